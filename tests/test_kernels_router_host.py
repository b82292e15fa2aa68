"""The router's tail (dsv4/kernels/router.py, also run by the routed experts kernel) on the host
in CI: its body compiled with clang under the threadgroup emulator of test_kernels_matvec (a
thread per lane, the SIMD exchanges between them), against a float64 transcription of the
router's definition: the k largest keys sqrt(softplus(l / temp)) + bias, ties to the lower
expert id, in descending key order, and their scores normalised and scaled."""

import subprocess

import numpy as np
import pytest

from dsv4.kernels import router
from tests.test_kernels_decode_host import build_host
from tests.test_kernels_matvec import EMULATOR

MAIN = r"""
void body(const float* logits, const float* bias, const float* params, int* ids, float* weights,
          uint32_t tid, uint32_t group_y, uint32_t group_z, uint32_t group_threads) {
  EMULATED_IDS(tid)
  BODY
}
int main() {
  const int tokens = read_int();
  std::vector<float> logits((size_t)tokens * E), bias(E), params(2), weights((size_t)tokens * K, NAN);
  std::vector<int> ids((size_t)tokens * K, -1);
  read(logits); read(bias); read(params);
  launch(32, tokens, 1, [&](int t, int g, int z, int threads) {
    body(logits.data(), bias.data(), params.data(), ids.data(), weights.data(), t, g, z, threads);
  });
  std::fwrite(ids.data(), 4, ids.size(), stdout);
  std::fwrite(weights.data(), 4, weights.size(), stdout);
  return 0;
}
"""


def run_router(tmp_path, logits, bias, k, temp, scale, norm):
    tokens, e = logits.shape
    consts = dict(E=e, K=k, NORM=int(norm))
    source = (EMULATOR + "".join(f"constexpr int {n} = {v};\n" for n, v in consts.items())
              + router.HEADER + MAIN.replace("BODY", router.ROUTER_KERNEL.body))
    exe = build_host(tmp_path, f"router_{e}_{k}", source)
    data = (np.array([tokens], np.int32).tobytes() + logits.astype(np.float32).tobytes()
            + bias.astype(np.float32).tobytes() + np.array([temp, scale], np.float32).tobytes())
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    ids = np.frombuffer(out[: tokens * k * 4], np.int32).reshape(tokens, k)
    return ids, np.frombuffer(out[tokens * k * 4:], np.float32).reshape(tokens, k)


def expected(logits, bias, k, temp, scale, norm):
    """float64: ids in descending key order (lower id first among equal keys), weights."""
    y = logits.astype(np.float64) / temp
    scores = np.sqrt(np.maximum(y, 0) + np.log1p(np.exp(-np.abs(y))))
    keys = scores + bias
    ids = np.stack([np.lexsort((np.arange(len(row)), -row))[:k] for row in keys])
    picked = np.take_along_axis(scores, ids, -1)
    w = picked / (picked.sum(-1, keepdims=True) + 1e-20) if norm else picked
    return ids, w * scale, np.sort(keys, -1)[:, ::-1]


@pytest.mark.parametrize("experts,k,tokens,norm,temp,bias_scale", [
    (384, 6, 3, True, 1.0, 0.1),     # V4.1 Flash: 12 experts a lane
    (256, 8, 2, True, 0.7, 1.0),     # the bias decides the selection
    (13, 1, 4, False, 1.0, 0.0),     # lanes without an expert; k = 1, no normalisation
    (40, 5, 2, True, 1.3, 0.5),      # a second expert on 8 lanes only
])
def test_router_body_picks_the_largest_keys_in_order(tmp_path, experts, k, tokens, norm, temp, bias_scale):
    rng = np.random.default_rng()
    logits = (rng.standard_normal((tokens, experts)) * 3).astype(np.float32)
    bias = (rng.standard_normal(experts) * bias_scale).astype(np.float32)
    ids, weights = run_router(tmp_path, logits, bias, k, temp, 1.5, norm)
    want_ids, want_w, keys = expected(logits, bias, k, temp, 1.5, norm)
    # Random keys are ~1e-2 apart; the kernel's fp32 keys are within a few ulps of float64's.
    assert np.all(keys[:, :k] - keys[:, 1:k + 1] > 1e-5), "draw again: near-equal keys"
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=2e-6, atol=0)


def test_router_body_breaks_ties_to_the_lower_id(tmp_path):
    """Equal keys (equal logits, no bias) in lanes and rounds alike: the k lowest ids, in order;
    then equal keys among a few experts only (ids 3, 35, 67, 99 share lane 3, 7 and 300 others)."""
    ids, weights = run_router(tmp_path, np.zeros((2, 384), np.float32), np.zeros(384, np.float32), 6, 1.0, 1.0, True)
    np.testing.assert_array_equal(ids, np.tile(np.arange(6), (2, 1)))
    np.testing.assert_allclose(weights, 1 / 6, rtol=1e-6)
    logits = np.full((1, 384), -4.0, np.float32)
    logits[0, [300, 99, 67, 35, 7, 3]] = 2.0
    ids, _ = run_router(tmp_path, logits, np.zeros(384, np.float32), 6, 1.0, 1.0, True)
    np.testing.assert_array_equal(ids, [[3, 7, 35, 67, 99, 300]])
