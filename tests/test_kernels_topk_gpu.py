"""The indexer's top-k kernel (dsv4/kernels/topk.py) on the GPU (run on the H200: pytest -m gpu).

The kernel must pick exactly the reference's rows (the k largest scores, ties to the lower
row, -1 where not visible); only their order within the k may differ."""

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import topk as tk
from tests.test_kernels_topk import random_scores

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_poisoned")]


@pytest.mark.parametrize("B,S,N,k,ratio,ties,visible", [
    (1, 1, 8192, 512, 1, False, None),   # V4.1 Flash at 8K context
    (1, 1, 4096, 512, 2, True, 3000),    # many ties, masked rows past 3000
    (2, 3, 300, 64, 4, False, 40),       # fewer finite rows than k: -inf rows by row order
    (1, 8, 1000, 1000, 1, True, None),   # k = N, the most queries
    (1, 2, 7, 3, 1, False, 0),           # every row -inf
    (1, 1, 5000, 1, 1, True, None),      # k = 1 among ties
])
def test_kernel_picks_the_reference_rows(B, S, N, k, ratio, ties, visible):
    rng = np.random.default_rng()
    scores = mx.array(random_scores(rng, (B, S, N), ties, visible))
    positions = mx.array(np.sort(rng.integers(0, N * ratio, S)).astype(np.int32))
    assert tk.kernel_applies(scores, k)
    got = np.array(tk.topk_visible(scores, k, positions, ratio))
    with flags.override(kernel_topk=False):
        want = np.array(tk.topk_visible(scores, k, positions, ratio))
    assert got.shape == want.shape == (B, S, k)
    for i in range(B):
        for j in range(S):
            assert sorted(got[i, j]) == sorted(want[i, j]), (i, j)
