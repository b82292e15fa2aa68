"""The one-pass head kernel (dsv4/kernels/head.py) on the GPU (run on the H200: pytest -m gpu).

Oracle: the exact product in float64 (numpy) of the fp32 inputs and the bf16 weight widened to
fp32. Bound: any fp32 summation of D products is within D * 2^-24 * sum_d |x_d w_d| of the
exact value (the products themselves are exact in fp32: 24-bit x times 8-bit w mantissas fit),
which MLX's own fp32 matmul must meet too; the kernel is checked against both."""

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import head

pytestmark = pytest.mark.gpu


def exact(x, w):
    xs = np.array(x.astype(mx.float32)).astype(np.float64)
    ws = np.array(w.astype(mx.float32)).astype(np.float64)
    return xs @ ws.T, np.abs(xs) @ np.abs(ws).T


@pytest.mark.parametrize("lead,d,v", [
    ((1,), 5120, 129280),   # V4.1 Flash, one token
    ((1, 1), 5120, 1000),   # [B, S, D] input
    ((3,), 64, 13),         # fewer chunks than lanes, rows not a multiple of a threadgroup's
    ((8,), 256, 1001),      # the most tokens
    ((2,), 8, 7),           # one 16-byte chunk per row
])
def test_head_kernel_matches_the_exact_product(kernels_poisoned, lead, d, v):
    rng = np.random.default_rng()
    x = mx.array(rng.standard_normal((*lead, d)).astype(np.float32) * 4)
    w = mx.array(rng.standard_normal((v, d)).astype(np.float32) / np.sqrt(d)).astype(mx.bfloat16)
    with flags.override(kernel_head=True):
        assert head.kernel_applies(x, w)
        got = head.head_logits(x, w)
    assert got.dtype == mx.float32 and got.shape == (*lead, v)
    want, mag = exact(x.reshape(-1, d), w)
    bound = d * 2.0 ** -24 * mag
    got = np.array(got).reshape(-1, v).astype(np.float64)
    assert np.all(np.abs(got - want) <= bound)
    mlx_fp32 = np.array(x.reshape(-1, d) @ w.astype(mx.float32).T).astype(np.float64)
    assert np.all(np.abs(mlx_fp32 - want) <= bound)   # the bound holds for the path it replaces


@pytest.mark.parametrize("tokens,d,v", [(1, 512, 300), (1, 5120, 384), (8, 5120, 384), (3, 64, 13)])
def test_bf16_input_is_widened_not_rounded(kernels_poisoned, tokens, d, v):
    """bf16 x is read as bf16 (the MoE router's gate: 384 x 5120 in V4.1), widened exactly."""
    rng = np.random.default_rng()
    x = mx.array(rng.standard_normal((tokens, d)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((v, d)).astype(np.float32)).astype(mx.bfloat16)
    assert head.supports(x, w)
    got = np.array(head.head_logits(x, w)).astype(np.float64)
    want, mag = exact(x, w)
    assert np.all(np.abs(got - want) <= d * 2.0 ** -24 * mag)


def test_kernel_declines_what_it_does_not_handle():
    w = mx.zeros((10, 64), mx.bfloat16)
    with flags.override(kernel_head=True):
        assert not head.kernel_applies(mx.zeros((9, 64)), w)                 # > 8 tokens
        assert not head.kernel_applies(mx.zeros((1, 64)), w.astype(mx.float32))
        assert not head.kernel_applies(mx.zeros((1, 60)), mx.zeros((10, 60), mx.bfloat16))
    with flags.override(kernel_head=False):
        assert not head.kernel_applies(mx.zeros((1, 64)), w)
