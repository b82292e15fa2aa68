"""Sparse attention at decode: the 4-row kernels against the 8-row ones (DSV4_KERNEL_ATTENTION_ROWS8).

    python -m benchmarks.attention_decode --out benchmarks/results/DATE-attention-decode.md

V4.1's shape: 64 heads x 512 (bf16), a 128-row window plus 512 selected compressed rows, the
queries rotated and the output de-rotated inside (as the decode step calls it), for T = 1 and 4
queries (decode, speculative verify) at context 512 (every compressed row of a ratio-1 layer
selected, in order) and 8K (512 random rows of 8192). For each case:
- wall time per call, the variants interleaved (A B B A ...) in one process (kernels_bench's
  timer: a batch of calls, one eval): this includes the host's two launches (~20 µs each);
- GPU time per launch under ncu (when Nsight Compute is there; `--no-ncu` skips it): a child
  process makes 3 calls of each variant and case, ncu times each kernel alone at locked clocks;
- the largest difference of each variant to the plain-MLX reference (and the GPU tests' bound).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.hardware import describe, to_markdown  # noqa: E402
from benchmarks.kernels_bench import compare, max_diff  # noqa: E402
from benchmarks.step_profile import NCU_METRICS, kernel_family, ncu_kernels, ncu_path  # noqa: E402
from dsv4 import flags  # noqa: E402
from dsv4.kernels import sparse_attention as sa  # noqa: E402
from dsv4.kernels.dialect import backend  # noqa: E402

H, D, W, TOPK, R = 64, 512, 128, 512, 32
CASES = [(t, ctx) for ctx in (512, 8192) for t in (1, 4)]
VARIANTS = {"4-row": False, "8-row": True}
NCU_CALLS = 3


def make_case(T: int, context: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)
    if context <= TOPK:
        topk = np.broadcast_to(np.arange(TOPK), (1, T, TOPK))
    else:
        topk = np.stack([np.sort(rng.choice(context, TOPK, replace=False)) for _ in range(T)])[None]
    theta = rng.uniform(-np.pi, np.pi, (1, T, R)).astype(np.float32)
    case = dict(q=f(1, T, H, D), window_kv=f(1, W, D),
                window_idx=mx.array(np.broadcast_to(np.arange(W, dtype=np.int32), (1, T, W)).copy()),
                compressed_kv=f(1, context, D), topk_idx=mx.array(topk.astype(np.int32)),
                sinks=mx.array(rng.standard_normal(H).astype(np.float32)), scale=D ** -0.5,
                rope_cos=mx.array(np.cos(theta)), rope_sin=mx.array(np.sin(theta)), rotate_queries=True)
    mx.eval([v for v in case.values() if isinstance(v, mx.array)])
    return case


def call(case: dict, rows8: bool) -> mx.array:
    with flags.override(kernel_attention_rows8=rows8):
        return sa.sparse_attention_kernel(**case)


def within_bound(got, want, case) -> bool:
    """The GPU tests' bound: 2^-7 max|kv| + 2^-8 |out| (bf16 probabilities to different maxima)."""
    kv_max = max(mx.max(mx.abs(case["window_kv"])).item(), mx.max(mx.abs(case["compressed_kv"])).item())
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32))
    return bool(mx.all(err <= 2.0 ** -7 * kv_max + 2.0 ** -8 * mx.abs(want.astype(mx.float32))).item())


def profiled_calls() -> None:
    """The child under ncu: NCU_CALLS calls of each case and variant, in CASES x VARIANTS order."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    cases = [make_case(t, ctx) for t, ctx in CASES]
    for case in cases:
        for rows8 in VARIANTS.values():
            mx.eval(call(case, rows8))   # built before profiling
    mx.synchronize()
    cuda.cuProfilerStart()
    for case in cases:
        for rows8 in VARIANTS.values():
            for _ in range(NCU_CALLS):
                mx.eval(call(case, rows8))
                mx.synchronize()
    cuda.cuProfilerStop()


def gpu_times() -> tuple[dict, str]:
    """{(T, context, variant): (partial µs, merge µs)}: medians of the ncu launches; or a note why none."""
    ncu = ncu_path()
    if ncu is None:
        return {}, "no ncu found: GPU times skipped"
    out = subprocess.run([ncu, "--profile-from-start", "off", "--metrics", NCU_METRICS, "--csv", sys.executable,
                          "-m", "benchmarks.attention_decode", "--profiled-calls"], capture_output=True, text=True)
    launches = [k for k in ncu_kernels(out.stdout) if "sparse_attention" in kernel_family(k["name"])]
    expected = len(CASES) * len(VARIANTS) * NCU_CALLS * 2
    if len(launches) != expected:
        print((out.stdout + out.stderr)[-3000:], file=sys.stderr)
        return {}, f"ncu recorded {len(launches)} attention launches, expected {expected} (exit status {out.returncode})"
    times, i = {}, 0
    for t, ctx in CASES:
        for name, rows8 in VARIANTS.items():
            mine = launches[i:i + 2 * NCU_CALLS]
            i += 2 * NCU_CALLS
            kinds = [("rows8" in k["name"], "partial" if "partial" in k["name"] else "merge") for k in mine]
            assert kinds == [(rows8, "partial"), (rows8, "merge")] * NCU_CALLS, [k["name"] for k in mine]
            us = lambda ks: statistics.median(k["gpu__time_duration.sum"] / 1e3 for k in ks)
            times[(t, ctx, name)] = (us(mine[0::2]), us(mine[1::2]))
    return times, ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="Markdown report to write")
    p.add_argument("--no-ncu", action="store_true", help="skip the GPU times under ncu")
    p.add_argument("--profiled-calls", action="store_true", help=argparse.SUPPRESS)   # the child under ncu
    a = p.parse_args(argv)
    if backend() is None:
        sys.exit("attention_decode needs a GPU backend (Metal or CUDA) on the default device")
    if a.profiled_calls:
        profiled_calls()
        return 0
    if a.out is None:
        p.error("--out is required")
    # ncu first: its child then has the GPU to itself.
    gpu, note = ({}, "--no-ncu: GPU times skipped") if a.no_ncu else gpu_times()
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# Sparse attention at decode: 4-row vs 8-row kernels — {now:%Y-%m-%d %H:%M} UTC", "",
             f"H = {H} x D = {D} bf16, window {W} + {TOPK} selected rows, fused RoPE both ways. Wall: medians "
             "of 8 interleaved rounds of 20 calls (µs per call, the host's launches included). GPU: ncu's "
             f"gpu__time_duration per launch (median of {NCU_CALLS}), partial + merge, at ncu's locked clocks; "
             "TB/s: the rows read once per query (T x 640 KB) over that time.", "",
             "| T | context | 4-row wall µs | 8-row wall µs | wall 4/8 | 4-row GPU µs (partial + merge) | "
             "8-row GPU µs (partial + merge) | GPU 4/8 | 8-row TB/s | max diff to reference 4-row / 8-row (in bound) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t, ctx in CASES:
        case = make_case(t, ctx)
        wall = compare({name: (lambda r=rows8: call(case, r)) for name, rows8 in VARIANTS.items()})
        want = sa.sparse_attention_reference(**case)
        diffs = []
        for rows8 in VARIANTS.values():
            got = call(case, rows8)
            diffs.append(f"{max_diff(got, want):.2e} ({'yes' if within_bound(got, want, case) else 'NO'})")
        g4, g8 = gpu.get((t, ctx, "4-row")), gpu.get((t, ctx, "8-row"))
        gpu_cells = ["", "", "", ""]
        if g4 and g8:
            gpu_cells = [f"{sum(g4):.1f} ({g4[0]:.1f} + {g4[1]:.1f})", f"{sum(g8):.1f} ({g8[0]:.1f} + {g8[1]:.1f})",
                         f"{sum(g4) / sum(g8):.2f}x", f"{t * (W + TOPK) * D * 2 / (sum(g8) * 1e-6) / 1e12:.2f}"]
        lines.append(f"| {t} | {ctx} | {wall['4-row'] * 1e6:.1f} | {wall['8-row'] * 1e6:.1f} | "
                     f"{wall['4-row'] / wall['8-row']:.2f}x | {gpu_cells[0]} | {gpu_cells[1]} | {gpu_cells[2]} | "
                     f"{gpu_cells[3]} | {' / '.join(diffs)} |")
        print(lines[-1], flush=True)
    if note:
        lines += ["", f"Note: {note}."]
    lines += ["", to_markdown(describe()), ""]
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
