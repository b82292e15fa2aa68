"""The experts' hidden-activation kernel (dsv4/kernels/swiglu.py) on the GPU against the plain-MLX
reference at a prefill chunk's V4.1 width (run on the H200/H100: pytest -m gpu)."""

import mlx.core as mx
import numpy as np
import pytest

from dsv4.kernels import swiglu
from dsv4.kernels.dialect import poisoned_outputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("act_quant", [True, False])
def test_hidden_kernel_against_the_reference(dtype, act_quant):
    """2048 sorted pairs x 2304 (a 4096-token chunk's pairs of a few experts), values past the
    clamp: rounded (bf16, fp8) nearly every value the same bits, the rest within a step of their
    block; fp32 within a few ulps."""
    rng = np.random.default_rng()
    P, I = 2048, 2304
    g = mx.array((rng.standard_normal((P, 1, I)) * 6).astype(np.float32)).astype(dtype)
    u = mx.array((rng.standard_normal((P, 1, I)) * 6).astype(np.float32)).astype(dtype)
    w = mx.array(rng.uniform(0.05, 1.0, P).astype(np.float32))
    assert swiglu.kernel_applies(g, u)
    with poisoned_outputs():
        got = np.array(swiglu.swiglu_hidden(g, u, w, 10.0, act_quant).astype(mx.float32))
    want = np.array(swiglu.swiglu_hidden_reference(g, u, w, 10.0, act_quant).astype(mx.float32))
    if dtype == mx.bfloat16 or act_quant:
        assert np.mean(got == want) > 0.99
    blocks = np.abs(want).reshape(-1, 32).max(-1, keepdims=True)
    step = 2.0 ** -2 if act_quant else (2.0 ** -7 if dtype == mx.bfloat16 else 2.0 ** -20)
    assert (np.abs(got - want).reshape(-1, 32) <= step * blocks).all()
