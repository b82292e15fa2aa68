"""Prefill's sparse attention on CUDA tensor cores (flag `kernel_prefill_attention_mma`; auto: on
under CUDA, where the H200 measured it 2.4x the reference at 2048 queries).

At prefill the reference (sparse_attention_reference) gathers each query's rows (its window
rows and its selected compressed rows, 640 in V4.1), widens them to fp32 and runs two batched
matmuls; at 2048 queries the gathers and copies took 9.0 of its 14.7 ms on the H200
(benchmarks/results/2026-12-04-0241-prefill-matmuls.md). The rows are never gathered here. All
heads of a query share its rows, so a query is a small GEMM with M = heads: a threadgroup takes
one query and 16 of its heads, and streams the rows from memory (L2 for the other head groups)
into bf16 mma.sync m16n8k16 fragments.

Numbers, the reference's: scores q . kv in fp32 (bf16 products are exact in the tensor core,
sums fp32), times the scale; M = max(max score, -1e30); p = exp(score - M), its fp32 sum plus
exp(sink - M) the denominator; p rounded to bf16 (the KV dtype) for the PV product, fp32 sums;
out = numer / denom rounded to bf16. Two passes, not an online softmax, because the reference
rounds p against the final maximum. Only the fp32 summation order differs from the reference.

Layout of a launch: grid (128, H / 16, B * S), 4 SIMD groups. Pass 1: SIMD group w scores row
tiles w, w + 4, ... (8 rows each) against the 16 heads' queries, held in threadgroup memory;
a lane keeps its tiles' scores in registers (the maximum needs all of them). The D walk is in
steps of 32: lane (q, t) (lane = 4 q + t) loads dims 8t..8t+7 of row q of the tile with one
16-byte load, and so k positions 2t, 2t+1, 2t+8, 2t+9 of the two mma steps stand for dims 8t..
8t+3 and 8t+4..8t+7 (A takes the queries' dims at the same places). Then the maxima and sums
cross the SIMD groups through threadgroup memory, and p (bf16 pairs) goes there too. Pass 2:
the rows come again, 16 at a time, staged in threadgroup memory (where the queries were);
SIMD group w makes dims w D/4.. of the 16 heads' output from P (A) and the rows (B).
Fragments (PTX ISA, m16n8k16, lane = 4 q + t): A {(q, 2t..), (q+8, 2t..), (q, 2t+8..),
(q+8, 2t+8..)}, B {(2t.., q), (2t+8.., q)}, D {(q, 2t), (q, 2t+1), (q+8, 2t), (q+8, 2t+1)}.
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels.dialect import Kernel, backend, constant, falls_back, shared_memory_limit

HEADS = 16      # heads per threadgroup: the mma's M
THREADS = 128   # 4 SIMD groups
TILE = 8        # rows per pass-1 tile (the mma's N)
PAD = 4         # uint32 of padding per staged row: rows 4 banks apart

HEADER = r"""
// Row r (< NR) of query qi's list as a pointer to its D values, or null: its window rows (NW
// indices into W rows), then its selected compressed rows (NK indices into N rows); -1 or an
// index past the end picks nothing.
template <int D, int NW, int NK, typename PT, typename PI>
KFN PT prefill_row(PT window_kv, PI window_idx, PT compressed_kv, PI topk_idx, int b, int qi, int r,
                   int W, int N) {
  if (r < NW) {
    const int j = window_idx[(size_t)qi * NW + r];
    return (j >= 0 && j < W) ? window_kv + ((size_t)b * W + j) * D : (PT)0;
  }
  if (r >= NW + NK) return (PT)0;
  const int j = topk_idx[(size_t)qi * NK + (r - NW)];
  return (j >= 0 && j < N) ? compressed_kv + ((size_t)b * N + j) * D : (PT)0;
}
// The bf16 bits of f rounded to nearest even (f finite).
KFN uint32_t bf16_rne_bits(float f) {
  const uint32_t u = AS_UINT(f);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
"""

BODY = r"""
  // grid (THREADS, H / 16, B * S); RT row tiles of 8 per SIMD group, NRP = 32 RT rows in all.
  constexpr int QS = D / 2 + PAD;              // uint32 per staged row (queries, then rows)
  constexpr int NRP = 32 * RT;                 // rows, padded to whole tiles of every SIMD group
  constexpr int PS = NRP / 2;                  // P: bf16 pairs per head
  constexpr int NT = D / 32;                   // pass 2: 8-dim tiles per SIMD group
  const int S = queries_shape[1], W = window_kv_shape[1], N = compressed_kv_shape[1];
  const int qi = (int)group_z, b = qi / S, h0 = 16 * (int)group_y;
  const int q = (int)lane >> 2, t = (int)lane & 3;
  const float scale = params[0];
  SHARED uint32_t stage[16 * QS];
  SHARED uint32_t pv[16 * PS];
  SHARED float red[2][4][16];

  // The 16 heads' queries: 16 D bf16 values, 16 bytes a thread per step.
  for (int i = (int)tid; i < 16 * (D / 8); i += (int)group_threads) {
    const int h = i / (D / 8), c = i % (D / 8);
    const uint4 v = LOAD_U4(queries + ((size_t)qi * H + h0 + h) * D, c);
    stage[h * QS + 4 * c] = v.x; stage[h * QS + 4 * c + 1] = v.y;
    stage[h * QS + 4 * c + 2] = v.z; stage[h * QS + 4 * c + 3] = v.w;
  }
  BARRIER();

  // Pass 1: scores of rows 8 g + 2t, 8 g + 2t + 1 (g = 4 i + warp) for heads q and q + 8.
  float sc[RT][4];
  for (int i = 0; i < RT; ++i) {
    const int g = 4 * i + (int)warp;
    GLOBAL T* row = prefill_row<D, NW, NK>(window_kv, window_idx, compressed_kv, topk_idx, b, qi, 8 * g + q, W, N);
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int kk = 0; kk < D / 32; ++kk) {
      uint4 v = {0u, 0u, 0u, 0u};
      if (row) v = LOAD_U4(row, 4 * kk + t);
      const int at = 16 * kk + 4 * t;
      const uint32_t a0[4] = {stage[q * QS + at], stage[(q + 8) * QS + at],
                              stage[q * QS + at + 1], stage[(q + 8) * QS + at + 1]};
      const uint32_t b0[2] = {v.x, v.y};
      mma_16816_bf16(d, a0, b0);
      const uint32_t a1[4] = {stage[q * QS + at + 2], stage[(q + 8) * QS + at + 2],
                              stage[q * QS + at + 3], stage[(q + 8) * QS + at + 3]};
      const uint32_t b1[2] = {v.z, v.w};
      mma_16816_bf16(d, a1, b1);
    }
    const bool ok0 = prefill_row<D, NW, NK>(window_kv, window_idx, compressed_kv, topk_idx, b, qi, 8 * g + 2 * t, W, N) != 0;
    const bool ok1 = prefill_row<D, NW, NK>(window_kv, window_idx, compressed_kv, topk_idx, b, qi, 8 * g + 2 * t + 1, W, N) != 0;
    sc[i][0] = ok0 ? d[0] * scale : -INFINITY; sc[i][1] = ok1 ? d[1] * scale : -INFINITY;
    sc[i][2] = ok0 ? d[2] * scale : -INFINITY; sc[i][3] = ok1 ? d[3] * scale : -INFINITY;
  }
  // The maxima of heads q (m0) and q + 8 (m1) over every row.
  float m0 = -INFINITY, m1 = -INFINITY;
  for (int i = 0; i < RT; ++i) {
    m0 = FMAX(m0, FMAX(sc[i][0], sc[i][1])); m1 = FMAX(m1, FMAX(sc[i][2], sc[i][3]));
  }
  for (int o = 1; o <= 2; o <<= 1) { m0 = FMAX(m0, simd_xor_f(m0, o)); m1 = FMAX(m1, simd_xor_f(m1, o)); }
  if (t == 0) { red[0][warp][q] = m0; red[0][warp][q + 8] = m1; }
  BARRIER();
  m0 = FMAX(FMAX(FMAX(red[0][0][q], red[0][1][q]), FMAX(red[0][2][q], red[0][3][q])), -1e30f);
  m1 = FMAX(FMAX(FMAX(red[0][0][q + 8], red[0][1][q + 8]), FMAX(red[0][2][q + 8], red[0][3][q + 8])), -1e30f);
  // p: its fp32 sums, and its bf16 pairs (rows 8 g + 2t, + 1) for pass 2.
  float s0 = 0.0f, s1 = 0.0f;
  for (int i = 0; i < RT; ++i) {
    const int g = 4 * i + (int)warp;
    const float p0 = EXP(sc[i][0] - m0), p1 = EXP(sc[i][1] - m0);
    const float p2 = EXP(sc[i][2] - m1), p3 = EXP(sc[i][3] - m1);
    s0 += p0 + p1; s1 += p2 + p3;
    pv[q * PS + 4 * g + t] = bf16_rne_bits(p0) | (bf16_rne_bits(p1) << 16);
    pv[(q + 8) * PS + 4 * g + t] = bf16_rne_bits(p2) | (bf16_rne_bits(p3) << 16);
  }
  for (int o = 1; o <= 2; o <<= 1) { s0 += simd_xor_f(s0, o); s1 += simd_xor_f(s1, o); }
  if (t == 0) { red[1][warp][q] = s0; red[1][warp][q + 8] = s1; }
  BARRIER();
  const float den0 = ((red[1][0][q] + red[1][1][q]) + (red[1][2][q] + red[1][3][q]))
                     + EXP(sinks[h0 + q] - m0);
  const float den1 = ((red[1][0][q + 8] + red[1][1][q + 8]) + (red[1][2][q + 8] + red[1][3][q + 8]))
                     + EXP(sinks[h0 + q + 8] - m1);

  // Pass 2: 16 rows at a time staged; SIMD group w makes dims w D/4 + 8 j + (2t, 2t+1).
  float acc[NT][4];
  for (int j = 0; j < NT; ++j) for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
  for (int blk = 0; blk < NRP / 16; ++blk) {
    for (int i = (int)tid; i < 16 * (D / 8); i += (int)group_threads) {
      const int r = i / (D / 8), c = i % (D / 8);
      GLOBAL T* row = prefill_row<D, NW, NK>(window_kv, window_idx, compressed_kv, topk_idx, b, qi, 16 * blk + r, W, N);
      uint4 v = {0u, 0u, 0u, 0u};
      if (row) v = LOAD_U4(row, c);
      stage[r * QS + 4 * c] = v.x; stage[r * QS + 4 * c + 1] = v.y;
      stage[r * QS + 4 * c + 2] = v.z; stage[r * QS + 4 * c + 3] = v.w;
    }
    BARRIER();
    const uint32_t a[4] = {pv[q * PS + 8 * blk + t], pv[(q + 8) * PS + 8 * blk + t],
                           pv[q * PS + 8 * blk + 4 + t], pv[(q + 8) * PS + 8 * blk + 4 + t]};
    for (int j = 0; j < NT; ++j) {
      const int dim = (int)warp * (D / 4) + 8 * j + q, w_at = dim >> 1, sh = 16 * (dim & 1);
      const uint32_t bb[2] = {
          ((stage[(2 * t) * QS + w_at] >> sh) & 0xffffu) | (((stage[(2 * t + 1) * QS + w_at] >> sh) & 0xffffu) << 16),
          ((stage[(2 * t + 8) * QS + w_at] >> sh) & 0xffffu) | (((stage[(2 * t + 9) * QS + w_at] >> sh) & 0xffffu) << 16)};
      mma_16816_bf16(acc[j], a, bb);
    }
    BARRIER();
  }
  for (int j = 0; j < NT; ++j) {
    const int dim = (int)warp * (D / 4) + 8 * j + 2 * t;
    T* o0 = out + ((size_t)qi * H + h0 + q) * D + dim;
    T* o1 = out + ((size_t)qi * H + h0 + q + 8) * D + dim;
    o0[0] = static_cast<T>(DIV_RN(acc[j][0], den0)); o0[1] = static_cast<T>(DIV_RN(acc[j][1], den0));
    o1[0] = static_cast<T>(DIV_RN(acc[j][2], den1)); o1[1] = static_cast<T>(DIV_RN(acc[j][3], den1));
  }
"""


def _shapes():
    """V4.1's prefill shapes (the syntax gate builds these): window 128 rows, top-512 selected or
    none (window-only layers)."""
    return tuple(((mx.bfloat16, mx.bfloat16, mx.int32, mx.bfloat16, mx.int32, mx.float32, mx.float32),
                  (mx.bfloat16,),
                  (("T", mx.bfloat16), ("D", 512), ("H", 64), ("NW", 128), ("NK", nk), ("RT", rt), ("PAD", PAD)))
                 for nk, rt in ((512, 20), (1, 5)))


KERNEL = Kernel(
    name="dsv4_prefill_sparse_attention_mma",
    input_names=("queries", "window_kv", "window_idx", "compressed_kv", "topk_idx", "sinks", "params"),
    output_names=("out",), body=BODY, header=HEADER, dialects=("cuda",), checks=_shapes())


def row_tiles(rows: int) -> int:
    """Pass-1 tiles of 8 rows per SIMD group for a query's `rows` rows (4 SIMD groups)."""
    return math.ceil(rows / (4 * TILE))


def shared_bytes(D: int, rows: int) -> int:
    """Threadgroup memory of a launch: the staged queries/rows, P, the cross-group reductions."""
    return 4 * (HEADS * (D // 2 + PAD) + HEADS * 16 * row_tiles(rows) + 2 * 4 * 16)


def applies(q, window_kv, compressed_kv, rows: int) -> bool:
    """The flag, CUDA, bf16 queries and rows, whole groups of 16 heads, D in steps of 32, and a
    launch within shared memory for `rows` rows a query (window and selected: 640 in V4.1)."""
    H, D = q.shape[-2:]
    bf16 = (q.dtype == window_kv.dtype == mx.bfloat16
            and (compressed_kv is None or compressed_kv.dtype == mx.bfloat16))
    return (backend() == "cuda" and flags.switch("kernel_prefill_attention_mma", True) and bf16
            and H % HEADS == 0 and D % 32 == 0 and shared_bytes(D, rows) <= shared_memory_limit("cuda"))


def reference(q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale):
    from dsv4.kernels.sparse_attention import attention_core

    return attention_core(q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale)


def launch_indices(q, window_idx, compressed_kv, topk_idx):
    """(window_idx, compressed_kv, topk_idx) as the prefill launches take them: int32 indices for
    each of the batch's queries, and one never-selected row for a missing compressed cache."""
    B, S, _, D = q.shape
    fit = lambda idx: (idx if idx.shape[0] == B else mx.broadcast_to(idx, (B, S, idx.shape[-1]))).astype(mx.int32)
    if compressed_kv is None:
        compressed_kv = constant((((0.0,) * D,),), q.dtype)
        topk_idx = mx.full((B, S, 1), -1, mx.int32)
    return fit(window_idx), compressed_kv, fit(topk_idx)


@falls_back(reference, "kernel_prefill_attention_mma")
def prefill_attention(q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale):
    """sparse_attention's core (queries already rotated, output not de-rotated) for q
    [B, S, H, D] bf16 over window_kv [B, W, D] (window_idx [B|1, S, w]) and compressed_kv
    [B, N, D] or None (topk_idx [B|1, S, k]) -> [B, S, H, D] bf16."""
    B, S, H, D = q.shape
    window_idx, compressed_kv, topk_idx = launch_indices(q, window_idx, compressed_kv, topk_idx)
    rows = window_idx.shape[-1] + topk_idx.shape[-1]
    (out,) = KERNEL(
        inputs=[q, window_kv, window_idx, compressed_kv, topk_idx, sinks.astype(mx.float32),
                constant((float(scale),))],
        output_shapes=[q.shape], output_dtypes=[q.dtype],
        grid=(THREADS, H // HEADS, B * S), threadgroup=(THREADS, 1, 1),
        template=[("T", q.dtype), ("D", D), ("H", H), ("NW", window_idx.shape[-1]), ("NK", topk_idx.shape[-1]),
                  ("RT", row_tiles(rows)), ("PAD", PAD)])
    return out
