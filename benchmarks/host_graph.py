"""The host's part of building one fixed-shape decode step as a GPU backend builds it, on any machine.

    python -m benchmarks.host_graph [--steps 200] [--out DIR]

On a GPU host a decode step waits on its encoding (benchmarks/results/2026-12-06-0845-host-encode.md):
dsv4's graph (the Python of FixedDecoder.__call__ and the compiled step's replay), then MLX's
encoding of every primitive. The first part does not need the GPU: under benchmarks/gpu_path.py's
stand-ins (dispatchers see a CUDA backend, each custom kernel one node) the toy-width slice's
step is built here as it is there, and this times, per step (median ms of `--steps`): the whole
`dec(token)` call, its `flags.snapshot()` (the traced graph's key) and the compiled call alone.
Each step is evaluated before the next (the stand-ins' zeros), so no graph grows.
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


def timings(model, steps: int, context: int = 64) -> dict:
    """{"median": ..., "min": ...} ms a step of: the decoder's call, the switch snapshot, the
    compiled call alone (the minimums: what no pause of the machine's can raise)."""
    from benchmarks.gpu_path import as_gpu_backend
    from dsv4 import flags
    from dsv4.step import FixedDecoder

    ids = np.random.default_rng(0).integers(7, min(500, model.args.vocab_size), (1, context))
    call, snap, replay = [], [], []
    with as_gpu_backend(rope=True), flags.override(fixed_decode="on", dequant_matmul="off"):
        cache = model.make_cache()
        mx.eval(model(mx.array(ids), cache))
        dec = FixedDecoder(model, cache)
        y = mx.array([5])
        for i in range(steps + 10):   # the first 10: traces and the stand-ins' zeros
            t0 = time.perf_counter()
            logits = dec(y)
            t1 = time.perf_counter()
            flags.snapshot()
            t2 = time.perf_counter()
            fn, token = dec._function(), y.reshape(1, 1)
            pos, engram = mx.array([dec.pos], mx.int32), dec._engram_rows(token)
            t3 = time.perf_counter()
            fn(token, pos, engram, dec.buffers)
            t4 = time.perf_counter()
            y = mx.argmax(logits, axis=-1)
            mx.eval(y, dec.buffers)
            if i >= 10:
                call.append(t1 - t0), snap.append(t2 - t1), replay.append(t4 - t3)
        dec.close(cache.offset)
    parts = {"call": call, "snapshot": snap, "compiled call": replay}
    return {"median": {k: 1e3 * statistics.median(v) for k, v in parts.items()},
            "min": {k: 1e3 * min(v) for k, v in parts.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated
    from benchmarks.slice_decode import ROLES, SMALL, build

    model, _, _ = build({**SMALL, **ROLES})
    data = timings(model, a.steps)
    t = data["median"]
    when = datetime.now()
    lines = ["# The host's graph of one fixed-shape decode step (GPU path, stand-ins)", "",
             f"{when:%Y-%m-%d %H:%M}; the toy-width slice, context 64, median of {a.steps} steps (ms).", "",
             "| decoder call | a switch snapshot (one in each call) | the compiled call alone (in each call) |",
             "|---|---|---|",
             f"| {t['call']:.3f} | {t['snapshot']:.3f} | {t['compiled call']:.3f} |", "", to_markdown(describe())]
    write_dated(a.out, when, "host-graph", lines, data=data, shown=7)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
