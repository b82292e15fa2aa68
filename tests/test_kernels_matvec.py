"""Dense quantized matvec with fused fp8 input rounding (dsv4/kernels/matvec.py), what the CPU
can check: the plain-MLX reference against a numpy transcription (the independent decoder of
test_kernels_experts, the fp8 rounding of test_quant), `fp8_linear`'s CPU path, and the
kernel's dispatch rules. The kernel itself: tests/test_kernels_matvec_gpu.py."""

from unittest import mock

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import matvec as mv
from dsv4.linear import Linear, fp8_linear
from dsv4.quant import qdq_fp8
from tests.test_kernels_experts import bf16, dequantize_np, quantized
from tests.test_quant import ref_qdq_fp8

MODES = [("mxfp8", 8, 32), ("mxfp4", 4, 32), ("affine", 4, 64), ("affine", 3, 32)]


def inputs(rng, tokens, K):
    """Blocks of 32 over many magnitudes (the fp8 scale differs per block) and a zero block."""
    x = rng.standard_normal((tokens, K)) * 10.0 ** rng.integers(-3, 3, (tokens, K // 32)).repeat(32, -1)
    x[0, :32] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("mode,bits,gs", MODES)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("act_quant", [False, True])
def test_reference_matches_numpy_transcription(mode, bits, gs, dtype, act_quant):
    rng = np.random.default_rng()
    N, K, T = 48, 256, 3
    q = quantized(rng, (N, K), mode, bits, gs, mx.float32)
    x = mx.array(inputs(rng, T, K)).astype(dtype)
    got = np.array(mv.matvec_reference(x, q, act_quant).astype(mx.float32)).astype(np.float64)
    xs = np.array(x.astype(mx.float32))
    xin = (ref_qdq_fp8(xs) if act_quant else xs).astype(np.float64)
    exact = xin @ dequantize_np(q).T                          # float64: the exact product
    want = bf16(exact) if dtype == mx.bfloat16 else exact.astype(np.float32).astype(np.float64)
    # The reference sums in fp32: error <= K * 2^-24 * sum|w x| (summation), then one rounding
    # of the output to x's dtype that may fall on the other side of a boundary (1 ulp, <= 2^-7
    # relative in bf16).
    mag = np.abs(xin) @ np.abs(dequantize_np(q)).T
    ulp = 2.0 ** -7 if dtype == mx.bfloat16 else 2.0 ** -23
    assert np.all(np.abs(got - want) <= ulp * np.abs(want) + K * 2.0 ** -24 * mag)
    assert got.shape == (T, N) and mv.matvec_reference(x, q, act_quant).dtype == dtype


@pytest.mark.parametrize("act_quant", [False, True])
def test_fp8_linear_on_cpu_is_the_layer_on_the_rounded_input(act_quant):
    layer = Linear(128, 40, bias=False).to_quantized(32, 8, "mxfp8")
    x = mx.array(inputs(np.random.default_rng(), 2, 128)).astype(mx.bfloat16)
    with flags.override(act_quant=act_quant, kernel_matvec=True):
        got = fp8_linear(layer, x)
    want = layer(qdq_fp8(x) if act_quant else x)
    assert mx.array_equal(got, want).item() and got.dtype == x.dtype
    if act_quant:   # the rounding is applied (a test that cannot pass with it left out)
        assert not mx.array_equal(got, layer(x)).item()


def test_fp8_linear_takes_the_kernel_only_where_it_applies():
    layer = Linear(64, 32, bias=False).to_quantized(32, 4, "mxfp4")
    x = mx.ones((1, 64), mx.bfloat16)
    sentinel = mx.zeros((1, 32), mx.bfloat16)
    with mock.patch("dsv4.linear.kernel_supports", return_value=True), \
            mock.patch("dsv4.linear.quantized_matvec", return_value=sentinel) as kernel:
        with flags.override(kernel_matvec=True, act_quant=True):
            assert fp8_linear(layer, x) is sentinel
        assert kernel.call_args.args[2] is True and kernel.call_args.args[1].mode == "mxfp4"
        with flags.override(kernel_matvec=False):
            assert fp8_linear(layer, x) is not sentinel
        dense = Linear(64, 32, bias=False)
        assert fp8_linear(dense, x) is not sentinel
        assert kernel.call_count == 1


def test_kernel_supports_refuses_what_the_kernel_cannot_do():
    rng = np.random.default_rng()
    q = quantized(rng, (64, 128), "mxfp8", 8, 32)
    x = mx.ones((2, 128), mx.bfloat16)
    assert not mv.kernel_supports(x, q), "the CPU has no kernel backend"
    with mock.patch.object(mv, "backend", return_value="cuda"):
        assert mv.kernel_supports(x, q)
        assert mv.kernel_supports(mx.ones((2, 4, 128), mx.float32), q)
        assert not mv.kernel_supports(mx.ones((9, 128), mx.bfloat16), q), "more than 8 tokens"
        assert not mv.kernel_supports(mx.ones((3, 3, 128), mx.bfloat16), q), "more than 8 tokens"
        assert not mv.kernel_supports(mx.ones((2, 96), mx.bfloat16), q), "K differs from the matrix's"
        assert not mv.kernel_supports(mx.ones((2, 128), mx.int32), q), "not a float dtype"
        assert not mv.kernel_supports(mx.ones((0, 128), mx.bfloat16), q), "no tokens"
        stacked = quantized(rng, (2, 64, 128), "mxfp8", 8, 32)
        assert not mv.kernel_supports(x, stacked), "stacked experts"
        wide = quantized(rng, (32, 16384), "mxfp4", 4, 32)
        assert not mv.kernel_supports(mx.ones((1, 16384), mx.bfloat16), wide), "x's copy too large"
        affine5 = quantized(rng, (64, 128), "affine", 5, 32)
        assert not mv.kernel_supports(x, affine5), "5-bit packing"

