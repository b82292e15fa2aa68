"""GGUF blocks in the decode kernels: `rows_dot` over rows of raw GGUF blocks.

The matvec and fused-experts kernels (matvec.py, experts.py) are written against
`rows_dot<MODE, BITS, GS, ROWS, LANES, K_IN, XS, TWO>`: dot products of one input row with
ROWS rows of one or two matrices, the SIMD group's lanes in groups of LANES, each lane taking
units of the row in turn. experts.PACKS_HEADER defines it for MLX's packed matrices; the
header here defines it for rows of GGUF blocks (dsv4/gguf_blocks.py), so the same bodies
(the shared expert, the router's tail, the mHC expand, the fp8 rounding of x and h) run over
GGUF weights. MODE is a GGUF type id (GGUF_MODE_IDS); BITS and GS are unused.

A row is the tensor's own bytes (K_IN / BLOCK_VALUES blocks), read in place: no repacking,
so a weight is exactly as big as in the GGUF file. A lane's unit is what it decodes from one
set of loads:

  Q8_0     32 values: a block (34 B, 2-byte aligned: 17 u16 loads), d * sum(q x); with
           DSV4_KERNEL_GGUF_Q8_PAIRS and rows of 64k values, 64 values: two blocks (68 B from a
           4-byte boundary: 17 u32 loads, half the load instructions), mode id 14
  IQ2_XXS  32 values: a sub-block (8 B + the block's f16 d, u16 loads), db * sum(+-grid x);
           the grid (256 x 8 bytes) and the sign table come in the matrix's `scales` operand
  Q4_K     64 values: two sub-blocks sharing 32 bytes of nibbles (16-byte loads: a block is
           144 B), (d sc) sum(q x) - (dmin m) sum(x) per 32
  Q2_K    128 values: half a block, whose 32 bytes hold 4 bit planes (4-byte loads: 84 B),
           (d sc) sum(q x) - (dmin m) sum(x) per 16

Each unit accumulates in fp32 (a different order from the reference's fp32 matmul of the
decoded weights: within the fp32 summation bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from dsv4 import flags, gguf_blocks
from dsv4.kernels.dialect import backend

GGUF_MODE_IDS = {"Q8_0": 10, "Q4_K": 11, "Q2_K": 12, "IQ2_XXS": 13}
Q8_0_PAIRS = 14   # the mode id of Q8_0 read two blocks at a time
Q8_0_HSUB = 21    # Q8_0's wide unit taking its int8s' bias off fp16 pairs (DSV4_KERNEL_GGUF_Q8_HSUB)
# The mode ids of the wide units (DSV4_KERNEL_GGUF_WIDE); Q4_K's unit is wide already.
WIDE_MODE_IDS = {"Q8_0": 20, "Q2_K": 22, "IQ2_XXS": 23}
# The units whose codes become fp16 subnormals (DSV4_KERNEL_GGUF_HALVES; IQ2_XXS and Q2_K on the
# wide units' loads, Q4_K's unit is wide already).
HALVES_MODE_IDS = {"IQ2_XXS": 24, "Q2_K": 26, "Q4_K": 27}
# The integer units (DSV4_KERNEL_GGUF_DP4A): with x fp8-rounded (act_quant) and copied as integer
# limbs (experts.py's XStore<X_INTS>), exact integer dot products, DP4A four values at a time.
INT_MODE_IDS = {"IQ2_XXS": 28, "Q8_0": 29, "Q4_K": 30, "Q2_K": 31}
# Those that take them by default under CUDA; IQ2_XXS since its unit computes its sign masks (an
# H100: q2's gate/up 77.0 against 81.1 µs at one token, 351 against 391 at eight). Not Q2_K, whose
# down the integer units made slower (DSV4_KERNEL_GGUF_DP4A_DOWN).
DP4A_AUTO_TYPES = ("Q8_0", "Q4_K", "IQ2_XXS")
# IQ2_XXS's tables (iq2_xxs_tables), in words: where the halves unit's fp16 pairs start (after the
# grid's 256 x 8 bytes and the 128 sign bytes), and the whole length (the pairs: 256 x 16 bytes).
IQ2_PAIRS_AT = (256 * 8 + 128) // 4
IQ2_TABLE_WORDS = IQ2_PAIRS_AT + 256 * 16 // 4
# Values a lane decodes per unit (see above).
UNIT_VALUES = {"Q8_0": 32, "IQ2_XXS": 32, "Q4_K": 64, "Q2_K": 128}

# Reading GGUF bytes: fp16 fields, codes as exact floats, u16/u32 and 16-byte realigned loads.
BLOCK_LOADS = r"""
KFN float f16_bits(uint32_t h) { return half2_bits_to_float2(h).x; }
// The two integers at bits 0 and 16 of `w` (each < 1024), minus `offset`, as exact floats:
// fp16 0x6400 is 1024 with a mantissa step of 1, so OR-ing them in and widening the half2 is one
// conversion for two values (taking 1024 + offset off is exact too; no cancellation in the sums).
KFN float2 ints2(uint32_t w, float offset) {
  const float2 f = half2_bits_to_float2(w | 0x64006400u);
  return {f.x - (1024.0f + offset), f.y - (1024.0f + offset)};
}
// The codes (each < 1024) at bits 0 and 16 of `w` as exact floats: ints2, or with SMALL the same
// times 2^-24 as fp16 subnormals' bits, no subtraction (the halves units, DSV4_KERNEL_GGUF_HALVES,
// whose scales carry the 2^24).
template <bool SMALL> KFN float2 codes2(uint32_t w) { return SMALL ? half2_bits_to_float2(w) : ints2(w, 0.0f); }
// IQ2_XXS's 8 signs (bit k for value k) from their 7 stored bits: the 8th makes the parity even
// (0x6996 holds the parities of 0-15).
KFN uint32_t iq2_signs8(uint32_t si) { return si | (((0x6996u >> ((si ^ (si >> 4)) & 15u)) & 1u) << 7); }
template <typename P> KFN uint32_t u16_at(P bytes, int i) { return (uint32_t)((GLOBAL uint16_t*)bytes)[i]; }
template <typename P> KFN uint32_t u32_at(P bytes, int i) { return ((GLOBAL uint32_t*)bytes)[i]; }
// An IQ2_XXS sub-block's scale: its block's d (the fp16 at byte 0) times (0.5 + aux's top 4 bits) / 4.
template <typename P> KFN float iq2_scale(P block, uint32_t aux) {
  return f16_bits(u16_at(block, 0)) * (0.5f + (float)(aux >> 28)) * 0.25f;
}
// Two int8s stored + 128 at bits 0 and 16 of `w` as exact floats: 1024 + u less 1152 in fp16 (exact,
// integers up to 2048), then widened; ints2(w, 128) with one subtraction for the pair.
KFN float2 int8s2(uint32_t w) { return half2_bits_to_float2(H2_SUB_BITS(w | 0x64006400u, 0x64806480u)); }
// A chunk's 8 values v times x[0..7], four products a term: the units' order of summation.
KFN float chunk_dot8(LOCAL const float* v, LOCAL const float* x) {
  float s = 0.0f;
  for (int j = 0; j < 2; ++j) s += v[4 * j] * x[4 * j] + v[4 * j + 1] * x[4 * j + 1] + v[4 * j + 2] * x[4 * j + 2] + v[4 * j + 3] * x[4 * j + 3];
  return s;
}
// The 8 int8s of two little-endian words (as Q8_0 stores them) as exact floats; HSUB: made by
// int8s2 (the same values).
template <bool HSUB = false> KFN void int8s8(uint32_t w0, uint32_t w1, LOCAL float* v) {
  const uint32_t w[2] = {w0, w1};
  for (int j = 0; j < 2; ++j) {
    const uint32_t u = w[j] ^ 0x80808080u;   // int8 + 128, as bytes
    const uint32_t lo = u & 0x00ff00ffu, hi = (u >> 8) & 0x00ff00ffu;
    const float2 a = HSUB ? int8s2(lo) : ints2(lo, 128.0f), b = HSUB ? int8s2(hi) : ints2(hi, 128.0f);
    v[4 * j] = a.x; v[4 * j + 1] = b.x; v[4 * j + 2] = a.y; v[4 * j + 3] = b.y;
  }
}
template <bool HSUB = false> KFN float int8_dot8(uint32_t w0, uint32_t w1, LOCAL const float* x) {
  float v[8];
  int8s8<HSUB>(w0, w1, v);
  return chunk_dot8(v, x);
}

// Wide loads (DSV4_KERNEL_GGUF_WIDE): out[k] = the u32 at byte off + 4k of the buffer at `base`
// (16-byte aligned), for the NB bytes from off (a multiple of ALIGN, 2 or 4), read as the aligned
// 16-byte words that hold them and realigned in registers (selects by the word phase, a 16-bit
// funnel for a 2-byte phase). A load never starts past the last 16-byte word holding a byte asked
// for (it is clamped there), so it never leaves the pages the span lies in. out's bytes past NB
// are not defined.
template <int NB, int ALIGN, typename P> KFN void span_words(P base, size_t off, LOCAL uint32_t* out) {
  constexpr int L = (NB + 16 - ALIGN + 15) / 16;      // 16-byte words covering NB bytes at any phase
  constexpr int NW = (NB + 3) / 4;
  const size_t first = off / 16, last = (off + NB - 1) / 16;
  uint32_t w[4 * L + 3];
  for (int i = 0; i < L; ++i) {
    const uint4 q = LOAD_U4(base, first + i < last ? first + i : last);
    w[4 * i] = q.x; w[4 * i + 1] = q.y; w[4 * i + 2] = q.z; w[4 * i + 3] = q.w;
  }
  for (int k = 4 * L; k < 4 * L + 3; ++k) w[k] = 0u;
  const uint32_t m = (uint32_t)(off % 16) / 4;         // the span's first word within the first load
  for (int k = 0; k < 4 * L + 1; ++k) w[k] = (m & 2u) ? w[k + 2] : w[k];
  for (int k = 0; k < 4 * L; ++k) w[k] = (m & 1u) ? w[k + 1] : w[k];
  const bool half = ALIGN < 4 && (off & 2) != 0;
  for (int k = 0; k < NW; ++k) out[k] = half ? (w[k] >> 16) | (w[k + 1] << 16) : w[k];
}
"""

# The lanes' units and rows_dot (the portable kernels').
UNITS = f"constexpr int IQ2_PAIRS_AT = {IQ2_PAIRS_AT};\n" + r"""
// One lane's unit of a GGUF row: load() from the row's bytes, then dot8(c, x, x_sum, tables)
// for each chunk c of 8 values: the chunk's values times x (x_sum = the chunk's sum of x).
// values8(c, v, tables) gives the chunk's values as exact floats (signs on), and scales8(c) the
// pair (m, l) that makes dot8 = m chunk_dot8(v, x) - l x_sum (l is 0 unless MINS: the K-quants'
// mins), so that TokensDot decodes a chunk once for several tokens.
template <int MODE> struct GgufUnit;
// The stride of x's threadgroup copy that unit MODE reads: the integer units' limbs (X_INTS), the
// others' floats (X_STRIDE; XS, the launch's widest, may differ: a shared expert's units may not be
// the routed experts' kind).
template <int MODE, int XS> constexpr int x_stride() { return INT_UNIT ? X_INTS : X_STRIDE; }

template <> struct GgufUnit<10> {   // Q8_0
  static constexpr int VALUES = 32, BLOCK_VALUES = 32, BLOCK_BYTES = 34;
  static constexpr bool MINS = false;
  uint32_t q[8];
  float d;
  template <typename P> KFN void load(P base, size_t row_off, int u) {
    P b = base + row_off + 34 * u;
    d = f16_bits(u16_at(b, 0));
    for (int k = 0; k < 8; ++k) q[k] = u16_at(b, 1 + 2 * k) | (u16_at(b, 2 + 2 * k) << 16);
  }
  template <typename PT> KFN float dot8(int c, LOCAL const float* x, float x_sum, PT tables) const {
    return d * int8_dot8(q[2 * c], q[2 * c + 1], x);
  }
  template <typename PT> KFN void values8(int c, LOCAL float* v, PT tables) const { int8s8(q[2 * c], q[2 * c + 1], v); }
  KFN float2 scales8(int c) const { return {d, 0.0f}; }
};

template <> struct GgufUnit<14> {   // Q8_0, two blocks per unit: 68 bytes, 4-byte aligned
  static constexpr int VALUES = 64, BLOCK_VALUES = 64, BLOCK_BYTES = 68;
  static constexpr bool MINS = false;
  uint32_t q[16];
  float d[2];
  template <typename P> KFN void load(P base, size_t row_off, int u) {
    P b = base + row_off + 68 * u;
    uint32_t w[17];
    for (int k = 0; k < 17; ++k) w[k] = u32_at(b, k);
    d[0] = f16_bits(w[0] & 0xffffu);                   // bytes 0-1; its int8s at bytes 2-33
    for (int k = 0; k < 8; ++k) q[k] = (w[k] >> 16) | (w[k + 1] << 16);
    d[1] = f16_bits(w[8] >> 16);                       // bytes 34-35; its int8s at 36-67, aligned
    for (int k = 0; k < 8; ++k) q[8 + k] = w[9 + k];
  }
  template <typename PT> KFN float dot8(int c, LOCAL const float* x, float x_sum, PT tables) const {
    return d[c / 4] * int8_dot8(q[2 * c], q[2 * c + 1], x);
  }
  template <typename PT> KFN void values8(int c, LOCAL float* v, PT tables) const { int8s8(q[2 * c], q[2 * c + 1], v); }
  KFN float2 scales8(int c) const { return {d[c / 4], 0.0f}; }
};

template <> struct GgufUnit<13> {   // IQ2_XXS: tables = grid (512 words), then the 128 sign bytes
  static constexpr int VALUES = 32, BLOCK_VALUES = 256, BLOCK_BYTES = 66;
  static constexpr bool MINS = false;
  uint32_t grid_index, aux;
  float db;
  template <typename P> KFN void load(P base, size_t row_off, int u) {
    P b = base + row_off + 66 * (u / 8);
    const int j = u % 8;
    grid_index = u16_at(b, 1 + 4 * j) | (u16_at(b, 2 + 4 * j) << 16);
    aux = u16_at(b, 3 + 4 * j) | (u16_at(b, 4 + 4 * j) << 16);
    db = iq2_scale(b, aux);
  }
  template <typename PT> KFN void values8(int c, LOCAL float* v, PT tables) const {
    const uint32_t g = (grid_index >> (8 * c)) & 255u, si = (aux >> (7 * c)) & 127u;
    const uint2 entry = ((GLOBAL uint2*)tables)[g];
    const uint32_t lo = entry.x, hi = entry.y;
    const uint32_t signs = (tables[512 + si / 4] >> (8 * (si % 4))) & 255u;
    for (int k = 0; k < 8; ++k) {
      const float a = (float)(((k < 4 ? lo : hi) >> (8 * (k % 4))) & 255u);
      v[k] = (signs >> k) & 1u ? -a : a;
    }
  }
  KFN float2 scales8(int c) const { return {db, 0.0f}; }
  template <typename PT> KFN float dot8(int c, LOCAL const float* x, float x_sum, PT tables) const {
    float v[8];
    values8(c, v, tables);
    return db * chunk_dot8(v, x);
  }
};

template <> struct GgufUnit<11> {   // Q4_K
  static constexpr int VALUES = 64, BLOCK_VALUES = 256, BLOCK_BYTES = 144;
  static constexpr bool MINS = true;
  uint32_t q[8];
  float scale[2], low[2];
  template <typename P> KFN void load(P base, size_t row_off, int u) {
    P b = base + row_off + 144 * (u / 4);
    const int i = u % 4;
    const uint4 head = LOAD_U4(b, 0), lo = LOAD_U4(b + 16, 2 * i), hi = LOAD_U4(b + 16, 2 * i + 1);
    const uint32_t sc[3] = {head.y, head.z, head.w};
    const float d = f16_bits(head.x & 0xffffu), dmin = f16_bits(head.x >> 16);
    for (int h = 0; h < 2; ++h) {   // sub-block j = 2i + h: ggml's get_scale_min_k4
      const int j = 2 * i + h;
      uint32_t s, m;
      if (j < 4) {
        s = (sc[0] >> (8 * j)) & 63u;
        m = (sc[1] >> (8 * j)) & 63u;
      } else {
        const uint32_t b8 = (sc[2] >> (8 * (j - 4))) & 255u;
        s = (b8 & 15u) | (((sc[0] >> (8 * (j - 4))) >> 6 & 3u) << 4);
        m = (b8 >> 4) | (((sc[1] >> (8 * (j - 4))) >> 6 & 3u) << 4);
      }
      scale[h] = d * (float)s;
      low[h] = dmin * (float)m;
    }
    q[0] = lo.x; q[1] = lo.y; q[2] = lo.z; q[3] = lo.w; q[4] = hi.x; q[5] = hi.y; q[6] = hi.z; q[7] = hi.w;
  }
  template <bool SMALL> KFN void codes8(int c, LOCAL float* v) const {
    const int h = c / 4, k8 = c % 4, shift = 4 * h;   // chunk c: bytes 8 k8.. of the 32, nibble h
    for (int j = 0; j < 2; ++j) {
      const uint32_t u = q[2 * k8 + j] >> shift;
      const float2 a = codes2<SMALL>(u & 0x000f000fu), b = codes2<SMALL>((u >> 8) & 0x000f000fu);
      v[4 * j] = a.x; v[4 * j + 1] = b.x; v[4 * j + 2] = a.y; v[4 * j + 3] = b.y;
    }
  }
  KFN float2 scales8(int c) const { return {scale[c / 4], low[c / 4]}; }
  template <bool SMALL> KFN float codes_dot8(int c, LOCAL const float* x, float x_sum) const {
    float v[8];
    codes8<SMALL>(c, v);
    const float2 m = scales8(c);
    return m.x * chunk_dot8(v, x) - m.y * x_sum;
  }
  template <typename PT> KFN void values8(int c, LOCAL float* v, PT tables) const { codes8<false>(c, v); }
  template <typename PT> KFN float dot8(int c, LOCAL const float* x, float x_sum, PT tables) const {
    return codes_dot8<false>(c, x, x_sum);
  }
};

template <> struct GgufUnit<12> {   // Q2_K
  static constexpr int VALUES = 128, BLOCK_VALUES = 256, BLOCK_BYTES = 84;
  static constexpr bool MINS = true;
  uint32_t q[8], sc[2];
  float d, dmin;
  template <typename P> KFN void load(P base, size_t row_off, int u) {
    P b = base + row_off + 84 * (u / 2);
    const int h = u % 2;
    for (int k = 0; k < 8; ++k) q[k] = u32_at(b, 4 + 8 * h + k);
    sc[0] = u32_at(b, 2 * h);
    sc[1] = u32_at(b, 2 * h + 1);
    const uint32_t dd = u32_at(b, 20);
    d = f16_bits(dd & 0xffffu);
    dmin = f16_bits(dd >> 16);
  }
  template <bool SMALL> KFN void codes8(int c, LOCAL float* v) const {
    const int plane = c / 4, k8 = c % 4;           // bits 2 plane of bytes 8 k8.. of the 32
    for (int j = 0; j < 2; ++j) {
      const uint32_t u = q[2 * k8 + j] >> (2 * plane);
      const float2 a = codes2<SMALL>(u & 0x00030003u), b = codes2<SMALL>((u >> 8) & 0x00030003u);
      v[4 * j] = a.x; v[4 * j + 1] = b.x; v[4 * j + 2] = a.y; v[4 * j + 3] = b.y;
    }
  }
  KFN float2 scales8(int c) const {
    const int sub = 2 * (c / 4) + (c % 4) / 2;     // the chunk's sub-block of 16 within the half
    const uint32_t s8 = (sc[sub / 4] >> (8 * (sub % 4))) & 255u;
    return {d * (float)(s8 & 15u), dmin * (float)(s8 >> 4)};
  }
  template <bool SMALL> KFN float codes_dot8(int c, LOCAL const float* x, float x_sum) const {
    float v[8];
    codes8<SMALL>(c, v);
    const float2 m = scales8(c);
    return m.x * chunk_dot8(v, x) - m.y * x_sum;
  }
  template <typename PT> KFN void values8(int c, LOCAL float* v, PT tables) const { codes8<false>(c, v); }
  template <typename PT> KFN float dot8(int c, LOCAL const float* x, float x_sum, PT tables) const {
    return codes_dot8<false>(c, x, x_sum);
  }
};

// The wide units (DSV4_KERNEL_GGUF_WIDE): the same values, fewer and wider loads.
template <> struct GgufUnit<20> : GgufUnit<10> {   // Q8_0: 3 16-byte loads a block, not 17 u16
  template <typename P> KFN void load(P base, size_t row_off, int u) {
    uint32_t w[9];
    span_words<34, 2>(base, row_off + 34 * (size_t)u, w);
    d = f16_bits(w[0] & 0xffffu);
    for (int k = 0; k < 8; ++k) q[k] = (w[k] >> 16) | (w[k + 1] << 16);
  }
};

template <> struct GgufUnit<21> : GgufUnit<20> {   // Q8_0 wide, the int8s by int8s2
  template <typename PT> KFN float dot8(int c, LOCAL const float* x, float x_sum, PT tables) const {
    return d * int8_dot8<true>(q[2 * c], q[2 * c + 1], x);
  }
  template <typename PT> KFN void values8(int c, LOCAL float* v, PT tables) const { int8s8<true>(q[2 * c], q[2 * c + 1], v); }
};

// IQ2_XXS: a sub-block's 8 bytes in 2 16-byte loads and d in one (5 u16 loads before); the signs
// computed (7 bits and their parity, 0x6996 being the parities of 0-15) instead of read from the
// table; grid bytes widened two at a time (ints2) where each took an int-to-float conversion, and
// a minus sign put on their sign bits.
template <> struct GgufUnit<23> {
  static constexpr int VALUES = 32, BLOCK_VALUES = 256, BLOCK_BYTES = 66;
  static constexpr bool MINS = false;
  uint32_t grid_index, aux;
  float db;
  template <typename P> KFN void load(P base, size_t row_off, int u) {
    const size_t b = row_off + 66 * (size_t)(u / 8);
    uint32_t w[2];
    span_words<8, 2>(base, b + 2 + 8 * (u % 8), w);
    grid_index = w[0];
    aux = w[1];
    db = iq2_scale(base + b, aux);
  }
  // Chunk c's grid entry (8 bytes) and its 8 signs (bit k for value k).
  template <typename PT> KFN uint2 entry(int c, PT tables) const {
    return ((GLOBAL uint2*)tables)[(grid_index >> (8 * c)) & 255u];
  }
  KFN uint32_t signs8(int c) const { return iq2_signs8((aux >> (7 * c)) & 127u); }
  template <typename PT> KFN void values8(int c, LOCAL float* v, PT tables) const {
    const uint2 g = entry(c, tables);
    const uint32_t signs = signs8(c), e[2] = {g.x, g.y};
    for (int j = 0; j < 2; ++j) {
      const float2 a = ints2(e[j] & 0x00ff00ffu, 0.0f), b = ints2((e[j] >> 8) & 0x00ff00ffu, 0.0f);
      const float u[4] = {a.x, b.x, a.y, b.y};
      for (int k = 0; k < 4; ++k)
        v[4 * j + k] = AS_FLOAT(AS_UINT(u[k]) ^ ((signs << (31 - (4 * j + k))) & 0x80000000u));
    }
  }
  KFN float2 scales8(int c) const { return {db, 0.0f}; }
  template <typename PT> KFN float dot8(int c, LOCAL const float* x, float x_sum, PT tables) const {
    float v[8];
    values8(c, v, tables);
    return db * chunk_dot8(v, x);
  }
};

// IQ2_XXS with the wide unit's loads, its weights made as signed fp16 subnormals (+-g 2^-24, db
// carrying the 2^24), two to a word, exactly: a grid entry is one 16-byte read of its values as
// such pairs (the tables' words from IQ2_PAIRS_AT: values 0 and 2, 1 and 3, 4 and 6, 5 and 7), and
// one multiply puts a pair's two signs on their halves' sign bits: s * (2^a + 2^b) is s << a OR
// s << b while |a - b| >= 14 exceeds s's width (its parity bit's popcount may reach bit 9).
template <> struct GgufUnit<24> : GgufUnit<23> {
  // The sub-block's 8 bytes (2-byte aligned) as two 4-byte reads from the word holding its first
  // byte, and at a 2-byte phase a 2-byte read of its last two (no byte read outside the 8).
  template <typename P> KFN void load(P base, size_t row_off, int u) {
    const size_t b = row_off + 66 * (size_t)(u / 8), off = b + 2 + 8 * (u % 8);
    P w = base + (off & ~(size_t)3);
    const bool half = (off & 2) != 0;
    const uint32_t w0 = u32_at(w, 0), w1 = u32_at(w, 1), last = u16_at(w, half ? 4 : 2);
    grid_index = half ? (w0 >> 16) | (w1 << 16) : w0;
    aux = half ? (w1 >> 16) | (last << 16) : w1;
    db = iq2_scale(base + b, aux) * 16777216.0f;
  }
  template <typename PT> KFN void values8(int c, LOCAL float* v, PT tables) const {
    const uint4 g = LOAD_U4(tables + IQ2_PAIRS_AT, (grid_index >> (8 * c)) & 255u);
    const uint32_t si = (aux >> (7 * c)) & 127u, signs = si | (POPCOUNT(si) << 7);
    const uint32_t w[4] = {g.x | ((signs * 0x20008000u) & 0x80008000u), g.y | ((signs * 0x10004000u) & 0x80008000u),
                           g.z | ((signs * 0x02000800u) & 0x80008000u), g.w | ((signs * 0x01000400u) & 0x80008000u)};
    for (int j = 0; j < 2; ++j) {
      const float2 a = half2_bits_to_float2(w[2 * j]), b = half2_bits_to_float2(w[2 * j + 1]);   // values 0, 2 and 1, 3
      v[4 * j] = a.x; v[4 * j + 1] = b.x; v[4 * j + 2] = a.y; v[4 * j + 3] = b.y;
    }
  }
  template <typename PT> KFN float dot8(int c, LOCAL const float* x, float x_sum, PT tables) const {
    float v[8];
    values8(c, v, tables);
    return db * chunk_dot8(v, x);
  }
};
// Q4_K with its nibbles as fp16 subnormals (codes2<true>); its sub-block scales carry the 2^24.
template <> struct GgufUnit<27> : GgufUnit<11> {
  template <typename P> KFN void load(P base, size_t row_off, int u) {
    GgufUnit<11>::load(base, row_off, u);
    scale[0] *= 16777216.0f;
    scale[1] *= 16777216.0f;
  }
  template <typename PT> KFN void values8(int c, LOCAL float* v, PT tables) const { codes8<true>(c, v); }
  template <typename PT> KFN float dot8(int c, LOCAL const float* x, float x_sum, PT tables) const {
    return codes_dot8<true>(c, x, x_sum);
  }
};

template <> struct GgufUnit<22> : GgufUnit<12> {   // Q2_K: a half's 32 code bytes in 3 16-byte loads, not 8 u32
  template <typename P> KFN void load(P base, size_t row_off, int u) {
    const size_t b = row_off + 84 * (size_t)(u / 2);
    const int h = u % 2;
    span_words<32, 4>(base, b + 16 + 32 * h, q);
    sc[0] = u32_at(base + b, 2 * h);
    sc[1] = u32_at(base + b, 2 * h + 1);
    const uint32_t dd = u32_at(base + b, 20);
    d = f16_bits(dd & 0xffffu);
    dmin = f16_bits(dd >> 16);
  }
};

// Q2_K on the wide unit's loads, its 2-bit codes as fp16 subnormals (codes2<true>); d carries the 2^24.
template <> struct GgufUnit<26> : GgufUnit<22> {
  template <typename P> KFN void load(P base, size_t row_off, int u) {
    GgufUnit<22>::load(base, row_off, u);
    d *= 16777216.0f;
  }
  template <typename PT> KFN void values8(int c, LOCAL float* v, PT tables) const { codes8<true>(c, v); }
  template <typename PT> KFN float dot8(int c, LOCAL const float* x, float x_sum, PT tables) const {
    return codes_dot8<true>(c, x, x_sum);
  }
};

// The integer units (DSV4_KERNEL_GGUF_DP4A), over x as experts.py's X_INTS limbs: ints8 gives a
// chunk's 8 codes as signed bytes in two words, which limbs_dot8 multiplies by x's limbs. Each
// scale group g of a unit (GROUP_CHUNKS chunks: a 32-value sub-block, Q2_K's 16) then adds (with
// x's s / 2^9) int_scale(g) times its integer sum codes . q, less (MINS) int_low(g) times the
// group's sum of q.
// IQ2_XXS: the grid bytes (8, 25, 43) made signed four at a time, (g ^ 255 l) + l with l the bytes
// 1 where a value is negative: a half's 4 sign bits (the 7 stored and their parity) spread to
// its bytes' low bits by one multiply (bit i to bit 8i; the product's 16 terms land on distinct
// bits, so nothing carries). Computed, where a table of the masks took a second gather a chunk
// through L1 (ncu: the long-scoreboard stalls that made this unit slower than the halves one,
// benchmarks/results/2026-12-06-0557-ncu-experts-gate-up.md).
template <> struct GgufUnit<28> : GgufUnit<24> {
  static constexpr int GROUP_CHUNKS = 4;
  KFN float int_scale(int g) const { return db * (1.0f / 16777216.0f); }   // <24>'s db carries 2^24
  KFN float int_low(int g) const { return 0.0f; }
  template <typename PT> KFN void ints8(int c, LOCAL int* w, PT tables) const {
    const uint2 g = ((GLOBAL uint2*)tables)[(grid_index >> (8 * c)) & 255u];
    const uint32_t si = (aux >> (7 * c)) & 127u, s = si | ((POPCOUNT(si) & 1u) << 7);
    const uint32_t lo = ((s & 15u) * 0x00204081u) & 0x01010101u, hi = ((s >> 4) * 0x00204081u) & 0x01010101u;
    w[0] = (int)((g.x ^ (lo * 255u)) + lo);
    w[1] = (int)((g.y ^ (hi * 255u)) + hi);
  }
};
// Q8_0: the int8s as they are stored, on the wide unit's loads.
template <> struct GgufUnit<29> : GgufUnit<20> {
  static constexpr int GROUP_CHUNKS = 4;
  KFN float int_scale(int g) const { return d; }
  KFN float int_low(int g) const { return 0.0f; }
  template <typename PT> KFN void ints8(int c, LOCAL int* w, PT tables) const {
    w[0] = (int)q[2 * c];
    w[1] = (int)q[2 * c + 1];
  }
};
// Q4_K: the nibbles of chunk c (sub-block c / 4) four at a time, unsigned codes below 16.
template <> struct GgufUnit<30> : GgufUnit<11> {
  static constexpr int GROUP_CHUNKS = 4;
  KFN float int_scale(int g) const { return scale[g]; }
  KFN float int_low(int g) const { return low[g]; }
  template <typename PT> KFN void ints8(int c, LOCAL int* w, PT tables) const {
    const int shift = 4 * (c / 4);
    w[0] = (int)((q[2 * (c % 4)] >> shift) & 0x0f0f0f0fu);
    w[1] = (int)((q[2 * (c % 4) + 1] >> shift) & 0x0f0f0f0fu);
  }
};
// Q2_K, on the wide unit's loads: chunk c's 2-bit codes (bit plane c / 4 of bytes 8 (c % 4)..) four
// at a time; a scale group is a 16-value sub-block (two chunks), each with its scale and min.
template <> struct GgufUnit<31> : GgufUnit<22> {
  static constexpr int GROUP_CHUNKS = 2;
  KFN uint32_t sub_scales(int g) const { return (sc[g / 4] >> (8 * (g % 4))) & 255u; }
  KFN float int_scale(int g) const { return d * (float)(sub_scales(g) & 15u); }
  KFN float int_low(int g) const { return dmin * (float)(sub_scales(g) >> 4); }
  template <typename PT> KFN void ints8(int c, LOCAL int* w, PT tables) const {
    const int shift = 2 * (c / 4);
    w[0] = (int)((q[2 * (c % 4)] >> shift) & 0x03030303u);
    w[1] = (int)((q[2 * (c % 4) + 1] >> shift) & 0x03030303u);
  }
};
// What scale group g of unit a adds with group j of pack p of x (scale sx), given the limbs' dot
// products l: its integer sum converted once (|sum| < 2^31: 32 codes of |w| <= 128 times |q| < 2^18).
template <typename U, typename PX>
KFN float group_part(const LOCAL U& a, int g, float sx, LOCAL const int* l, PX x, int p, int j) {
  return U::MINS ? sx * (a.int_scale(g) * (float)XInts::join(l) - a.int_low(g) * XInts::sum<U::GROUP_CHUNKS>(x, p, j))
                 : a.int_scale(g) * sx * (float)XInts::join(l);
}

// rows_dot's two loops: over x as floats (XChunk<XS>, a unit's dot8), or as X_INTS limbs (a unit a
// scale group at a time, its limbs_dot8 sums converted once a group by group_part).
template <bool INTS> struct RowsDot;

template <int MODE, int BITS, int GS, int ROWS, int LANES, int K_IN, int XS, bool TWO, typename PX,
          typename PW, typename PS, typename PB>
KFN void rows_dot(PX x, PW w0, PS s0, PB b0, PW w1, PS s1, PB b1, size_t first, int row0,
                  int rows_out, LOCAL float* acc0, LOCAL float* acc1, uint32_t lane, int part = 0, int parts = 1) {
  const int sub = (int)lane % LANES + LANES * part;        // the lane's first unit (part: experts.py's)
  const int rows0 = row0 + ((int)lane / LANES) * ROWS;      // its lane group's first row
  for (int r = 0; r < ROWS; ++r) { acc0[r] = 0.0f; acc1[r] = 0.0f; }
  RowsDot<XS == X_INTS>::template run<MODE, ROWS, K_IN, XS, TWO>(x, w0, s0, w1, s1, first, sub, LANES * parts, rows0,
                                                                  rows_out, acc0, acc1);
  for (int r = 0; r < ROWS; ++r) {
    acc0[r] = lanes_sum<LANES>(acc0[r]);
    if (TWO) acc1[r] = lanes_sum<LANES>(acc1[r]);
  }
}

template <> struct RowsDot<true> {
  template <int MODE, int ROWS, int K_IN, int XS, bool TWO, typename PX, typename PW, typename PS>
  static KFN void run(PX x, PW w0, PS s0, PW w1, PS s1, size_t first, int sub, int step, int rows0, int rows_out,
                      LOCAL float* acc0, LOCAL float* acc1) {
    typedef GgufUnit<MODE> U;
    constexpr int PER = U::VALUES / 32;   // packs of x a unit
    constexpr int GC = U::GROUP_CHUNKS, GROUPS = 4 / GC;   // a pack's scale groups, of GC chunks
    constexpr int UNITS = K_IN / U::VALUES;
    constexpr size_t ROW_BYTES = (size_t)(K_IN / U::BLOCK_VALUES) * U::BLOCK_BYTES;
    for (int u = sub; u < UNITS; u += step) {
      U a[ROWS], b[TWO ? ROWS : 1];
      for (int r = 0; r < ROWS; ++r) {
        const size_t row = first + (size_t)min(rows0 + r, rows_out - 1);
        a[r].load(w0, row * ROW_BYTES, u);
        if (TWO) b[r].load(w1, row * ROW_BYTES, u);
      }
      for (int i = 0; i < PER * GROUPS; ++i) {   // the unit's scale groups: group j of pack p
        const int p = u * PER + i / GROUPS, j = i % GROUPS;
        int la[ROWS][3], lb[TWO ? ROWS : 1][3];
        for (int r = 0; r < ROWS; ++r)
          for (int k = 0; k < 3; ++k) { la[r][k] = 0; lb[TWO ? r : 0][k] = 0; }
        for (int c = j * GC; c < (j + 1) * GC; ++c) {
          int q[6];
          XInts::load(x, p, c, q);
          for (int r = 0; r < ROWS; ++r) {
            int w[2];
            a[r].ints8(4 * (i / GROUPS) + c, w, s0);
            limbs_dot8(w, q, la[r]);
            if (TWO) {
              b[TWO ? r : 0].ints8(4 * (i / GROUPS) + c, w, s1);
              limbs_dot8(w, q, lb[TWO ? r : 0]);
            }
          }
        }
        const float sx = XInts::scale(x, p);
        for (int r = 0; r < ROWS; ++r) {
          acc0[r] += group_part(a[r], i, sx, la[r], x, p, j);
          if (TWO) acc1[r] += group_part(b[TWO ? r : 0], i, sx, lb[TWO ? r : 0], x, p, j);
        }
      }
    }
  }
};

template <> struct RowsDot<false> {
  template <int MODE, int ROWS, int K_IN, int XS, bool TWO, typename PX, typename PW, typename PS>
  static KFN void run(PX x, PW w0, PS s0, PW w1, PS s1, size_t first, int sub, int step, int rows0, int rows_out,
                      LOCAL float* acc0, LOCAL float* acc1) {
    typedef GgufUnit<MODE> U;
    constexpr int UNITS = K_IN / U::VALUES;
    constexpr size_t ROW_BYTES = (size_t)(K_IN / U::BLOCK_VALUES) * U::BLOCK_BYTES;
    for (int u = sub; u < UNITS; u += step) {
      U a[ROWS], b[TWO ? ROWS : 1];
      for (int r = 0; r < ROWS; ++r) {
        const size_t row = first + (size_t)min(rows0 + r, rows_out - 1);
        a[r].load(w0, row * ROW_BYTES, u);
        if (TWO) b[r].load(w1, row * ROW_BYTES, u);
      }
      for (int c = 0; c < U::VALUES / 8; ++c) {
        float xv[8];
        XChunk<XS>::load(x, u * (U::VALUES / 32) + c / 4, c % 4, xv);
        float x_sum = 0.0f;
        for (int i = 0; i < 8; ++i) x_sum += xv[i];
        for (int r = 0; r < ROWS; ++r) {
          acc0[r] += a[r].dot8(c, xv, x_sum, s0);
          if (TWO) acc1[r] += b[TWO ? r : 0].dot8(c, xv, x_sum, s1);
        }
      }
    }
  }
};
"""

# DSV4_KERNEL_MATVEC_TOKENS over GGUF rows (matvec.py's GGUF_TOKENS_MATVEC_KERNEL).
TOKENS = r"""
// One segment of x for TOKS tokens (SEG packs each, token t's pack p at t * SEG + p) against ROWS
// rows: the lane's unit `sub` of the segment (unit seg / PER + sub of the row, PER packs a unit) is
// decoded once per chunk (values8, or ints8 over X_INTS limbs) and multiplied by every token's x,
// acc[r * TOKS + t] += its part. A row's units of a segment are LANES = SEG / PER lanes'.
template <bool INTS> struct TokensDot;

// a[r]: the lane's unit `sub` of the segment from pack seg in rows rows0 + r (clamped to the
// matrix); false where the row has no such unit (the last segment's idle lanes).
template <int ROWS, int K_IN, typename U, typename PW>
KFN bool segment_units(LOCAL U* a, PW w, int seg, int rows0, int rows_out, int sub) {
  constexpr size_t ROW_BYTES = (size_t)(K_IN / U::BLOCK_VALUES) * U::BLOCK_BYTES;
  const int u = seg / (U::VALUES / 32) + sub;
  if (u >= K_IN / U::VALUES) return false;
  for (int r = 0; r < ROWS; ++r) a[r].load(w, (size_t)min(rows0 + r, rows_out - 1) * ROW_BYTES, u);
  return true;
}

template <> struct TokensDot<false> {
  template <int MODE, int ROWS, int SEG, int K_IN, int XS, int TOKS, typename PX, typename PW, typename PS>
  static KFN void run(PX x, PW w, PS tables, int seg, int rows0, int rows_out, int sub, LOCAL float* acc) {
    typedef GgufUnit<MODE> U;
    constexpr int PER = U::VALUES / 32;
    U a[ROWS];
    if (!segment_units<ROWS, K_IN>(a, w, seg, rows0, rows_out, sub)) return;
    for (int c = 0; c < U::VALUES / 8; ++c) {
      float v[ROWS][8], mul[ROWS], low[ROWS];
      for (int r = 0; r < ROWS; ++r) {
        a[r].values8(c, v[r], tables);
        const float2 m = a[r].scales8(c);
        mul[r] = m.x;
        low[r] = m.y;
      }
      for (int t = 0; t < TOKS; ++t) {
        float xv[8];
        XChunk<XS>::load(x, t * SEG + sub * PER + c / 4, c % 4, xv);
        float x_sum = 0.0f;
        if (U::MINS)
          for (int i = 0; i < 8; ++i) x_sum += xv[i];
        for (int r = 0; r < ROWS; ++r)   // as dot8 writes it (the same fp32 contractions)
          acc[r * TOKS + t] += U::MINS ? mul[r] * chunk_dot8(v[r], xv) - low[r] * x_sum : mul[r] * chunk_dot8(v[r], xv);
      }
    }
  }
};

template <> struct TokensDot<true> {
  template <int MODE, int ROWS, int SEG, int K_IN, int XS, int TOKS, typename PX, typename PW, typename PS>
  static KFN void run(PX x, PW w, PS tables, int seg, int rows0, int rows_out, int sub, LOCAL float* acc) {
    typedef GgufUnit<MODE> U;
    constexpr int PER = U::VALUES / 32;
    U a[ROWS];
    if (!segment_units<ROWS, K_IN>(a, w, seg, rows0, rows_out, sub)) return;
    constexpr int GC = U::GROUP_CHUNKS, GROUPS = 4 / GC;
    for (int i = 0; i < PER * GROUPS; ++i) {   // the unit's scale groups: group j of pack p
      const int p = sub * PER + i / GROUPS, j = i % GROUPS;   // p: the pack within the segment
      int l[ROWS * TOKS][3];
      for (int n = 0; n < ROWS * TOKS; ++n) l[n][0] = l[n][1] = l[n][2] = 0;
      for (int c = j * GC; c < (j + 1) * GC; ++c) {
        int wq[ROWS][2];
        for (int r = 0; r < ROWS; ++r) a[r].ints8(4 * (i / GROUPS) + c, wq[r], tables);
        for (int t = 0; t < TOKS; ++t) {
          int q[6];
          XInts::load(x, t * SEG + p, c, q);
          for (int r = 0; r < ROWS; ++r) limbs_dot8(wq[r], q, l[r * TOKS + t]);
        }
      }
      for (int t = 0; t < TOKS; ++t) {   // as RowsDot<true>: each group's sum converted once
        const float sx = XInts::scale(x, t * SEG + p);
        for (int r = 0; r < ROWS; ++r)
          acc[r * TOKS + t] += group_part(a[r], i, sx, l[r * TOKS + t], x, t * SEG + p, j);
      }
    }
  }
};
"""

# x_stride's integer units: those of INT_MODE_IDS.
UNITS = UNITS.replace("INT_UNIT", "(" + " || ".join(f"MODE == {m}" for m in INT_MODE_IDS.values()) + ")")
HEADER = BLOCK_LOADS + UNITS


@dataclass(frozen=True)
class GGUFMatrix:
    """One weight kept as GGUF blocks: routed experts [E, out, row bytes] or a matrix
    [out, row bytes], uint8, in the GGUF's own byte order."""

    weight: mx.array
    qtype: str

    @property
    def in_features(self) -> int:
        return gguf_blocks.in_features(self.qtype, self.weight.shape[-1])

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]

    @property
    def layout(self) -> tuple:
        return ("gguf", self.qtype)

    @property
    def paired(self) -> bool:
        """Q8_0 read two blocks at a time (DSV4_KERNEL_GGUF_Q8_PAIRS; rows of 64k values)."""
        return self.qtype == "Q8_0" and self.in_features % 64 == 0 and bool(flags.get("kernel_gguf_q8_pairs"))

    @property
    def wide(self) -> bool:
        """Read with 16-byte loads (DSV4_KERNEL_GGUF_WIDE; a unit of its own for the type)."""
        return self.qtype in WIDE_MODE_IDS and flags.switch("kernel_gguf_wide", backend() == "cuda")

    @property
    def hsub(self) -> bool:
        """Q8_0's wide unit with its int8s' bias taken off fp16 pairs (DSV4_KERNEL_GGUF_Q8_HSUB)."""
        return self.qtype == "Q8_0" and self.wide and flags.switch("kernel_gguf_q8_hsub", backend() == "cuda")

    @property
    def halves(self) -> bool:
        """Codes made fp16 subnormals (DSV4_KERNEL_GGUF_HALVES; IQ2_XXS and Q2_K with the wide units)."""
        return (self.qtype in HALVES_MODE_IDS and flags.switch("kernel_gguf_halves", backend() == "cuda")
                and (self.wide or self.qtype not in WIDE_MODE_IDS))

    @property
    def block_values(self) -> int:
        """Values of the unit a kernel's work split must keep whole: a block, or a pair."""
        return 64 if self.paired and not self.wide else gguf_blocks.BLOCK_WEIGHTS[self.qtype]

    def unit_values(self, integer: bool = False) -> int:
        """Values of a lane's unit in the unit `template(integer=integer)` picks (UNIT_VALUES; a pair
        of Q8_0 blocks is one)."""
        return 64 if self.paired and not self.wide and not integer else UNIT_VALUES[self.qtype]

    @property
    def integer(self) -> bool:
        """A type with an integer unit (DSV4_KERNEL_GGUF_DP4A); the launch decides whether it
        takes it (x must be fp8-rounded, and its other matrix integer too)."""
        return self.qtype in INT_MODE_IDS and flags.switch(
            "kernel_gguf_dp4a", backend() == "cuda" and self.qtype in DP4A_AUTO_TYPES)

    def template(self, prefix: str = "", integer: bool = False) -> list:
        """MODE (the unit the switches pick; with `integer`, the integer unit), BITS, GS."""
        if integer:
            mode = INT_MODE_IDS[self.qtype]
        elif self.halves:
            mode = HALVES_MODE_IDS[self.qtype]
        elif self.hsub:
            mode = Q8_0_HSUB
        elif self.wide:
            mode = WIDE_MODE_IDS[self.qtype]
        else:
            mode = Q8_0_PAIRS if self.paired else GGUF_MODE_IDS[self.qtype]
        return [(prefix + "MODE", mode), (prefix + "BITS", 0), (prefix + "GS", 0)]

    def operands(self) -> list:
        """weight, tables (IQ2_XXS's grid and signs; else a placeholder), and a placeholder bias."""
        tables = iq2_xxs_tables() if self.qtype == "IQ2_XXS" else _placeholder()
        return [self.weight, tables, _placeholder()]

    def dequantized(self, dtype=mx.float32) -> mx.array:
        return gguf_blocks.dequantize(self.weight, self.qtype).astype(dtype)


def supported(m: GGUFMatrix) -> bool:
    """Whether rows_dot decodes m: a known type whose rows hold whole units."""
    return (m.qtype in GGUF_MODE_IDS and m.weight.dtype == mx.uint8
            and m.in_features % UNIT_VALUES[m.qtype] == 0)


@lru_cache(maxsize=1)
def iq2_xxs_tables() -> mx.array:
    """IQ2_XXS's grid as bytes (256 entries x 8 values, 512 words), its 128 sign bytes, then from
    word IQ2_PAIRS_AT the grid as the halves unit's fp16 pairs: each entry's values
    (0, 2), (1, 3), (4, 6), (5, 7) as 16-bit integers g (the fp16 subnormals g 2^-24), low first."""
    grid = gguf_blocks.iq2_xxs_grid().astype(np.uint8)
    pairs = grid[:, [0, 2, 1, 3, 4, 6, 5, 7]].astype(np.uint16).reshape(-1)
    return mx.array(np.concatenate([grid.reshape(-1), gguf_blocks.iq2_xxs_signs(), pairs.view(np.uint8)]).view(np.uint32))


@lru_cache(maxsize=1)
def _placeholder() -> mx.array:
    return mx.zeros((8,), mx.uint32)
