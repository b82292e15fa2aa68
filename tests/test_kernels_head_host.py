"""The head kernel's body (dsv4/kernels/head.py) run on the host in CI: compiled with clang under
the threadgroup emulator of test_kernels_matvec (a thread per lane, the SIMD sums in lane order),
the weight's shape given at run time as MLX gives it, at shapes whose rows and chunks do not fill
the last threadgroup or the last lane's turn; against the exact float64 product."""

import subprocess

import mlx.core as mx
import numpy as np
import pytest

from dsv4.kernels import head
from tests.test_kernels_decode_host import build_host
from tests.test_kernels_matvec import EMULATOR


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return np.array(mx.array(a).astype(mx.bfloat16).view(mx.uint16))


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return np.array(mx.array(bits).view(mx.bfloat16).astype(mx.float32))

MAIN = r"""
void body(const X* x, const uint16_t* w, Shape2 w_shape, float* out,
          uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int v = read_int(), d = read_int();
  std::vector<X> x((size_t)TOK * d);
  std::vector<uint16_t> w((size_t)v * d);
  std::vector<float> out((size_t)TOK * v, NAN);
  read(x); read(w);
  launch(32 * WARPS, (v + WARPS * ROWS - 1) / (WARPS * ROWS), 1, [&](int t, int g, int z, int threads) {
    body(x.data(), w.data(), Shape2{{v, d}}, out.data(), t, g, z, threads);
  });
  std::fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}
"""


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """One executable per (token count, x in bf16): the kernel's template values; D and V are
    the run's, as on the GPU."""
    made = {}

    def get(tokens: int, x_bf16: bool):
        if (tokens, x_bf16) not in made:
            consts = dict(WARPS=head.WARPS, ROWS=head.ROWS, TOK=tokens, X_BF16=int(x_bf16))
            source = (EMULATOR + "".join(f"constexpr int {k} = {v};\n" for k, v in consts.items())
                      + f"using X = {'uint16_t' if x_bf16 else 'float'};\n"
                      + MAIN.replace("BODY", head.HEAD_KERNEL.body))
            made[tokens, x_bf16] = build_host(tmp_path_factory.mktemp("head"), f"head_{tokens}_{int(x_bf16)}", source)
        return made[tokens, x_bf16]
    return get


@pytest.mark.parametrize("tokens,d,v,x_bf16", [
    (1, 264, 45, False),     # 33 chunks of 8: lane 0 takes two; 45 rows: the last threadgroup's 13
    (1, 512, 32, False),     # one threadgroup exactly
    (8, 64, 13, False),      # fewer chunks than lanes
    (1, 520, 101, True),     # the router's case: bf16 x
    (1, 136, 7, True),
])
def test_head_body_on_the_host(builds, tokens, d, v, x_bf16):
    rng = np.random.default_rng()
    w = bf16_bits(rng.standard_normal((v, d)).astype(np.float32) / np.sqrt(d))
    x = rng.standard_normal((tokens, d)).astype(np.float32) * 3
    x_in = bf16_bits(x) if x_bf16 else x
    data = np.array([v, d], np.int32).tobytes() + x_in.tobytes() + w.tobytes()
    out = subprocess.run([str(builds(tokens, x_bf16))], input=data, capture_output=True, check=True).stdout
    got = np.frombuffer(out, np.float32).reshape(tokens, v).astype(np.float64)
    xs = (from_bf16_bits(x_in) if x_bf16 else x).astype(np.float64)
    ws = from_bf16_bits(w).astype(np.float64)
    want, mag = xs @ ws.T, np.abs(xs) @ np.abs(ws).T
    # fp32 products (exact for bf16 x) summed in fp32 in some order: within 2 D 2^-24 sum|x w|.
    assert np.all(np.abs(got - want) <= 2 * d * 2.0 ** -24 * mag), np.abs(got - want).max()
