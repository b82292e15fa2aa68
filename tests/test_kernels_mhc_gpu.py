"""The wide mHC decode path (DSV4_KERNEL_MHC_WIDE) on the GPU against the plain-MLX references and
the per-token kernels it replaces: `pytest -m gpu tests/test_kernels_mhc_gpu.py` on the H200.

Outputs are poisoned (NaN) before each launch; each test also checks that the wide launches
ran (a test of the old kernels under another name would pass too)."""

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import flags
from dsv4.kernels import mhc
from dsv4.quant import qdq_fp8
from tests.test_kernels_gpu import RNG, arr, f32
from tests.test_model_gpu import KERNELS_OFF, fixed_greedy, greedy

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels_poisoned")]


@pytest.fixture
def launched(monkeypatch):
    """The names of the kernels launched from here on."""
    names, call = [], mhc.Kernel.__call__

    def record(kernel, **kw):
        names.append(kernel.name)
        return call(kernel, **kw)
    monkeypatch.setattr(mhc.Kernel, "__call__", record)
    return names


def site(tokens, D, dtype):
    X = arr(RNG.standard_normal((tokens, 4, D)), dtype)
    fn = arr(RNG.standard_normal((24, 4 * D)) / np.sqrt(4 * D))
    scale, base = arr(RNG.uniform(0.5, 2, 3)), arr(RNG.standard_normal(24))
    pre_in = arr(RNG.uniform(0, 1, (tokens, 4)))
    weight = arr(RNG.uniform(0.5, 1.5, D), dtype)
    return X, (pre_in, fn, scale, base, weight, 1e-6, 1e-20, 1e-6, 20)


def check_entry(got, want, fp8, dtype):
    """As test_kernels_gpu's site-entry tests: x within two ulps of the reference's (the
    collapse and its sum of squares in another order), the mixes within fp32 summation
    (1e-4 / 1e-5, no amplification by the Sinkhorn), the fp8 copy the rounding of x bit for bit."""
    x, *rest = got
    ulp = 2.0 ** -7 if dtype == mx.bfloat16 else 2.0 ** -20
    assert np.isfinite(f32(x)).all()
    np.testing.assert_allclose(f32(x), f32(want[0]), rtol=2 * ulp, atol=1e-6)
    if fp8:
        np.testing.assert_array_equal(f32(rest[0]), f32(qdq_fp8(x)))
        rest = rest[1:]
    for g, w in zip(rest, want[-3:]):
        np.testing.assert_allclose(f32(g), f32(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens,D,dtype,fp8", [
    (1, 5120, mx.bfloat16, True), (4, 5120, mx.bfloat16, True), (8, 5120, mx.bfloat16, False),
    (3, 100, mx.float32, False), (2, 96, mx.float32, True)])
def test_wide_attention_site_entry(launched, tokens, D, dtype, fp8):
    """The attention site as a decode step runs it: entry partials from the streams, then the
    finish (with the fp8 copy for wq_a/wkv)."""
    X, args = site(tokens, D, dtype)
    with flags.override(kernel_mhc_wide=True):
        got = mhc.hc_mixes_collapse_norm(X, *args, fp8_copy=fp8)
    assert launched[0] == "dsv4_hc_entry_partials" and launched[1].startswith("dsv4_hc_entry_finish")
    check_entry(got, mhc.hc_mixes_collapse_norm_reference(X, *args, fp8_copy=fp8), fp8, dtype)
    # Against the per-token kernels: the same x but where the sum of h^2 in another order
    # moves the norm factor across a rounding boundary.
    old = mhc.hc_mixes_collapse_norm(X, *args)
    if dtype == mx.bfloat16:
        assert np.mean(f32(got[0]) == f32(old[0])) > 0.95


@pytest.mark.parametrize("tokens,D,dtype", [(1, 5120, mx.bfloat16), (4, 5120, mx.bfloat16), (5, 100, mx.float32)])
def test_wide_ffn_site_from_the_expand(launched, tokens, D, dtype):
    """The FFN site: the attention's expand makes the new streams (the plain expand kernel's bit
    for bit) and the FFN entry's partials; the entry then launches only the finish."""
    R, args = site(tokens, D, dtype)
    pre_in, fn = args[0], args[1]
    y = arr(RNG.standard_normal((tokens, D)), dtype)
    post, comb = arr(RNG.uniform(0, 2, (tokens, 4))), arr(RNG.uniform(0, 1, (tokens, 4, 4)))
    with flags.override(kernel_mhc_wide=True):
        streams, projection = mhc.hc_expand(y, R, post, comb, fn, pre_in)
        got = mhc.hc_mixes_collapse_norm(streams, *args, projection=projection)
    assert launched == ["dsv4_hc_expand_partials", "dsv4_hc_entry_finish"]
    np.testing.assert_array_equal(f32(streams), f32(mhc.hc_expand(y, R, post, comb)))
    check_entry(got, mhc.hc_mixes_collapse_norm_reference(streams, *args), False, dtype)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from dsv4.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpu-mhc") / "ckpt", seed=0)


def test_fp32_fixed_decode_with_wide_mhc_equals_reference_over_64_greedy_steps(ckpt, launched):
    """The lean decode with the wide mHC path against the plain reference path without kernels
    (test_model_gpu's check): fp32, roundings off, the same greedy tokens, logits within 1e-4."""
    model, _ = dsv4.load(ckpt, dtype=mx.float32)
    prompt = np.random.default_rng(3).integers(7, 500, (1, 24))
    with flags.override(kv_qdq=False, act_quant=False):
        with flags.override(kernel_mhc_wide=True):
            fast_tokens, fast_logits = fixed_greedy(model, prompt, 64)
        with flags.override(fixed_decode="off", **KERNELS_OFF):
            ref_tokens, ref_logits = greedy(model, prompt, 64)
    assert {"dsv4_hc_entry_partials", "dsv4_hc_expand_partials", "dsv4_hc_entry_finish"} <= set(launched)
    assert fast_tokens == ref_tokens
    err = float(mx.max(mx.abs(fast_logits - ref_logits)) / mx.max(mx.abs(ref_logits)))
    assert err < 1e-4, err


@pytest.mark.parametrize("tokens", [mhc.TILES_MIN_TOKENS + 1, 2048])
def test_prefill_projection_in_tiles(launched, tokens):
    """DSV4_KERNEL_MHC_TILES at V4.1's width: a site entry's mixes bit for bit the per-token
    projection's (the same sums in the same order), the last tile part-filled; the expand leaves
    its projection to the entry, whose x and mixes are then the reference's as check_entry bounds."""
    X, args = site(tokens, 5120, mx.bfloat16)
    with flags.override(kernel_mhc_tiles=False):
        want = mhc.hc_mixes_collapse_norm(X, *args)
    launched.clear()
    with flags.override(kernel_mhc_tiles=True):
        got = mhc.hc_mixes_collapse_norm(X, *args)
        assert "dsv4_hc_project_tiles" in launched and "dsv4_hc_project" not in launched
        for g, w in zip(got, want):
            np.testing.assert_array_equal(f32(g), f32(w))
        y = X[:, 0]
        streams, projection = mhc.hc_expand(y, X, got[2], got[3], args[1])
        assert projection is None and launched[-1] == "dsv4_hc_expand"
        entry = mhc.hc_mixes_collapse_norm(streams, *args, projection=projection)
    reference = mhc.hc_mixes_collapse_norm_reference(streams, *args)
    check_entry(entry, reference, False, mx.bfloat16)
