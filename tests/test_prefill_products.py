"""Prefill's products over mxfp weights: the dense projections dequantized per product
(DSV4_DEQUANT_PREFILL) and grouped wo_a as one product per group, against a float64
transcription of the dequantized weights."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import attention, flags
from dsv4.attention import Attention
from dsv4.config import ModelArgs
from dsv4.kernels.dialect import backend, pretend_gpu
from dsv4.linear import PREFILL_DEQUANT_MIN_ROWS, Linear, dequant_prefill
from dsv4.testing import tiny_config

ROUNDING = {mx.bfloat16: 2.0 ** -8, mx.float32: 2.0 ** -24}   # an output's rounding, relative


def quantized_linear(rng, d_in: int, d_out: int, mode: str):
    layer = Linear(d_in, d_out, bias=False)
    layer.weight = mx.array(rng.standard_normal((d_out, d_in)).astype(np.float32) * 0.05)
    return layer.to_quantized(group_size=32, bits=8 if mode == "mxfp8" else 4, mode=mode)


def exact(layer) -> np.ndarray:
    """The layer's weight as float64 (its dequantized values are exact in fp32)."""
    w = mx.dequantize(layer.weight, layer.scales, group_size=32, bits=layer.bits, mode=layer.mode,
                      dtype=mx.float32)
    return np.array(w).astype(np.float64)


def assert_rounded_product(got: mx.array, want: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """got is the product rounded to its dtype: within that rounding, plus fp32 sums over |x||w|."""
    bound = ROUNDING[got.dtype] * np.abs(want) + 1e-6 * (np.abs(x) @ np.abs(w).T)
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) - bound)


@pytest.mark.parametrize("mode", ["mxfp8", "mxfp4"])
def test_quantized_projection_of_a_prefill_chunk(mode):
    rng = np.random.default_rng(3)
    layer = quantized_linear(rng, 256, 96, mode)
    x = mx.array(rng.standard_normal((1, PREFILL_DEQUANT_MIN_ROWS, 256)).astype(np.float32)).astype(mx.bfloat16)
    with flags.override(dequant_matmul=False, dequant_prefill=True):
        assert dequant_prefill(layer, x)
        got = layer(x)
    assert got.dtype == mx.bfloat16
    xs = np.array(x.astype(mx.float32)).astype(np.float64)[0]
    w = exact(layer)
    assert_rounded_product(got[0], xs @ w.T, xs, w)


def test_dequant_prefill_takes_prefill_chunks_only():
    rng = np.random.default_rng(4)
    layer = quantized_linear(rng, 64, 32, "mxfp8")
    rows = lambda n, dtype=mx.bfloat16: mx.zeros((1, n, 64), dtype)
    with flags.override(dequant_prefill=True):
        assert dequant_prefill(layer, rows(PREFILL_DEQUANT_MIN_ROWS))
        assert not dequant_prefill(layer, rows(PREFILL_DEQUANT_MIN_ROWS - 1))   # decode, verification
        assert not dequant_prefill(layer, rows(PREFILL_DEQUANT_MIN_ROWS, mx.float32))
    with flags.override(dequant_prefill="auto"):   # under CUDA only
        assert dequant_prefill(layer, rows(PREFILL_DEQUANT_MIN_ROWS)) is (backend() == "cuda")


def grouped_attention(rng):
    args = ModelArgs.from_dict(tiny_config())
    attn = Attention(args, 0)
    attn.wo_a = quantized_linear(rng, attn.wo_a.weight.shape[1], attn.wo_a.weight.shape[0], "mxfp8")
    return args, attn


@pytest.mark.parametrize("tokens,dtype,dequant", [
    (3, mx.float32, False),                              # decode: a gathered row per token and group
    (attention.GROUPED_GATHER_MAX_TOKENS + 5, mx.float32, False),   # prefill: quantized_matmul per group
    (PREFILL_DEQUANT_MIN_ROWS, mx.bfloat16, True)])     # prefill: each group's block dequantized
def test_grouped_wo_a_per_group_product(tokens, dtype, dequant):
    """Every route gives each group's block of wo_a times that group's heads (fp32 where MLX's
    CPU quantized matmul runs: in bf16 it rounds along the sum)."""
    rng = np.random.default_rng(5)
    args, attn = grouped_attention(rng)
    h, d, g, rows = attn.n_heads, attn.head_dim, attn.groups, args.o_lora_rank
    o = mx.array(rng.standard_normal((1, tokens, h, d)).astype(np.float32)).astype(dtype)
    with flags.override(dequant_matmul=False, dequant_prefill=dequant):
        got = attn._grouped_wo_a(o, 1, tokens)
    assert got.shape == (1, tokens, g * rows) and got.dtype == dtype
    x = np.array(o.astype(mx.float32)).astype(np.float64).reshape(tokens, g, -1)
    w = exact(attn.wo_a).reshape(g, rows, -1)
    for j in range(g):
        assert_rounded_product(got[0, :, j * rows:(j + 1) * rows], x[:, j] @ w[j].T, x[:, j], w[j])



def test_grouped_wo_a_of_a_verify_takes_the_multi_token_launch():
    """On a GPU, 2-6 tokens (a DSpark verify) of an MLX-quantized grouped wo_a go through one
    multi-token matvec launch over every group (DSV4_KERNEL_MATVEC_TOKENS) instead of gather_qmm,
    which decodes each weight once a token; one token, or the switch off, keeps gather_qmm."""
    rng = np.random.default_rng(6)
    args, attn = grouped_attention(rng)
    launches = []

    def launch(kernel, *, output_shapes, output_dtypes, template, **_):
        launches.append((kernel.name, dict(template)))
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    for tokens, switch, want in ((3, True, 1), (1, True, 0), (3, False, 0)):
        launches.clear()
        o = mx.zeros((1, tokens, attn.n_heads, attn.head_dim), mx.bfloat16)
        with pretend_gpu("cuda", launch), flags.override(dequant_matmul=False, kernel_matvec_tokens=switch):
            got = attn._grouped_wo_a(o, 1, tokens)
        assert got.shape == (1, tokens, attn.groups * args.o_lora_rank)
        assert [(name, t["GROUPS"], t["TOKS"], t["ACTQ"]) for name, t in launches] == \
            [("dsv4_quantized_matvec_tokens", attn.groups, tokens, False)] * want
