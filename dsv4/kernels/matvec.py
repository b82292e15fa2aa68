"""A dense quantized projection for a few tokens (decode, draft verification), with the fp8
rounding of its input fused (model-spec §11):

    y[t] = round_T(W q(x[t]))      q = qdq_fp8 per 32 values when act_quant, else identity

x is [..., K] with at most MAX_TOKENS rows, in bf16, fp16 or fp32 (T); W is [N, K], an
MLX-quantized matrix (`QuantizedMatrix`: mxfp8, mxfp4, affine with 2/3/4/8 bits, packed as
`mx.quantize` packs it, see experts.py); the matmul accumulates in fp32 and y is [..., N] in T.

One launch instead of two (the rounding, then MLX's quantized matmul): a threadgroup of WARPS
SIMD groups and one token holds the token's x in threadgroup memory, fp8-rounded once there
(experts.py's `qdq_fp8_32`, the gate/up kernel's layout), and each SIMD group runs
experts.py's `rows_dot` (lanes split the input in packs of 32, one pack of every row in
flight per lane). A decode matvec is bound by the bytes in flight, about N packs at a time,
so a small N splits K: with SPLIT > 1, SPLIT SIMD groups share each row, one slice of K/SPLIT
each (slice j of row r is row r*SPLIT + j of W seen as [N*SPLIT, K/SPLIT], so `rows_dot`
takes it as it is), and their partial sums are added in slice order through threadgroup
memory. A large N instead gives each SIMD group ROWS rows (fewer, longer threadgroups). Since
every threadgroup copies and rounds the whole x before its first load, fewer threadgroups
measured faster at every V4.1 shape: under DSV4_KERNEL_MATVEC_LONG_THREADGROUPS (CUDA's default)
only an N under 32 threadgroups' rows splits K (`split_limits`).

A grouped projection (GGUF blocks: V4.1's wo_a, 8 groups of heads each through its own block of
1024 rows) is one launch too: x [tokens, G, K], each threadgroup's rows in one group, whose x it
copies; with MLX's packs, gather_qmm does the same in one launch (attention.py), except for the
multi-token launch's 2-6 tokens.

With DSV4_KERNEL_MATVEC_TOKENS, 2-6 tokens take another launch, whose threadgroups hold every
token's x (a segment of K at a time) and decode each weight once for all of them: MLX's packs,
and GGUF blocks (grouped too), each lane decoding one unit of a row per segment.
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels.dialect import Kernel, backend, falls_back, shared_memory_limit
from dsv4.kernels import gguf_dot
from dsv4.kernels.experts import (_HEADER, MODE_IDS, X_HEADER, X_INTS, X_STRIDE, QuantizedMatrix,
                                  matrix_supported)
from dsv4.kernels.gguf_dot import GGUFMatrix
from dsv4.quant import qdq_fp8

MAX_TOKENS = 8
WARPS = 8
MAX_SPLIT = 4
IN_FLIGHT_ROWS = 2048   # ~16 SIMD groups on each of the H200's 132 SMs
LONG_THREADGROUPS = 32  # DSV4_KERNEL_MATVEC_LONG_THREADGROUPS: split K or shorten rows only below this many
DTYPES = (mx.bfloat16, mx.float16, mx.float32)

_BODY = r"""
  // grid (32 * warps, ceil(N * SPLIT / (warps * ROWS)), tokens); y is [tokens, N], x [tokens, K],
  // or with GROUPS > 1 [tokens, GROUPS, K], row n of W taking x's group n / (N / GROUPS) (a grouped
  // projection: a threadgroup's rows lie in one group). SPLIT > 1 needs ROWS == 1 and warps <= 32.
  const int N = (int)w_shape[0];
  const int t = group_z;
  const int tg_rows = (int)(group_threads / 32) / SPLIT * ROWS;
  const size_t x_row = GROUPS == 1 ? (size_t)t : (size_t)t * GROUPS + (size_t)((int)group_y * tg_rows / (N / GROUPS));
  // The token's x in fp32, fp8-rounded when ACTQ, once per threadgroup (XS uint4s per pack).
  SHARED uint4 xs[K / 32 * XS];
  SHARED float part[32];   // SPLIT > 1: each SIMD group's partial sum
  for (int p = (int)tid; p < K / 32; p += (int)group_threads) {
    float v[32];
    for (int i = 0; i < 32; ++i) v[i] = float(x[x_row * K + 32 * p + i]);
    const float x_scale = ACTQ ? qdq_fp8_32(v) : 1.0f;
    store_x_pack<XS>(xs, p, v, x_scale);   // XS == X_INTS (GGUF integer units): as limbs
  }
  BARRIER();
  float acc[ROWS], unused[ROWS];
  if (SPLIT == 1) {
    const int row0 = (int)group_y * tg_rows + (int)warp * ROWS;
    if (row0 < N) {
      rows_dot<MODE, BITS, GS, ROWS, 32, K, XS, false>(xs, w, s, b, w, s, b, 0, row0, N, acc, unused, lane);
      if (lane == 0) {
        for (int r = 0; r < ROWS && row0 + r < N; ++r) PUT_ROW((size_t)t * N + row0 + r, acc[r]);
      }
    }
  } else {
    constexpr int KS = K / SPLIT;   // slice length; KS % 32 == 0 and KS % GS == 0
    const int j = (int)warp % SPLIT;
    const int row = min((int)group_y * tg_rows + (int)warp / SPLIT, N - 1);
    rows_dot<MODE, BITS, GS, 1, 32, KS, XS, false>(xs + j * (KS / 32) * XS, w, s, b, w, s, b, 0,
                                                   row * SPLIT + j, N * SPLIT, acc, unused, lane);
    if (lane == 0) part[warp] = acc[0];
    BARRIER();
    const int out_row = (int)group_y * tg_rows + (int)lane;
    if (warp == 0 && (int)lane < tg_rows && out_row < N) {
      float v = 0.0f;
      for (int i = 0; i < SPLIT; ++i) v += part[lane * SPLIT + i];
      PUT_ROW((size_t)t * N + out_row, v);
    }
  }
"""


def _stored(body: str, store: str) -> str:
    """The body with each row's sum v at index i stored as `store` says (a format of i and v)."""
    for i, v in (("(size_t)t * N + row0 + r", "acc[r]"), ("(size_t)t * N + out_row", "v")):
        body = body.replace(f"PUT_ROW({i}, {v})", store.format(i=i, v=v))
    assert "PUT_ROW" not in body
    return body


_PLAIN_BODY = _stored(_BODY, "y[{i}] = static_cast<T>({v})")


def _checks():
    """Instantiations for the offline compile gates: (x dtype, matrix layout, split, rows, K, ACTQ)."""
    u32, u8, bf16, f32 = mx.uint32, mx.uint8, mx.bfloat16, mx.float32
    out = []
    for xt, (mode, bits, gs, st, bt), split, rows, k, actq in [
            (bf16, ("mxfp8", 8, 32, u8, u32), 1, 2, 5120, True),
            (bf16, ("mxfp8", 8, 32, u8, u32), 4, 1, 5120, True),
            (f32, ("mxfp4", 4, 32, u8, u32), 1, 4, 1280, False),
            (bf16, ("affine", 3, 64, bf16, bf16), 2, 1, 512, True),
            (f32, ("affine", 8, 32, f32, f32), 1, 1, 8192, True)]:
        template = (("T", xt), ("MODE", MODE_IDS[mode]), ("BITS", bits), ("GS", gs), ("SPLIT", split),
                    ("ROWS", rows), ("K", k), ("XS", X_STRIDE), ("ACTQ", actq), ("GROUPS", 1))
        out.append(((xt, u32, st, bt), (xt,), template))
    return tuple(out)


MATVEC_KERNEL = Kernel(name="dsv4_quantized_matvec", input_names=("x", "w", "s", "b"),
                       output_names=("y",), body=_PLAIN_BODY, header=_HEADER, checks=_checks())


def _gguf_checks():
    """GGUF dense projections: ds4's Q8_0 (split and rows; read in pairs, and wide, too), the Q4_K
    of its q4 attention option, an IQ2_XXS in the wide unit, and both with fp16-subnormal codes
    (DSV4_KERNEL_GGUF_HALVES); Q8_0 by int8s2 (DSV4_KERNEL_GGUF_Q8_HSUB), also as V4.1's grouped
    wo_a (8 groups of 1024 rows over 4096 inputs); Q8_0, IQ2_XXS and Q4_K in the integer units over
    x's limbs (DSV4_KERNEL_GGUF_DP4A), split and grouped too."""
    out = []
    modes = dict(gguf_dot.GGUF_MODE_IDS, Q8_0_PAIRS=gguf_dot.Q8_0_PAIRS, Q8_0_HSUB=gguf_dot.Q8_0_HSUB,
                 **{f"{t}_WIDE": m for t, m in gguf_dot.WIDE_MODE_IDS.items()},
                 **{f"{t}_HALVES": m for t, m in gguf_dot.HALVES_MODE_IDS.items()},
                 **{f"{t}_INT": m for t, m in gguf_dot.INT_MODE_IDS.items()})
    for qtype, split, rows, k, groups in (("Q8_0", 1, 2, 4096, 1), ("Q8_0", 4, 1, 1024, 1), ("Q4_K", 2, 1, 4096, 1),
                                          ("Q8_0_PAIRS", 1, 2, 4096, 1), ("Q8_0_WIDE", 1, 2, 4096, 1),
                                          ("Q8_0_WIDE", 4, 1, 1024, 1), ("IQ2_XXS_WIDE", 2, 1, 5120, 1),
                                          ("Q4_K_HALVES", 2, 1, 4096, 1), ("IQ2_XXS_HALVES", 2, 1, 5120, 1),
                                          ("Q8_0_HSUB", 1, 2, 4096, 1), ("Q8_0_HSUB", 1, 4, 4096, 8),
                                          ("Q8_0_INT", 1, 2, 4096, 1), ("Q8_0_INT", 4, 1, 1024, 1),
                                          ("Q8_0_INT", 1, 4, 4096, 8), ("IQ2_XXS_INT", 2, 1, 5120, 1),
                                          ("Q4_K_INT", 2, 1, 4096, 1)):
        xs = X_INTS if qtype.endswith("_INT") else X_STRIDE
        template = (("T", mx.bfloat16), ("MODE", modes[qtype]), ("BITS", 0), ("GS", 0), ("SPLIT", split),
                    ("ROWS", rows), ("K", k), ("XS", xs), ("ACTQ", True), ("GROUPS", groups))
        out.append(((mx.bfloat16, mx.uint8, mx.uint32, mx.uint32), (mx.bfloat16,), template))
    return tuple(out)


# The multi-token launches' copy of x: packs seg .. seg + SEG - 1 of each of TOKS tokens (token t's
# row t * groups + group of K values), fp8-rounded when ACTQ, pack p of token t at t * SEG + p - seg.
_SEGMENT_HEADER = r"""
template <int XS, int TOKS, int SEG, int K, bool ROUND, typename PS, typename PX>
KFN void stage_segment(PS xs, PX x, int seg, int groups, size_t group, uint32_t tid, uint32_t threads) {
  for (int i = (int)tid; i < TOKS * SEG; i += (int)threads) {
    const int t = i / SEG, p = seg + i % SEG;
    if (p < K / 32) {
      float v[32];
      for (int j = 0; j < 32; ++j) v[j] = float(x[((size_t)t * groups + group) * K + 32 * p + j]);
      const float s = ROUND ? qdq_fp8_32(v) : 1.0f;
      store_x_pack<XS>(xs, i, v, s);
    }
  }
}
"""


# DSV4_KERNEL_MATVEC_TOKENS: 2..MAX_TOKS tokens (a DSpark verify, a batch of sessions) in one pass
# over MLX's packs. The body above makes a threadgroup per token, which decodes every weight once a
# token: at eight tokens the H200 measured ~4x one token's time with the weights found in L2.
MAX_TOKS = 6          # x's segment for 6 tokens is 27 KB of threadgroup memory (Metal allows 32)
TOKENS_SEGMENT = 32   # packs of x a segment (one a lane)
TOKENS_ROWS2_MIN = 4096   # rows from which a SIMD group makes 2 rows (fewer threadgroups), else 1

_TOKENS_BODY = r"""
  // grid (32 * warps, ceil(N / (warps * ROWS)), 1); y is [TOKS, N], x [TOKS, K] or [TOKS, GROUPS, K]
  // (a grouped projection: a threadgroup's rows lie in one group, whose x it copies). A lane decodes
  // the pack of each of its SIMD group's ROWS rows once and multiplies it by every token's x: packs
  // p = lane + 32 i of a row, in order, the one-token body's sums at SPLIT 1. x comes into
  // threadgroup memory SEG packs at a time for all the tokens, fp8-rounded per pack when ACTQ.
  constexpr int SEG = TOKENS_SEGMENT;
  constexpr int PACKS = K / 32;
  constexpr int WORDS_PER_ROW = PACKS * BITS;
  constexpr int SCALES_PER_ROW = K / GS;
  const int N = (int)w_shape[0];
  const int row0 = ((int)group_y * (int)(group_threads / 32) + (int)warp) * ROWS;
  const size_t group = GROUPS == 1 ? 0 : (size_t)((int)group_y * (int)(group_threads / 32) * ROWS / (N / GROUPS));
  SHARED uint4 xs[TOKS * SEG * XS];
  float acc[ROWS][TOKS];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TOKS; ++t) acc[r][t] = 0.0f;
  for (int seg = 0; seg < PACKS; seg += SEG) {
    BARRIER();   // the last segment read by every SIMD group
    stage_segment<XS, TOKS, SEG, K, ACTQ>(xs, x, seg, GROUPS, group, tid, group_threads);
    BARRIER();
    const int p = seg + (int)lane;
    if (p >= PACKS) continue;
    uint32_t words[ROWS][BITS];
    float scale[ROWS], bias[ROWS] = {};
    for (int r = 0; r < ROWS; ++r) {
      const size_t row = (size_t)min(row0 + r, N - 1);
      load_pack<MODE, BITS, GS>(w + row * WORDS_PER_ROW, s + row * SCALES_PER_ROW, b + row * SCALES_PER_ROW, p,
                                words[r], &scale[r], &bias[r]);
    }
    float d[ROWS][TOKS], x_sum[TOKS];
    for (int t = 0; t < TOKS; ++t) {
      x_sum[t] = 0.0f;
      for (int r = 0; r < ROWS; ++r) d[r][t] = 0.0f;
    }
    for (int c = 0; c < 4; ++c) {
      float v[ROWS][8];
      for (int r = 0; r < ROWS; ++r) unpack8<MODE, BITS>(words[r], c, v[r]);
      for (int t = 0; t < TOKS; ++t) {
        float xv[8];
        XChunk<XS>::load(xs, t * SEG + (int)lane, c, xv);
        if (MODE == 0)
          for (int i = 0; i < 8; ++i) x_sum[t] += xv[i];
        for (int r = 0; r < ROWS; ++r)
          for (int i = 0; i < 8; ++i) d[r][t] += v[r][i] * xv[i];
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int t = 0; t < TOKS; ++t)
        acc[r][t] += MODE == 0 ? scale[r] * d[r][t] + bias[r] * x_sum[t] : scale[r] * d[r][t];
  }
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TOKS; ++t) acc[r][t] = simd_sum_f(acc[r][t]);
  if (lane == 0)
    for (int r = 0; r < ROWS && row0 + r < N; ++r)
      for (int t = 0; t < TOKS; ++t) y[(size_t)t * N + row0 + r] = static_cast<T>(acc[r][t]);
""".replace("TOKENS_SEGMENT", str(TOKENS_SEGMENT))


def _tokens_checks():
    """The multi-token launch at V4.1's dense shapes: mxfp8 over 5120 and 1280 inputs, mxfp4 (the
    draft stages' experts' layout family), 3-bit affine (words straddling packs), and the grouped
    wo_a (8 groups of 1024 rows over 4096 inputs, without the input's rounding)."""
    u32, u8, bf16, f32 = mx.uint32, mx.uint8, mx.bfloat16, mx.float32
    out = []
    for xt, (mode, bits, gs, st, bt), rows, k, toks, groups in [
            (bf16, ("mxfp8", 8, 32, u8, u32), 2, 5120, MAX_TOKS, 1), (bf16, ("mxfp8", 8, 32, u8, u32), 1, 1280, 4, 1),
            (f32, ("mxfp4", 4, 32, u8, u32), 2, 8192, 2, 1), (bf16, ("affine", 3, 64, bf16, bf16), 1, 512, 3, 1),
            (bf16, ("mxfp8", 8, 32, u8, u32), 2, 4096, 4, 8)]:
        template = (("T", xt), ("MODE", MODE_IDS[mode]), ("BITS", bits), ("GS", gs), ("ROWS", rows), ("K", k),
                    ("XS", X_STRIDE), ("ACTQ", groups == 1), ("TOKS", toks), ("GROUPS", groups))
        out.append(((xt, u32, st, bt), (xt,), template))
    return tuple(out)


TOKENS_MATVEC_KERNEL = Kernel(name="dsv4_quantized_matvec_tokens", input_names=("x", "w", "s", "b"),
                              output_names=("y",), body=_TOKENS_BODY, header=_HEADER + _SEGMENT_HEADER,
                              checks=_tokens_checks())


def tokens_rows(n: int, lanes: int = 32) -> int:
    """Rows a lane group of `lanes` makes in the multi-token launch (a SIMD group has 32 / lanes)."""
    return 2 if n >= TOKENS_ROWS2_MIN and lanes == 32 else 1


def tokens_lanes(q, integer: bool = False) -> int:
    """Lanes a row takes in the multi-token launch: a lane a unit of the segment (MLX's packs: 32)."""
    return TOKENS_SEGMENT * 32 // q.unit_values(integer) if isinstance(q, GGUFMatrix) else 32


def tokens_applies(q, tokens: int, groups: int = 1, integer: bool = False) -> bool:
    """Whether `quantized_matvec` takes the multi-token launch: DSV4_KERNEL_MATVEC_TOKENS, 2..MAX_TOKS
    tokens whose segment of x fits the threadgroup memory (GGUF blocks' `integer` units: as limbs)
    and, grouped, whose threadgroups each lie in a group."""
    if not (flags.get("kernel_matvec_tokens") and 2 <= tokens <= MAX_TOKS):
        return False
    lanes, n = tokens_lanes(q, integer), q.out_features
    return (tokens * TOKENS_SEGMENT * (X_INTS if integer else X_STRIDE) * 16 <= shared_memory_limit(backend())
            and grouped_fits(n, groups, 1, tokens_rows(n, lanes) * 32 // lanes))


# The multi-token launch over rows of GGUF blocks: in each segment, each of a row's LANES lanes
# decodes its unit once and multiplies it by every token's x (gguf_dot.py's TokensDot).
_GGUF_TOKENS_BODY = r"""
  // grid (32 * warps, ceil(N / (warps * RW)), 1) with RW = ROWS * 32 / LANES rows a SIMD group; y
  // is [TOKS, N], x [TOKS, K] or [TOKS, GROUPS, K] (a grouped projection: a threadgroup's rows lie
  // in one group, whose x it copies).
  constexpr int SEG = TOKENS_SEGMENT;
  constexpr int PACKS = K / 32;
  static_assert(LANES * GgufUnit<MODE>::VALUES == SEG * 32, "a lane a unit of the segment");
  const int N = (int)w_shape[0];
  const int tg_rows = (int)(group_threads / 32) * ROWS * (32 / LANES);
  const int rows0 = (int)group_y * tg_rows + ((int)warp * (32 / LANES) + (int)lane / LANES) * ROWS;
  const size_t group = GROUPS == 1 ? 0 : (size_t)((int)group_y * tg_rows / (N / GROUPS));
  SHARED uint4 xs[TOKS * SEG * XS];
  float acc[ROWS * TOKS];
  for (int i = 0; i < ROWS * TOKS; ++i) acc[i] = 0.0f;
  for (int seg = 0; seg < PACKS; seg += SEG) {
    BARRIER();   // the last segment read by every SIMD group
    stage_segment<XS, TOKS, SEG, K, ACTQ>(xs, x, seg, GROUPS, group, tid, group_threads);   // XS == X_INTS: limbs
    BARRIER();
    TokensDot<XS == X_INTS>::template run<MODE, ROWS, SEG, K, XS, TOKS>(xs, w, s, seg, rows0, N, (int)lane % LANES, acc);
  }
  for (int i = 0; i < ROWS * TOKS; ++i) acc[i] = lanes_sum<LANES>(acc[i]);
  if ((int)lane % LANES == 0)
    for (int r = 0; r < ROWS && rows0 + r < N; ++r)
      for (int t = 0; t < TOKS; ++t) y[(size_t)t * N + rows0 + r] = static_cast<T>(acc[r * TOKS + t]);
""".replace("TOKENS_SEGMENT", str(TOKENS_SEGMENT))


def _gguf_tokens_checks():
    """The GGUF multi-token launch: ds4's Q8_0 projections (wide, by int8s2, and in the integer
    units, 6 tokens as CUDA allows and 4 as Metal does), V4.1's grouped wo_a, Q4_K and Q2_K units
    over 16 and 8 lanes a row, and IQ2_XXS; IQ2_XXS and Q4_K in the integer units too."""
    out = []
    ids, halves, ints = gguf_dot.GGUF_MODE_IDS, gguf_dot.HALVES_MODE_IDS, gguf_dot.INT_MODE_IDS
    for qtype, mode, rows, k, toks, groups in (
            ("Q8_0", ids["Q8_0"], 1, 5120, 4, 1), ("Q8_0", gguf_dot.Q8_0_HSUB, 2, 4096, MAX_TOKS, 1),
            ("Q8_0", gguf_dot.Q8_0_HSUB, 2, 4096, 4, 8), ("Q4_K", ids["Q4_K"], 1, 4096, 3, 1),
            ("Q2_K", halves["Q2_K"], 1, 2304, 2, 1), ("IQ2_XXS", halves["IQ2_XXS"], 1, 5120, 5, 1),
            ("Q8_0", ints["Q8_0"], 2, 4096, 4, 8), ("IQ2_XXS", ints["IQ2_XXS"], 1, 5120, 4, 1),
            ("Q4_K", ints["Q4_K"], 1, 4096, 3, 1)):
        template = (("T", mx.bfloat16), ("MODE", mode), ("BITS", 0), ("GS", 0), ("ROWS", rows),
                    ("LANES", TOKENS_SEGMENT * 32 // gguf_dot.UNIT_VALUES[qtype]), ("K", k),
                    ("XS", X_INTS if mode in ints.values() else X_STRIDE), ("ACTQ", True), ("TOKS", toks),
                    ("GROUPS", groups))
        out.append(((mx.bfloat16, mx.uint8, mx.uint32, mx.uint32), (mx.bfloat16,), template))
    return tuple(out)


GGUF_TOKENS_MATVEC_KERNEL = Kernel(name="dsv4_gguf_matvec_tokens", input_names=("x", "w", "s", "b"),
                                   output_names=("y",), body=_GGUF_TOKENS_BODY,
                                   header=X_HEADER + _SEGMENT_HEADER + gguf_dot.HEADER + gguf_dot.TOKENS,
                                   checks=_gguf_tokens_checks())


# The one-token body over rows of GGUF blocks (gguf_dot.py's rows_dot).
GGUF_MATVEC_KERNEL = Kernel(name="dsv4_gguf_matvec", input_names=("x", "w", "s", "b"),
                            output_names=("y",), body=_PLAIN_BODY, header=X_HEADER + gguf_dot.HEADER,
                            checks=_gguf_checks())


def work_split(n: int, k: int, group_size: int, groups: int = 1) -> tuple[int, int]:
    """(SPLIT, ROWS) for an [n, k] matrix: SIMD groups per row when n is small, so that about
    `in_flight` rows' packs are in flight; rows per SIMD group when n is large, while that still
    leaves `floor` threadgroups (split_limits). With `groups` > 1 (a grouped projection) a
    threadgroup's rows must lie in one group: `grouped_fits` says whether the split keeps them so."""
    in_flight, floor = split_limits()
    fits = lambda split, rows: split_fits(n, k, group_size, groups, split, rows)
    split = MAX_SPLIT
    while split > 1 and (n * split // 2 >= in_flight or not fits(split, 1)):
        split //= 2
    if split > 1:
        return split, 1
    for rows in (4, 2):
        if n >= floor * WARPS * rows and fits(1, rows):
            return 1, rows
    return 1, 1


def split_limits() -> tuple[int, int]:
    """(rows in flight that stop splitting K, threadgroups that stop more rows a SIMD group):
    DSV4_KERNEL_MATVEC_LONG_THREADGROUPS's fewer, longer threadgroups (each copies and rounds
    the whole x before its first load, so more of them cost more than their loads gain:
    benchmarks/results/2026-12-06-1429-matvec-split.md), else the H200's first guess."""
    if flags.switch("kernel_matvec_long_threadgroups", backend() == "cuda"):
        return LONG_THREADGROUPS * WARPS, LONG_THREADGROUPS
    return IN_FLIGHT_ROWS, 128


def split_fits(n: int, k: int, group_size: int, groups: int, split: int, rows: int) -> bool:
    """Whether the one-token launch can run an [n, k] matrix as (SPLIT, ROWS) (benchmarks/
    matvec_split.py tries each): a split row needs ROWS 1 and whole packs a slice."""
    return (split in (1, 2, 4) and rows in (1, 2, 4) and (split == 1 or rows == 1)
            and k % (split * max(32, group_size)) == 0 and grouped_fits(n, groups, split, rows))


def grouped_fits(n: int, groups: int, split: int, rows: int) -> bool:
    """Whether a threadgroup's rows (WARPS / split * rows) lie in one of `groups` equal groups of n rows."""
    return groups == 1 or (n % groups == 0 and (n // groups) % (WARPS // split * rows) == 0)


def kernel_supports(x: mx.array, q: QuantizedMatrix, groups: int = 1) -> bool:
    """Whether `quantized_matvec` handles (x, q, groups) on this device: a GPU backend, 1-8 tokens
    of a float dtype, a single [N, K] matrix in a layout the decoder knows (grouped: GGUF blocks,
    N in `groups` groups that whole threadgroups fill; MLX's packs only through the multi-token
    launch), x's copy within the threadgroup memory."""
    if backend() is None or x.ndim < (2 if groups > 1 else 1) or x.dtype not in DTYPES:
        return False
    K = x.shape[-1]
    tokens = x.size // (K * groups) if K else 0
    N = q.out_features
    grouped = groups == 1 or x.shape[-2] == groups and (
        grouped_fits(N, groups, *work_split(N, K, q.block_values, groups)) if isinstance(q, GGUFMatrix)
        else tokens_applies(q, tokens, groups))
    return (1 <= tokens <= MAX_TOKENS and K % 32 == 0 and q.weight.ndim == 2
            and q.in_features == K and matrix_supported(q) and grouped
            and K // 32 * (X_INTS if isinstance(q, GGUFMatrix) and q.integer else X_STRIDE) * 16 + 4 * 32
            <= shared_memory_limit(backend()))   # x's copy + partial sums


def matvec_reference(x: mx.array, q, act_quant: bool, groups: int = 1, work=None) -> mx.array:
    """Plain MLX: the quantized matmul on the (fp8-rounded) input in fp32, so that it
    accumulates in fp32 on every backend, rounded to x's dtype (as in experts_reference);
    GGUF blocks decoded exactly, then a fp32 matmul. With `groups` G > 1 (GGUF blocks), x is
    [..., G, K] and group j meets W's rows j N/G .. (j+1) N/G - 1: y [..., N] (a grouped projection).
    `work` (the kernel's launch shape) changes nothing here."""
    xin = (qdq_fp8(x) if act_quant else x).astype(mx.float32)
    if groups > 1:
        w = q.dequantized() if isinstance(q, GGUFMatrix) else mx.dequantize(
            q.weight, q.scales, q.biases, dtype=mx.float32, **q.kwargs())
        y = xin[..., None, :] @ w.reshape(groups, -1, w.shape[-1]).swapaxes(-1, -2)   # [..., G, 1, N/G]
        return y.reshape(*x.shape[:-2], -1).astype(x.dtype)
    if isinstance(q, GGUFMatrix):
        return (xin @ q.dequantized().T).astype(x.dtype)
    y = mx.quantized_matmul(xin, q.weight, q.scales, q.biases, transpose=True, **q.kwargs())
    return y.astype(x.dtype)


@falls_back(matvec_reference, "kernel_matvec")
def quantized_matvec(x: mx.array, q: QuantizedMatrix, act_quant: bool, groups: int = 1,
                     work: tuple[int, int] | None = None) -> mx.array:
    """x [..., K] (at most MAX_TOKENS rows), or [..., G, K] with `groups` G -> y [..., N] in x's
    dtype, one launch; the same contract as `matvec_reference`. Call only where
    `kernel_supports(x, q, groups)`. `work`: the one-token launch's (SPLIT, ROWS) where
    `split_fits` (benchmarks), instead of `work_split`'s."""
    K, N = x.shape[-1], q.out_features
    tokens = x.size // (K * groups)
    lead = x.shape[:-2] if groups > 1 else x.shape[:-1]
    gguf = isinstance(q, GGUFMatrix)
    integer = gguf and bool(act_quant) and q.integer   # gguf_dot's integer units over x's limbs
    xs = X_INTS if integer else X_STRIDE
    layout = q.template(integer=True) if integer else q.template()
    if tokens_applies(q, tokens, groups, integer):
        lanes = tokens_lanes(q, integer)
        rows = tokens_rows(N, lanes)
        template = [("T", x.dtype)] + layout + [
            ("ROWS", rows), ("K", K), ("XS", xs), ("ACTQ", bool(act_quant)), ("TOKS", tokens), ("GROUPS", groups)]
        if gguf:
            template.append(("LANES", lanes))
        (y,) = (GGUF_TOKENS_MATVEC_KERNEL if gguf else TOKENS_MATVEC_KERNEL)(
            inputs=[x] + q.operands(), output_shapes=[(*lead, N)], output_dtypes=[x.dtype],
            grid=(32 * WARPS, math.ceil(N / (WARPS * rows * 32 // lanes)), 1), threadgroup=(32 * WARPS, 1, 1),
            template=template)
        return y
    split, rows = work or work_split(N, K, q.block_values, groups)
    (y,) = (GGUF_MATVEC_KERNEL if gguf else MATVEC_KERNEL)(
        inputs=[x] + q.operands(), output_shapes=[(*lead, N)], output_dtypes=[x.dtype],
        grid=(32 * WARPS, math.ceil(N * split / (WARPS * rows)), tokens), threadgroup=(32 * WARPS, 1, 1),
        template=[("T", x.dtype)] + layout + [
            ("SPLIT", split), ("ROWS", rows), ("K", K), ("XS", xs),
            ("ACTQ", bool(act_quant)), ("GROUPS", groups)])
    return y
