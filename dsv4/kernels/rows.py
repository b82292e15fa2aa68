"""The tail of a projection, per row, in one launch: RMSNorm -> RoPE of the last dims -> fp8/fp4
rounding (each stage optional), for the decode step at fixed shapes (dsv4/step.py).

In plain MLX the window-KV row `qdq_fp8(rope(kv_norm(wkv(x))))` is ~12 primitives (the norm's
reduction, RoPE's slices, transposes and concatenation, the rounding's reduction and fp8
conversions); a decode step has several such tails per layer (queries, window KV, indexer
queries and keys, the q-LoRA latent). Here one threadgroup holds one row in registers and
each stage ends rounded to the row's dtype, exactly where the reference rounds:

    norm:  h = round(w * (x * rsqrt(sum(x^2) / D + eps)))              (fp32 inside)
    rope:  (a, b) -> round(a cos - b sin, a sin + b cos) on the last 2R dims, pairs adjacent
    qdq:   dsv4.kernels.qdq's rounding per 32 values (e4m3 or e2m1, power-of-two scale), or
           per 16 to e2m1 with an e4m3 scale (the compressed KV)

cos/sin are the [R] fp32 values of the rows' angles (one position: a decode step), or [S, R]
for rows at S positions (a speculative verify, a draft block): row s of them for the rows of
position s. The result equals the reference up to fp32 summation order in the norm and the
cos/sin values.
"""

from __future__ import annotations

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels.dialect import Kernel, backend, constant, falls_back
from dsv4.kernels.qdq import FP4, FP8, HEADER as QDQ_HEADER

THREADS = 256
MAX_WIDTH = 2048
NO_QDQ = -1
FP4_E4M3 = 2   # dsv4.quant.qdq_fp4_e4m3: e2m1 with an e4m3 scale per 16 (the compressed KV)

# The stages on a row held by a threadgroup of 256 (THREADS): thread tid holds h[e] = value
# d = tid + 256 e (E = ceil(D / 256) of them, 0 past D), ss the sum of their squares; `row` is the
# row's index, params (eps, rows per position, positions S), weight the norm's, cosv/sinv the
# angles.
_STAGES = f"""
  constexpr int FP4_E4M3 = {FP4_E4M3};""" + r"""
  if (NORM) {
    SHARED float red[8];
    const float s = simd_sum_f(ss);
    if (lane == 0) red[warp] = s;
    BARRIER();
    float total = 0.0f;
    for (int w = 0; w < 8; ++w) total += red[w];
    const float n = RSQRT(total * (1.0f / (float)D) + params[0]);
    for (int e = 0; e < E; ++e) {
      const int d = (int)tid + 256 * e;
      if (d < D) h[e] = float(static_cast<T>(h[e] * n * float(weight[d])));
    }
  }
  if (R > 0) {
    // The row's position among the call's S (params[2]) positions, params[1] rows each
    // (x laid out [B, S, rows per position, D]): its angles are row s of cos/sin [S, R].
    const int S = (int)params[2];
    const size_t s = S > 1 ? (row / (size_t)params[1]) % (size_t)S : 0;
    for (int e = 0; e < E; ++e) {
      const int d = (int)tid + 256 * e;
      const float other = AS_FLOAT((uint32_t)simd_shuffle_i((int)AS_UINT(h[e]), (int)(lane ^ 1u)));
      if (d >= D - 2 * R && d < D) {
        const int k = (d - (D - 2 * R)) >> 1;
        const float c = cosv[s * R + k], sn = sinv[s * R + k];
        h[e] = float(static_cast<T>((d & 1) == 0 ? h[e] * c - other * sn : other * sn + h[e] * c));
      }
    }
  }
  // QDQ: 1 + the rounding's format (template values must be names: no minus sign)
  if (QDQ == 1 + FP4_E4M3) {
    for (int e = 0; e < E; ++e) h[e] = qdq_fp4_e4m3_lane(h[e], lane);
  } else if (QDQ > 0) {
    for (int e = 0; e < E; ++e) h[e] = qdq_pow2_lane<(QDQ == 1 ? 0 : 1)>(h[e]);
  }
"""


def held_row(row: str, value: str, target: str) -> str:
    """A body fragment: row `row` (a C expression) loaded by a threadgroup of 256 from `value` (an
    fp32 expression in row and d, its value d), taken through the stages, and stored, rounded to T,
    to `target` (an lvalue in row and d). The row-tail launch's, and matvec_tail.py's on the
    matvec's output row."""
    return (r"""
  constexpr int E = (D + 255) / 256;
  const size_t row = ROW;
  float h[E];
  float ss = 0.0f;
  for (int e = 0; e < E; ++e) {
    const int d = (int)tid + 256 * e;
    h[e] = d < D ? VALUE : 0.0f;
    ss += h[e] * h[e];
  }""".replace("ROW", row).replace("VALUE", value) + _STAGES + r"""  for (int e = 0; e < E; ++e) {
    const int d = (int)tid + 256 * e;
    if (d < D) TARGET = static_cast<T>(h[e]);
  }
""".replace("TARGET", target))


_BODY = r"""
  // grid (256 rows, 1, 1), threadgroup 256: one row per threadgroup (on x: a prefill chunk's
  // query rows outnumber CUDA's 65535 threadgroups on y); lane values d = tid + 256 e, so each
  // SIMD group holds whole blocks of 32 and both values of a RoPE pair.""" + held_row("group_x", "float(x[row * D + d])",
                                                                                "out[row * D + d]")

_F = mx.float32
ROW_TAIL_KERNEL = Kernel(
    name="dsv4_row_tail", input_names=("x", "weight", "cosv", "sinv", "params"), output_names=("out",),
    body=_BODY, header=QDQ_HEADER,
    checks=(((mx.bfloat16, mx.bfloat16, _F, _F, _F), (mx.bfloat16,),
             (("T", mx.bfloat16), ("D", 512), ("R", 32), ("NORM", True), ("QDQ", 1 + FP8))),
            ((mx.bfloat16, _F, _F, _F, _F), (mx.bfloat16,),
             (("T", mx.bfloat16), ("D", 1280), ("R", 0), ("NORM", True), ("QDQ", 0))),
            ((_F, _F, _F, _F, _F), (_F,),
             (("T", _F), ("D", 128), ("R", 32), ("NORM", False), ("QDQ", 1 + FP4))),
            ((mx.bfloat16, _F, _F, _F, _F), (_F,),   # bf16 values stored as fp32
             (("T", mx.bfloat16), ("D", 128), ("R", 32), ("NORM", False), ("QDQ", 1 + FP4))),
            ((mx.bfloat16, _F, _F, _F, _F), (mx.bfloat16,),   # a compressed KV row
             (("T", mx.bfloat16), ("D", 512), ("R", 32), ("NORM", False), ("QDQ", 1 + FP4_E4M3)))))


_ANGLES_BODY = r"""
  // grid (R rounded up to 32, S, 1): for position p = offset + s (s = group_y),
  // theta_k = (p * scale) * (1 / freqs_k), as the plain-MLX ops compute it (reciprocal
  // correctly rounded), then its cosine and sine at [s, k].
  const int k = (int)(group_x * group_threads + tid);
  if (k >= R) return;
  const int s = (int)group_y;
  const float theta = (float(offset[0] + s) * params[0]) * DIV_RN(1.0f, freqs[k]);
  cosv[s * R + k] = COS(theta);
  sinv[s * R + k] = SIN(theta);
"""

ANGLES_KERNEL = Kernel(
    name="dsv4_rope_angles", input_names=("offset", "freqs", "params"), output_names=("cosv", "sinv"),
    body=_ANGLES_BODY,
    checks=(((mx.int32, _F, _F), (_F, _F), (("R", 32),)),))


def rope_angles_reference(offset: mx.array, freqs: mx.array, scale: float,
                          positions: int = 1) -> tuple[mx.array, mx.array]:
    """cos, sin of the angles (p * scale) / freqs (offset [1] int32, freqs [R] fp32) at the
    position p = offset: [R] each; or, for several `positions`, at offset + s: [S, R]."""
    at = offset if positions == 1 else (offset + mx.arange(positions, dtype=offset.dtype))[:, None]
    theta = at.astype(mx.float32) * scale * mx.reciprocal(freqs)   # [1] * [R]: [R], no views
    return mx.cos(theta), mx.sin(theta)


@falls_back(rope_angles_reference, "kernel_rows")
def rope_angles(offset: mx.array, freqs: mx.array, scale: float,
                positions: int = 1) -> tuple[mx.array, mx.array]:
    """`rope_angles_reference` in one launch where the projection tails run as kernels (flag
    `kernel_rows` and a GPU: three launches otherwise, the angles and one per function)."""
    if not (flags.get("kernel_rows") and backend() is not None and offset.dtype == mx.int32
            and freqs.dtype == mx.float32 and freqs.ndim == 1):
        return rope_angles_reference(offset, freqs, scale, positions)
    r = freqs.shape[0]
    shape = (r,) if positions == 1 else (positions, r)
    cos, sin = ANGLES_KERNEL(inputs=[offset, freqs, constant((float(scale),))],
                             output_shapes=[shape, shape], output_dtypes=[mx.float32, mx.float32],
                             grid=(-(-r // 32) * 32, positions, 1), threadgroup=(32, 1, 1),
                             template=[("R", r)])
    return cos, sin


def kernel_applies(x: mx.array, qdq: int, width: int = None) -> bool:
    """Whether `row_tail` takes x's rows of `width` values (default x.shape[-1])."""
    width = x.shape[-1] if width is None else width
    return (bool(flags.get("kernel_rows")) and backend() is not None
            and x.dtype in (mx.bfloat16, mx.float16, mx.float32)
            and width <= MAX_WIDTH and (qdq == NO_QDQ or width % 32 == 0))


def row_tail_reference(x: mx.array, norm=None, rope=None, qdq: int = NO_QDQ, shape: tuple = None,
                       dtype: mx.Dtype = None) -> mx.array:
    """Plain-MLX definition of `row_tail`: dsv4.attention's RMSNorm formula, the RoPE of
    sparse_attention.rope_reference, dsv4.quant's roundings."""
    from dsv4.kernels.sparse_attention import rope_reference
    from dsv4.quant import qdq_fp4_e4m3, qdq_fp4_pow2, qdq_fp8

    x = x if shape is None else x.reshape(shape)
    if norm is not None:
        weight, eps = norm
        h = x.astype(mx.float32)
        h = h * mx.rsqrt(mx.mean(h * h, axis=-1, keepdims=True) + eps)
        x = (h * weight.astype(mx.float32)).astype(x.dtype)
    if rope is not None and rope[0].ndim == 2:   # [S, R]: x [B, S, ...], row s at angles s
        b, S = x.shape[0], rope[0].shape[0]
        x = rope_reference(x.reshape(b, S, -1, x.shape[-1]), *(a[None] for a in rope)).reshape(x.shape)
    elif rope is not None:
        x = rope_reference(x, *rope)
    if qdq != NO_QDQ:
        x = {FP8: qdq_fp8, FP4: qdq_fp4_pow2, FP4_E4M3: qdq_fp4_e4m3}[qdq](x)
    return x if dtype is None else x.astype(dtype)


@falls_back(row_tail_reference, "kernel_rows")
def row_tail(x: mx.array, norm=None, rope=None, qdq: int = NO_QDQ, shape: tuple = None,
             dtype: mx.Dtype = None) -> mx.array:
    """x [..., D] -> the same shape and dtype, through the stages asked for.

    norm: (weight [D], eps) or None; rope: (cos, sin) fp32 [R], or [S, R] for x laid out
    [B, S, ...] (row s for the rows of position s), or None (the last 2R dims are rotated,
    adjacent pairs); qdq: FP8, FP4 (power-of-two scale per 32), FP4_E4M3
    (e4m3 scale per 16) or NO_QDQ. With `shape` (the same
    size), x's rows are of shape[-1] values and the result has that shape (a projection's
    output split into heads without a reshape). With `dtype` (fp32), the values, rounded to
    x's dtype as ever, are stored widened (exactly) to it: no cast for an fp32 consumer.
    Call only where `kernel_applies(x, qdq, D)`."""
    shape = x.shape if shape is None else tuple(shape)
    D = shape[-1]
    weight, eps = norm if norm is not None else (constant((0.0,) * 8), 0.0)
    cos, sin = rope if rope is not None else (constant((0.0,) * 8), constant((0.0,) * 8))
    rows = x.size // D
    positions = cos.shape[0] if cos.ndim == 2 else 1
    if positions > 1 and shape[1] != positions:
        raise ValueError(f"row_tail: angles of {positions} positions for rows laid out {shape}")
    per_position = rows // (shape[0] * positions)
    (out,) = ROW_TAIL_KERNEL(
        inputs=[x, weight, cos, sin, constant((float(eps), float(per_position), float(positions)))],
        output_shapes=[shape], output_dtypes=[dtype or x.dtype], grid=(THREADS * rows, 1, 1),
        threadgroup=(THREADS, 1, 1),
        template=[("T", x.dtype), ("D", D), ("R", 0 if rope is None else cos.shape[-1]),
                  ("NORM", norm is not None), ("QDQ", 1 + qdq)])
    return out
