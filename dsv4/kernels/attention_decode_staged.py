"""Decode's sparse attention on tensor cores (flag `kernel_attention_staged_decode`; CUDA, off
until a GPU has timed it).

Why. The 8-row kernel (sparse_attention.py) gives each head a SIMD group of fp32 dot products
and splits a query's rows over 32 threadgroups of 8 heads: at V4.1's 64 heads and 640 rows it
took 33 µs a layer under ncu for 0.6 MB of rows, and its merge 12 µs (an H100,
benchmarks/results/2026-12-07-1006-step-profile.md): latency, not bytes or FLOPs.

What. The prefill's staged launch (attention_prefill_staged.py: one threadgroup holds all the
query's heads, its rows staged once in threadgroup memory for every head, QK and PV on bf16
mma.sync, the scores recomputed in a second pass instead of stored) with the query's rows split
over threadgroups: split s takes tiles TILES_PER_SPLIT s .. (16 rows each), stages them all at
once and keeps them for both passes, and writes its partial (fp32 numerators, the maximum and
the sum of p) as the 8-row partial kernel does, which the 8-row merge turns into the output
(the sink, the division, the bf16 rounding, the inverse RoPE). The queries arrive unrotated at
decode and are rotated as their fragments load: fp32, rounded to bf16, as the 8-row kernel
rotates them.

Numbers: the 8-row kernels': p = exp(score - the split's maximum) rounded to bf16 for PV, fp32
sums; the merge rescales each split by exp(its maximum - the query's). Only the fp32 summation
order differs from the 8-row kernels.
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import attention_prefill_staged as staged
from dsv4.kernels import sparse_attention as sa
from dsv4.kernels.dialect import Kernel, backend, constant, shared_memory_limit

TILES_PER_SPLIT = 2   # the rows a threadgroup keeps staged: both buffers of the prefill launch

HEADER = staged.HEADER + sa.ROPE_HEADER + r"""
// Eight bf16 values (dims d0 .. d0 + 7, pairs adjacent) with those among the last 2R dims
// rotated forward in fp32 and rounded back to bf16.
template <int D, int R, typename PC>
KFN uint4 rotated_bf16_8(uint4 u, int d0, PC cosv, PC sinv, int qi) {
  uint32_t w[4] = {u.x, u.y, u.z, u.w};
  for (int i = 0; i < 4; ++i) {
    float v[2] = {AS_FLOAT(w[i] << 16), AS_FLOAT(w[i] & 0xffff0000u)};
    rotate_pair<D, R, false>(v, d0 + 2 * i, cosv, sinv, qi);
    w[i] = bf16_rne_bits(v[0]) | (bf16_rne_bits(v[1]) << 16);
  }
  const uint4 out = {w[0], w[1], w[2], w[3]};
  return out;
}
"""

_ROTATE = r"""    if (ROPE_Q > 0) {
      lo = rotated_bf16_8<D, ROPE_Q>(lo, 8 * c, rope_cos, rope_sin, qi);
      hi = rotated_bf16_8<D, ROPE_Q>(hi, 8 * c, rope_cos, rope_sin, qi);
    }
"""
_TILES = f"""  // grid (128 HG, splits, B * S): split group_y takes tiles {TILES_PER_SPLIT} group_y .., kept staged.
  const int split = (int)group_y, first = {TILES_PER_SPLIT} * split, count = min({TILES_PER_SPLIT}, NT - first);
  constexpr bool RESIDENT = true;
"""
# The split's partial as the 8-row merge reads it: part (qi, head, split) of [B*S, H, SPLITS].
_PARTIAL = r"""  const size_t p0 = ((size_t)qi * H + h0 + q) * SPLITS + split, p1 = p0 + 8 * SPLITS;
  // Heads q, q + 8: dims dq DW + 64 h + 16 t + e (D column 0) and + 8 (column 1) of n-tile 8 h + e.
  for (int h = 0; h < NB; ++h)
    for (int e = 0; e < 8; ++e) {
      const int dim = dq * DW + 64 * h + 16 * t + e;
      part_acc[p0 * D + dim] = acc[8 * h + e][0];
      part_acc[p0 * D + dim + 8] = acc[8 * h + e][1];
      part_acc[p1 * D + dim] = acc[8 * h + e][2];
      part_acc[p1 * D + dim + 8] = acc[8 * h + e][3];
    }
  if (dq == 0 && t == 0) {
    part_ml[2 * p0] = m0; part_ml[2 * p0 + 1] = s0;
    part_ml[2 * p1] = m1; part_ml[2 * p1 + 1] = s1;
  }
"""
BODY = (staged.BODY_TEMPLATE.replace("HEAD_GROUPS_Y", "0")
        .replace("    ROTATE_QUERIES\n", _ROTATE)
        .replace("  TILES\n", _TILES)
        .replace("  EPILOGUE\n", _PARTIAL))


def splits(rows: int) -> int:
    """Threadgroups a query's rows take: TILES_PER_SPLIT tiles of 16 rows each (the last fewer)."""
    return math.ceil(staged.tiles(rows) / TILES_PER_SPLIT)


def _shapes():
    """V4.1's decode shapes (the syntax gate builds these): window 128 rows, top-512 selected or
    none (window-only layers), the queries rotated in the launch."""
    return tuple(((mx.bfloat16, mx.bfloat16, mx.int32, mx.bfloat16, mx.int32, mx.float32, mx.float32, mx.float32),
                  (mx.float32, mx.float32),
                  (("T", mx.bfloat16), ("D", 512), ("H", 64), ("NW", 128), ("NK", nk), ("HG", 4),
                   ("NT", staged.tiles(128 + nk)), ("ROPE_Q", 32), ("SPLITS", splits(128 + nk))))
                 for nk in (512, 1))


KERNEL = Kernel(
    name="dsv4_sparse_attention_staged_partial",
    input_names=("queries", "window_kv", "window_idx", "compressed_kv", "topk_idx", "params", "rope_cos", "rope_sin"),
    output_names=("part_acc", "part_ml"), body=BODY, header=HEADER, dialects=("cuda",), checks=_shapes(),
    max_threads=staged.MAX_THREADS)


def applies(q, window_kv, compressed_kv) -> bool:
    """The flag, CUDA, bf16 queries and rows, all the heads in one threadgroup (16, 32 or 64),
    D in steps of 256 (a SIMD group's quarter in 64-dim blocks), and a launch within shared
    memory."""
    H, D = q.shape[-2:]
    bf16 = (q.dtype == window_kv.dtype == mx.bfloat16
            and (compressed_kv is None or compressed_kv.dtype == mx.bfloat16))
    return (backend() == "cuda" and bool(flags.get("kernel_attention_staged_decode")) and bf16
            and H % staged.HEADS == 0 and H == staged.HEADS * staged.head_groups(H) and D % 256 == 0
            and staged.shared_bytes(D, H) <= shared_memory_limit("cuda"))


def partials(q, window_kv, window_idx, compressed_kv, topk_idx, scale, rope_cos, rope_sin, rope_q: int):
    """(part_acc, part_ml, splits) of the queries q [B, S, H, D] over their rows, as
    sparse_attention.ROWS8_PARTIAL_KERNEL makes them, for its merge. The indices [B, S, *] int32,
    compressed_kv and topk_idx given (the dispatcher's stand-in row where a layer has none);
    rope_q > 0: q's last 2 rope_q dims rotated by rope_cos/sin [B*S*rope_q] first."""
    B, S, H, D = q.shape
    NW, NK = window_idx.shape[-1], topk_idx.shape[-1]
    n = splits(NW + NK)
    hg = staged.head_groups(H)
    part_acc, part_ml = KERNEL(
        inputs=[q, window_kv, window_idx, compressed_kv, topk_idx, constant((float(scale),)), rope_cos, rope_sin],
        output_shapes=[(B * S * H * n * D,), (B * S * H * n * 2,)], output_dtypes=[mx.float32, mx.float32],
        grid=(128 * hg, n, B * S), threadgroup=(128 * hg, 1, 1),
        template=[("T", q.dtype), ("D", D), ("H", H), ("NW", NW), ("NK", NK), ("HG", hg),
                  ("NT", staged.tiles(NW + NK)), ("ROPE_Q", rope_q), ("SPLITS", n)])
    return part_acc, part_ml, n
