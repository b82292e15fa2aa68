"""`python -m dsv4_convert` / `dsv4-convert`: official | gguf | exl3 -> a dsv4 model directory.

The gguf and exl3 converters live in their own modules (`gguf.py` `gguf_command`, `exl3.py`
`exl3_command`, plain typer command functions) and are imported only when their subcommand
runs, so one converter's dependencies never slow down or break another. Every command runs
inside `dsv4.errors.reported()`: bad input is one `error: ...` line and exit status 2.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Optional

import typer

from dsv4.errors import reported

from .writer import ConversionError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Convert a DeepSeek V4.1 Flash checkpoint into a dsv4 model directory.")


@app.command()
def official(
    src: str = typer.Argument(..., help="official checkpoint directory or Hugging Face repo id"),
    dst: Path = typer.Argument(..., help="dsv4 model directory to create"),
    revision: Optional[str] = typer.Option(None, help="branch, tag or commit of a repo id"),
    experts_bits: Optional[int] = typer.Option(
        None, help="requantize the routed experts to MLX affine 2/3/4/8 bits "
                   "(default: keep mxfp4)"),
    experts_group_size: int = typer.Option(64, help="group size of the experts' requantization"),
    dense_bits: Optional[int] = typer.Option(
        None, help="requantize the dense fp8 projections to affine 2/3/4/8 bits "
                   "(default: keep mxfp8)"),
    dense_group_size: int = typer.Option(64, help="group size of the dense requantization"),
    drop_mtp: bool = typer.Option(False, help="leave out the MTP (DSpark) tensors"),
    drop_vision: bool = typer.Option(False, help="leave out the vision tensors"),
    copy_engram: bool = typer.Option(
        False, help="write the Engram tables into DST (engram-LL.bin) instead of referencing them"),
    overwrite: bool = typer.Option(False, help="replace DST (and any unfinished conversion)"),
    resume: bool = typer.Option(False, help="continue an interrupted conversion into DST"),
    verify: bool = typer.Option(False, help="re-read sampled rows of every written tensor and "
                                            "compare them with the source"),
    shard_gb: float = typer.Option(5.0, help="largest weight file, in GB (1e9 bytes)"),
    quiet: bool = typer.Option(False, help="no progress bar"),
) -> None:
    """Convert the official FP8/FP4 checkpoint (lossless unless asked to requantize)."""
    from dsv4_convert.official import Requant, convert
    from dsv4.progress import format_bytes

    with reported():
        experts = Requant(experts_bits, experts_group_size) if experts_bits else None
        dense = Requant(dense_bits, dense_group_size) if dense_bits else None
        result = convert(src, dst, revision=revision, experts=experts, dense=dense,
                         drop_mtp=drop_mtp, drop_vision=drop_vision, copy_engram=copy_engram,
                         overwrite=overwrite, resume=resume, verify=verify,
                         max_shard_bytes=int(shard_gb * 1e9), progress=not quiet,
                         log=lambda line: typer.echo(line, err=True))
    checked = f", verified {result.verified_tensors} tensors" if verify else ""
    typer.echo(f"wrote {result.dst}: {result.shards} model weight file(s), "
               f"{format_bytes(result.bytes_written)} of weights{checked}")


def _delegate(module: str, function: str, ctx: typer.Context) -> None:
    """Run `dsv4_convert.<module>.<function>` as a typer command on the remaining arguments."""
    with reported():
        try:
            loaded = importlib.import_module(f"dsv4_convert.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"dsv4_convert.{module}":
                raise
            raise ConversionError(f"the {module} converter is not available yet "
                                  f"(convert/{module}.py is missing)") from None
        command = getattr(loaded, function, None)
        if command is None:
            raise ConversionError(f"convert/{module}.py has no function {function}")
    sub = typer.Typer(add_completion=False)
    sub.command()(command)
    typer.main.get_command(sub).main(ctx.args, prog_name=f"{ctx.find_root().info_name} {module}")


_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True,
                 "help_option_names": []}


@app.command(context_settings=_PASS_THROUGH, add_help_option=False)
def gguf(ctx: typer.Context) -> None:
    """Convert a ds4 GGUF (Q2/Q4) checkpoint (arguments: see `gguf --help`)."""
    _delegate("gguf", "gguf_command", ctx)


@app.command(context_settings=_PASS_THROUGH, add_help_option=False)
def exl3(ctx: typer.Context) -> None:
    """Convert an EXL3 checkpoint (arguments: see `exl3 --help`)."""
    _delegate("exl3", "exl3_command", ctx)


def main() -> None:
    app(prog_name="dsv4-convert")


if __name__ == "__main__":
    sys.exit(main())
