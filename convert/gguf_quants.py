"""GGUF quantized blocks -> MLX affine quantization (group size 32), in numpy.

MLX affine: per group of 32 inputs, w = scale * code + bias, codes packed LSB-first into
uint32 words (`mx.dequantize(weight, scales, biases, group_size=32, bits=b)`).

  Q8_0    -> 8-bit, exact: code = q + 128, scale = d, bias = -128 d (f16 holds both exactly).
  Q4_K    -> 4-bit, exact: the 32-element sub-blocks are MLX groups; scale = d*sc and
             bias = -dmin*m need up to 17 mantissa bits, so they are f32.
  IQ2_XXS -> every 32-element sub-block holds db * {±8, ±25, ±43}. 3-bit (lossy): the six
             levels go to codes 0..5 on their least-squares line; 8-bit (exact, f32):
             code = level + 43, scale = db, bias = -43 db.
  Q2_K    -> lossy: a group of 32 joins two 16-element sub-blocks with their own scale and
             min, which share no grid; fitted per group on its 8 distinct values weighted by
             their counts (min/max start, then Lloyd steps: nearest codes <-> least-squares
             scale and bias), scale and bias in f16. ~3.4% added error at 4 bits, 0.2% at 8.
  MXFP4   -> MLX mxfp4, exact (`mxfp4`): the same e2m1 codes and e8m0 scales, nibbles reordered
             (ds4's DSpark support files hold the released fp4 experts so).

Every function takes the raw rows of a tensor, uint8 [..., bytes per row] (one GGUF row is
one output neuron, blocks along the input), and returns an `Affine` whose arrays have the
same leading shape. Lossy mappings also return the squared error they add and the squared
norm of the source values, so a converter can report relative RMS errors.

Block sizes, the IQ2_XXS grid and sign table and Q4_K's packed scales are dsv4.gguf_blocks'
(the runtime's decoders); gguf-py is the tests' independent oracle, not a code path here.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from dsv4 import gguf_blocks
from dsv4.errors import InputError

GROUP = 32
BLOCK_BYTES = {T[name]: size for name, size in gguf_blocks.BLOCK_BYTES.items()}
BLOCK_WEIGHTS = {T[name]: n for name, n in gguf_blocks.BLOCK_WEIGHTS.items()}
# IQ2_XXS levels in code order and their least-squares line code -> level (3-bit map).
_IQ2_LEVELS = np.array([-43, -25, -8, 8, 25, 43], np.float64)
_IQ2_SLOPE = float(np.polyfit(np.arange(6), _IQ2_LEVELS, 1)[0])


@dataclass
class Affine:
    weight: np.ndarray   # uint32 [..., out, in * bits / 32]
    scales: np.ndarray   # f16 or f32 [..., out, in / 32]
    biases: np.ndarray   # same dtype and shape as scales
    bits: int
    exact: bool
    err_sq: float = 0.0  # sum of squared differences to the source values (lossy only)
    ref_sq: float = 0.0  # sum of squared source values (lossy only)

    @property
    def quantization(self) -> dict:
        return {"group_size": GROUP, "bits": self.bits, "mode": "affine"}


class QuantError(InputError):
    """Raw rows that do not hold whole blocks of the type."""


def _blocks(raw: np.ndarray, qtype: T) -> tuple[np.ndarray, tuple[int, ...]]:
    """raw [..., row bytes] -> blocks [n, block bytes] and the leading shape."""
    size = BLOCK_BYTES[qtype]
    if raw.dtype != np.uint8 or raw.shape[-1] % size:
        raise QuantError(f"{qtype.name} rows must be uint8 with a multiple of {size} bytes, got "
                         f"{raw.dtype} {list(raw.shape)}")
    return np.ascontiguousarray(raw).reshape(-1, size), raw.shape[:-1]


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [..., n] (n a multiple of 32) -> uint32 [..., n * bits / 32], LSB first."""
    codes = np.ascontiguousarray(codes, np.uint8)
    lead, n = codes.shape[:-1], codes.shape[-1]
    if bits == 8:
        return codes.view("<u4").reshape(*lead, n // 4)
    if bits == 4:
        return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)).view("<u4")
    # 32 codes fill `bits` words exactly; code k starts at bit bits*k of the group.
    # Transposed, so that each step works on contiguous rows.
    groups = np.ascontiguousarray(codes.reshape(-1, 32).T).astype(np.uint32)
    words = np.zeros((bits, groups.shape[1]), np.uint32)
    for k in range(32):
        word, shift = divmod(bits * k, 32)
        words[word] |= groups[k] << np.uint32(shift)
        if shift + bits > 32:  # straddles into the next word
            words[word + 1] |= groups[k] >> np.uint32(32 - shift)
    return np.ascontiguousarray(words.T).reshape(*lead, n * bits // 32)


def q8_0(raw: np.ndarray) -> Affine:
    blocks, lead = _blocks(raw, T.Q8_0)
    d = blocks[:, :2].copy().view(np.float16)                      # [n, 1]
    codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    # -128 d is exact in f16 unless it overflows, which needs weights near 65504.
    biases = d.astype(np.float32) * -128
    if not np.all(np.abs(biases) <= 65504):
        raise QuantError(f"Q8_0 block {int(np.argmax(np.abs(biases) > 65504))}: scale "
                         f"{float(d[np.abs(biases) > 65504][0])} is too large for an f16 bias")
    return Affine(pack_codes(codes.reshape(*lead, -1), 8), d.reshape(*lead, -1),
                  biases.astype(np.float16).reshape(*lead, -1), 8, True)


def q4_k(raw: np.ndarray) -> Affine:
    blocks, lead = _blocks(raw, T.Q4_K)
    n = len(blocks)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = (np.array(a) for a in gguf_blocks.q4_k_scale_min(mx.array(blocks[:, 4:16])))  # [n, 8]
    # 4 chunks of 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c+1.
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(*lead, -1)
    scales = (d * sc.astype(np.float32)).reshape(*lead, -1)
    biases = -(dmin * m.astype(np.float32)).reshape(*lead, -1)
    return Affine(pack_codes(codes, 4), scales, biases, 4, True)


def _iq2_xxs_tables():
    """For every (grid index, sign index) pair = 8 weights: their 3-bit level codes packed
    into 24 bits, their 8-bit exact codes (level + 43) as 8 bytes, and how often each of
    the six levels occurs. 256 x 128 entries, built once."""
    global _IQ2_TABLES
    if _IQ2_TABLES is None:
        grid = gguf_blocks.iq2_xxs_grid().reshape(256, 1, 8).astype(np.int16)  # 8, 25 or 43
        signs = gguf_blocks.iq2_xxs_signs().reshape(1, 128, 1)
        negative = (signs >> np.arange(8, dtype=np.uint8)) & 1                 # [1, 128, 8]
        levels = np.where(negative == 1, -grid, grid)                          # [256, 128, 8]
        index = np.searchsorted(_IQ2_LEVELS, levels).astype(np.uint32)         # 0..5
        packed3 = (index << (3 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
        exact8 = np.ascontiguousarray((levels + 43).astype(np.uint8)).view("<u8")[..., 0]
        counts = (index[..., None] == np.arange(8)).sum(-2, dtype=np.uint8)   # [256, 128, 8]
        # one byte per level: four entries (a group) add up without carries (<= 32 each)
        counts = np.ascontiguousarray(counts).view("<u8")[..., 0]
        _IQ2_TABLES = (packed3.reshape(-1), exact8.reshape(-1), counts.reshape(-1))
    return _IQ2_TABLES


_IQ2_TABLES = None


def iq2_xxs(raw: np.ndarray, bits: int = 3) -> Affine:
    blocks, lead = _blocks(raw, T.IQ2_XXS)
    n = len(blocks)
    packed3, exact8, counts = _iq2_xxs_tables()
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 2:].copy().view("<u4").reshape(n, 8, 2)                    # per 32-group
    db = d * (np.float32(0.5) + (qs[..., 1] >> 28).astype(np.float32)) * np.float32(0.25)
    grid = qs[..., 0].copy().view(np.uint8).reshape(n, 8, 4).astype(np.uint32)
    sign = (qs[..., 1][..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 0x7F
    entry = grid * 128 + sign                                                  # [n, 8, 4]
    if bits == 8:
        weight = exact8[entry].reshape(*lead, -1).view("<u4")
        return Affine(weight, db.reshape(*lead, -1), (db * np.float32(-43)).reshape(*lead, -1),
                      8, True)
    if bits != 3:
        raise QuantError(f"IQ2_XXS maps to 3-bit (level map) or 8-bit (exact), not {bits}-bit")
    c = packed3[entry]                                    # 4 x 24 bits -> 3 words per group
    words = np.stack([c[..., 0] | (c[..., 1] << 24), (c[..., 1] >> 8) | (c[..., 2] << 16),
                      (c[..., 2] >> 16) | (c[..., 3] << 8)], axis=-1)
    scales = (db * np.float32(_IQ2_SLOPE)).astype(np.float16)
    biases = (db * np.float32(-2.5 * _IQ2_SLOPE)).astype(np.float16)
    # error from the level counts: level k of a group lands on s*k + b instead of db*L_k
    per_entry = counts[entry]
    count = per_entry[..., 0] + per_entry[..., 1] + per_entry[..., 2] + per_entry[..., 3]
    count = count.view(np.uint8).reshape(n, 8, 8)[..., :6]
    k = np.arange(6, dtype=np.float64)
    got = scales.astype(np.float64)[..., None] * k + biases.astype(np.float64)[..., None]
    ref = db.astype(np.float64)[..., None] * _IQ2_LEVELS
    return Affine(words.reshape(*lead, -1), scales.reshape(*lead, -1), biases.reshape(*lead, -1),
                  3, False, float(np.sum(count * np.square(got - ref))),
                  float(np.sum(count * np.square(ref))))


def fit_affine(values: np.ndarray, bits: int, steps: int = 2, weights: np.ndarray = None):
    """Per row of `values` [g, k] (with `weights`, counts of each value; default 1): f16
    (scale, bias) and codes minimising the weighted squared error, from the min/max grid
    improved by `steps` Lloyd steps (nearest codes <-> least-squares line); per row the better
    of the two after rounding to f16, so never worse than min/max."""
    top = (1 << bits) - 1
    # transposed to [k, g]: sums over k become k - 1 adds of contiguous rows, which numpy
    # does far faster than reductions over a short last axis
    v = np.ascontiguousarray(values.T, np.float32)
    w = np.ones_like(v) if weights is None else np.ascontiguousarray(weights.T, np.float32)
    present = w > 0
    lo = np.where(present, v, np.inf).min(0)
    hi = np.where(present, v, -np.inf).max(0)
    s = np.where(hi > lo, (hi - lo) / top, 1.0).astype(np.float32)
    b = lo.astype(np.float32)
    start = (s, b)
    total = w.sum(0)
    wv = w * v
    sv = wv.sum(0)
    for _ in range(steps):
        c = np.clip(np.rint((v - b) / s), 0, top)
        wc = w * c
        sc = wc.sum(0)
        den = total * (wc * c).sum(0) - sc * sc
        ok = den > 0
        new_s = np.where(ok, (total * (wc * v).sum(0) - sc * sv) / np.where(ok, den, 1), s)
        ok &= new_s > 0
        s = np.where(ok, new_s, s).astype(np.float32)
        b = np.where(ok, (sv - s * sc) / total, b).astype(np.float32)
    best = None
    for s, b in (start, (s, b)) if steps else (start,):
        with np.errstate(over="ignore"):
            s16, b16 = s.astype(np.float16), b.astype(np.float16)
        bad = ~(np.isfinite(s16) & np.isfinite(b16))
        if bad.any():
            raise QuantError(f"group {int(np.argmax(bad))}: values up to "
                             f"{float(np.abs(v[:, bad]).max())} do not fit an f16 scale and bias")
        s32, b32 = s16.astype(np.float32), b16.astype(np.float32)
        safe = np.where(s32 == 0, np.float32(1), s32)
        c = np.clip(np.rint((v - b32) / safe), 0, top).astype(np.uint8)
        err = (w * np.square(s32 * c + b32 - v)).sum(0)
        if best is None:
            best = [s16, b16, c, err]
        else:
            better = err < best[3]
            best = [np.where(better, s16, best[0]), np.where(better, b16, best[1]),
                    np.where(better, c, best[2]), np.minimum(err, best[3])]
    return best[0], best[1], np.ascontiguousarray(best[2].T)


def q2_k(raw: np.ndarray, bits: int = 4, steps: int = 2) -> Affine:
    """A group of 32 holds at most 8 distinct values (two 16-element sub-blocks, each
    d*sc*q - dmin*m for q = 0..3): fit on those, weighted by how often each q occurs."""
    blocks, lead = _blocks(raw, T.Q2_K)
    n = len(blocks)
    d = blocks[:, 80:82].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 82:84].copy().view(np.float16).astype(np.float32)
    step = d * (blocks[:, :16] & 0xF).astype(np.float32)                     # [n, 16]
    low = dmin * (blocks[:, :16] >> 4).astype(np.float32)
    # Byte l of half h holds, at bits 2j, element 128h + 32j + l: sub-block 8h + 2j + l // 16.
    # Count each q per sub-block with one byte lane per q value (1 << 8q), summing the 16
    # bytes of a sub-block as contiguous rows.
    by_l = np.ascontiguousarray(blocks[:, 16:80].reshape(n, 2, 2, 16).transpose(3, 0, 1, 2))
    lanes = np.array([1, 1 << 8, 1 << 16, 1 << 24], np.uint32)
    counts = np.stack([lanes[(by_l >> (2 * j)) & 3].sum(0, dtype=np.uint32) for j in range(4)],
                      axis=2)                                                # [n, h, j, l//16]
    counts = counts.view(np.uint8).reshape(n * 8, 8)                         # per group
    values = (step.reshape(-1, 1) * np.arange(4, dtype=np.float32) - low.reshape(-1, 1))
    values = values.reshape(n * 8, 8)
    s, b, c = fit_affine(values, bits, steps, counts)
    # each element's code: byte q of its sub-block's four codes packed in a uint32
    table = np.ascontiguousarray(c).view("<u4").reshape(n, 2, 4, 2, 1)   # [n, h, j, l//16, .]
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (blocks[:, 16:80].reshape(n, 2, 1, 32) >> shifts) & 3
    codes = (table >> (q.reshape(n, 2, 4, 2, 16).astype(np.uint32) * 8)) & 0xFF
    got = s.astype(np.float64)[:, None] * c + b.astype(np.float64)[:, None]
    return Affine(pack_codes(codes.astype(np.uint8).reshape(*lead, -1), bits), s.reshape(*lead, -1),
                  b.reshape(*lead, -1), bits, False,
                  float(np.sum(counts * np.square(got - values))),
                  float(np.sum(counts * np.square(values.astype(np.float64)))))


MAPPERS = {T.Q8_0: q8_0, T.Q4_K: q4_k, T.IQ2_XXS: iq2_xxs, T.Q2_K: q2_k}
DEFAULT_BITS = {T.Q8_0: 8, T.Q4_K: 4, T.IQ2_XXS: 3, T.Q2_K: 4}
ALLOWED_BITS = {T.Q8_0: (8,), T.Q4_K: (4,), T.IQ2_XXS: (3, 8), T.Q2_K: (2, 3, 4, 5, 6, 8)}


def scale_dtype(qtype: T, bits: int) -> np.dtype:
    """The dtype of scales and biases `MAPPERS[qtype]` produces at `bits`."""
    exact_f32 = qtype == T.Q4_K or (qtype == T.IQ2_XXS and bits == 8)
    return np.dtype(np.float32 if exact_f32 else np.float16)


def affine_nbytes(qtype: T, bits: int, rows: int, n_in: int) -> int:
    """Bytes of weight + scales + biases for `rows` rows of `n_in` inputs."""
    return rows * (n_in * bits // 8 + 2 * (n_in // GROUP) * scale_dtype(qtype, bits).itemsize)


def to_affine(raw: np.ndarray, qtype: T, bits: int, chunk_weights: int = 1 << 18) -> Affine:
    """Map rows [..., row bytes] of `qtype` at `bits`, a few hundred thousand weights at a
    time (numpy is several times faster when a step's arrays stay in the CPU cache)."""
    if bits not in ALLOWED_BITS[qtype]:
        raise QuantError(f"{qtype.name} maps to affine {ALLOWED_BITS[qtype]} bits, not {bits}")
    mapper = {T.IQ2_XXS: lambda r: iq2_xxs(r, bits), T.Q2_K: lambda r: q2_k(r, bits)}.get(
        qtype, MAPPERS[qtype])
    lead, row_bytes = raw.shape[:-1], raw.shape[-1]
    rows = raw.reshape(-1, row_bytes)
    per_row = row_bytes // BLOCK_BYTES[qtype] * BLOCK_WEIGHTS[qtype]
    step = max(1, chunk_weights // per_row)
    parts = [mapper(rows[i:i + step]) for i in range(0, len(rows), step)]
    first = parts[0]

    def joined(field: str) -> np.ndarray:
        arrays = [getattr(p, field) for p in parts]
        out = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        return out.reshape(*lead, out.shape[-1])

    return Affine(joined("weight"), joined("scales"), joined("biases"), first.bits, first.exact,
                  sum(p.err_sq for p in parts), sum(p.ref_sq for p in parts))


MXFP4_BLOCK = 17   # GGUF MXFP4 (type 39): an e8m0 byte, then 16 bytes of 32 e2m1 codes


def mxfp4(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 rows uint8 [..., blocks * 17] -> MLX mxfp4 (weight uint32 [..., in / 8],
    scales uint8 [..., in / 32]), exact: the same e2m1 codes and e8m0 scales, only the nibbles
    move (a GGUF block's byte j holds codes j and j + 16; MLX packs codes in order, LSB first)."""
    if raw.shape[-1] % MXFP4_BLOCK:
        raise QuantError(f"MXFP4 rows of {raw.shape[-1]} bytes are not whole blocks of {MXFP4_BLOCK}")
    blocks = raw.reshape(*raw.shape[:-1], -1, MXFP4_BLOCK)
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)              # [..., blocks, 32] in order
    pairs = codes[..., 0::2] | (codes[..., 1::2] << 4)                 # two codes a byte, LSB first
    weight = np.ascontiguousarray(pairs.reshape(*raw.shape[:-1], -1)).view(np.uint32)
    return weight, np.ascontiguousarray(blocks[..., 0])
