"""The fused projection tail (dsv4/kernels/rows.py) against the plain-MLX stages it replaces
(run on the H200: pytest -m gpu). The rounding stage is checked bit for bit given the same
input; norm and RoPE to fp32 summation order and the cos/sin values (the kernel gets them
from the caller, the reference computes them inside mx.fast.rope)."""

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import quant
from dsv4.attention import RMSNorm, rope
from dsv4.kernels import rows
from dsv4.kernels.dialect import backend, poisoned_outputs

pytestmark = pytest.mark.gpu


def angles(pos, freqs, scale=1.0):
    theta = (mx.array([pos], mx.float32) * scale)[:, None] * mx.reciprocal(freqs)[None]
    return mx.cos(theta)[0], mx.sin(theta)[0]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape,norm,rot,qdq", [
    ((1, 1, 512), True, True, rows.FP8),          # window KV row
    ((1, 1, 64, 512), False, True, rows.NO_QDQ),  # queries, 64 heads
    ((1, 1, 1280), True, False, rows.FP8),        # q-LoRA latent as matmul input
    ((1, 1, 32, 128), False, True, rows.FP4),     # indexer queries
    ((2, 1, 128), True, True, rows.FP4),          # indexer keys, batch 2
    ((1, 1, 512), False, True, rows.FP4_E4M3),    # compressed KV row
])
def test_row_tail_equals_the_stages(shape, norm, rot, qdq, dtype):
    assert backend() is not None, "needs MLX's CUDA or Metal backend"
    rng = np.random.default_rng()
    D = shape[-1]
    x = mx.array(rng.standard_normal(shape).astype(np.float32) * 3).astype(dtype)
    module = RMSNorm(D, 1e-6)
    module.weight = mx.array(rng.uniform(0.5, 1.5, D).astype(np.float32)).astype(dtype)
    freqs = mx.array((10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32))   # wavelengths
    pos = int(rng.integers(0, 70000))
    cs = angles(pos, freqs) if rot else None
    with poisoned_outputs():
        unrounded = rows.row_tail(x, (module.weight, module.eps) if norm else None, cs, rows.NO_QDQ)
        got = rows.row_tail(x, (module.weight, module.eps) if norm else None, cs, qdq)
    want = module(x) if norm else x
    want = rope(want, pos, freqs) if rot else want
    u, w = np.array(unrounded.astype(mx.float32)), np.array(want.astype(mx.float32))
    if dtype == mx.float32:
        assert np.max(np.abs(u - w)) <= 1e-5 * np.max(np.abs(w))
    else:   # one bf16 ulp where an fp32 difference crosses a rounding boundary
        assert np.all(np.abs(u - w) <= 2.0 ** -7 * np.abs(w) + 1e-30)
        assert np.mean(u == w) > 0.95
    if qdq != rows.NO_QDQ:
        # The plain-MLX rounding, never the kernel.
        ref = (quant._qdq_fp4_e4m3(unrounded, 16) if qdq == rows.FP4_E4M3
               else quant._qdq_pow2(unrounded, 32, qdq))
        bits = mx.uint16 if dtype == mx.bfloat16 else mx.uint32
        assert np.array_equal(np.array(got.view(bits)), np.array(ref.view(bits)))
    else:
        assert np.array_equal(np.array(got.astype(mx.float32)), u)


@pytest.mark.parametrize("qdq", [rows.NO_QDQ, rows.FP4])
def test_row_tail_output_shape_and_dtype_only_lay_out_the_same_values(qdq):
    """`shape` (split into heads) and `dtype` (fp32 store) change the layout and the storage
    type, never a value: bit for bit the plain call, reshaped and widened."""
    assert backend() is not None, "needs MLX's CUDA or Metal backend"
    rng = np.random.default_rng()
    x = mx.array(rng.standard_normal((1, 1, 32 * 128)).astype(np.float32) * 3).astype(mx.bfloat16)
    freqs = mx.array((10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32))
    cs = angles(int(rng.integers(0, 70000)), freqs)
    with poisoned_outputs():
        plain = rows.row_tail(x.reshape(1, 1, 32, 128), None, cs, qdq)
        laid_out = rows.row_tail(x, None, cs, qdq, shape=(1, 1, 32, 128), dtype=mx.float32)
    assert laid_out.shape == (1, 1, 32, 128) and laid_out.dtype == mx.float32
    assert np.array_equal(np.array(laid_out), np.array(plain.astype(mx.float32)))


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_rope_angles_kernel_equals_the_plain_ops(scale):
    """cos/sin of (offset * scale) / freqs in one launch: the same fp32 theta (reciprocal
    correctly rounded on both sides) and the same accurate cosf/sinf, so equal to within one
    fp32 ulp of the plain ops' (MLX's unary kernels)."""
    assert backend() is not None, "needs MLX's CUDA or Metal backend"
    freqs = mx.array((10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32))
    for pos in (0, 1, 513, 8191, 1_000_000):
        offset = mx.array([pos], mx.int32)
        with poisoned_outputs():
            got = rows.rope_angles(offset, freqs, scale)
        want = rows.rope_angles_reference(offset, freqs, scale)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=2.0 ** -23, atol=2.0 ** -24)


@pytest.mark.parametrize("shape,norm,qdq", [
    ((1, 4, 512), True, rows.FP8),           # a verify's window KV rows
    ((1, 5, 64, 512), False, rows.NO_QDQ),   # a draft block's queries, 64 heads
    ((2, 3, 128), True, rows.FP4),           # indexer keys of 3 positions, batch 2
])
def test_row_tail_of_several_positions_equals_each_position_alone(shape, norm, qdq):
    """Angles [S, R] (a verify, a draft block): the rows of position s come out bit for bit as
    the one-position call gives them with that position's angles."""
    assert backend() is not None, "needs MLX's CUDA or Metal backend"
    rng = np.random.default_rng()
    D, S = shape[-1], shape[1]
    x = mx.array(rng.standard_normal(shape).astype(np.float32) * 3).astype(mx.bfloat16)
    weight = mx.array(rng.uniform(0.5, 1.5, D).astype(np.float32)).astype(mx.bfloat16)
    freqs = mx.array((10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32))
    offset = mx.array([int(rng.integers(0, 70000))], mx.int32)
    with poisoned_outputs():
        cs = rows.rope_angles(offset, freqs, 1.0, positions=S)
        got = rows.row_tail(x, (weight, 1e-6) if norm else None, cs, qdq)
        mx.eval(got)
        for s in range(S):
            one = rows.row_tail(x[:, s:s + 1], (weight, 1e-6) if norm else None, (cs[0][s], cs[1][s]), qdq)
            assert np.array_equal(np.array(got[:, s:s + 1].astype(mx.float32)), np.array(one.astype(mx.float32))), s
        alone = rows.rope_angles(offset + (S - 1), freqs, 1.0)
    assert np.array_equal(np.array(cs[0][S - 1]), np.array(alone[0]))
