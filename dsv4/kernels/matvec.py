"""A dense quantized projection for a few tokens (decode, draft verification), with the fp8
rounding of its input fused (model-spec §11):

    y[t] = round_T(W q(x[t]))      q = qdq_fp8 per 32 values when act_quant, else identity

x is [..., K] with at most MAX_TOKENS rows, in bf16, fp16 or fp32 (T); W is [N, K], an
MLX-quantized matrix (`QuantizedMatrix`: mxfp8, mxfp4, affine with 2/3/4/8 bits, packed as
`mx.quantize` packs it, see experts.py); the matmul accumulates in fp32 and y is [..., N] in T.

One launch instead of two (the rounding, then MLX's quantized matmul): a threadgroup per
WARPS * ROWS consecutive rows of W and one token holds the token's x in threadgroup memory,
fp8-rounded once there (experts.py's `qdq_fp8_32`, the gate/up kernel's layout); each SIMD
group makes ROWS rows with experts.py's `rows_dot` (lanes split the input in packs of 32).
Rows per SIMD group grow with N so that large matrices use fewer, longer threadgroups while
small ones still spread over the GPU.
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4.kernels.dialect import Kernel, backend
from dsv4.kernels.experts import (_HEADER, MODE_IDS, SHARED_BYTES, X_STRIDE, QuantizedMatrix,
                                  matrix_operands, matrix_supported)
from dsv4.quant import qdq_fp8

MAX_TOKENS = 8
WARPS = 8
DTYPES = (mx.bfloat16, mx.float16, mx.float32)

_BODY = r"""
  // grid (32 * WARPS, ceil(N / (WARPS * ROWS)), tokens); y is [tokens, N], x [tokens, K].
  const int N = (int)w_shape[0];
  const int t = group_z;
  // The token's x in fp32, fp8-rounded when ACTQ, once per threadgroup (XS uint4s per pack).
  SHARED uint4 xs[K / 32 * XS];
  for (int p = (int)tid; p < K / 32; p += (int)group_threads) {
    float v[32];
    for (int i = 0; i < 32; ++i) v[i] = float(x[(size_t)t * K + 32 * p + i]);
    if (ACTQ) qdq_fp8_32(v);
    store_x_pack<XS>(xs, p, v);
  }
  BARRIER();
  const int row0 = ((int)group_y * (int)(group_threads / 32) + (int)warp) * ROWS;
  if (row0 >= N) return;
  float acc[ROWS], unused[ROWS];
  rows_dot<MODE, BITS, GS, ROWS, K, XS, false>(xs, w, s, b, w, s, b, 0, row0, N, acc, unused, lane);
  if (lane == 0) {
    for (int r = 0; r < ROWS && row0 + r < N; ++r) y[(size_t)t * N + row0 + r] = static_cast<T>(acc[r]);
  }
"""


def _checks():
    """Instantiations for the offline compile gates: (x dtype, matrix layout, rows, K, ACTQ)."""
    u32, u8, bf16, f32 = mx.uint32, mx.uint8, mx.bfloat16, mx.float32
    out = []
    for xt, (mode, bits, gs, st, bt), rows, k, actq in [
            (bf16, ("mxfp8", 8, 32, u8, u32), 2, 5120, True),
            (f32, ("mxfp4", 4, 32, u8, u32), 4, 1280, False),
            (bf16, ("affine", 3, 64, bf16, bf16), 1, 512, True),
            (f32, ("affine", 8, 32, f32, f32), 1, 8192, True)]:
        template = (("T", xt), ("MODE", MODE_IDS[mode]), ("BITS", bits), ("GS", gs), ("ROWS", rows),
                    ("K", k), ("XS", X_STRIDE), ("ACTQ", actq))
        out.append(((xt, u32, st, bt), (xt,), template))
    return tuple(out)


MATVEC_KERNEL = Kernel(name="dsv4_quantized_matvec", input_names=("x", "w", "s", "b"),
                       output_names=("y",), body=_BODY, header=_HEADER, checks=_checks())


def rows_per_warp(n: int) -> int:
    """Rows each SIMD group makes: 4 once that still leaves >= 128 threadgroups, else fewer."""
    for rows in (4, 2):
        if n >= 128 * WARPS * rows:
            return rows
    return 1


def kernel_supports(x: mx.array, q: QuantizedMatrix) -> bool:
    """Whether `quantized_matvec` handles (x, q) on this device: a GPU backend, 1-8 tokens of a
    float dtype, a single [N, K] matrix in a layout the decoder knows, x's copy within the
    threadgroup memory."""
    if backend() is None or x.ndim < 1 or x.dtype not in DTYPES:
        return False
    K = x.shape[-1]
    tokens = x.size // K if K else 0
    return (1 <= tokens <= MAX_TOKENS and K % 32 == 0 and q.weight.ndim == 2
            and q.in_features == K and matrix_supported(q)
            and K // 32 * X_STRIDE * 16 <= SHARED_BYTES)


def matvec_reference(x: mx.array, q: QuantizedMatrix, act_quant: bool) -> mx.array:
    """Plain MLX: the quantized matmul on the (fp8-rounded) input in fp32, so that it
    accumulates in fp32 on every backend, rounded to x's dtype (as in experts_reference)."""
    xin = (qdq_fp8(x) if act_quant else x).astype(mx.float32)
    y = mx.quantized_matmul(xin, q.weight, q.scales, q.biases, transpose=True, **q.kwargs())
    return y.astype(x.dtype)


def quantized_matvec(x: mx.array, q: QuantizedMatrix, act_quant: bool) -> mx.array:
    """x [..., K] (at most MAX_TOKENS rows) -> y [..., N] in x's dtype, one launch; the same
    contract as `matvec_reference`. Call only where `kernel_supports(x, q)`."""
    K, N = x.shape[-1], q.out_features
    tokens = x.size // K
    rows = rows_per_warp(N)
    (y,) = MATVEC_KERNEL(
        inputs=[x] + matrix_operands(q), output_shapes=[(*x.shape[:-1], N)], output_dtypes=[x.dtype],
        grid=(32 * WARPS, math.ceil(N / (WARPS * rows)), tokens), threadgroup=(32 * WARPS, 1, 1),
        template=[("T", x.dtype), ("MODE", MODE_IDS[q.mode]), ("BITS", q.bits), ("GS", q.group_size),
                  ("ROWS", rows), ("K", K), ("XS", X_STRIDE), ("ACTQ", bool(act_quant))])
    return y
