"""EXL3 pack (exllamav3) of DeepSeek V4.1 Flash -> dsv4 model directory.

    python -m dsv4_convert exl3 SRC DST [--bits B] [--group-size G] [--workers N]

Published packs code only some Linears with EXL3 (usually the routed experts) and keep every
other tensor in the official format. The official tensors go through the official packing
(`dsv4.layout`), unchanged. Each EXL3 Linear is decoded (`exl3_decode`, trellis -> float32
weight) and trimmed of exllamav3's 128-padding; routed experts are requantised to MLX affine
at a width chosen from their K (`--bits` overrides), any other EXL3 Linear is kept as bf16.
The error this adds is measured per module, printed and recorded in the output config. Experts of one layer and projection are stacked [E, out, in]
as dsv4 stores them; they are decoded in parallel worker processes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Annotated, Optional

import mlx.core as mx
import numpy as np
import typer

from dsv4 import layout
from dsv4.config import ModelArgs
from dsv4.errors import reported
from dsv4.safetensors_file import Checkpoint, CheckpointError, TensorInfo, view

from . import exl3_pack, official
from .exl3_decode import linear_weight
from .exl3_pack import Exl3Linear
from .writer import MAX_SHARD_BYTES, ConversionError, ModelDirWriter, Unit

# Affine width per K: about two bits above the trellis, so the requantisation adds a few
# percent to EXL3's own error (relative RMS ~0.38 at K=2, ~0.17 at K=3, ~0.09 at K=4).
BITS_FOR_K = {1: 3, 2: 4, 3: 5, 4: 6, 5: 8, 6: 8, 7: 8, 8: 8}
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
_EXPERT_MODULE = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])$")
ERROR_KEY = official.ERROR_KEY  # shard metadata: "<err2>,<ref2>" per requantised module


@dataclass(frozen=True)
class Target:
    """One dsv4 module made from EXL3 Linears: a stack of experts, or a single Linear."""
    name: str
    linears: tuple[Exl3Linear, ...]
    out: int
    inp: int
    stacked: bool

    @property
    def k_bits(self) -> int:
        return max(lin.k_bits for lin in self.linears)


# -- reading the pack ----------------------------------------------------------------------------

def read_config(src: Path) -> dict:
    return restore_virtual_heads(official.read_config(src), src / "config.json")


def restore_virtual_heads(config: dict, path: Path) -> dict:
    """Undo the TP3 'virtual heads' rewrite (72 heads / 9 o_groups declared over unchanged
    64 / 8 weights, real counts in `virtual_heads_from`): dsv4 needs the real geometry."""
    config = json.loads(json.dumps(config))
    for block in (config, config.get("text_config")):
        if not isinstance(block, dict) or "virtual_heads_from" not in block:
            continue
        real = block.pop("virtual_heads_from")
        if not isinstance(real, dict) or not {"num_attention_heads", "o_groups"} <= set(real):
            raise ConversionError(f"{path}: virtual_heads_from is {real!r}, expected "
                                  f"{{'num_attention_heads': H, 'o_groups': G}}")
        block["num_attention_heads"] = int(real["num_attention_heads"])
        block["o_groups"] = int(real["o_groups"])
    return config


def is_exl3_pack(config: dict, ckpt: Checkpoint) -> bool:
    method = (config.get("quantization_config") or {}).get("quant_method")
    return method == "exl3" or any(name.endswith(".trellis") for name in ckpt.names())


class _OfficialView:
    """The pack as `dsv4.layout` expects an official checkpoint: EXL3 parts hidden, and each
    official tensor an EXL3 Linear replaces stood in by a header-only placeholder of the
    official dtype and shape. Placeholders are never read: their plan items are replaced."""

    def __init__(self, ckpt: Checkpoint, stand_ins: dict[str, tuple[str, tuple[int, ...]]],
                 hidden: set[str]):
        self.directory = ckpt.directory
        self.tensors = {n: i for n, i in ckpt.tensors.items() if n not in hidden}
        for name, (dtype, shape) in stand_ins.items():
            self.tensors[name] = TensorInfo(name, dtype, shape, Path("<exl3 stand-in>"), 0, 0)

    def __contains__(self, name):
        return name in self.tensors

    def __getitem__(self, name):
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: tensor {name} is missing") from None

    def names(self):
        return self.tensors.keys()


def plan_pack(ckpt: Checkpoint, args: ModelArgs,
              linears: dict[str, Exl3Linear]) -> tuple[list[layout.Item], list[Target]]:
    """Official items for the official tensors, and the EXL3 targets; refuses a pack with
    missing tensors (listing them), wrong shapes, or EXL3 Linears dsv4 has no place for."""
    expected = layout.expected_tensors(args)
    stand_ins, hidden = {}, set()
    singles, experts = [], {}
    for module, lin in linears.items():
        if layout.is_unused(f"{module}.weight"):  # e.g. MTP experts: copied verbatim
            continue
        weight = expected.get(f"{module}.weight")
        shape = weight and exl3_pack.linear_shape(*weight)
        if shape is None:
            raise ConversionError(
                f"{lin.trellis.file.name}: {module} is EXL3 but dsv4 has no Linear of that name "
                f"(expected e.g. layers.N.ffn.experts.E.w1; split layouts such as wo_a.slice.G "
                f"are not supported)")
        exl3_pack.check_fits(lin, *shape)
        stand_ins[f"{module}.weight"] = weight
        if f"{module}.scale" in expected:
            stand_ins[f"{module}.scale"] = expected[f"{module}.scale"]
        hidden.update(f"{module}.{part}" for part in exl3_pack.EXL3_PARTS)
        m = _EXPERT_MODULE.match(module)
        if m:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = lin
        else:
            singles.append(Target(module, (lin,), *shape, stacked=False))
    _check_no_placeholder_clash(ckpt, stand_ins)
    view = _OfficialView(ckpt, stand_ins, hidden)
    try:
        layout.check(view, args)
    except CheckpointError as e:
        raise ConversionError(f"{e}\n(this is an EXL3 pack: a tensor listed as missing is neither "
                              f"in the official format nor EXL3-coded; some published packs "
                              f"lack all non-expert tensors and cannot be converted)") from None
    targets = list(singles)
    for name, by_index in sorted(experts.items()):
        if len(by_index) != args.n_routed_experts:
            others = sorted(set(range(args.n_routed_experts)) - set(by_index))
            raise ConversionError(f"{name}: experts {sorted(by_index)[:8]}... are EXL3 but "
                                  f"{others[:8]}... are not; a mixed stack is not supported")
        first = by_index[0].module
        out, inp = exl3_pack.linear_shape(*expected[f"{first}.weight"])
        targets.append(Target(name, tuple(by_index[e] for e in sorted(by_index)), out, inp, True))
    # plan items are named by module (fp8, experts) or by tensor (BF16 Linears such as head)
    replaced = {t.name for t in targets} | {f"{t.name}.weight" for t in targets}
    items = [it for it in layout.plan(view, args) if it.name not in replaced]
    return items, targets


def _check_no_placeholder_clash(ckpt: Checkpoint, stand_ins: dict) -> None:
    both = sorted(n for n in stand_ins if n in ckpt)
    if both:
        raise ConversionError(f"{ckpt.directory}: {both[0]} is present both as an official "
                              f"tensor and as EXL3 ({len(both)} such tensors)")


# -- decoding and requantising --------------------------------------------------------------------

def choose_bits(k_bits: int, override: Optional[int]) -> int:
    return override if override is not None else BITS_FOR_K[k_bits]


def decode_requantize(lin: Exl3Linear, out: int, inp: int, bits: Optional[int], group_size: int):
    """One EXL3 Linear -> MLX affine (weight uint32, scales/biases bf16 bits), or bf16 weight
    bits when `bits` is None, + the squared error this adds and the squared norm of the
    decoded weight."""
    weight = linear_weight(np.asarray(view(lin.trellis)), exl3_pack.scales(lin.input_scales),
                           exl3_pack.scales(lin.output_scales), lin.codebook)[:out, :inp]
    if bits is None:
        parts = (weight.astype(mx.bfloat16),)
        back = parts[0].astype(mx.float32)
    else:
        parts = mx.quantize(weight.astype(mx.bfloat16), group_size=group_size, bits=bits)
        # the stored bf16 scales taken exactly (fp32), as the official converter measures
        back = mx.dequantize(parts[0], parts[1].astype(mx.float32), parts[2].astype(mx.float32),
                             group_size=group_size, bits=bits)
    err2, ref2 = mx.sum(mx.square(back - weight)), mx.sum(mx.square(weight))
    mx.eval(*parts, err2, ref2)
    return (*(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in parts),
            float(err2), float(ref2))


def _decode_job(job):
    return decode_requantize(*job)


class Decoder:
    """Makes writer units of EXL3 targets, decoded in worker processes when `workers` > 1.
    Each unit records its squared error and norm in its shard's metadata (so a resumed
    conversion still reports every module)."""

    def __init__(self, bits: Optional[int], group_size: int, workers: int, progress: bool = True):
        self.bits_override, self.group_size = bits, group_size
        self.workers, self.progress = workers, progress
        self._pool = None

    def __enter__(self):
        if self.workers > 1:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=get_context("spawn"))
        return self

    def __exit__(self, *exc):
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def bits(self, target: Target) -> Optional[int]:
        """Affine width of a stack of experts; None (bf16) for a single Linear, which dsv4
        may use unquantized (the head is one) and which is small next to the experts."""
        return choose_bits(target.k_bits, self.bits_override) if target.stacked else None

    def quantization(self, target: Target) -> Optional[dict]:
        bits = self.bits(target)
        return bits and {"group_size": self.group_size, "bits": bits, "mode": "affine"}

    def unit(self, target: Target) -> Unit:
        bits = self.bits(target)
        rows = len(target.linears) * target.out
        if bits is None:
            nbytes = 2 * rows * target.inp
        else:
            nbytes = rows * target.inp * bits // 8 + 2 * 2 * rows * (target.inp // self.group_size)
        stats = {}

        def produce():
            tensors, stats["value"] = self.produce(target)
            return tensors

        return Unit(target.name, nbytes, produce,
                    lambda: {ERROR_KEY + target.name: stats["value"]})

    def produce(self, target: Target):
        jobs = [(lin, target.out, target.inp, self.bits(target), self.group_size)
                for lin in target.linears]
        parts, err2, ref2, shown = None, 0.0, 0.0, 0.0
        results = self._pool.map(_decode_job, jobs) if self._pool else map(_decode_job, jobs)
        for i, (*arrays, e2, r2) in enumerate(results):
            if parts is None:  # one output array per part, filled as experts arrive
                parts = [np.empty((len(jobs), *a.shape), a.dtype) for a in arrays]
            for part, a in zip(parts, arrays):
                part[i] = a
            err2, ref2 = err2 + e2, ref2 + r2
            if self.progress and time.monotonic() - shown > 0.5:  # a stack takes minutes
                shown = time.monotonic()
                print(f"\rdecoding {target.name}: {i + 1}/{len(jobs)} ", end="",
                      file=sys.stderr, flush=True)
        if not target.stacked:
            parts = [p[0] for p in parts]
        if len(parts) == 1:
            tensors = {f"{target.name}.weight": ("BF16", parts[0])}
        else:
            tensors = {f"{target.name}.weight": ("U32", parts[0]),
                       f"{target.name}.scales": ("BF16", parts[1]),
                       f"{target.name}.biases": ("BF16", parts[2])}
        return tensors, f"{err2!r},{ref2!r}"


def module_errors(metadata: dict[str, str]) -> dict[str, float]:
    """Relative RMS error added to each requantised module, from the shards' metadata."""
    out = {}
    for key, value in metadata.items():
        if key.startswith(ERROR_KEY):
            err2, ref2 = (float(v) for v in value.split(","))
            out[key[len(ERROR_KEY):]] = (err2 / ref2) ** 0.5 if ref2 > 0 else 0.0
    return dict(sorted(out.items()))


# -- the conversion -------------------------------------------------------------------------------

@dataclass
class Result:
    dst: Path
    bytes_written: int
    errors: dict[str, float]        # requantised module -> relative RMS error added
    errors_by_kind: dict[str, float]
    verified_tensors: int


def convert(src: Path | str, dst: Path | str, *, revision: Optional[str] = None,
            bits: Optional[int] = None, group_size: int = 64, workers: Optional[int] = None,
            overwrite: bool = False, resume: bool = False, verify: bool = False,
            max_shard_bytes: int = MAX_SHARD_BYTES, progress: bool = True, log=print) -> Result:
    """Convert the EXL3 pack at `src` (directory or HF repo id) into the dsv4 directory `dst`.
    Every input check runs before anything is written."""
    if bits is not None and bits not in AFFINE_BITS:
        raise ConversionError(f"--bits {bits}: MLX affine widths are {AFFINE_BITS}")
    if group_size not in GROUP_SIZES:
        raise ConversionError(f"--group-size {group_size}: expected one of {GROUP_SIZES}")
    source = official.resolve_source(str(src), revision)
    config = read_config(source.path)
    ckpt = Checkpoint(source.path)
    if not is_exl3_pack(config, ckpt):
        raise ConversionError(f"{source.path}: not an EXL3 pack (no .trellis tensors, "
                              f"quant_method {(config.get('quantization_config') or {}).get('quant_method')!r}); "
                              f"use `dsv4_convert official`")
    if (source.path / "permute_g8_manifest.json").is_file():
        raise ConversionError(f"{source.path}: a PF-G8 pack (permute_g8_manifest.json: trellis "
                              f"reindexed group-major for one vLLM kernel) is not supported; "
                              f"use the stock-layout pack")
    args = ModelArgs.from_dict(config, source=str(source.path / "config.json"))
    linears = exl3_pack.scan(ckpt)
    items, targets = plan_pack(ckpt, args, linears)
    for target in targets:
        if target.inp % group_size:
            raise ConversionError(f"{target.name}: input size {target.inp} is not a multiple of "
                                  f"--group-size {group_size}")
    engram = layout.engram_table_refs(ckpt, args)
    workers = workers if workers is not None else min(4, os.cpu_count() or 1)
    fingerprint = {
        "source": str(source.path), "kind": "exl3",
        "source_files": {p.name: p.stat().st_size for p in sorted(source.path.glob("*.safetensors"))},
        "options": {"bits": bits, "group_size": group_size},
    }
    with Decoder(bits, group_size, workers, progress) as decoder:
        lossless = [official.lossless_unit(it) for it in items]
        side = {name: units for name, pattern in (("mtp", official.MTP), ("vision", official.VISION))
                if (units := official.side_units(ckpt, pattern))}
        model = sorted(lossless + [decoder.unit(t) for t in targets], key=lambda u: u.key)
        modules = {it.name: dict(it.quantization) for it in items if it.quantization}
        modules.update({t.name: decoder.quantization(t) for t in targets if t.stacked})
        verified = 0
        with ModelDirWriter(dst, fingerprint, overwrite=overwrite, resume=resume,
                            max_shard_bytes=max_shard_bytes, progress=progress,
                            sources=official.source_paths(source)) as out:
            shards = out.write_weights({"model": model, **side})
            metadata = out.metadata("model")
            errors, by_kind = module_errors(metadata), official.requant_errors(metadata)
            if verify:  # the official tensors; EXL3 modules would be decoded a second time
                verified = out.verify({"model": lossless, **side})
            out.write_json("config.json", output_config(config, source, modules, engram, targets,
                                                        decoder, errors, by_kind))
            for pattern in official.TOKENIZER_FILES:
                for path in sorted(source.path.glob(pattern)):
                    out.copy_file(path)
            written = sum(s.nbytes for s in shards)
    for (k, stacked), (mean, worst, count) in errors_by_k(errors, targets).items():
        into = f"affine {choose_bits(k, bits)}-bit/{group_size}" if stacked else "bf16"
        log(f"EXL3 K={k} -> {into}: added relative RMS error mean {mean:.4f}, max {worst:.4f} "
            f"over {count} modules")
    return Result(Path(dst), written, errors, by_kind, verified)


def output_config(config, source, modules, engram, targets, decoder, errors, by_kind) -> dict:
    """The official converter's config, marked as made from EXL3, with what the requantisation
    cost recorded under `dsv4.requantization.exl3`."""
    ks = sorted({lin.k_bits for t in targets for lin in t.linears})
    requant = {"exl3": {
        "bits_for_K": {str(k): choose_bits(k, decoder.bits_override) for k in ks},
        "single_linears": "bf16",
        "group_size": decoder.group_size,
        "codebooks": sorted({lin.codebook for t in targets for lin in t.linears}),
        "relative_error": by_kind, "relative_error_by_module": errors}}
    out = official.output_config(config, source, official.quantization_block(modules), engram,
                                 requant, drop_vision=False)
    out["dsv4"]["source"].update(kind="exl3",
                                 quantization_config=config.get("quantization_config"))
    return out


def errors_by_k(errors: dict[str, float], targets: list[Target]) -> dict[tuple, tuple]:
    """(K, stacked) -> (mean, max, count) of the added relative errors."""
    by_k: dict[tuple, list[float]] = {}
    for target in targets:
        if target.name in errors:
            by_k.setdefault((target.k_bits, target.stacked), []).append(errors[target.name])
    return {k: (float(np.mean(v)), float(np.max(v)), len(v)) for k, v in sorted(by_k.items())}


def exl3_command(
    src: Annotated[str, typer.Argument(help="EXL3 pack directory or Hugging Face repo id")],
    dst: Annotated[Path, typer.Argument(help="dsv4 model directory to create")],
    revision: Annotated[Optional[str], typer.Option(help="branch, tag or commit of a repo id")] = None,
    bits: Annotated[Optional[int], typer.Option(
        help="affine width of the routed experts, 2/3/4/5/6/8 (default from each stack's K: "
             "K1->3, K2->4, K3->5, K4->6, K5+->8)")] = None,
    group_size: Annotated[int, typer.Option(help="values per affine scale: 32/64/128")] = 64,
    workers: Annotated[Optional[int], typer.Option(
        help="decoding processes (default min(4, cores))")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace DST (and any unfinished conversion)")] = False,
    resume: Annotated[bool, typer.Option(help="continue an interrupted conversion into DST")] = False,
    verify: Annotated[bool, typer.Option(help="re-read sampled rows of every official tensor "
                                              "written and compare them with the source")] = False,
    shard_gb: Annotated[float, typer.Option(help="largest weight file, in GB (1e9 bytes)")] = 5.0,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
) -> None:
    """Convert an EXL3 (exllamav3) pack: routed experts decoded and requantised to MLX affine
    (the added error is reported), other EXL3 Linears to bf16, official tensors as `official`."""
    with reported():
        result = convert(src, dst, revision=revision, bits=bits, group_size=group_size,
                         workers=workers, overwrite=overwrite, resume=resume, verify=verify,
                         max_shard_bytes=int(shard_gb * 1e9), progress=not quiet,
                         log=lambda line: print(line, file=sys.stderr))
    print(f"wrote {result.dst}: {result.bytes_written / 1e9:.2f} GB")
