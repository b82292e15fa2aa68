"""The fast path against the plain reference path, where the two must agree (issue 27's checks).

    python -m benchmarks.exactness [--contexts 512] [--steps 32] [--small] [--no-demo]

1. **Real widths** (the shape-true slice of benchmarks/slice_decode.py, cast to float32, the
   fp8/fp4 roundings off): each context is prefilled with random tokens, then `--steps` random
   tokens are teacher-forced, once through the fast path (generation.prefill and
   decode_tokens with every switch at its default: kernels, the fixed-shape decoder,
   compile, run-ahead) and once through the reference path (every `kernel_*` off, the
   fixed-shape decoder off, one position per forward). Reported: the largest |fast - reference|
   logit over the largest |reference| logit, for the prefill's last position and over the
   decode steps. In float32 the two differ by summation order only; target < 1e-5.
2. **The demo checkpoint** (dsv4/demo/, its own dtype, the roundings on as the model ships):
   the mean next-token cross-entropy of HELD_OUT_TEXT through the reference path (one
   forward, kernels off), through the fast prefill (kernels on) and through the fast decode
   (the first token prefilled, the rest teacher-forced one step at a time). Target: each within
   0.2% of the reference.

On a machine without a GPU every kernel dispatcher takes its plain-MLX reference, so this
checks the fixed-shape decoder and its run-ahead only; the H200 run is the real check. There
it runs with MLX_ENABLE_TF32=0 (it starts itself again with the variable set where it is not):
otherwise MLX's fp32 matmuls round their inputs to TF32, in the reference path too (2.5e-4 /
1.4e-3 with it, 5e-6 / 2e-6 without, at 512).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

# Written for the demo's checks: not in its training corpus (CPython's pydoc topics).
HELD_OUT_TEXT = (
    "A list is a mutable sequence of objects. You can add an item to the end of a list "
    "with the append method, and remove the last item again with the pop method. When a "
    "function is called, the arguments are evaluated from left to right and bound to the "
    "names of its parameters, and the value of the return statement is the result of the call.")


def mean_cross_entropy(logits, targets) -> float:
    """Mean next-token cross-entropy (nats) of logits [S, V] against targets [S], in float64."""
    logits = np.array(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
    return float(np.mean(log_z - logits[np.arange(len(targets)), targets]))


def reference_switches() -> dict:
    """The plain reference path: every custom kernel and the fixed-shape decoder off."""
    from dsv4 import flags

    return {"fixed_decode": "off", **{n: False for n in flags.FLAGS if n.startswith("kernel_")}}


def fast_logits(model, prompt: np.ndarray, forced: np.ndarray) -> mx.array:
    """[len(forced), V]: the prompt's last logits, then those after each forced token but the
    last, the tokens fed through decode_tokens (the decoder and run-ahead the switches pick)."""
    from dsv4.generation import decode_tokens, prefill

    cache = model.make_cache()
    seen = [prefill(model, prompt, cache)[0]]
    feed = iter(forced[1:].tolist())

    def sampler(logits):
        seen.append(logits[0])
        return mx.array([next(feed)])

    for _ in decode_tokens(model, cache, mx.array(forced[:1]), sampler, len(forced)):
        pass
    return mx.stack(seen)


def reference_logits(model, prompt: np.ndarray, forced: np.ndarray) -> mx.array:
    """The same positions, one forward per position after the prompt's."""
    cache = model.make_cache()
    seen = [model(prompt, cache)[0, -1]]
    for token in forced[:-1]:
        seen.append(model(np.array([[token]]), cache)[0, -1])
        mx.eval(seen[-1])
    return mx.stack(seen)


def relative_error(got: mx.array, want: mx.array) -> float:
    got, want = np.array(got, np.float64), np.array(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def real_width_rows(model, contexts: list[int], steps: int) -> tuple[list[str], dict]:
    from dsv4 import flags

    rows, data = [], {}
    for context in contexts:
        rng = np.random.default_rng(context)
        prompt = rng.integers(7, model.args.vocab_size, (1, context))
        forced = rng.integers(7, model.args.vocab_size, steps + 1)
        with flags.override(kv_qdq=False, act_quant=False):
            t = time.perf_counter()
            fast = fast_logits(model, prompt, forced)
            mx.eval(fast)
            with flags.override(**reference_switches()):
                ref = reference_logits(model, prompt, forced)
                mx.eval(ref)
        prefill_err, decode_err = relative_error(fast[:1], ref[:1]), relative_error(fast[1:], ref[1:])
        same = int(np.sum(np.argmax(np.array(fast), -1) == np.argmax(np.array(ref), -1)))
        print(f"context {context}: prefill {prefill_err:.2e}, decode {decode_err:.2e}, "
              f"argmax equal {same}/{len(forced)} ({time.perf_counter() - t:.1f} s)", flush=True)
        rows.append(f"| {context} | {steps} | {prefill_err:.2e} | {decode_err:.2e} | {same}/{len(forced)} |")
        data[str(context)] = dict(prefill=prefill_err, decode=decode_err, argmax_equal=same)
    return rows, data


def demo_rows() -> tuple[list[str], dict]:
    import dsv4
    from dsv4 import flags

    model, tokenizer = dsv4.load()
    ids = np.array(tokenizer.encode(HELD_OUT_TEXT, add_special_tokens=True))
    targets = ids[1:]
    with flags.override(**reference_switches()):
        reference = mean_cross_entropy(model(ids[None, :-1])[0], targets)
    prefilled = mean_cross_entropy(model(ids[None, :-1])[0], targets)
    losses = {"reference path (one forward, kernels off)": reference,
              "fast prefill (one forward, kernels on)": prefilled,
              "fast decode (teacher-forced steps)": mean_cross_entropy(fast_logits(model, ids[None, :1], ids[1:]),
                                                                        targets)}
    rows = [f"| {name} | {loss:.6f} | {100 * (loss - reference) / reference:+.4f}% |" for name, loss in losses.items()]
    for row in rows:
        print(row, flush=True)
    return rows, dict(tokens=len(ids), losses=losses)


def exact_fp32_matmuls(argv: list) -> None:
    """Under CUDA, run again with MLX_ENABLE_TF32=0 unless it is set: MLX reads it once, and
    TF32 would round the reference path's fp32 matmuls too (a forgotten variable made a whole
    run's numbers 50-800x worse, 2026-12-07)."""
    from dsv4.kernels.dialect import backend

    if backend() == "cuda" and os.environ.get("MLX_ENABLE_TF32") != "0":
        print("exactness: running again with MLX_ENABLE_TF32=0 (exact fp32 matmuls)", flush=True)
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.exactness", *argv],
                  {**os.environ, "MLX_ENABLE_TF32": "0"})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="512")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--small", action="store_true", help="toy widths (CPU)")
    p.add_argument("--no-demo", action="store_true", help="skip the demo checkpoint's loss")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    exact_fp32_matmuls(sys.argv[1:] if argv is None else argv)
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated
    from benchmarks.slice_decode import REAL, ROLES, SMALL, build

    model = build({**(SMALL if a.small else REAL), **ROLES})[0]
    model.set_dtype(mx.float32)
    rows, data = real_width_rows(model, [int(c) for c in a.contexts.split(",")], a.steps)
    del model
    when = datetime.now()
    lines = [f"# The fast path against the reference path ({'toy-width' if a.small else 'shape-true'} slice, demo)", "",
             f"{when:%Y-%m-%d %H:%M}; `python -m benchmarks.exactness` (see its help for what each path is).", "",
             "Slice in float32, roundings off: max |fast - reference| / max |reference| logit.", "",
             "| context | decode steps | prefill's last logits | decode steps' logits | argmax equal |",
             "|---|---|---|---|---|", *rows]
    if not a.no_demo:
        demo, data["demo"] = demo_rows()
        lines += ["", "Demo checkpoint, roundings on: held-out cross-entropy (nats/token).", "",
                  "| path | loss | vs reference |", "|---|---|---|", *demo]
    shown = len(lines)
    lines += ["", to_markdown(describe())]
    write_dated(a.out, when, f"exactness{'-small' if a.small else ''}", lines, data=data, shown=shown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
