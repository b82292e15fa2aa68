"""QDQ helpers bit-exact against a numpy transcription of model-spec §11."""

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import quant
from tests.formats import E2M1 as E2M1_CODES
from tests.formats import e2m1_packed_value, e4m3_value, e8m0_scale

# The finite non-negative grids, ascending by code (e4m3 0x00..0x7E; 0x7F is NaN).
E4M3 = e4m3_value(np.arange(127))
E2M1 = E2M1_CODES[:8]


def nearest_even(v, table):
    """Round |v| to the table (ascending, codes = positions), ties to the even code."""
    mag = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(table, mag), 1, len(table) - 1)
    lo = hi - 1
    dlo, dhi = mag - table[lo], table[hi] - mag
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(mag >= table[-1], len(table) - 1, pick)
    return np.sign(v) * table[pick]


def pow2_ceil(v):
    return np.float32(2.0) ** np.ceil(np.log2(v.astype(np.float64))).astype(np.float32)


def ref_qdq_fp8(x, block=32):
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), np.float32(1e-4))
    s = pow2_ceil(amax * np.float32(1 / 448))
    return (nearest_even(np.clip(b / s, -448, 448), E4M3) * s).astype(np.float32).reshape(x.shape)


def ref_qdq_fp4_pow2(x, block=32):
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), np.float32(6 * 2.0 ** -126))
    s = pow2_ceil(amax * np.float32(1 / 6))
    return (nearest_even(np.clip(b / s, -6, 6), E2M1) * s).astype(np.float32).reshape(x.shape)


def ref_qdq_fp4_e4m3(x, block=16):
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), np.float32(6 * 2.0 ** -9))
    s = nearest_even((amax / np.float32(6)).astype(np.float32), E4M3).astype(np.float32)
    return (nearest_even((np.clip(b / s, -6, 6)).astype(np.float32), E2M1) * s).astype(np.float32).reshape(x.shape)


CASES = [(quant.qdq_fp8, ref_qdq_fp8), (quant.qdq_fp4_pow2, ref_qdq_fp4_pow2),
         (quant.qdq_fp4_e4m3, ref_qdq_fp4_e4m3)]


@pytest.mark.parametrize("ours,ref", CASES, ids=["fp8", "fp4-pow2", "fp4-e4m3"])
def test_random_inputs_bit_exact(ours, ref):
    rng = np.random.default_rng(0)
    for scale in (1e-6, 1e-2, 1.0, 300.0):
        x = (rng.standard_normal((64, 128)) * scale).astype(np.float32)
        x[3, :32] = 0.0  # an all-zero block hits the amax floor
        got = np.array(ours(mx.array(x)))
        np.testing.assert_array_equal(got.view(np.uint32), ref(x).view(np.uint32))


@pytest.mark.parametrize("ours,ref,table", [(quant.qdq_fp8, ref_qdq_fp8, E4M3),
                                            (quant.qdq_fp4_pow2, ref_qdq_fp4_pow2, E2M1)],
                         ids=["fp8", "fp4"])
def test_exact_midpoints_round_to_even(ours, ref, table):
    """Blocks whose scale is 1 (amax = the format's max), every other value a midpoint."""
    mids = ((table[:-1] + table[1:]) / 2).astype(np.float32)
    top = np.float32(table[-1])
    vals = np.concatenate([mids, -mids])
    n = -(-len(vals) // 31) * 31
    vals = np.resize(vals, n).reshape(-1, 31)
    x = np.concatenate([np.full((len(vals), 1), top, np.float32), vals], axis=1)
    got = np.array(ours(mx.array(x)))
    np.testing.assert_array_equal(got.view(np.uint32), ref(x).view(np.uint32))
    # and the tie rule itself: each midpoint went to the neighbour with the even code
    codes = np.searchsorted(table, np.abs(got[:, 1:]).astype(np.float64))
    assert (codes % 2 == 0).all()


def test_e2m1_ties_listed_in_spec():
    x = mx.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5], mx.float32)
    assert np.array(quant.round_e2m1(x)).tolist() == [0, 1, 1, 2, 2, 4, 4, -2]


def test_bf16_output_keeps_dtype():
    x = mx.random.normal((4, 64)).astype(mx.bfloat16)
    assert quant.qdq_fp8(x).dtype == mx.bfloat16


def test_fp8_packing_is_exact_dequant():
    """Official 32x32-block fp8 -> mxfp8 per-row groups dequantizes to e4m3 * 2^(s-127)."""
    from dsv4.testing import fp8_block_weight

    rng = np.random.default_rng(1)
    w, s = fp8_block_weight(rng, 70, 96, 0.05)
    packed, scales = quant.pack_fp8_block32(w, s)
    got = np.array(mx.dequantize(mx.array(packed), mx.array(scales), group_size=32, bits=8,
                                 mode="mxfp8", dtype=mx.float32))
    want = e4m3_value(w) * np.repeat(np.repeat(e8m0_scale(s), 32, 0), 32, 1)[:70]
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_fp4_packing_is_exact_dequant():
    from dsv4.testing import fp4_weight

    rng = np.random.default_rng(2)
    w, s = fp4_weight(rng, (3, 8, 64), 0.1)
    packed, scales = quant.pack_fp4(w.view(np.uint8), s)
    got = np.array(mx.dequantize(mx.array(packed), mx.array(scales), group_size=32, bits=4,
                                 mode="mxfp4", dtype=mx.float32))
    want = e2m1_packed_value(w) * np.repeat(e8m0_scale(s), 32, -1)
    np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("shape,threads", [((4096, 5120), 256), ((1, 5120), 256), ((3, 7, 64), 64),
                                           ((1, 3, 32), 32), ((2, 96), 64)])
def test_the_rounding_kernel_launches_whole_threadgroups_of_up_to_eight_blocks(shape, threads):
    """The GPU launch of quant.qdq_fp8 (a SIMD group a block of 32): as many blocks a threadgroup
    as divide the values, up to 8, so that a prefill's rounding starts 8x fewer threadgroups and
    none is partial (the kernel has no bounds check)."""
    from dsv4.kernels import dialect
    launches = []

    def record(kernel, *, inputs, output_shapes, output_dtypes, grid, threadgroup, **_):
        launches.append((grid, threadgroup))
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    with dialect.pretend_gpu("cuda", record):
        quant.qdq_fp8(mx.zeros(shape, mx.bfloat16))
    ((grid, tg),) = launches
    assert grid == (int(np.prod(shape)), 1, 1) and tg == (threads, 1, 1) and grid[0] % threads == 0
