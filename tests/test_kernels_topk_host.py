"""The indexer's top-k kernel body (dsv4/kernels/topk.py) on the host in CI: compiled with clang
under the threadgroup emulator of test_kernels_matvec (a fiber per thread, the SIMD exchanges
between them, 1024 threads a query as on the GPU), against test_kernels_topk's numpy oracle:
the k largest scores (ties to the lower row), -1 where the query cannot see the row. The
threshold digit of each radix pass is where most of the cases below differ: one bin holding
every row, ties across the k-th row, the digit in the last SIMD lane's bins (0-7), k = N."""

import subprocess

import numpy as np
import pytest

from dsv4.kernels import topk
from tests.test_kernels_decode_host import build_host
from tests.test_kernels_matvec import EMULATOR
from tests.test_kernels_topk import oracle, random_scores

# Threadgroup atomics need nothing more between fibers, which never run at the same time.
ATOMICS = r"""
#define SHARED_ATOMIC_U32 static uint32_t
#define ATOMIC_ADD(x, v) ((x) += (v))
#define ATOMIC_LOAD(x) (x)
#define ATOMIC_STORE(x, v) ((x) = (v))
struct Shape3 { int v[3]; int operator[](int i) const { return v[i]; } };
"""

MAIN = r"""
void body(const float* scores, Shape3 scores_shape, const int* positions, const int* kparam, int* out,
          uint32_t tid, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int queries = read_int(), n = read_int(), k = read_int();
  std::vector<float> scores((size_t)queries * n);
  std::vector<int> positions(S), out((size_t)queries * k, -7);
  read(scores); read(positions);
  const Shape3 shape{{1, queries, n}};
  const int kparam[1] = {k};
  launch(THREADS, 1, queries, [&](int t, int g, int z, int threads) {
    body(scores.data(), shape, positions.data(), kparam, out.data(), t, z, threads);
  });
  std::fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}
"""


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    folder, built = tmp_path_factory.mktemp("topk"), {}

    def exe(s: int, ratio: int):
        if (s, ratio) not in built:
            consts = dict(THREADS=topk.THREADS, S=s, RATIO=ratio)
            source = (EMULATOR + ATOMICS + "".join(f"constexpr int {n} = {v};\n" for n, v in consts.items())
                      + topk._HEADER + MAIN.replace("BODY", topk.TOPK_KERNEL.body))
            built[s, ratio] = build_host(folder, f"topk_{s}_{ratio}", source)
        return built[s, ratio]
    return exe


def run(exe, scores: np.ndarray, k: int, positions: np.ndarray) -> np.ndarray:
    s, n = scores.shape
    data = (np.array([s, n, k], np.int32).tobytes() + scores.astype(np.float32).tobytes()
            + positions.astype(np.int32).tobytes())
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    return np.frombuffer(out, np.int32).reshape(s, k)


@pytest.mark.parametrize("s,n,k,ratio,case", [
    (1, 513, 512, 1, "normal"),     # the slice at 512: all rows but one
    (2, 700, 64, 4, "ties"),        # ties across the k-th row; two queries
    (1, 300, 100, 1, "equal"),      # one score everywhere: every pass's digit in one bin
    (2, 257, 5, 4, "small"),        # tiny positive scores: codes whose top digit sits in lane 15's bins
    (1, 64, 64, 1, "negative"),     # k = N, every score negative (digits in the last lanes)
])
def test_topk_body_picks_the_oracle_rows(build, s, n, k, ratio, case):
    rng = np.random.default_rng()
    if case == "equal":
        scores = np.full((s, n), 0.75, np.float32)
    elif case == "small":
        scores = rng.uniform(1e-30, 1e-20, (s, n)).astype(np.float32)
    elif case == "negative":
        scores = -rng.uniform(0.5, 3.0, (s, n)).astype(np.float32)
    else:
        scores = random_scores(rng, (s, n), ties=case == "ties")
    positions = np.sort(rng.integers(0, n * ratio, s)).astype(np.int32)
    got = run(build(s, ratio), scores, k, positions)
    want = oracle(scores[None], k, positions, ratio)[0]
    for j in range(s):
        assert sorted(got[j]) == sorted(want[j]), j
