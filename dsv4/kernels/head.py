"""The output head for a few tokens: fp32 logits from the bf16 weight in one pass.

    logits[t, v] = sum_d x[t, d] * W[v, d]        fp32 products and sums (model-spec §2: the
                                                  reference keeps the head in fp32)

A bf16 weight widens to fp32 exactly, so this is the reference's product; only the order of the
fp32 sums differs. MLX's `x_fp32 @ W.T` with a bf16 W first converts the whole weight to an
fp32 temporary (2.6 GB for V4.1's 129280 x 5120, on every decode step) and then reads that
again: three times the bytes of reading the bf16 weight once, which is what this kernel does.

Each SIMD group makes ROWS rows for every token: its lanes take 16-byte chunks (8 weights) of
the rows in turn, the tokens' inputs come from device memory (a few KB, cached), and the
sums are fp32 in each lane, then across the SIMD group. The weight's shape is read at run time,
not compiled in: the head, the router's gate and the compressors' products (22 shapes at V4.1)
share one build per token count, which a cold start pays once (NVRTC, ~2 s each on the H200).

The same product serves the MoE router's gate (bf16 weight [E, D], bf16 x: the reference's
`x_fp32 @ W_fp32.T`), which reads x as bf16 (widened exactly in the kernel, no cast launch).
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels.dialect import Kernel, backend, falls_back

MAX_TOKENS = 8
ROWS = 4            # rows per SIMD group
WARPS = 8           # SIMD groups per threadgroup

_BODY = r"""
  // grid (32 * WARPS, ceil(V / (WARPS * ROWS)), 1); x [TOK, D] fp32, w [V, D] bf16 -> out [TOK, V].
  // D and V are read at run time: one instantiation per token count serves every weight shape.
  const int V = (int)w_shape[0], D = (int)w_shape[1];
  const int row0 = ((int)group_y * (int)(group_threads / 32) + (int)warp) * ROWS;
  if (row0 >= V) return;   // no barrier below: a finished SIMD group may leave
  float acc[TOK][ROWS];
  for (int t = 0; t < TOK; ++t)
    for (int r = 0; r < ROWS; ++r) acc[t][r] = 0.0f;
  for (int c = (int)lane; c < D / 8; c += 32) {
    uint4 q[ROWS];
    for (int r = 0; r < ROWS; ++r) q[r] = LOAD_U4(w + (size_t)min(row0 + r, V - 1) * D, c);
    for (int t = 0; t < TOK; ++t) {
      float xv[8];
      if (X_BF16) {   // 8 bf16 inputs in one 16-byte word; x advances 2 bytes per element
        const uint4 a = LOAD_U4(x + t * D, c);
        const uint32_t xs[4] = {a.x, a.y, a.z, a.w};
        for (int j = 0; j < 4; ++j) {
          xv[2 * j] = AS_FLOAT(xs[j] << 16);
          xv[2 * j + 1] = AS_FLOAT(xs[j] & 0xffff0000u);
        }
      } else {        // 8 fp32 inputs in two
        const uint4 a = LOAD_U4(x + t * D, 2 * c), b = LOAD_U4(x + t * D, 2 * c + 1);
        const uint32_t xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        for (int j = 0; j < 8; ++j) xv[j] = AS_FLOAT(xs[j]);
      }
      for (int r = 0; r < ROWS; ++r) {
        const uint32_t wv[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
        float s = acc[t][r];
        for (int j = 0; j < 4; ++j) {
          s += AS_FLOAT(wv[j] << 16) * xv[2 * j];
          s += AS_FLOAT(wv[j] & 0xffff0000u) * xv[2 * j + 1];
        }
        acc[t][r] = s;
      }
    }
  }
  for (int t = 0; t < TOK; ++t)
    for (int r = 0; r < ROWS; ++r) {
      const float s = simd_sum_f(acc[t][r]);
      if (lane == 0 && row0 + r < V) out[(size_t)t * V + row0 + r] = s;
    }
"""

HEAD_KERNEL = Kernel(
    name="dsv4_head_logits", input_names=("x", "w"), output_names=("out",), body=_BODY,
    checks=(((mx.float32, mx.bfloat16), (mx.float32,),
             (("TOK", 1), ("ROWS", ROWS), ("X_BF16", False))),
            ((mx.float32, mx.bfloat16), (mx.float32,), (("TOK", 8), ("ROWS", ROWS), ("X_BF16", False))),
            ((mx.bfloat16, mx.bfloat16), (mx.float32,), (("TOK", 1), ("ROWS", ROWS), ("X_BF16", True)))))


def supports(x: mx.array, weight: mx.array) -> bool:
    """What the kernel computes: a GPU backend, x [..., D] with at most MAX_TOKENS rows, weight
    [V, D] bf16, D a multiple of 8."""
    tokens = math.prod(x.shape[:-1])
    return (backend() is not None and weight.dtype == mx.bfloat16 and weight.ndim == 2
            and x.shape[-1] == weight.shape[1] and weight.shape[1] % 8 == 0 and 1 <= tokens <= MAX_TOKENS)


def kernel_applies(x: mx.array, weight: mx.array) -> bool:
    """The head through the kernel: flag `kernel_head` on and `supports`."""
    return bool(flags.get("kernel_head")) and supports(x, weight)


def head_logits_reference(x: mx.array, weight: mx.array) -> mx.array:
    """Plain-MLX definition of `head_logits`."""
    return x.astype(mx.float32) @ weight.astype(mx.float32).T


# The model's head (kernel_head) and the router's gate (kernel_router) take this kernel.
@falls_back(head_logits_reference, "kernel_head", "kernel_router")
def head_logits(x: mx.array, weight: mx.array) -> mx.array:
    """x [..., D] -> fp32 logits [..., V] = x_fp32 @ weight_fp32.T (weight [V, D] bf16),
    through the kernel (see `supports`); a bf16 x is read as it is, other dtypes as fp32."""
    v = weight.shape[0]
    tokens = math.prod(x.shape[:-1])
    x_bf16 = x.dtype == mx.bfloat16
    (out,) = HEAD_KERNEL(inputs=[x if x_bf16 or x.dtype == mx.float32 else x.astype(mx.float32), weight],
                         output_shapes=[(*x.shape[:-1], v)], output_dtypes=[mx.float32],
                         grid=(32 * WARPS, -(-v // (WARPS * ROWS)), 1), threadgroup=(32 * WARPS, 1, 1),
                         template=[("TOK", tokens), ("ROWS", ROWS), ("X_BF16", x_bf16)])
    return out
