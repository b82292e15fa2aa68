"""The indexer-scores kernel (dsv4/kernels/indexer.py) on the GPU (run on the H200: pytest -m gpu).

Oracle: float64 numpy of the same inputs (tests/test_kernels_indexer.py's transcription of the
spec). The masks (-inf) must match exactly. A finite score is a sum over H heads of w_h times a
sum of DK products, each product and each addition rounded once in fp32: in any order, to first
order within (DK + H + 2) * 2^-24 * (the same sums of absolute values). The reference path
(MLX's fp32 matmul, TF32 off by tests/conftest.py) is held to the same bound."""

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import indexer as ix
from tests.test_kernels_indexer import oracle

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_poisoned")]


@pytest.mark.parametrize("B,S,H,DK,N,ratio,keys_dtype,candidates", [
    (1, 1, 32, 128, 2048, 4, mx.bfloat16, True),     # V4.1 Flash at 8K context, candidate mask
    (1, 1, 32, 128, 512, 1, mx.bfloat16, False),
    (2, 3, 8, 64, 13, 2, mx.float32, True),           # batch, several queries, odd N
    (1, 8, 4, 16, 200, 1, mx.bfloat16, False),        # the most queries
])
def test_kernel_matches_float64(B, S, H, DK, N, ratio, keys_dtype, candidates):
    rng = np.random.default_rng()
    q = rng.standard_normal((B, S, H, DK)).astype(np.float32)
    keys = mx.array(rng.standard_normal((B, N, DK)).astype(np.float32)).astype(keys_dtype)
    w = mx.array(rng.standard_normal((B, S, H)).astype(np.float32)).astype(mx.bfloat16)
    positions = np.sort(rng.integers(0, N * ratio, S)).astype(np.int32)
    cand = rng.random((B, S, N + 5)) < 0.7 if candidates else None
    scale = DK ** -0.5 * H ** -0.5
    assert ix.kernel_applies(mx.array(q), keys)
    check_scores(q, keys, w, scale, positions, ratio, cand)
    with flags.override(kernel_indexer=False):
        check_scores(q, keys, w, scale, positions, ratio, cand)


def check_scores(q, keys, w, scale, positions, ratio, cand):
    """indexer_scores as the switches have it against float64: masks exact, finite scores within
    the fp32 bound of their sums."""
    DK, H = q.shape[-1], q.shape[-2]
    got = np.array(ix.indexer_scores(mx.array(q), keys, w, scale, mx.array(positions), ratio,
                                     None if cand is None else mx.array(cand)))
    k64, w64 = np.array(keys.astype(mx.float32)), np.array(w.astype(mx.float32))
    want = oracle(q, k64, w64, scale, positions, ratio, cand)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert np.isfinite(got[finite]).all()
    mag = oracle(np.abs(q), np.abs(k64), np.abs(w64), scale, positions, ratio, None)
    assert np.all(np.abs(got[finite] - want[finite]) <= (DK + H + 2) * 2.0 ** -24 * mag[finite])


@pytest.mark.parametrize("S,N,candidates", [(64, 2048, True), (300, 77, False)])
def test_prefill_head_sum_matches_float64(S, N, candidates):
    """A prefill's queries (more than the kernel takes): the matmul's products summed over V4.1's 64
    heads in one launch (DSV4_KERNEL_PREFILL_INDEXER), held to the same bound, masks exact."""
    rng = np.random.default_rng()
    H, DK, ratio = 64, 128, 2
    q = rng.standard_normal((1, S, H, DK)).astype(np.float32)
    keys = mx.array(rng.standard_normal((1, N, DK)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((1, S, H)).astype(np.float32)).astype(mx.bfloat16)
    positions = np.sort(rng.integers(0, N * ratio, S)).astype(np.int32)
    cand = rng.random((1, S, N + 5)) < 0.7 if candidates else None
    scale = DK ** -0.5 * H ** -0.5
    assert not ix.kernel_applies(mx.array(q), keys) and ix.head_sum_applies(mx.array(q), keys)
    check_scores(q, keys, w, scale, positions, ratio, cand)
