"""MoE: sqrtsoftplus router with selection bias, clamped-SwiGLU experts, shared expert
(model-spec §4)."""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .config import ModelArgs
from .constants import derived
from . import flags
from .kernels.dialect import backend
from .kernels import head as head_kernel
from .kernels.experts import routed_experts
from .kernels.experts import kernel_supports as experts_kernel_supports
from .kernels.mhc import hc_expand
from .kernels.router import route
from .linear import ExpertLinear, Linear, fp8_input, fp8_linear, fp8_linears, matrix_operand


def clamped_swiglu(g: mx.array, u: mx.array, limit: float) -> mx.array:
    """silu(min(g, limit)) * clip(u, -limit, limit) in fp32."""
    g, u = g.astype(mx.float32), u.astype(mx.float32)
    if limit > 0:
        g, u = mx.minimum(g, limit), mx.clip(u, -limit, limit)
    return nn.silu(g) * u


class Router(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        self.bias = mx.zeros((args.n_routed_experts,), mx.float32)
        self.args = args

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [N, D] -> (expert ids [N, k], weights [N, k] fp32). The bias only selects."""
        return self.select(self.logits(x))

    def logits(self, x: mx.array) -> mx.array:
        """x [N, D] -> the gate's fp32 logits [N, E]."""
        if flags.get("kernel_router") and head_kernel.supports(x, self.weight):
            return head_kernel.head_logits(x, self.weight)   # the same product, x read as bf16
        w = derived(self, "fp32_t", self.weight, lambda: self.weight.astype(mx.float32).T)
        return x.astype(mx.float32) @ w

    def select(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """The gate's logits [N, E] -> (expert ids [N, k], weights [N, k] fp32)."""
        return route(logits, self.bias, *self.routing())

    def routing(self) -> tuple[int, float, float, bool]:
        """route()'s k, temperature, scale and whether the weights are normalized."""
        a = self.args
        k = a.num_experts_per_tok
        return k, a.gate_temp, a.routed_scaling_factor, a.norm_topk_prob and k > 1


class RoutedExperts(nn.Module):
    """Experts stacked as [E, out, in] (w1 gate, w3 up, w2 down), as dsv4 stores them."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, inter, e = args.hidden_size, args.moe_intermediate_size, args.n_routed_experts
        self.w1 = ExpertLinear(d, inter, e)
        self.w3 = ExpertLinear(d, inter, e)
        self.w2 = ExpertLinear(inter, d, e)
        self.limit = args.swiglu_limit

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        """x [N, D], ids/weights [N, k] -> sum_e w_e * expert_e(x) in fp32 [N, D]."""
        n, k = ids.shape
        if n * k < 64:
            # Few rows: every token's k experts straight from the indices.
            xs = fp8_input(x)[:, None, None, :]                              # [N, 1, 1, D]
            h = clamped_swiglu(self.w1(xs, ids), self.w3(xs, ids), self.limit)
            h = h * weights[..., None, None]
            y = self.w2(fp8_input(h.astype(x.dtype)), ids)                   # [N, k, 1, D]
            return mx.sum(y[:, :, 0].astype(mx.float32), axis=1)
        # Many rows: sort the (token, expert) pairs so each expert's rows go together.
        flat = ids.reshape(-1)
        order = mx.argsort(flat)
        inv = mx.argsort(order)
        xs = fp8_input(x)[order // k][:, None, :]                            # [N*k, 1, D]
        e = flat[order]
        h = clamped_swiglu(self.w1(xs, e, True), self.w3(xs, e, True), self.limit)
        h = h * weights.reshape(-1)[order][:, None, None]
        y = self.w2(fp8_input(h.astype(x.dtype)), e, True)
        return mx.sum(y[inv].reshape(n, k, -1).astype(mx.float32), axis=1)


class SharedExpert(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, inter = args.hidden_size, args.moe_intermediate_size
        self.w1 = Linear(d, inter, bias=False)
        self.w3 = Linear(d, inter, bias=False)
        self.w2 = Linear(inter, d, bias=False)
        self.limit = args.swiglu_limit

    def __call__(self, x: mx.array) -> mx.array:
        h = clamped_swiglu(*fp8_linears(x, self.w1, self.w3), self.limit)
        return fp8_linear(self.w2, h.astype(x.dtype))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Router(args)
        self.experts = RoutedExperts(args)
        self.shared_experts = SharedExpert(args)
        self.limit = args.swiglu_limit

    def __call__(self, x: mx.array, expand: Optional[tuple[mx.array, mx.array, mx.array]] = None) -> mx.array:
        """x [..., D] -> [..., D]; with expand = (streams, post, comb) of the FFN site, the
        expanded streams [..., hc, D] (fused into the experts kernel where it runs). Tokens
        given flat ([N, D], streams [N, hc, D]) need no reshapes."""
        shape = x.shape
        flat = x.reshape(math.prod(shape[:-1]), shape[-1])   # an explicit shape: no-op when 2D
        logits = self.gate.logits(flat)
        fused = self._fused(flat, logits, expand)
        if fused is not None:
            return fused.reshape(expand[0].shape if expand is not None else shape)
        ids, weights = self.gate.select(logits)
        y = self.experts(flat, ids, weights) + self.shared_experts(flat).astype(mx.float32)
        y = y.reshape(shape).astype(x.dtype)
        return y if expand is None else hc_expand(y, *expand)

    def _fused(self, flat, logits, expand) -> Optional[mx.array]:
        """The fused experts kernel's result (routing by the gate's logits), or None where it
        does not run."""
        e, sh = self.experts, self.shared_experts
        if not (flags.get("kernel_moe") and backend() is not None):
            return None
        q = [matrix_operand(m) for m in (e.w1, e.w3, e.w2, sh.w1, sh.w3, sh.w2)]
        if None in q or not experts_kernel_supports(flat, q[0], q[1], q[2], q[3:]):
            return None
        if expand is not None:
            streams, post, comb = expand
            (n, _), (hc, d) = flat.shape, streams.shape[-2:]
            expand = (streams.reshape(n, hc, d), post.reshape(n, hc), comb.reshape(n, hc, hc))
        return routed_experts(flat, logits, self.gate.bias, *self.gate.routing(), q[0], q[1], q[2],
                              tuple(q[3:]), self.limit, bool(flags.get("act_quant")), expand)
