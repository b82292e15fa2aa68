"""The indexer's scores of the compressed rows for a few queries, in one launch (model-spec §3.6).

For query (b, s) at position p, over the rows n of the index keys:

    score[n] = sum_h c w_h max(q_h . k_n, 0)      if n < (p + 1) // ratio (and the candidate
             = -inf                                 mask, where given, keeps n); else -inf

with q [B, S, h, d] fp32 (rotated, fp4-rounded), keys [B, N, d] (bf16 in the model), w the
weights projection [B, S, h] (any float dtype) and c its constant scale. In plain MLX that is
the keys' fp32 copy, the [h, N] product, max/multiply, the sum over heads, the visibility mask,
the weights' scaling and the candidate mask: ~7 launches per scoring layer at decode, and an
fp32 copy of every key. Here each lane scores one row: the query's h x d values sit in
threadgroup memory, the lane reads its key in 8-value chunks and keeps one fp32 sum per head
(heads <= MAX_HEADS), so the sum over d runs in index order, then the heads in index order.
Only the fp32 summation order differs from the reference.
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4 import flags
from dsv4.constants import ramp
from dsv4.kernels.dialect import Kernel, backend, constant, falls_back

MAX_QUERIES = 8
MAX_HEADS = 64      # fp32 sums per thread; and h * d <= 8192 (the query in 32 KB of threadgroup memory)
WARPS = 4           # rows per threadgroup: 32 * WARPS

_BODY = r"""
  // grid (32 * WARPS, ceil(N / (32 * WARPS)), queries): one row per thread, one query per z.
  // N is read from the keys, not a template value: the reference path's key count grows by
  // one per step, and each template value is a kernel build.
  const int N = keys_shape[1];
  const int qi = group_z;                     // b * S + s
  const int s = qi % S;
  const int n = (int)(group_y * group_threads + tid);
  SHARED float qs[H * DK];
  SHARED float ws[H];
  for (int i = (int)tid; i < H * DK; i += (int)group_threads) qs[i] = q[(size_t)qi * H * DK + i];
  for (int i = (int)tid; i < H; i += (int)group_threads) ws[i] = float(w[(size_t)qi * H + i]) * params[0];
  BARRIER();
  if (n >= N) return;                         // no barrier below
  const int visible = (positions[s] + 1) / RATIO;
  bool keep = n < visible;
  if (CANDIDATES) keep = keep && candidates[(size_t)qi * candidates_shape[2] + n];
  if (!keep) {
    scores[(size_t)qi * N + n] = -INFINITY;
    return;
  }
  const int b = qi / S;
  float acc[H];
  for (int h = 0; h < H; ++h) acc[h] = 0.0f;
  for (int c = 0; c < DK; c += 8) {
    float kv[8];
    for (int j = 0; j < 8; ++j) kv[j] = float(keys[((size_t)b * N + n) * DK + c + j]);
    for (int h = 0; h < H; ++h) {
      float a = acc[h];
      for (int j = 0; j < 8; ++j) a += qs[h * DK + c + j] * kv[j];
      acc[h] = a;
    }
  }
  float total = 0.0f;
  for (int h = 0; h < H; ++h) total += FMAX(acc[h], 0.0f) * ws[h];
  scores[(size_t)qi * N + n] = total;
"""

_CHECKS = tuple(
    ((mx.float32, kt, wt, mx.int32, mx.bool_, mx.float32), (mx.float32,),
     (("H", h), ("DK", dk), ("S", 1), ("RATIO", r), ("CANDIDATES", c)))
    for kt, wt, h, dk, r, c in ((mx.bfloat16, mx.bfloat16, 32, 128, 4, True),
                                (mx.float32, mx.float32, 8, 64, 1, False)))

SCORES_KERNEL = Kernel(
    name="dsv4_indexer_scores",
    input_names=("q", "keys", "w", "positions", "candidates", "params"), output_names=("scores",),
    body=_BODY, checks=_CHECKS)


def indexer_scores_reference(q, keys, w, scale, positions, ratio, candidates=None):
    """Plain-MLX definition; see `indexer_scores`."""
    w = w.astype(mx.float32) * scale
    dots = q @ keys.astype(mx.float32)[:, None].swapaxes(-1, -2)                     # [B,S,h,N]
    scores = mx.sum(mx.maximum(dots, 0.0) * w[..., None], axis=2)                    # [B,S,N]
    n = keys.shape[1]
    visible = (positions[:, None] + 1) // ratio                                        # [S,1]
    scores = mx.where(ramp(n) < visible, scores, -mx.inf)
    if candidates is not None:
        scores = mx.where(candidates[..., :n], scores, -mx.inf)
    return scores


def kernel_applies(q, keys) -> bool:
    b, s, h, dk = q.shape
    return (bool(flags.get("kernel_indexer")) and backend() is not None and b * s <= MAX_QUERIES
            and h <= MAX_HEADS and h * dk <= 8192 and dk % 8 == 0 and keys.shape[-1] == dk and q.dtype == mx.float32
            and keys.dtype in (mx.bfloat16, mx.float16, mx.float32) and keys.shape[0] == b
            and keys.shape[1] > 0)


@falls_back(indexer_scores_reference, "kernel_indexer")
def indexer_scores(q, keys, w, scale, positions, ratio, candidates=None):
    """Scores [B, S, N] fp32 of the index keys for each query.

    q          [B, S, h, d] fp32   the indexer's queries (rotated, rounded)
    keys       [B, N, d]           the index keys of the compressed rows (capacity N)
    w          [B, S, h]           the weights projection of each query; times `scale`
    positions  [S] int32           each query's position; rows n < (p + 1) // ratio are visible
    candidates [B, S, >= N] bool   optional: rows outside it score -inf too

    Through the kernel where `kernel_applies` (flag `kernel_indexer`, a GPU, <= 8 queries),
    else `indexer_scores_reference`.
    """
    if not kernel_applies(q, keys):
        return indexer_scores_reference(q, keys, w, scale, positions, ratio, candidates)
    b, s, h, dk = q.shape
    n = keys.shape[1]
    has_candidates = candidates is not None
    (scores,) = SCORES_KERNEL(
        inputs=[q, keys, w, positions if positions.dtype == mx.int32 else positions.astype(mx.int32),
                candidates if has_candidates else constant((False,) * 8, mx.bool_),
                constant((float(scale),))],
        output_shapes=[(b, s, n)], output_dtypes=[mx.float32],
        grid=(32 * WARPS, math.ceil(n / (32 * WARPS)), b * s), threadgroup=(32 * WARPS, 1, 1),
        template=[("H", h), ("DK", dk), ("S", s), ("RATIO", int(ratio)), ("CANDIDATES", has_candidates)])
    return scores
