"""GGUF quantized blocks, kept byte for byte, and their exact decoding in plain MLX.

A GGUF row holds one output neuron: blocks of `BLOCK_WEIGHTS` values along the input, each
`BLOCK_BYTES` bytes. Decoding follows ggml's formulas in fp32 with the operations in the
order gguf-py's numpy decoders take them, so the values are those gguf-py gives, bit for bit:

  Q8_0     34 B / 32:   f16 d, int8 q[32];                      w = d * q
  Q4_K    144 B / 256:  f16 d, f16 dmin, 12 B of 6-bit scale/min pairs for 8 sub-blocks
                        of 32, 128 B of nibbles (byte l of chunk c: element 64c + l low,
                        64c + 32 + l high);                      w = (d sc_j) q - dmin m_j
  Q2_K     84 B / 256:  16 B of 4-bit scale | 4-bit min for 16 sub-blocks of 16, 64 B of
                        2-bit codes (byte l of half h, bits 2j: element 128h + 32j + l),
                        f16 d, f16 dmin;                         w = (d sc_s) q - dmin m_s
  IQ2_XXS  66 B / 256:  f16 d, then per sub-block of 32 two u32: 4 grid indices (bytes),
                        and 4 x 7-bit sign indices + a 4-bit scale ls (top bits);
                        db = d (0.5 + ls) / 4, w = db * grid[g][k] * (-1 if sign bit k)

The IQ2_XXS grid (256 entries of 8 values in {8, 25, 43}) is ggml's table as gguf-py
ships it; the sign table is computed (7 bits and their parity).

These decoders are the reference the GPU kernels are checked against and what the CPU
runs; the GGUF converter dequantizes through them too.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from .errors import InputError

TYPES = ("Q8_0", "Q4_K", "Q2_K", "IQ2_XXS")
BLOCK_BYTES = {"Q8_0": 34, "Q4_K": 144, "Q2_K": 84, "IQ2_XXS": 66}
BLOCK_WEIGHTS = {"Q8_0": 32, "Q4_K": 256, "Q2_K": 256, "IQ2_XXS": 256}


class BlockError(InputError):
    """Raw rows that do not hold whole blocks of their type."""


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one row of `in_features` values."""
    check_type(qtype)
    if in_features % BLOCK_WEIGHTS[qtype]:
        raise BlockError(f"{qtype} rows hold multiples of {BLOCK_WEIGHTS[qtype]} values, not {in_features}")
    return in_features // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]


def in_features(qtype: str, nbytes: int) -> int:
    """Values in a row of `nbytes` bytes."""
    check_type(qtype)
    if nbytes % BLOCK_BYTES[qtype]:
        raise BlockError(f"{qtype} rows are multiples of {BLOCK_BYTES[qtype]} bytes, not {nbytes}")
    return nbytes // BLOCK_BYTES[qtype] * BLOCK_WEIGHTS[qtype]


def bits_per_weight(qtype: str) -> float:
    return 8 * BLOCK_BYTES[qtype] / BLOCK_WEIGHTS[qtype]


def check_type(qtype: str) -> None:
    if qtype not in BLOCK_BYTES:
        raise BlockError(f"GGUF block type {qtype!r}: expected one of {', '.join(TYPES)}")


def dequantize(raw: mx.array, qtype: str) -> mx.array:
    """raw uint8 [..., row bytes] -> fp32 [..., in_features], exactly as the blocks decode."""
    if raw.dtype != mx.uint8:
        raise BlockError(f"{qtype} rows must be uint8 bytes, got {raw.dtype}")
    lead, nbytes = raw.shape[:-1], raw.shape[-1]
    n_in = in_features(qtype, nbytes)
    blocks = raw.reshape(-1, BLOCK_BYTES[qtype])
    return _DECODERS[qtype](blocks).reshape(*lead, n_in)


def _f16(blocks: mx.array, at: int) -> mx.array:
    """The f16 at byte `at` of each block, as fp32 [n, 1]."""
    return blocks[:, at:at + 2].view(mx.float16).astype(mx.float32)


def _q8_0(blocks: mx.array) -> mx.array:
    return blocks[:, 2:].view(mx.int8).astype(mx.float32) * _f16(blocks, 0)


def q4_k_scale_min(packed: mx.array) -> tuple[mx.array, mx.array]:
    """The 12 bytes [n, 12] -> 6-bit scales and mins [n, 8]: bytes 0-3 hold scales 0-3 (and
    the top bits of 4-7), 4-7 mins 0-3 (and the top bits of 4-7), 8-11 the low nibbles of
    scales and mins 4-7."""
    d, m, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = mx.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = mx.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(blocks: mx.array) -> mx.array:
    n = blocks.shape[0]
    sc, mn = q4_k_scale_min(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * sc.astype(mx.float32))[..., None]          # [n, 8, 1]
    low = (_f16(blocks, 2) * mn.astype(mx.float32))[..., None]
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> mx.array([0, 4], mx.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, 8, 32).astype(mx.float32)
    return (scale * q - low).reshape(n, 256)


def _q2_k(blocks: mx.array) -> mx.array:
    n = blocks.shape[0]
    scales = blocks[:, :16]
    step = (_f16(blocks, 80) * (scales & 0x0F).astype(mx.float32)).reshape(n, 16, 1)
    low = (_f16(blocks, 82) * (scales >> 4).astype(mx.float32)).reshape(n, 16, 1)
    shifts = mx.array([0, 2, 4, 6], mx.uint8).reshape(1, 1, 4, 1)
    q = ((blocks[:, 16:80].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 16, 16).astype(mx.float32)
    return (step * q - low).reshape(n, 256)


@lru_cache(maxsize=1)
def iq2_xxs_grid() -> np.ndarray:
    """ggml's IQ2_XXS grid [256, 8] (values 8, 25 and 43), from gguf-py."""
    from gguf.quants import IQ2_XXS

    IQ2_XXS.init_grid()
    return np.ascontiguousarray(IQ2_XXS.grid.reshape(256, 8), np.float32)


@lru_cache(maxsize=1)
def iq2_xxs_signs() -> np.ndarray:
    """The sign table [128]: 7 sign bits and, as the 8th, their parity (an even count of
    minus signs in each 8)."""
    i = np.arange(128, dtype=np.uint8)
    parity = np.unpackbits(i[:, None], axis=1).sum(1) & 1
    return (i | (parity.astype(np.uint8) << 7)).astype(np.uint8)


def _iq2_xxs(blocks: mx.array) -> mx.array:
    n = blocks.shape[0]
    words = blocks[:, 2:].view(mx.uint32).reshape(n, 8, 2)
    aux = words[..., 1]
    db = _f16(blocks, 0) * (0.5 + (aux >> 28).astype(mx.float32)) * 0.25   # [n, 8]
    sign_index = (aux[..., None] >> mx.array([0, 7, 14, 21], mx.uint32)) & 0x7F     # [n, 8, 4]
    signs = mx.array(iq2_xxs_signs())[sign_index]                                     # uint8
    bit = (signs[..., None] >> mx.arange(8, dtype=mx.uint8)) & 1                     # [n, 8, 4, 8]
    sign = mx.where(bit == 0, mx.array(1.0, mx.float32), mx.array(-1.0, mx.float32))
    grid_index = blocks[:, 2:].reshape(n, 8, 8)[..., :4].astype(mx.uint32)         # bytes 0-3 of word 0
    grid = mx.array(iq2_xxs_grid())[grid_index]                                       # [n, 8, 4, 8]
    return (db[..., None, None] * grid * sign).reshape(n, 256)


_DECODERS = {"Q8_0": _q8_0, "Q4_K": _q4_k, "Q2_K": _q2_k, "IQ2_XXS": _iq2_xxs}
