"""The projection-tail module's RoPE angles (dsv4/kernels/rows.py) on the CPU: the plain path
against float64 and the dispatch; the kernels on the device: tests/test_kernels_rows_gpu.py."""

import mlx.core as mx
import numpy as np

from dsv4 import flags
from dsv4.kernels import rows


def test_rope_angles_dispatch(monkeypatch):
    """The fixed step's RoPE angles: the plain ops on the CPU (the step's formula), one
    kernel launch on a GPU with the projection tails' switch on."""
    freqs = mx.array(np.linspace(1.0, 5000.0, 32).astype(np.float32))
    offset = mx.array([77], mx.int32)
    cos, sin = rows.rope_angles(offset, freqs, 2.0)
    theta = 77.0 * 2.0 * (1.0 / np.array(freqs, np.float64))
    np.testing.assert_allclose(np.array(cos), np.cos(theta), atol=1e-4)
    np.testing.assert_allclose(np.array(sin), np.sin(theta), atol=1e-4)
    calls = []
    monkeypatch.setattr(rows, "backend", lambda: "cuda")
    monkeypatch.setattr(rows.Kernel, "__call__", lambda self, **kw: calls.append((self.name, kw)) or
                        [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])])
    rows.rope_angles(offset, freqs, 2.0)
    assert [c[0] for c in calls] == ["dsv4_rope_angles"] and calls[0][1]["grid"] == (32, 1, 1)
    with flags.override(kernel_rows=False):
        rows.rope_angles(offset, freqs, 2.0)
    assert len(calls) == 1


def test_rope_angles_of_several_positions(monkeypatch):
    """Angles of positions offset .. offset + S - 1: [S, R], row s equal (bit for bit) to
    the one position's angles at offset + s; one launch of S threadgroup rows on a GPU."""
    freqs = mx.array(np.linspace(1.0, 5000.0, 32).astype(np.float32))
    cos, sin = rows.rope_angles(mx.array([509], mx.int32), freqs, 4.0, positions=5)
    assert cos.shape == sin.shape == (5, 32)
    for s in range(5):
        one = rows.rope_angles(mx.array([509 + s], mx.int32), freqs, 4.0)
        assert np.array_equal(np.array(cos[s]), np.array(one[0]))
        assert np.array_equal(np.array(sin[s]), np.array(one[1]))
    theta = (509.0 + np.arange(5))[:, None] * 4.0 / np.array(freqs, np.float64)
    np.testing.assert_allclose(np.array(cos), np.cos(theta), atol=1e-3)
    calls = []
    monkeypatch.setattr(rows, "backend", lambda: "cuda")
    monkeypatch.setattr(rows.Kernel, "__call__", lambda self, **kw: calls.append((self.name, kw)) or
                        [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])])
    got = rows.rope_angles(mx.array([509], mx.int32), freqs, 4.0, positions=5)
    assert calls[0][1]["grid"] == (32, 5, 1) and got[0].shape == (5, 32)


def test_row_tail_reference_rotates_each_position_by_its_angles():
    """row_tail's definition with [S, R] angles: the rows of position s (a head each, and a
    batch of 2) are what the one-position call gives them with angles s."""
    rng = np.random.default_rng(0)
    freqs = mx.array((10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32))
    cs = rows.rope_angles(mx.array([700], mx.int32), freqs, 1.0, positions=3)
    for shape in [(2, 3, 4, 128), (1, 3, 128)]:
        x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)
        got = rows.row_tail_reference(x, None, cs, rows.FP8)
        for s in range(3):
            one = rows.row_tail_reference(x[:, s:s + 1], None, (cs[0][s], cs[1][s]), rows.FP8)
            assert np.array_equal(np.array(got[:, s:s + 1].astype(mx.float32)), np.array(one.astype(mx.float32)))
