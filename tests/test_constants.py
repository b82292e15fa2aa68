"""dsv4.constants.ramp: host-data ramps, so that mx.compile takes them as constants."""

import re
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from dsv4.constants import ramp


def test_ramp_values_dtype_and_shape():
    r = ramp(6, mx.uint32, (1, 2, 3))
    assert r.dtype == mx.uint32 and r.shape == (1, 2, 3)
    assert np.array_equal(np.array(r).reshape(-1), np.arange(6))
    assert ramp(4).shape == (4,) and ramp(4).dtype == mx.int32


def test_compiled_graph_holds_the_ramp_as_a_constant():
    f = mx.compile(lambda x: x + ramp(8, mx.float32, (2, 4)))
    out = f(mx.zeros((2, 4)))
    assert np.array_equal(np.array(out), np.arange(8, dtype=np.float32).reshape(2, 4))
    with tempfile.NamedTemporaryFile(suffix=".dot") as fh:
        mx.export_to_dot(fh.name, out)
        prims = re.findall(r'label ="([^"]+)", shape=rectangle', Path(fh.name).read_text())
    assert not any(p.startswith(("Arange", "Reshape")) for p in prims), prims
