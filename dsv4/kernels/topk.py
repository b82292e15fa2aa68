"""The indexer's top-k of a few queries, in one launch (model-spec §3.6).

    out[b, s] = the k rows of largest score[b, s, n] (ties: the lower row), each replaced by -1
                where it is not visible to the query (n >= (p + 1) // ratio)

as `topk_indices` (scores and rows packed into one int64 key, MLX's argpartition)
followed by the visibility `where`: ~4 launches in plain MLX, the partition a full sort on the
GPU. Here one threadgroup per query finds the k-th largest score by radix selection (four
passes over 8-bit digits of the score's order-preserving 32-bit code, a 256-bin histogram in
threadgroup memory each, its threshold digit found by one SIMD group's scan), then writes every row above it and the lowest rows equal to it, in
row order (threadgroup prefix sums over contiguous chunks of rows). The set of rows is the
reference's exactly; their order within the k is unspecified in both (every consumer sums
over them).
"""

from __future__ import annotations

import mlx.core as mx

from dsv4 import flags
from dsv4.constants import ramp
from dsv4.kernels.dialect import Kernel, backend, constant, falls_back

THREADS = 1024
MAX_QUERIES = 8

_HEADER = r"""
// fp32 -> uint32 with the same order (-0 below +0, as the reference's signed packing).
KFN uint32_t ordered_code(float v) {
  const uint32_t b = AS_UINT(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Inclusive prefix sum over the lanes of a SIMD group.
KFN uint32_t lane_scan(uint32_t v, uint32_t lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t t = (uint32_t)simd_shuffle_i((int)v, (int)lane >= o ? (int)lane - o : (int)lane);
    if ((int)lane >= o) v += t;
  }
  return v;
}
"""

_BODY = r"""
  // grid (THREADS, 1, queries), threadgroup THREADS: one query per threadgroup.
  // scores [queries, N] fp32 -> out [queries, K] int32. N and K are read at run time, not
  // template values: in the reference path both grow with the cache (a build per value).
  const int N = scores_shape[2];
  const int K = kparam[0];
  const int qi = group_z;
  const size_t row0 = (size_t)qi * N;
  SHARED_ATOMIC_U32 hist[256];
  SHARED uint32_t pick[2];            // the threshold's code so far, how many at it are needed
  SHARED uint32_t offs[2][32];        // per SIMD group: rows above / at the threshold before it
  SHARED uint32_t totals[1];
  uint32_t prefix = 0u, need = (uint32_t)K;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    const uint32_t high = pass == 0 ? 0u : (0xFFFFFFFFu << (shift + 8));   // digits fixed so far
    for (int i = (int)tid; i < 256; i += (int)group_threads) ATOMIC_STORE(hist[i], 0u);
    BARRIER();
    for (int n = (int)tid; n < N; n += (int)group_threads) {
      const uint32_t u = ordered_code(scores[row0 + n]);
      if ((u & high) == (prefix & high)) ATOMIC_ADD(hist[(u >> shift) & 255u], 1u);
    }
    BARRIER();
    if (warp == 0) {
      // The largest digit d with (rows above d) + hist[d] >= need: lane l holds the digits
      // 255 - 8l down to 248 - 8l, a scan over the lanes counts the rows above each lane's,
      // and the one lane whose digits reach `need` walks its 8 (one thread walked all 256).
      uint32_t c[8], mine = 0u;
      for (int j = 0; j < 8; ++j) {
        c[j] = ATOMIC_LOAD(hist[255 - 8 * (int)lane - j]);
        mine += c[j];
      }
      const uint32_t through = lane_scan(mine, lane);
      uint32_t above = through - mine;
      if (above < need && need <= through) {
        int j = 0;
        for (; j < 7 && above + c[j] < need; ++j) above += c[j];
        pick[0] = prefix | ((uint32_t)(255 - 8 * (int)lane - j) << shift);
        pick[1] = need - above;
      }
    }
    BARRIER();
    prefix = pick[0];
    need = pick[1];
    BARRIER();                        // pick is written again by the next pass
  }
  // prefix is the k-th largest code; the k rows are those above it and the `need` lowest at it.
  const int chunk = (N + (int)group_threads - 1) / (int)group_threads;
  const int lo = min(N, (int)tid * chunk), hi = min(N, lo + chunk);
  uint32_t gt = 0u, eq = 0u;
  for (int n = lo; n < hi; ++n) {
    const uint32_t u = ordered_code(scores[row0 + n]);
    gt += u > prefix ? 1u : 0u;
    eq += u == prefix ? 1u : 0u;
  }
  const uint32_t gt_incl = lane_scan(gt, lane), eq_incl = lane_scan(eq, lane);
  if (lane == 31) {
    offs[0][warp] = gt_incl;
    offs[1][warp] = eq_incl;
  }
  BARRIER();
  if (warp == 0) {
    const uint32_t warps = group_threads / 32;
    const uint32_t a = lane < warps ? offs[0][lane] : 0u, b = lane < warps ? offs[1][lane] : 0u;
    const uint32_t a_incl = lane_scan(a, lane), b_incl = lane_scan(b, lane);
    offs[0][lane] = a_incl - a;
    offs[1][lane] = b_incl - b;
    if (lane == 31) totals[0] = a_incl;
  }
  BARRIER();
  uint32_t at_gt = offs[0][warp] + gt_incl - gt, at_eq = offs[1][warp] + eq_incl - eq;
  const uint32_t above_total = totals[0];
  const int visible = (positions[qi % S] + 1) / RATIO;
  for (int n = lo; n < hi; ++n) {
    const uint32_t u = ordered_code(scores[row0 + n]);
    const int row = n < visible ? n : -1;
    if (u > prefix) {
      out[(size_t)qi * K + at_gt++] = row;
    } else if (u == prefix) {
      if (at_eq < need) out[(size_t)qi * K + above_total + at_eq] = row;
      ++at_eq;
    }
  }
"""

TOPK_KERNEL = Kernel(
    name="dsv4_indexer_topk", input_names=("scores", "positions", "kparam"), output_names=("out",),
    body=_BODY, header=_HEADER,
    checks=(((mx.float32, mx.int32, mx.int32), (mx.int32,), (("S", 1), ("RATIO", 1))),
            ((mx.float32, mx.int32, mx.int32), (mx.int32,), (("S", 3), ("RATIO", 4)))))


def topk_indices(scores: mx.array, k: int) -> mx.array:
    """Indices of the k largest fp32 scores along the last axis; ties go to the lower
    index (scores and indices are packed into one unique int64 key). A selection has no
    gradient, so the scores are cut from the graph (training runs through this too)."""
    bits = mx.stop_gradient(scores).astype(mx.float32).view(mx.int32)
    ordered = mx.where(bits < 0, bits ^ 0x7FFFFFFF, bits).astype(mx.int64)
    index = ramp(scores.shape[-1], mx.int64)
    key = ordered * (1 << 32) + ((1 << 32) - 1 - index)
    return mx.argpartition(-key, k - 1, axis=-1)[..., :k].astype(mx.int32)


def topk_visible_reference(scores, k, positions, ratio):
    """Plain-MLX definition; see `topk_visible`."""
    chosen = topk_indices(scores, k)
    visible = (positions[:, None] + 1) // ratio                                        # [S, 1]
    return mx.where(chosen < visible, chosen, -1)


def kernel_applies(scores, k) -> bool:
    b, s, n = scores.shape
    return (bool(flags.get("kernel_topk")) and backend() is not None and b * s <= MAX_QUERIES
            and scores.dtype == mx.float32 and 1 <= k <= n)


@falls_back(topk_visible_reference, "kernel_topk")
def topk_visible(scores, k, positions, ratio):
    """scores [B, S, N] fp32, positions [S] int32 -> [B, S, k] int32: the rows of the k largest
    scores of each query (ties to the lower row), -1 for a row the query cannot see (>=
    (p + 1) // ratio). Through the kernel where `kernel_applies` (flag `kernel_topk`, a GPU,
    <= 8 queries), else `topk_visible_reference`."""
    if not kernel_applies(scores, k):
        return topk_visible_reference(scores, k, positions, ratio)
    b, s, n = scores.shape
    (out,) = TOPK_KERNEL(
        inputs=[scores, positions if positions.dtype == mx.int32 else positions.astype(mx.int32),
                constant((int(k),), mx.int32)],
        output_shapes=[(b, s, k)], output_dtypes=[mx.int32],
        grid=(THREADS, 1, b * s), threadgroup=(THREADS, 1, 1),
        template=[("S", s), ("RATIO", int(ratio))])
    return out
