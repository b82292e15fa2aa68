"""Count the MLX primitives of one decode step (the launches a GPU pays for).

    python -m benchmarks.graph_ops --model DIR [--prompt-tokens 64] [--report]

Prefills a prompt, then builds one decode step lazily and walks its graph
(`mx.export_to_dot`): each primitive node is one kernel launch on Metal/CUDA (a compiled
function counts as one), except the view-only ones (reshapes, broadcasts, slices: VIEWS),
which are counted and also reported apart. Quantized layers use MLX's quantized kernels here (as on a GPU),
whatever the device. Prints the total, per layer, and the most frequent primitives; with
--report writes a dated Markdown report to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

# Primitives that only re-describe memory (or order work) and launch nothing when their input
# is contiguous, as it is in a decode step: what is left is the work a GPU launches.
VIEWS = ("Reshape", "ExpandDims", "Squeeze", "Broadcast", "Unflatten", "Flatten", "Transpose",
         "Slice", "View", "Depends", "StopGradient")


def launches(counts: collections.Counter) -> collections.Counter:
    """The counts without the view-only primitives of VIEWS."""
    return collections.Counter({name: n for name, n in counts.items()
                                if not any(name == v or name.startswith(v + " ") for v in VIEWS)})

def table(counts: collections.Counter, layers: int, top: int, width: int | None = None) -> list[str]:
    """Markdown table of the `top` most frequent primitives, per step and per layer (names cut
    to `width` characters if given)."""
    return ["| primitive | count | per layer |", "|---|---|---|"] + [
        f"| {name[:width]} | {n} | {n / layers:.1f} |" for name, n in counts.most_common(top)]


def write_report(filename: str, heading: str, lines: list[str]) -> Path:
    """benchmarks/results/<filename>: the heading, the lines and the hardware."""
    from benchmarks.hardware import describe, to_markdown

    out = Path(__file__).parent / "results" / filename
    out.write_text(heading + "\n\n" + "\n".join(lines) + "\n\n" + to_markdown(describe()) + "\n")
    return out


def prompt_ids(model, prompt_tokens: int) -> np.ndarray:
    """The prompt count_graph decodes after, and the token it feeds: [1, prompt_tokens + 1]."""
    return np.random.default_rng(0).integers(7, min(500, model.args.vocab_size), (1, prompt_tokens + 1))


def prompt_cache(model, prompt_tokens: int):
    """The cache of count_graph's prompt, prefilled as the switches have it."""
    import mlx.core as mx

    cache = model.make_cache()
    mx.eval(model(prompt_ids(model, prompt_tokens)[:, :-1], cache))
    return cache


def count_graph(model, prompt_tokens: int, fixed: bool = False, cache=None) -> collections.Counter:
    """Primitive counts of one decode step after a prompt of `prompt_tokens`: the reference
    forward, or (`fixed`) the fixed-shape step of dsv4.step as the switches have it
    (compiled: fused element-wise runs count once; one graph, not DSV4_ENGRAM_PIECES' pieces,
    of which all but the last are queued before the step returns). The cache writes are counted
    too. `cache`: the prompt's (prompt_cache), made before under other switches if need be (a
    copy is decoded into); else it is prefilled here."""
    import mlx.core as mx

    from dsv4 import flags
    from dsv4.step import FixedDecoder

    ids = prompt_ids(model, prompt_tokens)
    cache = prompt_cache(model, prompt_tokens) if cache is None else cache.copy()
    if fixed:
        dec = FixedDecoder(model, cache)
        mx.eval(dec.buffers)
        with flags.override(engram_pieces=False):
            outputs = [dec(mx.array(ids[:, -1])), *dec.buffers.values()]
    else:
        outputs = [model(ids[:, -1:], cache)] + [a for lc in cache.layers for a in
                                                (lc.window, lc.compressed, lc.index_keys) if a is not None]
    return primitive_counts(outputs)


def primitive_counts(outputs) -> collections.Counter:
    """Primitive name -> count in the (unevaluated) graph of `outputs`."""
    import mlx.core as mx

    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        text = Path(f.name).read_text()
    return collections.Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle\]', text))


def count_step(model_dir: str | None, prompt_tokens: int, fixed: bool) -> tuple[collections.Counter, int]:
    import dsv4
    from dsv4 import flags

    model, _ = dsv4.load(model_dir)
    with flags.override(dequant_matmul="off"):
        return count_graph(model, prompt_tokens, fixed), model.args.num_hidden_layers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the bundled demo)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--report", action="store_true", help="write a dated report to benchmarks/results/")
    p.add_argument("--label", default="decode-step-primitives")
    p.add_argument("--path", choices=("fixed", "reference"), default="fixed",
                   help="the fixed-shape decode step (dsv4/step.py) or the reference forward")
    a = p.parse_args(argv)
    counts, layers = count_step(a.model, a.prompt_tokens, a.path == "fixed")
    total, work = sum(counts.values()), sum(launches(counts).values())
    lines = [f"primitives in one decode step: {total} ({total / layers:.1f} per layer, {layers} layers); "
             f"without the view-only ones: {work} ({work / layers:.1f} per layer)",
             "", *table(counts, layers, 25)]
    print("\n".join(lines))
    if a.report:
        when = datetime.now()
        out = write_report(f"{when:%Y-%m-%d-%H%M%S}-{a.label}.md",
                           f"# Primitives of one decode step\n\n{when:%Y-%m-%d %H:%M}; model "
                           f"`{a.model or 'demo'}`, prompt {a.prompt_tokens} tokens.", lines)
        print(f"report: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
