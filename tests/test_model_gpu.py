"""The whole model with kernels on vs off, on a GPU backend (run on the H200: pytest -m gpu)."""

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import flags
from dsv4.kernels.dialect import backend

pytestmark = pytest.mark.gpu

KERNELS_OFF = dict(kernel_sparse_attention=False, kernel_moe=False, kernel_mhc=False)


def greedy(model, prompt, steps):
    cache = model.make_cache()
    logits = model(prompt, cache)[0, -1]
    tokens, all_logits = [], []
    for _ in range(steps):
        all_logits.append(logits)
        tokens.append(int(mx.argmax(logits).item()))
        logits = model(np.array([[tokens[-1]]]), cache)[0, -1]
    return tokens, mx.stack(all_logits)


@pytest.mark.parametrize("seed", [0, 1])
def test_kernels_on_equal_kernels_off_over_64_greedy_steps(tmp_path, seed):
    """Same greedy tokens over 64 decode steps; logits within bf16 accumulation noise
    (the kernels sum in another order than MLX's ops: relative 2e-2 of the largest logit)."""
    assert backend() is not None, "needs MLX's CUDA or Metal backend"
    from dsv4.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ckpt", seed=seed)
    model, _ = dsv4.load(path)
    prompt = np.random.default_rng(seed).integers(7, 500, (1, 24))
    on_tokens, on_logits = greedy(model, prompt, 64)
    with flags.override(**KERNELS_OFF):
        off_tokens, off_logits = greedy(model, prompt, 64)
    assert on_tokens == off_tokens
    err = float(mx.max(mx.abs(on_logits - off_logits)) / mx.max(mx.abs(off_logits)))
    assert err < 2e-2, err
