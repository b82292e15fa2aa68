"""Plain numpy reference decoder of EXL3 (exllamav3) trellis tensors: the oracle for the MLX decoder.

Written from the format description (shared/reference/exl3.md §1) and kept deliberately
literal: the tile bitstream is unpacked into single bits and each 16-bit trellis state is
read as a window of that bit list, so it shares no shift arithmetic with `exl3_decode`.

Shapes: `trellis` is int16 [in/16, out/16, 16*K] (EXL3 stores every Linear transposed), so
the reconstructed matrices here are [in, out]; `suh` is [in], `svh` is [out].
"""

from __future__ import annotations

import numpy as np

CODEBOOKS = ("3inst", "mcg", "mul1")
MCG_MULTIPLIER = 0xCBAC1FED
MUL1_MULTIPLIER = 0x83DCD12D
HAD = 128  # every EXL3 Hadamard block is the 128x128 Sylvester matrix


def tensor_core_perm() -> np.ndarray:
    """perm[p] = row*16 + col of the tile element decoded at stream position p (exl3.md §1.6)."""
    perm = np.empty(256, dtype=np.int64)
    for t in range(32):
        r0, c0 = 2 * (t % 4), t // 4
        rows = (r0, r0 + 1, r0 + 8, r0 + 9)
        for j in range(8):
            perm[8 * t + j] = rows[j % 4] * 16 + c0 + (8 if j >= 4 else 0)
    return perm


def codebook_values(codebook: str) -> np.ndarray:
    """fp16 value of each of the 65,536 trellis states (exl3.md §1.5, codebook.cuh)."""
    s = np.arange(65536, dtype=np.uint64)
    if codebook == "mul1":
        x = (s * MUL1_MULTIPLIER) & 0xFFFFFFFF
        byte_sum = sum((x >> (8 * i)) & 0xFF for i in range(4)).astype(np.float64)
        k_inv = float(np.uint16(0x1EEE).view(np.float16))
        k_bias = float(np.uint16(0xC931).view(np.float16))
        # the GPU does one fp16 fma on the exact value 1024+B: float64 then one rounding is identical
        return ((1024.0 + byte_sum) * k_inv + k_bias).astype(np.float16)
    if codebook == "3inst":
        x = (s * 89226354 + 64248484) & 0xFFFFFFFF
    elif codebook == "mcg":
        x = (s * MCG_MULTIPLIER) & 0xFFFFFFFF
    else:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = (x & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (x >> 16).astype(np.uint16).view(np.float16).astype(np.float32)
    # both halves lie in [0.125, 2): the float32 sum is exact, so one rounding equals __hadd
    return (lo + hi).astype(np.float16)


def trellis_states(trellis: np.ndarray) -> np.ndarray:
    """uint16 states [tiles_k, tiles_n, 256] in stream order, read bit by bit from each tile.

    The tile's 16*K int16 values are 8*K little-endian uint32 words; the bitstream is the
    words in order, each MSB first. State p is the 16 bits ending at bit (p+1)*K, wrapping
    around the tile (tail-biting trellis).
    """
    k_bits = trellis.shape[-1] // 16
    words = np.ascontiguousarray(trellis).view("<u4")
    bits = np.unpackbits(words.astype(">u4").view(np.uint8), axis=-1)  # [.., 256K], MSB first
    n_bits = 256 * k_bits
    ends = (np.arange(256) + 1) * k_bits
    window = (ends[:, None] - 16 + np.arange(16)[None, :]) % n_bits  # [256, 16]
    weights = (1 << np.arange(15, -1, -1)).astype(np.uint32)
    return (bits[..., window].astype(np.uint32) @ weights).astype(np.uint16)


def reconstruct(trellis: np.ndarray, codebook: str) -> np.ndarray:
    """The rotated weight Ŵ [in, out] as fp16, exactly as exllamav3's `reconstruct` kernel."""
    check_trellis(trellis)
    tiles_k, tiles_n = trellis.shape[:2]
    values = codebook_values(codebook)[trellis_states(trellis)]  # [tk, tn, 256] stream order
    tiles = np.empty_like(values)
    tiles[..., tensor_core_perm()] = values  # stream position p -> row-major slot perm[p]
    return tiles.reshape(tiles_k, tiles_n, 16, 16).transpose(0, 2, 1, 3).reshape(
        16 * tiles_k, 16 * tiles_n)


def fwht(x: np.ndarray, axis: int) -> np.ndarray:
    """Unnormalised natural-order Walsh-Hadamard transform over 128-blocks of `axis`, float32.

    Fixed butterfly order (bit 0 first), so the MLX decoder can reproduce it bit for bit.
    """
    x = np.moveaxis(np.asarray(x, dtype=np.float32), axis, -1)
    shape = x.shape
    for bit in range(7):
        h = 1 << bit
        y = x.reshape(-1, HAD // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        x = np.stack([a + b, a - b], axis=2).reshape(shape)
    return np.moveaxis(x, -1, axis)


def weight(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, codebook: str) -> np.ndarray:
    """W [in, out] float32 = diag(suh) · H · Ŵ · H · diag(svh) (exl3.md §1.7), H = Sylvester/√128.

    The two unnormalised transforms are scaled once by 1/128 (exact, a power of two).
    """
    w_hat = reconstruct(trellis, codebook)
    check_scales(w_hat.shape, suh, svh)
    w = fwht(fwht(w_hat, axis=0), axis=1) * np.float32(1 / 128)
    return w * suh.astype(np.float32)[:, None] * svh.astype(np.float32)[None, :]


def sylvester(n: int = HAD) -> np.ndarray:
    """H[i, j] = (-1)^popcount(i & j) / √n, float64."""
    i = np.arange(n)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    return (1 - 2 * parity) / np.sqrt(n)


def weight_dense(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, codebook: str) -> np.ndarray:
    """The same W computed the textbook way, with float64 block-diagonal matmuls."""
    w_hat = reconstruct(trellis, codebook).astype(np.float64)
    check_scales(w_hat.shape, suh, svh)
    k, n = w_hat.shape
    h = sylvester()
    w = (h @ w_hat.reshape(k // HAD, HAD, n)).reshape(k, n)
    w = (w.reshape(k, n // HAD, HAD) @ h).reshape(k, n)
    return w * suh.astype(np.float64)[:, None] * svh.astype(np.float64)[None, :]


def stepwise_fp16_weight(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray,
                         codebook: str) -> np.ndarray:
    """W [in, out] fp16 rounded like exllamav3's Python `LinearEXL3.get_weight_tensor`.

    That path rounds to fp16 after each Hadamard (an fp32 matmul with H/√128) and after each
    scale. Its cuBLAS summation order is not reproducible, so this matches it only within
    that noise (a few ulps on under 1% of elements).
    """
    w_hat = reconstruct(trellis, codebook)
    check_scales(w_hat.shape, suh, svh)
    scale = np.float32(1 / np.sqrt(HAD))
    w = (fwht(w_hat, axis=0) * scale).astype(np.float16)
    w = (w.astype(np.float32) * suh.astype(np.float32)[:, None]).astype(np.float16)
    w = (fwht(w, axis=1) * scale).astype(np.float16)
    return (w.astype(np.float32) * svh.astype(np.float32)[None, :]).astype(np.float16)


def fused_kernel_weight(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray,
                        codebook: str) -> np.ndarray:
    """W [in, out] fp16 rounded exactly as exllamav3's `reconstruct_had_slice` kernel.

    That kernel works in fp16: along the input axis, two butterfly stages, a multiply by
    fp16(1/√128), then five; along the output axis, two stages in float32, one fp16
    rounding, the same multiply, five fp16 stages; then ·suh and ·svh in fp16. Every fp16
    operation is emulated as float32 then one rounding, which is exact for + and ·
    (float32 has more than 2·11+2 significand bits).
    """
    w_hat = reconstruct(trellis, codebook)
    check_scales(w_hat.shape, suh, svh)
    scale = np.float16(0.08838834764831845)

    def half(x):
        return x.astype(np.float16)

    def stage(x, bit, rounding):  # one butterfly over bit `bit` of the last axis (128-blocks)
        h = 1 << bit
        shape = x.shape
        y = x.astype(np.float32).reshape(-1, HAD // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        return rounding(np.stack([a + b, a - b], axis=2)).reshape(shape)

    x = np.ascontiguousarray(w_hat.T)  # input axis last
    for bit in (0, 1):
        x = stage(x, bit, half)
    x = half(x.astype(np.float32) * np.float32(scale))
    for bit in range(2, 7):
        x = stage(x, bit, half)
    x = np.ascontiguousarray(x.T)  # output axis last
    x = stage(stage(x, 0, lambda v: v), 1, half)
    x = half(x.astype(np.float32) * np.float32(scale))
    for bit in range(2, 7):
        x = stage(x, bit, half)
    x = half(x.astype(np.float32) * suh.astype(np.float32)[:, None])
    return half(x.astype(np.float32) * svh.astype(np.float32)[None, :])


def check_trellis(trellis: np.ndarray) -> None:
    if trellis.dtype != np.int16 or trellis.ndim != 3 or trellis.shape[-1] % 16 \
            or not 1 <= trellis.shape[-1] // 16 <= 8:
        raise ValueError(f"trellis must be int16 [in/16, out/16, 16*K] with K in 1..8, "
                         f"got {trellis.dtype} {list(trellis.shape)}")


def check_scales(shape: tuple[int, int], suh: np.ndarray, svh: np.ndarray) -> None:
    k, n = shape
    if k % HAD or n % HAD:
        raise ValueError(f"Hadamard blocks need both dims divisible by {HAD}, got [{k}, {n}]")
    if suh.shape != (k,) or svh.shape != (n,):
        raise ValueError(f"suh must be [{k}] and svh [{n}], got {list(suh.shape)} and "
                         f"{list(svh.shape)}")
