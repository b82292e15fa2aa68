"""The Engram layer's combination (dsv4/engram.py) against a float64 transcription of the
official reference (inference/model.py `Engram.forward`, model-spec 6.4)."""

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.config import ConfigError, ModelArgs
from dsv4.engram import Engram, NgramHasher
from dsv4.testing import tiny_config, to_bf16_bits


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (round to nearest even), as float64."""
    return (to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def reference(x, rows, wkv, q, k, eps, product=lambda q, k: q * k):
    """x [B, S, hc, D], rows [B, S, r, head_dim], wkv [(hc + 1) D, r head_dim], all float64."""
    b, s, hc, d = x.shape
    kv = rows.reshape(b, s, -1) @ wkv.T
    key, value = kv[..., :hc * d].reshape(b, s, hc, d), kv[..., hc * d:]
    rstd = 1 / np.sqrt((x ** 2).mean(-1) + eps) / np.sqrt((key ** 2).mean(-1) + eps)
    dot = (x * product(q, k) * key).sum(-1) * rstd * d ** -0.5
    gate = 1 / (1 + np.exp(-np.copysign(np.sqrt(np.maximum(np.abs(dot), 1e-6)), dot)))
    return x + gate[..., None] * value[:, :, None, :]


@pytest.fixture
def layer_and_inputs():
    args = ModelArgs.from_dict(tiny_config())
    layer = Engram(args)
    rng = np.random.default_rng(5)
    width = args.engram_rows_per_token * args.engram_head_dim
    d, hc = args.hidden_size, args.hc_mult
    wkv = bf16(rng.normal(0, width ** -0.5, (d * (hc + 1), width)))
    q, k = bf16(rng.normal(0, 1, (2, hc, d)))
    layer.wkv.weight = mx.array(wkv.astype(np.float32)).astype(mx.bfloat16)
    layer.q_weight = mx.array(q.astype(np.float32)).astype(mx.bfloat16)  # as loaded: bf16
    layer.k_weight = mx.array(k.astype(np.float32)).astype(mx.bfloat16)
    # fp32 streams keep every other step fp32, so the test sees the product's rounding; a
    # small x (the gate normalises it away) keeps the output's rounding below it too
    x = 1e-3 * rng.normal(0, 1, (2, 5, hc, d))
    x[0, 2] = 0.0  # a zero dot: the reference's copysign gives the gate sigmoid(+1e-3)
    rows = bf16(rng.normal(0, 1, (2, 5, args.engram_rows_per_token, args.engram_head_dim)))
    return layer, (x, rows, wkv, q, k, args.rms_norm_eps)


def test_gate_takes_the_product_of_the_weights_in_fp32(layer_and_inputs):
    layer, (x, rows, wkv, q, k, eps) = layer_and_inputs
    with flags.override(act_quant=False):
        got = np.array(layer(mx.array(x.astype(np.float32)), mx.array(rows.astype(np.float32))))
    want = reference(x, rows, wkv, q, k, eps)
    scale = np.abs(want - x).max()
    error = np.abs(got - want).max() / scale
    assert error < 1e-5
    # the test can tell: a bf16 product, or sign() for copysign, moves the output further
    in_bf16 = reference(x, rows, wkv, q, k, eps, lambda q, k: bf16((q * k).astype(np.float32)))
    assert np.abs(in_bf16 - want).max() / scale > 10 * error
    with_sign = want.copy()
    value = (rows.reshape(2, 5, -1) @ wkv.T)[0, 2, -x.shape[-1]:]
    with_sign[0, 2] = 0.5 * value
    assert np.abs(with_sign - want).max() / scale > 10 * error


def test_a_token_map_that_disagrees_with_the_config_is_bad_input():
    args = ModelArgs.from_dict(tiny_config(engram_compressed_vocab_size=9))
    with pytest.raises(ConfigError, match="token map has 8 compressed ids, the config says "
                                          "engram_compressed_vocab_size=9"):
        NgramHasher(args, np.arange(16) % 8)
