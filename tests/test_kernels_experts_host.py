"""The fused experts kernels' bodies (gate/up, then down) run on the host, CPU, in CI.

Each body is compiled with clang (tools/cxx.py) under the host prelude and test_kernels_matvec's
threadgroup emulator (a thread per lane, a barrier of fibers for BARRIER and for the SIMD-group
exchanges), with T a bf16 type, and run over the launch grid the dispatcher uses at the
committed launch shapes (rows_dot's ROWS x LANES; the down kernel's 8-lane groups included). Its
outputs are checked against the plain-MLX stages (hidden_reference, down_reference) with the GPU
test's bounds: the kernel's own indexing (slots, shared expert, row groups, lane groups, packs
per lane, the last group's clamped rows, the fp8 block of h) on every machine, not only on a
GPU.
"""

import dataclasses
import subprocess

import numpy as np
import pytest

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import dialect, experts_mma
from dsv4.kernels import experts as ex
from tests.test_kernels_decode_host import build_host
from tests.test_kernels_experts import check_down, check_hidden, hidden_expected, quantized
from tests.test_kernels_matvec import EMULATOR
from tests.mma_emulator import CP_ASYNC_EMULATOR, MMA_EMULATOR, MUTATIONS

BF16 = r"""
struct bf16 {   // the activation type T: bf16 bits, rounded to nearest even from float
  uint16_t bits;
  bf16() = default;
  explicit bf16(float f) { uint32_t u = host_as_uint(f); bits = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }
  operator float() const { return host_as_float((uint32_t)bits << 16); }
};
using T = bf16;
"""

# Inputs on stdin in this order; outputs (bf16 bits) on stdout.
GATE_UP_MAIN = r"""
void body(const T* x, const int* idx, const float* route_w, const float* params,
          const uint32_t* gate_w, const SCALE* gate_s, const SCALE* gate_b,
          const uint32_t* up_w, const SCALE* up_s, const SCALE* up_b,
          const uint32_t* sgate_w, const SSCALE* sgate_s, const SSCALE* sgate_b,
          const uint32_t* sup_w, const SSCALE* sup_s, const SSCALE* sup_b, T* h,
          uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int tokens = read_int(), experts = read_int();
  std::vector<T> x(tokens * D), h((size_t)tokens * (K + HS) * I, T(NAN));
  std::vector<int> idx(tokens * K);
  std::vector<float> route_w(tokens * K), params(1);
  const size_t rows = (size_t)experts * I;
  std::vector<uint32_t> gw(rows * D * BITS / 32), uw(gw.size());
  std::vector<SCALE> gs(rows * D / GS), gb(gs.size()), us(gs.size()), ub(gs.size());
  std::vector<uint32_t> sgw((size_t)I * D * SBITS / 32), suw(sgw.size());
  std::vector<SSCALE> sgs((size_t)I * D / SGS), sgb(sgs.size()), sus(sgs.size()), sub(sgs.size());
  read(x); read(idx); read(route_w); read(params);
  read(gw); read(gs); read(gb); read(uw); read(us); read(ub);
  read(sgw); read(sgs); read(sgb); read(suw); read(sus); read(sub);
  constexpr int RW = ROWS * 32 / LANES;
  launch(32 * 32 / RW, I / 32, tokens * (K + HS), [&](int t, int g, int z, int threads) {
    body(x.data(), idx.data(), route_w.data(), params.data(), gw.data(), gs.data(), gb.data(), uw.data(),
         us.data(), ub.data(), sgw.data(), sgs.data(), sgb.data(), suw.data(), sus.data(), sub.data(), h.data(),
         t, g, z, threads);
  });
  std::fwrite(h.data(), 2, h.size(), stdout);
  return 0;
}
"""

# The down launches' mains: the routed and shared down matrices, read after h and idx.
DOWN_READS = r"""
  const size_t rows = (size_t)experts * DO;
  std::vector<uint32_t> dw(rows * I * BITS / 32);
  std::vector<SCALE> ds(rows * I / GS), db(ds.size());
  std::vector<uint32_t> sdw((size_t)DO * I * SBITS / 32);
  std::vector<SSCALE> sds((size_t)DO * I / SGS), sdb(sds.size());
  read(h); read(idx); read(dw); read(ds); read(db); read(sdw); read(sds); read(sdb);
"""
DOWN_MAIN = r"""
void body(const T* h, const int* idx, const uint32_t* down_w, const SCALE* down_s, const SCALE* down_b,
          const uint32_t* sdown_w, const SSCALE* sdown_s, const SSCALE* sdown_b, const T* residual,
          const float* post, const float* comb, T* y,
          uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int tokens = read_int(), experts = read_int();
  std::vector<T> h((size_t)tokens * (K + HS) * I), y((size_t)tokens * DO, T(NAN));
  std::vector<int> idx(tokens * K);
""" + DOWN_READS + r"""  constexpr int RW = ROWS * 32 / LANES;
  launch(32 * GROUPS, (DO + RW - 1) / RW, tokens, [&](int t, int g, int z, int threads) {
    body(h.data(), idx.data(), dw.data(), ds.data(), db.data(), sdw.data(), sds.data(), sdb.data(), nullptr,
         nullptr, nullptr, y.data(), t, g, z, threads);
  });
  std::fwrite(y.data(), 2, y.size(), stdout);
  return 0;
}
"""


def bf16_bits(a: mx.array) -> bytes:
    return np.array(a.astype(mx.bfloat16).view(mx.uint16)).tobytes()


def from_bf16_bits(data: bytes, shape) -> mx.array:
    return mx.array(np.frombuffer(data, np.uint16).reshape(shape)).view(mx.bfloat16)


def matrix_bytes(m: ex.QuantizedMatrix | None, like: ex.QuantizedMatrix, rows: int, cols: int) -> bytes:
    """weight, scales, biases as the emulator reads them (scales and biases as uint8 for the mx
    modes, fp32 for affine); zeros standing for an absent matrix of like's layout."""
    if m is None:
        scale = np.float32 if like.mode == "affine" else np.uint8
        n_scales = rows * cols // like.group_size
        return (np.zeros(rows * cols * like.bits // 32, np.uint32).tobytes()
                + np.zeros(2 * n_scales, scale).tobytes())
    if m.mode == "affine":
        scales = np.array(m.scales.astype(mx.float32))
        biases = np.array(m.biases.astype(mx.float32))
    else:
        scales = np.array(m.scales)
        biases = np.zeros_like(scales)
    return np.array(m.weight).tobytes() + scales.tobytes() + biases.tobytes()


def build(tmp_path, name, kernel, main, consts, routed, shared, prelude="", header=ex._HEADER):
    scale = lambda m: "float" if m.mode == "affine" else "uint8_t"
    return build_host(tmp_path, name, EMULATOR + BF16 + prelude
                      + "".join(f"constexpr int {k} = {int(v)};\n" for k, v in consts.items())
                      + header + main.replace("BODY", kernel.body).replace("SSCALE", scale(shared or routed))
                      .replace("SCALE", scale(routed)))


def layout(prefix, m):
    return {prefix + "MODE": ex.MODE_IDS[m.mode], prefix + "BITS": m.bits, prefix + "GS": m.group_size}


def case(rng, mode, bits, gs, shared_mode, I, D, tokens):
    """Random experts (5, 3 a token), a shared expert in `shared_mode` (or none), x and the routing."""
    E, K = 5, 3
    scale_dtype = mx.float32 if mode == "affine" else mx.bfloat16
    gate, up = (quantized(rng, (E, I, D), mode, bits, gs, scale_dtype) for _ in range(2))
    down = quantized(rng, (E, D, I), mode, bits, gs, scale_dtype)
    shared = None
    if shared_mode is not None:
        shared = tuple(quantized(rng, s, *shared_mode) for s in ((I, D), (I, D), (D, I)))
    x = mx.array((rng.standard_normal((tokens, D)) * 3).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).astype(np.int32))
    rw = mx.array(rng.uniform(0.05, 1.0, (tokens, K)).astype(np.float32))
    return E, K, gate, up, down, shared, x, idx, rw


def layouts(K, I, D, routed, shared):
    """The template values both launches share: K, HS, the widths and the two layouts."""
    return dict(K=K, HS=int(shared is not None), I=I, D=D, **layout("", routed),
                **layout("S", shared[0] if shared else routed))


def run_gate_up(tmp_path, E, K, gate, up, shared, x, idx, rw, limit, act_quant, integer=False, mma=""):
    """h from the gate/up body on the host; with `integer`, the routed experts in mxfp4's integer
    unit (MXFP4_INT) over x's copy as limbs, as the dispatcher's template has them; with `mma`,
    the tensor-core launch (experts_mma.py) under the mma.sync emulator (`mma` its prelude: a
    layout mutation, or MMA_EMULATOR's own tables with "plain")."""
    tokens, D = x.shape
    I = gate.out_features
    consts = dict(layouts(K, I, D, gate, shared), ROWS=ex.ROWS_GATE_UP, LANES=ex.LANES_GATE_UP, XS=ex.X_STRIDE,
                  ACTQ=act_quant)
    if integer:
        consts.update(MODE=ex.MXFP4_INT, XS=ex.X_INTS)
    if mma:
        mutation = "" if mma == "plain" else MUTATIONS[mma]
        gate_up = build(tmp_path, f"gate_up_mma_{sorted(MUTATIONS).index(mma) if mma in MUTATIONS else 'plain'}",
                        experts_mma.GATE_UP_KERNEL, GATE_UP_MAIN, consts, gate, shared[0] if shared else None,
                        prelude=mutation + MMA_EMULATOR + CP_ASYNC_EMULATOR, header=experts_mma.GATE_UP_KERNEL.header)
    else:
        gate_up = build(tmp_path, "gate_up_ints" if integer else "gate_up", ex.GATE_UP_KERNEL, GATE_UP_MAIN,
                        consts, gate, shared[0] if shared else None)
    s_gate, s_up = (shared[0], shared[1]) if shared else (None, None)
    data = (np.array([tokens, E], np.int32).tobytes() + bf16_bits(x) + np.array(idx).tobytes()
            + np.array(rw).tobytes() + np.array([limit], np.float32).tobytes()
            + matrix_bytes(gate, gate, E * I, D) + matrix_bytes(up, gate, E * I, D)
            + matrix_bytes(s_gate, gate, I, D) + matrix_bytes(s_up, gate, I, D))
    out = subprocess.run([str(gate_up)], input=data, capture_output=True, check=True).stdout
    return from_bf16_bits(out, (tokens, K + int(shared is not None), I))


# I is the hidden width (gate/up rows, down inputs), D the model width. 288 = 9 packs a down row:
# with 8 lanes a row, lane 0 takes two and the others one; 384 = 12 packs (lanes 0-3 take two).
# D = 160 leaves the down kernel's last threadgroup of 16 rows half past the end (clamped rows).
@pytest.mark.parametrize("mode,bits,gs,shared_mode,I,D", [
    ("mxfp4", 4, 32, ("mxfp8", 8, 32), 288, 160),     # V4.1's experts and shared expert
    ("mxfp8", 8, 32, None, 288, 96),
    ("affine", 3, 64, ("affine", 4, 128), 384, 128),  # 3-bit words straddle, scale groups span packs
])
@pytest.mark.parametrize("tokens,act_quant", [(1, True), (3, False)])
def test_experts_kernel_bodies_on_the_host(tmp_path, mode, bits, gs, shared_mode, I, D, tokens, act_quant):
    # Seeded per case, so that CI repeats itself: an unseeded draw once put a value past the
    # bound (affine 3-bit, 3 tokens, no act_quant; 2026-12-02), whose cancellation floor is an
    # estimate, not a proven bound.
    rng = np.random.default_rng([bits, gs, I, D, tokens, int(act_quant)])
    E, K, gate, up, down, shared, x, idx, rw = case(rng, mode, bits, gs, shared_mode, I, D, tokens)
    limit = 0.3
    assert ex.kernel_supports(x, gate, up, down, shared)
    h = run_gate_up(tmp_path, E, K, gate, up, shared, x, idx, rw, limit, act_quant)
    check_hidden(h, hidden_expected(x, idx, rw, gate, up, shared, limit, act_quant), act_quant)

    s_down = shared[2] if shared else None
    check_down(run_down(tmp_path, E, K, h, idx, down, s_down, layouts(K, I, D, gate, shared)), h, idx, down, s_down)


def run_down(tmp_path, E, K, h, idx, down, s_down, consts, mma=""):
    """y from the down body on the host, over as many SIMD groups as the launch has
    (shared_splits: DSV4_KERNEL_MOE_SHARED_SPLITS); with `mma`, the tensor-core launch
    (experts_mma.DOWN_KERNEL) under the mma.sync emulator, as run_gate_up's."""
    tokens, D = h.shape[0], down.out_features
    groups = K + ex.shared_splits(down, s_down, K)
    consts = dict(consts, ROWS=ex.ROWS_DOWN, LANES=ex.LANES_DOWN, DO=D, HC=0, GROUPS=groups)
    if mma:
        consts.update(zip(("ROWS", "LANES"), experts_mma.DOWN_SHAPE))
        down_exe = build(tmp_path, f"down_mma_{groups}_{mma}", experts_mma.DOWN_KERNEL, DOWN_MAIN, consts, down, s_down,
                         prelude=("" if mma == "plain" else MUTATIONS[mma]) + MMA_EMULATOR + CP_ASYNC_EMULATOR,
                         header=experts_mma.DOWN_KERNEL.header)
    else:
        down_exe = build(tmp_path, f"down{groups}", ex.DOWN_KERNEL, DOWN_MAIN, consts, down, s_down)
    data = (np.array([tokens, E], np.int32).tobytes() + bf16_bits(h) + np.array(idx).tobytes()
            + matrix_bytes(down, down, E * D, h.shape[-1]) + matrix_bytes(s_down, down, D, h.shape[-1]))
    out = subprocess.run([str(down_exe)], input=data, capture_output=True, check=True).stdout
    return from_bf16_bits(out, (tokens, D))


def huge_scales(rng, m: ex.QuantizedMatrix) -> ex.QuantizedMatrix:
    """m with e8m0 scale codes drawn from 100-199: past 128 a weight needs the second power of two."""
    return dataclasses.replace(m, scales=mx.array(rng.integers(100, 200, m.scales.shape).astype(np.uint8)))


def launched_on_and_off(call) -> list[str]:
    """The kernels `call` launches on (pretended) CUDA with DSV4_KERNEL_MOE_MMA on, then off."""
    launched = []

    def record(kernel, *, output_shapes, output_dtypes, **_):
        launched.append(kernel.name)
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    with dialect.pretend_gpu("cuda", record):
        for on in (True, False):
            with flags.override(kernel_moe_mma=on):
                call()
    return launched


@pytest.mark.parametrize("tokens,act_quant,scales,D", [(1, True, "quantized", 512), (3, False, "quantized", 1024),
                                                       (2, True, "codes 100-199", 512)])
def test_mma_gate_up_on_the_host(tmp_path, tokens, act_quant, scales, D):
    """DSV4_KERNEL_MOE_MMA: the gate/up body with V4.1's mxfp4 routed experts on (emulated) tensor
    cores, the mxfp8 shared expert in rows_dot, against the reference's bounds. D = 512: two chunks
    of 128 a SIMD group's half, loaded together; D = 1024: four (V4.1's batch of loads); every fp4
    code drawn; scale codes past 128 take the second power of two, as in the prefill launch."""
    rng = np.random.default_rng([5, tokens, int(act_quant), len(scales)])
    E, K, gate, up, down, shared, x, idx, rw = case(rng, "mxfp4", 4, 32, ("mxfp8", 8, 32), 288, D, tokens)
    if scales != "quantized":
        gate, up = huge_scales(rng, gate), huge_scales(rng, up)
    assert launched_on_and_off(lambda: ex.gate_up_kernel(x, idx, rw, gate, up, shared, 0.3, act_quant)) == [
        experts_mma.GATE_UP_KERNEL.name, ex.GATE_UP_KERNEL.name]
    h = run_gate_up(tmp_path, E, K, gate, up, shared, x, idx, rw, 0.3, act_quant, mma="plain")
    with np.errstate(over="ignore"):   # the reference's exp(-g) of the huge scales' g
        want = hidden_expected(x, idx, rw, gate, up, shared, 0.3, act_quant)
    check_hidden(h, want, act_quant)


@pytest.mark.parametrize("tokens,scales,D", [(1, "quantized", 160), (3, "codes 100-199", 320)])
def test_mma_down_on_the_host(tmp_path, tokens, scales, D):
    """DSV4_KERNEL_MOE_MMA's down launch: V4.1's mxfp4 routed experts on (emulated) tensor cores,
    the mxfp8 shared expert in rows_dot at 16 rows a threadgroup too, against the reference.
    I = 384: three chunks of 128 loaded together; D = 160 and 320: 10 and 20 threadgroups of 16
    rows; scale codes past 128 take the second power of two."""
    rng = np.random.default_rng([7, tokens, D])
    E, K, gate, up, down, shared, x, idx, rw = case(rng, "mxfp4", 4, 32, ("mxfp8", 8, 32), 384, D, tokens)
    if scales != "quantized":
        down = huge_scales(rng, down)
    h = run_gate_up(tmp_path, E, K, gate, up, shared, x, idx, rw, 0.3, True)
    assert launched_on_and_off(lambda: ex.down_kernel(h, idx, down, shared[2])) == [
        experts_mma.DOWN_KERNEL.name, ex.DOWN_KERNEL.name]
    y = run_down(tmp_path, E, K, h, idx, down, shared[2], layouts(K, 384, D, gate, shared), mma="plain")
    with np.errstate(over="ignore"):
        check_down(y, h, idx, down, shared[2])


@pytest.mark.parametrize("mutation", list(MUTATIONS), ids=list(MUTATIONS))
def test_mma_gate_up_fails_with_a_wrong_fragment_layout(tmp_path, mutation):
    rng = np.random.default_rng([6])
    E, K, gate, up, down, shared, x, idx, rw = case(rng, "mxfp4", 4, 32, ("mxfp8", 8, 32), 288, 512, 1)
    h = run_gate_up(tmp_path, E, K, gate, up, shared, x, idx, rw, 0.3, True, mma=mutation)
    with pytest.raises(AssertionError):
        check_hidden(h, hidden_expected(x, idx, rw, gate, up, shared, 0.3, True), True)


@pytest.mark.parametrize("splits,expected", [(0, 2), (3, 3)])
def test_down_body_splits_the_shared_expert(tmp_path, splits, expected):
    """V4.1's mxfp4 routed experts with the mxfp8 shared expert's down rows over several SIMD
    groups (DSV4_KERNEL_MOE_SHARED_SPLITS; 0: its row's bytes over mxfp4's, 297 / 153 -> 2), each
    a part of every lane's packs (9 packs a row over 8 lanes: the parts past the first get one or
    none), against the reference."""
    rng = np.random.default_rng([splits, 11])
    E, K, gate, up, down, shared, x, idx, rw = case(rng, "mxfp4", 4, 32, ("mxfp8", 8, 32), 288, 160, 2)
    h = run_gate_up(tmp_path, E, K, gate, up, shared, x, idx, rw, 0.3, True)
    consts = layouts(K, 288, 160, gate, shared)
    with flags.override(kernel_moe_shared_splits=splits):
        assert ex.shared_splits(down, shared[2], K) == expected
        y = run_down(tmp_path, E, K, h, idx, down, shared[2], consts)
    check_down(y, h, idx, down, shared[2])


@pytest.mark.parametrize("tokens", [1, 3])
def test_mxfp4_integer_unit_on_the_host(tmp_path, tokens):
    """DSV4_KERNEL_MOE_DP4A: the gate/up body with V4.1's mxfp4 routed experts in the integer unit
    (their slots' x as limbs, the mxfp8 shared expert's as floats) against the same reference and
    bounds; fp8-rounded x (act_quant), which the limbs need. Every fp4 code, -0 included, is drawn."""
    rng = np.random.default_rng([4, tokens])
    E, K, gate, up, down, shared, x, idx, rw = case(rng, "mxfp4", 4, 32, ("mxfp8", 8, 32), 288, 160, tokens)
    w = np.array(gate.weight)   # quantizing never gives -0 (code 8): some first codes made so
    gate = dataclasses.replace(gate, weight=mx.array(np.where(rng.random(w.shape) < 0.2, (w & ~np.uint32(15)) | 8, w)))
    assert len(np.unique(np.array(gate.weight).view(np.uint8) & 15)) == 16
    with flags.override(kernel_moe_dp4a=True):
        assert ex.integer_kinds(gate, shared[0], act_quant=True) == (True, False)
        assert ex.integer_kinds(gate, shared[0], act_quant=False) == (False, False)
        assert ex.kernel_supports(x, gate, up, down, shared)
    h = run_gate_up(tmp_path, E, K, gate, up, shared, x, idx, rw, 0.3, True, integer=True)
    check_hidden(h, hidden_expected(x, idx, rw, gate, up, shared, 0.3, True), True)


DOWN_PROJECTING_MAIN = r"""
void body(const T* h, const int* idx, const uint32_t* down_w, const SCALE* down_s, const SCALE* down_b,
          const uint32_t* sdown_w, const SSCALE* sdown_s, const SSCALE* sdown_b, const T* residual,
          const float* post, const float* comb, T* y, const float* fn, const float* pre_in, float* partial,
          T* collapsed, uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int tokens = read_int(), experts = read_int();
  constexpr int RW = ROWS * 32 / LANES, BLOCKS = (DO + RW - 1) / RW, NM = HC * (2 + HC);
  std::vector<T> h((size_t)tokens * (K + HS) * I), residual((size_t)tokens * HC * DO);
  std::vector<T> y((size_t)tokens * HC * DO, T(NAN)), collapsed((size_t)tokens * DO, T(NAN));
  std::vector<int> idx(tokens * K);
  std::vector<float> post(tokens * HC), comb(tokens * HC * HC), fn((size_t)NM * HC * DO), pre_in(tokens * HC);
  std::vector<float> partial((size_t)tokens * BLOCKS * (NM + 2), NAN);
""" + DOWN_READS + r"""  read(residual); read(post); read(comb); read(fn); read(pre_in);
  launch(32 * GROUPS, BLOCKS, tokens, [&](int t, int g, int z, int threads) {
    body(h.data(), idx.data(), dw.data(), ds.data(), db.data(), sdw.data(), sds.data(), sdb.data(), residual.data(),
         post.data(), comb.data(), y.data(), fn.data(), pre_in.data(), partial.data(), collapsed.data(), t, g, z, threads);
  });
  std::fwrite(y.data(), 2, y.size(), stdout);
  std::fwrite(collapsed.data(), 2, collapsed.size(), stdout);
  std::fwrite(partial.data(), 4, partial.size(), stdout);
  return 0;
}
"""


def f32_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (nearest even), as float32."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def test_down_body_makes_the_next_sites_entry_partials(tmp_path, tokens=3):
    """DSV4_KERNEL_MOE_NEXT_PROJECTION: the projecting down body on V4.1's experts (mxfp4, the
    mxfp8 shared expert), HC 4, D = 160 (20 column blocks of 8): its new streams are the expand of
    the plain down body's y in the kernel's fp32 order (bit for bit: the host makes no FMAs), the
    collapse with pre_in likewise, and each column block's partials the projection by fn, sum of
    X^2 and of h^2 over its 8 columns, within the fp32 summation bound of float64's."""
    rng = np.random.default_rng([7, tokens])
    I, D, HC = 288, 160, 4
    E, K, gate, up, down, shared, x, idx, rw = case(rng, "mxfp4", 4, 32, ("mxfp8", 8, 32), I, D, tokens)
    h = run_gate_up(tmp_path, E, K, gate, up, shared, x, idx, rw, 0.3, True)
    consts = layouts(K, I, D, gate, shared)
    plain = np.array(run_down(tmp_path, E, K, h, idx, down, shared[2], consts).astype(mx.float32))
    residual = mx.array(rng.standard_normal((tokens, HC, D)).astype(np.float32)).astype(mx.bfloat16)
    post, pre_in = (rng.uniform(0.1, 2.0, (tokens, HC)).astype(np.float32) for _ in range(2))
    comb = rng.uniform(0.0, 1.0, (tokens, HC, HC)).astype(np.float32)
    NM = HC * (2 + HC)
    fn = (rng.standard_normal((NM, HC * D)) * 0.05).astype(np.float32)
    groups = K + ex.shared_splits(down, shared[2], K)
    exe = build(tmp_path, "down_projecting", ex.DOWN_PROJECTING_KERNEL, DOWN_PROJECTING_MAIN,
                dict(consts, ROWS=ex.ROWS_DOWN, LANES=ex.LANES_DOWN, DO=D, HC=HC, GROUPS=groups), down, shared[2])
    data = (np.array([tokens, E], np.int32).tobytes() + bf16_bits(h) + np.array(idx).tobytes()
            + matrix_bytes(down, down, E * D, I) + matrix_bytes(shared[2], down, D, I)
            + bf16_bits(residual) + post.tobytes() + comb.tobytes() + fn.tobytes() + pre_in.tobytes())
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    n_streams, blocks = tokens * HC * D, D // (ex.ROWS_DOWN * 32 // ex.LANES_DOWN)
    streams = np.array(from_bf16_bits(out[:2 * n_streams], (tokens, HC, D)).astype(mx.float32))
    collapsed = np.array(from_bf16_bits(out[2 * n_streams:2 * (n_streams + tokens * D)], (tokens, D)).astype(mx.float32))
    partial = np.frombuffer(out[2 * (n_streams + tokens * D):], np.float32).reshape(tokens, blocks, NM + 2)

    res = np.array(residual.astype(mx.float32))
    want = np.empty_like(streams)
    for j in range(HC):   # v = post_j y, then + comb[i][j] R_i in order, each step rounded to fp32
        v = post[:, j:j + 1] * plain
        for i in range(HC):
            v = (v + comb[:, i, j:j + 1] * res[:, i]).astype(np.float32)
        want[:, j] = f32_bf16(v)
    np.testing.assert_array_equal(streams, want)
    hv = np.zeros((tokens, D), np.float32)
    for c in range(HC):
        hv = (hv + pre_in[:, c:c + 1] * streams[:, c]).astype(np.float32)
    np.testing.assert_array_equal(collapsed, f32_bf16(hv))

    xs = streams.astype(np.float64).reshape(tokens, HC, blocks, D // blocks)
    f = fn.astype(np.float64).reshape(NM, HC, blocks, D // blocks)
    exact = np.concatenate([np.einsum("mjbc,tjbc->tbm", f, xs), (xs ** 2).sum((1, 3))[..., None],
                            (collapsed.astype(np.float64).reshape(tokens, blocks, -1) ** 2).sum(-1)[..., None]], -1)
    mag = np.concatenate([np.einsum("mjbc,tjbc->tbm", np.abs(f), np.abs(xs)), exact[..., NM:]], -1)
    assert np.isfinite(partial).all()
    assert (np.abs(partial - exact) <= 2 * HC * D // blocks * 2.0 ** -24 * mag + 1e-30).all()
