"""A projection and its tail in one launch (dsv4/kernels/matvec_tail.py, flag
`kernel_matvec_tail`) run on the host, CPU, in CI.

The bodies (the tailed launch; the plain matvec and row-tail launches it replaces) are compiled
with clang under test_kernels_matvec's threadgroup emulator with bf16 activations and run as the
dispatchers launch them, inside `pretend_gpu`: grids, templates and params are a GPU's. The
tailed launch must give the two launches' output bit for bit (the same sums in the same order,
the same stages), whichever of a token's threadgroups arrives last (the emulator runs them in a
given order), and leave its counters at zero for the next launch. The two launches themselves
are checked against their references by test_kernels_matvec and test_kernels_rows_host.
"""

import subprocess

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import dialect, matvec as mv, matvec_tail, rows
from dsv4.linear import Linear, matrix_operand
from tests.test_kernels_decode_host import build_kernel
from tests.test_kernels_matvec import EMULATOR, inputs
from tests.test_kernels_mhc_host import EXTRAS
from tests.test_kernels_rows_host import PRELUDE, ROW_TAIL_MAIN

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

HOST = r"""
#define DEVICE_FENCE()
#define DEVICE_ARRIVE(c, i) (const_cast<uint32_t*>(c)[i]++)
#define DEVICE_RESET(c, i) (const_cast<uint32_t*>(c)[i] = 0u)
#define LOAD_CG(p) (*(p))
using T = bf16;
"""

# Inputs on stdin: rows N, tokens, threadgroups on y, the sizes of the norm weight and of cos/sin,
# the threadgroups' order, x, w, the scale bytes (mxfp8), then (the tailed launch) the norm
# weight, cos, sin, params; y (as fp32) then the counters on stdout.
MAIN = r"""
void body(const T* x, const uint32_t* w, Shape2 w_shape, const uint8_t* s, const uint32_t* b, const W* weight,
          const float* cosv, const float* sinv, const float* params, const uint32_t* arrivals, T* y, float* raw,
          uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int n = read_int(), tokens = read_int(), groups = read_int(), n_weight = read_int(), n_rope = read_int();
  std::vector<int> order(groups);
  for (int& g : order) g = read_int();
  auto x = read_as<T>((size_t)tokens * K);
  std::vector<uint32_t> w((size_t)n * K * BITS / 32);
  std::vector<uint8_t> s((size_t)n * K / GS);
  std::vector<uint32_t> b(1);
  read(w);
  read(s);
  std::vector<W> weight;
  std::vector<float> cosv, sinv, params;
  std::vector<uint32_t> arrivals(8, 0u);
  if (TAILED) {
    weight = read_as<W>(n_weight);
    cosv = read_as<float>(n_rope);
    sinv = read_as<float>(n_rope);
    params = read_as<float>(3);
  }
  std::vector<T> y((size_t)tokens * n, T(NAN));
  std::vector<float> raw((size_t)tokens * n, NAN);
  launch(32 * WARPS, groups, tokens, [&](int t, int g, int z, int threads) {
    body(x.data(), w.data(), Shape2{{n, 0}}, s.data(), b.data(), weight.data(), cosv.data(), sinv.data(),
         params.data(), arrivals.data(), y.data(), raw.data(), t, order[g], z, threads);
  });
  for (const T& v : y) { const float f = float(v); std::fwrite(&f, 4, 1, stdout); }
  for (uint32_t c : arrivals) { const float f = (float)c; std::fwrite(&f, 4, 1, stdout); }
  return 0;
}
"""


class Emulated:
    """pretend_gpu's launch for the plain matvec, the row tail and the tailed launch, built and
    run on the host; `order(groups)` gives the order the threadgroups run in."""

    def __init__(self, folder):
        self.folder, self.launches, self.counters = folder, [], []
        self.order = lambda groups: list(range(groups))

    def exe(self, kernel, template, main, extra: str):
        return build_kernel(self.folder, kernel, template, EMULATOR + EXTRAS + PRELUDE + HOST, main, after=extra)

    def __call__(self, kernel, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value):
        self.launches.append(kernel.name)
        if kernel is rows.ROW_TAIL_KERNEL:
            x, weight, cos, sin, params = inputs
            head = np.array([threadgroup[0], grid[0] // threadgroup[0], weight.size, cos.size], np.int32).tobytes()
            extra = f"using W = {'bf16' if weight.dtype == mx.bfloat16 else 'float'};\nusing O = T;\n"
            out = self.run(kernel, template, ROW_TAIL_MAIN, extra, head, x, weight, cos, sin, params)
            return [mx.array(out.reshape(output_shapes[0])).astype(output_dtypes[0])]
        assert kernel in (mv.MATVEC_KERNEL, matvec_tail.TAIL_KERNEL), kernel.name
        tailed = kernel is matvec_tail.TAIL_KERNEL
        x, w, s, b, *tail = inputs
        n, tokens, groups = output_shapes[0][-1], grid[2], grid[1]
        assert dict(template)["MODE"] == mv.MODE_IDS["mxfp8"]
        extra = (f"constexpr int TAILED = {int(tailed)};\n"
                 + ("" if tailed else "constexpr int D = 1, R = 0;\n")
                 + f"using W = {'bf16' if tailed and tail[0].dtype == mx.bfloat16 else 'float'};\n"
                 + f"constexpr int WARPS = {threadgroup[0] // 32};\n")
        order = self.order(groups)
        assert sorted(order) == list(range(groups))
        sizes = [tail[0].size, tail[1].size] if tailed else [0, 0]
        head = np.array([n, tokens, groups, *sizes, *order], np.int32).tobytes()
        arrays = [x, w, s]
        out = self.run(kernel, template, MAIN, extra, head, *arrays, *(tail[:4] if tailed else []))
        y, counters = out[:-8], out[-8:]
        self.counters.append(counters)
        return [mx.array(y.reshape(output_shapes[0])).astype(output_dtypes[0])] + (
            [mx.zeros(output_shapes[1], mx.float32)] if tailed else [])

    def run(self, kernel, template, main, extra, head, *arrays):
        def raw(a):   # uint8 scales and packed words go as they are; values as fp32
            return np.array(a if a.dtype in (mx.uint8, mx.uint32) else a.astype(mx.float32)).tobytes()
        data = head + b"".join(raw(a) for a in arrays)
        out = subprocess.run([str(self.exe(kernel, template, main, extra))], input=data, capture_output=True,
                             check=True).stdout
        return np.frombuffer(out, np.float32)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return Emulated(tmp_path_factory.mktemp("matvec_tail"))


def projection(rng, n, k):
    """An [n, k] projection as the model holds wq_a and wkv: mxfp8."""
    layer = Linear(k, n, bias=False)
    layer.weight = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    return matrix_operand(layer.to_quantized(32, 8, "mxfp8"))


def both_ways(emulated, x, q, act_quant, norm, rope, qdq, order=None):
    """(the matvec and row-tail launches' output, the tailed launch's), run on the host."""
    emulated.launches.clear()
    with dialect.pretend_gpu("cuda", emulated), dialect.poisoned_outputs(), \
            flags.override(kernel_matvec_tail=True, kernel_matvec="on"):
        assert matvec_tail.applies(x, q, qdq)
        two = rows.row_tail(mv.quantized_matvec(x, q, act_quant), norm, rope, qdq)
        mx.eval(two)
        if order is not None:
            emulated.order = order
        try:
            one = matvec_tail.projection_tail(x, q, act_quant, matvec_tail.arrivals(), norm, rope, qdq)
            mx.eval(one)
        finally:
            emulated.order = lambda groups: list(range(groups))
    assert emulated.launches == [mv.MATVEC_KERNEL.name, rows.ROW_TAIL_KERNEL.name, matvec_tail.TAIL_KERNEL.name]
    return two, one


def bits(a):
    return np.array(a.astype(mx.float32)).view(np.uint32)


# (rows N, inputs K, act_quant, the tail): the q-LoRA latent (norm, fp8; 40 threadgroups of 8
# rows) and the window KV row (norm, RoPE, fp8; K split over 2 SIMD groups) at toy widths.
CASES = [(320, 256, False, True, 0, rows.FP8), (128, 512, True, True, 16, rows.FP8)]


@pytest.mark.parametrize("n,k,act_quant,norm,R,qdq", CASES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_one_launch_is_the_two_bit_for_bit(emulated, n, k, act_quant, norm, R, qdq, tokens):
    rng = np.random.default_rng([n, k, tokens])
    q = projection(rng, n, k)
    x = mx.array(inputs(rng, tokens, k)).astype(mx.bfloat16)
    weight = (mx.array(rng.uniform(0.5, 1.5, n).astype(np.float32)).astype(mx.bfloat16), 1e-6) if norm else None
    angles = mx.array(rng.uniform(-np.pi, np.pi, R).astype(np.float32))
    rope = (mx.cos(angles), mx.sin(angles)) if R else None
    two, one = both_ways(emulated, x, q, act_quant, weight, rope, qdq)
    assert one.shape == two.shape == (tokens, n) and one.dtype == two.dtype == mx.bfloat16
    assert np.array_equal(bits(one), bits(two))
    assert not np.isnan(np.array(one.astype(mx.float32))).any()
    assert np.all(emulated.counters[-1] == 0), "the counters must be back at zero for the next launch"


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_any_threadgroup_may_arrive_last(emulated, order):
    """The tail runs once, on whichever threadgroup of the token arrives last."""
    rng = np.random.default_rng(7)
    n, k = 320, 256
    q = projection(rng, n, k)
    x = mx.array(inputs(rng, 2, k)).astype(mx.bfloat16)
    norm = (mx.array(rng.uniform(0.5, 1.5, n).astype(np.float32)).astype(mx.bfloat16), 1e-6)
    pick = {"reversed": lambda g: list(range(g))[::-1],
            "shuffled": lambda g: [int(i) for i in np.random.default_rng(g).permutation(g)]}[order]
    two, one = both_ways(emulated, x, q, False, norm, None, rows.FP8, order=pick)
    assert np.array_equal(bits(one), bits(two))
    assert np.all(emulated.counters[-1] == 0)
