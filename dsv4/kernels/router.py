"""The MoE router's tail in one launch: scores, biased top-k and routing weights (model-spec §4).

After the gate matmul (fp32 logits l [N, E]), for each token:

    s_e = sqrt(softplus(l_e / temp))              the expert scores
    ids = top-k of s_e + bias_e                   ties to the lower expert id; the bias only selects
    w   = s_ids / (sum s_ids + 1e-20) * scale      (without the division when norm is off)

In plain MLX that is ~8 launches (softplus/sqrt, bias add, the ordered-key packing, the
partition, the gather, the sum, the division); here one SIMD group handles one token: each
lane keeps E/32 scores in registers, and each of the k rounds is a SIMD argmax (largest key,
then smallest id among equal keys), after which the winning lane retires its entry. The ids
come out in descending key order (the plain-MLX partition's order is unspecified; every
consumer sums over them).

softplus(y) is computed as MLX's logaddexp(y, 0) is: max(y, 0) + log1p(exp(-|y|)), with a
log1p accurate for small arguments built from log (the dialect has no log1p).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from dsv4 import flags
from dsv4.kernels.dialect import Kernel, backend, constant, falls_back
from dsv4.kernels.topk import topk_indices

# Shared with the experts kernel, which can run the router's tail itself (dsv4/kernels/experts.py).
HEADER = r"""
// log(1 + e) for e in [0, 1], accurate where 1 + e rounds (Goldberg's correction).
KFN float log1p_small(float e) {
  const float u = 1.0f + e;
  return u == 1.0f ? e : LOG(u) * (e / (u - 1.0f));
}

// The router's tail for one token, by one SIMD group (every lane calls it): lane l holds
// experts l + 32 j; each of the K rounds is a SIMD argmax. Lane 0 writes ids[r] and
// weights[r] in pick order. `row` holds the token's E fp32 logits.
template <int E, int K, bool NORM, typename PL, typename PB, typename PI, typename PW>
KFN void route_token(PL row, PB bias, float temp, float scale, uint32_t lane, PI ids, PW weights) {
  constexpr int PER = (E + 31) / 32;
  float score[PER], key[PER];
  for (int j = 0; j < PER; ++j) {
    const int e = (int)lane + 32 * j;
    if (e < E) {
      const float y = row[e] / temp;
      const float sp = FMAX(y, 0.0f) + log1p_small(EXP(-FABS(y)));
      score[j] = SQRT(sp);
      key[j] = score[j] + bias[e];
    } else {
      score[j] = 0.0f;
      key[j] = -INFINITY;
    }
  }
  float picked[K];
  float total = 0.0f;
  for (int r = 0; r < K; ++r) {
    float best = -INFINITY, best_score = 0.0f;
    int best_j = 0;
    for (int j = 0; j < PER; ++j)
      if (key[j] > best) { best = key[j]; best_j = j; best_score = score[j]; }
    const float top = simd_max_f(best);
    // Smallest id among the lanes holding the top key (ids < 2^24 are exact in fp32).
    const float mine = best == top ? (float)((int)lane + 32 * best_j) : 1.0e9f;
    const int winner = (int)(-simd_max_f(-mine));
    const int owner = winner % 32;
    picked[r] = AS_FLOAT((uint32_t)simd_shuffle_i((int)AS_UINT(best_score), owner));
    if ((int)lane == owner) key[winner / 32] = -INFINITY;
    if (lane == 0) ids[r] = winner;
    total += picked[r];
  }
  if (lane == 0) {
    const float denom = NORM ? total + 1e-20f : 1.0f;
    for (int r = 0; r < K; ++r) weights[r] = NORM ? picked[r] / denom * scale : picked[r] * scale;
  }
}
"""

_BODY = r"""
  // grid (32, tokens, 1), threadgroup 32: one SIMD group per token.
  const int t = group_y;
  route_token<E, K, NORM>(logits + (size_t)t * E, bias, params[0], params[1], lane, ids + t * K,
                          weights + t * K);
"""

ROUTER_KERNEL = Kernel(
    name="dsv4_router_topk", input_names=("logits", "bias", "params"), output_names=("ids", "weights"),
    body=_BODY, header=HEADER,
    checks=(((mx.float32, mx.float32, mx.float32), (mx.int32, mx.float32),
             (("E", 384), ("K", 6), ("NORM", True))),
            ((mx.float32, mx.float32, mx.float32), (mx.int32, mx.float32),
             (("E", 13), ("K", 1), ("NORM", False)))))

MAX_EXPERTS = 32 * 64   # registers per lane: E/32 scores and keys


def kernel_applies(logits: mx.array, k: int) -> bool:
    e = logits.shape[-1]
    return (bool(flags.get("kernel_router")) and backend() is not None and logits.dtype == mx.float32
            and logits.ndim == 2 and logits.shape[0] > 0 and 1 <= k <= min(e, 32) and e <= MAX_EXPERTS)


def route_reference(logits: mx.array, bias: mx.array, k: int, temp: float, scale: float,
                    norm: bool) -> tuple[mx.array, mx.array]:
    """Plain-MLX definition of `route`."""
    scores = mx.sqrt(nn.softplus(logits / temp))
    chosen = topk_indices(scores + bias, k)
    weights = mx.take_along_axis(scores, chosen, axis=-1)
    if norm:
        weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return chosen, weights * scale


@falls_back(route_reference, "kernel_router")
def route_kernel(logits: mx.array, bias: mx.array, k: int, temp: float, scale: float,
                 norm: bool) -> tuple[mx.array, mx.array]:
    """The one-launch path of `route` (call that instead)."""
    n, e = logits.shape
    ids, weights = ROUTER_KERNEL(
        inputs=[logits, bias if bias.dtype == mx.float32 else bias.astype(mx.float32), constant((float(temp), float(scale)))],
        output_shapes=[(n, k), (n, k)], output_dtypes=[mx.int32, mx.float32],
        grid=(32, n, 1), threadgroup=(32, 1, 1), template=[("E", e), ("K", k), ("NORM", bool(norm))])
    return ids, weights


def route(logits: mx.array, bias: mx.array, k: int, temp: float, scale: float,
          norm: bool) -> tuple[mx.array, mx.array]:
    """logits [N, E] fp32 (gate matmul output), bias [E] fp32 -> (ids [N, k] int32, weights
    [N, k] fp32) as `dsv4.moe.Router` defines them; one launch where `kernel_applies`."""
    if kernel_applies(logits, k):
        return route_kernel(logits, bias, k, temp, scale, norm)
    return route_reference(logits, bias, k, temp, scale, norm)
