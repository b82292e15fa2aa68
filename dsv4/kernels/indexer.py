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


# Prefill (more queries than the kernel above takes): the [h, N] products of every query come from
# a matmul, and the sum over heads of their weighted ReLU from one launch over them (a thread per
# query and row, the heads in index order), where plain MLX reads and writes the fp32 products
# three times (max, multiply, sum): ~11 of a 4K prefill's 178 ms of kernels on an H100
# (benchmarks/results/2026-12-07-1017-prefill-profile-4096-c4096.md). The same products; the sum
# over heads in another fp32 order.
_HEAD_SUM_BODY = r"""
  // grid (N, queries, 1): dots [queries, H, N] fp32, w [queries, H] scaled -> scores [queries, N].
  const int N = dots_shape[2];
  const size_t qi = group_y;
  const int n = (int)(group_x * group_threads + tid);
  if (n >= N) return;
  float total = 0.0f;
  for (int h = 0; h < H; ++h) total += FMAX(dots[(qi * H + h) * (size_t)N + n], 0.0f) * w[qi * H + h];
  scores[qi * (size_t)N + n] = total;
"""

HEAD_SUM_KERNEL = Kernel(
    name="dsv4_indexer_head_sum", input_names=("dots", "w"), output_names=("scores",), body=_HEAD_SUM_BODY,
    checks=(((mx.float32, mx.float32), (mx.float32,), (("H", 64),)),))
HEAD_SUM_THREADS = 256


def indexer_scores_reference(q, keys, w, scale, positions, ratio, candidates=None):
    """Plain-MLX definition; see `indexer_scores`."""
    dots, w = _products(q, keys, w, scale)
    scores = mx.sum(mx.maximum(dots, 0.0) * w[..., None], axis=2)                    # [B,S,N]
    return _masked(scores, keys.shape[1], positions, ratio, candidates)


def _products(q, keys, w, scale):
    """Every query head's products with every key, fp32 [B, S, h, N], and the scaled head weights."""
    return q @ keys.astype(mx.float32)[:, None].swapaxes(-1, -2), w.astype(mx.float32) * scale


def _masked(scores, n, positions, ratio, candidates):
    """Scores [B, S, N] with the rows a query may not see (and, where given, those outside its
    candidates) at -inf."""
    visible = (positions[:, None] + 1) // ratio                                        # [S,1]
    scores = mx.where(ramp(n) < visible, scores, -mx.inf)
    if candidates is not None:
        scores = mx.where(candidates[..., :n], scores, -mx.inf)
    return scores


def head_sum_applies(q, keys) -> bool:
    """Whether `indexer_scores` sums a prefill's heads in one launch: more queries than the kernel
    above takes, DSV4_KERNEL_PREFILL_INDEXER (auto: CUDA; Metal keeps plain MLX until a Mac
    measures it)."""
    dialect = backend()
    return (dialect is not None and flags.switch("kernel_prefill_indexer", dialect == "cuda")
            and q.shape[0] * q.shape[1] > MAX_QUERIES and q.dtype == mx.float32 and keys.shape[1] > 0)


@falls_back(indexer_scores_reference, "kernel_prefill_indexer")
def prefill_scores(q, keys, w, scale, positions, ratio, candidates=None):
    """`indexer_scores_reference` with the weighted ReLU summed over heads by HEAD_SUM_KERNEL."""
    b, s, h, _ = q.shape
    n = keys.shape[1]
    dots, w = _products(q, keys, w, scale)
    (scores,) = HEAD_SUM_KERNEL(
        inputs=[dots.reshape(b * s, h, n), w.reshape(b * s, h)],
        output_shapes=[(b, s, n)], output_dtypes=[mx.float32],
        grid=(math.ceil(n / HEAD_SUM_THREADS) * HEAD_SUM_THREADS, b * s, 1), threadgroup=(HEAD_SUM_THREADS, 1, 1),
        template=[("H", h)])
    return _masked(scores, n, positions, ratio, candidates)


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

    Through the kernel where `kernel_applies` (flag `kernel_indexer`, a GPU, <= 8 queries), else
    the reference's matmul with its heads summed in one launch (`head_sum_applies`: a prefill on
    CUDA), else `indexer_scores_reference`.
    """
    if not kernel_applies(q, keys):
        fn = prefill_scores if head_sum_applies(q, keys) else indexer_scores_reference
        return fn(q, keys, w, scale, positions, ratio, candidates)
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
