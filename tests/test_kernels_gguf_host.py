"""The GGUF-block decode kernels (gguf_dot.py's rows_dot under the matvec and fused-experts
bodies) run on the host, CPU, in CI: compiled with clang under the threadgroup emulator of
test_kernels_matvec (a thread per lane, a barrier of fibers for BARRIER and the SIMD exchanges) at
the dispatchers' launch shapes, on random GGUF blocks, against the plain-MLX references
(exact decoding as gguf-py's, then fp32 matmuls) with the bounds of the MLX-pack kernels'
tests. This checks the unit decoding (nibble, bit-plane and grid layouts, sub-block scales
and mins, unaligned 34- and 66-byte blocks) and the indexing of lanes over units."""

import subprocess
from unittest import mock

import numpy as np
import pytest

import mlx.core as mx

from dsv4 import flags, gguf_blocks
from dsv4.kernels import experts as ex
from dsv4.kernels import gguf_dot
from dsv4.kernels import matvec as mv
from dsv4.kernels.gguf_dot import GGUFMatrix
from dsv4.quant import qdq_fp8
from dsv4.testing import gguf_block_weight
from tests.test_kernels_decode_host import build_host
from tests.test_kernels_experts import check_down, check_hidden, hidden_expected, quantized
from tests.test_kernels_experts_host import BF16, bf16_bits, from_bf16_bits
from tests.test_kernels_matvec import EMULATOR

def gguf_matrix(rng, shape, qtype) -> GGUFMatrix:
    """Random valid blocks of `qtype` for a weight of `shape` [..., out, in]."""
    return GGUFMatrix(mx.array(gguf_block_weight(rng, shape, qtype)), qtype)


def matrix_bytes(m: GGUFMatrix | None, like: GGUFMatrix, rows: int) -> bytes:
    """weight bytes, tables (IQ2_XXS; 8 zero words otherwise) and a placeholder bias, as read."""
    if m is None:
        return np.zeros(rows * gguf_blocks.row_bytes(like.qtype, like.in_features), np.uint8).tobytes() \
            + np.zeros(16, np.uint32).tobytes()
    tables, bias = (np.array(a) for a in m.operands()[1:])
    return np.array(m.weight).tobytes() + np.resize(tables, gguf_dot.IQ2_TABLE_WORDS if m.qtype == "IQ2_XXS" else 8).tobytes() \
        + bias.tobytes()


# The Metal/CUDA vector types the GGUF header uses beyond the host prelude's, and LOAD_U4 checked
# against the weight buffers and tables (Matrix registers them): a 16-byte load at or after a buffer's start
# must start before its end (it holds one of its bytes, so on a GPU it stays in the buffer's
# pages); the bytes it reads past the end come back as zeros.
HOST_TYPES = r"""
struct uint2 { uint32_t x, y; };
std::vector<std::pair<const uint8_t*, const uint8_t*>> weight_buffers;
inline uint4 checked_u4(const void* p, size_t i) {
  const uint8_t* a = (const uint8_t*)p + 16 * i;
  size_t n = 16;
  bool inside = false, just_past = false;
  for (const auto& [begin, end] : weight_buffers) {
    if (a >= begin && a < end) { inside = true; n = std::min<size_t>(16, end - a); }
    just_past |= a >= end && a < end + 4096;
  }
  if (just_past && !inside) { std::fprintf(stderr, "a 16-byte load past a weight buffer\n"); std::abort(); }
  uint4 q{0, 0, 0, 0};
  std::memcpy(&q, a, n);
  return q;
}
#undef LOAD_U4
#define LOAD_U4(p, i) checked_u4(p, i)
"""

# A matrix on stdin: its row bytes (qtype a GGUF_MODE_IDS value), tables and bias placeholder.
READ_MATRIX = f"constexpr size_t IQ2_TABLE_WORDS = {gguf_dot.IQ2_TABLE_WORDS};\n" + r"""
inline size_t row_bytes(int qtype, int n_in) {   // (mode ids: 14 Q8_0 pairs, 20-23 wide, 21 Q8_0 hsub, 24-27 halves, 28-31 integer)
  return qtype == 10 || qtype == 14 || qtype == 20 || qtype == 21 || qtype == 29 ? n_in / 32 * 34
       : qtype == 11 || qtype == 27 || qtype == 30 ? n_in / 256 * 144
       : qtype == 12 || qtype == 22 || qtype == 26 || qtype == 31 ? n_in / 256 * 84 : n_in / 256 * 66;
}
struct Matrix {
  std::vector<uint8_t> w; std::vector<uint32_t> tables, bias;
  Matrix(size_t rows, int qtype, int n_in) : w(rows * row_bytes(qtype, n_in)), tables(qtype == 13 || qtype == 23 || qtype == 24 || qtype == 28 ? IQ2_TABLE_WORDS : 8), bias(8) {
    read(w); read(tables); read(bias);
    weight_buffers.emplace_back(w.data(), w.data() + w.size());
    weight_buffers.emplace_back((const uint8_t*)tables.data(), (const uint8_t*)(tables.data() + tables.size()));
  }
};
"""

GATE_UP_MAIN = r"""
void body(const T* x, const int* idx, const float* route_w, const float* params,
          const uint8_t* gate_w, const uint32_t* gate_s, const uint32_t* gate_b,
          const uint8_t* up_w, const uint32_t* up_s, const uint32_t* up_b,
          const uint8_t* sgate_w, const uint32_t* sgate_s, const uint32_t* sgate_b,
          const uint8_t* sup_w, const uint32_t* sup_s, const uint32_t* sup_b, HT* h,
          uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int tokens = read_int(), experts = read_int();
  std::vector<T> x(tokens * D);
  std::vector<HT> h((size_t)tokens * (K + HS) * H_ROW, H_UNSET);
  std::vector<int> idx(tokens * K);
  std::vector<float> route_w(tokens * K), params(1);
  read(x); read(idx); read(route_w); read(params);
  Matrix g((size_t)experts * I, MODE, D), u((size_t)experts * I, MODE, D), sg(I, SMODE, D), su(I, SMODE, D);
  constexpr int RW = ROWS * 32 / LANES;
  launch(32 * 32 / RW, I / 32, tokens * (K + HS), [&](int t, int gy, int z, int threads) {
    body(x.data(), idx.data(), route_w.data(), params.data(), g.w.data(), g.tables.data(), g.bias.data(),
         u.w.data(), u.tables.data(), u.bias.data(), sg.w.data(), sg.tables.data(), sg.bias.data(),
         su.w.data(), su.tables.data(), su.bias.data(), h.data(), t, gy, z, threads);
  });
  std::fwrite(h.data(), sizeof(HT), h.size(), stdout);
  return 0;
}
"""

DOWN_MAIN = r"""
void body(const HT* h, const int* idx, const uint8_t* down_w, const uint32_t* down_s, const uint32_t* down_b,
          const uint8_t* sdown_w, const uint32_t* sdown_s, const uint32_t* sdown_b, const T* residual,
          const float* post, const float* comb, T* y,
          uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int tokens = read_int(), experts = read_int();
  std::vector<HT> h((size_t)tokens * (K + HS) * H_ROW);
  std::vector<T> y((size_t)tokens * DO, T(NAN));
  std::vector<int> idx(tokens * K);
  read(h); read(idx);
  Matrix d((size_t)experts * DO, MODE, I), sd(DO, SMODE, I);
  constexpr int RW = ROWS * 32 / LANES;
  launch(32 * GROUPS, (DO + RW - 1) / RW, tokens, [&](int t, int gy, int z, int threads) {
    body(h.data(), idx.data(), d.w.data(), d.tables.data(), d.bias.data(), sd.w.data(), sd.tables.data(),
         sd.bias.data(), nullptr, nullptr, nullptr, y.data(), t, gy, z, threads);
  });
  std::fwrite(y.data(), 2, y.size(), stdout);
  return 0;
}
"""

MATVEC_MAIN = r"""
void body(const float* x, const uint8_t* w, Shape2 w_shape, const uint32_t* s, const uint32_t* b, float* y,
          uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  using T = float;
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int n = read_int(), tokens = read_int();
  std::vector<float> x(tokens * GROUPS * K), y(tokens * n, NAN);
  read(x);
  Matrix m(n, MODE, K);
  launch(32 * WARPS, (n * SPLIT + WARPS * ROWS - 1) / (WARPS * ROWS), tokens, [&](int t, int g, int z, int threads) {
    body(x.data(), m.w.data(), Shape2{{n, 0}}, m.tables.data(), m.bias.data(), y.data(), t, g, z, threads);
  });
  std::fwrite(y.data(), 4, y.size(), stdout);
  return 0;
}
"""


def h_type(limbs: bool = False) -> str:
    """The experts mains' h (after the constant I): T, I values a row, or with `limbs` X_INTS limbs
    (uint32, I / 32 packs a row; the words a pack leaves unwritten start as ~0)."""
    if limbs:
        return f"using HT = uint32_t;\nconstexpr size_t H_ROW = I / 32 * 4 * {ex.X_INTS};\n#define H_UNSET 0xffffffffu\n"
    return "using HT = T;\nconstexpr size_t H_ROW = I;\n#define H_UNSET T(NAN)\n"


def build(tmp_path, name, kernel, main, consts, limbs=False):
    source = (EMULATOR + BF16 + "".join(f"constexpr int {k} = {int(v)};\n" for k, v in consts.items())
              + (h_type(limbs) if "I" in consts else "") + HOST_TYPES + READ_MATRIX + kernel.header
              + main.replace("BODY", kernel.body))
    return build_host(tmp_path, name, source)


def mode(m: GGUFMatrix, integer: bool = False) -> int:
    """The unit decoder the switches pick for m (Q8_0 in pairs under DSV4_KERNEL_GGUF_Q8_PAIRS);
    `integer`: its integer unit (the launch's choice, experts.integer_units)."""
    return dict(m.template(integer=integer))["MODE"]


# (routed, shared, I, D): ds4's q2 and q4 recipes at toy widths whose rows hold several units
# per lane and leave lanes without one (Q2_K at I=512: 4 units a down row over 2 lanes; Q4_K
# gate/up at D=768: 12 units over 16 lanes), and D = 768 leaving the down kernel's last
# threadgroup partly past the end.
@pytest.mark.parametrize("routed,shared,I,D", [
    (("IQ2_XXS", "IQ2_XXS", "Q2_K"), "Q8_0", 512, 768),
    (("Q4_K", "Q4_K", "Q4_K"), "Q8_0", 256, 768),
    (("Q8_0", "Q8_0", "Q8_0"), None, 96, 160),
])
@pytest.mark.parametrize("tokens,act_quant,pairs,wide", [(1, True, False, False), (2, False, False, False),
                                                          (2, True, True, False), (1, True, False, True),
                                                          (2, False, True, True), (1, True, False, "halves"),
                                                          (2, True, False, "halves"), (2, True, False, "hsub"),
                                                          (1, True, False, "dp4a"), (3, True, False, "dp4a"),
                                                          (3, True, False, "limbs")])
def test_gguf_experts_bodies_on_the_host(tmp_path, routed, shared, I, D, tokens, act_quant, pairs, wide):
    """`pairs`: Q8_0 matrices read two blocks at a time (DSV4_KERNEL_GGUF_Q8_PAIRS); `wide`: the
    16-byte-load units (DSV4_KERNEL_GGUF_WIDE, which takes precedence); "halves": with the codes as
    fp16 subnormals (DSV4_KERNEL_GGUF_HALVES); "hsub": those and Q8_0 by int8s2 (DSV4_KERNEL_GGUF_Q8_HSUB);
    "dp4a": those and the gate/up in the integer units over x's limbs (DSV4_KERNEL_GGUF_DP4A:
    IQ2_XXS, Q4_K and Q8_0 have them); "limbs": those and h handed over as limbs to the down launch
    in the integer units (DSV4_KERNEL_GGUF_DP4A_DOWN: Q2_K, Q4_K and Q8_0 have them)."""
    with flags.override(kernel_gguf_q8_pairs=pairs, kernel_gguf_wide=bool(wide),
                        kernel_gguf_halves=wide in ("halves", "hsub", "dp4a", "limbs"),
                        kernel_gguf_q8_hsub=wide in ("hsub", "dp4a", "limbs"),
                        kernel_gguf_dp4a=wide in ("dp4a", "limbs"), kernel_gguf_dp4a_down=wide == "limbs"):
        gate = gguf_matrix(np.random.default_rng(), (1, 32, D), routed[0])
        assert ex.integer_kinds(gate, None, act_quant) == (wide in ("dp4a", "limbs") and act_quant,) * 2
        experts_bodies(tmp_path, routed, shared, I, D, tokens, act_quant)


@pytest.mark.parametrize("splits,expected,unit", [(0, 3, "hsub"), (4, 4, "hsub"), (2, 2, "limbs")])
def test_gguf_down_body_splits_the_shared_expert(tmp_path, splits, expected, unit):
    """ds4's q2 recipe with the Q8_0 shared expert's down rows over several SIMD groups
    (DSV4_KERNEL_MOE_SHARED_SPLITS; 0: its row's bytes over Q2_K's, here 544 / 168 -> 3), each a
    part of every lane's units (Q8_0's 16 units a row over 4 lanes: 4, 2 or 1 a lane and part)."""
    with flags.override(kernel_gguf_wide=True, kernel_gguf_halves=True, kernel_gguf_q8_hsub=True,
                        kernel_gguf_dp4a=unit == "limbs", kernel_gguf_dp4a_down=unit == "limbs",
                        kernel_moe_shared_splits=splits):
        q2k, q8 = (gguf_matrix(np.random.default_rng(), (768, 512), q) for q in ("Q2_K", "Q8_0"))
        assert ex.shared_splits(q2k, q8, 3) == expected and ex.shared_splits(q2k, None, 3) == 0
        experts_bodies(tmp_path, ("IQ2_XXS", "IQ2_XXS", "Q2_K"), "Q8_0", 512, 768, 2, True)


def experts_bodies(tmp_path, routed, shared, I, D, tokens, act_quant):
    rng = np.random.default_rng()
    E, K = 4, 3
    gate, up = (gguf_matrix(rng, (E, I, D), q) for q in routed[:2])
    down = gguf_matrix(rng, (E, D, I), routed[2])
    shared_m = None if shared is None else tuple(gguf_matrix(rng, s, shared) for s in ((I, D), (I, D), (D, I)))
    x = mx.array((rng.standard_normal((tokens, D)) * 3).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).astype(np.int32))
    rw = mx.array(rng.uniform(0.05, 1.0, (tokens, K)).astype(np.float32))
    limit = 0.3
    hs = int(shared_m is not None)
    s_gate, s_up, s_down = shared_m if shared_m else (None, None, None)

    rows, lanes = ex.GGUF_GATE_UP_SHAPES[gate.qtype]
    routed_ints, shared_ints = ex.integer_kinds(gate, s_gate, act_quant)
    assert routed_ints == shared_ints
    limbs = ex.limbs_between(down, s_down, act_quant)
    assert limbs == (flags.get("kernel_gguf_dp4a_down") and act_quant)
    consts = dict(K=K, HS=hs, I=I, D=D, MODE=mode(gate, routed_ints), SMODE=mode(s_gate or gate, shared_ints), BITS=0,
                  GS=0, SBITS=0, SGS=0)
    xs = ex.X_INTS if routed_ints or shared_ints else ex.X_STRIDE
    exe = build(tmp_path, "gate_up", ex.GGUF_GATE_UP_KERNELS[limbs][0], GATE_UP_MAIN,
                dict(consts, ROWS=rows, LANES=lanes, XS=xs, ACTQ=act_quant), limbs)
    data = (np.array([tokens, E], np.int32).tobytes() + bf16_bits(x) + np.array(idx).tobytes()
            + np.array(rw).tobytes() + np.array([limit], np.float32).tobytes()
            + matrix_bytes(gate, gate, E * I) + matrix_bytes(up, gate, E * I)
            + matrix_bytes(s_gate, gate, I) + matrix_bytes(s_up, gate, I))
    h_bytes = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    h = limbs_values(h_bytes, (tokens, K + hs, I)) if limbs else from_bf16_bits(h_bytes, (tokens, K + hs, I))
    check_hidden(h, hidden_expected(x, idx, rw, gate, up, shared_m, limit, act_quant), act_quant)

    rows, lanes = ex.GGUF_DOWN_SHAPES[down.qtype]
    consts.update(MODE=mode(down, limbs), SMODE=mode(s_down or down, limbs))
    groups = K + ex.shared_splits(down, s_down, K)   # the launch's SIMD groups
    exe = build(tmp_path, "down", ex.GGUF_LIMBS_DOWN_KERNEL if limbs else ex.GGUF_DOWN_KERNEL, DOWN_MAIN,
                dict(consts, ROWS=rows, LANES=lanes, DO=D, HC=0, GROUPS=groups), limbs)
    data = (np.array([tokens, E], np.int32).tobytes() + h_bytes + np.array(idx).tobytes()
            + matrix_bytes(down, down, E * D) + matrix_bytes(s_down, down, D))
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    check_down(from_bf16_bits(out, (tokens, D)), h, idx, down, s_down)


def limbs_values(data: bytes, shape) -> mx.array:
    """h [..., I] (bf16) from the gate/up launch's limbs (experts.py's X_INTS layout, read here
    from its description): value 8c + 4j + k of a pack is q = l0 + 2^7 l1 + 2^14 l2 (byte k of
    words 8c + j, 8c + 2 + j, 8c + 4 + j; l2 signed) times word 32's float; words 8c + 6 and 33
    hold the sums of q over chunk c and over the pack."""
    words = np.frombuffer(data, np.uint32).reshape(-1, 4 * ex.X_INTS)   # a pack a row
    limbs = words.view(np.uint8).reshape(len(words), -1, 4).astype(np.int64)   # [pack, word, byte]
    q = np.zeros((len(words), 4, 2, 4), np.int64)
    for c in range(4):
        for j in range(2):
            l2 = limbs[:, 8 * c + 4 + j]
            q[:, c, j] = limbs[:, 8 * c + j] + 128 * limbs[:, 8 * c + 2 + j] + 16384 * np.where(l2 > 127, l2 - 256, l2)
    assert (q.reshape(-1, 4, 8).sum(-1) == words[:, 6:32:8].view(np.int32)).all(), "chunk sums"
    assert (q.reshape(-1, 32).sum(-1) == words[:, 33].view(np.int32)).all(), "pack sums"
    values = (q.reshape(-1, 32) * words[:, 32].view(np.float32)[:, None].astype(np.float64)).reshape(shape)
    h = mx.array(values.astype(np.float32)).astype(mx.bfloat16)
    np.testing.assert_array_equal(np.array(h.astype(mx.float32)), values)   # fp8 values: exact in bf16
    return h


@pytest.mark.parametrize("qtype,n,k", [
    ("Q8_0", 40, 512),      # split in 4 slices of 4 blocks
    ("Q8_0", 2100, 64),     # 2 rows per SIMD group; the last threadgroup clamps
    ("Q4_K", 37, 1024),     # 4 slices of one block
    ("Q2_K", 300, 512),
    ("IQ2_XXS", 64, 768),
    ("Q8_0 pairs", 40, 512),      # split in 4 slices of 2 pairs
    ("Q8_0 pairs", 2100, 128),    # 2 rows per SIMD group, 2 pairs a row: most lanes without one
    ("Q8_0 wide", 40, 512),
    ("Q8_0 wide", 2100, 64),      # rows of 68 bytes: every 16-byte phase, the buffer's last block
    ("Q8_0 wide", 30, 96),        # rows of 102 bytes: odd rows start 2 bytes past a 4-byte boundary
    ("Q2_K wide", 300, 512),
    ("Q2_K wide", 45, 2304),      # rows of 756 bytes (V4.1's down): rows start at each 4-byte phase
    ("IQ2_XXS wide", 64, 768),
    ("IQ2_XXS wide", 33, 256),    # rows of one block: 66 bytes, every 2-byte phase
    ("Q2_K halves", 45, 2304),
    ("Q4_K halves", 37, 1024),
    ("IQ2_XXS halves", 33, 256),
    ("Q8_0 hsub", 2100, 64),      # as the wide unit's cases, the int8s by int8s2
    ("Q8_0 hsub", 30, 96),
    ("Q8_0 dp4a", 40, 512),       # the integer units over x's limbs: split in 4 slices,
    ("Q8_0 dp4a", 30, 96),        # rows at every 2-byte phase,
    ("IQ2_XXS dp4a", 33, 256),    # and IQ2_XXS's 66-byte rows;
    ("Q4_K dp4a", 37, 1024),      # Q4_K's two sub-blocks a unit, each with its min, in 4 slices
    ("Q2_K dp4a", 45, 2304),      # Q2_K's 16-value groups, each with its scale and min; rows at each 4-byte phase
])
def test_gguf_matvec_body_on_the_host(tmp_path, qtype, n, k):
    rng = np.random.default_rng()
    with flags.override(**variant_flags(qtype)):
        q = gguf_matrix(rng, (n, k), qtype.split()[0])
        assert (mode(q) == gguf_dot.Q8_0_HSUB) == qtype.endswith("hsub")
        assert q.integer == qtype.endswith("dp4a")
        matvec_body(tmp_path, rng, q, n, k)


def variant_flags(variant: str) -> dict:
    """The switches of a unit variant named as the tests name them ("Q8_0 pairs", "Q2_K wide",
    "IQ2_XXS halves", "Q8_0 hsub", "Q8_0 dp4a")."""
    return dict(kernel_gguf_q8_pairs=variant.endswith("pairs"),
                kernel_gguf_wide=variant.endswith(("wide", "halves", "hsub")),
                kernel_gguf_halves=variant.endswith("halves"), kernel_gguf_q8_hsub=variant.endswith("hsub"),
                kernel_gguf_dp4a=variant.endswith("dp4a"))


def run_matvec(tmp_path, q, x, split, rows, tokens_launch=False) -> np.ndarray:
    """The GGUF matvec body on the host with the given work split for fp32 x [tokens, G, K] (row r
    of q takes group r // (n / G)), or (`tokens_launch`) the multi-token body, whose rows a lane
    group makes are `rows`: y [tokens, n], float64."""
    tokens, groups, k = x.shape
    n = q.out_features
    consts = dict(WARPS=mv.WARPS, MODE=mode(q, q.integer), BITS=0, GS=0, SPLIT=split, ROWS=rows, K=k,
                  XS=ex.X_INTS if q.integer else ex.X_STRIDE, ACTQ=1, GROUPS=groups)
    kernel, main = mv.GGUF_MATVEC_KERNEL, MATVEC_MAIN
    if tokens_launch:   # one threadgroup row for all the tokens, 32 / LANES lane groups a SIMD group
        consts.update(TOKS=tokens, LANES=mv.tokens_lanes(q, q.integer))
        kernel = mv.GGUF_TOKENS_MATVEC_KERNEL
        main = main.replace("(n * SPLIT + WARPS * ROWS - 1) / (WARPS * ROWS), tokens,",
                            "(n + WARPS * ROWS * 32 / LANES - 1) / (WARPS * ROWS * 32 / LANES), 1,")
    exe = build(tmp_path, "matvec", kernel, main, consts)
    data = np.array([n, tokens], np.int32).tobytes() + x.tobytes() + matrix_bytes(q, q, n)
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    return np.frombuffer(out, np.float32).reshape(tokens, n).astype(np.float64)


def check_product(got, x, q):
    """got [tokens, n] within the fp32 summation bound of the float64 product of x [tokens, G, K],
    fp8-rounded, and q's decoded blocks (group j meeting rows j n / G ..); matvec_reference too."""
    tokens, groups, k = x.shape
    n = q.out_features
    xq = np.array(qdq_fp8(mx.array(x))).astype(np.float64)                    # [tokens, G, K]
    w = np.array(q.dequantized()).astype(np.float64).reshape(groups, n // groups, k)
    want = np.einsum("tgk,gnk->tgn", xq, w).reshape(tokens, n)
    mag = np.einsum("tgk,gnk->tgn", np.abs(xq), np.abs(w)).reshape(tokens, n)
    # fp32 sums in some order: within 2 K 2^-24 sum|w x| of the exact float64 product.
    assert np.all(np.abs(got - want) <= 2 * k * 2.0 ** -24 * mag + 1e-30), np.abs(got - want).max()
    x_in = mx.array(x if groups > 1 else x[:, 0])
    ref = np.array(mv.matvec_reference(x_in, q, True, groups)).astype(np.float64).reshape(tokens, n)
    assert np.all(np.abs(ref - want) <= 2 * k * 2.0 ** -24 * mag + 1e-30)


def matvec_body(tmp_path, rng, q, n, k, groups=1):
    """The GGUF matvec body on the host for 2 tokens of `groups` groups of K inputs each, at the
    dispatcher's work split, against the float64 product of the decoded blocks."""
    x = (rng.standard_normal((2, groups, k)) * 2).astype(np.float32)
    check_product(run_matvec(tmp_path, q, x, *mv.work_split(n, k, q.block_values, groups)), x, q)


# rows: a lane group's, as mv.tokens_rows gives them (2 from TOKENS_ROWS2_MIN rows, here on fewer
# rows: the emulator's time grows with n).
@pytest.mark.parametrize("variant,n,k,tokens,groups,rows", [
    ("Q8_0", 40, 1280, 2, 1, 1),           # 40 packs: a segment of 32, then 8 (lanes 8.. idle)
    ("Q8_0 hsub", 68, 64, 4, 1, 2),        # 2 rows a lane group; the last threadgroup clamps
    ("Q8_0 pairs", 40, 512, 3, 1, 1),      # units of two blocks: 16 lanes a row
    ("Q4_K", 37, 1024, 3, 1, 1),           # 16 lanes a row
    ("Q4_K halves", 37, 1024, 6, 1, 1),
    ("Q2_K wide", 45, 2304, 6, 1, 1),      # 8 lanes a row; V4.1's down width: segments of 8, 8 and 2 units
    ("Q2_K halves", 45, 2304, 2, 1, 1),
    ("IQ2_XXS", 64, 768, 5, 1, 1),
    ("IQ2_XXS halves", 33, 256, 4, 1, 1),  # rows of one block, at every 2-byte phase
    ("Q8_0 dp4a", 40, 512, 6, 1, 1),       # the integer units over every token's limbs
    ("IQ2_XXS dp4a", 33, 256, 3, 1, 1),
    ("Q4_K dp4a", 37, 1024, 5, 1, 1),      # 16 lanes a row, two packs a unit
    ("Q2_K dp4a", 45, 2304, 3, 1, 1),      # 8 lanes a row, four packs of two 16-value groups a unit
    ("Q8_0 hsub", 256, 64, 3, 8, 2),       # V4.1's grouped wo_a: 8 groups, here of 32 rows
    ("Q8_0 dp4a", 64, 512, 2, 4, 1),
])
def test_gguf_tokens_matvec_body_on_the_host(tmp_path, variant, n, k, tokens, groups, rows):
    """DSV4_KERNEL_MATVEC_TOKENS over GGUF rows, each unit decoded once for every token: within the
    fp32 bound of the float64 product, and where a unit is one pack of x (a lane a unit of the
    segment, as the one-token body's lanes at SPLIT 1), equal to that body's outputs bit for bit."""
    rng = np.random.default_rng()
    with flags.override(kernel_matvec_tokens=True, **variant_flags(variant)):
        q = gguf_matrix(rng, (n, k), variant.split()[0])
        with mock.patch.object(mv, "backend", return_value="cuda"):
            assert mv.tokens_applies(q, tokens, groups, q.integer)
        x = (rng.standard_normal((tokens, groups, k)) * 2).astype(np.float32)
        lanes = mv.tokens_lanes(q, q.integer)
        assert rows == 1 or mv.tokens_rows(mv.TOKENS_ROWS2_MIN, lanes) == rows
        got = run_matvec(tmp_path, q, x, 1, rows, tokens_launch=True)
        check_product(got, x, q)
        assert (lanes == 32) == (q.unit_values(q.integer) == 32)
        if lanes == 32:
            np.testing.assert_array_equal(got, run_matvec(tmp_path, q, x, 1, 1))


def test_gguf_tokens_launch_only_where_it_applies():
    """The GGUF multi-token launch: with its switch and 2..MAX_TOKS tokens; x's segment within the
    threadgroup memory (6 tokens' limbs fit CUDA's 48 KB, not Metal's 32 KB); grouped, only where
    each threadgroup's rows lie in one group."""
    rng = np.random.default_rng()
    q8 = gguf_matrix(rng, (8 * 1024, 256), "Q8_0")
    assert not mv.tokens_applies(q8, 4), "off by default"
    with flags.override(kernel_matvec_tokens=True):
        assert mv.tokens_applies(q8, 2) and mv.tokens_applies(q8, mv.MAX_TOKS) and mv.tokens_applies(q8, 4, 8)
        assert not mv.tokens_applies(q8, 1) and not mv.tokens_applies(q8, mv.MAX_TOKS + 1)
        assert not mv.tokens_applies(gguf_matrix(rng, (8 * 3, 256), "Q8_0"), 4, 8), "3 rows a group"
        for dialect, fits in (("cuda", True), ("metal", False)):
            with mock.patch.object(mv, "backend", return_value=dialect):
                assert mv.tokens_applies(q8, mv.MAX_TOKS, integer=True) == fits
                assert mv.tokens_applies(q8, 5, integer=True)


def test_integer_units_by_default_only_where_they_measured_faster():
    """DSV4_KERNEL_GGUF_DP4A auto: under CUDA IQ2_XXS, Q4_K and Q8_0 take the integer units (so both
    ds4 recipes' gate/up launches, with their Q8_0 shared expert, are integer) and Q2_K keeps its
    float unit; Metal none; on: every type that has one; and never without act_quant."""
    rng = np.random.default_rng()
    q2, q4, q8, k2 = (gguf_matrix(rng, (256, 256), t) for t in ("IQ2_XXS", "Q4_K", "Q8_0", "Q2_K"))
    for dialect, value, want in (("cuda", "auto", (True, True, True, False)), ("metal", "auto", (False,) * 4),
                                 ("cuda", "on", (True,) * 4), ("cuda", "off", (False,) * 4)):
        with mock.patch.object(gguf_dot, "backend", return_value=dialect), flags.override(kernel_gguf_dp4a=value):
            assert (q2.integer, q4.integer, q8.integer, k2.integer) == want, (dialect, value)
            assert ex.integer_units(q2, q8, True) == want[0] and ex.integer_units(q4, q8, True) == want[1]
            assert not ex.integer_units(q4, q8, False)


def test_limbs_between_the_launches_only_with_their_switch_act_quant_and_integer_downs():
    """DSV4_KERNEL_GGUF_DP4A_DOWN (off by default): h goes to the down launch as limbs where both
    down matrices have integer units (Q2_K, Q4_K, Q8_0, IQ2_XXS; not MLX's packs), under act_quant."""
    rng = np.random.default_rng()
    q2k, q4k, q8 = (gguf_matrix(rng, (256, 256), t) for t in ("Q2_K", "Q4_K", "Q8_0"))
    mx4 = quantized(rng, (256, 256), "mxfp4", 4, 32, mx.bfloat16)
    assert not ex.limbs_between(q2k, q8, True), "off by default"
    with flags.override(kernel_gguf_dp4a_down=True):
        assert ex.limbs_between(q2k, q8, True) and ex.limbs_between(q4k, q8, True)
        assert ex.limbs_between(q4k, None, True)
        assert not ex.limbs_between(q2k, q8, False)
        assert not ex.limbs_between(q2k, mx4, True)


def test_grouped_matvec_takes_whole_threadgroups_per_group():
    """A grouped launch only where each threadgroup's rows lie in one group: V4.1's wo_a (8 groups of
    1024 rows) takes it; groups of 3 rows (no split fits) and MLX's packs (gather_qmm's) do not."""
    rng = np.random.default_rng()
    with mock.patch.object(mv, "backend", return_value="cuda"):
        wo_a = gguf_matrix(rng, (8 * 1024, 256), "Q8_0")   # V4.1's rows; a shorter input
        assert mv.kernel_supports(mx.ones((1, 8, 256), mx.bfloat16), wo_a, groups=8)
        assert mv.grouped_fits(8192, 8, *mv.work_split(8192, 4096, 32, 8))
        assert not mv.kernel_supports(mx.ones((1, 4, 256), mx.bfloat16), wo_a, groups=8), "x's groups"
        assert not mv.kernel_supports(mx.ones((9, 8, 256), mx.bfloat16), wo_a, groups=8), "more than 8 tokens"
        odd = gguf_matrix(rng, (8 * 3, 256), "Q8_0")
        assert not mv.kernel_supports(mx.ones((1, 8, 256), mx.bfloat16), odd, groups=8), "3 rows a group"
        packs = quantized(rng, (8 * 1024, 256), "mxfp8", 8, 32)
        assert not mv.kernel_supports(mx.ones((1, 8, 256), mx.bfloat16), packs, groups=8), "MLX's packs"


@pytest.mark.parametrize("qtype,groups,n,k", [
    ("Q8_0 hsub", 8, 4096, 64),    # 8 groups of 512 rows, 4 rows a SIMD group (V4.1's wo_a split)
    ("Q8_0", 4, 64, 512),          # 4 groups of 16 rows, K in 4 slices: 8 threadgroups of 2 rows each
    ("Q4_K halves", 2, 16, 256),   # 2 groups of 8 rows, a threadgroup each
    ("Q8_0 dp4a", 4, 64, 512),     # the integer units: each threadgroup its group's x as limbs
    ("Q4_K dp4a", 2, 16, 256),
])
def test_grouped_gguf_matvec_body_on_the_host(tmp_path, qtype, groups, n, k):
    """A grouped projection (V4.1's wo_a: each group of heads through its own block of rows) in one
    launch: each threadgroup copies its group's x."""
    rng = np.random.default_rng()
    with flags.override(kernel_gguf_wide=qtype.endswith(("halves", "hsub")), kernel_gguf_halves=qtype.endswith("halves"),
                        kernel_gguf_q8_hsub=qtype.endswith("hsub"), kernel_gguf_dp4a=qtype.endswith("dp4a")):
        q = gguf_matrix(rng, (n, k), qtype.split()[0])
        split, rows = mv.work_split(n, k, q.block_values, groups)
        assert mv.grouped_fits(n, groups, split, rows)
        matvec_body(tmp_path, rng, q, n, k, groups)


def iq2_xxs_every_entry(rng, rows: int) -> GGUFMatrix:
    """IQ2_XXS rows of 8 blocks whose 64 sub-blocks take every grid entry (4s..4s+3) and every
    sign pattern (shifted by the row), with random d and sub-block scales."""
    blocks = np.zeros((rows, 8, 66), np.uint8)
    blocks[..., :2] = (rng.uniform(0.5, 2.0, (rows, 8)) * 2.0 ** -rng.integers(4, 12, (rows, 8))
                       ).astype(np.float16)[..., None].view(np.uint8)
    s = np.arange(64).reshape(8, 8)
    grid = (4 * s[..., None] + np.arange(4)).astype(np.uint8)                              # [8, 8, 4]
    for r in range(rows):
        signs = ((4 * s[..., None] + np.arange(4) + r) % 128).astype(np.uint32)
        aux = (signs << (7 * np.arange(4, dtype=np.uint32))).sum(-1, dtype=np.uint32) \
            | (rng.integers(0, 16, (8, 8)).astype(np.uint32) << 28)
        words = np.concatenate([grid.view(np.uint32), aux[..., None]], -1)            # [8, 8, 2]
        blocks[r, :, 2:] = words.reshape(8, 16).view(np.uint8)
    return GGUFMatrix(mx.array(blocks.reshape(rows, 8 * 66)), "IQ2_XXS")


@pytest.mark.parametrize("wide,halves,unit", [(False, False, 13), (True, False, 23), (True, True, 24), (True, True, 28)])
def test_iq2_xxs_every_grid_entry_and_sign_pattern(tmp_path, wide, halves, unit):
    """The IQ2_XXS units (the wide ones compute their signs; unit 24 makes signed fp16 pairs, the
    integer unit 28 signed grid bytes by byte masks it computes) over every grid entry and sign
    pattern, against the float64 product of gguf_blocks' decoding; that decoding against
    gguf-py's on the same blocks."""
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.constants import GGMLQuantizationType
    rng = np.random.default_rng()
    q = iq2_xxs_every_entry(rng, 4)
    want = gguf_dequantize(np.array(q.weight), GGMLQuantizationType.IQ2_XXS)
    np.testing.assert_array_equal(np.array(q.dequantized()), want)
    with flags.override(kernel_gguf_wide=wide, kernel_gguf_halves=halves, kernel_gguf_dp4a=unit == 28):
        assert mode(q, q.integer) == unit
        matvec_body(tmp_path, rng, q, 4, 2048)
