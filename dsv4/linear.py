"""Linear layers: dense, quantized, and stacked experts, with a CPU-friendly path.

MLX's CPU backend multiplies mxfp8/mxfp4 weights an order of magnitude slower than it
dequantizes them (measured: a 128x512 @ 512x1024 mxfp8 product 2.2 s vs 58 ms in bf16),
so with DSV4_DEQUANT_MATMUL (default "auto": on the CPU device, for products of 16 rows
or more, i.e. prefill) quantized layers dequantize their weights (exactly: every
mxfp8/mxfp4 value is a bf16) and use a plain matmul. GPUs keep MLX's quantized kernels.
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import flags


# Below this many rows the CPU's quantized matvec beats dequantize + matmul (measured
# on the medium benchmark config: 188 vs 272 ms per decode step).
_DEQUANT_MIN_ROWS = 16


def dequant_matmul(rows: int) -> bool:
    """Whether a product with `rows` input rows should dequantize the weight first."""
    mode = flags.get("dequant_matmul")
    if mode == "auto":
        return mx.default_device() == mx.cpu and rows >= _DEQUANT_MIN_ROWS
    return mode in ("1", "on", "true")


class Linear(nn.Linear):
    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


class QuantizedLinear(nn.QuantizedLinear):
    def dequantized(self, dtype) -> mx.array:
        return mx.dequantize(self["weight"], self["scales"], self.get("biases"),
                             group_size=self.group_size, bits=self.bits, mode=self.mode, dtype=dtype)

    def __call__(self, x: mx.array) -> mx.array:
        if dequant_matmul(x.size // x.shape[-1]):
            return x @ self.dequantized(x.dtype).T
        return super().__call__(x)


class ExpertLinear(nn.Module):
    """Stacked expert weights [E, out, in]; row m of x goes through expert indices[m]."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False,
                 used=None) -> mx.array:
        return mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices,
                            sorted_indices=sorted_indices)

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        q = QuantizedExpertLinear(group_size, bits, mode)
        q.weight, q.scales, *biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        if biases:
            q.biases = biases[0]
        return q


class QuantizedExpertLinear(nn.Module):
    def __init__(self, group_size: int, bits: int, mode: str):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False,
                 used: Optional[tuple[np.ndarray, mx.array]] = None) -> mx.array:
        """`used` = (the distinct expert ids, indices into them), from `experts_used`."""
        if dequant_matmul(indices.size):
            experts, local = used if used is not None else experts_used(indices)
            pick = mx.array(experts)
            w = mx.dequantize(self["weight"][pick], self["scales"][pick],
                              None if self.get("biases") is None else self["biases"][pick],
                              group_size=self.group_size, bits=self.bits, mode=self.mode,
                              dtype=mx.float32)
            # The CPU gather_mm takes float32 only; products of bf16 values are exact in it.
            out = mx.gather_mm(x.astype(mx.float32), w.swapaxes(-1, -2), rhs_indices=local,
                               sorted_indices=sorted_indices)
            return out.astype(x.dtype)
        return mx.gather_qmm(x, self["weight"], self["scales"], self.get("biases"),
                             rhs_indices=indices, transpose=True, group_size=self.group_size,
                             bits=self.bits, mode=self.mode, sorted_indices=sorted_indices)


def experts_used(indices: mx.array) -> tuple[np.ndarray, mx.array]:
    """The distinct experts of a call and each index's position among them (one host sync,
    shared by the three projections of the dequantizing path)."""
    experts, local = np.unique(np.array(indices), return_inverse=True)
    return experts, mx.array(local.reshape(indices.shape).astype(np.uint32))
