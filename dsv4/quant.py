"""fp8/fp4 numerics of the official model (model-spec §11) and weight packing.

QDQ ("quantize-dequantize") helpers reproduce the roundings the official model
applies to activations: window KV and matmul inputs to fp8 e4m3 with power-of-two
scales per 32 values, indexer q/k to fp4 with power-of-two scales per 32, and the
compressed KV to fp4 with an e4m3 scale per 16. Power-of-two scales are built from
the exponent bits (the reference's bit trick), not from a float log2, so they are
exact. All helpers return the input's dtype.

Packing: official fp8 weights with 32x32 e8m0 block scales are MLX `mxfp8` once each
block scale is repeated over its 32 rows; official fp4 experts (two e2m1 per byte,
low nibble first, e8m0 per 32 inputs) are MLX `mxfp4` as they lie. Both are exact.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_E4M3_FLOOR = FP4_MAX * 2.0**-9   # amax floor of qdq_fp4_e4m3: its scale stays >= e4m3's least value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _pow2_ceil(v: mx.array) -> mx.array:
    """2**ceil(log2(v)) for positive normal fp32 v, exactly: exponent + (mantissa != 0)."""
    bits = v.view(mx.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(mx.int32) + ((bits & 0x7FFFFF) != 0).astype(mx.int32)
    return (exponent.astype(mx.uint32) << 23).view(mx.float32)


def _blocks(x: mx.array, block: int) -> mx.array:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block size {block}")
    return x.astype(mx.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def round_e4m3(x: mx.array) -> mx.array:
    """fp32 -> nearest e4m3 (ties to even), back to fp32. |x| must be <= 448."""
    return mx.from_fp8(mx.to_fp8(x), mx.float32)


def round_e2m1(x: mx.array) -> mx.array:
    """fp32 -> nearest e2m1 magnitude (ties to the even code), keeping the sign. |x| <= 6."""
    mag = mx.abs(x)
    code = mx.zeros(mag.shape, mx.int32)
    # Ties go to the even code: down at 0.25, 1.25, 2.5, 5; up at 0.75, 1.75, 3.5.
    for t in (0.25, 1.25, 2.5, 5.0):
        code = code + (mag > t).astype(mx.int32)
    for t in (0.75, 1.75, 3.5):
        code = code + (mag >= t).astype(mx.int32)
    return mx.where(x < 0, -1.0, 1.0) * mx.array(E2M1_VALUES, mx.float32)[code]


# The roundings with a power-of-two scale per block: format id -> (largest value, amax floor,
# rounding to the format's grid). The GPU kernel (dsv4/kernels/qdq.py) builds from this table.
FP8, FP4 = 0, 1
POW2_FORMATS = {FP8: (FP8_MAX, 1e-4, round_e4m3), FP4: (FP4_MAX, FP4_MAX * 2.0**-126, round_e2m1)}


def _compiled(fn):
    """fn as one compiled graph (a dozen element-wise ops each) when DSV4_COMPILE is on."""
    compiled = mx.compile(fn)

    def call(x: mx.array, *constants) -> mx.array:
        from . import flags

        return compiled(x, *constants) if flags.get("compile") else fn(x, *constants)

    call.__doc__, call.__name__ = fn.__doc__, fn.__name__
    return call


def _qdq_pow2_dispatch(x: mx.array, block: int, fmt: int) -> mx.array:
    from .kernels import qdq   # imports this module's table: not at the top

    return qdq.qdq_pow2_kernel(x, fmt) if qdq.kernel_applies(x, block) else _qdq_pow2(x, block, fmt)


def qdq_fp8(x: mx.array, block: int = 32) -> mx.array:
    """Window KV / matmul-input rounding: e4m3 with a power-of-two scale per `block` values."""
    return _qdq_pow2_dispatch(x, block, FP8)


def qdq_fp4_pow2(x: mx.array, block: int = 32) -> mx.array:
    """Indexer q/k rounding: e2m1 with a power-of-two (e8m0) scale per `block` values."""
    return _qdq_pow2_dispatch(x, block, FP4)


def qdq_fp4_e4m3(x: mx.array, block: int = 16) -> mx.array:
    """Compressed KV rounding: e2m1 with an e4m3 scale (amax / 6) per `block` values."""
    return _qdq_fp4_e4m3(x, block)


@_compiled
def _qdq_pow2(x: mx.array, block: int, fmt: int) -> mx.array:
    top, floor, to_grid = POW2_FORMATS[fmt]
    b = _blocks(x, block)
    amax = mx.maximum(mx.max(mx.abs(b), axis=-1, keepdims=True), floor)
    scale = _pow2_ceil(amax * np.float32(1.0 / top))
    q = to_grid(mx.clip(b / scale, -top, top)) * scale
    return q.reshape(x.shape).astype(x.dtype)


@_compiled
def _qdq_fp4_e4m3(x: mx.array, block: int) -> mx.array:
    b = _blocks(x, block)
    amax = mx.maximum(mx.max(mx.abs(b), axis=-1, keepdims=True), FP4_E4M3_FLOOR)
    scale = round_e4m3(amax / FP4_MAX)
    q = round_e2m1(mx.clip(b / scale, -FP4_MAX, FP4_MAX)) * scale
    return q.reshape(x.shape).astype(x.dtype)


# --- packing of official fp8 / fp4 weights into MLX quantized layouts ------------------

def pack_fp8_block32(weight: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp8 e4m3 codes [out, in] + e8m0 32x32 block scales [ceil(out/32), in/32] ->
    (mxfp8 weight as uint32 [out, in/4], per-row scales uint8 [out, in/32])."""
    out_dim, in_dim = weight.shape
    if in_dim % 32:
        raise ValueError(f"fp8 weight {weight.shape}: input dim must be a multiple of 32")
    if scale.shape != ((out_dim + 31) // 32, in_dim // 32):
        raise ValueError(f"fp8 weight {weight.shape}: expected block scales "
                         f"{((out_dim + 31) // 32, in_dim // 32)}, got {scale.shape}")
    rows = np.repeat(scale, 32, axis=0)[:out_dim]
    return np.ascontiguousarray(weight).view(np.uint32), np.ascontiguousarray(rows)


def pack_fp4(weight: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp4 codes, two per byte [..., out, in/2] + e8m0 [..., out, in/32] ->
    (mxfp4 weight as uint32 [..., out, in/8], scales uint8). Nibble order already matches."""
    if weight.shape[-1] * 2 != scale.shape[-1] * 32 or weight.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"fp4 weight {weight.shape} does not match its scales {scale.shape}")
    return np.ascontiguousarray(weight).view(np.uint32), np.ascontiguousarray(scale)
