"""Linear layers: dense, quantized, and stacked experts, with a CPU-friendly path.

MLX's CPU backend multiplies mxfp8/mxfp4 weights an order of magnitude slower than a
plain matmul (measured: a 128x512 @ 512x1024 mxfp8 product 2.2 s vs 58 ms in bf16).
With DSV4_DEQUANT_MATMUL (default "auto": on for the CPU device) a quantized layer
dequantizes its weight once, on first use, keeps the dense copy and multiplies with
plain matmuls. The values are exact (every mxfp8/mxfp4 value is a bf16), every row
count takes the same kernel, so prefill chunking and prompt reuse give bit-identical
results, and the price is memory: the dense copy (bf16; float32 for the experts,
whose CPU gather_mm takes float32 only). GPUs keep MLX's quantized kernels, but for prefill
chunks under CUDA (DSV4_DEQUANT_PREFILL: the weight dequantized for one product, not kept) and
the routed experts' tensor-core prefill kernel (DSV4_KERNEL_PREFILL_EXPERTS_MMA).

`GGUFLinear` and `GGUFExpertLinear` keep a GGUF's blocks as they are (Q8_0, Q4_K, Q2_K,
IQ2_XXS: dsv4/gguf_blocks.py), decoded exactly where no kernel multiplies by them.

`fp8_linear` is a projection whose input the official model rounds to fp8 (act_quant); on a
GPU, for 1-8 tokens, it runs as one fused kernel (dsv4/kernels/matvec.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

import numpy as np

from . import encode_thread, flags, gguf_blocks
from .constants import derived, kept
from .kernels import experts_prefill, matvec_tail
from .kernels.dialect import backend
from .kernels.experts import QuantizedMatrix
from .kernels.gguf_dot import GGUFMatrix
from .kernels.matvec import kernel_supports, quantized_matvec
from .kernels.rows import NO_QDQ
from .quant import qdq_fp8


def dequant_matmul() -> bool:
    return flags.switch("dequant_matmul", mx.default_device() == mx.cpu)


PREFILL_DEQUANT_MIN_ROWS = 512   # dequant_prefill: from this many rows (see the flag)


def dequant_prefill(module: nn.Module, x: mx.array) -> bool:
    """Whether a product of x by the mxfp module's weight dequantizes that weight for this call
    and multiplies plainly (flag `dequant_prefill`; auto: under CUDA): bf16/fp16 activations,
    whose dtype holds every mxfp8/mxfp4 value, of at least PREFILL_DEQUANT_MIN_ROWS rows."""
    return (module.mode in ("mxfp4", "mxfp8") and x.dtype in (mx.bfloat16, mx.float16)
            and x.size >= PREFILL_DEQUANT_MIN_ROWS * x.shape[-1]
            and flags.switch("dequant_prefill", backend() == "cuda"))


def dequantize(module: nn.Module, dtype: mx.Dtype, arrays: Optional[tuple] = None) -> mx.array:
    """The quantized module's weight as `dtype`; or that of `arrays`, views (weight, scales,
    biases or None) of the module's own."""
    weight, scales, biases = arrays or (module["weight"], module["scales"], module.get("biases"))
    return mx.dequantize(weight, scales, biases, group_size=module.group_size, bits=module.bits,
                         mode=module.mode, dtype=dtype)


def _dense(module: nn.Module, dtype: mx.Dtype) -> mx.array:
    """The module's weight dequantized to `dtype`, made once and kept."""
    return kept(module, f"dense_{dtype}", module["weight"], lambda: dequantize(module, dtype))


class Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        # nn.Linear's product with the transposed weight kept (a view of the same memory) inside
        # the fixed-shape decode step: no Transpose primitive per step.
        w = derived(self, "transposed", self["weight"], lambda: self["weight"].T)
        return mx.addmm(self["bias"], x, w) if "bias" in self else x @ w

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


class QuantizedLinear(nn.QuantizedLinear):
    def dequantized(self, dtype) -> mx.array:
        # mxfp8/mxfp4 values are bf16-exact; affine weights (float scales) are exact in fp32 only.
        return _dense(self, dtype if self.mode in ("mxfp4", "mxfp8") else mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        if dequant_matmul():
            w = self.dequantized(x.dtype)
            return (x.astype(w.dtype) @ w.T).astype(x.dtype)
        q = _matvec_operand(self, x)
        if q is not None:
            return quantized_matvec(x, q, act_quant=False)
        if dequant_prefill(self, x):   # the dense weight lives for this product only
            return x @ dequantize(self, x.dtype).T
        # With float scales MLX returns float32 for bf16 inputs: keep the activations' dtype.
        return super().__call__(x).astype(x.dtype)


class ExpertPairs(nn.Module):
    """Stacked experts [E, out, in] multiplying (row, expert) pairs: pair m is x's row m (x_rows[m]
    where given) through expert indices[m], its product put at row m (out_rows[m]: a permutation),
    so that a caller who sorts the pairs by expert (prefill) need not gather x or the products
    back itself. Subclasses give `pairs` (x's rows in pair order, products in pair order)."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False,
                 x_rows: Optional[mx.array] = None, out_rows: Optional[mx.array] = None) -> mx.array:
        y = self.pairs(x if x_rows is None else x[x_rows], indices, sorted_indices)
        return experts_prefill.placed(y, out_rows)


class ExpertLinear(ExpertPairs):
    """Stacked expert weights [E, out, in]; row m of x goes through expert indices[m]."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))

    def pairs(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if dequant_matmul() and self["weight"].dtype != mx.float32:   # the CPU's gather_mm: fp32 only
            w = kept(self, "dense_float32", self["weight"], lambda: self["weight"].astype(mx.float32))
            return mx.gather_mm(x.astype(mx.float32), w.swapaxes(-1, -2), rhs_indices=indices,
                                sorted_indices=sorted_indices).astype(x.dtype)
        return mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices,
                            sorted_indices=sorted_indices)

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        q = QuantizedExpertLinear(group_size, bits, mode)
        q.weight, q.scales, *biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        if biases:
            q.biases = biases[0]
        return q


class GGUFLinear(nn.Module):
    """A projection kept as GGUF blocks (dsv4/gguf_blocks.py): weight uint8 [out, row bytes],
    the file's own bytes. 1-8 tokens on a GPU take the GGUF matvec kernel; otherwise the
    blocks are decoded exactly (fp32) and multiplied in fp32, the CPU from a dense copy made
    once (DSV4_DEQUANT_MATMUL)."""

    def __init__(self, input_dims: int, output_dims: int, qtype: str):
        super().__init__()
        self.qtype = qtype
        self.weight = mx.zeros((output_dims, gguf_blocks.row_bytes(qtype, input_dims)), mx.uint8)

    def matrix(self) -> GGUFMatrix:
        return GGUFMatrix(self["weight"], self.qtype)

    def dequantized(self) -> mx.array:
        return kept(self, "dense_float32", self["weight"], lambda: self.matrix().dequantized())

    def __call__(self, x: mx.array) -> mx.array:
        q = _matvec_operand(self, x)
        if q is not None:
            return quantized_matvec(x, q, act_quant=False)
        w = self.dequantized() if dequant_matmul() else self.matrix().dequantized()
        return (x.astype(mx.float32) @ w.T).astype(x.dtype)


class GGUFExpertLinear(ExpertPairs):
    """Stacked experts kept as GGUF blocks: weight uint8 [E, out, row bytes]; row m of x
    through expert indices[m], as ExpertLinear. Decode (1-8 tokens on a GPU) runs in the fused
    experts kernel (moe.py); here, prefill and the CPU: the CPU multiplies by a dense fp32 copy,
    a GPU decodes only the experts the rows select: up to FEW_PAIRS (row, expert) pairs each
    pair's own (traceable, as in mx.compile), beyond that each expert once, DEQUANT_BYTES of
    them at a time."""

    DEQUANT_BYTES = 1 << 30
    FEW_PAIRS = 64

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, qtype: str):
        super().__init__()
        self.qtype = qtype
        self.weight = mx.zeros((num_experts, output_dims, gguf_blocks.row_bytes(qtype, input_dims)), mx.uint8)

    def matrix(self) -> GGUFMatrix:
        return GGUFMatrix(self["weight"], self.qtype)

    def dequantized(self) -> mx.array:
        return kept(self, "dense_float32", self["weight"], lambda: self.matrix().dequantized())

    def pairs(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if dequant_matmul():
            w = self.dequantized().swapaxes(-1, -2)
            return mx.gather_mm(x.astype(mx.float32), w, rhs_indices=indices,
                                sorted_indices=sorted_indices).astype(x.dtype)
        # x [..., 1, in] broadcasts against indices [...]: one row per (row, expert) pair.
        d = x.shape[-1]
        shape = tuple(mx.broadcast_shapes(x.shape[:-2], indices.shape))
        rows = mx.broadcast_to(x, shape + (1, d)).reshape(-1, 1, d).astype(mx.float32)
        flat = mx.broadcast_to(indices, shape).reshape(-1)
        out_dims = self["weight"].shape[1]
        if flat.size <= self.FEW_PAIRS:   # decode the pairs' experts as they come: no host sync
            w = gguf_blocks.dequantize(self["weight"][flat], self.qtype).swapaxes(-1, -2)
            return (rows @ w).reshape(shape + (1, out_dims)).astype(x.dtype)
        # Sorted by expert, each batch of experts takes a contiguous run of rows.
        order = mx.argsort(flat)
        experts = np.array(flat[order])
        in_dims = self.matrix().in_features
        per_batch = max(1, self.DEQUANT_BYTES // (4 * out_dims * in_dims))
        used = np.unique(experts)
        parts = []
        for lo in range(0, len(used), per_batch):
            batch = used[lo:lo + per_batch]
            first, last = np.searchsorted(experts, [batch[0], batch[-1] + 1])
            w = gguf_blocks.dequantize(self["weight"][mx.array(batch)], self.qtype).swapaxes(-1, -2)
            local = mx.array(np.searchsorted(batch, experts[first:last]).astype(np.uint32))
            parts.append(mx.gather_mm(rows[order[first:last]], w, rhs_indices=local, sorted_indices=True))
        y = mx.concatenate(parts)[mx.argsort(order)]
        return y.reshape(shape + (1, out_dims)).astype(x.dtype)


def matrix_operand(layer: nn.Module):
    """The kernels' view of a quantized layer's weight (QuantizedMatrix or GGUFMatrix), or None."""
    if isinstance(layer, (GGUFLinear, GGUFExpertLinear)):
        return layer.matrix()
    if isinstance(layer, (nn.QuantizedLinear, QuantizedExpertLinear)):
        return QuantizedMatrix.of(layer)
    return None


class QuantizedExpertLinear(ExpertPairs):
    def __init__(self, group_size: int, bits: int, mode: str):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False,
                 x_rows: Optional[mx.array] = None, out_rows: Optional[mx.array] = None) -> mx.array:
        if not dequant_matmul() and experts_prefill.applies(self, x, indices, x_rows):   # rows read and put in place
            return experts_prefill.prefill_experts(x, self["weight"], self["scales"], indices, self.group_size,
                                                   self.bits, self.mode, sorted_indices, x_rows, out_rows)
        return super().__call__(x, indices, sorted_indices, x_rows, out_rows)

    def pairs(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if dequant_matmul():
            w = _dense(self, mx.float32)
            out = mx.gather_mm(x.astype(mx.float32), w.swapaxes(-1, -2), rhs_indices=indices,
                               sorted_indices=sorted_indices)
            return out.astype(x.dtype)
        return mx.gather_qmm(x, self["weight"], self["scales"], self.get("biases"),
                             rhs_indices=indices, transpose=True, group_size=self.group_size,
                             bits=self.bits, mode=self.mode, sorted_indices=sorted_indices)


def make_dense_copies(model: nn.Module, dtype: mx.Dtype) -> None:
    """With DSV4_DEQUANT_MATMUL on, make every quantized layer's dense copy now, for
    activations of `dtype`: loading takes that time and memory, not the first prompt (and
    not only the layers a short prompt reaches, such as an indexer that is still skipped)."""
    if not dequant_matmul():
        return
    for _, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            module.dequantized(dtype)
        elif isinstance(module, QuantizedExpertLinear):
            _dense(module, mx.float32)
        elif isinstance(module, (GGUFLinear, GGUFExpertLinear)):
            module.dequantized()


MATVEC_AUTO_MIN_ROWS = 2048   # kernel_matvec=auto: measured crossover, see the flag


def _matvec_operand(layer: nn.Module, x: mx.array, rounds: bool = False):
    """The layer's weight for the fused matvec kernel, or None where the kernel does not run:
    flag `kernel_matvec` off (auto: only where the kernel would also do the input's rounding,
    `rounds`, for at least MATVEC_AUTO_MIN_ROWS rows; GGUF blocks always, MLX has no matmul of
    its own for them), a layer with a bias or not quantized, or what `kernel_supports` refuses
    (the CPU, more than 8 tokens)."""
    gguf = isinstance(layer, GGUFLinear)
    if not _kernel_layer(layer):
        return None
    if not flags.switch("kernel_matvec", gguf or rounds and layer["weight"].shape[0] >= MATVEC_AUTO_MIN_ROWS):
        return None
    q = matrix_operand(layer)
    return q if kernel_supports(x, q) else None


def _kernel_layer(layer: nn.Module) -> bool:
    """A layer whose projection the matvec kernel can make: GGUF blocks, or MLX-quantized without a bias."""
    return isinstance(layer, GGUFLinear) or isinstance(layer, nn.QuantizedLinear) and "bias" not in layer


def _joined_operand(layers: tuple, x: mx.array) -> Optional[tuple]:
    """(`join_rows(layers)`) where a one-token x's projections by two or more layers run as one
    matvec launch (flag `kernel_matvec_joined`, and `kernel_matvec` not off): layers the kernel
    takes, of one layout and input width, on a device where it runs. Else None."""
    if len(layers) < 2 or x.size != x.shape[-1] or not flags.get("kernel_matvec_joined"):
        return None
    if not all(_kernel_layer(layer) for layer in layers) or not flags.switch("kernel_matvec", True):
        return None
    operands = [matrix_operand(layer) for layer in layers]
    if len({(q.layout, q.in_features) for q in operands}) > 1 or not kernel_supports(x, operands[0]):
        return None
    return join_rows(layers)


def join_rows(layers: tuple) -> tuple:
    """(the layers' weights as one kernel operand, their rows stacked in order; the row after each
    layer's). Made once: the arrays are concatenated, then each layer's own become row views of
    the concatenation, so that no weight is held twice; made again if a layer's weight was replaced."""
    store = layers[0].__dict__
    hit = store.get("_joined_rows")
    if hit is not None and len(hit[0]) == len(layers) and all(w is l["weight"] for w, l in zip(hit[0], layers)):
        return hit[1], hit[2]
    names = [n for n in ("weight", "scales", "biases") if n in layers[0]]
    joint = {n: mx.concatenate([layer[n] for layer in layers], axis=-2) for n in names}
    ends = tuple(int(e) for e in np.cumsum([layer["weight"].shape[-2] for layer in layers]))
    for layer, start, end in zip(layers, (0,) + ends[:-1], ends):
        for n in names:
            layer[n] = joint[n][start:end]
    encode_thread.evaluate(joint, [layer[n] for layer in layers for n in names])
    q = dataclasses.replace(matrix_operand(layers[0]), **joint)
    store["_joined_rows"] = (tuple(layer["weight"] for layer in layers), q, ends)
    return q, ends


def fp8_input(x: mx.array) -> mx.array:
    """The official fp8/fp4 matmuls see their input rounded to fp8 per 32 values."""
    return qdq_fp8(x) if flags.get("act_quant") else x


def fp8_linears(x: mx.array, *layers: nn.Module, rounded: Optional[mx.array] = None) -> list[mx.array]:
    """[layer(fp8_input(x)) for each layer], x rounded at most once (model-spec §11); `rounded`
    is fp8_input(x) when the caller already has it.

    A bias-free quantized layer on a GPU with 1-8 tokens takes the fused kernel (rounding and
    matvec in one launch) where flag `kernel_matvec` says; everything else, the CPU always,
    calls the layer on the rounded x."""
    out, rounds = [], rounded is None and bool(flags.get("act_quant"))
    joined = _joined_operand(layers, x)
    if joined is not None:
        q, ends = joined
        y = quantized_matvec(x, q, rounds) if rounded is None else quantized_matvec(rounded, q, False)
        return [y[..., a:b] for a, b in zip((0,) + ends[:-1], ends)]
    for layer in layers:
        q = _matvec_operand(layer, x, rounds)
        if q is not None:
            out.append(quantized_matvec(x, q, bool(flags.get("act_quant"))))
            continue
        if rounded is None:
            rounded = fp8_input(x)
        out.append(layer(rounded))
    return out


def fp8_linear_tail(layer: nn.Module, x: mx.array, norm=None, rope=None, qdq: int = NO_QDQ,
                    rounded: Optional[mx.array] = None) -> Optional[mx.array]:
    """rows.row_tail(fp8_linear(layer, x), norm, rope, qdq) as one launch where it runs (flag
    `kernel_matvec_tail`: dsv4/kernels/matvec_tail.py), else None; `rounded` as fp8_linears
    takes it. The layer keeps the launch's counters (one buffer a layer: its projection is one
    launch a step)."""
    if not _kernel_layer(layer) or not flags.switch("kernel_matvec", True):
        return None
    q = matrix_operand(layer)
    x, act_quant = (x, bool(flags.get("act_quant"))) if rounded is None else (rounded, False)
    if not matvec_tail.applies(x, q, qdq):
        return None
    store = layer.__dict__
    if "_tail_arrivals" not in store:
        store["_tail_arrivals"] = matvec_tail.arrivals()
        encode_thread.evaluate(store["_tail_arrivals"])
    return matvec_tail.projection_tail(x, q, act_quant, store["_tail_arrivals"], norm, rope, qdq)


def fp8_linear(layer: nn.Module, x: mx.array) -> mx.array:
    """layer(fp8_input(x)), fused where `fp8_linears` says."""
    return fp8_linears(x, layer)[0]
