"""Prefill's routed experts on CUDA tensor cores (flag `kernel_prefill_experts_mma`; auto: chunks
whose experts average a full tile, where the H200 measured it faster than gather_qmm).

At prefill the (token, expert) pairs come sorted by expert (moe.RoutedExperts), each expert a
run of rows; each sorted pair reads its token's row of x (`x_rows`) and stores its product in
(token, slot) order (`out_rows`), so that neither x nor the products are gathered around the
launch (at a 4096-token chunk each gather moved 251 MB a layer at 0.26 TB/s on an H100). MLX's
gather_qmm multiplies them at 26 TFLOP/s on the H200, 3% of its bf16 rate
(benchmarks/results/2026-12-04-0241-prefill-matmuls.md); its gather_mm on bf16 weights is no
faster. Here a threadgroup multiplies a tile of up to 32 pairs of one expert by 64 rows of that
expert's MX matrix with mma.sync m16n8k16: the weights as fp16 A fragments straight from their
codes (word_pair_bits, exact), the pairs' x as fp16 B fragments, 8 pairs a fragment.

Numbers: a 32-value group of weights shares one e8m0 scale, and the pack of x it meets one power
of two (store_x_halves, which keeps |x / s| <= 2^15, so every bf16 value of the pack but those
below 2^-29 of its largest is an exact fp16); the products are exact in the tensor core and
summed in fp32, one group at a time, then scaled by both and added. Rounded to bf16 at the end,
as gather_qmm's output is.

Layout of a launch: grid (128, ceil(N / 64), tiles): SIMD group w makes rows 16 w.. of the
threadgroup's 64, for all the tile's pairs (4 blocks of 8). The input is walked in chunks of 128
(4 groups): the threadgroup first writes the chunk of its pairs' x as fp16 pairs in the order
the A fragments hold the weights, then every SIMD group reads its B fragments from there.
Fragments (PTX ISA, m16n8k16, lane = 4 q + t): A {(q, 2t..), (q+8, 2t..), (q, 2t+8..),
(q+8, 2t+8..)}, B {(2t.., q), (2t+8.., q)}, D {(q, 2t), (q, 2t+1), (q+8, 2t), (q+8, 2t+1)}. In
step s (0, 1) of a group, lane t's A registers hold weight pairs 8s + 2t and 8s + 2t + 1 of its
rows, so its B registers hold x at those pairs' places.

KERNEL_BF16 (DSV4_KERNEL_PREFILL_EXPERTS_BF16) takes the same fragments in bf16, where the
weights carry their scales and x needs no power of two, and KERNEL_STREAM
(DSV4_KERNEL_PREFILL_EXPERTS_STREAM) its tiles with the loads a chunk ahead: see their comments.
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels.dialect import Kernel, backend, falls_back
from dsv4.kernels.experts import _HEADER, MODE_IDS

TILE_PAIRS = 32    # pairs of one expert per threadgroup
TILE_ROWS = 64     # output rows per threadgroup (16 per SIMD group)
THREADS = 128
CHUNK = 128        # input values per shared-memory chunk (4 groups)
X_STRIDE = 72      # uint32 per pair's row of the chunk: 64 fp16 pairs, padded off the bank period
MIN_PAIRS = 64     # fewer pairs (decode, verification) keep gather_qmm
MX_MODES = {"mxfp4": 4, "mxfp8": 8}   # the MX layouts (bits) the launches decode, in groups of 32

_PREAMBLE = r"""
  // grid (THREADS, ceil(N / 64), tiles); tile z = (expert, first pair, pairs) in `tiles`.
  // Sorted pair p multiplies x's row x_rows[p] into y's row y_rows[p].
  constexpr int GROUPS = K / 32;
  const int expert = tiles[3 * (int)group_z], first = tiles[3 * (int)group_z + 1];
  const int count = tiles[3 * (int)group_z + 2];
  if (count <= 0) return;   // a slot past the last tile (the grid is sized for the most there can be)
  const int q = (int)lane >> 2, t = (int)lane & 3;
  const int row0 = (int)group_y * 64 + 16 * (int)warp;
  const int ra = min(row0 + q, N - 1), rb = min(row0 + q + 8, N - 1);
  const size_t wa_row = ((size_t)expert * N + ra) * GROUPS, wb_row = ((size_t)expert * N + rb) * GROUPS;
  SHARED uint32_t xp[32 * XSTRIDE];
  SHARED float xsc[32 * 4];
  float acc[4][4];
  for (int j = 0; j < 4; ++j) for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
"""

# Group g (= 4 c + gl) of the chunk: the lane's weight words wa, wb of rows ra, rb and their
# scales sa, sb, times the staged x, summed into acc.
_GROUP = r"""
      uint32_t a[2][4];
      for (int st = 0; st < 2; ++st) {
        const int p = 8 * st + 2 * t;
        const uint32_t ua = step_word<MODE>(wa, st, t), ub = step_word<MODE>(wb, st, t);
        a[st][0] = word_pair_bits<MODE>(ua, p); a[st][1] = word_pair_bits<MODE>(ub, p);
        a[st][2] = word_pair_bits<MODE>(ua, p + 1); a[st][3] = word_pair_bits<MODE>(ub, p + 1);
      }
      for (int j = 0; j < 4; ++j) {
        const int row = (8 * j + q) * XSTRIDE + 16 * gl + 2 * t;
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int st = 0; st < 2; ++st) {
          const uint32_t b[2] = {xp[row + 8 * st], xp[row + 8 * st + 1]};
          mma_16816(d, a[st], b);
        }
        const float x0 = xsc[(8 * j + 2 * t) * 4 + gl], x1 = xsc[(8 * j + 2 * t + 1) * 4 + gl];
        acc[j][0] += d[0] * (sa * x0); acc[j][1] += d[1] * (sa * x1);
        acc[j][2] += d[2] * (sb * x0); acc[j][3] += d[3] * (sb * x1);
      }
"""

_STORE = r"""
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 4; ++i) {
      const int pr = 8 * j + 2 * t + (i & 1), row = row0 + q + (i >= 2 ? 8 : 0);
      if (pr < count && row < N) y[(size_t)y_rows[first + pr] * N + row] = static_cast<T>(acc[j][i]);
    }
"""

_BODY = _PREAMBLE + r"""
  for (int c = 0; c < GROUPS / 4; ++c) {
STAGE
    BARRIER();
    for (int gl = 0; gl < 4; ++gl) {
      const int g = 4 * c + gl;
      uint32_t wa[BITS], wb[BITS];
      load_words<BITS>(w + (wa_row + g) * BITS, wa);
      load_words<BITS>(w + (wb_row + g) * BITS, wb);
      const float sa = e8m0_scale((uint32_t)s[wa_row + g]), sb = e8m0_scale((uint32_t)s[wb_row + g]);
GROUP
    }
    BARRIER();
  }
""".replace("GROUP\n", _GROUP) + _STORE

# The staging of a chunk: thread tid makes group tid % 4 of the chunk for pair tid / 4 of the tile
# (zeros past its end) as fp16 pairs in the A fragments' order and the pack's power of two.
_CONVERT = r"""
    {
      const int pr = (int)tid >> 2, gl = (int)tid & 3;
      uint32_t* to = xp + pr * XSTRIDE + 16 * gl;
      if (pr < count) {
        float v[32];
        for (int c8 = 0; c8 < 4; ++c8) load_bf16_8(x + (size_t)x_rows[first + pr] * K, 4 * c + gl, c8, v + 8 * c8);
        xsc[pr * 4 + gl] = pack_x_pairs<MODE>(to, v);
      } else {
        for (int p = 0; p < 16; ++p) to[p] = 0u;
        xsc[pr * 4 + gl] = 0.0f;
      }
    }
"""
# DSV4_KERNEL_PREFILL_EXPERTS_BF16: the mma in bf16, where each weight with its group's e8m0
# scale and each value of x are exact, so nothing is scaled per group: a lane's A fragments are
# its share of the codes (one word of fp4) moved into bf16's fields and multiplied by the group's
# power of two (slot_bits, scaled_slot), the B side is x itself, moved into the same order
# (pack_bf16_pairs), and the tensor core sums each pair's row over the whole input. A group then
# costs its decoding and the mma.syncs alone, against _GROUP's per-group scales and sums; and a
# tile is 64 pairs (its empty blocks of 8 skipped) by 128 rows, 32 a SIMD group in two sets of 16
# that share their B fragments, so an expert's weights are read once for up to 64 of its pairs
# and a tile's x once for 128 rows. Matrices of fewer than 32 rows keep the plain launch.
BF16_TILE_PAIRS = 64
BF16_TILE_ROWS = 128

_BF16_STAGE = r"""
    for (int h = 0; h < 2; ++h) {   // pairs tid / 4 and 32 + tid / 4, group tid % 4 of the chunk
      const int pr = ((int)tid >> 2) + 32 * h, gl = (int)tid & 3;
      uint32_t* to = xp + pr * XSTRIDE + 16 * gl;
      if (pr < count) pack_bf16_pairs<MODE>(to, x + (size_t)x_rows[first + pr] * K + 32 * (4 * c + gl));
      else if (pr < 8 * blocks) for (int i = 0; i < 16; ++i) to[i] = 0u;
    }
"""

_BF16_BODY = r"""
  // grid (THREADS, ceil(N / 128), tiles); tile z = (expert, first pair, pairs <= 64) in `tiles`.
  // Sorted pair p multiplies x's row x_rows[p] into y's row y_rows[p].
  constexpr int GROUPS = K / 32;
  const int expert = tiles[3 * (int)group_z], first = tiles[3 * (int)group_z + 1];
  const int count = tiles[3 * (int)group_z + 2];
  if (count <= 0) return;   // a slot past the last tile (the grid is sized for the most there can be)
  const int q = (int)lane >> 2, t = (int)lane & 3, blocks = (count + 7) / 8;
  // The SIMD group's 32 rows, the last ones moved back to end at row N - 1 (N >= 32): rows some
  // group already makes are made again, and stored again with the same bits, so that the lane's
  // rows q, q + 8 (set 0), q + 16, q + 24 (set 1) lie at fixed distances from its first.
  const int row0 = min((int)group_y * 128 + 32 * (int)warp, N - 32);
  constexpr int LANE_WORDS = BITS / 4;   // a lane's words of a row's group: values 8 t..8 t + 7
  GLOBAL uint32_t* wl = w + ((size_t)expert * N + row0 + q) * GROUPS * BITS + LANE_WORDS * t;
  GLOBAL uint8_t* sl = s + ((size_t)expert * N + row0 + q) * GROUPS;
  SHARED uint32_t xp[64 * XSTRIDE];
  float acc[2][8][4];
  for (int set = 0; set < 2; ++set)
    for (int j = 0; j < 8; ++j) for (int i = 0; i < 4; ++i) acc[set][j][i] = 0.0f;
  for (int c = 0; c < GROUPS / 4; ++c) {
STAGE
    BARRIER();
    for (int gl = 0; gl < 4; ++gl) {
      const int g = 4 * c + gl;
      uint32_t a[2][2][4];   // [set][mma step]
      for (int set = 0; set < 2; ++set) {
        uint32_t wa[LANE_WORDS], wb[LANE_WORDS];   // the lane's share of the group in rows q, q + 8
        for (int i = 0; i < LANE_WORDS; ++i) {
          wa[i] = wl[(16 * set * GROUPS + g) * BITS + i];
          wb[i] = wl[((16 * set + 8) * GROUPS + g) * BITS + i];
        }
        const uint32_t sa = sl[16 * set * GROUPS + g], sb = sl[(16 * set + 8) * GROUPS + g];
        for (int st = 0; st < 2; ++st) {
          a[set][st][0] = scaled_slot<MODE>(wa, st, 0, sa); a[set][st][1] = scaled_slot<MODE>(wb, st, 0, sb);
          a[set][st][2] = scaled_slot<MODE>(wa, st, 1, sa); a[set][st][3] = scaled_slot<MODE>(wb, st, 1, sb);
        }
      }
      const uint32_t* xb = xp + q * XSTRIDE + 16 * gl + 2 * t;   // block j's pairs 8 j XSTRIDE further
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < blocks) {   // the same for the whole threadgroup
          for (int st = 0; st < 2; ++st) {
            const uint32_t b[2] = {xb[8 * j * XSTRIDE + 8 * st], xb[8 * j * XSTRIDE + 8 * st + 1]};
            mma_16816_bf16(acc[0][j], a[0][st], b);
            mma_16816_bf16(acc[1][j], a[1][st], b);
          }
        }
    }
    BARRIER();
  }
#pragma unroll
  for (int set = 0; set < 2; ++set)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int pr = 8 * j + 2 * t + (i & 1), row = row0 + 16 * set + q + (i >= 2 ? 8 : 0);
        if (pr < count) y[(size_t)y_rows[first + pr] * N + row] = static_cast<T>(acc[set][j][i]);
      }
"""

# DSV4_KERNEL_PREFILL_EXPERTS_STREAM: KERNEL_BF16's tiles, products and sums, fed without
# waiting. There every group starts with its weights' loads (a word per lane and row, 8 rows a
# load instruction) and every chunk with its x's, so a SIMD group waits out a load's latency a
# group at a time for a few dozen mma.syncs (at 2048 tokens, 32 pairs an expert: 4 blocks of 8).
# Here a lane holds a whole group of each of its rows in a chunk (group 4 c + t: its 16 or 32
# bytes in one or two 16-byte loads, a chunk ahead in registers), and the chunk's x comes by
# cp.async into one of two buffers while the chunk before multiplies, moved, not reordered: mma
# step S (0-7) of a chunk gives lane t values 32 t + 4 S .. + 3 of the chunk, so the weights' codes
# become bf16 pairs of neighbours (stream_pair) and x's pairs are its bf16 words as they lie.
# A pair's chunk of x is 16 pieces of 16 bytes, piece 4 t + i (values 32 t + 8 i ..) stored at
# place (4 t + i) ^ (t & 2) ^ (pair & 1): the 8 lanes of a 16-byte read (pairs q, q + 1, lanes t
# 0-3) then meet 8 distinct bank quads, with no padding (two buffers in 32 KB).
STREAM_X_WORDS = 64   # uint32 per pair's chunk of x in a buffer

_STREAM_HEADER = f"constexpr int STREAM_X_WORDS = {STREAM_X_WORDS};\n" + r"""
// The bf16 pair of a group's values 2b and 2b + 1 (byte b of word w, MODE 1; bytes 2b, 2b + 1 of w,
// MODE 2) in slot_bits' fields (the same values, times 2^-126 or 2^-120), low value first.
template <int MODE> KFN uint32_t stream_pair(uint32_t w, uint32_t w4, int b) {
  if (MODE == 1) {   // w4 = w << 4: byte b's low nibble to the low half, its high one to the high half
    const uint32_t z = BYTE_PERM(w4, w, (uint32_t)(b | (b << 4) | ((4 + b) << 8) | ((4 + b) << 12)));
    return ((z & 0x00f000f0u) * 0x104u) & 0x81c081c0u;
  }
  const uint32_t z = BYTE_PERM(w, 0u, (uint32_t)((2 * b) | (4 << 4) | ((2 * b + 1) << 8) | (4 << 12)));
  return ((z & 0x007f007fu) << 4) | ((z & 0x00800080u) << 8);
}
// A pair's weights times their group's scale 2^m (m: the code less MODE's bias) as scaled_slot
// makes it: the power past bf16's largest in a second step, which only HUGE chunks take.
template <bool HUGE> KFN uint32_t stream_scaled(uint32_t v, int m) {
  const uint32_t r = H2_MUL_BF16_BITS(v, bf16_pow2_pair(min(m, 127)));
  return HUGE ? H2_MUL_BF16_BITS(r, bf16_pow2_pair(m > 127 ? m - 127 : 0)) : r;
}
// Piece i (0-3) of lane t's group in the chunk of x of a pair of parity odd: its place in the buffer row.
KFN int stream_piece(int t, int i, int odd) { return (4 * t + i) ^ (t & 2) ^ odd; }
// Chunk c of the tile's x (its `count` pairs from `first`, pair p's row x_rows[p]) into buffer c & 1
// of xs by cp.async, one group: thread tid copies piece tid % 16 of pairs tid / 16 + 8 r.
template <int K, typename PX, typename PR>
KFN void stream_stage(uint32_t* xs, PX x, PR x_rows, int first, int count, uint32_t tid, int c) {
  const int piece = (int)tid & 15;
  for (int r = 0; r < 8; ++r) {
    const int pr = ((int)tid >> 4) + 8 * r;
    if (pr < count)
      cp_async16(xs + (c & 1) * 64 * STREAM_X_WORDS + pr * STREAM_X_WORDS + 4 * stream_piece(piece >> 2, piece & 3, pr & 1),
                 x + (size_t)x_rows[first + pr] * K + 128 * c + 8 * piece);
  }
  cp_async_commit();
}
// The lane's words and scale codes of chunk c: its group 4 c + t of rows q, q + 8, q + 16, q + 24
// (wl and sl at its first row's group t; row r 8 r rows further).
template <int BITS, int GROUPS>
KFN void stream_rows(GLOBAL uint32_t* wl, GLOBAL uint8_t* sl, int c, uint32_t (&w)[4][BITS], uint32_t* code) {
  for (int r = 0; r < 4; ++r) {
    for (int h = 0; h < BITS / 4; ++h) {
      const uint4 u = LOAD_U4(wl + (size_t)8 * r * GROUPS * BITS + 4 * BITS * c, h);
      w[r][4 * h] = u.x; w[r][4 * h + 1] = u.y; w[r][4 * h + 2] = u.z; w[r][4 * h + 3] = u.w;
    }
    code[r] = sl[(size_t)8 * r * GROUPS + 4 * c];
  }
}
"""

# One chunk's products, from the lane's words wc[row][word] and its groups' scale powers m[row],
# over x in buffer xb: for each pair of mma steps (2 i, 2 i + 1), a 16-byte read of x per block of
# 8 pairs and the A fragments of both sets.
_STREAM_CHUNK = r"""
template <int MODE, int BITS, bool HUGE>
KFN void stream_chunk(const uint32_t (&wc)[4][BITS], const int* m,
                      const uint32_t* xb, int blocks, int q, int t, float (&acc)[2][8][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t a[2][2][4];   // [set][step 2 i + s][register]
#pragma unroll
    for (int set = 0; set < 2; ++set)
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int ra = 2 * set, rb = 2 * set + 1;   // rows q + 16 set and q + 8 + 16 set
        uint32_t wa, wb, wa4 = 0u, wb4 = 0u;
        int lo;
        if (MODE == 1) { wa = wc[ra][i]; wb = wc[rb][i]; wa4 = wa << 4; wb4 = wb << 4; lo = 2 * s; }
        else { wa = wc[ra][2 * i + s]; wb = wc[rb][2 * i + s]; lo = 0; }
        a[set][s][0] = stream_scaled<HUGE>(stream_pair<MODE>(wa, wa4, lo), m[ra]);
        a[set][s][1] = stream_scaled<HUGE>(stream_pair<MODE>(wb, wb4, lo), m[rb]);
        a[set][s][2] = stream_scaled<HUGE>(stream_pair<MODE>(wa, wa4, lo + 1), m[ra]);
        a[set][s][3] = stream_scaled<HUGE>(stream_pair<MODE>(wb, wb4, lo + 1), m[rb]);
      }
    const uint32_t* xr = xb + q * STREAM_X_WORDS + 4 * stream_piece(t, i, q & 1);
#pragma unroll
    for (int j = 0; j < 8; j += 2)
      if (j < blocks) {   // the same for the whole threadgroup; block j + 1 too (past the tile: unstored)
        const uint4 v = *reinterpret_cast<const uint4*>(xr + 8 * j * STREAM_X_WORDS);
        const uint4 u = *reinterpret_cast<const uint4*>(xr + 8 * (j + 1) * STREAM_X_WORDS);
        const uint32_t b[2][2][2] = {{{v.x, v.y}, {v.z, v.w}}, {{u.x, u.y}, {u.z, u.w}}};   // [block][step]
#pragma unroll
        for (int s = 0; s < 2; ++s)   // four sums apart: each mma.sync's sum is not the next one's input
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            mma_16816_bf16(acc[0][j + jj], a[0][s], b[jj][s]);
            mma_16816_bf16(acc[1][j + jj], a[1][s], b[jj][s]);
          }
      }
  }
}
"""

_STREAM_BODY = r"""
  // grid (THREADS, ceil(N / 128), tiles); tile z = (expert, first pair, pairs <= 64) in `tiles`.
  // Sorted pair p multiplies x's row x_rows[p] into y's row y_rows[p].
  constexpr int GROUPS = K / 32;
  constexpr int CHUNKS = K / 128;
  const int expert = tiles[3 * (int)group_z], first = tiles[3 * (int)group_z + 1];
  const int count = tiles[3 * (int)group_z + 2];
  if (count <= 0) return;   // a slot past the last tile (the grid is sized for the most there can be)
  const int q = (int)lane >> 2, t = (int)lane & 3, blocks = (count + 7) / 8;
  const int row0 = min((int)group_y * 128 + 32 * (int)warp, N - 32);   // as KERNEL_BF16's
  // The lane's rows q, q + 8, q + 16, q + 24 (row r: 8 r further), its group t of each chunk.
  GLOBAL uint32_t* wl = w + ((size_t)expert * N + row0 + q) * GROUPS * BITS + BITS * t;
  GLOBAL uint8_t* sl = s + ((size_t)expert * N + row0 + q) * GROUPS + t;
  alignas(16) SHARED uint32_t xs[2 * 64 * STREAM_X_WORDS];
  float acc[2][8][4];
  for (int set = 0; set < 2; ++set)
    for (int j = 0; j < 8; ++j) for (int i = 0; i < 4; ++i) acc[set][j][i] = 0.0f;
  uint32_t wc[4][BITS], wn[4][BITS], code[4], next[4];
  stream_stage<K>(xs, x, x_rows, first, count, tid, 0);
  stream_rows<BITS, GROUPS>(wl, sl, 0, wc, code);
  for (int c = 0; c < CHUNKS; ++c) {
    if (c + 1 < CHUNKS) {   // the next chunk's x and weights in flight while this one multiplies
      stream_stage<K>(xs, x, x_rows, first, count, tid, c + 1);
      stream_rows<BITS, GROUPS>(wl, sl, c + 1, wn, next);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    int m[4];
    bool huge = false;
    for (int r = 0; r < 4; ++r) {
      m[r] = (int)code[r] - (MODE == 1 ? 1 : 7);
      huge = huge || m[r] > 127;
    }
    huge = simd_max_f(huge ? 1.0f : 0.0f) > 0.0f;   // the SIMD group's one path
    BARRIER();
    const uint32_t* xb = xs + (c & 1) * 64 * STREAM_X_WORDS;
    if (huge) stream_chunk<MODE, BITS, true>(wc, m, xb, blocks, q, t, acc);
    else stream_chunk<MODE, BITS, false>(wc, m, xb, blocks, q, t, acc);
    BARRIER();   // the buffer is the next chunk's but one
    for (int r = 0; r < 4; ++r) {
      for (int i = 0; i < BITS; ++i) wc[r][i] = wn[r][i];
      code[r] = next[r];
    }
  }
#pragma unroll
  for (int set = 0; set < 2; ++set)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int pr = 8 * j + 2 * t + (i & 1), row = row0 + 16 * set + q + (i >= 2 ? 8 : 0);
        if (pr < count) y[(size_t)y_rows[first + pr] * N + row] = static_cast<T>(acc[set][j][i]);
      }
"""

# The fp16 launch's A and B sides: MX codes as fp16 pairs, x's packs as fp16 with a power of two.
_HALVES_HEADER = r"""
// Pair p (< 16) of a 32-value group of MX codes, from the word holding it (MODE 1's word p/4,
// MODE 2's p/2): two weights whose fp16 bits one mask-and-shift gives (unpack8's tricks: MODE 1
// nibbles j and j+4 of the word, MODE 2 bytes j and j+2), scaled by 2^-14 (2^-8). pair_k: the
// low weight's place in the group; the high one is PAIR_GAP (4, 2) further.
template <int MODE> KFN uint32_t word_pair_bits(uint32_t word, int p) {
  if (MODE == 1) {
    const uint32_t q = word >> (4 * (p & 3));
    return ((q & 0x00070007u) << 9) | ((q & 0x00080008u) << 12);
  }
  const uint32_t q = word >> (8 * (p & 1));
  return ((q & 0x007f007fu) << 7) | ((q & 0x00800080u) << 8);
}
template <int MODE> KFN int pair_k(int p) { return MODE == 1 ? 8 * (p >> 2) + (p & 3) : 4 * (p >> 1) + (p & 1); }

// Pack p (32 values v) of an input as the B side reads it: per value the fp16 bits of v / s,
// s = the pack's power of two that keeps |v / s| <= 2^15, and with LO, lo_at values further (a
// second plane), the fp16 bits of what that leaves (hi + lo carries 22 bits: a bf16 x exactly;
// without LO, values below 2^-32 of the pack's largest lose bits, as fp16 subnormals).
template <bool LO, typename PH, typename PS>
KFN void store_x_halves(PH xh, PS xscale, int p, LOCAL const float* v, int lo_at = 0) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = FMAX(amax, FABS(v[i]));
  const float s = pow2_ceil(FMAX(amax * (1.0f / 32768.0f), 1.17549435e-38f));
  const float inv = 1.0f / s;   // exact: s is a power of two
  xscale[p] = s;
  for (int i = 0; i < 32; ++i) {
    const float a = v[i] * inv;
    const uint32_t hi = F2H_BITS(a);
    xh[32 * p + i] = hi;
    if (LO) xh[lo_at + 32 * p + i] = F2H_BITS(a - half2_bits_to_float2(hi).x);
  }
}
"""

# The fp16 launch's staging: a pack's fp16 pairs in the A fragments' order and its power of two;
# and the word of a group's codes a lane's A fragments take.
_PACK_HEADER = r"""
// The word of a group's codes (w) holding this lane's pairs 8 st + 2t and 8 st + 2t + 1 in mma
// step st: MODE 1's word 2 st + t / 2, MODE 2's 4 st + t, picked by selects on t's bits (indexing
// the words by t compiles to a predicated move a word and pair).
template <int MODE> KFN uint32_t step_word(LOCAL const uint32_t* w, int st, int t) {
  if (MODE == 1) return (t & 2) ? w[2 * st + 1] : w[2 * st];
  const uint32_t lo = (t & 1) ? w[4 * st + 1] : w[4 * st], hi = (t & 1) ? w[4 * st + 3] : w[4 * st + 2];
  return (t & 2) ? hi : lo;
}
// Pack (32 values v) of an input row as the tiles' B side reads it: its 16 fp16 pairs at dst in
// the order word_pair_bits holds the weights (pair_k; the high one PAIR_GAP further), and,
// returned, the pack's power of two (store_x_halves) times the 2^14 (2^8) word_pair_bits takes out.
template <int MODE, typename PD>
KFN float pack_x_pairs(PD dst, LOCAL const float* v) {
  constexpr int PAIR_GAP = MODE == 1 ? 4 : 2;
  uint32_t hv[32];
  float xs;
  store_x_halves<false>(hv, &xs, 0, v);
  for (int p = 0; p < 16; ++p) {
    const int k = pair_k<MODE>(p);
    dst[p] = (hv[k] & 0xffffu) | (hv[k + PAIR_GAP] << 16);
  }
  return xs * (MODE == 1 ? 16384.0f : 256.0f);
}
"""
# What the bf16 launch adds: the weights of a pair as bf16 with their group's scale, and x's
# pack in the A fragments' order, moved.
_BF16_HEADER = r"""
// Lane t's share of a row's group of 32 codes is values 8t..8t+7 (MODE 1's word t, MODE 2's
// words 2t and 2t + 1), fed as four k slots of two weights each: slot (st, h), mma step st,
// register half h (k 2t.. or 2t+8..), holds values 8t + 2st + h and 4 further (MODE 1) or
// 8t + 4st + h and 2 further (MODE 2). slot_bits: that pair's codes moved into bf16's fields,
// their values times 2^-126 (e2m1) or 2^-120 (e4m3), subnormal for the smallest, exact. MODE 1
// takes three instructions a pair: its two nibbles masked out, then copied to bits 6-9 and
// 12-15 of each half at once by a multiply (the copies do not overlap), then the fields kept.
template <int MODE> KFN uint32_t slot_bits(LOCAL const uint32_t* w, int st, int h) {
  if (MODE == 1) {
    const uint32_t x = st ? w[0] >> 8 : w[0];
    return ((x & (h ? 0x00f000f0u : 0x000f000fu)) * (h ? 0x104u : 0x1040u)) & 0x81c081c0u;
  }
  const uint32_t x = w[st] >> (8 * h);
  return ((x & 0x007f007fu) << 4) | ((x & 0x00800080u) << 8);
}
KFN uint32_t bf16_pow2_pair(int m) { const uint32_t h = (uint32_t)(m + 127) << 7; return h | (h << 16); }
// Slot (st, h)'s two weights times their group's scale 2^(code - 127), as bf16 bits: exact (the
// values have 2 or 4 significant bits, and bf16 reaches 2^-133), but for codes whose weights
// pass bf16's (fp32's) largest value, infinite as the reference's are. The power of two past
// bf16's largest (2^127: codes past 128, 134) is applied in two steps.
template <int MODE> KFN uint32_t scaled_slot(LOCAL const uint32_t* w, int st, int h, uint32_t code) {
  const int m = (int)code - (MODE == 1 ? 1 : 7);
  const uint32_t v = H2_MUL_BF16_BITS(slot_bits<MODE>(w, st, h), bf16_pow2_pair(min(m, 127)));
  return m > 127 ? H2_MUL_BF16_BITS(v, bf16_pow2_pair(m - 127)) : v;
}
// Pack (32 bf16 values at src, 16-byte aligned) as the B side reads it: the pair of slot
// (st, h) of lane t at word 8st + 2t + h of dst, moved.
template <int MODE, typename PD, typename PX> KFN void pack_bf16_pairs(PD dst, PX src) {
  for (int t = 0; t < 4; ++t) {   // values 8t..8t+7: words (0 1) (2 3) (4 5) (6 7)
    const uint4 u = LOAD_U4(src, t);
    const uint32_t a = u.x, b = MODE == 1 ? u.z : u.y, c = MODE == 1 ? u.y : u.z, d = u.w;
    dst[2 * t] = BYTE_PERM(a, b, 0x5410u); dst[2 * t + 1] = BYTE_PERM(a, b, 0x7632u);
    dst[8 + 2 * t] = BYTE_PERM(c, d, 0x5410u); dst[9 + 2 * t] = BYTE_PERM(c, d, 0x7632u);
  }
}
"""
HEADER = _HEADER + _HALVES_HEADER + _PACK_HEADER + _BF16_HEADER

_SHAPES = (("mxfp4", 4, 2304, 5120), ("mxfp4", 4, 5120, 2304), ("mxfp8", 8, 2304, 5120))

_X_CHECKS = tuple(((mx.bfloat16, mx.uint32, mx.uint8, mx.int32, mx.int32, mx.int32), (mx.bfloat16,),
                   (("T", mx.bfloat16), ("MODE", MODE_IDS[mode]), ("BITS", bits), ("XSTRIDE", X_STRIDE),
                    ("N", n), ("K", k)))
                  for mode, bits, n, k in _SHAPES)

KERNEL = Kernel(
    name="dsv4_prefill_experts_mma", input_names=("x", "w", "s", "tiles", "x_rows", "y_rows"), output_names=("y",),
    body=_BODY.replace("STAGE", _CONVERT), header=HEADER, dialects=("cuda",), checks=_X_CHECKS)

KERNEL_BF16 = Kernel(
    name="dsv4_prefill_experts_mma_bf16", input_names=("x", "w", "s", "tiles", "x_rows", "y_rows"), output_names=("y",),
    body=_BF16_BODY.replace("STAGE\n", _BF16_STAGE), header=HEADER, dialects=("cuda",), checks=_X_CHECKS)

STREAM_HEADER = HEADER + _STREAM_HEADER + _STREAM_CHUNK
# The decoding of MX codes into bf16 pairs with their group's power of two (stream_pair,
# stream_scaled), for launches whose header already has experts.py's (experts_mma.py).
FP4_PAIRS_HEADER = _BF16_HEADER + _STREAM_HEADER

KERNEL_STREAM = Kernel(
    name="dsv4_prefill_experts_mma_stream", input_names=("x", "w", "s", "tiles", "x_rows", "y_rows"), output_names=("y",),
    body=_STREAM_BODY, header=STREAM_HEADER, dialects=("cuda",), checks=_X_CHECKS)


def _mx(m) -> bool:
    return getattr(m, "mode", None) in MX_MODES and m.bits == MX_MODES[m.mode] and m.group_size == 32


def applies(layer, x: mx.array, indices: mx.array, x_rows: mx.array | None = None) -> bool:
    """Whether QuantizedExpertLinear's product of x [P, 1, K] (P = indices.size pairs; with x_rows
    [P], any rows of x) takes the tensor-core launch: CUDA, an MX layout of groups of 32, bf16 x with
    K in chunks of 128, and the flag: auto from a full tile's pairs per expert on average (fewer
    leave the tiles mostly empty: slower than gather_qmm on the H200 at 8 an expert), on from
    MIN_PAIRS."""
    pairs = x.shape[:-2] if x_rows is None else x_rows.shape
    if not (backend() == "cuda" and _mx(layer) and x.dtype == mx.bfloat16
            and x.shape[-1] % CHUNK == 0 and pairs == indices.shape):
        return False
    least = TILE_PAIRS * layer.weight.shape[0] if flags.get("kernel_prefill_experts_mma") == "auto" else MIN_PAIRS
    return flags.switch("kernel_prefill_experts_mma", True) and indices.size >= least


def max_tiles(pairs: int, experts: int, size: int = TILE_PAIRS) -> int:
    """The most tiles of `size` pairs that `pairs` sorted pairs over `experts` experts can make:
    each expert's run of c pairs makes ceil(c / size) <= c / size + 1 tiles."""
    return math.ceil(pairs / size) + min(experts, pairs)


def tiles(experts_sorted: mx.array, experts: int, size: int = TILE_PAIRS) -> mx.array:
    """(expert, first pair, pairs) of each tile: every expert's run of sorted pairs cut into
    pieces of at most `size`, in order, as int32 [max_tiles, 3]; the slots past the last tile
    hold 0 pairs. Computed on the device, so launching needs no host sync."""
    P = experts_sorted.size
    ids = experts_sorted.reshape(-1).astype(mx.int32)
    counts = mx.zeros((experts,), mx.int32).at[ids].add(1)
    firsts = mx.cumsum(counts) - counts                                 # each expert's first pair
    per_expert = (counts + size - 1) // size
    ends = mx.cumsum(per_expert)                                        # past each expert's last tile
    slot = mx.arange(max_tiles(P, experts, size), dtype=mx.int32)
    expert = mx.minimum(mx.sum(ends[None, :] <= slot[:, None], axis=1), experts - 1).astype(mx.int32)
    piece = slot - (ends[expert] - per_expert[expert])                  # the tile's place in its run
    count = mx.clip(counts[expert] - size * piece, 0, size)
    count = mx.where(slot < ends[-1], count, 0)
    return mx.stack([expert, firsts[expert] + size * piece, count], axis=1).astype(mx.int32)


def reference(x, weight, scales, indices, group_size, bits, mode, sorted_indices=False, x_rows=None, out_rows=None):
    """gather_qmm over the pairs, in fp32 on every backend, rounded to x's dtype: pair m takes x's
    row x_rows[m] (m without them) and its product lands in row out_rows[m] (m)."""
    x = x if x_rows is None else x[x_rows]
    y = mx.gather_qmm(x.astype(mx.float32), weight, scales, None, rhs_indices=indices, transpose=True,
                      group_size=group_size, bits=bits, mode=mode, sorted_indices=sorted_indices)
    return placed(y.astype(x.dtype), out_rows)


def placed(y: mx.array, out_rows: mx.array | None) -> mx.array:
    """Rows y[m] put at out_rows[m] (a permutation of the rows), as the launches store them."""
    return y if out_rows is None else y[mx.argsort(out_rows)]


@falls_back(reference, "kernel_prefill_experts_mma")
def prefill_experts(x, weight, scales, indices, group_size, bits, mode, sorted_indices=False, x_rows=None,
                    out_rows=None):
    """x [X, 1, K] (bf16) through the experts indices [P] of the stacked MX matrix (weight
    [E, N, K * bits / 32] uint32, scales [E, N, K / 32]) -> [P, 1, N], as gather_qmm: pair m takes
    x's row x_rows[m] (m without them: X = P) and its product lands in row out_rows[m] (m; a
    permutation). The tiles need the pairs sorted by expert: unless `sorted_indices` says they come
    so (RoutedExperts sorts them), they are sorted here, each pair keeping its rows, so that
    neither x nor the result is gathered. No host sync: the tiles are made on the device, the grid
    sized for the most there can be."""
    P, K = indices.size, x.shape[-1]
    N = scales.shape[1]
    flat, x = indices.reshape(-1), x.reshape(-1, K)
    identity = None
    if not sorted_indices:
        order = mx.argsort(flat)
        flat = flat[order]
        x_rows = order if x_rows is None else x_rows[order]
        out_rows = order if out_rows is None else out_rows[order]
    elif x_rows is None or out_rows is None:
        identity = mx.arange(P, dtype=mx.int32)
    x_rows = (identity if x_rows is None else x_rows).astype(mx.int32)
    out_rows = (identity if out_rows is None else out_rows).astype(mx.int32)
    bf16 = flags.switch("kernel_prefill_experts_bf16", True) and N >= 32   # (a SIMD group's rows)
    size, rows = (BF16_TILE_PAIRS, BF16_TILE_ROWS) if bf16 else (TILE_PAIRS, TILE_ROWS)
    work = tiles(flat, weight.shape[0], size)
    kernel = KERNEL
    if bf16:
        kernel = KERNEL_STREAM if flags.switch("kernel_prefill_experts_stream", True) else KERNEL_BF16
    (y,) = kernel(
        inputs=[x, weight, scales, work, x_rows, out_rows], output_shapes=[(P, N)], output_dtypes=[x.dtype],
        grid=(THREADS, math.ceil(N / rows), work.shape[0]), threadgroup=(THREADS, 1, 1),
        template=[("T", x.dtype), ("MODE", MODE_IDS[mode]), ("BITS", bits), ("XSTRIDE", X_STRIDE), ("N", N),
                  ("K", K)])
    return y.reshape(P, 1, N)
