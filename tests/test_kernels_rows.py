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
