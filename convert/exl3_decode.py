"""EXL3 (exllamav3) trellis decoder in MLX array operations: CPU here, Metal or CUDA elsewhere.

Format: shared/reference/exl3.md §1. A quantised Linear is stored transposed: `trellis`
int16 [in/16, out/16, 16*K], `suh` fp16 [in], `svh` fp16 [out], and a marker tensor
(`mcg` / `mul1` / none) naming the codebook. Every step here is a whole-array op, equal bit
for bit to the numpy oracle `exl3_reference` (tests/test_exl3_decode.py).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from .exl3_reference import CODEBOOKS, HAD, MCG_MULTIPLIER, MUL1_MULTIPLIER, check_trellis, \
    tensor_core_perm


@lru_cache(maxsize=None)
def codebook_table(codebook: str) -> mx.array:
    """fp16 value of each of the 65,536 states, computed with uint32 wrap-around in MLX."""
    s = mx.arange(65536, dtype=mx.uint32)
    if codebook == "mul1":
        x = s * mx.array(MUL1_MULTIPLIER, mx.uint32)
        byte_sum = sum((x >> (8 * i)) & 0xFF for i in range(4))
        # (1024+B)·h(0x1EEE) is exact in float32 (22 significant bits), and so is adding
        # h(0xC931): one rounding to fp16, like the GPU's single __hfma
        k_inv = mx.array([0x1EEE], mx.uint16).view(mx.float16).astype(mx.float32)
        k_bias = mx.array([0xC931], mx.uint16).view(mx.float16).astype(mx.float32)
        return ((1024 + byte_sum).astype(mx.float32) * k_inv + k_bias).astype(mx.float16)
    if codebook == "3inst":
        x = s * mx.array(89226354, mx.uint32) + mx.array(64248484, mx.uint32)
    elif codebook == "mcg":
        x = s * mx.array(MCG_MULTIPLIER, mx.uint32)
    else:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = (x & 0xFFFF).astype(mx.uint16).view(mx.float16).astype(mx.float32)
    hi = (x >> 16).astype(mx.uint16).view(mx.float16).astype(mx.float32)
    return (lo + hi).astype(mx.float16)  # exact float32 sum, one rounding = __hadd


@lru_cache(maxsize=None)
def state_gather(k_bits: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Per row-major tile slot q: the words holding its 16-bit state and the shift.

    The state of stream position p is bits [(p+1)K-16, (p+1)K) of the tile's MSB-first
    word stream (mod 256K). It lies in word `last` shifted right by `shift`, plus the low
    bits of word `first` when the window straddles a word boundary (shift > 16).
    """
    p = np.argsort(tensor_core_perm())  # stream position decoded into slot q
    end = (p + 1) * k_bits + 256 * k_bits  # one past the window's last bit, kept positive
    words = 8 * k_bits
    last = ((end - 1) // 32) % words
    first = ((end - 16) // 32) % words
    shift = ((end - 1) // 32 + 1) * 32 - end
    high_shift = np.where(shift > 16, 32 - shift, 32)  # 32: the window lies in `last` alone
    return tuple(mx.array(a.astype(np.uint32)) for a in (first, last, shift, high_shift))


def trellis_words(trellis) -> mx.array:
    """The trellis as little-endian uint32 words [tiles_k, tiles_n, 8K] (int16 is a container)."""
    if isinstance(trellis, np.ndarray):
        check_trellis(trellis)
        return mx.array(np.ascontiguousarray(trellis).view("<u4"))
    if trellis.dtype != mx.int16 or trellis.ndim != 3 or trellis.shape[-1] % 16 \
            or not 1 <= trellis.shape[-1] // 16 <= 8:
        raise ValueError(f"trellis must be int16 [in/16, out/16, 16*K] with K in 1..8, "
                         f"got {trellis.dtype} {list(trellis.shape)}")
    return trellis.view(mx.uint32)


def tile_values(trellis, codebook: str) -> mx.array:
    """fp16 values [tiles_k, tiles_n, 16, 16], each tile row-major (rows = input features)."""
    words = trellis_words(trellis)
    k_bits = words.shape[-1] // 8
    first, last, shift, high_shift = state_gather(k_bits)
    low = mx.right_shift(mx.take(words, last, axis=-1), shift)
    # a shift of 32 is not defined in C; mask those slots out instead of relying on it
    high = mx.left_shift(mx.take(words, first, axis=-1), mx.minimum(high_shift, 31))
    high = mx.where(high_shift < 32, high, 0)
    states = (low | high) & 0xFFFF
    values = mx.take(codebook_table(codebook), states.astype(mx.int32))
    return values.reshape(*words.shape[:2], 16, 16)


def reconstruct(trellis, codebook: str) -> mx.array:
    """The rotated weight Ŵ [in, out] fp16, bit for bit exllamav3's `reconstruct` kernel."""
    v = tile_values(trellis, codebook)
    tk, tn = v.shape[:2]
    return v.transpose(0, 2, 1, 3).reshape(16 * tk, 16 * tn)


def fwht(x: mx.array) -> mx.array:
    """Unnormalised natural-order Walsh-Hadamard over 128-blocks of axis 0 of a 2-D array, float32.

    Same butterfly order as `exl3_reference.fwht`, so the sums round identically. The 128 row
    slabs of the blocks are kept as separate arrays through all seven stages and stacked once:
    about six times faster on CPU than stacking after every stage.
    """
    rows, cols = x.shape
    blocks = x.reshape(rows // HAD, HAD, cols)
    slabs = [blocks[:, i] for i in range(HAD)]
    for bit in range(7):
        step = 1 << bit
        for i in range(HAD):
            if not i & step:
                a, b = slabs[i], slabs[i + step]
                slabs[i], slabs[i + step] = a + b, a - b
    return mx.stack(slabs, axis=1).reshape(rows, cols)


def linear_weight(trellis, suh, svh, codebook: str) -> mx.array:
    """The Linear's weight in PyTorch/MLX layout [out, in] float32: (diag(suh)·H·Ŵ·H·diag(svh))ᵀ."""
    v = tile_values(trellis, codebook)
    tk, tn = v.shape[:2]
    k, n = 16 * tk, 16 * tn
    if k % HAD or n % HAD:
        raise ValueError(f"Hadamard blocks need both dims divisible by {HAD}, got in={k} out={n}")
    suh, svh = mx.array(suh), mx.array(svh)
    if suh.shape != (k,) or svh.shape != (n,):
        raise ValueError(f"suh must be [{k}] and svh [{n}], got {list(suh.shape)} and "
                         f"{list(svh.shape)}")
    w = v.transpose(0, 2, 1, 3).reshape(k, n).astype(mx.float32)  # Ŵ [in, out]
    w_t = fwht(fwht(w).T) * mx.array(1 / 128, mx.float32)  # input side, then output side
    return w_t * suh.astype(mx.float32)[None, :] * svh.astype(mx.float32)[:, None]
