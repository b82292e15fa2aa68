"""The projection-tail kernels (dsv4/kernels/rows.py: dsv4_row_tail, dsv4_rope_angles) run on the
host, CPU, in CI, with the angles of several positions ([S, R]: a verify, a draft block).

The bodies are compiled with clang under test_kernels_matvec's threadgroup emulator (a thread per
lane, SIMD sums in lane order, shuffles through the lanes' exchange, barriers) and run as the
dispatchers launch them: `row_tail` and `rope_angles` run inside `pretend_gpu`, so the grid,
template and params (eps, rows per position, S) are the ones a GPU gets. The row tail is checked
against `row_tail_reference` bit for bit (rows whose sums of squares are exact in any order: the
norm's order cannot matter) or, for any values, within the norm's summation order; the rows of
position s against the one-position call with angles s. The angles against float64 cos/sin of
(offset + s) * scale / freqs. Without a compiler the tests fail rather than skip.
"""

import subprocess

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import dialect, rows
from tests.test_kernels_decode_host import build_kernel
from tests.test_kernels_matvec import EMULATOR
from tests.test_kernels_mhc_host import EXTRAS

# A kernel failure would make the dispatcher run the reference in its place: make it loud.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

# What the emulator and EXTRAS lack here: the accurate fp32 cosine and sine (the dialect's
# COS/SIN), arrays of any element type read from fp32 (T and W values widen exactly), and an fp32
# output that T values are stored into.
PRELUDE = r"""
#define COS(x) std::cos(x)
#define SIN(x) std::sin(x)
template <class V> std::vector<V> read_as(size_t n) {
  std::vector<float> f(n);
  read(f);
  return std::vector<V>(f.begin(), f.end());
}
struct Widened {   // an fp32 output the body stores its T values into (row_tail's dtype=)
  float v = NAN;
  Widened() = default;
  template <class U> Widened(U u) : v(float(u)) {}
  explicit operator float() const { return v; }
};
"""

# Inputs on stdin: threadgroup size, rows, the sizes of weight and cos/sin, then x, weight, cos,
# sin, params; out (O values, T's or their fp32 widening, as fp32) on stdout, NaN where the body
# left it unwritten.
ROW_TAIL_MAIN = r"""
void body(const T* x, const W* weight, const float* cosv, const float* sinv, const float* params, O* out,
          uint32_t tid, uint32_t group_x) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int threads = read_int(), n_rows = read_int(), n_weight = read_int(), n_rope = read_int();
  auto x = read_as<T>((size_t)n_rows * D);
  auto weight = read_as<W>(n_weight);
  auto cosv = read_as<float>(n_rope), sinv = read_as<float>(n_rope), params = read_as<float>(3);
  std::vector<O> out((size_t)n_rows * D, O(NAN));
  launch(threads, n_rows, 1, [&](int t, int g, int, int) {
    body(x.data(), weight.data(), cosv.data(), sinv.data(), params.data(), out.data(), t, g);
  });
  for (const O& v : out) { const float f = float(v); std::fwrite(&f, 4, 1, stdout); }
  return 0;
}
"""

# Inputs: threadgroup size, threadgroups in x and y, the outputs' size, offset, freqs, params;
# cos then sin on stdout.
ANGLES_MAIN = r"""
void body(const int* offset, const float* freqs, const float* params, float* cosv, float* sinv,
          uint32_t tid, uint32_t group_x, uint32_t group_y, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int threads = read_int(), groups_x = read_int(), groups_y = read_int(), n = read_int();
  const int offset = read_int();
  auto freqs = read_as<float>(R), params = read_as<float>(1);
  std::vector<float> cosv(n, NAN), sinv(n, NAN);
  launch(threads, groups_x * groups_y, 1, [&](int t, int g, int, int group_threads) {
    body(&offset, freqs.data(), params.data(), cosv.data(), sinv.data(), t, g % groups_x, g / groups_x,
         group_threads);
  });
  std::fwrite(cosv.data(), 4, n, stdout);
  std::fwrite(sinv.data(), 4, n, stdout);
  return 0;
}
"""

TYPES = {mx.float32: "float", mx.bfloat16: "bf16"}


def i32_bytes(*values) -> bytes:
    return np.array(values, np.int32).tobytes()


class Emulated:
    """pretend_gpu's launch of the two kernels, built and run on the host."""

    def __init__(self, folder):
        self.folder, self.launches = folder, []

    def exe(self, kernel, template, types, main):
        aliases = "".join(f"using {name} = {TYPES.get(dtype, dtype)};\n" for name, dtype in types)
        return build_kernel(self.folder, kernel, template, EMULATOR + EXTRAS + PRELUDE, main, after=aliases)

    def __call__(self, kernel, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value):
        self.launches.append((kernel.name, grid, threadgroup))
        assert grid[0] % threadgroup[0] == 0 and grid[2] == 1 and threadgroup[1:] == (1, 1)
        if kernel is rows.ROW_TAIL_KERNEL:
            x, weight, cos, sin, params = inputs
            T, (O,) = dict(template)["T"], output_dtypes
            assert x.dtype == T and O in (T, mx.float32)   # as stored, or widened (dtype=)
            assert grid[1] == 1
            head = i32_bytes(threadgroup[0], grid[0] // threadgroup[0], weight.size, cos.size)
            stored = ("O", T if O == T else "Widened")
            out = self.run(kernel, template, (("T", T), ("W", weight.dtype), stored), ROW_TAIL_MAIN, head,
                           x, weight, cos, sin, params)
            return [mx.array(out.reshape(output_shapes[0])).astype(O)]
        assert kernel is rows.ANGLES_KERNEL, kernel.name
        offset, freqs, params = inputs
        n = int(np.prod(output_shapes[0]))
        head = i32_bytes(threadgroup[0], grid[0] // threadgroup[0], grid[1], n) + np.array(offset).tobytes()
        out = self.run(kernel, template, (), ANGLES_MAIN, head, freqs, params)
        return [mx.array(a.reshape(output_shapes[0])) for a in np.split(out, 2)]

    def run(self, kernel, template, types, main, head, *arrays):
        data = head + b"".join(np.array(a.astype(mx.float32)).tobytes() for a in arrays)
        out = subprocess.run([str(self.exe(kernel, template, types, main))], input=data, capture_output=True,
                             check=True).stdout
        return np.frombuffer(out, np.float32)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return Emulated(tmp_path_factory.mktemp("rows"))


def row_tail(emulated, x, norm, rope, qdq):
    """rows.row_tail as a GPU launches it, on the host: one launch, a threadgroup of 256 per row."""
    emulated.launches.clear()
    with dialect.pretend_gpu("cuda", emulated), dialect.poisoned_outputs():
        got = rows.row_tail(x, norm, rope, qdq)
    assert emulated.launches == [(rows.ROW_TAIL_KERNEL.name, (rows.THREADS * (x.size // x.shape[-1]), 1, 1),
                                  (rows.THREADS, 1, 1))]
    return got


def rope_angles(emulated, offset, freqs, scale, positions=1):
    """rows.rope_angles as a GPU launches it, on the host: one launch, a row of threadgroups per position."""
    emulated.launches.clear()
    with dialect.pretend_gpu("cuda", emulated), dialect.poisoned_outputs():
        got = rows.rope_angles(mx.array([offset], mx.int32), freqs, scale, positions)
    R = freqs.shape[0]
    assert emulated.launches == [(rows.ANGLES_KERNEL.name, (-(-R // 32) * 32, positions, 1), (32, 1, 1))]
    return got


def bits(a: mx.array) -> np.ndarray:
    """The values as fp32 bit patterns (-0 is not +0)."""
    return np.array(a.astype(mx.float32)).view(np.uint32)


def wavelengths(R: int) -> mx.array:
    return mx.array((10000.0 ** (np.arange(0, 2 * R, 2) / (2 * R))).astype(np.float32))


def exact_sum_rows(rng, shape, dtype) -> mx.array:
    """Values k/8, |k| <= 40 (exact in bf16): the squares are multiples of 2^-6 and a row's sum
    stays below 2^16 (D <= 2048), so every partial sum is exact in fp32 and the norm's result
    does not depend on the summation order."""
    return mx.array(rng.integers(-40, 41, shape).astype(np.float32) / 8).astype(dtype)


def weight_of(rng, D, dtype):
    return mx.array(rng.uniform(0.5, 1.5, D).astype(np.float32)).astype(dtype)


# (T, D, norm, rounding): indexer queries/keys in fp32, window KV rows, compressed KV rows; 4
# rows (heads) a position, a batch of 2, so a row's position is (row / 4) % S.
TAILS = [(mx.float32, 128, True, rows.FP4), (mx.bfloat16, 512, True, rows.FP8),
         (mx.bfloat16, 512, False, rows.FP4_E4M3)]


@pytest.mark.parametrize("dtype,D,norm,qdq", TAILS)
def test_rows_of_several_positions_take_their_positions_angles(emulated, dtype, D, norm, qdq):
    """x [B, S, P, D], cos/sin [S, R]: bit for bit the reference; the rows of position s bit for bit
    the one-position call with angles row s (and not what angles row 0 would give them)."""
    rng = np.random.default_rng([D, qdq])
    B, S, P = 2, 3, 4
    x = exact_sum_rows(rng, (B, S, P, D), dtype)
    n = (weight_of(rng, D, dtype), 1e-6) if norm else None
    cs = rows.rope_angles_reference(mx.array([int(rng.integers(0, 70000))], mx.int32), wavelengths(32), 1.0,
                                    positions=S)
    got = row_tail(emulated, x, n, cs, qdq)
    assert got.shape == x.shape and got.dtype == dtype
    np.testing.assert_array_equal(bits(got), bits(rows.row_tail_reference(x, n, cs, qdq)))
    for s in range(S):
        one = row_tail(emulated, x[:, s:s + 1], n, (cs[0][s], cs[1][s]), qdq)
        np.testing.assert_array_equal(bits(got[:, s:s + 1]), bits(one), err_msg=f"position {s}")
        if s:
            first = rows.row_tail_reference(x[:, s:s + 1], n, (cs[0][0], cs[1][0]), qdq)
            assert not np.array_equal(bits(got[:, s:s + 1]), bits(first)), f"position {s} has position 0's angles"


@pytest.mark.parametrize("dtype,D,norm,qdq", TAILS)
def test_one_position_with_angles_r_is_the_reference(emulated, dtype, D, norm, qdq):
    """The decode step's call (S = 1, cos/sin [R]) is unchanged: bit for bit the reference, rows
    laid out [B, 1, D] and [1, 1, P, D]."""
    rng = np.random.default_rng([D, qdq, 1])
    n = (weight_of(rng, D, dtype), 1e-6) if norm else None
    cs = rows.rope_angles_reference(mx.array([int(rng.integers(0, 70000))], mx.int32), wavelengths(32), 1.0)
    for shape in [(2, 1, D), (1, 1, 4, D)]:
        x = exact_sum_rows(rng, shape, dtype)
        got = row_tail(emulated, x, n, cs, qdq)
        np.testing.assert_array_equal(bits(got), bits(rows.row_tail_reference(x, n, cs, qdq)), err_msg=str(shape))


def test_norm_of_any_rows_within_summation_order(emulated):
    """Gaussian bf16 rows at 3 positions: the norm's sum of squares (lanes, SIMD groups) is not
    MLX's order, so the unrounded tail is the reference's within one bf16 ulp, nearly all equal
    (tests/test_kernels_rows_gpu.py's bound); its fp8 rounding is the reference rounding of the
    kernel's own unrounded rows, bit for bit."""
    rng = np.random.default_rng(7)
    D, S = 512, 3
    x = mx.array(rng.standard_normal((2, S, 4, D)).astype(np.float32) * 3).astype(mx.bfloat16)
    n = (weight_of(rng, D, mx.bfloat16), 1e-6)
    cs = rows.rope_angles_reference(mx.array([int(rng.integers(0, 70000))], mx.int32), wavelengths(32), 1.0,
                                    positions=S)
    u = row_tail(emulated, x, n, cs, rows.NO_QDQ)
    w = rows.row_tail_reference(x, n, cs, rows.NO_QDQ)
    uf, wf = np.array(u.astype(mx.float32)), np.array(w.astype(mx.float32))
    assert np.all(np.abs(uf - wf) <= 2.0 ** -7 * np.abs(wf) + 1e-30), np.abs(uf - wf).max()
    assert np.mean(uf == wf) > 0.95
    got = row_tail(emulated, x, n, cs, rows.FP8)
    np.testing.assert_array_equal(bits(got), bits(rows.row_tail_reference(u, None, None, rows.FP8)))


def ulps(a) -> np.ndarray:
    """fp32 ulps of |a|."""
    return np.spacing(np.abs(np.asarray(a, np.float32)))


@pytest.mark.parametrize("R,scale", [(32, 1.0), (48, 4.0)])   # 48: a second threadgroup, 16 lanes idle
def test_rope_angles_of_several_positions_on_the_host(emulated, R, scale):
    """cos/sin [S, R] at positions offset + s: within 2 fp32 ulps of float64 cos/sin of the fp32
    angle (p * scale) * (1 / freqs) the body computes, and of the exact angle within that angle's
    rounding; row s bit for bit the one-position launch at offset + s."""
    S = 5
    freqs = wavelengths(R)
    f64 = np.array(freqs, np.float64)
    recip = np.float32(1.0) / np.array(freqs)   # correctly rounded, as DIV_RN
    for offset in (0, 509, 65531, 1_000_000):
        cos, sin = rope_angles(emulated, offset, freqs, scale, positions=S)
        assert cos.shape == sin.shape == (S, R)
        p = (offset + np.arange(S))[:, None]
        theta32 = (p.astype(np.float32) * np.float32(scale)) * recip
        theta = p * scale / f64
        for got, fn in ((np.array(cos), np.cos), (np.array(sin), np.sin)):
            want = fn(theta32.astype(np.float64))
            assert np.all(np.abs(got - want) <= 2 * ulps(want)), (offset, np.abs(got - want).max())
            assert np.all(np.abs(got - fn(theta)) <= np.abs(theta) * 2.0 ** -22 + 2 * ulps(want)), offset
        for s in range(S):
            one = rope_angles(emulated, offset + s, freqs, scale)
            assert one[0].shape == (R,)
            np.testing.assert_array_equal(bits(cos[s]), bits(one[0]), err_msg=f"{offset} + {s}")
            np.testing.assert_array_equal(bits(sin[s]), bits(one[1]), err_msg=f"{offset} + {s}")


def test_a_prefill_chunk_runs_its_tails_and_inverse_rope_as_row_kernels(emulated, monkeypatch):
    """DSV4_KERNEL_PREFILL_ROWS: a prefill chunk of the toy-width slice (every role: window-only,
    compressing, indexing and re-indexing layers; the indexer scoring) launches its projection
    tails and its output's inverse RoPE as row kernels with each position's angles, and only
    those (every other kernel is off). Each of those results is the plain ops' on the same input
    within one ulp of its dtype, nearly all bit for bit: the angles are rope_angles' fp32 cos/sin,
    not mx.fast.rope's own. (The logits are not compared: an ulp in one of 40960 query values
    moved this random slice's logits by up to 1-2%.)"""
    from benchmarks.slice_decode import ROLES, SMALL, build
    from dsv4 import attention
    from dsv4.generation import prefill
    from tests.test_model_gpu import KERNELS_OFF

    compared = []

    def compare(got, want, rounded):   # rounded: the dtype the values were rounded to
        g, w = (np.array(a.astype(mx.float32)) for a in (got, want))
        assert g.shape == w.shape
        assert np.all(np.abs(g - w) <= ulps(w) * (2 ** 16 if rounded == mx.bfloat16 else 1))
        compared.append((g == w).mean())

    finish_rows = attention.finish_rows

    def finish_both(x, norm=None, rot=None, qdq=None, fused=False, shape=None, dtype=None):
        got = finish_rows(x, norm, rot, qdq, fused, shape, dtype)
        if fused and rot is not None:
            plain = attention.Rotation(rot.offset, rot.freqs, rot.scale)   # no angles: plain ops
            compare(got, finish_rows(x, norm, plain, qdq, False, shape, dtype), x.dtype)
        return got

    def output_both(self, o, state):   # the de-rotated output as project_out receives it
        derotated = []
        with monkeypatch.context() as m:
            m.setattr(self, "project_out", lambda o, b, s: derotated.append(o) or project_out(self, o, b, s))
            got = output(self, o, state)
        compare(derotated[0], attention.rope(o, state.start, self._freqs, inverse=True), o.dtype)
        return got

    output, project_out = attention.Attention.output, attention.Attention.project_out
    monkeypatch.setattr(attention, "finish_rows", finish_both)
    monkeypatch.setattr(attention.Attention, "output", output_both)
    mx.random.seed(2)
    model = build({**SMALL, **ROLES})[0]
    ids = np.random.default_rng(3).integers(7, SMALL["vocab_size"], (1, 40))
    emulated.launches.clear()
    with (dialect.pretend_gpu("cuda", emulated),
          flags.override(**{**KERNELS_OFF, "kernel_rows": True, "kernel_prefill_rows": True},
                         indexer_skip=False, kv_qdq=False, act_quant=False)):
        mx.eval(prefill(model, ids, model.make_cache(), chunk=ids.shape[1]))
    names = [name for name, _, _ in emulated.launches]
    assert set(names) == {rows.ROW_TAIL_KERNEL.name, rows.ANGLES_KERNEL.name}
    layers = model.args.num_hidden_layers
    # per layer at least the q-LoRA latent, the queries, the window rows and the inverse RoPE
    assert names.count(rows.ROW_TAIL_KERNEL.name) >= 4 * layers
    assert len(compared) >= 3 * layers and min(compared) > 0.99, compared
