"""The indexer's scores (dsv4/kernels/indexer.py) on the CPU: the plain-MLX reference against a
float64 numpy transcription of model-spec §3.6, and the dispatch rules. The kernel on the
device: tests/test_kernels_indexer_gpu.py."""

from unittest import mock

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import indexer as ix


def case(rng, B=2, S=3, H=4, DK=16, N=11, ratio=2, candidates=False):
    q = rng.standard_normal((B, S, H, DK)).astype(np.float32)
    keys = rng.standard_normal((B, N, DK)).astype(np.float32)
    w = rng.standard_normal((B, S, H)).astype(np.float32)
    positions = np.array([7, 12, 18][:S], np.int32)
    cand = rng.random((B, S, N + 3)) < 0.6 if candidates else None
    return q, keys, w, positions, ratio, cand


def oracle(q, keys, w, scale, positions, ratio, cand):
    """score[b,s,n] = sum_h scale w_h max(q_h . k_n, 0), -inf unless n < (p+1)//ratio (and cand)."""
    q, keys, w = (a.astype(np.float64) for a in (q, keys, w))
    dots = np.einsum("bshd,bnd->bshn", q, keys)
    scores = (np.maximum(dots, 0) * (scale * w)[..., None]).sum(2)
    n = keys.shape[1]
    keep = np.arange(n)[None, None, :] < ((positions + 1) // ratio)[None, :, None]
    if cand is not None:
        keep = keep & cand[..., :n]
    return np.where(keep, scores, -np.inf)


@pytest.mark.parametrize("candidates", [False, True])
def test_reference_matches_the_spec(candidates):
    rng = np.random.default_rng()
    q, keys, w, pos, ratio, cand = case(rng, candidates=candidates)
    keys_bf16 = mx.array(keys).astype(mx.bfloat16)
    got = ix.indexer_scores(mx.array(q), keys_bf16, mx.array(w).astype(mx.bfloat16), 0.125,
                            mx.array(pos), ratio, None if cand is None else mx.array(cand))
    want = oracle(q, np.array(keys_bf16.astype(mx.float32)), np.array(mx.array(w).astype(mx.bfloat16).astype(mx.float32)),
                  0.125, pos, ratio, cand)
    got = np.array(got)
    assert got.shape == (2, 3, 11) and got.dtype == np.float32
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))      # the masks exactly
    finite = np.isfinite(want)
    assert finite.any() and (~finite).any()
    # fp32 sums of H*DK products: well inside 1e-5 relative to the magnitudes summed.
    mag = oracle(np.abs(q), np.abs(np.array(keys_bf16.astype(mx.float32))), np.abs(w), 0.125, pos, ratio, None)
    assert np.all(np.abs(got[finite] - want[finite]) <= 1e-5 * (1 + mag[finite]))


def test_dispatch():
    rng = np.random.default_rng()
    q, keys, w, pos, ratio, cand = case(rng, B=1, S=2, candidates=True)
    args = (mx.array(q), mx.array(keys).astype(mx.bfloat16), mx.array(w), 0.5, mx.array(pos), ratio)
    assert not ix.kernel_applies(args[0], args[1]), "the CPU has no kernel backend"
    calls = []
    fake = lambda kernel, **kw: calls.append(kw) or [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
    with mock.patch.object(ix, "backend", return_value="cuda"), mock.patch.object(ix.Kernel, "__call__", fake):
        out = ix.indexer_scores(*args, mx.array(cand))
        assert out.shape == (1, 2, 11) and len(calls) == 1
        assert calls[0]["grid"] == (128, 1, 2)
        assert dict(calls[0]["template"]) == dict(H=4, DK=16, S=2, RATIO=2, CANDIDATES=True)
        ix.indexer_scores(*args)
        assert dict(calls[1]["template"])["CANDIDATES"] is False
        with flags.override(kernel_indexer=False):
            ix.indexer_scores(*args)
        # A prefill's queries: the reference's matmul, its heads summed in one launch (the
        # DSV4_KERNEL_PREFILL_INDEXER kernel), none with that switch off.
        big = mx.zeros((1, ix.MAX_QUERIES + 1, 4, 16))
        prefill = (big, args[1], mx.zeros((1, ix.MAX_QUERIES + 1, 4)), 0.5, mx.arange(ix.MAX_QUERIES + 1), ratio)
        assert ix.indexer_scores(*prefill).shape == (1, ix.MAX_QUERIES + 1, 11) and len(calls) == 3
        assert calls[2]["grid"] == (ix.HEAD_SUM_THREADS, ix.MAX_QUERIES + 1, 1)
        assert calls[2]["output_shapes"] == [(1, ix.MAX_QUERIES + 1, 11)] and dict(calls[2]["template"]) == dict(H=4)
        with flags.override(kernel_prefill_indexer="off"):
            ix.indexer_scores(*prefill)
        assert len(calls) == 3
