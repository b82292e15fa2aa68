"""Quantize-dequantize with a power-of-two scale per 32 values, in one launch (model-spec §11).

The reference (`dsv4.quant.qdq_fp8` / `qdq_fp4_pow2` in plain MLX ops) is ~8 primitives per
call even compiled (the block maximum is a reduction, fp8 conversion its own op), and a decode
step calls it ~6 times per layer. Here one SIMD group holds one block of 32 values: a
SIMD max gives the block's amax, the scale is built from the exponent bits exactly as the
reference builds it, and each lane rounds its value to e4m3 (fp8) or e2m1 (fp4) by scaling
it to an integer grid and rounding half to even (`rint`), so the result is bit-identical.
Every operation is exact or correctly rounded; no division (the reciprocal of a power of two
is built from bits), so fast-math settings cannot change it.
"""

from __future__ import annotations

import struct

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels.dialect import Kernel, backend, falls_back
from dsv4.quant import FP4, FP4_E4M3_FLOOR, FP8, POW2_FORMATS, _qdq_pow2

BLOCK = 32


def _f32_bits(value: float) -> str:
    return f"0x{struct.unpack('<I', struct.pack('<f', value))[0]:08X}u"



# Shared with other kernels that end in this rounding (dsv4/kernels/rows.py).
HEADER = r"""
KFN float with_sign_of(float r, float y) { return AS_FLOAT(AS_UINT(r) | (AS_UINT(y) & 0x80000000u)); }
KFN float pow2_of_biased(uint32_t e) { return AS_FLOAT(e << 23); }

// Nearest e4m3 (ties to even) of |y| <= 448: quantum 2^(e-3) for normals, 2^-9 below 2^-6.
KFN float round_e4m3(float y) {
  const float a = FABS(y);
  int e = (int)((AS_UINT(a) >> 23) & 0xFFu) - 127;
  e = e < -6 ? -6 : e;
  const float r = RINT(a * pow2_of_biased((uint32_t)(127 - (e - 3)))) * pow2_of_biased((uint32_t)(e - 3 + 127));
  return with_sign_of(r, y);
}

// Nearest e2m1 of |y| <= 6, ties to the even code, sign as the reference applies it.
KFN float round_e2m1(float y) {
  const float a = FABS(y);
  const float v = a > 5.0f ? 6.0f : a >= 3.5f ? 4.0f : a > 2.5f ? 3.0f : a >= 1.75f ? 2.0f
                : a > 1.25f ? 1.5f : a >= 0.75f ? 1.0f : a > 0.25f ? 0.5f : 0.0f;
  return (y < 0.0f ? -1.0f : 1.0f) * v;
}

// v rounded within its block of 32 (its SIMD group: every lane must call this together) to
// e4m3 (FMT 0) or e2m1 (FMT 1) with the power-of-two scale of the block's amax.
template <int FMT>
KFN float qdq_pow2_lane(float v) {
  const float amax = FMAX(simd_max_f(FABS(v)), AS_FLOAT(FMT == 0 ? FP8_FLOOR : FP4_FLOOR));
  const uint32_t t = AS_UINT(amax * AS_FLOAT(FMT == 0 ? FP8_INV_MAX : FP4_INV_MAX));
  const uint32_t e = ((t >> 23) & 0xFFu) + ((t & 0x7FFFFFu) != 0u ? 1u : 0u);
  const float top = FMT == 0 ? FP8_TOP : FP4_TOP;
  const float y = FMIN(FMAX(v * pow2_of_biased(254u - e), -top), top);
  return (FMT == 0 ? round_e4m3(y) : round_e2m1(y)) * pow2_of_biased(e);
}

// Compressed-KV rounding (dsv4.quant.qdq_fp4_e4m3): e2m1 with the e4m3 scale of a 16-value
// block's amax / 6, the divisions correctly rounded as the reference's. amax/6 must be <= 448.
KFN float fp4_e4m3_of(float v, float amax) {
  const float scale = round_e4m3(DIV_RN(FMAX(amax, AS_FLOAT(FP4E4M3_FLOOR)), 6.0f));
  return round_e2m1(FMIN(FMAX(DIV_RN(v, scale), -6.0f), 6.0f)) * scale;
}

// v rounded within its block of 16 (half a SIMD group: every lane must call this together).
KFN float qdq_fp4_e4m3_lane(float v, uint32_t lane) {
  float a = FABS(v);
  for (int o = 8; o > 0; o >>= 1)
    a = FMAX(a, AS_FLOAT((uint32_t)simd_shuffle_i((int)AS_UINT(a), (int)(lane ^ (uint32_t)o))));
  return fp4_e4m3_of(v, a);
}
"""
HEADER = HEADER.replace("FP4E4M3_FLOOR", _f32_bits(FP4_E4M3_FLOOR))
for _fmt, _name in ((FP8, "FP8"), (FP4, "FP4")):   # the reference's constants, as fp32 bits
    _top, _floor, _ = POW2_FORMATS[_fmt]
    HEADER = (HEADER.replace(f"{_name}_FLOOR", _f32_bits(_floor))
              .replace(f"{_name}_INV_MAX", _f32_bits(1.0 / _top))
              .replace(f"{_name}_TOP", f"AS_FLOAT({_f32_bits(_top)})"))

_BODY = r"""
  // grid (elements, 1, 1): one SIMD group per block of 32 values, THREADGROUP / 32 a threadgroup.
  const uint32_t i = group_x * group_threads + tid;
  out[i] = static_cast<T>(qdq_pow2_lane<MODE>(float(x[i])));
"""


def _kernel(fmt: int) -> Kernel:
    name = {FP8: "dsv4_qdq_fp8_pow2", FP4: "dsv4_qdq_fp4_pow2"}[fmt]
    return Kernel(name=name, input_names=("x",), output_names=("out",), body=_BODY, header=HEADER,
                  checks=(((mx.bfloat16,), (mx.bfloat16,), (("T", mx.bfloat16), ("MODE", fmt))),
                          ((mx.float32,), (mx.float32,), (("T", mx.float32), ("MODE", fmt)))))


QDQ_FP8_KERNEL = _kernel(FP8)
QDQ_FP4_KERNEL = _kernel(FP4)


def kernel_applies(x: mx.array, block: int) -> bool:
    return (block == BLOCK and bool(flags.get("kernel_qdq")) and backend() is not None
            and x.dtype in (mx.bfloat16, mx.float16, mx.float32) and x.size > 0
            and x.shape[-1] % BLOCK == 0)


def qdq_pow2_reference(x: mx.array, fmt: int) -> mx.array:
    """Plain-MLX definition of `qdq_pow2_kernel` (dsv4.quant's)."""
    return _qdq_pow2(x, BLOCK, fmt)


@falls_back(qdq_pow2_reference, "kernel_qdq")
def qdq_pow2_kernel(x: mx.array, fmt: int) -> mx.array:
    """x rounded per 32 values to e4m3 (fmt FP8) or e2m1 (FP4) with a power-of-two scale."""
    kernel = QDQ_FP8_KERNEL if fmt == FP8 else QDQ_FP4_KERNEL
    (out,) = kernel(inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype],
                    grid=(x.size, 1, 1), threadgroup=(threadgroup(x.size), 1, 1),
                    template=[("T", x.dtype), ("MODE", fmt)])
    return out


def threadgroup(size: int) -> int:
    """Threads a threadgroup for `size` values (a multiple of BLOCK): the most, up to 256, that
    divide it, so that every threadgroup is whole. A block a threadgroup made a prefill's
    rounding of 4096 x 5120 values 655360 threadgroups of one SIMD group, which an H100 ran at
    0.11 TB/s (0.53 ms: benchmarks/results/2026-12-07-1005-prefill-profile-4096-c4096.md),
    bound by starting them."""
    return next(n for n in (256, 128, 64, BLOCK) if size % n == 0)
