"""GGUFLinear and GGUFExpertLinear (dsv4/linear.py): the layers that keep GGUF blocks give the
products of the exactly decoded weights, on the CPU's dense-copy path and on the path a GPU
takes for prefill (only the selected experts decoded, a batch at a time)."""

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags, gguf_blocks
from dsv4.linear import GGUFExpertLinear, GGUFLinear, matrix_operand
from tests.test_kernels_gguf_host import gguf_matrix


def f64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


@pytest.mark.parametrize("qtype", gguf_blocks.TYPES)
@pytest.mark.parametrize("dense_copy", [True, False])
def test_gguf_linear_is_the_decoded_product(qtype, dense_copy):
    rng = np.random.default_rng(1)
    m = gguf_matrix(rng, (48, 512), qtype)
    layer = GGUFLinear(512, 48, qtype)
    layer.weight = m.weight
    assert matrix_operand(layer).qtype == qtype
    x = mx.array(rng.standard_normal((3, 5, 512)).astype(np.float32)).astype(mx.bfloat16)
    with flags.override(dequant_matmul="on" if dense_copy else "off"):
        y = layer(x)
    assert y.dtype == mx.bfloat16 and y.shape == (3, 5, 48)
    want = f64(x) @ f64(m.dequantized()).T
    assert np.allclose(f64(y), want, rtol=2 ** -7, atol=2 ** -7 * np.abs(want).max() / 16)


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "Q4_K"])
@pytest.mark.parametrize("dense_copy,few_pairs", [(True, 64), (False, 64), (False, 0)])
def test_gguf_experts_are_the_decoded_products(qtype, dense_copy, few_pairs, monkeypatch):
    rng = np.random.default_rng(2)
    E, out, n_in = 6, 32, 256
    m = gguf_matrix(rng, (E, out, n_in), qtype)
    layer = GGUFExpertLinear(n_in, out, E, qtype)
    layer.weight = m.weight
    # a batch of one or two experts at a time: the batching and its bookkeeping get exercised
    monkeypatch.setattr(GGUFExpertLinear, "DEQUANT_BYTES", 4 * out * n_in * 2)
    monkeypatch.setattr(GGUFExpertLinear, "FEW_PAIRS", few_pairs)
    w = f64(m.dequantized())                                                  # [E, out, in]
    x = rng.standard_normal((5, n_in)).astype(np.float32)
    ids = np.stack([rng.choice(E - 1, 3, replace=False) for _ in range(5)])  # expert E-1 unused
    with flags.override(dequant_matmul="on" if dense_copy else "off"):
        few = layer(mx.array(x)[:, None, None, :], mx.array(ids))                # [5, 3, 1, out]
        order = np.argsort(ids.reshape(-1), kind="stable")
        rows = np.repeat(x, 3, axis=0)[order]
        sorted_y = layer(mx.array(rows)[:, None, :], mx.array(ids.reshape(-1)[order]), True)  # [15, 1, out]
    want = np.einsum("ni,nkoi->nko", x.astype(np.float64), w[ids])
    assert few.shape == (5, 3, 1, out) and sorted_y.shape == (15, 1, out)
    assert np.allclose(f64(few)[:, :, 0], want, rtol=1e-5, atol=1e-6)
    assert np.allclose(f64(sorted_y)[:, 0], want.reshape(15, out)[order], rtol=1e-5, atol=1e-6)
