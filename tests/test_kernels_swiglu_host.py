"""The experts' hidden-activation kernel (dsv4/kernels/swiglu.py) run on the host, CPU, in CI:
its body compiled with clang under test_kernels_matvec's threadgroup emulator and launched as
the dispatcher launches it (`hidden` inside `pretend_gpu`). Against the plain-MLX reference,
whose silu is g * sigmoid(g) where the kernel's is g / (1 + exp(-g)): rounded to bf16 or fp8,
the same bits for nearly every value, the rest within a rounding step of their block; in fp32,
within a few ulps. Without a compiler the tests fail."""

import subprocess

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import dialect, swiglu
from tests.test_kernels_decode_host import build_host
from tests.test_kernels_matvec import EMULATOR
from tests.test_kernels_mhc_host import EXTRAS

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

# Inputs on stdin: threadgroup size, values, then gate, up (as fp32), route, params; out on stdout
# (fp32 widenings of T), NaN where the body left it unwritten.
MAIN = r"""
std::vector<float> read_floats(size_t n) { std::vector<float> f(n); read(f); return f; }
void body(const T* gate, const T* up, const float* route, const float* params, T* out, uint32_t tid,
          uint32_t group_x, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int threads = read_int(), n = read_int();
  auto gf = read_floats(n), uf = read_floats(n), route = read_floats(n / I), params = read_floats(1);
  std::vector<T> gate(gf.begin(), gf.end()), up(uf.begin(), uf.end()), out(n, T(NAN));
  launch(threads, n / threads, 1, [&](int t, int g, int, int group_threads) {
    body(gate.data(), up.data(), route.data(), params.data(), out.data(), t, g, group_threads);
  });
  for (const T& v : out) { const float f = float(v); std::fwrite(&f, 4, 1, stdout); }
  return 0;
}
"""

TYPES = {mx.float32: "float", mx.bfloat16: "bf16"}


class Emulated:
    def __init__(self, folder):
        self.folder, self.built, self.launches = folder, {}, []

    def __call__(self, kernel, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value):
        assert kernel is swiglu.KERNEL and grid[1:] == (1, 1) and grid[0] % threadgroup[0] == 0
        self.launches.append((grid, threadgroup, dict(template)))
        key = tuple(template)
        if key not in self.built:
            consts = "".join(f"constexpr int {k} = {int(v)};\n" for k, v in template if k != "T")
            alias = f"using T = {TYPES[dict(template)['T']]};\n"
            self.built[key] = build_host(self.folder, f"swiglu_{len(self.built)}", EMULATOR + EXTRAS + consts + alias
                                         + kernel.header + MAIN.replace("BODY", kernel.body))
        gate, up, route, params = inputs
        head = np.array([threadgroup[0], gate.size], np.int32).tobytes()
        data = head + b"".join(np.array(a.astype(mx.float32)).tobytes() for a in (gate, up, route, params))
        out = subprocess.run([str(self.built[key])], input=data, capture_output=True, check=True).stdout
        return [mx.array(np.frombuffer(out, np.float32).reshape(output_shapes[0])).astype(output_dtypes[0])]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return Emulated(tmp_path_factory.mktemp("swiglu"))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("act_quant", [True, False])
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_hidden_kernel_against_the_reference(emulated, dtype, act_quant, limit):
    """A prefill chunk's sorted pairs ([P, 1, I], as RoutedExperts hands them over) with gate and
    up values past the clamp, router weights, a zero row: one launch of whole threadgroups."""
    rng = np.random.default_rng(7)
    P, I = 96, 256
    g = mx.array((rng.standard_normal((P, 1, I)) * 6).astype(np.float32)).astype(dtype)
    u = mx.array((rng.standard_normal((P, 1, I)) * 6).astype(np.float32)).astype(dtype)
    g[3] = 0.0
    w = mx.array(rng.uniform(0.05, 1.0, P).astype(np.float32))
    emulated.launches.clear()
    with dialect.pretend_gpu("cuda", emulated), dialect.poisoned_outputs():
        assert swiglu.kernel_applies(g, u)
        got = np.array(swiglu.hidden(g, u, w, limit, act_quant).astype(mx.float32))
    assert [(grid, tg) for grid, tg, _ in emulated.launches] == [((P * I, 1, 1), (256, 1, 1))]
    want = np.array(swiglu.swiglu_hidden_reference(g, u, w, limit, act_quant).astype(mx.float32))
    if dtype == mx.bfloat16 or act_quant:   # a rounding absorbs the two silus' fp32 differences
        assert np.mean(got == want) > 0.99
    blocks = np.abs(want).reshape(-1, 32).max(-1, keepdims=True)
    step = 2.0 ** -2 if act_quant else (2.0 ** -7 if dtype == mx.bfloat16 else 2.0 ** -20)
    assert (np.abs(got - want).reshape(-1, 32) <= step * blocks).all()


@pytest.mark.parametrize("tokens", [2, 16])   # the few-rows path (2 x 6 pairs) and the sorted pairs
def test_routed_experts_take_the_kernel_and_the_switch_rolls_it_back(emulated, tokens):
    """RoutedExperts hands its gate and up products to the kernel under CUDA (its sorted pairs at
    prefill, its few rows otherwise): the same output as with DSV4_KERNEL_SWIGLU off (the
    reference) to within the kernel's rounding steps; on Metal auto leaves it off."""
    from dsv4.config import ModelArgs
    from dsv4.moe import RoutedExperts
    from dsv4.testing import tiny_config
    args = ModelArgs.from_dict(tiny_config())
    experts = RoutedExperts(args)
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((tokens, args.hidden_size)).astype(np.float32)).astype(mx.bfloat16)
    ids = mx.array(np.stack([rng.choice(args.n_routed_experts, args.num_experts_per_tok, replace=False)
                             for _ in range(tokens)]).astype(np.int32))
    weights = mx.array(rng.uniform(0.1, 1.0, ids.shape).astype(np.float32))
    emulated.launches.clear()
    with dialect.pretend_gpu("cuda", emulated), flags.override(kernel_qdq=False):   # x's rounding: plain MLX
        got = np.array(experts(x, ids, weights))
        assert len(emulated.launches) == 1
        with flags.override(kernel_swiglu="off"):
            want = np.array(experts(x, ids, weights))
    with dialect.pretend_gpu("metal", emulated), flags.override(kernel_qdq=False):
        experts(x, ids, weights)
    assert len(emulated.launches) == 1
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.02 * np.abs(want).max())
    assert np.mean(np.isclose(got, want, rtol=1e-2, atol=1e-3 * np.abs(want).max())) > 0.95
