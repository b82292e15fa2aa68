"""benchmarks/exactness.py: issue 27's fast-vs-reference checks, here with the fixed-shape
decoder forced on (the CPU's default is the reference path), so the fast path really is
another computation: the decoder's rings, buffers, compiled graph and run-ahead."""

import mlx.core as mx
import numpy as np
import pytest

from benchmarks import exactness
from benchmarks.slice_decode import ROLES, SMALL, build
from dsv4 import flags


@pytest.fixture(scope="module")
def model():
    model = build({**SMALL, **ROLES})[0]
    model.set_dtype(mx.float32)
    return model


def test_fixed_decoder_matches_the_reference_across_the_window(model):
    """Context 150 with 24 steps crosses the window (128) and several compression groups."""
    with flags.override(fixed_decode="on"):
        _, data = exactness.real_width_rows(model, [150], 24)
    assert data["150"]["prefill"] == 0.0            # the same prefill computation
    assert data["150"]["decode"] < 1e-5             # float32, summation order only
    assert data["150"]["argmax_equal"] == 25


def test_a_wrong_forced_token_shows_as_an_error(model, monkeypatch):
    """The check can fail: a fast path fed one token late differs from the reference."""
    fast = exactness.fast_logits
    monkeypatch.setattr(exactness, "fast_logits",
                        lambda m, prompt, forced: fast(m, prompt, np.concatenate([forced[:1], forced[:-1]])))
    with flags.override(fixed_decode="on"):
        _, data = exactness.real_width_rows(model, [40], 6)
    assert data["40"]["decode"] > 1e-3


def test_mean_cross_entropy_against_a_direct_sum():
    rng = np.random.default_rng(0)
    logits, targets = rng.normal(size=(5, 11)) * 4, rng.integers(0, 11, 5)
    want = np.mean([np.log(np.sum(np.exp(row))) - row[t] for row, t in zip(logits, targets)])
    assert abs(exactness.mean_cross_entropy(logits, targets) - want) < 1e-12


@pytest.mark.parametrize("backend,tf32,restarts", [("cuda", None, True), ("cuda", "1", True), ("cuda", "0", False),
                                                   ("metal", None, False), (None, None, False)])
def test_a_cuda_run_restarts_itself_with_exact_fp32_matmuls(monkeypatch, backend, tf32, restarts):
    """MLX reads MLX_ENABLE_TF32 once; TF32 would round the reference path's matmuls too."""
    calls = []
    monkeypatch.setattr("dsv4.kernels.dialect.backend", lambda: backend)
    monkeypatch.setattr(exactness.os, "execve", lambda *a: calls.append(a))
    if tf32 is None:
        monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
    else:
        monkeypatch.setenv("MLX_ENABLE_TF32", tf32)
    exactness.exact_fp32_matmuls(["--contexts", "512"])
    if restarts:
        (path, args, env), = calls
        assert args[1:] == ["-m", "benchmarks.exactness", "--contexts", "512"] and env["MLX_ENABLE_TF32"] == "0"
    else:
        assert calls == []
