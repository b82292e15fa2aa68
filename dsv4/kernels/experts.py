"""Routed experts + shared expert for a few tokens (decode, draft verification), model-spec §4.

For each token t, its selected experts e (router weights w_te) and the shared expert:

    g = round(W1_e x), u = round(W3_e x)                   (matmul outputs in x's dtype, bf16)
    h = round(silu(min(g, L)) * clip(u, -L, L) * w_te)     (fp32; w = 1 for the shared expert)
    y = round(sum_e round(W2_e h) + round(W2_s h_s))       (fp32 sum of bf16 expert outputs)

with L = swiglu_limit. Optional `act_quant` rounds x and h to fp8 per 32 values first, as
the official model does for every fp8/fp4 matmul input (model-spec §11).

Weights are MLX-quantized matrices (`QuantizedMatrix`): mxfp4 and mxfp8 (e8m0 scale per 32,
no bias) and affine with 2, 3, 4 or 8 bits (scale and bias per group of 32/64/128), packed
exactly as `mx.quantize` packs them: little-endian bit stream in uint32 words, value i of a
row at bit i*bits (3-bit values may straddle words), fp4 e2m1 nibbles low first, fp8 e4m3 bytes.

The kernel is two launches: gate+up matvecs with the clamped SwiGLU and the router weight
fused (a threadgroup per 32 rows of one token-expert pair holds the token's x in threadgroup
memory; each SIMD group makes ROWS_GATE_UP rows, its lanes split the input), then the
down matvecs with the bf16 rounding per expert and the sum fused (a threadgroup per
ROWS_DOWN * 32 / LANES_DOWN rows of one token, one SIMD group per expert slot, so that every
selected expert's rows stream at once; the slots are summed in order afterwards). Each lane works on packs of
32 consecutive values (`bits` words, one scale group for mx modes), decoded in registers;
fp4/fp8 codes become fp16 bit patterns, whose fixed exponent offset is folded into the block
scale.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import gguf_dot
from dsv4.kernels.dialect import Kernel, backend, constant, falls_back, shared_memory_limit
from dsv4.kernels.gguf_dot import GGUFMatrix
from dsv4.kernels.mhc import Projection, hc_expand, partials_shape
from dsv4.kernels.router import HEADER as ROUTER_HEADER
from dsv4.kernels.router import kernel_applies as route_kernel_applies
from dsv4.kernels.router import route
from dsv4.kernels.swiglu import HIDDEN_HEADER
from dsv4.quant import qdq_fp8

MAX_KERNEL_TOKENS = 8
# Launch shapes (rows_dot's ROWS and LANES; H200 ncu times in benchmarks/results/2026-11-30-*-experts-shapes.md):
# the gate/up kernel's SIMD groups make ROWS_GATE_UP rows each, all 32 lanes on a row (5120
# inputs: 5 packs a lane); the down kernel's make ROWS_DOWN * 32 / LANES_DOWN rows, LANES_DOWN
# lanes a row (2304 inputs: 72 packs, 9 a lane, where 32 lanes a row leave 24 of them idle on
# the third pack): 22.9 against 26.0 µs at one token.
ROWS_GATE_UP = 4
LANES_GATE_UP = 32
X_STRIDE = 9        # uint4s per pack in the gate/up kernel's shared copy of x (see XChunk)
X_INTS = 11         # the same as integer limbs, for gguf_dot.py's integer units (see XStore<X_INTS>)
ROWS_DOWN = 2
LANES_DOWN = 8
MODE_IDS = {"affine": 0, "mxfp4": 1, "mxfp8": 2}
MXFP4_INT = 3       # mxfp4 in the integer unit over x's X_INTS limbs (DSV4_KERNEL_MOE_DP4A)
AFFINE_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class QuantizedMatrix:
    """One MLX-quantized weight: routed experts [E, out, in] or a single matrix [out, in].

    weight uint32 [..., out, in*bits/32]; scales [..., out, in/group_size] (uint8 e8m0 for
    mxfp4/mxfp8, float for affine); biases like scales for affine, else None.
    """

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    group_size: int
    bits: int
    mode: str = "affine"

    @classmethod
    def of(cls, layer) -> "QuantizedMatrix":
        """From any layer with MLX's quantized attributes (nn.QuantizedLinear, QuantizedSwitchLinear)."""
        return cls(layer.weight, layer.scales, getattr(layer, "biases", None), layer.group_size,
                   layer.bits, getattr(layer, "mode", "affine"))

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1] * 32 // self.bits

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]

    def kwargs(self) -> dict:
        return dict(group_size=self.group_size, bits=self.bits, mode=self.mode)

    @property
    def layout(self) -> tuple:
        """What the kernels' decoding depends on: matrices of one layout share an instantiation."""
        return (self.mode, self.bits, self.group_size, self.scales.dtype)

    @property
    def block_values(self) -> int:
        return self.group_size

    @property
    def integer(self) -> bool:
        """mxfp4 with the integer unit switched on (DSV4_KERNEL_MOE_DP4A); the gate/up launch
        takes it where x is fp8-rounded."""
        return self.mode == "mxfp4" and self.bits == 4 and self.group_size == 32 and bool(
            flags.get("kernel_moe_dp4a"))

    def template(self, prefix: str = "", integer: bool = False) -> list:
        """MODE (with `integer`, the integer unit's MXFP4_INT), BITS, GS."""
        mode = MXFP4_INT if integer else MODE_IDS[self.mode]
        return [(prefix + "MODE", mode), (prefix + "BITS", self.bits), (prefix + "GS", self.group_size)]

    def operands(self) -> list:
        """weight, scales, biases as kernel inputs (a placeholder for absent biases)."""
        return [self.weight, self.scales, self.biases if self.biases is not None else _placeholder()]


def _swiglu(g, u, limit):
    g = mx.minimum(g.astype(mx.float32), limit)
    u = mx.clip(u.astype(mx.float32), -limit, limit)
    return g * mx.sigmoid(g) * u


def experts_reference(x, indices, weights, gate, up, down, shared=None, swiglu_limit=10.0,
                      act_quant=False):
    """Plain-MLX definition (the gather_qmm path); see `experts`. The two stages of the
    kernel, `hidden_reference` then `down_reference`."""
    h = hidden_reference(x, indices, weights, gate, up, shared, swiglu_limit, act_quant)
    return down_reference(h, indices, down, shared[2] if shared is not None else None)


def _matmul(a, m, idx=None):
    """a @ m.T in fp32 (MLX's CPU kernels accumulate in the input dtype, so the input is fp32
    on every backend), for the rows idx of stacked experts when given; GGUF blocks decoded
    exactly first."""
    a = a.astype(mx.float32)
    if isinstance(m, GGUFMatrix):
        w = m.dequantized().swapaxes(-1, -2)
        return a @ w if idx is None else mx.gather_mm(a, w, rhs_indices=idx)
    if idx is None:
        return mx.quantized_matmul(a, m.weight, m.scales, m.biases, transpose=True, **m.kwargs())
    return mx.gather_qmm(a, m.weight, m.scales, m.biases, rhs_indices=idx, transpose=True, **m.kwargs())


def gate_up_reference(x, indices, gate, up, shared=None, act_quant=False):
    """The gate/up stage's matmuls: g and u [T, k (+1 for the shared expert, last), I] in fp32,
    before any rounding of their own (x fp8-rounded per 32 values first with act_quant)."""
    xin = qdq_fp8(x) if act_quant else x
    xe = xin[:, None, None, :]
    g, u = (_matmul(xe, m, indices)[:, :, 0] for m in (gate, up))   # [T, k, I]
    if shared is None:
        return g, u
    s_g, s_u = (_matmul(xin, m)[:, None] for m in shared[:2])
    return mx.concatenate([g, s_g], axis=1), mx.concatenate([u, s_u], axis=1)


def hidden_reference(x, indices, weights, gate, up, shared=None, swiglu_limit=10.0, act_quant=False):
    """The gate/up stage: h [T, k (+1 for the shared expert, last), I] in x's dtype, the
    clamped SwiGLU of the gate and up matmuls (each output rounded to x's dtype, as a bf16
    linear layer's would be) times the router weight (1 for the shared expert), fp8-rounded
    per 32 values with act_quant (as is x before the matmuls)."""
    dtype = x.dtype
    g, u = gate_up_reference(x, indices, gate, up, shared, act_quant)
    route = weights.astype(mx.float32)
    if shared is not None:
        route = mx.concatenate([route, mx.ones((route.shape[0], 1), mx.float32)], axis=1)
    h = (_swiglu(g.astype(dtype), u.astype(dtype), swiglu_limit) * route[..., None]).astype(dtype)
    return qdq_fp8(h) if act_quant else h


def down_reference(h, indices, down, s_down=None):
    """The down stage: sum over h's slots of their down matmuls (each expert's output rounded
    to h's dtype), in fp32, rounded to h's dtype; h [T, k (+1), I] as `hidden_reference` gives it."""
    k = indices.shape[-1]
    y = _matmul(h[:, :k, None, :], down, indices).astype(h.dtype)   # [T, k, 1, D]
    total = mx.sum(y.astype(mx.float32), axis=(1, 2))
    if s_down is not None:
        total = total + _matmul(h[:, k], s_down).astype(h.dtype).astype(mx.float32)
    return total.astype(h.dtype)


# What every decode kernel of a few tokens shares: the official fp8 rounding, bf16 loads, the
# threadgroup copy of x (XChunk) and lane-group sums. The matrix decoders come on top: MLX's
# packs here (PACKS_HEADER), GGUF blocks in gguf_dot.py; each defines rows_dot.
X_HEADER = f"constexpr int X_INTS = {X_INTS};\nconstexpr int X_STRIDE = {X_STRIDE};\n" + HIDDEN_HEADER + r"""
KFN float e4m3_round(float x) {
  const float a = FABS(x);
  float r;
  if (a < 0.015625f) {
    r = RINT(a * 512.0f) * (1.0f / 512.0f);          // subnormal e4m3: steps of 2^-9
  } else {
    uint32_t u = AS_UINT(a);
    u += 0x7ffffu + ((u >> 20) & 1u);                // round the mantissa to 3 bits, ties to even
    r = AS_FLOAT(u & 0xfff00000u);
  }
  return x < 0.0f ? -r : r;
}

// 2^ceil(log2(v)) for a positive normal v, from the exponent bits (the official bit trick).
KFN float pow2_ceil(float v) {
  const uint32_t b = AS_UINT(v);
  return AS_FLOAT((((b >> 23) & 0xffu) + ((b & 0x7fffffu) != 0u ? 1u : 0u)) << 23);
}

// fp8 e4m3 with a power-of-two scale per 32 values (the official act_quant); returns the scale.
KFN float qdq_fp8_32(LOCAL float* v) {
  float amax = 1e-4f;
  for (int i = 0; i < 32; ++i) amax = FMAX(amax, FABS(v[i]));
  const float s = pow2_ceil(amax * (1.0f / 448.0f));
  const float inv = 1.0f / s;   // exact: s is a power of two
  for (int i = 0; i < 32; ++i) v[i] = e4m3_round(FMIN(FMAX(v[i] * inv, -448.0f), 448.0f)) * s;
  return s;
}

// The 8 bf16 values of a 16-byte word as floats.
KFN void unpack_bf16_8(uint4 q, LOCAL float* v) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  for (int j = 0; j < 4; ++j) {
    v[2 * j] = AS_FLOAT(w[j] << 16);
    v[2 * j + 1] = AS_FLOAT(w[j] & 0xffff0000u);
  }
}

// 8 bf16 values: chunk c (< 4) of pack p of row, i.e. elements 32p+8c.. (16-byte aligned).
template <typename P>
KFN void load_bf16_8(P row, int p, int c, LOCAL float* v) {
  unpack_bf16_8(LOAD_U4(row + 32 * p, c), v);
}

// Chunk c of pack p of the input row: XS == 0 reads a row of bf16 in device memory; XS > 0
// reads the threadgroup's fp32 copy, 4 floats (as bits) per uint4 and XS uint4s per pack
// (XS = 9 puts the 16-byte reads of 8 consecutive lanes on distinct banks).
template <int XS> struct XChunk {
  template <typename P> static KFN void load(P x4, int p, int c, LOCAL float* v) {
    const uint4 a = x4[p * XS + 2 * c], b = x4[p * XS + 2 * c + 1];
    v[0] = AS_FLOAT(a.x); v[1] = AS_FLOAT(a.y); v[2] = AS_FLOAT(a.z); v[3] = AS_FLOAT(a.w);
    v[4] = AS_FLOAT(b.x); v[5] = AS_FLOAT(b.y); v[6] = AS_FLOAT(b.z); v[7] = AS_FLOAT(b.w);
  }
};
template <> struct XChunk<0> {
  template <typename P> static KFN void load(P x, int p, int c, LOCAL float* v) { load_bf16_8(x, p, c, v); }
};

// Pack p (the 32 values v; s their fp8 scale when rounded) into the threadgroup copy of x that
// XChunk<XS> reads: as floats, XS uint4s a pack.
template <int XS> struct XStore {
  template <typename P> static KFN void pack(P xs, int p, LOCAL const float* v, float s) {
    for (int k = 0; k < 8; ++k) {
      uint4 q;
      q.x = AS_UINT(v[4 * k]); q.y = AS_UINT(v[4 * k + 1]);
      q.z = AS_UINT(v[4 * k + 2]); q.w = AS_UINT(v[4 * k + 3]);
      xs[p * XS + k] = q;
    }
  }
};
// X_INTS: fp8-rounded values (v = e4m3 * s) as the integers q = v 2^9 / s (|q| < 2^18: e4m3's
// values are multiples of 2^-9 up to 448), each split into three signed bytes q = l0 + 2^7 l1 +
// 2^14 l2 (l0, l1 in 0..127), four values a word: chunk c (values 8c..8c+7) in uint4s 2c (l0 of
// values 0-3 and 4-7, then l1's) and 2c + 1 (l2's, then the chunk's sum of q, for Q2_K's mins), s /
// 2^9 in uint4 8's x and the pack's sum of q (|sum| < 2^23, for the K-quants' mins) in its y; 11
// uint4s a pack (odd: a quarter-warp's 16-byte reads of 8 packs hit distinct banks). limb_words
// makes a pack's first 9 uint4s as 36 words (the threadgroup copy here; the GGUF gate/up launch's
// h for the down launch's integer units, experts.py's STORE_LIMBS).
KFN void limb_words(LOCAL const float* v, float s, LOCAL uint32_t* w) {
  const float up = 512.0f / s;   // exact: s is a power of two
  int sum = 0;
  for (int c = 0; c < 4; ++c) {
    int chunk_sum = 0;
    for (int h = 0; h < 2; ++h) {
      uint32_t b0 = 0u, b1 = 0u, b2 = 0u;
      for (int k = 0; k < 4; ++k) {
        const int q = (int)RINT(v[8 * c + 4 * h + k] * up);
        chunk_sum += q;
        b0 |= (uint32_t)(q & 127) << (8 * k);
        b1 |= (uint32_t)((q >> 7) & 127) << (8 * k);
        b2 |= ((uint32_t)(q >> 14) & 255u) << (8 * k);
      }
      w[8 * c + h] = b0; w[8 * c + 2 + h] = b1; w[8 * c + 4 + h] = b2;
    }
    w[8 * c + 6] = (uint32_t)chunk_sum;
    w[8 * c + 7] = 0u;
    sum += chunk_sum;
  }
  w[32] = AS_UINT(s * (1.0f / 512.0f)); w[33] = (uint32_t)sum; w[34] = 0u; w[35] = 0u;
}
template <> struct XStore<X_INTS> {
  template <typename P> static KFN void pack(P xs, int p, LOCAL const float* v, float s) {
    uint32_t w[36];
    limb_words(v, s, w);
    for (int k = 0; k < 9; ++k) {
      uint4 q;
      q.x = w[4 * k]; q.y = w[4 * k + 1]; q.z = w[4 * k + 2]; q.w = w[4 * k + 3];
      xs[p * X_INTS + k] = q;
    }
  }
};
template <int XS, typename P>
KFN void store_x_pack(P xs, int p, LOCAL const float* v, float s = 1.0f) { XStore<XS>::pack(xs, p, v, s); }

// Chunk c of pack p of an X_INTS copy: its six limb words (l0, l1, l2 of values 0-3 and 4-7),
// the pack's scale s / 2^9 and the sum of q over group j of its chunks in groups of GC (the pack's
// at GC = 4; exact as a float); join: a dot product with the limbs' three (l0, l1, l2) as one.
struct XInts {
  static KFN int join(LOCAL const int* l) { return l[0] + (l[1] << 7) + (l[2] << 14); }
  template <typename P> static KFN void load(P x4, int p, int c, LOCAL int* q) {
    const uint4 a = x4[p * X_INTS + 2 * c], b = x4[p * X_INTS + 2 * c + 1];
    q[0] = (int)a.x; q[1] = (int)a.y; q[2] = (int)a.z; q[3] = (int)a.w; q[4] = (int)b.x; q[5] = (int)b.y;
  }
  template <typename P> static KFN float scale(P x4, int p) { return AS_FLOAT(x4[p * X_INTS + 8].x); }
  template <int GC, typename P> static KFN float sum(P x4, int p, int j) {
    if (GC == 4) return (float)(int)x4[p * X_INTS + 8].y;
    int total = 0;
    for (int c = j * GC; c < (j + 1) * GC; ++c) total += (int)x4[p * X_INTS + 2 * c + 1].z;
    return (float)total;
  }
};

// A chunk's 8 weights as signed bytes w (two words, values 0-3 then 4-7) times x's limbs xq
// (XInts::load), added to acc[0..2] (the dot products with l0, l1, l2), exactly.
KFN void limbs_dot8(LOCAL const int* w, LOCAL const int* xq, LOCAL int* acc) {
  for (int k = 0; k < 3; ++k) acc[k] = DP4A(w[1], xq[2 * k + 1], DP4A(w[0], xq[2 * k], acc[k]));
}

// Sum over the LANES consecutive lanes of a lane group (LANES a power of two <= 32), in every
// lane of the group.
template <int LANES>
KFN float lanes_sum(float v) {
  if (LANES == 32) return simd_sum_f(v);
  for (int o = LANES / 2; o > 0; o >>= 1) v += simd_xor_f(v, o);
  return v;
}
"""

PACKS_HEADER = f"constexpr int MXFP4_INT = {MXFP4_INT};\n" + r"""
// The stride of x's threadgroup copy that MODE's units read: X_INTS limbs for the integer unit,
// else floats (X_STRIDE where a launch's x copy is sized for limbs: its other slots').
template <int MODE, int XS> constexpr int x_stride() {
  return MODE == MXFP4_INT ? X_INTS : (XS == X_INTS ? X_STRIDE : XS);
}
// A pack = 32 consecutive values of one row = BITS uint32 words. MODE 0 affine, 1 mxfp4, 2 mxfp8,
// MXFP4_INT mxfp4 in the integer unit.
KFN float e8m0_scale(uint32_t s) { return s == 0 ? AS_FLOAT(0x00400000u) : AS_FLOAT(s << 23); }

// mxfp4's integer unit (MXFP4_INT, DSV4_KERNEL_MOE_DP4A), over x as X_INTS limbs (fp8-rounded x):
// twice a code's value is an integer (0, 1, 2, 3, 4, 6, 8, 12, signed), so a pack's dot product
// with x's integers is exact in DP4A, then scaled once a pack. fp4_bytes4: the codes in the low
// 16 bits of n (code k in nibble k) as four signed bytes: the magnitudes' and the negatives' tables
// looked up by each code's low 3 bits, then each byte taken from one of them by its sign bit.
KFN uint32_t fp4_bytes4(uint32_t n) {
  const uint32_t pos = BYTE_PERM(0x03020100u, 0x0c080604u, n & 0x7777u);
  const uint32_t neg = BYTE_PERM(0xfdfeff00u, 0xf4f8fafcu, n & 0x7777u);
  return BYTE_PERM(pos, neg, 0x3210u | ((n & 0x8888u) >> 1));
}

template <int BITS, typename P>
KFN void load_words(P w, LOCAL uint32_t* out) {
  if (BITS % 4 == 0) {
    for (int k = 0; k < BITS / 4; ++k) {
      const uint4 q = LOAD_U4(w, k);
      out[4 * k] = q.x; out[4 * k + 1] = q.y; out[4 * k + 2] = q.z; out[4 * k + 3] = q.w;
    }
  } else {
    for (int k = 0; k < BITS; ++k) out[k] = w[k];
  }
}

// Decode chunk c (values 8c..8c+7) of one pack. mxfp4 values come out scaled by 2^-14 and
// mxfp8 by 2^-8 (fp16 exponent bias); load_pack folds the factor back into the block scale.
template <int MODE, int BITS>
KFN void unpack8(LOCAL const uint32_t* w, int c, LOCAL float* v) {
  if (MODE == 1) {
    // Nibbles k and k+4 of a word sit 16 bits apart: one mask-and-shift makes both fp16s.
    for (int k = 0; k < 4; ++k) {
      const uint32_t q = w[c] >> (4 * k);
      const float2 f = half2_bits_to_float2(((q & 0x00070007u) << 9) | ((q & 0x00080008u) << 12));
      v[k] = f.x;
      v[k + 4] = f.y;
    }
  } else if (MODE == 2) {
    // Bytes k and k+2 likewise.
    for (int j = 0; j < 2; ++j)
      for (int k = 0; k < 2; ++k) {
        const uint32_t q = w[2 * c + j] >> (8 * k);
        const float2 f = half2_bits_to_float2(((q & 0x007f007fu) << 7) | ((q & 0x00800080u) << 8));
        v[4 * j + k] = f.x;
        v[4 * j + k + 2] = f.y;
      }
  } else {
    for (int i = 0; i < 8; ++i) {
      const int bit = (8 * c + i) * BITS, word = bit / 32, off = bit % 32;
      uint32_t q = w[word] >> off;
      if (off + BITS > 32) q |= w[word + 1] << (32 - off);
      v[i] = (float)(q & ((1u << BITS) - 1u));
    }
  }
}

// One pack's words and its scale (and bias, affine) for pack p of a row. The mx scales carry
// the 2^14 (fp4) / 2^8 (fp8) that unpack8's fp16 trick takes out.
template <int MODE, int BITS, int GS, typename PW, typename PS, typename PB>
KFN void load_pack(PW w_row, PS s_row, PB b_row, int p, LOCAL uint32_t* words, LOCAL float* scale,
                   LOCAL float* bias) {
  load_words<BITS>(w_row + p * BITS, words);
  if (MODE == 1) {
    *scale = e8m0_scale((uint32_t)s_row[p]) * 16384.0f;
  } else if (MODE == 2) {
    *scale = e8m0_scale((uint32_t)s_row[p]) * 256.0f;
  } else {
    const int g = (p * 32) / GS;
    *scale = float(s_row[g]);
    *bias = float(b_row[g]);
  }
}

// Dot products of one input row x of K_IN values (read as XChunk<XS> reads it) with the rows
// of the matrices at w0 (and w1 if TWO) starting at row `first` (expert e's first row). The
// SIMD group's lanes form 32 / LANES groups of LANES lanes; group g makes the ROWS consecutive
// output rows from row0 + g * ROWS (clamped to the last row), its lanes taking packs
// p = sub + LANES i (sub = lane % LANES). On return acc0 (acc1) holds the group's sums in each
// of its lanes. Each step first issues the loads of every row's pack, then walks the pack in
// chunks of 8 values (few registers for x and the decoded weights: more resident warps).
// Fewer LANES give each lane more packs of a row, for short rows (the down projection's). With
// `parts` SIMD groups on the same rows, this one (`part`) takes every parts-th of the lane's packs.
// PackDot<INTS>::add adds one pack's products: over x as floats, or (MXFP4_INT) as limbs.
template <bool INTS> struct PackDot;

template <int MODE, int BITS, int GS, int ROWS, int LANES, int K_IN, int XS, bool TWO, typename PX,
          typename PW, typename PS, typename PB>
KFN void rows_dot(PX x, PW w0, PS s0, PB b0, PW w1, PS s1, PB b1, size_t first, int row0,
                  int rows_out, LOCAL float* acc0, LOCAL float* acc1, uint32_t lane, int part = 0, int parts = 1) {
  const int sub = (int)lane % LANES;
  const int rows0 = row0 + ((int)lane / LANES) * ROWS;
  for (int r = 0; r < ROWS; ++r) { acc0[r] = 0.0f; acc1[r] = 0.0f; }
  for (int p = sub + LANES * part; p < K_IN / 32; p += LANES * parts)
    PackDot<MODE == MXFP4_INT>::template add<MODE, BITS, GS, ROWS, K_IN, XS, TWO>(
        x, w0, s0, b0, w1, s1, b1, first, rows0, rows_out, p, acc0, acc1);
  for (int r = 0; r < ROWS; ++r) {
    acc0[r] = lanes_sum<LANES>(acc0[r]);
    if (TWO) acc1[r] = lanes_sum<LANES>(acc1[r]);
  }
}

template <> struct PackDot<false> {
  template <int MODE, int BITS, int GS, int ROWS, int K_IN, int XS, bool TWO, typename PX, typename PW,
            typename PS, typename PB>
  static KFN void add(PX x, PW w0, PS s0, PB b0, PW w1, PS s1, PB b1, size_t first, int rows0, int rows_out,
                      int p, LOCAL float* acc0, LOCAL float* acc1) {
    constexpr int WORDS_PER_ROW = K_IN / 32 * BITS;
    constexpr int SCALES_PER_ROW = K_IN / GS;
    constexpr int MATS = TWO ? 2 : 1;
    uint32_t words[ROWS * MATS][BITS];
    float scale[ROWS * MATS], bias[ROWS * MATS] = {};
    for (int r = 0; r < ROWS; ++r) {
      const size_t row = first + (size_t)min(rows0 + r, rows_out - 1);
      load_pack<MODE, BITS, GS>(w0 + row * WORDS_PER_ROW, s0 + row * SCALES_PER_ROW,
                                b0 + row * SCALES_PER_ROW, p, words[r * MATS], &scale[r * MATS],
                                &bias[r * MATS]);
      if (TWO)
        load_pack<MODE, BITS, GS>(w1 + row * WORDS_PER_ROW, s1 + row * SCALES_PER_ROW,
                                  b1 + row * SCALES_PER_ROW, p, words[r * MATS + 1],
                                  &scale[r * MATS + 1], &bias[r * MATS + 1]);
    }
    float d[ROWS * MATS] = {};
    float x_sum = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float xv[8];
      XChunk<XS>::load(x, p, c, xv);
      if (MODE == 0)
        for (int i = 0; i < 8; ++i) x_sum += xv[i];
      for (int m = 0; m < ROWS * MATS; ++m) {
        float v[8];
        unpack8<MODE, BITS>(words[m], c, v);
        for (int i = 0; i < 8; ++i) d[m] += v[i] * xv[i];
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const int m = r * MATS;
      acc0[r] += MODE == 0 ? scale[m] * d[m] + bias[m] * x_sum : scale[m] * d[m];
      if (TWO)
        acc1[r] += MODE == 0 ? scale[m + 1] * d[m + 1] + bias[m + 1] * x_sum : scale[m + 1] * d[m + 1];
    }
  }
};

// MXFP4_INT: the pack's codes as signed bytes (fp4_bytes4) times x's limbs, exactly; then its
// e8m0 scale, x's s / 2^9 and the codes' factor 2 once.
template <> struct PackDot<true> {
  template <int MODE, int BITS, int GS, int ROWS, int K_IN, int XS, bool TWO, typename PX, typename PW,
            typename PS, typename PB>
  static KFN void add(PX x, PW w0, PS s0, PB b0, PW w1, PS s1, PB b1, size_t first, int rows0, int rows_out,
                      int p, LOCAL float* acc0, LOCAL float* acc1) {
    constexpr int MATS = TWO ? 2 : 1;
    uint32_t words[ROWS * MATS][4], codes[ROWS * MATS];
    for (int r = 0; r < ROWS; ++r) {
      const size_t row = first + (size_t)min(rows0 + r, rows_out - 1);
      load_words<4>(w0 + (row * (K_IN / 32) + p) * 4, words[r * MATS]);
      codes[r * MATS] = (uint32_t)s0[row * (K_IN / 32) + p];
      if (TWO) {
        load_words<4>(w1 + (row * (K_IN / 32) + p) * 4, words[r * MATS + 1]);
        codes[r * MATS + 1] = (uint32_t)s1[row * (K_IN / 32) + p];
      }
    }
    int l[ROWS * MATS][3];
    for (int m = 0; m < ROWS * MATS; ++m) l[m][0] = l[m][1] = l[m][2] = 0;
    for (int c = 0; c < 4; ++c) {
      int q[6];
      XInts::load(x, p, c, q);
      for (int m = 0; m < ROWS * MATS; ++m) {
        const int wb[2] = {(int)fp4_bytes4(words[m][c]), (int)fp4_bytes4(words[m][c] >> 16)};
        limbs_dot8(wb, q, l[m]);
      }
    }
    const float sx = XInts::scale(x, p) * 0.5f;
    for (int r = 0; r < ROWS; ++r) {
      acc0[r] += e8m0_scale(codes[r * MATS]) * sx * (float)XInts::join(l[r * MATS]);
      if (TWO) acc1[r] += e8m0_scale(codes[r * MATS + 1]) * sx * (float)XInts::join(l[r * MATS + 1]);
    }
  }
};
"""

_HEADER = X_HEADER + PACKS_HEADER

_GATE_UP_BODY = r"""
  // grid (32 * 32/RW, I/32, tokens*(K+HS)) with RW = ROWS*32/LANES rows per SIMD group: a
  // threadgroup makes 32 consecutive rows of h (one fp8 block when ACTQ). h is [tokens, K+HS, I];
  // I % 32 == 0.
  constexpr int RW = ROWS * 32 / LANES;
  const int pair = group_z;
  const int t = pair / (K + HS), slot = pair % (K + HS);
  const int row0 = (int)group_y * 32 + (int)warp * RW;
  const float limit = params[0];
  ROUTE_TOKEN
  // The token's x, fp8-rounded when ACTQ, once per threadgroup (up to XS uint4s per pack), read
  // by every SIMD group from there: in fp32, or as limbs where the slot's units are GGUF integer
  // ones (x_stride: the routed experts' and the shared expert's may differ).
  constexpr int RXS = x_stride<MODE, XS>();
  constexpr int SXS = x_stride<SMODE, XS>();
  static_assert(RXS <= XS && SXS <= XS, "x's copy is XS uint4s a pack");
  SHARED uint4 xs[D / 32 * XS];
  for (int p = (int)tid; p < D / 32; p += (int)group_threads) {
    float v[32];
    for (int c = 0; c < 4; ++c) load_bf16_8(x + (size_t)t * D, p, c, v + 8 * c);
    const float x_scale = ACTQ ? qdq_fp8_32(v) : 1.0f;
    if (slot < K) store_x_pack<RXS>(xs, p, v, x_scale);
    else store_x_pack<SXS>(xs, p, v, x_scale);
    STAGE_X
  }
  BARRIER();
  SELECT_EXPERT
  SHARED float block_h[32];
  ROUTED_DOTS
  {
    float g[ROWS], u[ROWS];
    if (slot < K) {
      rows_dot<MODE, BITS, GS, ROWS, LANES, D, RXS, true>(xs, gate_w, gate_s, gate_b, up_w, up_s, up_b,
                                                          (size_t)expert * I, row0, I, g, u, lane);
    } else {
      rows_dot<SMODE, SBITS, SGS, ROWS, LANES, D, SXS, true>(xs, sgate_w, sgate_s, sgate_b, sup_w, sup_s,
                                                            sup_b, 0, row0, I, g, u, lane);
    }
    if ((int)lane % LANES == 0)
      for (int r = 0; r < ROWS; ++r) block_h[warp * RW + (int)lane / LANES * ROWS + r] = hidden_of<T>(g[r], u[r], limit, route);
  }
  BARRIER();
  if (warp == 0) {
    float v = block_h[lane], s = 1.0f;
    if (ACTQ) {
      s = pow2_ceil(FMAX(simd_max_f(FABS(v)), 1e-4f) * (1.0f / 448.0f));
      v = e4m3_round(FMIN(FMAX(v * (1.0f / s), -448.0f), 448.0f)) * s;
    }
    STORE_H
  }
"""
# Where the gate/up launch puts its block of h: as T, or (the GGUF down launch's integer units,
# DSV4_KERNEL_GGUF_DP4A_DOWN; ACTQ) as that pack's X_INTS limbs, h then uint32 with X_INTS uint4s a
# pack (words 36.. of each left unwritten: never read), made by lane 0 from the SIMD group's values.
_STORE_T = {"STORE_H": "    h[(size_t)pair * I + (int)group_y * 32 + (int)lane] = static_cast<T>(v);"}
_STORE_LIMBS = {"STORE_H": r"""
    float hv[32];
    for (int i = 0; i < 32; ++i) hv[i] = AS_FLOAT((uint32_t)simd_shuffle_i((int)AS_UINT(v), i));
    if (lane == 0) {
      uint32_t w[36];
      limb_words(hv, s, w);
      for (int k = 0; k < 36; ++k) h[((size_t)pair * (I / 32) + group_y) * (4 * X_INTS) + k] = w[k];
    }"""}

MAX_SHARED_SPLITS = 4   # SIMD groups the down launch may put on the shared expert (its part[] holds them)
_DOWN_DOTS = r"""
  // grid (32*(K+SPLITS), ceil(DO / RW), tokens) with RW = ROWS*32/LANES: SIMD group s < K makes
  // slot s's dots for the threadgroup's RW rows (every expert's weights stream at once), and the
  // SPLITS groups after them the shared expert's, each a part of its inputs (the launch's width
  // says how many: DSV4_KERNEL_MOE_SHARED_SPLITS); the threadgroup then sums the slots in slot
  // order. h is [tokens, K+HS, I], y is [tokens, DO].
  constexpr int RW = ROWS * 32 / LANES;
  const int SPLITS = HS ? (int)group_threads / 32 - K : 0;
  const int t = group_z;
  const int row0 = (int)group_y * RW;
  const int slot = min((int)warp, K + HS - 1);
  GLOBAL T* hrow = h + ((size_t)t * (K + HS) + slot) * I;
  float acc[ROWS], unused[ROWS];
  if (slot < K) {
    rows_dot<MODE, BITS, GS, ROWS, LANES, I, 0, false>(hrow, down_w, down_s, down_b, down_w, down_s,
                                                       down_b, (size_t)idx[t * K + slot] * DO, row0, DO,
                                                       acc, unused, lane);
  } else {
    rows_dot<SMODE, SBITS, SGS, ROWS, LANES, I, 0, false>(hrow, sdown_w, sdown_s, sdown_b, sdown_w,
                                                          sdown_s, sdown_b, 0, row0, DO, acc, unused, lane,
                                                          (int)warp - K, SPLITS);
  }
  // Each expert's output is rounded to the activation dtype, as its own matmul would be (the
  // shared expert's once its parts are summed, in _DOWN_SUM).
  SHARED float part[(K + MAX_SHARED_SPLITS) * RW];
  if ((int)lane % LANES == 0)
    for (int r = 0; r < ROWS; ++r)
      part[(int)warp * RW + (int)lane / LANES * ROWS + r] = slot < K ? float(static_cast<T>(acc[r])) : acc[r];
"""
_DOWN_DOTS = _DOWN_DOTS.replace("MAX_SHARED_SPLITS", str(MAX_SHARED_SPLITS))
# The down launch's sum of the slots' outputs (part[slot * RW + row]) for row o = row0 + tid: total.
_DOWN_TOTAL = r"""
    float total = 0.0f;
    for (int s = 0; s < K; ++s) total += part[s * RW + (int)tid];
    if (HS) {   // the shared expert's parts, in order
      float shared_part = part[K * RW + (int)tid];
      for (int j = 1; j < SPLITS; ++j) shared_part += part[(K + j) * RW + (int)tid];
      total += float(static_cast<T>(shared_part));
    }
"""
# mHC expand fused: new stream j at row o, v = post_j y + sum_i comb[i][j] R_i (hc_expand's order).
_EXPAND_STREAM = r"""
        float v = post[t * HC + j] * yv;
        for (int i = 0; i < HC; ++i)
          v += comb[(t * HC + i) * HC + j] * float(residual[((size_t)t * HC + i) * DO + o]);
"""
# The down launch's epilogue: y [tokens, DO], or with the expand the HC new streams [tokens, HC, DO].
_DOWN_SUM = r"""
  BARRIER();
  const int o = row0 + (int)tid;
  if ((int)tid < RW && o < DO) {""" + _DOWN_TOTAL + r"""
    if (HC == 0) {
      y[(size_t)t * DO + o] = static_cast<T>(total);
    } else {
      const float yv = float(static_cast<T>(total));
      for (int j = 0; j < HC; ++j) {""" + _EXPAND_STREAM + r"""
        y[((size_t)t * HC + j) * DO + o] = static_cast<T>(v);
      }
    }
  }
"""
# The epilogue with the expand that also makes the next site's entry partials, as the wide path's
# partials launch makes them (mhc.py; DSV4_KERNEL_MOE_NEXT_PROJECTION): SIMD group 0's lanes are
# the threadgroup's RW rows (columns of the streams). Each expands its column, then over its HC
# stored streams X_j takes the projection by the next site's fn, sum X_j^2, and the collapse
# h = round(sum_c pre_in_c X_c) (the partials launch's arithmetic) with h^2, summed over the lanes
# into the column block's partials: partial[t, group_y] = (NM projections, sum X^2, sum h^2);
# collapsed[t, o] = h.
_DOWN_SUM_PROJECTING = r"""
  BARRIER();
  static_assert(RW <= 32, "a column a lane of SIMD group 0");
  constexpr int NM = HC * (2 + HC);
  const int o = row0 + (int)tid;
  if (warp == 0) {
    float acc[NM + 2];
    for (int m = 0; m < NM + 2; ++m) acc[m] = 0.0f;
    if ((int)tid < RW && o < DO) {""" + _DOWN_TOTAL + r"""
      const float yv = float(static_cast<T>(total));
      float x[HC];
      for (int j = 0; j < HC; ++j) {""" + _EXPAND_STREAM + r"""
        const T stored = static_cast<T>(v);
        y[((size_t)t * HC + j) * DO + o] = stored;
        x[j] = float(stored);
      }
      float hv = 0.0f;
      for (int c = 0; c < HC; ++c) hv += pre_in[t * HC + c] * x[c];
      const T h = static_cast<T>(hv);
      collapsed[(size_t)t * DO + o] = h;
      acc[NM + 1] = float(h) * float(h);
      for (int j = 0; j < HC; ++j) {
        acc[NM] += x[j] * x[j];
        for (int m = 0; m < NM; ++m) acc[m] += x[j] * fn[(size_t)m * (HC * DO) + j * DO + o];
      }
    }
    const size_t at = ((size_t)t * ((DO + RW - 1) / RW) + group_y) * (NM + 2);
    for (int m = 0; m < NM + 2; ++m) {
      const float sum = simd_sum_f(acc[m]);
      if (lane == 0) partial[at + m] = sum;
    }
  }
"""

_DOWN_BODY = _DOWN_DOTS + _DOWN_SUM
_DOWN_PROJECTING_BODY = _DOWN_DOTS + _DOWN_SUM_PROJECTING
# The down launch over h as X_INTS limbs (_STORE_LIMBS): rows_dot's integer units read them.
_DOWN_LIMBS_DOTS = (_DOWN_DOTS.replace("GLOBAL T* hrow = h + ((size_t)t * (K + HS) + slot) * I;",
                                       "GLOBAL uint4* hrow = (GLOBAL uint4*)h + ((size_t)t * (K + HS) + slot) * (I / 32) * X_INTS;")
                    .replace("I, 0, false>", "I, X_INTS, false>"))
_DOWN_LIMBS_BODY = _DOWN_LIMBS_DOTS + _DOWN_SUM

# Where the gate/up kernel gets slot `slot`'s expert and router weight: from the router's
# outputs, or (the routed variant) by running the router's tail itself, SIMD group 0 of every
# threadgroup for its token while the others copy x; the first threadgroup of each token also
# writes the ids the down kernel reads.
_GIVEN = {"ROUTE_TOKEN": "", "SELECT_EXPERT": r"""
  const int expert = slot < K ? idx[t * K + slot] : 0;
  const float route = slot < K ? route_w[t * K + slot] : 1.0f;"""}
_ROUTED = {"ROUTE_TOKEN": r"""
  SHARED int picked_ids[K];
  SHARED float picked_w[K];
  if (warp == 0 && slot < K)   // the shared expert's threadgroups need no route
    route_token<E, K, NORM>(logits + (size_t)t * E, bias, rparams[0], rparams[1], lane,
                            picked_ids, picked_w);""", "SELECT_EXPERT": r"""
  const int expert = slot < K ? picked_ids[slot] : 0;
  const float route = slot < K ? picked_w[slot] : 1.0f;
  if (group_y == 0 && slot == 0 && (int)tid < K) ids[t * K + (int)tid] = picked_ids[tid];"""}


# The routed slots' dots as rows_dot makes them (the mma launch's in experts_mma.py).
_ROWS_DOTS = {"STAGE_X": "", "ROUTED_DOTS": ""}


def _gate_up_body(parts: dict, store: dict = _STORE_T, dots: dict = _ROWS_DOTS) -> str:
    body = _GATE_UP_BODY
    for name, code in dict(store, **dots, **parts).items():
        body = re.sub(rf"^ *{name}\n", lambda _: code.lstrip("\n") + "\n", body, flags=re.M)
    return body


_MATRICES = ("gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b",
             "sgate_w", "sgate_s", "sgate_b", "sup_w", "sup_s", "sup_b")
_GATE_UP_INPUTS = ("x", "idx", "route_w", "params") + _MATRICES
_ROUTED_GATE_UP_INPUTS = ("x", "logits", "bias", "rparams", "params") + _MATRICES
_DOWN_INPUTS = ("h", "idx", "down_w", "down_s", "down_b", "sdown_w", "sdown_s", "sdown_b",
                "residual", "post", "comb")


def _gate_up_shape():
    return [("ROWS", ROWS_GATE_UP), ("LANES", LANES_GATE_UP), ("XS", X_STRIDE)]


def _down_shape():
    return [("ROWS", ROWS_DOWN), ("LANES", LANES_DOWN)]


# The routed launches' router template values in the compile gates' instances (V4.1's 384 experts).
_ROUTING_CHECK = [("E", 384), ("NORM", True)]


# The down launch's last three inputs (residual, post, comb) without the mHC expand (placeholders)
# and with it (HC 4): the compile gates check both.
_DOWN_EXPANDS = ((0, (mx.uint32,) * 3), (4, (mx.bfloat16, mx.float32, mx.float32)))


def _gguf_down_instances(h_dtype, tmpl: list) -> list:
    """A GGUF down launch's compile-gate instances of `tmpl`: h of h_dtype, without and with the expand."""
    return [((h_dtype, mx.int32) + (mx.uint8, mx.uint32, mx.uint32) * 2 + extra, (mx.bfloat16,), tuple(tmpl + [("HC", hc)]))
            for hc, extra in _DOWN_EXPANDS]


def _check_instances(stage):
    """(mode, bits, group_size, scale dtype) pairs the offline compile gates instantiate."""
    variants = [(("mxfp4", 4, 32, mx.uint8), ("mxfp8", 8, 32, mx.uint8)),
                (("affine", 3, 64, mx.bfloat16), ("affine", 2, 32, mx.float32)),
                (("affine", 4, 128, mx.float32), ("affine", 8, 32, mx.bfloat16))]
    out = []
    for (m, b, g, st), (sm, sb, sg, sst) in variants:
        tmpl = [("T", mx.bfloat16), ("MODE", MODE_IDS[m]), ("BITS", b), ("GS", g),
                ("SMODE", MODE_IDS[sm]), ("SBITS", sb), ("SGS", sg), ("HS", 1), ("K", 6)]
        bt = st if m == "affine" else mx.uint8
        sbt = sst if sm == "affine" else mx.uint8
        mats = (mx.uint32, st, bt) * 2 + (mx.uint32, sst, sbt) * 2
        gate_up_tmpl = tmpl + _gate_up_shape() + [("ACTQ", True), ("I", 2304), ("D", 5120)]
        gate_up_tmpls = [gate_up_tmpl]
        if m == "mxfp4":   # again with mxfp4's integer unit (DSV4_KERNEL_MOE_DP4A; x's copy sized for limbs)
            gate_up_tmpls.append(list(dict(gate_up_tmpl, MODE=MXFP4_INT, XS=X_INTS).items()))
        if stage == "gate_up":
            ins = (mx.bfloat16, mx.int32, mx.float32, mx.float32) + mats
            out += [(ins, (mx.bfloat16,), tuple(t)) for t in gate_up_tmpls]
        elif stage == "routed_gate_up":
            ins = (mx.bfloat16, mx.float32, mx.float32, mx.float32, mx.float32) + mats
            out += [(ins, (mx.bfloat16, mx.int32), tuple(t + _ROUTING_CHECK)) for t in gate_up_tmpls]
        else:
            for hc, extra in _DOWN_EXPANDS:
                ins = (mx.bfloat16, mx.int32, mx.uint32, st, bt, mx.uint32, sst, sbt) + extra
                out.append((ins, (mx.bfloat16,), tuple(tmpl + _down_shape() + [("I", 2304), ("DO", 5120), ("HC", hc)])))
    return tuple(out)


GATE_UP_KERNEL = Kernel(name="dsv4_experts_gate_up", input_names=_GATE_UP_INPUTS,
                        output_names=("h",), body=_gate_up_body(_GIVEN), header=_HEADER,
                        checks=_check_instances("gate_up"))
ROUTED_GATE_UP_KERNEL = Kernel(name="dsv4_experts_routed_gate_up", input_names=_ROUTED_GATE_UP_INPUTS,
                               output_names=("h", "ids"), body=_gate_up_body(_ROUTED),
                               header=_HEADER + ROUTER_HEADER, checks=_check_instances("routed_gate_up"))
DOWN_KERNEL = Kernel(name="dsv4_experts_down", input_names=_DOWN_INPUTS, output_names=("y",),
                     body=_DOWN_BODY, header=_HEADER, checks=_check_instances("down"))


def _projecting(down: Kernel, body: str) -> Kernel:
    """`down`'s launch with the epilogue that also makes the next site's entry partials
    (_DOWN_SUM_PROJECTING). Compile gates: `down`'s first instance with the expand, fn and pre_in
    fp32 (the dots before the epilogue are `down`'s, whose gates take every layout)."""
    ins, outs, tmpl = next(check for check in down.checks if dict(check[2])["HC"] > 0)
    checks = ((ins + (mx.float32, mx.float32), outs + (mx.float32, outs[0]), tmpl),)
    return Kernel(name=down.name.replace("_down", "_down_projecting"), input_names=_DOWN_INPUTS + ("fn", "pre_in"),
                  output_names=("y", "partial", "collapsed"), body=body, header=down.header, checks=checks)


# The same bodies over rows of GGUF blocks (gguf_dot.py's rows_dot). Launch shapes (ROWS, LANES)
# by the routed experts' type: a lane's unit is 32-128 values (gguf_dot.UNIT_VALUES), so fewer
# lanes share a row where the units are large. Q4_K's down makes two rows a lane group (h read
# once for both): on an H100 42.8 against 44.4 µs at one token, 109 against 131 at four and 183
# against 237 at eight; Q2_K's down (two rows: 32% slower) and the gate/up launches keep theirs,
# the fastest at one token (benchmarks/results/2026-12-06-0617-experts-shapes-q4.md,
# 0616-experts-shapes-q2.md).
GGUF_GATE_UP_SHAPES = {"Q8_0": (4, 32), "IQ2_XXS": (4, 32), "Q4_K": (4, 16), "Q2_K": (4, 8)}
GGUF_DOWN_SHAPES = {"Q8_0": (2, 8), "IQ2_XXS": (2, 8), "Q4_K": (2, 4), "Q2_K": (1, 4)}
_GGUF_HEADER = X_HEADER + gguf_dot.HEADER


def _gguf_checks(stage):
    """(routed, shared) GGUF types of ds4's q2 and q4 recipes (and a Q2_K/IQ2_XXS mix) at V4.1's
    widths; then the q2 recipe's (and the mix's) in the wide units (DSV4_KERNEL_GGUF_WIDE), and
    the recipes' units with fp16-subnormal codes (DSV4_KERNEL_GGUF_HALVES), q2's with Q8_0 by
    int8s2 (DSV4_KERNEL_GGUF_Q8_HSUB), and q2's and q4's gate/up in the integer units over x as
    limbs (DSV4_KERNEL_GGUF_DP4A)."""
    out = []
    narrow, wide = gguf_dot.GGUF_MODE_IDS, dict(gguf_dot.GGUF_MODE_IDS, **gguf_dot.WIDE_MODE_IDS)
    halves = dict(wide, **gguf_dot.HALVES_MODE_IDS)
    hsub = dict(halves, Q8_0=gguf_dot.Q8_0_HSUB)
    integer = dict(hsub, **gguf_dot.INT_MODE_IDS)   # their gate/up only (the down launch: hsub's)
    for routed, shared, ids in (("IQ2_XXS", "Q8_0", narrow), ("Q4_K", "Q8_0", narrow), ("Q2_K", "Q4_K", narrow),
                                ("IQ2_XXS", "Q8_0", wide), ("Q2_K", "Q4_K", wide), ("IQ2_XXS", "Q8_0", halves),
                                ("Q4_K", "Q8_0", halves), ("Q2_K", "Q4_K", halves), ("IQ2_XXS", "Q8_0", hsub),
                                ("IQ2_XXS", "Q8_0", integer), ("Q4_K", "Q8_0", integer)):
        if ids is integer and stage == "down":
            continue
        tmpl = [("T", mx.bfloat16), ("MODE", ids[routed]), ("BITS", 0), ("GS", 0),
                ("SMODE", ids[shared]), ("SBITS", 0), ("SGS", 0), ("HS", 1), ("K", 6)]
        mats = (mx.uint8, mx.uint32, mx.uint32) * 4
        rows, lanes = GGUF_GATE_UP_SHAPES[routed]
        gate_up_tmpl = tmpl + [("ROWS", rows), ("LANES", lanes), ("XS", X_INTS if ids is integer else X_STRIDE),
                               ("ACTQ", True), ("I", 2304), ("D", 5120)]
        if stage == "gate_up":
            ins = (mx.bfloat16, mx.int32, mx.float32, mx.float32) + mats
            out.append((ins, (mx.bfloat16,), tuple(gate_up_tmpl)))
        elif stage == "routed_gate_up":
            ins = (mx.bfloat16, mx.float32, mx.float32, mx.float32, mx.float32) + mats
            out.append((ins, (mx.bfloat16, mx.int32), tuple(gate_up_tmpl + _ROUTING_CHECK)))
        else:
            rows, lanes = GGUF_DOWN_SHAPES[routed]
            out += _gguf_down_instances(mx.bfloat16, tmpl + [("ROWS", rows), ("LANES", lanes), ("I", 2304), ("DO", 5120)])
    return tuple(out)


def _gguf_limbs_checks(stage):
    """The launches around h as limbs (DSV4_KERNEL_GGUF_DP4A_DOWN) in ds4's recipes at V4.1's
    widths: q4's and q2's gate/up in the integer units, and q2's in the halves ones (DSV4_KERNEL_GGUF_DP4A
    off), each writing limbs, then q4's (Q4_K) and q2's (Q2_K) down with the Q8_0 shared expert's,
    in the integer units."""
    out = []
    ints = gguf_dot.INT_MODE_IDS
    mats = (mx.uint8, mx.uint32, mx.uint32) * 4
    recipes = (("Q4_K", "Q4_K", ints["Q4_K"], ints["Q8_0"], X_INTS),
               ("IQ2_XXS", "Q2_K", gguf_dot.HALVES_MODE_IDS["IQ2_XXS"], gguf_dot.Q8_0_HSUB, X_STRIDE),
               ("IQ2_XXS", "Q2_K", ints["IQ2_XXS"], ints["Q8_0"], X_INTS))
    for gate, down, mode, smode, xs in recipes if stage != "down" else recipes[:2]:   # one down a recipe
        common = [("T", mx.bfloat16), ("BITS", 0), ("GS", 0), ("SBITS", 0), ("SGS", 0), ("HS", 1), ("K", 6)]
        if stage == "down":
            rows, lanes = GGUF_DOWN_SHAPES[down]
            tmpl = common + [("MODE", ints[down]), ("SMODE", ints["Q8_0"]), ("ROWS", rows), ("LANES", lanes),
                             ("I", 2304), ("DO", 5120)]
            out += _gguf_down_instances(mx.uint32, tmpl)
            continue
        rows, lanes = GGUF_GATE_UP_SHAPES[gate]
        tmpl = common + [("MODE", mode), ("SMODE", smode), ("ROWS", rows), ("LANES", lanes), ("XS", xs),
                         ("ACTQ", True), ("I", 2304), ("D", 5120)]
        if stage == "gate_up":
            out.append(((mx.bfloat16, mx.int32, mx.float32, mx.float32) + mats, (mx.uint32,), tuple(tmpl)))
        else:
            ins = (mx.bfloat16, mx.float32, mx.float32, mx.float32, mx.float32) + mats
            out.append((ins, (mx.uint32, mx.int32), tuple(tmpl + _ROUTING_CHECK)))
    return tuple(out)


GGUF_DOWN_KERNEL = Kernel(name="dsv4_experts_down_gguf", input_names=_DOWN_INPUTS, output_names=("y",),
                          body=_DOWN_BODY, header=_GGUF_HEADER, checks=_gguf_checks("down"))


def _gguf_gate_up_kernels(limbs: bool) -> tuple:
    """The GGUF gate/up launches (given the route, routing themselves) writing h as T or, with
    `limbs`, as limbs (DSV4_KERNEL_GGUF_DP4A_DOWN)."""
    suffix = "_limbs" if limbs else ""
    store = _STORE_LIMBS if limbs else _STORE_T
    checks = _gguf_limbs_checks if limbs else _gguf_checks
    out = []
    for routed, inputs, outputs, header in ((False, _GATE_UP_INPUTS, ("h",), _GGUF_HEADER),
                                            (True, _ROUTED_GATE_UP_INPUTS, ("h", "ids"), _GGUF_HEADER + ROUTER_HEADER)):
        out.append(Kernel(name=f"dsv4_experts{'_routed' if routed else ''}_gate_up_gguf{suffix}", input_names=inputs,
                          output_names=outputs, body=_gate_up_body(_ROUTED if routed else _GIVEN, store=store),
                          header=header, checks=checks("routed_gate_up" if routed else "gate_up")))
    return tuple(out)


# h as limbs -> (gate/up, routed gate/up) launches.
GGUF_GATE_UP_KERNELS = {limbs: _gguf_gate_up_kernels(limbs) for limbs in (False, True)}
GGUF_GATE_UP_KERNEL, GGUF_ROUTED_GATE_UP_KERNEL = GGUF_GATE_UP_KERNELS[False]
GGUF_LIMBS_GATE_UP_KERNEL, GGUF_LIMBS_ROUTED_GATE_UP_KERNEL = GGUF_GATE_UP_KERNELS[True]
# The down launch over h as limbs (DSV4_KERNEL_GGUF_DP4A_DOWN): rows_dot's integer units read them.
GGUF_LIMBS_DOWN_KERNEL = Kernel(name="dsv4_experts_down_gguf_limbs", input_names=_DOWN_INPUTS, output_names=("y",),
                                body=_DOWN_LIMBS_BODY, header=_GGUF_HEADER, checks=_gguf_limbs_checks("down"))
# The down launches' projecting twins (DSV4_KERNEL_MOE_NEXT_PROJECTION), by the down launch's name.
DOWN_PROJECTING_KERNEL = _projecting(DOWN_KERNEL, _DOWN_PROJECTING_BODY)
GGUF_DOWN_PROJECTING_KERNEL = _projecting(GGUF_DOWN_KERNEL, _DOWN_PROJECTING_BODY)
GGUF_LIMBS_DOWN_PROJECTING_KERNEL = _projecting(GGUF_LIMBS_DOWN_KERNEL, _DOWN_LIMBS_DOTS + _DOWN_SUM_PROJECTING)
PROJECTING_DOWN_KERNELS = {DOWN_KERNEL.name: DOWN_PROJECTING_KERNEL, GGUF_DOWN_KERNEL.name: GGUF_DOWN_PROJECTING_KERNEL,
                           GGUF_LIMBS_DOWN_KERNEL.name: GGUF_LIMBS_DOWN_PROJECTING_KERNEL}


def _kernels(m):
    """(gate/up, routed gate/up, down) kernels and the (gate/up, down) launch shapes for
    routed experts m."""
    if isinstance(m, GGUFMatrix):
        return (GGUF_GATE_UP_KERNEL, GGUF_ROUTED_GATE_UP_KERNEL, GGUF_DOWN_KERNEL,
                GGUF_GATE_UP_SHAPES[m.qtype], GGUF_DOWN_SHAPES[m.qtype])
    return (GATE_UP_KERNEL, ROUTED_GATE_UP_KERNEL, DOWN_KERNEL, (ROWS_GATE_UP, LANES_GATE_UP),
            (ROWS_DOWN, LANES_DOWN))


def matrix_supported(m) -> bool:
    """Whether the kernels' decoding handles m's layout: MLX's packs (load_pack, unpack8) or
    GGUF blocks (gguf_dot)."""
    if isinstance(m, GGUFMatrix):
        return gguf_dot.supported(m)
    if m.mode in ("mxfp4", "mxfp8"):
        ok_bits = m.bits == (4 if m.mode == "mxfp4" else 8) and m.group_size == 32
    else:
        ok_bits = m.mode == "affine" and m.bits in AFFINE_BITS and m.group_size in (32, 64, 128)
    return ok_bits and m.in_features % 32 == 0 and m.weight.dtype == mx.uint32


def gate_up_shared_bytes(D: int, stride: int) -> int:
    """The gate/up launch's threadgroup memory: x's copy (`stride` uint4s a 32-wide block) and block_h."""
    return D // 32 * stride * 16 + 128


def kernel_supports(x, gate, up, down, shared) -> bool:
    mats = [gate, up, down] + (list(shared) if shared is not None else [])
    gguf = lambda m: isinstance(m, GGUFMatrix)   # one rows_dot per kernel: GGUF or MLX packs
    # GGUF blocks have no MLX matmul: their prefill takes these kernels too (a chunk's ~8 rows
    # per expert are a decode's), where MLX's packs take gather_qmm beyond a decode's tokens.
    if x.ndim != 2 or x.dtype != mx.bfloat16 or (x.shape[0] > MAX_KERNEL_TOKENS and not gguf(gate)):
        return False
    # x's copy as the integer units' limbs, if they take it (under act_quant)
    stride = X_INTS if any(integer_kinds(gate, None if shared is None else shared[0], True)) else X_STRIDE
    if gate_up_shared_bytes(x.shape[-1], stride) > shared_memory_limit(backend()):
        return False
    if not all(matrix_supported(m) for m in mats):
        return False
    dims = [(m_g.in_features, m_g.out_features, m_u.out_features, m_d.in_features)
            for m_g, m_u, m_d in [(gate, up, down)] + ([tuple(shared)] if shared is not None else [])]
    if any(d != x.shape[-1] or not (i == j == k) for d, i, j, k in dims):
        return False
    same = lambda a, b: a.layout == b.layout
    if not all(gguf(m) == gguf(gate) for m in mats):
        return False
    if gguf(gate):   # the down launch has its own types: ds4's q2 recipe has Q2_K down, IQ2_XXS gate/up
        return same(gate, up) and (shared is None or same(shared[0], shared[1]))
    return same(gate, up) and same(gate, down) and (shared is None or (
        same(shared[0], shared[1]) and same(shared[0], shared[2])))


def integer_units(gate, s_gate, act_quant: bool) -> bool:
    """Whether the GGUF gate/up launch takes gguf_dot's integer units (DSV4_KERNEL_GGUF_DP4A): x
    fp8-rounded (act_quant) and both its matrices of a type that has one."""
    return (bool(act_quant) and isinstance(gate, GGUFMatrix) and gate.integer
            and (s_gate is None or (isinstance(s_gate, GGUFMatrix) and s_gate.integer)))


def integer_kinds(gate, s_gate, act_quant: bool) -> tuple[bool, bool]:
    """(routed, shared): whether the gate/up launch's routed experts and its shared expert
    (routed's again without one) take the integer units. GGUF: both as integer_units says. MLX's
    packs: mxfp4's routed experts under DSV4_KERNEL_MOE_DP4A, the shared expert (mxfp8 in V4.1) as
    floats. x's copy is then floats or limbs by slot. x must be fp8-rounded (act_quant) for limbs."""
    if isinstance(gate, QuantizedMatrix):   # mxfp4's routed experts (DSV4_KERNEL_MOE_DP4A); no mxfp8 unit
        return bool(act_quant) and gate.integer, False
    both = integer_units(gate, s_gate, act_quant)
    return both, both


def limbs_between(down, s_down, act_quant: bool) -> bool:
    """Whether the GGUF gate/up launch hands h to the down launch as X_INTS limbs, which the down
    reads in gguf_dot's integer units (DSV4_KERNEL_GGUF_DP4A_DOWN): h fp8-rounded (act_quant) and
    both down matrices of types that have integer units."""
    integer = lambda m: isinstance(m, GGUFMatrix) and m.qtype in gguf_dot.INT_MODE_IDS
    return (bool(act_quant) and bool(flags.get("kernel_gguf_dp4a_down")) and integer(down)
            and (s_down is None or integer(s_down)))


def _placeholder():
    """An 8-word input standing for an absent matrix/bias (8+ elements keep Metal's device space)."""
    return constant((0,) * 8, mx.uint32)


def matrix_operands(m) -> list:
    """m's kernel inputs (placeholders for an absent matrix)."""
    return [_placeholder()] * 3 if m is None else m.operands()


def experts_kernel_reference(x, indices, weights, gate, up, down, shared=None, swiglu_limit=10.0,
                             act_quant=False, expand=None, routing=None):
    """What `experts_kernel` computes, without its kernels: the router's choice (with
    `routing`), `experts_reference`, then the mHC expand (with `expand`)."""
    if routing is not None:
        indices, weights = route(*routing)
    y = experts_reference(x, indices, weights, gate, up, down, shared, swiglu_limit, act_quant)
    return y if expand is None else hc_expand(y, *expand)


@falls_back(experts_kernel_reference, "kernel_moe")
def experts_kernel(x, indices, weights, gate, up, down, shared=None, swiglu_limit=10.0,
                   act_quant=False, expand=None, routing=None):
    """The fused GPU path; same contract as `experts` (call that instead). With `routing` =
    (logits, bias, k, temp, scale, norm) in place of indices and weights, the gate/up kernel
    runs the router's tail itself (`routed_experts`)."""
    s_gate, s_down = (shared[0], shared[2]) if shared is not None else (None, None)
    limbs = limbs_between(down, s_down, act_quant)
    h, indices = gate_up_kernel(x, indices, weights, gate, up, shared, swiglu_limit, act_quant, routing, limbs)
    return down_kernel(h, indices, down, s_down, expand)


def _common_template(dtype, K, routed: QuantizedMatrix, shared: QuantizedMatrix | None, layouts: list = None):
    """Template values both launches share: the routed and shared experts' layouts (their own,
    or `layouts`), HS and K."""
    layouts = layouts or routed.template() + (shared or routed).template("S")
    return [("T", dtype)] + layouts + [("HS", int(shared is not None)), ("K", K)]


def gate_up_kernel(x, indices, weights, gate, up, shared=None, swiglu_limit=10.0, act_quant=False,
                   routing=None, limbs=False):
    """The first launch of `experts_kernel`: h [T, K+HS, I] (the routed slots, then the shared
    expert's) and the indices [T, K] the down kernel reads (routing's choice, or `indices`). With
    `limbs` (limbs_between), h is each pack's X_INTS limbs: uint32 [T, K+HS, I / 32 * 4 X_INTS]."""
    T, D = x.shape
    K = indices.shape[-1] if routing is None else routing[2]
    I = gate.out_features
    s_gate, s_up = shared[:2] if shared is not None else (None, None)
    slots = K + int(shared is not None)
    template = _common_template(x.dtype, K, gate, s_gate)
    given_kernel, routed_kernel, _, (rows, lanes), _ = _kernels(gate)
    if isinstance(gate, GGUFMatrix):
        given_kernel, routed_kernel = GGUF_GATE_UP_KERNELS[limbs]
    threads = 32 * 32 // (rows * 32 // lanes)   # 32 rows of h per threadgroup
    routed_ints, shared_ints = integer_kinds(gate, s_gate, act_quant)
    if routed_ints or shared_ints:
        template = _common_template(x.dtype, K, gate, s_gate, gate.template(integer=routed_ints) +
                                    (s_gate or gate).template("S", integer=shared_ints))
    template += [("ROWS", rows), ("LANES", lanes), ("XS", X_INTS if routed_ints or shared_ints else X_STRIDE),
                 ("ACTQ", bool(act_quant)), ("I", I), ("D", D)]
    from dsv4.kernels import experts_mma   # (it builds on this module's kernels)
    if experts_mma.applies(x, gate, act_quant, routed_ints):
        given_kernel, routed_kernel = experts_mma.GATE_UP_KERNEL, experts_mma.ROUTED_GATE_UP_KERNEL
    matrices = [a for m in (gate, up, s_gate, s_up) for a in matrix_operands(m)]
    h_shape, h_dtype = ((T, slots, I // 32 * 4 * X_INTS), mx.uint32) if limbs else ((T, slots, I), x.dtype)
    launch = dict(grid=(threads, I // 32, T * slots), threadgroup=(threads, 1, 1),
                  output_shapes=[h_shape], output_dtypes=[h_dtype])
    if routing is None:
        indices = indices if indices.dtype == mx.int32 else indices.astype(mx.int32)
        weights = weights if weights.dtype == mx.float32 else weights.astype(mx.float32)
        (h,) = given_kernel(inputs=[x, indices, weights, constant((float(swiglu_limit),))] + matrices,
                              template=template, **launch)
        return h, indices
    logits, bias, _, temp, scale, norm = routing
    launch["output_shapes"].append((T, K))
    launch["output_dtypes"].append(mx.int32)
    return tuple(routed_kernel(
        inputs=[x, logits, bias if bias.dtype == mx.float32 else bias.astype(mx.float32),
                constant((float(temp), float(scale))), constant((float(swiglu_limit),))] + matrices,
        template=template + [("E", logits.shape[-1]), ("NORM", bool(norm))], **launch))


def down_kernel(h, indices, down, s_down=None, expand=None):
    """The second launch of `experts_kernel`: the down matvecs of h's slots (the routed ones,
    then the shared expert's when s_down is given) summed, and mHC-expanded with `expand`. h as
    limbs (uint32, gate_up_kernel's `limbs`) takes the integer units."""
    limbs = h.dtype == mx.uint32
    T = h.shape[0]
    I = down.in_features
    dtype = mx.bfloat16 if limbs else h.dtype   # the kernels' activations are bf16 (kernel_supports)
    K = indices.shape[-1]
    DO = down.out_features
    site = ()
    if expand is None:
        streams, out_shape, hc = [_placeholder()] * 3, (T, DO), 0
    else:   # residual, post, comb, and the next site's fn and pre_in where given: all but residual fp32
        residual, *mixes = expand
        site, hc = mixes[2:], residual.shape[-2]
        streams = [residual] + [a if a.dtype == mx.float32 else a.astype(mx.float32) for a in mixes]
        out_shape = (T, hc, DO)
    layouts = down.template(integer=True) + (s_down or down).template("S", integer=True) if limbs else None
    template = _common_template(dtype, K, down, s_down, layouts)
    *_, kernel, _, (rows, lanes) = _kernels(down)
    kernel = GGUF_LIMBS_DOWN_KERNEL if limbs else kernel
    from dsv4.kernels import experts_mma   # (it builds on this module's kernels)
    if not site and experts_mma.down_applies(h, down, I, DO, K):
        kernel, (rows, lanes) = experts_mma.DOWN_KERNEL, experts_mma.DOWN_SHAPE
    per_group, groups = rows * 32 // lanes, K + shared_splits(down, s_down, K)
    template += [("ROWS", rows), ("LANES", lanes)]
    blocks = math.ceil(DO / per_group)
    outputs = dict(output_shapes=[out_shape], output_dtypes=[dtype])
    if site:   # the next site's entry partials, a column block's each
        kernel = PROJECTING_DOWN_KERNELS[kernel.name]
        outputs = dict(output_shapes=[out_shape, partials_shape(T, blocks, hc), (T, DO)],
                       output_dtypes=[dtype, mx.float32, dtype])
    y, *made = kernel(
        inputs=[h, indices] + matrix_operands(down) + matrix_operands(s_down) + streams,
        grid=(32 * groups, blocks, T), threadgroup=(32 * groups, 1, 1),
        # h arrives already rounded to fp8 (gate_up kernel), so no act_quant here.
        template=template + [("I", I), ("DO", DO), ("HC", hc)], **outputs)
    return (y, Projection(made[0], blocks, made[1])) if site else y


def shared_splits(down, s_down, K: int) -> int:
    """SIMD groups of the portable down launch on the shared expert's rows beside the K routed
    slots' (DSV4_KERNEL_MOE_SHARED_SPLITS; 0 without one): the switch's count, or with 0 its
    row's bytes over a routed expert's, rounded; 1-4, and at most 32 SIMD groups in all."""
    if s_down is None:
        return 0
    n = flags.get("kernel_moe_shared_splits") or round(_row_bytes(s_down) / _row_bytes(down))
    return max(1, min(MAX_SHARED_SPLITS, 32 - K, n))


def _row_bytes(m) -> int:
    """Bytes of one output row of m (its weight and, for MLX's packs, scales and biases)."""
    arrays = (m.weight,) if isinstance(m, GGUFMatrix) else (m.weight, m.scales, m.biases)
    return sum(a.shape[-1] * a.itemsize for a in arrays if a is not None)


def _kernel_runs(x, k, gate, up, down, shared, expand) -> bool:
    return (flags.get("kernel_moe") and backend() is not None
            and kernel_supports(x, gate, up, down, shared)
            and k + (shared is not None) <= 32   # a SIMD group per slot (down)
            and (expand is None or expand[0].dtype == x.dtype))


def experts(x, indices, weights, gate, up, down, shared=None, swiglu_limit=10.0, act_quant=False,
            expand=None):
    """Routed experts (+ shared expert) of a MoE layer, summed; optionally mHC-expanded.

    x        [T, D] activations (bf16)
    indices  [T, k] int: selected experts per token (all valid: the router always picks k)
    weights  [T, k] fp32 router weights (already normalised and scaled by route_scale)
    gate, up, down  QuantizedMatrix of the routed experts: [E, I, D], [E, I, D], [E, D, I]
    shared   optional (gate, up, down) QuantizedMatrix of the shared expert: [I, D], [I, D], [D, I]
    swiglu_limit    L in min(g, L) and clip(u, -L, L)
    act_quant       round x and h to fp8 per 32 values before their matmuls (official numerics)
    expand   optional (residual [T, hc, D], post [T, hc], comb [T, hc, hc]) of the FFN site:
             return hc_expand(y, residual, post, comb) [T, hc, D] instead of y (fused into the
             down kernel's epilogue on the kernel path)
    returns  [T, D] (or [T, hc, D] with expand) in x's dtype

    The fused kernel runs for 1-8 bf16 tokens when the backend has one and flag `kernel_moe`
    is on; otherwise (and for prefill) `experts_reference`, MLX's gather_qmm path.
    """
    if _kernel_runs(x, indices.shape[-1], gate, up, down, shared, expand):
        return experts_kernel(x, indices, weights, gate, up, down, shared, swiglu_limit, act_quant, expand)
    return experts_kernel_reference(x, indices, weights, gate, up, down, shared, swiglu_limit, act_quant, expand)


def routed_experts(x, logits, bias, k, temp, scale, norm, gate, up, down, shared=None,
                   swiglu_limit=10.0, act_quant=False, expand=None):
    """`experts` over the router's choice: route(logits, bias, k, temp, scale, norm)
    (dsv4/kernels/router.py) gives the indices and weights. Where both the router's and the
    experts' kernels run and flag `kernel_moe_route` is on, the gate/up kernel runs the
    router's tail itself (the same code, so the same choice and weights): one launch less."""
    if (flags.get("kernel_moe_route") and route_kernel_applies(logits, k)
            and _kernel_runs(x, k, gate, up, down, shared, expand)):
        return experts_kernel(x, None, None, gate, up, down, shared, swiglu_limit, act_quant, expand,
                              routing=(logits, bias, k, temp, scale, norm))
    indices, weights = route(logits, bias, k, temp, scale, norm)
    return experts(x, indices, weights, gate, up, down, shared, swiglu_limit, act_quant, expand)
