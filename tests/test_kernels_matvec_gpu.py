"""The dense quantized matvec kernel (dsv4/kernels/matvec.py) against its plain-MLX reference
(`matvec_reference`, itself checked against numpy in test_kernels_matvec.py), and
`fp8_linear`'s GPU dispatch.

Run on the GPU machine: `pytest -m gpu tests/test_kernels_matvec_gpu.py`. Random inputs every
run, every kernel output filled with NaN first (`poisoned_outputs`), tolerances stated next to
the comparison. CUDA compiles each template instantiation (x dtype, layout, rows per SIMD
group, K, act_quant) with NVRTC, seconds each: CASES names 12, token counts are free (grid).
TF32 is off (tests/conftest.py), so the reference's fp32 matmul is exact fp32 math.
"""

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import matvec as mv
from dsv4.linear import Linear, fp8_linear
from dsv4.quant import qdq_fp8

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_poisoned")]

RNG = np.random.default_rng()

# (N, K), (mode, bits, group size, scale dtype of the source weight), x dtype, act_quant.
# The first rows are dsv4's shapes (wq_a, wkv, the shared expert, the indexer's wq_b); the
# others are small, odd and one-pack inputs. (SPLIT, ROWS) from matvec.work_split, CUDA's default
# (DSV4_KERNEL_MATVEC_LONG_THREADGROUPS on): (1, 4), (1, 2), (1, 2), (1, 4), (1, 4), (1, 4),
# (2, 1), (2, 1), (1, 1), (1, 1), (2, 1), (1, 2); off (test_previous_split_matches_reference):
# (2, 1), (4, 1), (4, 1), (1, 2), (1, 4), (1, 4), (2, 1), (2, 1), (1, 1), (1, 1), (2, 1), (4, 1).
CASES = [
    ((1280, 5120), ("mxfp8", 8, 32, mx.bfloat16), mx.bfloat16, True),
    ((512, 5120), ("mxfp8", 8, 32, mx.bfloat16), mx.bfloat16, True),
    ((512, 5120), ("mxfp4", 4, 32, mx.bfloat16), mx.bfloat16, False),
    ((2304, 5120), ("mxfp8", 8, 32, mx.bfloat16), mx.bfloat16, True),
    ((4096, 1280), ("mxfp8", 8, 32, mx.bfloat16), mx.bfloat16, True),
    ((4096, 1280), ("mxfp4", 4, 32, mx.bfloat16), mx.float32, True),
    ((96, 64), ("mxfp8", 8, 32, mx.bfloat16), mx.float32, False),
    ((96, 64), ("mxfp4", 4, 32, mx.bfloat16), mx.float32, True),
    ((32, 32), ("mxfp8", 8, 32, mx.bfloat16), mx.bfloat16, False),
    ((32, 32), ("affine", 3, 32, mx.bfloat16), mx.bfloat16, True),
    ((96, 128), ("affine", 4, 64, mx.bfloat16), mx.float32, True),
    ((512, 5120), ("affine", 8, 32, mx.float32), mx.bfloat16, False),
]




def quantized(shape, mode, bits, gs, source_dtype):
    w = mx.array((RNG.standard_normal(shape) * 0.05).astype(np.float32)).astype(source_dtype)
    parts = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
    return mv.QuantizedMatrix(parts[0], parts[1], parts[2] if mode == "affine" else None, gs, bits, mode)


def activations(tokens, K, dtype):
    """Blocks of 32 over many magnitudes (each gets its own fp8 scale) and a zero block."""
    x = RNG.standard_normal((tokens, K)) * 10.0 ** RNG.integers(-3, 3, (tokens, K // 32)).repeat(32, -1)
    x[0, :32] = 0.0
    return mx.array(x.astype(np.float32)).astype(dtype)


def dense(q):
    """W in float64; affine scales go to fp32 first (mx.dequantize rounds scale*q + bias to
    the scales' dtype)."""
    f32 = (lambda a: a.astype(mx.float32)) if q.mode == "affine" else (lambda a: a)
    biases = None if q.biases is None else f32(q.biases)
    return np.array(mx.dequantize(q.weight, f32(q.scales), biases, dtype=mx.float32, **q.kwargs())).astype(np.float64)


def f64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("shape,layout,dtype,act_quant", CASES,
                         ids=[f"{n}x{k}-{lay[0]}{lay[1]}-{str(dt).split('.')[-1]}-actq{int(aq)}"
                              for (n, k), lay, dt, aq in CASES])
def test_kernel_matches_reference(shape, layout, dtype, act_quant, tokens):
    (N, K), (mode, bits, gs, source_dtype) = shape, layout
    q = quantized((N, K), mode, bits, gs, source_dtype)
    x = activations(tokens, K, dtype)
    if tokens == 3:
        x = x.reshape(3, 1, K)      # leading dims are kept
    assert mv.kernel_supports(x, q)
    got = mv.quantized_matvec(x, q, act_quant)
    check_matvec(got, x, q, act_quant)


def check_matvec(got, x, q, act_quant):
    """`got`, x's product by q, against `matvec_reference`'s within the fp32 summation bound."""
    K, N, tokens, dtype = x.shape[-1], q.out_features, x.size // x.shape[-1], x.dtype
    want = mv.matvec_reference(x, q, act_quant)
    assert got.shape == want.shape == (*x.shape[:-1], N) and got.dtype == dtype
    got, want = f64(got).reshape(tokens, N), f64(want).reshape(tokens, N)
    assert np.isfinite(got).all(), "kernel left outputs unwritten (NaN-poisoned) or non-finite"
    # Same products, both summed in fp32 in different orders: each sum is within
    # K * 2^-24 * sum|w x| of the exact one, then rounded once to x's dtype, which may land one
    # ulp apart (at most 2^-7 relative in bf16). Most outputs are far tighter than that bound.
    xin = f64(qdq_fp8(x) if act_quant else x).reshape(tokens, K)
    mag = np.abs(xin) @ np.abs(dense(q)).T
    ulp = 2.0 ** -7 if dtype == mx.bfloat16 else 2.0 ** -23
    err = np.abs(got - want)
    assert np.all(err <= ulp * np.abs(want) + 2 * K * 2.0 ** -24 * mag), float(err.max())
    tight = 2.0 ** -7 if dtype == mx.bfloat16 else 2.0 ** -16
    assert np.mean(err <= tight * np.abs(want) + 1e-30) > 0.9


@pytest.mark.parametrize("shape,layout,dtype,act_quant", CASES[:3] + CASES[-1:],
                         ids=["wq_a", "wkv-mxfp8", "wkv-mxfp4", "affine8"])
def test_previous_split_matches_reference(shape, layout, dtype, act_quant):
    """DSV4_KERNEL_MATVEC_LONG_THREADGROUPS off (its rollback): K split over 2 or 4 SIMD groups
    at the shapes where the default now takes rows."""
    with flags.override(kernel_matvec_long_threadgroups="off"):
        assert mv.work_split(*shape, layout[2])[0] > 1
        test_kernel_matches_reference(shape, layout, dtype, act_quant, 1)


@pytest.mark.parametrize("pre_rounded", [False, True])
def test_joined_wq_a_and_wkv_match_the_reference(pre_rounded):
    """DSV4_KERNEL_MATVEC_JOINED at V4.1's widths: wq_a's 1280 rows and wkv's 512 in one launch,
    each output within the bound of its own layer's reference, the layers' values kept."""
    from dsv4.linear import fp8_linears
    a, b = (Linear(5120, n, bias=False).to_quantized(32, 8, "mxfp8") for n in (1280, 512))
    x = activations(1, 5120, mx.bfloat16).reshape(1, 1, 5120)
    own = [mv.QuantizedMatrix.of(layer) for layer in (a, b)]
    with flags.override(kernel_matvec_joined=True, act_quant=True):
        got = fp8_linears(x, a, b, rounded=qdq_fp8(x) if pre_rounded else None)
    assert "_joined_rows" in a.__dict__
    for g, q, layer in zip(got, own, (a, b)):
        check_matvec(g, x, q, True)
        assert mx.array_equal(layer["weight"], q.weight).item() and mx.array_equal(layer["scales"], q.scales).item()


def test_fp8_linear_dispatches_to_the_kernel():
    layer = Linear(64, 96, bias=False).to_quantized(32, 8, "mxfp8")      # case (96, 64) mxfp8 fp32
    x = activations(3, 64, mx.float32)
    q = mv.QuantizedMatrix.of(layer)
    with flags.override(kernel_matvec=True, act_quant=False):
        assert mx.array_equal(fp8_linear(layer, x), mv.quantized_matvec(x, q, False)).item()
    with flags.override(kernel_matvec=False, act_quant=True):
        assert mx.array_equal(fp8_linear(layer, x), layer(qdq_fp8(x))).item()


TOKENS_CASES = [CASES[0], CASES[3], CASES[5], CASES[9], CASES[11],
                ((32768, 1280), ("mxfp8", 8, 32, mx.bfloat16), mx.bfloat16, True),     # wq_b
                ((5120, 8192), ("mxfp8", 8, 32, mx.bfloat16), mx.bfloat16, True)]      # wo_b


@pytest.mark.parametrize("tokens", [2, 4, mv.MAX_TOKS])
@pytest.mark.parametrize("shape,layout,dtype,act_quant", TOKENS_CASES)
def test_tokens_matvec_matches_reference(shape, layout, dtype, act_quant, tokens):
    """DSV4_KERNEL_MATVEC_TOKENS: every token in one launch, each weight decoded once, within the
    same bounds; and equal, bit for bit, to the one-token launch where that takes the whole K in one
    SIMD group (SPLIT 1: the same sums in the same order; its host emulation:
    test_kernels_matvec.test_tokens_body_gives_the_one_token_bodys_sums)."""
    with flags.override(kernel_matvec_tokens=True):
        assert mv.tokens_applies(quantized((32, 32), "mxfp8", 8, 32, mx.bfloat16), tokens)
        test_kernel_matches_reference(shape, layout, dtype, act_quant, tokens)
    (N, K), (mode, bits, gs, source_dtype) = shape, layout
    if mv.work_split(N, K, gs)[0] == 1:
        q, x = quantized((N, K), mode, bits, gs, source_dtype), activations(tokens, K, dtype)
        with flags.override(kernel_matvec_tokens=True):
            both = mv.quantized_matvec(x, q, act_quant)
        assert mx.array_equal(both, mv.quantized_matvec(x, q, act_quant)).item()


@pytest.mark.parametrize("tokens", [2, 4, mv.MAX_TOKS])
def test_grouped_tokens_matvec_matches_gather_qmm(tokens):
    """V4.1's grouped wo_a in MLX's mxfp8 (8 groups of 1024 rows over 4096 inputs, no input
    rounding) through the multi-token launch: within the reference's bounds, as gather_qmm's
    per-token products are (attention.py's route without the switch)."""
    q = quantized((8 * 1024, 4096), "mxfp8", 8, 32, mx.bfloat16)
    x = activations(tokens * 8, 4096, mx.bfloat16).reshape(tokens, 8, 4096)
    with flags.override(kernel_matvec_tokens=True):
        assert mv.kernel_supports(x, q, groups=8)
        got = f64(mv.quantized_matvec(x, q, False, groups=8))
    assert not mv.kernel_supports(x, q, groups=8), "MLX's packs take gather_qmm without the switch"
    want = f64(mv.matvec_reference(x, q, False, groups=8))
    w = dense(q).reshape(8, 1024, 4096)
    mag = np.einsum("tgk,gnk->tgn", np.abs(f64(x)), np.abs(w)).reshape(tokens, -1)
    err = np.abs(got - want)
    assert np.all(err <= 2.0 ** -7 * np.abs(want) + 2 * 4096 * 2.0 ** -24 * mag), float(err.max())
    assert np.mean(err <= 2.0 ** -7 * np.abs(want) + 1e-30) > 0.9


@pytest.mark.parametrize("N,R,act_quant", [(1280, 0, False), (512, 32, False), (512, 32, True)],
                         ids=["wq_a", "wkv", "wkv-rounding-x"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_projection_and_its_tail_in_one_launch_equal_the_two_launches(N, R, act_quant, tokens):
    """DSV4_KERNEL_MATVEC_TAIL at V4.1's widths (K = 5120, mxfp8): wq_a with q_norm and the fp8
    rounding, wkv with kv_norm, RoPE and the fp8 rounding, bit for bit the matvec launch and then
    the row-tail launch (the same sums in the same order); the same counters across calls (each
    launch must leave them at zero for the next)."""
    from dsv4.kernels import matvec_tail, rows

    q = quantized((N, 5120), "mxfp8", 8, 32, mx.bfloat16)
    counters = matvec_tail.arrivals()
    norm = (mx.array(RNG.uniform(0.5, 1.5, N).astype(np.float32)).astype(mx.bfloat16), 1e-6)
    theta = mx.array(RNG.uniform(-np.pi, np.pi, R).astype(np.float32))
    rope = (mx.cos(theta), mx.sin(theta)) if R else None
    with flags.override(kernel_matvec_tail=True, kernel_matvec="on"):
        for _ in range(3):
            x = activations(tokens, 5120, mx.bfloat16)
            assert matvec_tail.applies(x, q, rows.FP8)
            two = rows.row_tail(mv.quantized_matvec(x, q, act_quant), norm, rope, rows.FP8)
            one = matvec_tail.projection_tail(x, q, act_quant, counters, norm, rope, rows.FP8)
            assert mx.array_equal(one, two).item()
    assert not mx.any(counters).item()
