"""The one-launch fp8/fp4 rounding kernels (dsv4/kernels/qdq.py) against the plain-MLX
reference of dsv4.quant, bit for bit (run on the H200: pytest -m gpu). The reference itself
is checked against a numpy transcription of model-spec §11 in test_quant.py."""

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags, quant
from dsv4.kernels import qdq
from dsv4.kernels.dialect import backend, poisoned_outputs

pytestmark = pytest.mark.gpu


def cases(rng, shape):
    """Random values over many magnitudes, exact rounding midpoints, zeros and tiny blocks."""
    flat = rng.standard_normal((int(np.prod(shape)) // 32, 32)) * 10.0 ** rng.integers(-6, 4, (int(np.prod(shape)) // 32, 1))
    flat[0] = 0.0                                                 # a block of zeros
    flat[1] = rng.standard_normal(32) * 1e-30                     # below the amax floor
    fp8_ties = np.array([1.0625, 1.1875, 0.0029296875, 2.0 ** -10 * 3, 416.0])   # scale 1
    flat[2] = rng.uniform(-1, 1, 32)
    flat[2, :len(fp8_ties)] = fp8_ties * rng.choice([-1, 1], len(fp8_ties))
    fp4_ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])            # scale 1
    flat[4] = rng.uniform(-1, 1, 32)
    flat[4, :len(fp4_ties)] = fp4_ties * rng.choice([-1, 1], len(fp4_ties))
    flat[3] = -0.0
    return flat.reshape(shape)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("shape", [(1, 1, 5120), (3, 7, 64), (2, 128), (1, 5, 32), (1, 4096, 2304)])
@pytest.mark.parametrize("name", ["qdq_fp8", "qdq_fp4_pow2"])
def test_qdq_kernel_is_bit_identical_to_the_reference(name, shape, dtype):
    assert backend() is not None, "needs MLX's CUDA or Metal backend"
    rng = np.random.default_rng()
    x = mx.array(cases(rng, shape).astype(np.float32)).astype(dtype)
    fn = getattr(quant, name)
    assert qdq.kernel_applies(x, 32)
    with poisoned_outputs():
        got = fn(x)
    with flags.override(kernel_qdq=False):
        want = fn(x)
    bits = mx.uint16 if dtype == mx.bfloat16 else mx.uint32
    g, w = np.array(got.view(bits)), np.array(want.view(bits))
    assert np.array_equal(g, w), f"{int((g != w).sum())} of {g.size} values differ"
