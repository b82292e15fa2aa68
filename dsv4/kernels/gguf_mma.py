"""GGUF blocks on CUDA tensor cores: the fused experts' gate/up launch (experts_mma.BODY) over
ds4's IQ2_XXS routed experts and Q8_0 shared expert (flag `kernel_gguf_mma`).

The portable GGUF units (gguf_dot.py) spend ~8 instructions a weight at one token on the H200
(ncu: 65% of the issue slots busy at 25% occupancy, DRAM 14% busy; the q2 gate/up took 92 µs
where mxfp4's took 65, reading 40% fewer bytes). Here the codes become exact fp16 A fragments of
`mma.sync.m16n8k16`, and rows_mma (experts_mma.py) does the rest as it does for MX packs:

- IQ2_XXS: a grid entry (8 values of 8, 25 or 43) is one 16-byte threadgroup read of its 4 fp16
  pairs (the table made once per threadgroup from gguf_dot.iq2_xxs_tables, iq2_xxs_stage_grid);
  its 7 sign bits and their parity go to the pairs' sign bits in registers, a pair one xor. The
  sub-block's scale is d (0.5 + s) / 4, as gguf-py computes it.
- Q8_0: bytes j and j + 2 of a word under 0x6400 with their top bit flipped are the fp16
  1152 + q; one half2 subtraction of 1152 leaves q, exactly. The scale is the block's d.

So the products are exact and summed in fp32, then scaled per group: the fp32 summation bound
of the reference's matmul of the decoded weights, as the portable units.
"""

from __future__ import annotations

from dsv4 import flags
from dsv4.kernels import experts_mma
from dsv4.kernels.dialect import backend, shared_memory_limit
from dsv4.kernels.gguf_dot import GGUFMatrix

# The GGUF types with tensor-core codes, and their MmaCodes ids (the types' GGUF_MODE_IDS).
MODE_IDS = {"Q8_0": 10, "IQ2_XXS": 13}
TABLE_ENTRIES = 256   # IQ2_XXS's grid entries in threadgroup memory (uint4 each)

HEADER = r"""
// IQ2_XXS (mode 13): sub-block grp's 8 bytes (4 grid indices, then 4 x 7 sign bits and the 4-bit
// scale) lie 2 + 8 (grp % 8) bytes into its 66-byte block, after the block's fp16 d. tab: the
// grid's entries as 4 fp16 pairs (iq2_xxs_stage_grid); pair j's signs are bits 2j and 2j + 1 of
// the entry's 8, moved to bits 15 and 31.
template <> struct MmaCodes<13> {
  static constexpr int PAIR_GAP = 1;
  static KFN int pair_k(int p) { return 2 * p; }
  uint32_t grid_index, aux;
  float scale;
  template <int K_IN, typename PW, typename PS> KFN void load(PW w, PS s, size_t row, int grp) {
    const size_t b = row * (size_t)(K_IN / 256 * 66) + 66 * (size_t)(grp / 8);
    uint32_t v[2];
    span_words<8, 2>(w, b + 2 + 8 * (grp % 8), v);
    grid_index = v[0];
    aux = v[1];
    scale = iq2_scale(w + b, aux);
  }
  KFN void quad(int e, LOCAL uint32_t* out, const uint4* tab) const {
    const uint4 g = tab[(grid_index >> (8 * e)) & 255u];
    const uint32_t s = iq2_signs8((aux >> (7 * e)) & 127u), gw[4] = {g.x, g.y, g.z, g.w};
    for (int j = 0; j < 4; ++j) out[j] = gw[j] ^ (((s << (15 - 2 * j)) | (s << (30 - 2 * j))) & 0x80008000u);
  }
};

// Q8_0 (mode 10): block grp (34 bytes: fp16 d, 32 int8s). Pair p: bytes j and j + 2 of word p / 2
// (j = p % 2), as fp16 0x6400 | (q ^ 0x80) = 1152 + q, less 1152 (0x6480): exact.
template <> struct MmaCodes<10> {
  static constexpr int PAIR_GAP = 2;
  static KFN int pair_k(int p) { return 4 * (p >> 1) + (p & 1); }
  uint32_t q[8];
  float scale;
  template <int K_IN, typename PW, typename PS> KFN void load(PW w, PS s, size_t row, int grp) {
    uint32_t v[9];
    span_words<34, 2>(w, row * (size_t)(K_IN / 32 * 34) + 34 * (size_t)grp, v);
    scale = f16_bits(v[0] & 0xffffu);
    for (int k = 0; k < 8; ++k) q[k] = (v[k] >> 16) | (v[k + 1] << 16);
  }
  KFN void quad(int e, LOCAL uint32_t* out, const uint4* tab) const {
    for (int i = 0; i < 4; ++i) {
      const int p = 4 * e + i;
      const uint32_t u = (q[p >> 1] >> (8 * (p & 1))) & 0x00ff00ffu;
      out[i] = H2_SUB_BITS((u ^ 0x00800080u) | 0x64006400u, 0x64806480u);
    }
  }
};

// MmaCodes<13>'s table from gguf_dot.iq2_xxs_tables (its first 512 words: the grid's bytes),
// made by the threadgroup's threads.
template <typename PT> KFN void iq2_xxs_stage_grid(PT src, uint4* tab, uint32_t tid, uint32_t threads) {
  for (uint32_t i = tid; i < 256u; i += threads) {
    uint32_t o[4];
    for (int j = 0; j < 4; ++j) {   // values 2j, 2j + 1
      const uint32_t wv = src[2 * i + j / 2] >> (16 * (j & 1));
      o[j] = F2H_BITS((float)(wv & 255u)) | (F2H_BITS((float)((wv >> 8) & 255u)) << 16);
    }
    uint4 v;
    v.x = o[0]; v.y = o[1]; v.z = o[2]; v.w = o[3];
    tab[i] = v;
  }
}
"""

# experts_mma.BODY's table slot for these codes.
STAGE_TABLES = r"""
  SHARED uint4 mma_tab[256];
  if (MODE == 13) iq2_xxs_stage_grid(gate_s, mma_tab, tid, group_threads);
  else if (SMODE == 13) iq2_xxs_stage_grid(sgate_s, mma_tab, tid, group_threads);
"""


def _codes(m) -> bool:
    return isinstance(m, GGUFMatrix) and m.qtype in MODE_IDS


def supports(x, gate, shared, dialect) -> bool:
    """Whether the tensor-core launch takes this GGUF gate/up: the flag, CUDA, routed and shared
    experts in MODE_IDS' types, the input in chunks of 128 with its fp16 parts and the tables in
    threadgroup memory."""
    D = x.shape[-1]
    return (flags.get("kernel_gguf_mma") and dialect == "cuda" and _codes(gate)
            and (shared is None or _codes(shared)) and D % 128 == 0 and gate.out_features % 32 == 0
            and experts_mma.gate_up_shared_bytes(D) + 16 * TABLE_ENTRIES <= shared_memory_limit(dialect))


def applies(x, gate, shared) -> bool:
    return supports(x, gate, shared, backend())


def layouts(gate: GGUFMatrix, shared: GGUFMatrix | None) -> list:
    """The MODE / SMODE template values (and their unused BITS and GS) of the launch."""
    out = []
    for prefix, m in (("", gate), ("S", shared or gate)):
        out += [(prefix + "MODE", MODE_IDS[m.qtype]), (prefix + "BITS", 0), (prefix + "GS", 0)]
    return out
