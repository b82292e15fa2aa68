"""GPU kernels (CUDA build on the H200, or Metal) against their plain-MLX references.

Run on the GPU machine: `pytest -m gpu tests/test_kernels_gpu.py`. Random inputs every run,
edge cases on purpose, every kernel output filled with NaN before the kernel writes it
(`poisoned_outputs`), tolerances stated next to each comparison. fp32 matmuls of the
references would run in TF32 on CUDA (MLX_ENABLE_TF32 defaults to on), so tests/conftest.py turns
it off: the references then do the exact fp32 math the kernels are held to.
"""

import numpy as np
import pytest

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import experts as ex
from dsv4.kernels import mhc
from dsv4.kernels import sparse_attention as sa
from dsv4.quant import qdq_fp8
from tests.test_kernels_experts import check_down, check_hidden, hidden_expected

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_poisoned")]

RNG = np.random.default_rng()


@pytest.fixture(autouse=True)
def rollback_kernels():
    """The kernels the CUDA defaults replaced stay tested here, each with its own switch off: the
    4-row attention (test_attention_rows8_kernels turns the 8-row one back on) and the per-token
    mHC launches (the wide ones: test_kernels_mhc_gpu.py)."""
    with flags.override(kernel_attention_rows8=False, kernel_mhc_wide=False):
        yield


def f32(a):
    return np.array(a.astype(mx.float32))


def arr(x, dtype=mx.float32):
    return mx.array(np.asarray(x, np.float32)).astype(dtype)


# --- sparse attention ------------------------------------------------------------------------

def attention_case(B, S, H, D, W, N, w, k, dtype, invalid=0.25, rope=0, rotate_queries=False):
    wi = RNG.integers(0, W, (B, S, w)).astype(np.int32)
    ti = RNG.integers(0, max(N, 1), (B, S, k)).astype(np.int32)
    wi[RNG.random(wi.shape) < invalid] = -1
    ti[RNG.random(ti.shape) < invalid] = -1
    case = dict(q=arr(RNG.standard_normal((B, S, H, D)) * 2, dtype),
                window_kv=arr(RNG.standard_normal((B, W, D)), dtype), window_idx=mx.array(wi),
                compressed_kv=arr(RNG.standard_normal((B, N, D)), dtype), topk_idx=mx.array(ti),
                sinks=arr(RNG.standard_normal(H)), scale=D ** -0.5)
    if rope:
        theta = RNG.uniform(-np.pi, np.pi, (B, S, rope))
        case.update(rope_cos=arr(np.cos(theta)), rope_sin=arr(np.sin(theta)), rotate_queries=rotate_queries)
    return case


def compare_attention(case):
    assert sa.kernel_supports(case["q"], case["window_kv"], case["compressed_kv"], case.get("rope_cos"))
    got = f32(sa.sparse_attention_kernel(**case))
    want = f32(sa.sparse_attention_reference(**case))
    assert np.isfinite(got).all(), "kernel left unwritten (NaN-poisoned) or non-finite outputs"
    kv_max = max(np.abs(f32(case["window_kv"])).max(), np.abs(f32(case["compressed_kv"])).max())
    if case["q"].dtype == mx.float32:
        # Same fp32 math in another order (online softmax by splits): fp32 rounding only.
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * kv_max)
    else:
        # Both round probabilities to bf16, but relative to different running maxima: each
        # weight may differ by 2^-8 relative, the weighted mean of rows by 2^-8 * max|kv|;
        # plus one bf16 output ulp (2^-8 relative). Bound 2^-7 * max|kv| + 2^-8 |out|.
        assert np.all(np.abs(got - want) <= 2.0 ** -7 * kv_max + 2.0 ** -8 * np.abs(want))
    return got


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_attention_decode_real_shape(dtype):
    compare_attention(attention_case(1, 1, 64, 512, 128, 700, 128, 512, dtype))
    # As the decode step calls it: queries rotated and the output de-rotated inside.
    compare_attention(attention_case(1, 1, 64, 512, 128, 700, 128, 512, dtype, rope=32, rotate_queries=True))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_attention_multi_query_odd_sizes(dtype):
    # B*S up to the kernel's MAX_KERNEL_QUERIES (8); more queries take the reference.
    compare_attention(attention_case(2, 4, 11, 96, 13, 37, 9, 7, dtype))
    compare_attention(attention_case(1, 8, 64, 512, 144, 300, 128, 64, dtype, rope=32))
    compare_attention(attention_case(2, 3, 11, 64, 13, 37, 9, 7, dtype, rope=8, rotate_queries=True))


def test_attention_all_invalid_and_one_row():
    case = attention_case(1, 3, 8, 64, 8, 8, 5, 4, mx.bfloat16, invalid=0.0)
    wi, ti = np.array(case["window_idx"]), np.array(case["topk_idx"])
    wi[0, 0] = -1; ti[0, 0] = -1                   # no valid row -> zeros
    wi[0, 1] = [3, -1, -1, -1, -1]; ti[0, 1] = -1  # exactly one row
    ti[0, 2] = [100, -5, 2, 2]                     # out of range = none; a repeated row counts twice
    case.update(window_idx=mx.array(wi), topk_idx=mx.array(ti))
    got = compare_attention(case)
    assert np.all(got[0, 0] == 0)


def test_attention_without_compressed_and_single_row_caches():
    case = attention_case(2, 1, 4, 32, 1, 1, 1, 1, mx.float32, invalid=0.0)
    compare_attention(case)
    got = f32(sa.sparse_attention(**dict(case, compressed_kv=None, topk_idx=None)))
    want = f32(sa.sparse_attention_reference(**dict(case, compressed_kv=None, topk_idx=None)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_attention_layouts_change_no_value():
    """[R] angles shared by every query equal the same angles given per query, and `shape`
    (the output as grouped wo_a takes it) only lays the same values out: bit for bit."""
    B, S, H, D, R = 1, 3, 64, 512, 32
    case = attention_case(B, S, H, D, 128, 64, 16, 8, mx.bfloat16)
    theta = RNG.uniform(-np.pi, np.pi, R)
    cos, sin = arr(np.cos(theta)), arr(np.sin(theta))
    per_query = sa.sparse_attention_kernel(**case, rope_cos=mx.broadcast_to(cos, (B, S, R)),
                                           rope_sin=mx.broadcast_to(sin, (B, S, R)))
    shared = sa.sparse_attention_kernel(**case, rope_cos=cos, rope_sin=sin)
    grouped = sa.sparse_attention_kernel(**case, rope_cos=cos, rope_sin=sin, shape=(B * S, 8, 1, H * D // 8))
    assert np.isfinite(f32(per_query)).all()
    np.testing.assert_array_equal(f32(shared), f32(per_query))
    np.testing.assert_array_equal(f32(grouped), f32(per_query).reshape(B * S, 8, 1, H * D // 8))


def decode_attention_cases(S, odd_heads, edge_heads, edge_compressed, edge_selected):
    """The decode kernels against the reference at decode and verify widths: V4.1's shape with the
    fused RoPE both ways (512 of 8192 compressed rows), 512 of 512 selected; odd sizes over two
    batches; the edge cases (no row, one row, out of range)."""
    compare_attention(attention_case(1, S, 64, 512, 128, 8192, 128, 512, mx.bfloat16, rope=32, rotate_queries=True))
    compare_attention(attention_case(1, S, 64, 512, 128, 512, 128, 512, mx.bfloat16, invalid=0.0))
    # 2 x (S // 2 + 1) queries would pass the kernels' 8 at S = 8
    compare_attention(attention_case(2, min(S // 2 + 1, sa.MAX_KERNEL_QUERIES // 2), odd_heads, 256, 13, 37, 9, 29,
                                     mx.bfloat16, rope=8))
    case = attention_case(1, 3, edge_heads, 512, 8, edge_compressed, 5, edge_selected, mx.bfloat16, invalid=0.0)
    wi, ti = np.array(case["window_idx"]), np.array(case["topk_idx"])
    wi[0, 0] = -1; ti[0, 0] = -1
    wi[0, 1] = [3, -1, -1, -1, -1]; ti[0, 1] = -1
    ti[0, 2, :4] = [100, -5, 2, 2]
    case.update(window_idx=mx.array(wi), topk_idx=mx.array(ti))
    assert np.all(compare_attention(case)[0, 0] == 0)


@pytest.mark.parametrize("S", [1, 4, 8])
def test_attention_staged_decode_kernel(S):
    """The staged partial on tensor cores with the 8-row merge (DSV4_KERNEL_ATTENTION_STAGED_DECODE):
    all the heads in one threadgroup, so 32 heads for the odd sizes and 16 (over 3 splits) at the edges."""
    from dsv4.kernels import attention_decode_staged as staged
    with flags.override(kernel_attention_staged_decode=True):
        q, kv = mx.zeros((1, S, 64, 512), mx.bfloat16), mx.zeros((1, 8, 512), mx.bfloat16)
        assert staged.applies(q, kv, kv)
        decode_attention_cases(S, 32, 16, 40, 36)


@pytest.mark.parametrize("S", [1, 4, 8])
def test_attention_rows8_kernels(S):
    """The 8-row kernels (DSV4_KERNEL_ATTENTION_ROWS8): 11 heads for the odd sizes, 8 at the edges."""
    with flags.override(kernel_attention_rows8=True):
        assert sa.rows8_applies(mx.zeros((1, S, 64, 512), mx.bfloat16))
        decode_attention_cases(S, 11, 8, 8, 4)



# --- mHC ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,D,dtype", [(1, 5120, mx.bfloat16), (7, 96, mx.float32), (3, 5120, mx.bfloat16)])
def test_hc_mixes(tokens, D, dtype):
    X = arr(RNG.standard_normal((1, tokens, 4, D)), dtype)
    fn = arr(RNG.standard_normal((24, 4 * D)) / np.sqrt(4 * D))
    scale, base = arr(RNG.uniform(0.5, 2, 3)), arr(RNG.standard_normal(24))
    got = mhc.hc_mixes(X, fn, scale, base, 1e-20, 1e-6, 20)
    with flags.override(kernel_mhc=False):
        want = mhc.hc_mixes(X, fn, scale, base, 1e-20, 1e-6, 20)
    for g, w in zip(got, want):
        # fp32 dot products of 4D terms summed in another order (relative ~1e-6), through
        # sigmoid/softmax and 20 normalisations that do not amplify it.
        np.testing.assert_allclose(f32(g), f32(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens,D,dtype", [(1, 5120, mx.bfloat16), (5, 100, mx.float32)])
def test_hc_collapse_norm_and_expand(tokens, D, dtype):
    X = arr(RNG.standard_normal((1, tokens, 4, D)), dtype)
    pre = arr(RNG.uniform(0, 1, (1, tokens, 4)))
    post = arr(RNG.uniform(0, 2, (1, tokens, 4)))
    comb = arr(RNG.uniform(0, 1, (1, tokens, 4, 4)))
    weight = arr(RNG.uniform(0.5, 1.5, D), dtype)
    y = arr(RNG.standard_normal((1, tokens, D)), dtype)
    got_n, got_e = mhc.hc_collapse_norm(X, pre, weight, 1e-20), mhc.hc_expand(y, X, post, comb)
    want_n = mhc.hc_collapse_norm_reference(X, pre, weight, 1e-20)
    want_e = mhc.hc_expand_reference(y, X, post, comb)
    # One ulp of bf16 is at most 2^-7 of the value (8 significant bits; 2^-8 at the top of a
    # binade): rtol must cover the bottom of a binade.
    ulp = 2.0 ** -7 if dtype == mx.bfloat16 else 2.0 ** -20
    # The fp32 collapse summed in another order may round to the neighbouring value, which
    # moves the norm output by at most two ulps (<= 2^-6 relative in bf16). (With 2^-7, as
    # here before, a run on the H200 failed once in four.)
    np.testing.assert_allclose(f32(got_n), f32(want_n), rtol=2 * ulp, atol=1e-6)
    if dtype == mx.bfloat16:
        assert np.mean(f32(got_n) == f32(want_n)) > 0.95
    # Each side rounds an fp32 value once; the values differ by summation order, so the
    # results can be one ulp apart (<= 2^-7 relative in bf16).
    np.testing.assert_allclose(f32(got_e), f32(want_e), rtol=ulp, atol=1e-5)


@pytest.mark.parametrize("tokens,D,dtype", [(1, 5120, mx.bfloat16), (6, 100, mx.float32), (3, 5120, mx.bfloat16)])
def test_hc_site_entry_fused(tokens, D, dtype):
    X = arr(RNG.standard_normal((1, tokens, 4, D)), dtype)
    fn = arr(RNG.standard_normal((24, 4 * D)) / np.sqrt(4 * D))
    scale, base = arr(RNG.uniform(0.5, 2, 3)), arr(RNG.standard_normal(24))
    pre_in = arr(RNG.uniform(0, 1, (1, tokens, 4)))
    weight = arr(RNG.uniform(0.5, 1.5, D), dtype)
    args = (X, pre_in, fn, scale, base, weight, 1e-6, 1e-20, 1e-6, 20)
    got = mhc.hc_mixes_collapse_norm(*args)
    want = mhc.hc_mixes_collapse_norm_reference(*args)
    ulp = 2.0 ** -7 if dtype == mx.bfloat16 else 2.0 ** -20
    # x: as test_hc_collapse_norm_and_expand; the mixes: as test_hc_mixes.
    np.testing.assert_allclose(f32(got[0]), f32(want[0]), rtol=2 * ulp, atol=1e-6)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(f32(g), f32(w), rtol=1e-4, atol=1e-5)
    # The fused kernel runs the separate kernels' code on the same partial sums: same results.
    separate = (mhc.hc_collapse_norm(X, pre_in, weight, 1e-6), *mhc.hc_mixes(X, fn, scale, base, 1e-20, 1e-6, 20))
    for g, s in zip(got, separate):
        np.testing.assert_array_equal(f32(g), f32(s))


def test_hc_flat_token_layouts_change_no_value():
    """Streams with their tokens flat ([B*S, hc, D], as the model keeps them between blocks),
    pre/y in another layout of the same tokens and x written as [B, S, D] (x_shape) give the
    values of the [B, S, hc, D] layout bit for bit."""
    B, S, D = 1, 3, 5120
    X = arr(RNG.standard_normal((B, S, 4, D)), mx.bfloat16)
    fn = arr(RNG.standard_normal((24, 4 * D)) / np.sqrt(4 * D))
    scale, base = arr(RNG.uniform(0.5, 2, 3)), arr(RNG.standard_normal(24))
    pre_in = arr(RNG.uniform(0, 1, (B, S, 4)))
    weight = arr(RNG.uniform(0.5, 1.5, D), mx.bfloat16)
    y = arr(RNG.standard_normal((B, S, D)), mx.bfloat16)
    flat = X.reshape(B * S, 4, D)
    nested = mhc.hc_mixes_collapse_norm(X, pre_in, fn, scale, base, weight, 1e-6, 1e-20, 1e-6, 20)
    got = mhc.hc_mixes_collapse_norm(flat, pre_in, fn, scale, base, weight, 1e-6, 1e-20, 1e-6, 20,
                                     x_shape=(B, S, D))
    assert got[0].shape == (B, S, D)
    for g, n in zip(got, nested):
        np.testing.assert_array_equal(f32(g).reshape(-1), f32(n).reshape(-1))
    pre, post, comb = got[1:]
    np.testing.assert_array_equal(f32(mhc.hc_collapse_norm(flat, pre_in, weight, 1e-6, (B, S, D))),
                                  f32(mhc.hc_collapse_norm(X, pre_in, weight, 1e-6)))
    np.testing.assert_array_equal(f32(mhc.hc_expand(y, flat, post, comb)).reshape(-1),
                                  f32(mhc.hc_expand(y, X, post.reshape(B, S, 4), comb.reshape(B, S, 4, 4))).reshape(-1))



@pytest.mark.parametrize("tokens,D,dtype", [(1, 5120, mx.bfloat16), (3, 5120, mx.bfloat16), (2, 96, mx.float32)])
def test_hc_site_entry_fp8_copy_and_projection_from_expand(tokens, D, dtype):
    """The FFN site as the model runs it: the attention site's expand also projects the new
    streams; the entry then launches once. The expand is the plain expand kernel's bit for
    bit; the mixes are the reference's within test_hc_mixes' tolerance, x the kernel's without
    projection bit for bit; the fp8 copy is the rounding kernel's (= the reference's) of x."""
    X = arr(RNG.standard_normal((tokens, 4, D)), dtype)
    y = arr(RNG.standard_normal((1, tokens, D)), dtype)
    post, comb = arr(RNG.uniform(0, 2, (tokens, 4))), arr(RNG.uniform(0, 1, (tokens, 4, 4)))
    fn = arr(RNG.standard_normal((24, 4 * D)) / np.sqrt(4 * D))
    scale, base = arr(RNG.uniform(0.5, 2, 3)), arr(RNG.standard_normal(24))
    pre_in = arr(RNG.uniform(0, 1, (tokens, 4)))
    weight = arr(RNG.uniform(0.5, 1.5, D), dtype)
    streams, projection = mhc.hc_expand(y, X, post, comb, fn)
    assert projection is not None
    np.testing.assert_array_equal(f32(streams), f32(mhc.hc_expand(y, X, post, comb)))
    args = (streams, pre_in, fn, scale, base, weight, 1e-6, 1e-20, 1e-6, 20)
    x, x_fp8, *mixes = mhc.hc_mixes_collapse_norm(*args, fp8_copy=True, projection=projection)
    separate = mhc.hc_mixes_collapse_norm(*args)
    np.testing.assert_array_equal(f32(x), f32(separate[0]))
    np.testing.assert_array_equal(f32(x_fp8), f32(qdq_fp8(separate[0])))
    with flags.override(kernel_qdq=False):
        np.testing.assert_array_equal(f32(x_fp8), f32(qdq_fp8(separate[0])))
    want = mhc.hc_mixes_reference(streams, fn, scale, base, 1e-20, 1e-6, 20)
    for g, w in zip(mixes, want):
        np.testing.assert_allclose(f32(g), f32(w), rtol=1e-4, atol=1e-5)


# --- fused experts ------------------------------------------------------------------------------

def quantized(shape, mode, bits, gs, scale_dtype=mx.bfloat16):
    w = arr(RNG.standard_normal(shape) * 0.05, scale_dtype)
    parts = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
    return ex.QuantizedMatrix(parts[0], parts[1], parts[2] if mode == "affine" else None, gs, bits, mode)


def test_experts_with_fused_expand_equals_expand_kernel():
    E, I, D, K, T = 12, 256, 512, 6, 2
    gate, up, down = (quantized(s, "mxfp4", 4, 32) for s in ((E, I, D), (E, I, D), (E, D, I)))
    x = arr(RNG.standard_normal((T, D)) * 3, mx.bfloat16)
    idx = mx.array(np.stack([RNG.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32))
    rw = arr(RNG.uniform(0.05, 1.0, (T, K)))
    residual = arr(RNG.standard_normal((T, 4, D)), mx.bfloat16)
    post, comb = arr(RNG.uniform(0, 2, (T, 4))), arr(RNG.uniform(0, 1, (T, 4, 4)))
    fused = f32(ex.experts_kernel(x, idx, rw, gate, up, down, None, 10.0, True, (residual, post, comb)))
    y = ex.experts_kernel(x, idx, rw, gate, up, down, None, 10.0, True)
    # The epilogue does hc_expand's fp32 operations in the same order on the same y, so the
    # results agree exactly unless the compiler contracts them differently (then 1 ulp).
    want = f32(mhc.hc_expand(y, residual, post, comb))
    np.testing.assert_allclose(fused, want, rtol=2.0 ** -7, atol=1e-6)
    assert np.mean(fused == want) > 0.99


@pytest.mark.parametrize("tokens", [1, 3])
def test_experts_down_makes_the_next_sites_entry_partials(tokens):
    """DSV4_KERNEL_MOE_NEXT_PROJECTION at V4.1's width (mxfp4 experts, the mxfp8 shared expert):
    the expand that also carries the next site's fn and pre_in gives the plain fused expand's
    streams bit for bit, and a projection whose entry (its finish alone) gives the entry's x of
    the partials launch (the same collapse; its RMS factor summed in another order: an ulp apart
    at most, rarely) and the reference's mixes."""
    E, I, D, K = 24, 256, 5120, 6
    gate, up, down = (quantized(s, "mxfp4", 4, 32) for s in ((E, I, D), (E, I, D), (E, D, I)))
    shared = tuple(quantized(s, "mxfp8", 8, 32) for s in ((I, D), (I, D), (D, I)))
    x = arr(RNG.standard_normal((tokens, D)) * 3, mx.bfloat16)
    idx = mx.array(np.stack([RNG.choice(E, K, replace=False) for _ in range(tokens)]).astype(np.int32))
    rw = arr(RNG.uniform(0.05, 1.0, (tokens, K)))
    expand = (arr(RNG.standard_normal((tokens, 4, D)), mx.bfloat16), arr(RNG.uniform(0, 2, (tokens, 4))),
              arr(RNG.uniform(0, 1, (tokens, 4, 4))))
    fn = arr(RNG.standard_normal((24, 4 * D)) / np.sqrt(4 * D))
    pre_in = arr(RNG.uniform(0, 1, (tokens, 4)))
    streams, projection = ex.experts(x, idx, rw, gate, up, down, shared, 10.0, True, expand + (fn, pre_in))
    assert projection is not None and projection.collapsed is not None
    np.testing.assert_array_equal(f32(streams), f32(ex.experts(x, idx, rw, gate, up, down, shared, 10.0, True, expand)))
    scale, base = arr(RNG.uniform(0.5, 2, 3)), arr(RNG.standard_normal(24))
    weight = arr(RNG.uniform(0.5, 1.5, D), mx.bfloat16)
    args = (streams, pre_in, fn, scale, base, weight, 1e-6, 1e-20, 1e-6, 20)
    x_in, *mixes = mhc.hc_mixes_collapse_norm(*args, projection=projection)
    separate = mhc.hc_mixes_collapse_norm(*args)
    np.testing.assert_allclose(f32(x_in), f32(separate[0]), rtol=2.0 ** -8, atol=0)
    assert np.mean(f32(x_in) == f32(separate[0])) > 0.999
    want = mhc.hc_mixes_reference(streams, fn, scale, base, 1e-20, 1e-6, 20)
    for g, w in zip(mixes, want):
        np.testing.assert_allclose(f32(g), f32(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens,expand", [(1, True), (3, False), (8, True)])
def test_routed_experts_run_the_routers_tail_in_the_gate_up_kernel(tokens, expand):
    """The router's tail inside the gate/up launch (routed_experts) is the router kernel's
    code on the same logits: the same ids and bit-identical outputs to route() then the
    experts kernel. V4.1's router width (384 experts, top-6, normalised, scaled)."""
    from dsv4.kernels import router
    E, I, D, K = 384, 256, 512, 6
    gate, up, down = (quantized(s, "mxfp4", 4, 32) for s in ((E, I, D), (E, I, D), (E, D, I)))
    shared = tuple(quantized(s, "mxfp8", 8, 32) for s in ((I, D), (I, D), (D, I)))
    x = arr(RNG.standard_normal((tokens, D)) * 3, mx.bfloat16)
    logits = arr(RNG.standard_normal((tokens, E)))
    bias = arr(RNG.standard_normal(E) * 0.1)
    routing = (6, 1.0, 1.5, True)
    ex_args = None
    if expand:
        ex_args = (arr(RNG.standard_normal((tokens, 4, D)), mx.bfloat16), arr(RNG.uniform(0, 2, (tokens, 4))),
                   arr(RNG.uniform(0, 1, (tokens, 4, 4))))
    got = ex.routed_experts(x, logits, bias, *routing, gate, up, down, shared, 10.0, True, ex_args)
    ids, weights = router.route_kernel(logits, bias, *routing)
    want = ex.experts_kernel(x, ids, weights, gate, up, down, shared, 10.0, True, ex_args)
    with flags.override(kernel_moe_route=False):
        unfused = ex.routed_experts(x, logits, bias, *routing, gate, up, down, shared, 10.0, True, ex_args)
    assert got.shape == ((tokens, 4, D) if expand else (tokens, D))
    np.testing.assert_array_equal(f32(got), f32(want))
    np.testing.assert_array_equal(f32(unfused), f32(want))
    # The ids the down kernel read: one launch's outputs, compared with the router kernel's.
    _, fused_ids = ex.gate_up_kernel(x, None, None, gate, up, shared, 10.0, True, routing=(logits, bias, *routing))
    np.testing.assert_array_equal(np.array(fused_ids), np.array(ids))


MOE_MODES = [("mxfp4", 4, 32, ("mxfp8", 8, 32)), ("mxfp8", 8, 32, None), ("affine", 2, 32, ("affine", 4, 64)),
             ("affine", 3, 64, None), ("affine", 4, 128, ("affine", 8, 32)), ("affine", 8, 32, None)]


@pytest.mark.parametrize("mode,bits,gs,shared_mode", [m for m in MOE_MODES if m[3] is not None])
@pytest.mark.parametrize("tokens", [1, 8])
def test_experts_with_the_shared_expert_split(mode, bits, gs, shared_mode, tokens):
    """The down launch with the shared expert's rows over several SIMD groups
    (DSV4_KERNEL_MOE_SHARED_SPLITS=0: by its row's bytes over a routed row's)."""
    with flags.override(kernel_moe_shared_splits=0):
        test_experts(mode, bits, gs, shared_mode, tokens, True)


@pytest.mark.parametrize("mode,bits,gs,shared_mode", MOE_MODES)
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("act_quant", [False, True])
def test_experts(mode, bits, gs, shared_mode, tokens, act_quant):
    E, I, D, K = 10, 256, 512, 6
    gate, up = quantized((E, I, D), mode, bits, gs), quantized((E, I, D), mode, bits, gs)
    down = quantized((E, D, I), mode, bits, gs, mx.float32 if mode == "affine" else mx.bfloat16)
    if down.mode == "affine":     # GGUF-style fp32 scales on one matrix; all three must match
        gate, up = (quantized((E, I, D), mode, bits, gs, mx.float32) for _ in range(2))
    shared = None
    if shared_mode is not None:
        sm, sb, sg = shared_mode
        shared = (quantized((I, D), sm, sb, sg), quantized((I, D), sm, sb, sg), quantized((D, I), sm, sb, sg))
    x = arr(RNG.standard_normal((tokens, D)) * 3, mx.bfloat16)
    idx = mx.array(np.stack([RNG.choice(E, K, replace=False) for _ in range(tokens)]).astype(np.int32))
    if tokens > 1:
        idx[1:2] = idx[0:1]        # two tokens on the same experts
    rw = arr(RNG.uniform(0.05, 1.0, (tokens, K)))
    limit = 0.3                    # low enough for both clamps to act
    assert ex.kernel_supports(x, gate, up, down, shared)
    s_down = shared[2] if shared is not None else None
    # Each launch against its reference stage on the same input (bounds: check_hidden, check_down).
    h, _ = ex.gate_up_kernel(x, idx, rw, gate, up, shared, limit, act_quant)
    check_hidden(h, hidden_expected(x, idx, rw, gate, up, shared, limit, act_quant), act_quant)
    got = ex.down_kernel(h, idx, down, s_down)
    check_down(got, h, idx, down, s_down)
    # The whole (one call, two launches) is the composition of the two.
    np.testing.assert_array_equal(f32(ex.experts_kernel(x, idx, rw, gate, up, down, shared, limit, act_quant)),
                                  f32(got))


@pytest.mark.parametrize("I,D", [(256, 512), (2304, 5120)])   # V4.1's widths
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_mxfp4_gate_up_on_tensor_cores(I, D, tokens):
    """DSV4_KERNEL_MOE_MMA: the gate/up launch with mxfp4's routed experts on tensor cores (the
    mxfp8 shared expert in rows_dot), given ids and routed, against hidden_reference with the float
    unit's bounds, with and without act_quant (host emulation: tests/test_kernels_experts_host.py)."""
    from dsv4.kernels import experts_mma
    for act_quant in (True, False):
        with flags.override(kernel_moe_mma=True):
            case = mxfp4_gate_up(I, D, tokens, act_quant)
            assert experts_mma.applies(case[0], case[3], act_quant, False)


@pytest.mark.parametrize("I,D", [(256, 512), (2304, 5120)])   # V4.1's widths
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_mxfp4_down_on_tensor_cores(I, D, tokens):
    """DSV4_KERNEL_MOE_MMA's down launch (mxfp4's routed experts on tensor cores, the mxfp8 shared
    expert in rows_dot) against the reference's bounds, and the same as the whole experts call
    (host emulation: tests/test_kernels_experts_host.py)."""
    from dsv4.kernels import experts_mma
    with flags.override(kernel_moe_mma=True):
        x, idx, rw, gate, up, shared = mxfp4_gate_up(I, D, tokens, True)
        E = gate.weight.shape[0]
        down, s_down = quantized((E, D, I), "mxfp4", 4, 32), quantized((D, I), "mxfp8", 8, 32)
        h, _ = ex.gate_up_kernel(x, idx, rw, gate, up, shared, 0.3, True)
        assert experts_mma.down_applies(h, down, I, D, idx.shape[-1])
        got = ex.down_kernel(h, idx, down, s_down)
        check_down(got, h, idx, down, s_down)
        np.testing.assert_array_equal(f32(ex.experts_kernel(x, idx, rw, gate, up, down, shared + (s_down,), 0.3, True)),
                                      f32(got))


@pytest.mark.parametrize("I,D", [(256, 512), (2304, 5120)])   # V4.1's widths
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_mxfp4_integer_unit_gate_up(I, D, tokens):
    """DSV4_KERNEL_MOE_DP4A: the gate/up launch with mxfp4's routed experts in the integer unit
    (x fp8-rounded, as limbs; the mxfp8 shared expert as floats), given ids and routed, against
    hidden_reference with the float unit's bounds; the routed launch picks the router kernel's ids
    (host emulation: tests/test_kernels_experts_host.py)."""
    with flags.override(kernel_moe_dp4a=True):
        x, *_, gate, _, shared = mxfp4_gate_up(I, D, tokens, True)
        assert ex.integer_kinds(gate, shared[0], True) == (True, False)


def mxfp4_gate_up(I, D, tokens, act_quant):
    """V4.1's mxfp4 routed experts and mxfp8 shared expert (16 experts at V4.1's widths: 1.5 GB of
    host randoms, not 36), through the gate/up launch as the switches have it, given ids and
    routed: both checked against hidden_reference's bounds and each other. Returns the case."""
    from dsv4.kernels import router
    E, K = (384 if D < 5120 else 16), 6
    gate, up = quantized((E, I, D), "mxfp4", 4, 32), quantized((E, I, D), "mxfp4", 4, 32)
    shared = (quantized((I, D), "mxfp8", 8, 32), quantized((I, D), "mxfp8", 8, 32))
    x = arr(RNG.standard_normal((tokens, D)) * 3, mx.bfloat16)
    logits, bias = arr(RNG.standard_normal((tokens, E))), arr(RNG.standard_normal(E) * 0.1)
    idx, rw = router.route_kernel(logits, bias, K, 1.0, 1.5, True)
    h, _ = ex.gate_up_kernel(x, idx, rw, gate, up, shared, 0.3, act_quant)
    routed_h, ids = ex.gate_up_kernel(x, None, None, gate, up, shared, 0.3, act_quant,
                                      routing=(logits, bias, K, 1.0, 1.5, True))
    check_hidden(h, hidden_expected(x, idx, rw, gate, up, shared, 0.3, act_quant), act_quant)
    np.testing.assert_array_equal(np.array(ids), np.array(idx))
    np.testing.assert_array_equal(f32(routed_h), f32(h))
    return x, idx, rw, gate, up, shared
