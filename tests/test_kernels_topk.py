"""The indexer's top-k (dsv4/kernels/topk.py) on the CPU: the plain-MLX path against numpy (the
k largest scores, ties to the lower row, -1 where not visible) and the dispatch rules. The
kernel on the device: tests/test_kernels_topk_gpu.py."""

from unittest import mock

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import topk as tk


def oracle(scores, k, positions, ratio):
    """Per query: rows sorted by (score desc, row asc), the first k, -1 past the visible count.
    Scores compare as the model packs them: by their fp32 bits' order, so -0 ranks below +0."""
    b, s, n = scores.shape
    bits = scores.astype(np.float32).view(np.int32).astype(np.int64)
    code = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    out = np.empty((b, s, k), np.int64)
    for i in range(b):
        for j in range(s):
            order = sorted(range(n), key=lambda r: (-code[i, j, r], r))[:k]
            visible = (positions[j] + 1) // ratio
            out[i, j] = [r if r < visible else -1 for r in order]
    return out


def random_scores(rng, shape, ties=False, visible=None):
    x = rng.standard_normal(shape).astype(np.float32)
    if ties:
        x = np.round(x * 2) / 2          # few distinct values: many ties
    if visible is not None:
        x[..., visible:] = -np.inf
    return x


@pytest.mark.parametrize("ties", [False, True])
def test_reference_matches_numpy(ties):
    rng = np.random.default_rng()
    scores = random_scores(rng, (2, 3, 40), ties)
    scores[0, 0, 20:] = -np.inf          # fewer finite rows than k
    positions = np.array([9, 30, 70], np.int32)
    got = np.array(tk.topk_visible(mx.array(scores), 25, mx.array(positions), 2))
    want = oracle(scores, 25, positions, 2)
    assert got.shape == (2, 3, 25) and got.dtype == np.int32
    for i in range(2):
        for j in range(3):
            assert sorted(got[i, j]) == sorted(want[i, j])


def test_dispatch():
    scores = mx.zeros((1, 2, 50))
    positions = mx.array([3, 4], mx.int32)
    assert not tk.kernel_applies(scores, 10), "the CPU has no kernel backend"
    calls = []
    fake = lambda kernel, **kw: calls.append(kw) or [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
    with mock.patch.object(tk, "backend", return_value="cuda"), mock.patch.object(tk.Kernel, "__call__", fake):
        out = tk.topk_visible(scores, 10, positions, 2)
        assert out.shape == (1, 2, 10) and out.dtype == mx.int32
        assert calls[0]["grid"] == (tk.THREADS, 1, 2)
        assert dict(calls[0]["template"]) == dict(S=2, RATIO=2)
        assert calls[0]["inputs"][2].tolist() == [10]   # k at run time
        with flags.override(kernel_topk=False):
            tk.topk_visible(scores, 10, positions, 2)
        tk.topk_visible(mx.zeros((1, tk.MAX_QUERIES + 1, 50)), 10, mx.arange(tk.MAX_QUERIES + 1), 2)
        assert len(calls) == 1
