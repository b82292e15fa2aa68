"""Decode throughput of B sessions decoded together (the server's batch), without HTTP.

    python -m benchmarks.batch_decode [--model PATH | --slice [--small]] [--sessions 1,2,4,8] [--steps 32]

Each session is prefilled with a prompt of its own length (--context + 37 x i tokens, so the
sessions sit at different positions, as a server's do), then every step decodes one token for
each session through the server's engine (dsv4/serve/engine.py): one session alone takes the
decoder the switches pick (the fixed-shape compiled step on a GPU), several the batched
fixed-shape step on a GPU (dsv4.batch_step, one compiled graph for the batch) or one forward of
dsv4.batch_decode on the CPU (DSV4_BATCH_FIXED_DECODE=on|off picks either anywhere). Sizes are
measured in turn, forward then backward, --repeats times; the report gives median tokens/s
(B x steps / time) and ms per step, and how many greedy tokens of each session equal that
session's tokens decoded alone (all of them on the CPU, where batching is exact; on a GPU a
batched product may round differently from a single one). `--slice` builds the
shape-true 7-layer V4.1 slice of benchmarks/slice_decode.py (random weights, no Engram).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.hardware import describe, to_markdown  # noqa: E402


def sessions_of(engine, count: int, context: int) -> list:
    """(cache, first token) of `count` sessions prefilled with prompts of different lengths."""
    from dsv4.generation import PREFILL_CHUNK

    out = []
    for i in range(count):
        ids = np.random.default_rng(i).integers(7, engine.vocab_size, context + 37 * i).tolist()
        cache = engine.new_cache()
        for lo in range(0, len(ids), PREFILL_CHUNK):
            logits = engine.prefill(cache, ids[lo:lo + PREFILL_CHUNK])
        out.append((cache, int(mx.argmax(logits).item())))
    return out


def decode(engine, sessions: list, steps: int) -> tuple[float, list[list[int]]]:
    """Seconds for `steps` steps of every session together, and each session's greedy tokens."""
    caches = [cache for cache, _ in sessions]
    tokens = [[first] for _, first in sessions]
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        logits = engine.decode(caches, [t[-1] for t in tokens])
        picks = mx.argmax(logits, axis=-1).tolist()
        for session, pick in zip(tokens, picks):
            session.append(pick)
    elapsed = time.perf_counter() - start
    engine.settle()
    return elapsed, tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the bundled demo)")
    parser.add_argument("--slice", action="store_true", help="the shape-true V4.1 slice instead of a model")
    parser.add_argument("--small", action="store_true", help="the slice at toy widths")
    parser.add_argument("--sessions", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    options = parser.parse_args(argv)
    from dsv4.serve.engine import ModelEngine

    if options.slice:
        from benchmarks.slice_decode import REAL, ROLES, SMALL, build

        model, _, _ = build({**(SMALL if options.small else REAL), **ROLES})
        what = f"the V4.1 slice{' (toy widths)' if options.small else ''} (7 layers, random weights)"
    else:
        import dsv4

        model, _ = dsv4.load(options.model)
        what = options.model or "the bundled demo"
    engine = ModelEngine(model, None)
    from dsv4.batch_step import use_batch_fixed_decode

    batched = ("the batched fixed-shape step (dsv4.batch_step)" if use_batch_fixed_decode(model)
               else "one forward of the reference path (dsv4.batch_decode)")
    sizes = [int(s) for s in options.sessions.split(",")]
    alone = {}   # session index -> its tokens decoded alone
    for i in range(max(sizes)):
        alone[i] = decode(engine, sessions_of(engine, i + 1, options.context)[i:], options.steps)[1][0]
    decode(engine, sessions_of(engine, max(sizes), options.context), 4)   # warm-up of the batched path
    times: dict[int, list[float]] = {b: [] for b in sizes}
    agree: dict[int, list[float]] = {b: [] for b in sizes}
    for repeat in range(options.repeats):
        for b in (sizes if repeat % 2 == 0 else sizes[::-1]):
            elapsed, tokens = decode(engine, sessions_of(engine, b, options.context), options.steps)
            times[b].append(elapsed)
            agree[b].append(statistics.mean(np.mean(np.array(t) == np.array(alone[i])) for i, t in enumerate(tokens)))
            print(f"B={b}: {b * options.steps / elapsed:.1f} tok/s", file=sys.stderr, flush=True)
    one = options.steps / statistics.median(times[sizes[0]]) / sizes[0]
    stamp = datetime.now().strftime("%Y-%m-%d-%H%M")
    lines = [f"# Sessions decoded together: throughput by batch size ({stamp})", "", to_markdown(describe()), "",
             f"`python -m benchmarks.batch_decode {' '.join(argv or sys.argv[1:])}` on {what}: prompts of "
             f"{options.context} + 37 x i tokens, {options.steps} greedy steps, median of {options.repeats} "
             f"(sizes in turn, forward then backward). Sessions decoded together by {batched}.", "",
             "| sessions | tokens/s | x one session | ms per step | greedy tokens equal to alone |",
             "|---:|---:|---:|---:|---:|"]
    for b in sizes:
        elapsed = statistics.median(times[b])
        rate = b * options.steps / elapsed
        lines.append(f"| {b} | {rate:.1f} | {rate / one:.2f} | {elapsed / options.steps * 1e3:.2f} | "
                     f"{statistics.mean(agree[b]):.1%} |")
    options.out_dir.mkdir(parents=True, exist_ok=True)
    out = options.out_dir / f"{stamp}-batch-decode{'-slice' if options.slice else ''}.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
