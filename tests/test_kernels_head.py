"""The head's fp32 logits on the CPU (the path the head kernel replaces on a GPU; its GPU test is
tests/test_kernels_head_gpu.py): against the exact float64 product, within the bound of an fp32
sum of D products (each product is exact in fp32)."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from dsv4.kernels import head
from dsv4.linear import Linear
from dsv4.model import Model


def test_cpu_logits_are_the_fp32_product_of_the_bf16_head():
    rng = np.random.default_rng()
    d, v = 256, 301
    layer = Linear(d, v, bias=False)
    layer.weight = mx.array(rng.standard_normal((v, d)).astype(np.float32) / np.sqrt(d)).astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((1, 1, d)).astype(np.float32) * 3).astype(mx.bfloat16)
    assert not head.kernel_applies(x, layer.weight)   # no GPU backend here: the reference runs
    got = Model.logits(SimpleNamespace(head=layer), x)
    assert got.dtype == mx.float32 and got.shape == (1, 1, v)
    xs = np.array(x.astype(mx.float32)).astype(np.float64).reshape(1, d)
    ws = np.array(layer.weight.astype(mx.float32)).astype(np.float64)
    want, mag = xs @ ws.T, np.abs(xs) @ np.abs(ws).T
    assert np.all(np.abs(np.array(got).reshape(1, v) - want) <= d * 2.0 ** -24 * mag)
