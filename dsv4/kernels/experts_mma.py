"""The fused experts' gate/up launch with the mxfp4 routed experts on tensor cores (CUDA;
DSV4_KERNEL_MOE_MMA, off until a GPU has timed it).

The portable launch (experts.py) decodes each fp4 code to fp32 and multiplies: ~4.2 instructions
a weight, which is what bounds it (an H100 at one token: 65 µs for 99.5 MB, 1.5 TB/s; an L2
prefetch of its rows made it slower, benchmarks/results/2026-12-07-0953-l2-prefetch.md). Here
the same threadgroup (a pair's 32 rows of gate and up, x copied once) makes its routed slot's
rows with mma.sync m16n8k16 in bf16, the codes decoded as the prefill's tensor-core launch
decodes them (experts_prefill.py: a pair of codes moved into bf16's fields in four instructions,
then times the group's power of two; exact), ~2.7 instructions a weight:

  - SIMD group w takes 16 rows (tile w % 4: gate rows 0-15, 16-31, up rows 0-15, 16-31) over half
    the input (w / 4), in chunks of 128 values: lane (q, t) loads group 4c + t of its rows q and
    q + 8 (16 bytes each), and mma step S of the chunk gives it values 32 t + 4 S .. + 3 (the k
    order is the lane's own; x is read in the same order);
  - x (fp8-rounded with act_quant, else the activations' bf16) is exact in bf16: the B side is
    x's values, the same for all 8 columns, so every column of D holds the rows' sums;
  - the two halves' sums are added in fp32, then the clamped SwiGLU, the router weight and the
    fp8 block of h as in the portable launch (`hidden_of`, the same epilogue).

The products are exact and summed in fp32 in another order: within the fp32 bound of the
portable launch's sums. The shared expert's slot (mxfp8 officially) keeps rows_dot.
"""

from __future__ import annotations

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import experts as ex
from dsv4.kernels import experts_prefill
from dsv4.kernels.dialect import Kernel, backend, shared_memory_limit

CHUNK = 128   # input values a lane's step of the loop covers (4 groups of 32)

_STAGE_X = {"STAGE_X": r"""
    for (int j = 0; j < 16; ++j) xb[16 * p + j] = (AS_UINT(v[2 * j]) >> 16) | (AS_UINT(v[2 * j + 1]) & 0xffff0000u);"""}

_MMA_DOTS = r"""
  if (slot < K) {
    // SIMD group w: tile w % 4 (16 rows: gate 0-15, 16-31, up 0-15, 16-31), input half w / 4.
    SHARED float half_sums[2][64];
    const int tile = (int)warp & 3, half_k = (int)warp >> 2;
    const int q = (int)lane >> 2, t = (int)lane & 3;
    constexpr int GROUPS = D / 32;
    constexpr int CHUNKS = D / CHUNK_VALUES;
    const size_t row = (size_t)expert * I + (int)group_y * 32 + 16 * (tile & 1) + q;   // and row + 8
    GLOBAL uint32_t* wl = (tile < 2 ? gate_w : up_w) + row * GROUPS * 4 + 4 * t;       // group t of chunk 0
    GLOBAL uint8_t* sl = (tile < 2 ? gate_s : up_s) + row * GROUPS + t;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c = half_k * (CHUNKS / 2); c < (half_k + 1) * (CHUNKS / 2); ++c) {
      uint32_t w[2][4], w4[2][4];
      int m[2];
      for (int r = 0; r < 2; ++r) {
        const uint4 u4 = LOAD_U4(wl + (size_t)8 * r * GROUPS * 4 + 16 * c, 0);
        w[r][0] = u4.x; w[r][1] = u4.y; w[r][2] = u4.z; w[r][3] = u4.w;
        for (int i = 0; i < 4; ++i) w4[r][i] = w[r][i] << 4;
        m[r] = (int)sl[(size_t)8 * r * GROUPS + 4 * c] - 1;
      }
      const bool huge = simd_max_f(m[0] > 127 || m[1] > 127 ? 1.0f : 0.0f) > 0.0f;   // the SIMD group's one path
      for (int i = 0; i < 4; ++i) {
        const uint4 xv = *reinterpret_cast<const uint4*>(xb + 64 * c + 16 * t + 4 * i);   // values 32 t + 8 i ..
        const uint32_t b[2][2] = {{xv.x, xv.y}, {xv.z, xv.w}};
        for (int s = 0; s < 2; ++s) {
          uint32_t a[4];
          for (int r = 0; r < 2; ++r) {
            const uint32_t lo = stream_pair<1>(w[r][i], w4[r][i], 2 * s), hi = stream_pair<1>(w[r][i], w4[r][i], 2 * s + 1);
            a[r] = huge ? stream_scaled<true>(lo, m[r]) : stream_scaled<false>(lo, m[r]);
            a[2 + r] = huge ? stream_scaled<true>(hi, m[r]) : stream_scaled<false>(hi, m[r]);
          }
          mma_16816_bf16(acc, a, b[s]);
        }
      }
    }
    if (t == 0) {
      half_sums[half_k][16 * tile + q] = acc[0];
      half_sums[half_k][16 * tile + q + 8] = acc[2];
    }
    BARRIER();
    if (tid < 32)
      block_h[tid] = hidden_of<T>(half_sums[0][tid] + half_sums[1][tid], half_sums[0][32 + tid] + half_sums[1][32 + tid],
                                  limit, route);
  } else
"""

_DOTS = dict(_STAGE_X, ROUTED_DOTS=_MMA_DOTS.replace("CHUNK_VALUES", str(CHUNK)))
_XB = "  alignas(16) SHARED uint32_t xb[D / 2];   // x as bf16 pairs, in order\n"


def _mma_kernel(plain: Kernel, parts: dict) -> Kernel:
    body = ex._gate_up_body(parts, dots=_DOTS)
    body = body.replace("  SHARED uint4 xs[D / 32 * XS];\n", "  SHARED uint4 xs[D / 32 * XS];\n" + _XB)
    checks = tuple(c for c in plain.checks if dict(c[2])["MODE"] == ex.MODE_IDS["mxfp4"])
    return Kernel(name=plain.name + "_mma", input_names=plain.input_names, output_names=plain.output_names,
                  body=body, header=plain.header + experts_prefill.FP4_PAIRS_HEADER, dialects=("cuda",), checks=checks)


GATE_UP_KERNEL = _mma_kernel(ex.GATE_UP_KERNEL, ex._GIVEN)
ROUTED_GATE_UP_KERNEL = _mma_kernel(ex.ROUTED_GATE_UP_KERNEL, ex._ROUTED)


def applies(x: mx.array, gate, act_quant: bool, integer: bool) -> bool:
    """Whether the gate/up launch takes its routed slots on tensor cores: CUDA, the switch, the
    routed experts mxfp4 in the float unit (not MXFP4_INT), x exact in bf16 (bf16 activations, or
    rounded to fp8), D in an even number of chunks, and x's two copies (fp32 for the shared
    expert's slot, bf16 pairs) and the halves' sums within the threadgroup memory."""
    D = x.shape[-1]
    return (backend() == "cuda" and bool(flags.get("kernel_moe_mma")) and isinstance(gate, ex.QuantizedMatrix)
            and gate.mode == "mxfp4" and gate.bits == 4 and gate.group_size == 32 and not integer
            and (x.dtype == mx.bfloat16 or act_quant) and D % (2 * CHUNK) == 0
            and ex.gate_up_shared_bytes(D, ex.X_STRIDE) + 2 * D + 2 * 64 * 4 <= shared_memory_limit("cuda"))
