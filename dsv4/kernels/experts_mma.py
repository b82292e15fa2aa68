"""The fused experts' gate/up and down launches with the mxfp4 routed experts on tensor cores
(CUDA; DSV4_KERNEL_MOE_MMA, off until a GPU shows it faster).

The portable launch (experts.py) decodes each fp4 code to fp32 and multiplies: ~4.2 instructions
a weight, which is what bounds it (an H100 at one token: 63-65 µs for 99.5 MB, 1.5 TB/s; an L2
prefetch of its rows made it slower, benchmarks/results/2026-12-07-0953-l2-prefetch.md). Here
the same threadgroup (a pair's 32 rows of gate and up, x copied once) makes its routed slot's
rows with mma.sync m16n8k16 in bf16, the codes decoded as the prefill's tensor-core launch
decodes them (experts_prefill.py: a pair of codes moved into bf16's fields in four instructions,
then times the group's power of two; exact), ~2.7 instructions a weight:

  - SIMD group w takes 16 rows (tile w % 4: gate rows 0-15, 16-31, up rows 0-15, 16-31) over half
    the input (w / 4), in chunks of 128 values: lane (q, t) loads group 4c + t of its rows q and
    q + 8 (16 bytes each), and mma step S of the chunk gives it values 32 t + 4 S .. + 3 (the k
    order is the lane's own; x is read in the same order);
  - a lane issues the loads of several chunks (mma_batch) before it decodes any: with one chunk
    a step, each SIMD group had 1 KB in flight and waited out every load (85 against the portable
    launch's 63 µs at one token on an H100, 2026-12-07);
  - x (fp8-rounded with act_quant, else the activations' bf16) is exact in bf16: the B side is
    x's values, the same for all 8 columns, so every column of D holds the rows' sums;
  - the two halves' sums are added in fp32, then the clamped SwiGLU, the router weight and the
    fp8 block of h as in the portable launch (`hidden_of`, the same epilogue).

The down launch does the same for 16 rows of each routed slot over the whole of its h (bf16,
already fp8-rounded by the gate/up launch). The products are exact and summed in fp32 in another
order: within the fp32 bound of the portable launch's sums. The shared expert (mxfp8 officially)
keeps rows_dot.
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

# A lane (q, t)'s rows q and q + 8 over chunks of the input (wl, sl at row q's group t), both
# launches' routed dots: a batch of chunks' loads issued before any is used, so that a SIMD group
# keeps U x 1 KB in flight (one chunk a step left it waiting on each load: 85 against the portable
# launch's 63 µs on an H100).
MMA_HEADER = experts_prefill.FP4_PAIRS_HEADER + r"""
// Chunks loaded together: the most of 4, 3, 2 that divides a SIMD group's chunks.
KFN constexpr int mma_batch(int chunks) { return chunks % 4 == 0 ? 4 : chunks % 3 == 0 ? 3 : chunks % 2 == 0 ? 2 : 1; }
template <int GROUPS, int U>
KFN void mma_rows_load(GLOBAL uint32_t* wl, GLOBAL uint8_t* sl, int c, uint32_t (&w)[U][2][4], int (&m)[U][2]) {
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < 2; ++r) {
      const uint4 u4 = LOAD_U4(wl + (size_t)8 * r * GROUPS * 4 + 16 * (c + u), 0);
      w[u][r][0] = u4.x; w[u][r][1] = u4.y; w[u][r][2] = u4.z; w[u][r][3] = u4.w;
      m[u][r] = (int)sl[(size_t)8 * r * GROUPS + 4 * (c + u)] - 1;
    }
}
// Their mma steps: step (i, s) of chunk c + u gives lane t values 32 t + 8 i + 4 s .. + 3 of the
// chunk (the k order is the lane's own; x's bf16 pairs xb are read in the same order).
template <bool HUGE, int U>
KFN void mma_rows_dots(float (&acc)[4], const uint32_t (&w)[U][2][4], const int (&m)[U][2], const uint32_t* xb, int c, int t) {
  for (int u = 0; u < U; ++u)
    for (int i = 0; i < 4; ++i) {
      const uint4 xv = *reinterpret_cast<const uint4*>(xb + 64 * (c + u) + 16 * t + 4 * i);
      const uint32_t b[2][2] = {{xv.x, xv.y}, {xv.z, xv.w}};
      for (int s = 0; s < 2; ++s) {
        uint32_t a[4];
        for (int r = 0; r < 2; ++r) {
          const uint32_t wi = w[u][r][i], w4 = wi << 4;
          a[r] = stream_scaled<HUGE>(stream_pair<1>(wi, w4, 2 * s), m[u][r]);
          a[2 + r] = stream_scaled<HUGE>(stream_pair<1>(wi, w4, 2 * s + 1), m[u][r]);
        }
        mma_16816_bf16(acc, a, b[s]);
      }
    }
}
// acc += rows q and q + 8 times the input over chunks c0 .. c0 + N - 1, loaded mma_batch(N) at a
// time; a batch with a scale code past 128 takes the second power of two (one path a SIMD group).
template <int GROUPS, int N>
KFN void mma_rows(float (&acc)[4], GLOBAL uint32_t* wl, GLOBAL uint8_t* sl, const uint32_t* xb, int c0, int t) {
  constexpr int U = mma_batch(N);
  for (int c = c0; c < c0 + N; c += U) {
    uint32_t w[U][2][4];
    int m[U][2];
    mma_rows_load<GROUPS, U>(wl, sl, c, w, m);
    bool huge = false;
    for (int u = 0; u < U; ++u) huge = huge || m[u][0] > 127 || m[u][1] > 127;
    if (simd_max_f(huge ? 1.0f : 0.0f) > 0.0f)
      mma_rows_dots<true, U>(acc, w, m, xb, c, t);
    else
      mma_rows_dots<false, U>(acc, w, m, xb, c, t);
  }
}
"""

_MMA_DOTS = r"""
  if (slot < K) {
    // SIMD group w: tile w % 4 (16 rows: gate 0-15, 16-31, up 0-15, 16-31), input half w / 4.
    SHARED float half_sums[2][64];
    const int tile = (int)warp & 3, half_k = (int)warp >> 2;
    const int q = (int)lane >> 2, t = (int)lane & 3;
    constexpr int GROUPS = D / 32;
    constexpr int HALF = D / CHUNK_VALUES / 2;   // chunks a SIMD group takes
    const size_t row = (size_t)expert * I + (int)group_y * 32 + 16 * (tile & 1) + q;   // and row + 8
    GLOBAL uint32_t* wl = (tile < 2 ? gate_w : up_w) + row * GROUPS * 4 + 4 * t;       // group t of chunk 0
    GLOBAL uint8_t* sl = (tile < 2 ? gate_s : up_s) + row * GROUPS + t;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_rows<GROUPS, HALF>(acc, wl, sl, xb, half_k * HALF, t);
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
                  body=body, header=plain.header + MMA_HEADER, dialects=("cuda",), checks=checks)


GATE_UP_KERNEL = _mma_kernel(ex.GATE_UP_KERNEL, ex._GIVEN)
ROUTED_GATE_UP_KERNEL = _mma_kernel(ex.ROUTED_GATE_UP_KERNEL, ex._ROUTED)


# The down launch: SIMD group s < K makes slot s's 16 rows of the threadgroup on tensor cores
# over the whole of its h (copied first into threadgroup memory as bf16 pairs, in order, which
# mma_rows_dots reads as the gate/up launch reads x); the shared expert's SIMD groups keep
# rows_dot at ROWS x LANES = DOWN_SHAPE (16 rows too). The slots' sum and the epilogue are the
# portable launch's.
DOWN_SHAPE = (4, 8)
_MMA_DOWN_DOTS = r"""
  // grid (32*(K+SPLITS), DO / 16, tokens): slot s < K on tensor cores, the shared expert's
  // SPLITS groups in rows_dot; then the threadgroup sums the slots in slot order.
  constexpr int RW = ROWS * 32 / LANES;   // 16: an mma's rows
  const int SPLITS = HS ? (int)group_threads / 32 - K : 0;
  const int t = group_z;
  const int row0 = (int)group_y * RW;
  const int slot = min((int)warp, K + HS - 1);
  GLOBAL T* hrow = h + ((size_t)t * (K + HS) + slot) * I;
  alignas(16) SHARED uint4 hs[K][I / 8];
  if (slot < K)
    for (int i = (int)lane; i < I / 8; i += 32) hs[slot][i] = LOAD_U4(hrow, i);
  BARRIER();
  SHARED float part[(K + MAX_SHARED_SPLITS) * RW];
  if (slot < K) {
    const int q = (int)lane >> 2, lt = (int)lane & 3;
    constexpr int GROUPS = I / 32;
    constexpr int CHUNKS = I / CHUNK_VALUES;
    const size_t row = (size_t)idx[t * K + slot] * DO + row0 + q;   // and row + 8
    GLOBAL uint32_t* wl = down_w + row * GROUPS * 4 + 4 * lt;
    GLOBAL uint8_t* sl = down_s + row * GROUPS + lt;
    const uint32_t* hb = reinterpret_cast<const uint32_t*>(hs[slot]);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_rows<GROUPS, CHUNKS>(acc, wl, sl, hb, 0, lt);
    // Each expert's output rounded to the activation dtype, as in the portable launch.
    if (lt == 0) {
      part[(int)warp * RW + q] = float(static_cast<T>(acc[0]));
      part[(int)warp * RW + q + 8] = float(static_cast<T>(acc[2]));
    }
  } else {
    float acc[ROWS], unused[ROWS];
    rows_dot<SMODE, SBITS, SGS, ROWS, LANES, I, 0, false>(hrow, sdown_w, sdown_s, sdown_b, sdown_w,
                                                          sdown_s, sdown_b, 0, row0, DO, acc, unused, lane,
                                                          (int)warp - K, SPLITS);
    if ((int)lane % LANES == 0)
      for (int r = 0; r < ROWS; ++r) part[(int)warp * RW + (int)lane / LANES * ROWS + r] = acc[r];
  }
""".replace("CHUNK_VALUES", str(CHUNK)).replace("MAX_SHARED_SPLITS", str(ex.MAX_SHARED_SPLITS))


def _down_checks():
    """The portable down launch's mxfp4 compile gates at DOWN_SHAPE."""
    shape = dict(zip(("ROWS", "LANES"), DOWN_SHAPE))
    return tuple((ins, outs, tuple((k, shape.get(k, v)) for k, v in tmpl))
                 for ins, outs, tmpl in ex.DOWN_KERNEL.checks if dict(tmpl)["MODE"] == ex.MODE_IDS["mxfp4"])


DOWN_KERNEL = Kernel(name=ex.DOWN_KERNEL.name + "_mma", input_names=ex.DOWN_KERNEL.input_names,
                     output_names=ex.DOWN_KERNEL.output_names, body=_MMA_DOWN_DOTS + ex._DOWN_SUM,
                     header=ex.DOWN_KERNEL.header + MMA_HEADER,
                     dialects=("cuda",), checks=_down_checks())


def down_applies(h: mx.array, down, I: int, DO: int, K: int) -> bool:
    """Whether the down launch takes its routed slots on tensor cores: CUDA, the switch, mxfp4
    routed experts, h in bf16 (exact: the gate/up launch rounds it), whole chunks of h and whole
    mma tiles of rows, and h's slots within the threadgroup memory."""
    return (backend() == "cuda" and bool(flags.get("kernel_moe_mma")) and isinstance(down, ex.QuantizedMatrix)
            and down.mode == "mxfp4" and down.bits == 4 and down.group_size == 32 and h.dtype == mx.bfloat16
            and I % CHUNK == 0 and DO % 16 == 0
            and K * I * 2 + (K + ex.MAX_SHARED_SPLITS) * 16 * 4 <= shared_memory_limit("cuda"))


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
