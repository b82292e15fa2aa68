"""The matmuls of a prefill chunk at V4.1's shapes, each way MLX can compute them (GPU).

    python -m benchmarks.prefill_matmuls [--tokens 128,512,2048] [--repeats 5]
                                         [--parts dense,grouped,attention,experts]

For each chunk size T:
- the dense projections (mxfp8, group 32): MLX's quantized_matmul, the weight dequantized to
  bf16 and multiplied (dequantize + matmul, every call), and the bf16 matmul alone on a weight
  dequantized beforehand (the floor of that route);
- the routed experts (mxfp4, 384 experts, top-6, the T x 6 (token, expert) pairs sorted by
  expert, as RoutedExperts takes them): gather_qmm, dsv4's tensor-core kernel
  (dsv4/kernels/experts_prefill.py, which tiles the sorted pairs itself), in fp16, in bf16
  (DSV4_KERNEL_PREFILL_EXPERTS_BF16) and in bf16 fed by cp.async (DSV4_KERNEL_PREFILL_EXPERTS_STREAM),
  and gather_mm on bf16 weights dequantized beforehand;
- the grouped wo_a (8 groups of 4096 -> 1024, mxfp8) as decode computes it (gather_qmm, one row
  per token and group), against a batched product per group;
- the sparse attention's reference over the chunk's queries (64 heads of 512, 128 window and
  512 compressed rows each), its row gathers alone, and dsv4's tensor-core kernels
  (dsv4/kernels/attention_prefill.py; attention_prefill_staged.py, CUDA).
TFLOP/s are each call's FLOPs over its median time; torch's bf16 matmul rate is measured in
the same process (benchmarks/roofline.py).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.roofline import _mlx_seconds, matmul_roofline  # noqa: E402

DENSE = {"wq_a": (5120, 1280), "wq_b": (1280, 32768), "wkv": (5120, 512), "wo_b": (8192, 5120),
         "shared w1": (5120, 2304), "shared w2": (2304, 5120)}
EXPERTS, TOP_K, D, INTER = 384, 6, 5120, 2304
GROUPS, GROUP_IN, GROUP_OUT = 8, 4096, 1024


def quantized(shape, mode: str, bits: int, slice_rows: int = 1 << 27):
    """Random weights quantized, in slices of the leading axis of at most slice_rows values
    each (one call over 384 experts' 4.5G values fails on the GPU)."""
    per = max(1, slice_rows // int(np.prod(shape[1:])))
    parts = []
    for lo in range(0, shape[0], per):
        w = mx.random.normal((min(per, shape[0] - lo), *shape[1:])).astype(mx.bfloat16) * 0.02
        parts.append(mx.quantize(w, group_size=32, bits=bits, mode=mode))
        mx.eval(parts[-1])
    q, s = (mx.concatenate([p[i] for p in parts]) for i in (0, 1))
    mx.eval(q, s)
    return q, s


def dequantized(q, s, bits: int, mode: str):
    """q, s dequantized to bf16 in slices of experts (see `quantized`)."""
    per = max(1, (1 << 27) // (q.shape[1] * q.shape[2] * 32 // bits))
    parts = []
    for lo in range(0, q.shape[0], per):
        parts.append(mx.dequantize(q[lo:lo + per], s[lo:lo + per], group_size=32, bits=bits, mode=mode,
                                   dtype=mx.bfloat16))
        mx.eval(parts[-1])
    return mx.concatenate(parts)


def dense_rows(t: int, repeats: int) -> list[tuple[str, float, float]]:
    rows = []
    for name, (d_in, d_out) in DENSE.items():
        q, s = quantized((d_out, d_in), "mxfp8", 8)
        x = mx.random.normal((t, d_in)).astype(mx.bfloat16)
        w = mx.dequantize(q, s, group_size=32, bits=8, mode="mxfp8", dtype=mx.bfloat16)
        mx.eval(x, w)
        flops = 2 * t * d_in * d_out
        ways = {
            "quantized_matmul": lambda: mx.quantized_matmul(x, q, s, transpose=True, group_size=32, bits=8,
                                                            mode="mxfp8"),
            "dequantize + matmul": lambda: x @ mx.dequantize(q, s, group_size=32, bits=8, mode="mxfp8",
                                                             dtype=mx.bfloat16).T,
            "bf16 matmul (weight ready)": lambda: x @ w.T,
        }
        for way, make in ways.items():
            rows.append((f"{name} {d_in}->{d_out}", way, flops, _mlx_seconds(make, repeats)))
    return rows


def expert_rows(t: int, repeats: int) -> list[tuple[str, float, float]]:
    from dsv4 import flags
    from dsv4.kernels import experts_prefill

    rng = np.random.default_rng(t)
    ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(t)]).reshape(-1)
    order = np.argsort(ids, kind="stable")
    e = mx.array(ids[order].astype(np.uint32))
    rows = []
    for name, (d_in, d_out) in {"gate": (D, INTER), "down": (INTER, D)}.items():
        q, s = quantized((EXPERTS, d_out, d_in), "mxfp4", 4)
        xs = mx.random.normal((t * TOP_K, 1, d_in)).astype(mx.bfloat16)
        mx.eval(xs, e)
        flops = 2 * t * TOP_K * d_in * d_out
        rows.append((f"experts {name} {d_in}->{d_out}", "gather_qmm (sorted)", flops, _mlx_seconds(
            lambda: mx.gather_qmm(xs, q, s, rhs_indices=e, transpose=True, group_size=32, bits=4, mode="mxfp4",
                                  sorted_indices=True), repeats)))
        for way, bf16, stream in (("dsv4 tensor-core kernel in fp16 (experts_prefill)", False, False),
                                  ("the same in bf16 (DSV4_KERNEL_PREFILL_EXPERTS_BF16)", True, False),
                                  ("bf16, fed by cp.async a chunk ahead (DSV4_KERNEL_PREFILL_EXPERTS_STREAM)", True, True)):
            def switched(xs=xs, q=q, s=s, bf16=bf16, stream=stream):
                with flags.override(kernel_prefill_experts_bf16=bf16, kernel_prefill_experts_stream=stream):
                    return experts_prefill.prefill_experts(xs, q, s, e, 32, 4, "mxfp4", True)
            rows.append((f"experts {name} {d_in}->{d_out}", way, flops, _mlx_seconds(switched, repeats)))
        rows.append((f"experts {name} {d_in}->{d_out}", "dequantize every expert to bf16 (no product)", 0,
                     _mlx_seconds(lambda: dequantized(q, s, 4, "mxfp4"), 1)))
        w = dequantized(q, s, 4, "mxfp4").swapaxes(-1, -2)
        mx.eval(w)
        rows.append((f"experts {name} {d_in}->{d_out}", "gather_mm bf16 (weights ready)", flops, _mlx_seconds(
            lambda: mx.gather_mm(xs, w, rhs_indices=e, sorted_indices=True), repeats)))
    return rows


def grouped_rows(t: int, repeats: int) -> list[tuple[str, float, float]]:
    q, s = quantized((GROUPS * GROUP_OUT, GROUP_IN), "mxfp8", 8)
    gq, gs = q.reshape(GROUPS, GROUP_OUT, -1), s.reshape(GROUPS, GROUP_OUT, -1)
    x = mx.random.normal((t, GROUPS, 1, GROUP_IN)).astype(mx.bfloat16)
    lhs = mx.arange(t * GROUPS, dtype=mx.uint32).reshape(t, GROUPS)
    rhs = mx.arange(GROUPS, dtype=mx.uint32).reshape(1, GROUPS)
    w = mx.dequantize(gq, gs, group_size=32, bits=8, mode="mxfp8", dtype=mx.bfloat16)
    mx.eval(x, lhs, rhs, w)
    flops = 2 * t * GROUPS * GROUP_IN * GROUP_OUT
    name = f"wo_a {GROUPS} x {GROUP_IN}->{GROUP_OUT}"
    per_group = x[:, :, 0].swapaxes(0, 1)   # [G, T, in]
    return [
        (name, "gather_qmm (a row per token and group)", flops, _mlx_seconds(
            lambda: mx.gather_qmm(x, gq, gs, lhs_indices=lhs, rhs_indices=rhs, transpose=True, group_size=32,
                                  bits=8, mode="mxfp8"), repeats)),
        (name, "quantized_matmul per group (batched)", flops, _mlx_seconds(
            lambda: mx.quantized_matmul(per_group, gq, gs, transpose=True, group_size=32, bits=8, mode="mxfp8"),
            repeats)),
        (name, "bf16 batched matmul (weights ready)", flops, _mlx_seconds(
            lambda: per_group @ w.swapaxes(-1, -2), repeats)),
    ]


def attention_rows(t: int, repeats: int) -> list[tuple[str, float, float]]:
    """The sparse attention's reference (what prefill runs) over a chunk of t queries, each
    seeing a window of 128 rows and 512 compressed rows, and the part of it that only gathers
    each query's rows (in fp32, from the rows widened once)."""
    from dsv4.kernels import attention_prefill, attention_prefill_staged
    from dsv4.kernels import sparse_attention as sa
    from dsv4.kernels.dialect import backend

    rng = np.random.default_rng(t)
    heads, d, window, topk, n = 64, 512, 128, 512, 4096
    q = mx.random.normal((1, t, heads, d)).astype(mx.bfloat16)
    window_kv = mx.random.normal((1, t + window, d)).astype(mx.bfloat16)
    window_idx = mx.array((np.arange(t)[:, None] + 1 + np.arange(window)[None]).astype(np.int32))[None]
    compressed = mx.random.normal((1, n, d)).astype(mx.bfloat16)
    topk_idx = mx.array(np.stack([rng.choice(n, topk, replace=False) for _ in range(t)]).astype(np.int32))[None]
    sinks = mx.zeros((heads,), mx.float32)
    mx.eval(q, window_kv, window_idx, compressed, topk_idx)
    flops = 4 * t * heads * d * (window + topk)
    name = f"sparse attention {heads} heads, {window} + {topk} rows"

    def gathered():
        rows, _, _ = sa._query_rows(window_kv, window_idx, compressed, topk_idx, 1)
        return [mx.sum(rows(lo, lo + sa.QUERY_BLOCK), axis=-1) for lo in range(0, t, sa.QUERY_BLOCK)]

    rows = [
        (name, "reference (prefill's path)", flops, _mlx_seconds(
            lambda: sa.sparse_attention_reference(q, window_kv, window_idx, compressed, topk_idx, sinks,
                                                  d ** -0.5), repeats)),
        (name, "its fp32 row gathers only", 0, _mlx_seconds(gathered, repeats)),
    ]
    if backend() == "cuda":
        rows.append((name, "dsv4 tensor-core kernel (attention_prefill)", flops, _mlx_seconds(
            lambda: attention_prefill.prefill_attention(q, window_kv, window_idx, compressed, topk_idx, sinks,
                                                        d ** -0.5), repeats)))
        rows.append((name, "its rows staged for all heads (attention_prefill_staged)", flops, _mlx_seconds(
            lambda: attention_prefill_staged.prefill_attention(q, window_kv, window_idx, compressed, topk_idx,
                                                               sinks, d ** -0.5), repeats)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="128,512,2048")
    p.add_argument("--parts", default="dense,grouped,attention,experts", help="comma-separated subset")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated

    rate = matmul_roofline()
    table = []
    parts = {"dense": dense_rows, "grouped": grouped_rows, "attention": attention_rows, "experts": expert_rows}
    for t in [int(v) for v in a.tokens.split(",")]:
        for part in (parts[name] for name in a.parts.split(",")):
            for shape, way, flops, s in part(t, a.repeats):
                tflops = flops / s / 1e12   # 0 for a row without a product
                share = f"{100 * tflops / rate:.1f}%" if rate else "-"
                table.append(f"| {t} | {shape} | {way} | {1e3 * s:.3f} | {tflops:.1f} | {share} |")
                print(table[-1], flush=True)
    when = datetime.now()
    roof = f"torch's bf16 matmul in this process: {rate:.0f} TFLOP/s." if rate else "No CUDA torch: no roofline."
    lines = ["# Prefill matmuls at V4.1's shapes, each way MLX computes them", "",
             f"{when:%Y-%m-%d %H:%M}; median of {a.repeats} after one untimed call. {roof}", "",
             "| tokens | matmul | way | ms | TFLOP/s | of torch's bf16 |", "|---|---|---|---|---|---|",
             *table, "", to_markdown(describe())]
    write_dated(a.out, when, "prefill-matmuls", lines, shown=6 + len(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
