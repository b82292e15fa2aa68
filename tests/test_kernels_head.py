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


def test_router_and_compressor_take_the_kernel_for_bf16_weights(monkeypatch):
    """On a GPU the router's gate and a compressor's kv+gate products (one launch for both: the
    concatenated weights) go through the head kernel; off, or with fp32 weights, the matmuls."""
    from dsv4 import flags
    from dsv4.attention import Compressor
    from dsv4.moe import Router

    rng = np.random.default_rng()
    d, dh, e = 64, 16, 12
    args = SimpleNamespace(hidden_size=d, head_dim=dh, rms_norm_eps=1e-6, n_routed_experts=e,
                           num_experts_per_tok=2, gate_temp=1.0, routed_scaling_factor=1.0,
                           norm_topk_prob=True)
    comp = Compressor(args, 2)
    for m in (comp.wkv, comp.wgate):
        m.weight = mx.array(rng.standard_normal((dh, d)).astype(np.float32)).astype(mx.bfloat16)
    router = Router(args)
    router.weight = mx.array(rng.standard_normal((e, d)).astype(np.float32)).astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((1, 1, d)).astype(np.float32)).astype(mx.bfloat16)
    kv_want, gate_want = comp.inputs(x)                      # CPU: the fp32 matmuls
    calls = []

    def fake(x, w):
        calls.append(w.shape)
        return x.astype(mx.float32) @ w.astype(mx.float32).T
    monkeypatch.setattr(head, "backend", lambda: "cuda")
    monkeypatch.setattr(head, "head_logits", fake)
    kv, gate = comp.inputs(x)
    assert calls == [(2 * dh, d)]
    np.testing.assert_allclose(np.array(kv), np.array(kv_want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(gate), np.array(gate_want), rtol=1e-6, atol=1e-6)
    with flags.override(kernel_router=False):
        router(x.reshape(1, d))
    with flags.override(kernel_router=True):
        router(x.reshape(1, d))                              # (its top-k: plain ops, no GPU here)
    assert calls == [(2 * dh, d), (e, d)]
    with flags.override(kernel_head=False):
        comp.inputs(x)
    assert len(calls) == 2
