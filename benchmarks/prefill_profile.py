"""Where a prefill's time goes on the shape-true V4.1 slice: wall time per piece of a layer.

    python -m benchmarks.prefill_profile [--context 4096] [--chunk 512] [--small] [--kernels]

The slice and its random weights are benchmarks/slice_decode.py's. One prefill of `--context`
random tokens in chunks of `--chunk` is timed whole (no instrumentation, after a warm-up), then
once more with the pieces below instrumented: each instrumented call evaluates its inputs and
its outputs with a device synchronisation around it, and is charged its own time less the
instrumented calls inside it (exclusive time). What no instrumented call covers (embedding,
the head, graph building between pieces) is "other". The synchronisations serialize what MLX
would otherwise overlap, so the instrumented total is larger than the plain prefill: use the
shares for where the time goes, and the plain time for how much there is.

`--kernels` (CUDA, needs Nsight Compute's `ncu`): first re-runs itself under ncu around one
plain prefill (after a warm-up one) and lists every kernel family with its launches, GPU time
and DRAM bytes read: where the GPU's time goes, with no synchronisations added
(benchmarks/step_profile.py's table).
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.slice_decode import REAL, ROLES, SMALL, build  # noqa: E402


def arrays(value) -> list:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in arrays(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in arrays(v)]
    return []


class Timer:
    """Exclusive wall time per label of the instrumented callables."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.inner = [0.0]   # time of instrumented calls inside the current one, per depth
        self.on = False
        self.undo = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            mx.eval(arrays(args) + arrays(kwargs))
            mx.synchronize()
            self.inner.append(0.0)
            start = time.perf_counter()
            out = original(*args, **kwargs)
            mx.eval(arrays(out))
            mx.synchronize()
            total = time.perf_counter() - start
            inside = self.inner.pop()
            self.inner[-1] += total
            self.seconds[label] = self.seconds.get(label, 0.0) + total - inside
            self.calls[label] = self.calls.get(label, 0) + 1
            return out

        setattr(owner, name, timed)
        self.undo.append((owner, name, original))


def instrument(timer: Timer) -> None:
    from dsv4 import attention, model, moe

    for owner, name, label in [
        (model, "hc_mixes_collapse_norm", "mHC mixes + collapse + norm"),
        (model, "hc_expand", "mHC expand"),
        (attention, "fp8_linears", "wq_a + wkv"),
        (attention, "fp8_linear", "wo_b"),
        (attention.Attention, "_grouped_wo_a", "wo_a (grouped)"),
        (attention.Attention, "queries", "q norm + wq_b + rope"),
        (attention.Attention, "window_rows", "kv norm + rope"),
        (attention.Attention, "output", "inverse rope"),
        (attention, "sparse_attention", "sparse attention"),
        (attention.ForwardState, "window", "window append"),
        (attention.ForwardState, "compress", "compressor"),
        (attention.Indexer, "__call__", "indexer"),
        (attention, "indexer_scores", "indexer scores"),
        (attention, "topk_visible", "indexer top-k"),
        (moe.Router, "__call__", "router"),
        (moe.SharedExpert, "__call__", "shared expert"),
        (moe.RoutedExperts, "__call__", "routed experts"),
        (moe.MoE, "__call__", "MoE (rest)"),
    ]:
        timer.wrap(owner, name, label)


def prefill_seconds(model, context: int, chunk: int) -> float:
    from dsv4.generation import prefill

    ids = np.random.default_rng(context).integers(7, model.args.vocab_size, (1, context))
    cache = model.make_cache()
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(prefill(model, ids, cache, chunk=chunk))
    mx.synchronize()
    return time.perf_counter() - start


def profiled_prefill(model, context: int, chunk: int) -> None:
    """One plain prefill between cuProfilerStart/Stop (what `ncu --profile-from-start off`
    records), after a warm-up one."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    prefill_seconds(model, context, chunk)
    cuda.cuProfilerStart()
    prefill_seconds(model, context, chunk)
    cuda.cuProfilerStop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512, help="tokens per prefill chunk")
    p.add_argument("--small", action="store_true", help="toy widths (CPU)")
    p.add_argument("--kernels", action="store_true", help="also profile one prefill's kernels under ncu")
    p.add_argument("--profiled-prefill", action="store_true", help=argparse.SUPPRESS)   # the run under ncu
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated
    from benchmarks.step_profile import ncu_table

    # The ncu run first, with the GPU's memory to itself.
    shape = ["--context", str(a.context), "--chunk", str(a.chunk)] + (["--small"] if a.small else [])
    kernel_lines = (ncu_table(["benchmarks.prefill_profile", "--profiled-prefill", *shape],
                              f"one prefill of {a.context} tokens in chunks of {a.chunk}")
                    if a.kernels and not a.profiled_prefill else [])
    model, _, _ = build({**(SMALL if a.small else REAL), **ROLES})
    if a.profiled_prefill:
        profiled_prefill(model, a.context, a.chunk)
        return 0
    timer = Timer()
    instrument(timer)
    # at the full context: a shorter warm-up leaves the chunk's own shapes to build in "plain"
    print(f"warm-up: {prefill_seconds(model, a.context, a.chunk):.1f} s", flush=True)
    plain = prefill_seconds(model, a.context, a.chunk)
    print(f"plain: {plain:.3f} s, {a.context / plain:.0f} tokens/s", flush=True)
    timer.on = True
    timer.inner = [0.0]
    profiled = prefill_seconds(model, a.context, a.chunk)
    timer.on = False
    covered = sum(timer.seconds.values())
    timer.seconds["other"] = profiled - covered
    timer.calls["other"] = 0
    rows = [f"| {label} | {timer.calls[label]} | {1e3 * s:.1f} | {100 * s / profiled:.1f}% |"
            for label, s in sorted(timer.seconds.items(), key=lambda kv: -kv[1])]
    when = datetime.now()
    lines = [f"# Prefill profile on the {'toy-width' if a.small else 'shape-true'} V4.1 slice", "",
             f"{when:%Y-%m-%d %H:%M}; {model.args.num_hidden_layers} layers (roles {ROLES['compress_ratios']}), "
             f"experts mxfp4, dense mxfp8; {a.context} tokens in chunks of {a.chunk}.", "",
             f"Plain prefill: {plain:.3f} s ({a.context / plain:.0f} tokens/s). Instrumented: "
             f"{profiled:.3f} s, split below (exclusive time; see the script's help).", "",
             "| piece | calls | ms | share |", "|---|---|---|---|", *rows, *kernel_lines, "",
             to_markdown(describe())]
    write_dated(a.out, when, f"prefill-profile-{a.context}-c{a.chunk}{'-small' if a.small else ''}", lines,
                data=dict(plain=plain, profiled=profiled, seconds=timer.seconds, calls=timer.calls),
                shown=8 + len(rows) + len(kernel_lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
