"""mHC references against a float64 numpy transcription of model-spec §2.2, and dispatch. CPU."""

import numpy as np
import pytest

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import mhc
from dsv4.kernels import qdq as qdq_kernels
from dsv4.quant import qdq_fp8


def oracle_mixes(X, fn, scale, base, norm_eps, hc_eps, iters):
    hc = X.shape[-2]
    x = X.reshape(*X.shape[:-2], -1)
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + norm_eps)
    m = (x @ fn.T) * r
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))
    pre = sig(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * sig(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + hc_eps
    c = c / (c.sum(-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + hc_eps)
        c = c / (c.sum(-2, keepdims=True) + hc_eps)
    return pre, post, c


def random_site(rng, B, S, D, dtype=mx.bfloat16):
    X = mx.array(rng.standard_normal((B, S, 4, D)).astype(np.float32)).astype(dtype)
    fn = mx.array((rng.standard_normal((24, 4 * D)) / np.sqrt(4 * D)).astype(np.float32))
    scale = mx.array(rng.uniform(0.5, 2.0, 3).astype(np.float32))
    base = mx.array(rng.standard_normal(24).astype(np.float32))
    return X, fn, scale, base


def f64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 96)])
def test_mixes_reference_matches_spec(shape):
    rng = np.random.default_rng()
    X, fn, scale, base = random_site(rng, *shape)
    got = mhc.hc_mixes_reference(X, fn, scale, base, 1e-20, 1e-6, 20)
    want = oracle_mixes(f64(X), f64(fn), f64(scale), f64(base), 1e-20, 1e-6, 20)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), w, rtol=2e-5, atol=1e-6)   # fp32 vs fp64
    # Sinkhorn property: columns sum to ~1 after the last (column) normalisation.
    np.testing.assert_allclose(np.array(got[2]).sum(-2), 1.0, atol=1e-5)


def test_collapse_norm_reference_matches_spec():
    rng = np.random.default_rng()
    X, *_ = random_site(rng, 2, 2, 160)
    pre = mx.array(rng.uniform(0, 1, (2, 2, 4)).astype(np.float32))
    weight = mx.array(rng.uniform(0.5, 1.5, 160).astype(np.float32)).astype(mx.bfloat16)
    got = f64(mhc.hc_collapse_norm_reference(X, pre, weight, 1e-20))
    h = (f64(pre)[..., None] * f64(X)).sum(-2)
    want = f64(weight) * h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-20)
    # bf16 collapse and bf16 output: two roundings of at most 2^-8 relative each (half an ulp
    # of an 8-bit significand).
    np.testing.assert_allclose(got, want, rtol=2 * 2.0 ** -8, atol=1e-6)


def test_expand_reference_matches_spec():
    rng = np.random.default_rng()
    X, *_ = random_site(rng, 1, 3, 64)
    y = mx.array(rng.standard_normal((1, 3, 64)).astype(np.float32)).astype(mx.bfloat16)
    post = mx.array(rng.uniform(0, 2, (1, 3, 4)).astype(np.float32))
    comb = mx.array(rng.uniform(0, 1, (1, 3, 4, 4)).astype(np.float32))
    got = f64(mhc.hc_expand_reference(y, X, post, comb))
    want = f64(post)[..., None] * f64(y)[..., None, :] + np.einsum("bsij,bsid->bsjd", f64(comb), f64(X))
    np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=1e-5)   # one bf16 rounding (<= 2^-8)


def test_dispatch_uses_reference_on_cpu_and_kernels_when_switched(monkeypatch):
    rng = np.random.default_rng()
    X, fn, scale, base = random_site(rng, 1, 1, 32)
    assert mhc.backend() is None
    ref = mhc.hc_mixes(X, fn, scale, base, 1e-20, 1e-6)
    for a, b in zip(ref, mhc.hc_mixes_reference(X, fn, scale, base, 1e-20, 1e-6)):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    calls = []
    fake = lambda **kw: calls.append(kw) or [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
    monkeypatch.setattr(mhc, "backend", lambda: "metal")
    monkeypatch.setattr(mhc.Kernel, "__call__", lambda self, **kw: fake(**kw))
    pre, post, comb = mhc.hc_mixes(X, fn, scale, base, 1e-20, 1e-6)
    assert comb.shape == (1, 1, 4, 4) and len(calls) == 2
    with flags.override(kernel_mhc=False):
        mhc.hc_mixes(X, fn, scale, base, 1e-20, 1e-6)
        mhc.hc_expand(X[:, :, 0], X, pre, comb)
    assert len(calls) == 2
    mhc.hc_expand(X[:, :, 0], X, pre, comb)
    assert calls[-1]["grid"] == (256, 1, 1) and len(calls) == 3


def test_site_entry_reference_matches_spec():
    rng = np.random.default_rng()
    X, fn, scale, base = random_site(rng, 1, 2, 96)
    pre_in = mx.array(rng.uniform(0, 1, (1, 2, 4)).astype(np.float32))
    weight = mx.array(rng.uniform(0.5, 1.5, 96).astype(np.float32)).astype(mx.bfloat16)
    x, *mixes = mhc.hc_mixes_collapse_norm_reference(X, pre_in, fn, scale, base, weight, 1e-6,
                                                     1e-20, 1e-6, 20)
    h = (f64(pre_in)[..., None] * f64(X)).sum(-2)
    want_x = f64(weight) * h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(f64(x), want_x, rtol=2 * 2.0 ** -8, atol=1e-6)   # as the collapse test
    want = oracle_mixes(f64(X), f64(fn), f64(scale), f64(base), 1e-20, 1e-6, 20)
    for g, w in zip(mixes, want):
        np.testing.assert_allclose(np.array(g), w, rtol=2e-5, atol=1e-6)         # as the mixes test


def test_site_entry_dispatch_two_launches(monkeypatch):
    rng = np.random.default_rng()
    X, fn, scale, base = random_site(rng, 1, 3, 32)
    pre_in = mx.array(rng.uniform(0, 1, (1, 3, 4)).astype(np.float32))
    weight = mx.ones((32,), mx.bfloat16)
    args = (X, pre_in, fn, scale, base, weight, 1e-6, 1e-20, 1e-6, 20)
    got = mhc.hc_mixes_collapse_norm(*args)             # CPU: the references
    for a, b in zip(got, mhc.hc_mixes_collapse_norm_reference(*args)):
        np.testing.assert_array_equal(f64(a), f64(b))
    calls = []
    fake = lambda **kw: calls.append(kw) or [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
    monkeypatch.setattr(mhc, "backend", lambda: "cuda")
    monkeypatch.setattr(mhc.Kernel, "__call__", lambda self, **kw: fake(**kw))
    with flags.override(kernel_mhc_wide=False):         # the per-token launches (auto: wide under CUDA)
        x, pre, post, comb = mhc.hc_mixes_collapse_norm(*args)
    assert len(calls) == 2                              # projection + fused Sinkhorn/collapse
    assert (x.shape, x.dtype, pre.shape, comb.shape) == ((1, 3, 32), mx.bfloat16, (1, 3, 4), (1, 3, 4, 4))
    assert calls[1]["grid"] == (288, 3, 1)             # 8 collapse SIMD groups + 1 mixer, per token
    with flags.override(kernel_mhc=False):
        mhc.hc_mixes_collapse_norm(*args)
    assert len(calls) == 2


@pytest.mark.parametrize("gpu,wide", [("cuda", True), ("metal", False)])
def test_the_wide_entry_is_the_default_under_cuda_only(monkeypatch, gpu, wide):
    """auto: the H100 measured the wide launches faster (the slice's step 2.52 against 2.70 ms);
    no Mac has measured them."""
    monkeypatch.setattr(mhc, "backend", lambda: gpu)
    assert mhc.wide_entry(mx.zeros((1, 1, 4, 64), mx.bfloat16)) is wide
    with flags.override(kernel_mhc_wide="off" if wide else "on"):
        assert mhc.wide_entry(mx.zeros((1, 1, 4, 64), mx.bfloat16)) is not wide


def test_references_take_flat_token_layouts():
    """The model keeps streams with their tokens flat ([B*S, hc, D]) between blocks; pre, y and
    the output may be laid out per [B, S]: the same values as the nested layout, bit for bit."""
    rng = np.random.default_rng()
    bits = lambda a: np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).reshape(-1)
    B, S, D = 2, 3, 64
    X, fn, scale, base = random_site(rng, B, S, D)
    flat = X.reshape(B * S, 4, D)
    pre = mx.array(rng.uniform(0, 1, (B, S, 4)).astype(np.float32))
    weight = mx.array(rng.uniform(0.5, 1.5, D).astype(np.float32)).astype(mx.bfloat16)
    y = mx.array(rng.standard_normal((B, S, D)).astype(np.float32)).astype(mx.bfloat16)
    post = mx.array(rng.uniform(0, 2, (B * S, 4)).astype(np.float32))
    comb = mx.array(rng.uniform(0, 1, (B * S, 4, 4)).astype(np.float32))
    got = mhc.hc_collapse_norm_reference(flat, pre, weight, 1e-6, (B, S, D))
    assert got.shape == (B, S, D)
    np.testing.assert_array_equal(bits(got), bits(mhc.hc_collapse_norm_reference(X, pre, weight, 1e-6)))
    got = mhc.hc_expand_reference(y, flat, post, comb)
    want = mhc.hc_expand_reference(y, X, post.reshape(B, S, 4), comb.reshape(B, S, 4, 4))
    assert got.shape == (B * S, 4, D)
    np.testing.assert_array_equal(bits(got), bits(want))
    entry = mhc.hc_mixes_collapse_norm_reference(flat, pre, fn, scale, base, weight, 1e-6, 1e-20, 1e-6,
                                                 x_shape=(B, S, D))
    nested = mhc.hc_mixes_collapse_norm_reference(X, pre, fn, scale, base, weight, 1e-6, 1e-20, 1e-6)
    for g, n in zip(entry, nested):
        np.testing.assert_array_equal(bits(g), bits(n))


@pytest.fixture
def cuda_launches(monkeypatch):
    """From its call on, dispatch as under CUDA: each launch recorded in the list it returns as
    (kernel name, its arguments) and answered with zeros of its output shapes."""
    def start() -> list:
        calls = []

        def fake(kernel, **kw):
            calls.append((kernel.name, kw))
            return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        monkeypatch.setattr(mhc, "backend", lambda: "cuda")
        monkeypatch.setattr(qdq_kernels, "backend", lambda: "cuda")
        monkeypatch.setattr(mhc.Kernel, "__call__", fake)
        return calls
    return start


def test_site_entry_fp8_copy_and_projection_from_expand(cuda_launches):
    """fp8_copy adds qdq_fp8(x) (bit for bit) after x; hc_expand with the next site's fn gives
    its projection, which that site then takes instead of launching its own. On the kernel
    path: expand + projection in one launch, the site entry (fp8 copy included) in one."""
    rng = np.random.default_rng()
    X, fn, scale, base = random_site(rng, 1, 3, 64)
    pre_in = mx.array(rng.uniform(0, 1, (1, 3, 4)).astype(np.float32))
    weight = mx.array(rng.uniform(0.5, 1.5, 64).astype(np.float32)).astype(mx.bfloat16)
    args = (X, pre_in, fn, scale, base, weight, 1e-6, 1e-20, 1e-6, 20)
    plain = mhc.hc_mixes_collapse_norm(*args)
    x, x_fp8, *mixes = mhc.hc_mixes_collapse_norm(*args, fp8_copy=True)       # CPU: the references
    np.testing.assert_array_equal(f64(x_fp8), f64(qdq_fp8(plain[0])))
    assert not np.array_equal(f64(x_fp8), f64(x))                             # rounding happened
    for a, b in zip((x, *mixes), plain):
        np.testing.assert_array_equal(f64(a), f64(b))
    post = mx.array(rng.uniform(0, 2, (1, 3, 4)).astype(np.float32))
    comb = mx.array(rng.uniform(0, 1, (1, 3, 4, 4)).astype(np.float32))
    streams, projection = mhc.hc_expand(X[:, :, 0], X, post, comb, fn)
    np.testing.assert_array_equal(f64(streams), f64(mhc.hc_expand(X[:, :, 0], X, post, comb)))
    assert projection is None

    calls = cuda_launches()
    streams, projection = mhc.hc_expand(X[:, :, 0], X, post, comb, fn)
    assert [c[0] for c in calls] == ["dsv4_hc_expand_project"] and projection[1] == 1
    assert calls[0][1]["grid"] == (256, 3, 1) and calls[0][1]["output_shapes"][1] == (3 * 25,)
    x, x_fp8, pre, post, comb = mhc.hc_mixes_collapse_norm(streams, *args[1:], fp8_copy=True,
                                                          projection=projection)
    assert [c[0] for c in calls[1:]] == ["dsv4_hc_sinkhorn_collapse_norm_fp8"]
    assert ("SPLITS", 1) in calls[1][1]["template"]
    assert (x.shape, x_fp8.shape, x_fp8.dtype, comb.shape) == ((1, 3, 64), (1, 3, 64), mx.bfloat16, (1, 3, 4, 4))


def test_wide_path_launches(cuda_launches):
    """DSV4_KERNEL_MHC_WIDE: a site entry is the partials over D/32 column blocks per token and
    the finish over D/256 + 1 threadgroups; the expand given the next site's fn and pre makes
    that site's partials, whose entry then launches once; without pre, or past
    WIDE_MAX_TOKENS tokens, the per-token kernels run."""
    rng = np.random.default_rng()
    X, fn, scale, base = random_site(rng, 1, 3, 96)
    pre_in = mx.array(rng.uniform(0, 1, (1, 3, 4)).astype(np.float32))
    weight = mx.ones((96,), mx.bfloat16)
    args = (pre_in, fn, scale, base, weight, 1e-6, 1e-20, 1e-6, 20)
    calls = cuda_launches()
    with flags.override(kernel_mhc_wide=True):
        x, x_fp8, pre, post, comb = mhc.hc_mixes_collapse_norm(X, *args, fp8_copy=True)
        assert [c[0] for c in calls] == ["dsv4_hc_entry_partials", "dsv4_hc_entry_finish_fp8"]
        assert calls[0][1]["grid"] == (32 * 3, 3, 1) and calls[0][1]["output_shapes"] == [(3 * 3 * 26,), (3, 96)]
        assert calls[1][1]["grid"] == (256 * 2, 3, 1) and ("SPLITS", 3) in calls[1][1]["template"]
        assert (x.shape, x_fp8.shape, comb.shape) == ((1, 3, 96), (1, 3, 96), (1, 3, 4, 4))
        y = X[:, :, 0]
        streams, projection = mhc.hc_expand(y, X, post, comb, fn, pre_in)
        assert calls[2][0] == "dsv4_hc_expand_partials" and calls[2][1]["grid"] == (32 * 3, 3, 1)
        assert streams.shape == X.shape and projection.splits == 3 and projection.collapsed.shape == (3, 96)
        mhc.hc_mixes_collapse_norm(streams, *args, projection=projection)
        assert [c[0] for c in calls[3:]] == ["dsv4_hc_entry_finish"]
        assert calls[3][1]["inputs"][4] is projection.collapsed
        mhc.hc_expand(y, X, post, comb, fn)
        assert calls[4][0] == "dsv4_hc_expand_project"
        many = mx.zeros((mhc.WIDE_MAX_TOKENS + 1, 4, 96), mx.bfloat16)
        mhc.hc_mixes_collapse_norm(many, mx.zeros((many.shape[0], 4)), *args[1:])
        assert [c[0] for c in calls[5:]] == ["dsv4_hc_project", "dsv4_hc_sinkhorn_collapse_norm"]
    with flags.override(kernel_mhc_wide=False):
        mhc.hc_mixes_collapse_norm(X, *args)
        assert [c[0] for c in calls[7:]] == ["dsv4_hc_project", "dsv4_hc_sinkhorn_collapse_norm"]


def test_prefill_projects_in_tiles(cuda_launches):
    """DSV4_KERNEL_MHC_TILES: from TILES_MIN_TOKENS tokens a site entry's projection runs in tiles
    of TILE_TOKENS tokens (the last part-filled), and the expand given the next site's fn leaves
    the projection to that entry (no partials of its own); fewer tokens keep a threadgroup per
    token, and so does every count with the switch off."""
    rng = np.random.default_rng()
    n = mhc.TILES_MIN_TOKENS + 1
    X, fn, scale, base = random_site(rng, 1, n, 96)
    pre_in = mx.array(rng.uniform(0, 1, (1, n, 4)).astype(np.float32))
    args = (pre_in, fn, scale, base, mx.ones((96,), mx.bfloat16), 1e-6, 1e-20, 1e-6, 20)
    calls = cuda_launches()
    with flags.override(kernel_mhc_tiles=True):
        streams, projection = mhc.hc_expand(X[:, :, 0], X, *mhc.hc_mixes(X, fn, scale, base, 1e-6, 1e-20)[1:], fn)
        assert [c[0] for c in calls[2:]] == ["dsv4_hc_expand"] and projection is None
        mhc.hc_mixes_collapse_norm(streams, *args, projection=projection)
        assert [c[0] for c in calls[3:]] == ["dsv4_hc_project_tiles", "dsv4_hc_sinkhorn_collapse_norm"]
        tiles = -(-n // mhc.TILE_TOKENS)
        assert calls[3][1]["grid"] == (mhc.PROJECT_THREADS, 1, tiles) and ("TT", mhc.TILE_TOKENS) in calls[3][1]["template"]
        mhc.hc_mixes_collapse_norm(X[:, :mhc.TILES_MIN_TOKENS - 1], pre_in[:, :mhc.TILES_MIN_TOKENS - 1], *args[1:])
        assert calls[5][0] == "dsv4_hc_project"
    with flags.override(kernel_mhc_tiles=False):
        mhc.hc_mixes_collapse_norm(X, *args)
        assert calls[7][0] == "dsv4_hc_project"
