"""The fused experts' gate/up and down launches on CUDA tensor cores (flag `kernel_moe_mma`); off
by default: within their bounds on the H200 but slower there; the portable kernels of experts.py
are the rollback, and Metal's.

The portable kernel spends ~4.2 instructions per fp4 weight (decode to fp16, widen to fp32, one
FMA per weight and token). Here the decoded fp16 pairs go straight into `mma.sync.m16n8k16`
(fp16 inputs, fp32 sums): unpack8's mask-and-shift makes two fp16 weights per step, and the
tensor core does the multiply-adds, ~2 instructions per weight.

Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"; lane = 4 q + t):
A (16 rows x 16 k) registers {(q, 2t..2t+1), (q+8, 2t..), (q, 2t+8..), (q+8, 2t+8..)}; B (16 k x
8 columns) {(2t..2t+1, q), (2t+8.., q)}; D {(q, 2t), (q, 2t+1), (q+8, 2t), (q+8, 2t+1)}.

How a SIMD group uses them for 16 rows of W (A) against one token's x (B): the input is walked in
chunks of 4 groups of 32 (one e8m0 scale each). Lane t reads group t of the chunk for its rows q
and q+8 (16 bytes of fp4, 32 of fp8) and feeds its 16 weight pairs in 8 mma steps, two per
register; the sum over k does not care which weight a k stands for, so B holds x at the same
places. The four lanes of a lane group hold four different groups, each with its own scale, so B
is block-diagonal: column n < 4 holds group n's x (its fp16 high part), column n + 4 its low part
(hi + lo carries 22 bits of x divided by a power of two that keeps hi within fp16's range), zero
elsewhere. D's column n is then group n's partial sum of each row, which its lane scales by the
row's group scale (the one lane n of the lane group loaded, shuffled over) and x's power of two
before summing; the lane group's four lanes sum last. x's parts sit in two fp16 planes.
The codes are a trait (MmaCodes<MODE>).

The down launch does the same for each slot's h (one fp16 part: h is bf16, so it fits whole
but for values below 2^-32 of their group's largest), a SIMD group per slot over 16 rows,
then the portable launch's slot sum and mHC expand epilogue (experts._DOWN_SUM).
"""

from __future__ import annotations

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels.dialect import backend, shared_memory_limit

KSPLIT = 4          # SIMD groups that share a row set's input chunks (two row sets of 16 per threadgroup)
THREADS = 32 * 2 * KSPLIT
MX_MODES = {"mxfp4": 4, "mxfp8": 8}

HEADER = r"""
// Pair p (< 16) of a 32-value group of MX codes: two weights whose fp16 bits one mask-and-shift
// of a word gives (unpack8's tricks: MODE 1 nibbles j and j+4 of word p/4, MODE 2 bytes j and
// j+2 of word p/2), scaled by 2^-14 (2^-8). pair_k: the low weight's place in the group; the
// high one is PAIR_GAP further.
// word_pair_bits: the same from the word holding pair p (MODE 1's word p/4, MODE 2's p/2).
template <int MODE> KFN uint32_t word_pair_bits(uint32_t word, int p) {
  if (MODE == 1) {
    const uint32_t q = word >> (4 * (p & 3));
    return ((q & 0x00070007u) << 9) | ((q & 0x00080008u) << 12);
  }
  const uint32_t q = word >> (8 * (p & 1));
  return ((q & 0x007f007fu) << 7) | ((q & 0x00800080u) << 8);
}
template <int MODE> KFN uint32_t pair_bits(LOCAL const uint32_t* w, int p) {
  return word_pair_bits<MODE>(w[MODE == 1 ? p >> 2 : p >> 1], p);
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

// A lane's group of 32 codes of one row, as rows_mma reads them: load(w, s, row, grp) takes group
// grp of the row from a matrix's operands, `scale` is then the group's scale (times what the
// pairs take out), and quad(e, out, tab) gives pairs 4e..4e+3 as fp16 bit pairs whose weights
// are the group's places pair_k(p) and pair_k(p) + PAIR_GAP (tab: the launch's threadgroup
// tables, for codes that decode through one).
template <int MODE> struct MmaCodes {   // MODE 1 mxfp4, 2 mxfp8
  static constexpr int BITS = MODE == 1 ? 4 : 8;    // words per group of a row
  static constexpr int PAIR_GAP = MODE == 1 ? 4 : 2;
  static KFN int pair_k(int p) { return ::pair_k<MODE>(p); }
  uint32_t w[BITS];
  float scale;
  template <int K_IN, typename PW, typename PS> KFN void load(PW w0, PS s0, size_t row, int grp) {
    load_words<BITS>(w0 + (row * (K_IN / 32) + grp) * BITS, w);
    scale = e8m0_scale((uint32_t)s0[row * (K_IN / 32) + grp]) * (MODE == 1 ? 16384.0f : 256.0f);
  }
  KFN void quad(int e, LOCAL uint32_t* out, const uint4* tab) const {
    for (int i = 0; i < 4; ++i) out[i] = pair_bits<MODE>(w, 4 * e + i);
  }
};

KFN float simd_shuffle_f(float v, int src) { return AS_FLOAT((uint32_t)simd_shuffle_i((int)AS_UINT(v), src)); }

// Sums of an input (fp16 planes xh, xscale as store_x_halves<LO> left them, the low plane K_IN
// values after the high one) with the 16 rows row0.. (clamped to rows_out) of the matrix at
// w0/s0 (and w1/s1 if TWO), codes MmaCodes<MODE>, from row `first`, over the chunks split,
// split + splits, ... of 128 inputs. On return each lane of lane group q holds rows row0 + q
// (acc[0]) and row0 + q + 8 (acc[1]).
template <int MODE, int K_IN, bool TWO, bool LO, typename PX, typename PF, typename PW, typename PS>
KFN void rows_mma(PX xh, PF xscale, PW w0, PS s0, PW w1, PS s1, size_t first, int row0, int rows_out,
                  int split, int splits, LOCAL float* acc0, LOCAL float* acc1, uint32_t lane, const uint4* tab) {
  typedef MmaCodes<MODE> C;
  constexpr int GROUPS = K_IN / 32;
  const int q = (int)lane >> 2, t = (int)lane & 3;
  const size_t ra = first + (size_t)min(row0 + q, rows_out - 1);
  const size_t rb = first + (size_t)min(row0 + q + 8, rows_out - 1);
  const bool holds_x = (q & 3) == t && (LO || q < 4);   // B's nonzero lanes: column q is group t's
  const PX xp = xh + (q < 4 ? 0 : K_IN);                  // high plane in columns 0-3, low plane in 4-7
  acc0[0] = 0.0f; acc0[1] = 0.0f; acc1[0] = 0.0f; acc1[1] = 0.0f;
  for (int c = split; c < GROUPS / 4; c += splits) {
    const int grp = 4 * c + t;
    C ca0, cb0, ca1, cb1;
    ca0.template load<K_IN>(w0, s0, ra, grp);
    cb0.template load<K_IN>(w0, s0, rb, grp);
    if (TWO) {
      ca1.template load<K_IN>(w1, s1, ra, grp);
      cb1.template load<K_IN>(w1, s1, rb, grp);
    }
    float d0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      uint32_t qa0[4], qb0[4], qa1[4], qb1[4];
      ca0.quad(e, qa0, tab); cb0.quad(e, qb0, tab);
      if (TWO) { ca1.quad(e, qa1, tab); cb1.quad(e, qb1, tab); }
#pragma unroll
      for (int hs = 0; hs < 2; ++hs) {   // mma step 2e + hs: pairs 4e + 2hs, 4e + 2hs + 1
        uint32_t b[2] = {0u, 0u};
        if (holds_x)
          for (int i = 0; i < 2; ++i) {
            const int k = 32 * grp + C::pair_k(4 * e + 2 * hs + i);   // even where PAIR_GAP is 1
            b[i] = C::PAIR_GAP == 1 ? ((const uint32_t*)xp)[k >> 1]
                                    : (uint32_t)xp[k] | ((uint32_t)xp[k + C::PAIR_GAP] << 16);
          }
        const uint32_t a0[4] = {qa0[2 * hs], qb0[2 * hs], qa0[2 * hs + 1], qb0[2 * hs + 1]};
        mma_16816(d0, a0, b);
        if (TWO) {
          const uint32_t a1[4] = {qa1[2 * hs], qb1[2 * hs], qa1[2 * hs + 1], qb1[2 * hs + 1]};
          mma_16816(d1, a1, b);
        }
      }
    }
    // This lane's D columns 2t and 2t+1 are groups (2t) % 4 and (2t+1) % 4 of the chunk, whose
    // scales lane (q, that group) loaded.
    for (int j = 0; j < 2; ++j) {
      const int gj = (2 * t + j) & 3, src = 4 * q + gj;
      const float sx = xscale[4 * c + gj];
      acc0[0] += d0[j] * (simd_shuffle_f(ca0.scale, src) * sx);
      acc0[1] += d0[2 + j] * (simd_shuffle_f(cb0.scale, src) * sx);
      if (TWO) {
        acc1[0] += d1[j] * (simd_shuffle_f(ca1.scale, src) * sx);
        acc1[1] += d1[2 + j] * (simd_shuffle_f(cb1.scale, src) * sx);
      }
    }
  }
  for (int o = 1; o <= 2; o <<= 1) {   // the lane group's four lanes summed groups of their own
    acc0[0] += simd_xor_f(acc0[0], o); acc0[1] += simd_xor_f(acc0[1], o);
    if (TWO) { acc1[0] += simd_xor_f(acc1[0], o); acc1[1] += simd_xor_f(acc1[1], o); }
  }
}

// h of lane `lane`'s row, rounded to fp8 with its 32-row block's scale when ACTQ (SIMD group 0).
template <bool ACTQ> KFN float h_block_round(float v) {
  if (!ACTQ) return v;
  const float s = pow2_ceil(FMAX(simd_max_f(FABS(v)), 1e-4f) * (1.0f / 448.0f));
  return e4m3_round(FMIN(FMAX(v * (1.0f / s), -448.0f), 448.0f)) * s;
}
"""

BODY = r"""
  // grid (32 * 2 * KSPLIT, I / 32, tokens * (K + HS)): a threadgroup makes 32 consecutive rows of
  // h (one fp8 block) for one (token, slot) pair; SIMD group w makes rows 16 (w & 1).. of them
  // over the input chunks w >> 1, w >> 1 + KSPLIT, ...; their partial sums meet in part.
  const int pair = group_z;
  const int t = pair / (K + HS), slot = pair % (K + HS);
  const float limit = params[0];
  ROUTE_TOKEN
  SHARED uint32_t xh_words[D];   // x's high and low fp16 planes, 4-byte aligned
  uint16_t* xhl = (uint16_t*)xh_words;
  SHARED float xscale[D / 32];
  for (int p = (int)tid; p < D / 32; p += (int)group_threads) {
    float v[32];
    for (int c = 0; c < 4; ++c) load_bf16_8(x + (size_t)t * D, p, c, v + 8 * c);
    if (ACTQ) qdq_fp8_32(v);
    store_x_halves<true>(xhl, xscale, p, v, D);
  }
  MMA_TABLES
  BARRIER();
  SELECT_EXPERT
  const int set = (int)warp & 1, split = (int)warp >> 1;
  const int row0 = (int)group_y * 32 + 16 * set;
  float g[2], u[2];
  if (slot < K) {
    rows_mma<MODE, D, true, true>(xhl, xscale, gate_w, gate_s, up_w, up_s, (size_t)expert * I, row0, I, split,
                                  KSPLIT, g, u, lane, mma_tab);
  } else {
    rows_mma<SMODE, D, true, true>(xhl, xscale, sgate_w, sgate_s, sup_w, sup_s, 0, row0, I, split, KSPLIT, g, u,
                                   lane, mma_tab);
  }
  SHARED float part[2][KSPLIT][32];
  if ((lane & 3u) == 0u) {
    const int r = 16 * set + (int)(lane >> 2);
    part[0][split][r] = g[0]; part[0][split][r + 8] = g[1];
    part[1][split][r] = u[0]; part[1][split][r + 8] = u[1];
  }
  BARRIER();
  if (warp == 0) {
    float gs = 0.0f, us = 0.0f;
    for (int s = 0; s < KSPLIT; ++s) { gs += part[0][s][lane]; us += part[1][s][lane]; }
    const float gv = FMIN(float(static_cast<T>(gs)), limit);
    const float uv = FMIN(FMAX(float(static_cast<T>(us)), -limit), limit);
    const float v = float(static_cast<T>(gv / (1.0f + EXP(-gv)) * uv * route));
    h[(size_t)pair * I + (int)group_y * 32 + (int)lane] = static_cast<T>(h_block_round<ACTQ>(v));
  }
"""

DOWN_DOTS = r"""
  // grid (32 * (K + HS), ceil(DO / 16), tokens): SIMD group s makes slot s's sums for the
  // threadgroup's 16 rows (every expert's weights stream at once), from the slots' h in
  // threadgroup memory as fp16 (h is bf16, fp8-rounded with act_quant: one part suffices).
  constexpr int RW = 16;
  const int SPLITS = HS;   // _DOWN_SUM's: one SIMD group a slot here
  const int t = group_z;
  const int row0 = (int)group_y * RW;
  const int slot = (int)warp;
  SHARED uint16_t hh[(K + HS) * I];
  SHARED float hscale[(K + HS) * (I / 32)];
  for (int p = (int)tid; p < (K + HS) * (I / 32); p += (int)group_threads) {
    float v[32];
    for (int c = 0; c < 4; ++c) load_bf16_8(h + (size_t)t * (K + HS) * I, p, c, v + 8 * c);
    store_x_halves<false>(hh, hscale, p, v);
  }
  BARRIER();
  float acc[2], unused[2];
  if (slot < K) {
    rows_mma<MODE, I, false, false>(hh + slot * I, hscale + slot * (I / 32), down_w, down_s, down_w, down_s,
                                    (size_t)idx[t * K + slot] * DO, row0, DO, 0, 1, acc, unused, lane, 0);
  } else {
    rows_mma<SMODE, I, false, false>(hh + slot * I, hscale + slot * (I / 32), sdown_w, sdown_s, sdown_w, sdown_s,
                                     0, row0, DO, 0, 1, acc, unused, lane, 0);
  }
  // Each expert's output is rounded to the activation dtype, as its own matmul would be.
  SHARED float part[(K + HS) * RW];
  if ((lane & 3u) == 0u) {
    part[slot * RW + (int)(lane >> 2)] = float(static_cast<T>(acc[0]));
    part[slot * RW + (int)(lane >> 2) + 8] = float(static_cast<T>(acc[1]));
  }
"""
DOWN_ROWS = 16

def _mx(m) -> bool:
    return getattr(m, "mode", None) in MX_MODES and m.bits == MX_MODES[m.mode] and m.group_size == 32


def down_applies(h, down, s_down) -> bool:
    """Whether the tensor-core down launch takes h [T, slots, I]: the flag, CUDA, MX layouts,
    I in chunks of 128 and every slot's fp16 h in threadgroup memory."""
    slots, I = h.shape[1], h.shape[2]
    dialect = backend()
    return (flags.get("kernel_moe_mma") and dialect == "cuda" and all(_mx(m) for m in (down, s_down) if m is not None)
            and I % 128 == 0 and slots * (2 * I + I // 8 + 4 * DOWN_ROWS) <= shared_memory_limit(dialect))


def gate_up_shared_bytes(D: int) -> int:
    """BODY's threadgroup memory for an input of D values: x's two fp16 planes, the packs' powers
    of two and the SIMD groups' partial sums (a table of the codes' comes on top)."""
    return 4 * D + D // 8 + 2 * KSPLIT * 32 * 4


def supports(x, gate, shared, dialect) -> bool:
    """Whether the tensor-core launch takes this gate/up: CUDA, routed and shared experts in MX
    modes (mxfp4 / mxfp8, groups of 32), the input in chunks of 128 with its fp16 parts in
    threadgroup memory, and the flag on."""
    mats = [gate] + ([shared] if shared is not None else [])
    D = x.shape[-1]
    return (flags.get("kernel_moe_mma") and dialect == "cuda"
            and all(_mx(m) for m in mats)
            and D % 128 == 0 and gate.out_features % 32 == 0
            and gate_up_shared_bytes(D) <= shared_memory_limit(dialect))


def applies(x, gate, shared) -> bool:
    return supports(x, gate, shared, backend())


def template(common: list, act_quant: bool, I: int, D: int) -> list:
    """The launch's template values after those both experts launches share (`common`)."""
    return common + [("KSPLIT", KSPLIT), ("ACTQ", bool(act_quant)), ("I", I), ("D", D)]


def check_template() -> list:
    """V4.1's layouts (mxfp4 routed, mxfp8 shared) for the compile gate."""
    return [("T", mx.bfloat16), ("MODE", 1), ("BITS", 4), ("GS", 32), ("SMODE", 2), ("SBITS", 8), ("SGS", 32),
            ("HS", 1), ("K", 6)]
