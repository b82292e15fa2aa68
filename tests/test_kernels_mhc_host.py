"""The wide mHC decode path's bodies (dsv4/kernels/mhc.py, DSV4_KERNEL_MHC_WIDE) run on the host
in CI: compiled with clang under the threadgroup emulator of test_kernels_matvec (a thread per
lane, SIMD sums in lane order, shuffles through the same exchange), at widths whose last column
block is part-filled and at V4.1's (D = 5120: 160 partials per token), then checked against
float64 transcriptions of model-spec §2.2 and, where the arithmetic is the same, bit for bit:
the expand's streams against the current expand kernel's body, the collapse against fp32 sums
in index order, the fp8 copy against dsv4.quant.qdq_fp8."""

import subprocess

import mlx.core as mx
import numpy as np
import pytest

from dsv4.kernels import mhc
from dsv4.quant import qdq_fp8
from tests.test_kernels_decode_host import build_host
from tests.test_kernels_matvec import EMULATOR
from tests.test_kernels_mhc import oracle_mixes

HC, NM, ITERS = 4, 24, 20
NORM_EPS, HC_EPS, RMS_EPS = 1e-6, 1e-6, 1e-6

# What the emulator lacks for these bodies: RSQRT, DIV_RN, and bf16 as a type that rounds to
# nearest even on its way in.
EXTRAS = r"""
#define RSQRT(x) (1.0f / std::sqrt(x))
#define DIV_RN(a, b) ((a) / (b))
struct bf16 {
  uint16_t bits;
  bf16() = default;
  explicit bf16(float f) { const uint32_t u = host_as_uint(f); bits = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); }
  explicit operator float() const { return host_as_float((uint32_t)bits << 16); }
};
"""

MAIN = r"""
void entry_partials(const T* streams, const float* fn, const float* pre_in, float* partial, T* collapsed,
                    uint32_t tid, uint32_t group_x, uint32_t group_y) {
  EMULATED_IDS(tid)
  @ENTRY_PARTIALS@
}
void expand_partials(const T* y, const T* residual, const float* post, const float* comb, const float* fn,
                     const float* pre_in, T* out, float* partial, T* collapsed,
                     uint32_t tid, uint32_t group_x, uint32_t group_y) {
  EMULATED_IDS(tid)
  @EXPAND_PARTIALS@
}
void expand(const T* y, const T* residual, const float* post, const float* comb, T* out,
            uint32_t tid, uint32_t group_x, uint32_t group_y, uint32_t group_threads) {
  EMULATED_IDS(tid)
  @EXPAND@
}
template <bool FP8>
void finish(const float* partial, const float* scale, const float* base, const float* params, const T* collapsed,
            const T* weight, float* pre, float* post, float* comb, T* out, T* out_q,
            uint32_t tid, uint32_t group_x, uint32_t group_y) {
  EMULATED_IDS(tid)
  if (FP8) { @FINISH_FP8@ } else { @FINISH@ }
}
// T arrays travel as float32 both ways.
std::vector<T> read_t(size_t n) {
  std::vector<float> f(n);
  read(f);
  std::vector<T> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = T(f[i]);
  return t;
}
void write_t(const std::vector<T>& t) {
  for (const T& v : t) { const float f = float(v); std::fwrite(&f, 4, 1, stdout); }
}
std::vector<float> read_f(size_t n) { std::vector<float> f(n); read(f); return f; }
void write_f(const std::vector<float>& f) { std::fwrite(f.data(), 4, f.size(), stdout); }
// Outputs start as NaN, as the GPU tests poison them.
std::vector<T> nan_t(size_t n) { return std::vector<T>(n, T(NAN)); }

int main() {
  const int mode = read_int(), tok = read_int();
  constexpr int K = HC * D, P = SPLITS * (NM + 2);
  if (mode == 0) {
    auto streams = read_t((size_t)tok * K);
    auto fn = read_f((size_t)NM * K), pre_in = read_f(tok * HC);
    std::vector<float> partial((size_t)tok * P, NAN);
    auto collapsed = nan_t((size_t)tok * D);
    launch(32, SPLITS, tok, [&](int t, int g, int z, int) {
      entry_partials(streams.data(), fn.data(), pre_in.data(), partial.data(), collapsed.data(), t, g, z);
    });
    write_f(partial); write_t(collapsed);
  } else if (mode == 1 || mode == 2) {
    auto y = read_t((size_t)tok * D), residual = read_t((size_t)tok * K);
    auto post = read_f(tok * HC), comb = read_f(tok * HC * HC);
    auto out = nan_t((size_t)tok * K);
    if (mode == 1) {
      auto fn = read_f((size_t)NM * K), pre_in = read_f(tok * HC);
      std::vector<float> partial((size_t)tok * P, NAN);
      auto collapsed = nan_t((size_t)tok * D);
      launch(32, SPLITS, tok, [&](int t, int g, int z, int) {
        expand_partials(y.data(), residual.data(), post.data(), comb.data(), fn.data(), pre_in.data(),
                        out.data(), partial.data(), collapsed.data(), t, g, z);
      });
      write_t(out); write_f(partial); write_t(collapsed);
    } else {
      launch(256, (D + 255) / 256, tok, [&](int t, int g, int z, int threads) {
        expand(y.data(), residual.data(), post.data(), comb.data(), out.data(), t, g, z, threads);
      });
      write_t(out);
    }
  } else {
    auto partial = read_f((size_t)tok * P), scale = read_f(3), base = read_f(NM), params = read_f(3);
    auto collapsed = read_t((size_t)tok * D), weight = read_t(D);
    std::vector<float> pre(tok * HC, NAN), post(tok * HC, NAN), comb(tok * HC * HC, NAN);
    auto out = nan_t((size_t)tok * D), out_q = nan_t((size_t)tok * D);
    launch(256, (D + 255) / 256 + 1, tok, [&](int t, int g, int z, int) {
      if (mode == 4) finish<true>(partial.data(), scale.data(), base.data(), params.data(), collapsed.data(),
                                  weight.data(), pre.data(), post.data(), comb.data(), out.data(), out_q.data(), t, g, z);
      else finish<false>(partial.data(), scale.data(), base.data(), params.data(), collapsed.data(),
                         weight.data(), pre.data(), post.data(), comb.data(), out.data(), out.data(), t, g, z);
    });
    write_f(pre); write_f(post); write_f(comb); write_t(out); write_t(out_q);
  }
  return 0;
}
"""


class Emulated:
    """The four bodies of one (D, dtype) build, run on float32 numpy inputs."""

    def __init__(self, folder, D: int, bf16: bool):
        self.D, self.splits = D, mhc._column_blocks(HC, D)
        consts = dict(HC=HC, NM=NM, D=D, ITERS=ITERS, SPLITS=self.splits)
        bodies = dict(ENTRY_PARTIALS=mhc.ENTRY_PARTIALS_KERNEL, EXPAND_PARTIALS=mhc.EXPAND_PARTIALS_KERNEL,
                      EXPAND=mhc.EXPAND_KERNEL, FINISH_FP8=mhc.ENTRY_FINISH_FP8_KERNEL,
                      FINISH=mhc.ENTRY_FINISH_KERNEL)
        main = MAIN
        for key, kernel in bodies.items():
            main = main.replace(f"@{key}@", "{" + kernel.body + "}")
        source = (EMULATOR + EXTRAS + "".join(f"constexpr int {k} = {v};\n" for k, v in consts.items())
                  + f"using T = {'bf16' if bf16 else 'float'};\n" + mhc._WIDE_HEADER + main)
        self.exe = build_host(folder, f"mhc_{D}_{int(bf16)}", source)

    def run(self, mode: int, tokens: int, *arrays, sizes):
        data = np.array([mode, tokens], np.int32).tobytes() + b"".join(
            np.ascontiguousarray(a, np.float32).tobytes() for a in arrays)
        out = np.frombuffer(subprocess.run([str(self.exe)], input=data, capture_output=True, check=True).stdout,
                            np.float32)
        assert out.size == sum(sizes)
        return np.split(out, np.cumsum(sizes)[:-1])

    def entry_partials(self, X, fn, pre_in):
        t = X.shape[0]
        return self.run(0, t, X, fn, pre_in, sizes=[t * self.splits * (NM + 2), t * self.D])

    def expand_partials(self, y, R, post, comb, fn, pre_in):
        t = R.shape[0]
        return self.run(1, t, y, R, post, comb, fn, pre_in,
                        sizes=[t * HC * self.D, t * self.splits * (NM + 2), t * self.D])

    def expand(self, y, R, post, comb):
        return self.run(2, R.shape[0], y, R, post, comb, sizes=[R.size])[0]

    def finish(self, fp8, partial, scale, base, collapsed, weight):
        t = collapsed.shape[0]
        return self.run(4 if fp8 else 3, t, partial, scale, base, [NORM_EPS, HC_EPS, RMS_EPS], collapsed, weight,
                        sizes=[t * HC, t * HC, t * HC * HC, t * self.D, t * self.D])


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    made = {}

    def get(D, bf16):
        if (D, bf16) not in made:
            made[D, bf16] = Emulated(tmp_path_factory.mktemp("mhc"), D, bf16)
        return made[D, bf16]
    return get


def rounded(a: np.ndarray, bf16: bool) -> np.ndarray:
    """a as the kernel's T holds it (bf16: rounded to nearest even), in float32."""
    return np.array(mx.array(a, mx.float32).astype(mx.bfloat16).astype(mx.float32)) if bf16 else a.astype(np.float32)


def site(rng, tokens, D, bf16):
    X = rounded(rng.standard_normal((tokens, HC, D)).astype(np.float32), bf16)
    fn = (rng.standard_normal((NM, HC * D)) / np.sqrt(HC * D)).astype(np.float32)
    pre_in = rng.uniform(0.2, 1.0, (tokens, HC)).astype(np.float32)
    return X, fn, pre_in


def finish_inputs(rng, D, bf16):
    """A site's scale, base and norm weight."""
    return (rng.uniform(0.5, 2.0, 3).astype(np.float32), rng.standard_normal(NM).astype(np.float32),
            rounded(rng.uniform(0.5, 1.5, D).astype(np.float32), bf16))


def expand_inputs(rng, tokens, D, bf16):
    """An expand's sublayer output y and the site's post and comb."""
    return (rounded(rng.standard_normal((tokens, D)).astype(np.float32), bf16),
            rng.uniform(0, 2, (tokens, HC)).astype(np.float32), rng.uniform(0, 1, (tokens, HC, HC)).astype(np.float32))


def collapse_in_order(X, pre, bf16):
    """The collapse as fp32 sums in index order (c = 0..HC-1), rounded to T: the same roundings
    the kernels are written to make (the host build contracts no FMA)."""
    v = np.zeros(X.shape[::2], np.float32)
    for c in range(HC):
        v = v + pre[:, c:c + 1] * X[:, c]
    return rounded(v, bf16)


def check_sums(parts, X, fn, h=None):
    """parts [tokens, NM + 1 (+ 1 with h)]: the projections and the sum of squares of the
    streams X (and of h) are the float64 ones within fp32 summation (2 K 2^-24 of the sum of
    magnitudes)."""
    t, _, D = X.shape
    K = HC * D
    x = X.reshape(t, K).astype(np.float64)
    squares = [x] + ([h.astype(np.float64)] if h is not None else [])
    want = np.concatenate([x @ fn.T.astype(np.float64)] + [(v * v).sum(1, keepdims=True) for v in squares], axis=1)
    mag = np.concatenate([np.abs(x) @ np.abs(fn.T.astype(np.float64)), want[:, NM:]], axis=1)
    assert np.all(np.abs(parts - want) <= 2 * K * 2.0 ** -24 * mag + 1e-30), np.abs(parts - want).max()


def check_partials(partial, collapsed, X, fn, pre_in, splits, bf16):
    """Summed over the splits, the projections and sums of squares are the float64 ones
    within fp32 summation (check_sums); the collapse is bit-exact."""
    t, _, D = X.shape
    parts = partial.reshape(t, splits, NM + 2).astype(np.float64).sum(1)
    h = collapsed.reshape(t, D)
    np.testing.assert_array_equal(h, collapse_in_order(X, pre_in, bf16))
    check_sums(parts, X, fn, h)


def check_finish(got, fn, scale, base, collapsed, weight, X, fp8, bf16):
    """The mixes are model-spec §2.2's in float64 (from the streams) within the fp32 tolerance
    of test_kernels_mhc; x is w h rsqrt(mean(h^2) + eps) of the kernel's collapse within one
    rounding to T; the fp8 copy is qdq_fp8(x) bit for bit."""
    pre, post, comb, x, x_q = got
    t, _, D = X.shape
    want = oracle_mixes(X.astype(np.float64), fn.astype(np.float64), scale.astype(np.float64),
                        base.astype(np.float64), NORM_EPS, HC_EPS, ITERS)
    for g, w in zip((pre, post, comb), want):
        np.testing.assert_allclose(g.reshape(w.shape), w, rtol=2e-5, atol=1e-6)
    h = collapsed.reshape(t, D).astype(np.float64)
    want_x = weight.astype(np.float64) * h / np.sqrt((h * h).mean(1, keepdims=True) + RMS_EPS)
    rtol = 2.0 ** -8 + 1e-6 if bf16 else 1e-6
    np.testing.assert_allclose(x.reshape(t, D), want_x, rtol=rtol, atol=1e-30)
    if fp8:
        T = mx.bfloat16 if bf16 else mx.float32
        want_q = np.array(qdq_fp8(mx.array(x.reshape(t, D)).astype(T)).astype(mx.float32))
        np.testing.assert_array_equal(x_q.reshape(t, D), want_q)


@pytest.mark.parametrize("tokens,D,bf16,fp8", [
    (2, 96, True, True),        # 3 column blocks; one finish threadgroup of 256 with 160 idle lanes
    (1, 100, False, False),     # the last column block has one live quad of 8; D % 32 != 0: no fp8 copy
    (1, 5120, True, True),      # V4.1: 160 partials per token, 20 normalising threadgroups
])
def test_site_entry_on_the_host(builds, tokens, D, bf16, fp8):
    rng = np.random.default_rng()
    em = builds(D, bf16)
    X, fn, pre_in = site(rng, tokens, D, bf16)
    partial, collapsed = em.entry_partials(X, fn, pre_in)
    check_partials(partial, collapsed, X, fn, pre_in, em.splits, bf16)
    scale, base, weight = finish_inputs(rng, D, bf16)
    got = em.finish(fp8, partial, scale, base, collapsed.reshape(tokens, D), weight)
    check_finish(got, fn, scale, base, collapsed, weight, X, fp8, bf16)
    # The reference of the whole entry (plain MLX, fp32): x within one rounding to T of it, plus
    # what the two collapses' fp32 sums (each in its own order) may differ by, carried through
    # the norm: HC terms a sum, a few 2^-24 of sum |pre X| each, times weight / rms. A collapse
    # that nearly cancels makes that term, not the rounding, the larger (one run in ~15 failed
    # the rounding alone at D = 100, fp32).
    T = mx.bfloat16 if bf16 else mx.float32
    ref = mhc.hc_mixes_collapse_norm_reference(
        mx.array(X).astype(T), mx.array(pre_in), mx.array(fn), mx.array(scale), mx.array(base),
        mx.array(weight).astype(T), RMS_EPS, NORM_EPS, HC_EPS, ITERS)
    ref_x = np.array(ref[0].astype(mx.float32))
    ulp = 2.0 ** -7 if bf16 else 2.0 ** -22
    h = collapsed.reshape(tokens, D).astype(np.float64)
    rms = np.sqrt((h * h).mean(1, keepdims=True) + RMS_EPS)
    sums = 2 * HC * 2.0 ** -24 * np.einsum("tc,tcd->td", np.abs(pre_in), np.abs(X)) * weight / rms
    assert np.all(np.abs(got[3].reshape(tokens, D) - ref_x) <= ulp * np.abs(ref_x) + sums + 1e-30)


@pytest.mark.parametrize("tokens,D,bf16", [(2, 96, True), (1, 100, False), (1, 5120, True)])
def test_expand_partials_on_the_host(builds, tokens, D, bf16):
    """The expand's new streams are the current expand kernel's bit for bit (the same fp32
    operations in the same order); their projection and collapse are checked as the entry's."""
    rng = np.random.default_rng()
    em = builds(D, bf16)
    R, fn, pre_in = site(rng, tokens, D, bf16)
    y, post, comb = expand_inputs(rng, tokens, D, bf16)
    out, partial, collapsed = em.expand_partials(y, R, post, comb, fn, pre_in)
    np.testing.assert_array_equal(out, em.expand(y, R, post, comb))
    X = out.reshape(tokens, HC, D)
    want = (post[..., None].astype(np.float64) * y[:, None, :]
            + np.einsum("tij,tid->tjd", comb.astype(np.float64), R.astype(np.float64)))
    rtol = 2.0 ** -8 if bf16 else 1e-6
    np.testing.assert_allclose(X, want, rtol=rtol, atol=1e-5)
    check_partials(partial, collapsed, X, fn, pre_in, em.splits, bf16)


# The prefill projection (DSV4_KERNEL_MHC_TILES) against the per-token projection kernel: both
# bodies in one build, with the dispatcher's THREADS, SPLITS and CHUNK.
PROJECT_MAIN = r"""
void project(const T* streams, const float* fn, float* partial, uint32_t tid, uint32_t group_y,
             uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  @PROJECT@
}
void project_tiles(const T* streams, const float* fn, const float* params, float* partial, uint32_t tid,
                   uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  @PROJECT_TILES@
}
int main() {
  const int tok = read_int();
  constexpr int K = HC * D;
  std::vector<float> f((size_t)tok * K);
  read(f);
  std::vector<T> streams(f.size());
  for (size_t i = 0; i < f.size(); ++i) streams[i] = T(f[i]);
  std::vector<float> fn((size_t)NM * K), params = {(float)tok};
  read(fn);
  std::vector<float> one((size_t)tok * SPLITS * (NM + 1), NAN), tiles(one.size(), NAN);
  launch(THREADS, SPLITS, tok, [&](int t, int g, int z, int n) { project(streams.data(), fn.data(), one.data(), t, g, z, n); });
  launch(THREADS, SPLITS, (tok + TT - 1) / TT, [&](int t, int g, int z, int n) {
    project_tiles(streams.data(), fn.data(), params.data(), tiles.data(), t, g, z, n);
  });
  std::fwrite(one.data(), 4, one.size(), stdout);
  std::fwrite(tiles.data(), 4, tiles.size(), stdout);
  return 0;
}
"""


@pytest.mark.parametrize("tokens,D,splits,tt", [(9, 96, 2, 4), (7, 100, 1, 3), (5, 5120, 1, mhc.TILE_TOKENS)])
def test_projection_in_tiles_is_the_per_token_one(tmp_path, tokens, D, splits, tt):
    """A tile of tt tokens (the last one part-filled) gives each token's partial sums bit for bit
    as the per-token launch (the same threads, chunks and order), and those are float64's within
    fp32 summation; the 256 threads of the dispatcher at V4.1's width."""
    K = HC * D
    consts = dict(HC=HC, NM=NM, D=D, SPLITS=splits, CHUNK=-(-K // splits), TT=tt, THREADS=mhc.PROJECT_THREADS)
    main = (PROJECT_MAIN.replace("@PROJECT@", "{" + mhc.PROJECT_KERNEL.body + "}")
            .replace("@PROJECT_TILES@", "{" + mhc.PROJECT_TILES_KERNEL.body + "}"))
    source = (EMULATOR + EXTRAS + "".join(f"constexpr int {k} = {v};\n" for k, v in consts.items())
              + "using T = bf16;\n" + mhc._STREAM_HEADER + main)
    exe = build_host(tmp_path, f"project_{D}", source)
    rng = np.random.default_rng([tokens, D])
    X, fn, _ = site(rng, tokens, D, True)
    data = np.array([tokens], np.int32).tobytes() + X.astype(np.float32).tobytes() + fn.tobytes()
    out = np.frombuffer(subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout, np.float32)
    one, tiles = np.split(out, 2)
    np.testing.assert_array_equal(tiles.view(np.uint32), one.view(np.uint32))
    check_sums(one.reshape(tokens, splits, NM + 1).astype(np.float64).sum(1), X, fn)
