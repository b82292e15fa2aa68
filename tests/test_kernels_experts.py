"""Fused-experts reference (gather_qmm path) against a numpy transcription of model-spec §4 that
decodes MLX's packed layouts itself; the decoder is checked bit-exactly against
mx.dequantize (the kernel decodes the same layouts). Plus dispatch rules. CPU, runs in CI."""

import numpy as np
import pytest

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import dialect
from dsv4.kernels import experts as ex
from tests.formats import E2M1, e4m3_value

MODES = [("mxfp4", 4, 32), ("mxfp8", 8, 32), ("affine", 2, 32), ("affine", 3, 64),
         ("affine", 4, 128), ("affine", 8, 32)]


def codes(weight, bits):
    """Unsigned codes of an MLX-packed matrix: a little-endian bit stream, value i at bit i*bits."""
    w = np.array(weight).astype(np.uint32)
    stream = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little")
    n = stream.shape[-1] // bits
    chunks = stream[..., :n * bits].reshape(*stream.shape[:-1], n, bits).astype(np.int64)
    return (chunks << np.arange(bits)).sum(-1)


def dequantize_np(m: ex.QuantizedMatrix):
    c = codes(m.weight, m.bits)
    reps = lambda a: np.repeat(np.array(a.astype(mx.float32)).astype(np.float64) if a.dtype != mx.uint8
                               else np.array(a).astype(np.float64), m.group_size, axis=-1)
    if m.mode == "affine":
        return reps(m.scales) * c + reps(m.biases)
    scale = 2.0 ** (reps(m.scales) - 127)
    return scale * (E2M1[c] if m.mode == "mxfp4" else e4m3_value(c))


def f64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


def bf16(a):
    """Round float64/32 to bf16 (nearest, ties to even), returned as float64."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


def quantized(rng, shape, mode, bits, gs, scale_dtype=mx.bfloat16):
    w = mx.array((rng.standard_normal(shape) * 0.05).astype(np.float32)).astype(scale_dtype)
    parts = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
    return ex.QuantizedMatrix(parts[0], parts[1], parts[2] if mode == "affine" else None, gs, bits, mode)


def bf16_neighbours(v):
    """The bf16 values next to each of v's (bf16 values as float64), below and above in magnitude."""
    bits = np.asarray(v, np.float32).view(np.uint32)
    sign, magnitude = bits & 0x80000000, bits & 0x7FFFFFFF
    step = lambda m: (sign | m).astype(np.uint32).view(np.float32).astype(np.float64)
    return step(np.maximum(magnitude, 0x10000) - 0x10000), step(magnitude + 0x10000)


def hidden_expected(x, idx, rw, gate, up, shared, limit, act_quant):
    """(hidden_reference's h, its spread): how far the clamped SwiGLU times the route weight
    moves (float64, before h's own rounding) when g or u, or both, land one bf16 step from the
    reference's. Summed in another order, a kernel's fp32 g or u next to a rounding boundary
    rounds to the neighbouring bf16 value, and SiLU's slope carries that step into h scaled by
    |1 + g(1 - sigmoid(g))| (~3 at g = -4), past one bf16 step of h."""
    want = ex.hidden_reference(x, idx, rw, gate, up, shared, limit, act_quant)
    g, u = (bf16(f64(a)) for a in ex.gate_up_reference(x, idx, gate, up, shared, act_quant))
    route = f64(rw)
    if shared is not None:
        route = np.concatenate([route, np.ones((route.shape[0], 1))], axis=1)
    route = route[..., None]

    def swiglu(gv, uv):
        gv = np.minimum(gv, limit)
        return gv / (1 + np.exp(-gv)) * np.clip(uv, -limit, limit) * route

    base = swiglu(g, u)
    spread = np.maximum.reduce([np.abs(swiglu(gv, uv) - base)
                                for gv in (g, *bf16_neighbours(g)) for uv in (u, *bf16_neighbours(u))])
    return want, spread


def check_hidden(got_h, expected, act_quant):
    """The gate/up stage's h (a kernel's) against `hidden_expected`'s (h, spread) for the same input.

    The same roundings (g and u to bf16, h to bf16 and with act_quant to fp8 per 32) of fp32
    sums in another order (and, affine, as scale * sum(q x) + bias * sum(x) per group): g or u
    may land on the neighbouring bf16 value (the spread), and h next to a rounding boundary on
    the neighbouring grid point, one step of its grid: 2^-3 relative with fp8, 2^-7 for bf16.
    A dot product that cancels to near zero carries the sums' absolute error instead (affine
    most: two large terms): 2^-10 of the largest value of the token's slot covers it. Nearly
    every value must be exact.
    """
    want_h, spread = expected
    got_h, want_h = f64(got_h), f64(want_h)
    assert np.isfinite(got_h).all(), "h has unwritten (NaN) or non-finite values"
    step = 2.0 ** -3 if act_quant else 2.0 ** -7
    floor = 2.0 ** -10 * np.abs(want_h).max(-1, keepdims=True)
    assert (np.abs(got_h - want_h) <= spread + step * np.maximum(np.abs(want_h), np.abs(got_h)) + floor).all()
    assert np.mean(got_h == want_h) > 0.99


def check_down(got, h, idx, down, s_down):
    """The down stage's output (a kernel's, on h) against down_reference(h): each expert's
    output one bf16 step off at most (<= 2^-7 relative), their fp32 sum rounded once more; 2^-10
    of the token's largest output for sums that cancel; most values exact."""
    want = f64(ex.down_reference(h, idx, down, s_down))
    slots = h.shape[1]
    alone = [ex.down_reference(h * (mx.arange(slots) == j)[None, :, None].astype(h.dtype), idx, down, s_down)
             for j in range(slots)]
    magnitude = sum(np.abs(f64(a)) for a in alone)   # sum over slots of |that expert's output|
    got = f64(got)
    assert np.isfinite(got).all(), "y has unwritten (NaN) or non-finite values"
    floor = 2.0 ** -10 * np.abs(want).max(-1, keepdims=True)
    assert (np.abs(got - want) <= 2.0 ** -7 * (magnitude + np.abs(want)) + floor).all()
    assert np.mean(got == want) > 0.9


def oracle(x, idx, rw, gate, up, down, shared, limit):
    """Spec §4 with the activation roundings of bf16 matmul outputs, in float64."""
    G, U, Dn = dequantize_np(gate), dequantize_np(up), dequantize_np(down)
    xs = np.array(x.astype(mx.float32)).astype(np.float64)
    idx, rw = np.array(idx), np.array(rw).astype(np.float64)

    def expert(xv, g_w, u_w, d_w, weight):
        g = np.minimum(bf16(g_w @ xv), limit)
        u = np.clip(bf16(u_w @ xv), -limit, limit)
        h = bf16(g / (1 + np.exp(-g)) * u * weight)
        return bf16(d_w @ h)

    out = np.zeros((xs.shape[0], Dn.shape[1]))
    for t in range(xs.shape[0]):
        for j, e in enumerate(idx[t]):
            out[t] += expert(xs[t], G[e], U[e], Dn[e], rw[t, j])
        if shared is not None:
            out[t] += expert(xs[t], *(dequantize_np(m) for m in shared), 1.0)
    return bf16(out)


@pytest.mark.parametrize("mode,bits,gs", MODES)
def test_numpy_decoder_matches_mx_dequantize(mode, bits, gs):
    rng = np.random.default_rng()
    # fp32 affine scales so that mx.dequantize does not round scale*q + bias to bf16.
    m = quantized(rng, (3, 8, 256), mode, bits, gs, mx.float32)
    want = np.array(mx.dequantize(m.weight, m.scales, m.biases, group_size=gs, bits=bits, mode=mode,
                                  dtype=mx.float32))
    if mode == "affine":
        np.testing.assert_allclose(dequantize_np(m), want, rtol=1e-6, atol=1e-7)  # fp32 vs fp64 s*q+b
    else:
        np.testing.assert_array_equal(dequantize_np(m), want)


@pytest.mark.parametrize("mode,bits,gs", MODES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_reference_matches_spec(mode, bits, gs, tokens):
    rng = np.random.default_rng()
    E, I, D, K = 5, 128, 256, 2
    gate, up = quantized(rng, (E, I, D), mode, bits, gs), quantized(rng, (E, I, D), mode, bits, gs)
    down = quantized(rng, (E, D, I), mode, bits, gs)
    shared = (quantized(rng, (I, D), mode, bits, gs), quantized(rng, (I, D), mode, bits, gs),
              quantized(rng, (D, I), mode, bits, gs))
    x = mx.array((rng.standard_normal((tokens, D)) * 4).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]).astype(np.int32))
    rw = mx.array(rng.uniform(0.1, 1.5, (tokens, K)).astype(np.float32))
    limit = 0.5  # low enough that the clamps act on real values
    got = np.array(ex.experts(x, idx, rw, gate, up, down, shared, limit).astype(mx.float32))
    want = oracle(x, idx, rw, gate, up, down, shared, limit)
    # Same roundings, different fp32 summation order: a rounding of g/u/h/y_e may land one bf16
    # ulp (2^-8 relative at worst) apart; bound by 2^-6 of the largest output. One flipped h
    # moves every output a little (a count of agreeing elements is then a matter of chance: it
    # failed once at 230 of 256), but the whole vector by less than a bf16 ulp of its norm.
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 2.0 ** -6 * scale
    assert np.linalg.norm(got - want) <= 2.0 ** -8 * np.linalg.norm(want)


def test_act_quant_changes_inputs_like_the_official_rounding():
    rng = np.random.default_rng()
    gate, up = quantized(rng, (2, 64, 64), "mxfp4", 4, 32), quantized(rng, (2, 64, 64), "mxfp4", 4, 32)
    down = quantized(rng, (2, 64, 64), "mxfp4", 4, 32)
    x = mx.array(rng.standard_normal((1, 64)).astype(np.float32)).astype(mx.bfloat16)
    idx, rw = mx.array([[1]], mx.int32), mx.array([[1.0]])
    from dsv4.quant import qdq_fp8
    # With x already fp8-representable the x rounding is the identity (QDQ is idempotent), so
    # the only difference left is the h rounding, which a one-expert oracle reproduces.
    xq = qdq_fp8(x)
    got = np.array(ex.experts(xq, idx, rw, gate, up, down, None, 10.0, act_quant=True).astype(mx.float32))
    G, U, Dn = (dequantize_np(m)[1] for m in (gate, up, down))
    xs = np.array(xq.astype(mx.float32)).astype(np.float64)[0]
    g, u = np.minimum(bf16(G @ xs), 10.0), np.clip(bf16(U @ xs), -10, 10)
    h = qdq_fp8(mx.array(bf16(g / (1 + np.exp(-g)) * u).astype(np.float32)[None]))
    want = bf16(Dn @ np.array(h[0].astype(mx.float32)).astype(np.float64))
    assert np.abs(got[0] - want).max() <= 2.0 ** -6 * np.abs(want).max()


def test_dispatch(monkeypatch):
    rng = np.random.default_rng()
    q = lambda shape: quantized(rng, shape, "mxfp4", 4, 32)
    gate, up, down = q((2, 32, 64)), q((2, 32, 64)), q((2, 64, 32))
    x = mx.zeros((2, 64), mx.bfloat16)
    idx, rw = mx.array([[0], [1]], mx.int32), mx.ones((2, 1))
    assert ex.backend() is None
    monkeypatch.setattr(ex, "experts_kernel", lambda *a, **k: "kernel")
    assert isinstance(ex.experts(x, idx, rw, gate, up, down), mx.array)
    monkeypatch.setattr(ex, "backend", lambda: "cuda")
    assert ex.experts(x, idx, rw, gate, up, down) == "kernel"
    with flags.override(kernel_moe=False):
        assert isinstance(ex.experts(x, idx, rw, gate, up, down), mx.array)
    many = mx.zeros((ex.MAX_KERNEL_TOKENS + 1, 64), mx.bfloat16)   # prefill: gather_qmm path
    assert isinstance(ex.experts(many, mx.zeros((9, 1), mx.int32), mx.ones((9, 1)), gate, up, down), mx.array)
    assert isinstance(ex.experts(x.astype(mx.float32), idx, rw, gate, up, down), mx.array)
    mixed = ex.QuantizedMatrix(**{**down.__dict__, "mode": "affine", "bits": 5, "biases": down.scales})
    assert not ex.kernel_supports(x, gate, up, mixed, None)
    # The gate/up kernel keeps x in 48 KB of threadgroup memory, 144 bytes per 32 values (padded
    # fp32) plus 128 bytes of h: 340 packs fit (D = 10880), 341 do not (wider x: the reference).
    for D, ok in ((10880, True), (10912, False)):
        g, u, d = q((1, 32, D)), q((1, 32, D)), q((1, D, 32))
        assert ex.kernel_supports(mx.zeros((1, D), mx.bfloat16), g, u, d, None) == ok


def test_the_integer_unit_takes_mxfp4s_routed_experts_where_x_is_fp8():
    """DSV4_KERNEL_MOE_DP4A: the gate/up launch's template has mxfp4's routed experts in the
    integer unit (x's copy sized for limbs) only with act_quant, the mxfp8 shared expert's float
    unit either way; off, the float units."""
    rng = np.random.default_rng(0)
    gate, up = (quantized(rng, (4, 32, 64), "mxfp4", 4, 32) for _ in range(2))
    shared = tuple(quantized(rng, s, "mxfp8", 8, 32) for s in ((32, 64), (32, 64)))
    x, idx, rw = mx.zeros((1, 64), mx.bfloat16), mx.array([[0, 2]], mx.int32), mx.ones((1, 2))
    seen = []

    def launch(kernel, *, template, output_shapes, output_dtypes, **_):
        seen.append({k: v for k, v in template if k in ("MODE", "SMODE", "XS")})
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    with dialect.pretend_gpu("cuda", launch):
        for on, act_quant in ((True, True), (True, False), (False, True)):
            with flags.override(kernel_moe_dp4a=on):
                ex.gate_up_kernel(x, idx, rw, gate, up, shared, 10.0, act_quant)
    assert seen == [dict(MODE=ex.MXFP4_INT, SMODE=2, XS=ex.X_INTS), dict(MODE=1, SMODE=2, XS=ex.X_STRIDE),
                    dict(MODE=1, SMODE=2, XS=ex.X_STRIDE)]


def test_expand_option_equals_expand_of_the_output():
    rng = np.random.default_rng()
    q = lambda shape: quantized(rng, shape, "mxfp4", 4, 32)
    gate, up, down = q((3, 32, 64)), q((3, 32, 64)), q((3, 64, 32))
    x = mx.array(rng.standard_normal((2, 64)).astype(np.float32)).astype(mx.bfloat16)
    idx, rw = mx.array([[0, 2], [1, 2]], mx.int32), mx.array(rng.uniform(0, 1, (2, 2)).astype(np.float32))
    residual = mx.array(rng.standard_normal((2, 4, 64)).astype(np.float32)).astype(mx.bfloat16)
    post = mx.array(rng.uniform(0, 2, (2, 4)).astype(np.float32))
    comb = mx.array(rng.uniform(0, 1, (2, 4, 4)).astype(np.float32))
    y = ex.experts(x, idx, rw, gate, up, down)
    got = ex.experts(x, idx, rw, gate, up, down, expand=(residual, post, comb))
    want = np.array(post)[..., None] * f64(y)[:, None, :] + np.einsum("tij,tid->tjd", np.array(comb), f64(residual))
    np.testing.assert_allclose(f64(got), want, rtol=2.0 ** -8, atol=1e-5)   # one bf16 rounding


def test_the_hidden_bound_takes_g_one_bf16_step_off_and_refuses_more():
    """check_hidden's spread: an h made from the reference's g with one element moved to the
    neighbouring bf16 value (as a kernel's sum in another order can round it) passes, where a
    bound of one bf16 step of h (plus the floor) alone refuses it: with the clamp at 0.3 the
    largest h come from negative g, where SiLU's slope multiplies g's step (~3x at g = -4); the
    same element a quarter off fails."""
    rng = np.random.default_rng(7)
    T, E, K, I, D, limit = 2, 4, 2, 64, 256, 0.3
    gate, up = (quantized(rng, (E, I, D), "mxfp4", 4, 32) for _ in range(2))
    x = mx.array((rng.standard_normal((T, D)) * 3).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32))
    rw = mx.array(rng.uniform(0.5, 1.0, (T, K)).astype(np.float32))
    expected = hidden_expected(x, idx, rw, gate, up, None, limit, False)
    want, spread = expected
    w = f64(want)
    g, u = (bf16(f64(a)) for a in ex.gate_up_reference(x, idx, gate, up))
    # the element where one step of g moves h furthest past one step of h and the floor
    allowed = 2.0 ** -7 * np.abs(w) + 2.0 ** -10 * np.abs(w).max(-1, keepdims=True)
    i = np.unravel_index(np.argmax(spread / allowed), g.shape)
    assert g[i] < -1

    def h_with(g_i):
        moved = g.copy()
        moved[i] = g_i
        gm = mx.array(moved.astype(np.float32)).astype(mx.bfloat16)
        um = mx.array(u.astype(np.float32)).astype(mx.bfloat16)
        return (ex._swiglu(gm, um, limit) * rw.astype(mx.float32)[..., None]).astype(mx.bfloat16)

    off_by_a_step = max((h_with(v) for v in bf16_neighbours(g[i])), key=lambda h: abs(f64(h)[i] - w[i]))
    check_hidden(off_by_a_step, expected, False)
    with pytest.raises(AssertionError):
        check_hidden(off_by_a_step, (want, 0 * spread), False)
    with pytest.raises(AssertionError):
        check_hidden(h_with(g[i] * 1.25), expected, False)
