"""MoE: sqrtsoftplus router with selection bias, clamped-SwiGLU experts, shared expert
(model-spec §4)."""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .config import ModelArgs
from .constants import derived
from . import distributed, flags, profiler
from .kernels.dialect import backend
from .kernels import head as head_kernel
from .kernels.experts import experts as fused_experts
from .kernels.experts import routed_experts
from .kernels.experts import kernel_supports as experts_kernel_supports
from .kernels.mhc import hc_expand
from .kernels.router import route
from .kernels import swiglu
from .linear import (ExpertLinear, Linear, dequant_matmul, fp8_input, fp8_linear, fp8_linears,
                     matrix_operand)


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
    """Experts stacked as [E, out, in] (w1 gate, w3 up, w2 down), as dsv4 stores them: the
    experts and intermediate columns the plan gives this rank."""

    def __init__(self, args: ModelArgs, plan: distributed.Plan = distributed.SINGLE):
        super().__init__()
        d, e = args.hidden_size, len(plan.experts(args))
        inter = len(plan.routed_columns(args))
        self.w1 = ExpertLinear(d, inter, e)
        self.w3 = ExpertLinear(d, inter, e)
        self.w2 = ExpertLinear(inter, d, e)
        self.limit = args.swiglu_limit

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array,
                 sort_rows: Optional[bool] = None) -> mx.array:
        """x [N, D], ids/weights [N, k] -> sum_e w_e * expert_e(x) in fp32 [N, D]. `sort_rows`
        (default: 64 pairs or more) picks the way of computing; a caller that splits a batch
        passes the whole batch's choice, so that every part is computed as the whole would be."""
        return mx.sum(self.slots(x, ids, weights, sort_rows).astype(mx.float32), axis=1)

    def slots(self, x: mx.array, ids: mx.array, weights: mx.array,
              sort_rows: Optional[bool] = None) -> mx.array:
        """Each slot's weighted expert output [N, k, D] in x's dtype (summed in fp32 over k, the
        routed output)."""
        n, k = ids.shape
        if not (n * k >= 64 if sort_rows is None else sort_rows):
            # Few rows: every token's k experts straight from the indices.
            xs = fp8_input(x)[:, None, None, :]                              # [N, 1, 1, D]
            h = swiglu.hidden(self.w1(xs, ids), self.w3(xs, ids), weights, self.limit, flags.get("act_quant"))
            y = self.w2(h, ids)                                              # [N, k, 1, D]
            return y[:, :, 0]
        # Many rows: sort the (token, expert) pairs so each expert's rows go together; the gate
        # and up products read each pair's token row, the down products land in (token, slot) order.
        flat = ids.reshape(-1)
        order = mx.argsort(flat)
        tokens = order // k
        xq = fp8_input(x)[:, None, :]                                        # [N, 1, D]
        e = flat[order]
        g, u = (w(xq, e, True, x_rows=tokens) for w in (self.w1, self.w3))   # [N*k, 1, I], sorted
        h = swiglu.hidden(g, u, weights.reshape(-1)[order], self.limit, flags.get("act_quant"))
        y = self.w2(h, e, True, out_rows=order)                              # [N*k, 1, D], in order
        return y.reshape(n, k, -1)


class SharedExpert(nn.Module):
    def __init__(self, args: ModelArgs, plan: distributed.Plan = distributed.SINGLE):
        super().__init__()
        d, inter = args.hidden_size, len(plan.shared_columns(args))
        self.w1 = Linear(d, inter, bias=False)
        self.w3 = Linear(d, inter, bias=False)
        self.w2 = Linear(inter, d, bias=False)
        self.limit = args.swiglu_limit

    def __call__(self, x: mx.array) -> mx.array:
        h = swiglu.clamped_swiglu(*fp8_linears(x, self.w1, self.w3), self.limit)
        return fp8_linear(self.w2, h.astype(x.dtype))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, plan: distributed.Plan = distributed.SINGLE):
        """`plan`: the routed experts and intermediate columns this rank holds (dsv4.distributed);
        the router is whole on every rank."""
        super().__init__()
        self.gate = Router(args)
        self.experts = RoutedExperts(args, plan)
        self.shared_experts = SharedExpert(args, plan)
        self.limit = args.swiglu_limit
        self.plan = plan
        self.expert_ids = plan.experts(args)
        self.sharded = (len(self.expert_ids) < args.n_routed_experts
                        or len(plan.routed_columns(args)) < args.moe_intermediate_size
                        or len(plan.shared_columns(args)) < args.moe_intermediate_size)
        # Set by expert_store.Streaming.attach when the routed experts stream from disk: then
        # `experts` is gone and this layer's experts come from the store's cache.
        self.streamed = None

    def __call__(self, x: mx.array, expand: Optional[tuple] = None):
        """x [..., D] -> [..., D]; with expand = (streams, post, comb) of the FFN site, the
        expanded streams [..., hc, D] (fused into the experts kernel where it runs). Tokens
        given flat ([N, D], streams [N, hc, D]) need no reshapes. An expand that also carries
        the next site's (fn, pre_in) gives (streams, projection) as `hc_expand` with them does:
        that site's entry partials, made in the experts' down launch where it runs (None where
        nothing made them)."""
        site = expand is not None and len(expand) > 3
        if site and (self.streamed is not None or self.sharded):
            return self(x, expand[:3]), None
        if self.streamed is not None:   # (never sharded: the loader refuses --parallel then)
            return self._streamed(x, expand)
        shape = x.shape
        flat = _tokens(x)
        logits = self.gate.logits(flat)
        if self.sharded:
            y = self._sharded(flat, *self.gate.select(logits), expand)
        else:
            y = self._fused(self.experts, flat, expand, logits=logits)
            if y is None:
                y = self._reference(self.experts, flat, *self.gate.select(logits), expand)
        if site:
            return y[0].reshape(expand[0].shape), y[1]
        return y.reshape(expand[0].shape if expand is not None else shape)

    def _reference(self, experts, flat, ids, weights, expand, sort_rows=None) -> mx.array:
        """Routed (through `experts`, ids/weights [N, k]) + shared experts without the fused
        kernel: [N, D], or with expand the expanded streams."""
        y = experts(flat, ids, weights, sort_rows) + self.shared_experts(flat).astype(mx.float32)
        y = y.astype(flat.dtype)
        return y if expand is None else hc_expand(y, *expand)

    def _sharded(self, flat, ids, weights, expand) -> mx.array:
        """Routed + shared experts of this rank's share, combined with the other ranks' in one
        exchange. Experts split by id: each slot's output comes from the rank holding its
        expert (the others give exact zeros: their slot weighs 0), so the exchanged slots are
        one process's, summed in its order (bit-identical); with the shared expert split too it
        travels as one more slot. Columns split: the partial sums are summed (fp32 rounding)."""
        n, k = ids.shape
        owned = self.expert_ids
        if len(owned) < self.gate.args.n_routed_experts:
            local = ids - owned.start
            mine = (local >= 0) & (local < len(owned))
            ids, weights = mx.where(mine, local, 0), mx.where(mine, weights, 0.0)
            slots = self.experts.slots(flat, ids, weights, n * k >= 64)
            shared = self.shared_experts(flat).astype(mx.float32)
            if len(self.plan.shared_columns(self.gate.args)) < self.gate.args.moe_intermediate_size:
                both = self.plan.combine(mx.concatenate([slots.astype(mx.float32), shared[:, None]], axis=1))
                y = mx.sum(both[:, :k], axis=1) + both[:, k]
            else:   # slots travel in their own dtype (bf16: half the bytes), summed in fp32 after
                y = mx.sum(self.plan.combine(slots).astype(mx.float32), axis=1) + shared
        else:
            y = self.plan.combine(self.experts(flat, ids, weights)
                                  + self.shared_experts(flat).astype(mx.float32))
        y = y.astype(flat.dtype)
        return y if expand is None else hc_expand(y, *expand)

    def _kernel_operands(self, experts, flat) -> Optional[list]:
        """The fused kernel's weights (routed gate, up, down, then the shared expert's) when it
        runs for the tokens `flat` through `experts`, else None."""
        sh = self.shared_experts
        if not (flags.get("kernel_moe") and backend() is not None):
            return None
        q = [matrix_operand(m) for m in (experts.w1, experts.w3, experts.w2, sh.w1, sh.w3, sh.w2)]
        if None in q or not experts_kernel_supports(flat, q[0], q[1], q[2], q[3:]):
            return None
        return q

    def _fused(self, experts, flat, expand, logits=None, ids=None, weights=None, q=None) -> Optional[mx.array]:
        """The fused experts kernel's result through `experts` (its operands `q` when known),
        routing by the gate's logits or by ids/weights [N, k] given; None where it does not run."""
        q = q or self._kernel_operands(experts, flat)
        if q is None:
            return None
        if expand is not None:
            streams, post, comb, *site = expand
            (n, _), (hc, d) = flat.shape, streams.shape[-2:]
            expand = (streams.reshape(n, hc, d), post.reshape(n, hc), comb.reshape(n, hc, hc))
            if site:   # the next site's fn and pre_in
                expand += (site[0], site[1].reshape(n, hc))
        if logits is None:
            return fused_experts(flat, ids, weights, q[0], q[1], q[2], tuple(q[3:]), self.limit,
                                 bool(flags.get("act_quant")), expand)
        return routed_experts(flat, logits, self.gate.bias, *self.gate.routing(), q[0], q[1], q[2],
                              tuple(q[3:]), self.limit, bool(flags.get("act_quant")), expand)

    # --- streamed experts ------------------------------------------------------------------
    # The MoE in parts: routing (device), the choice on the host and the lookup (host), the
    # experts from the cache's slots (device). `_streamed` runs them in a row, op by op; a
    # compiled decode step ends one graph at the routing and starts the next at the experts
    # (dsv4/step_segments.py), with the host's part in between.

    def _streamed(self, x: mx.array, expand) -> mx.array:
        """The routed experts from the expert cache (dsv4/expert_store.py): route, bring the
        host the choice (one sync), read the missing experts, compute from the cache's slots as
        the resident model computes from its stack. When the chunk's experts do not all fit in
        the cache at once, its tokens go in parts that do, each computed the way the whole
        chunk would be (so the result is the same, token by token)."""
        routing = self.streamed_routing(x)
        chosen = self.streamed_chosen(routing)
        flat, flat_expand = _tokens(x), _flat_expand(expand, x)
        pool = self.streamed.store.pool(self.streamed.layer)
        parts = []
        for lo, hi in token_parts(chosen, self.streamed.store.capacity(self.streamed.layer)):
            slots, slot_ids, gather = self.streamed_slots(chosen[lo:hi])
            profiler.mark("expert reads", routing["ids"])   # the lookup, its misses read
            part = None if expand is None else tuple(a[lo:hi] for a in flat_expand)
            y = self._from_slots(pool.modules(gather=gather), flat[lo:hi], part, slot_ids,
                                 routing["weights"][lo:hi], flat)
            self.streamed_queued(slots, y)
            parts.append(y)
        self.streamed_prefetch(routing)
        y = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return y.reshape(expand[0].shape if expand is not None else x.shape)

    def streamed_routing(self, x: mx.array) -> dict:
        """Device: x [..., D] (the MoE's input) -> {ids [N, k], weights [N, k] fp32, guess: the
        next streamed layer's experts [N, k] by its router on x (None unless prefetching)}."""
        store, layer = self.streamed.store, self.streamed.layer
        flat = _tokens(x)
        ids, weights = self.gate.select(self.gate.logits(flat))
        next_gate = store.next_gate.get(layer) if flat.shape[0] <= PREFETCH_TOKENS and flags.get("expert_prefetch") else None
        guess = next_gate.select(next_gate.logits(flat))[0] if next_gate is not None else None
        return {"ids": ids, "weights": weights, "guess": guess}

    def streamed_chosen(self, routing: dict) -> np.ndarray:
        """Host: the layer's one sync (its routing, with the work fenced since the last) -> the
        chosen expert ids [N, k]."""
        self.streamed.store.sync([a for a in routing.values() if a is not None])
        return np.array(profiler.mark("expert routing", routing["ids"]))   # the mixes, router and sync

    def streamed_slots(self, chosen: np.ndarray, width: Optional[int] = None):
        """Host: look up the experts `chosen` [n, k] selects (the misses read) -> (their slots
        [u], slot_ids [n, k] int32 as route() gives ids, gather). With the CPU's dense path the
        experts are copies of the slots `gather` [u] (padded to `width` for a fixed shape), which
        slot_ids index; else gather is None and slot_ids index the pool."""
        used = np.unique(chosen)
        slots = self.streamed.store.lookup(self.streamed.layer, used, len(chosen))
        at = np.searchsorted(used, chosen)
        if not dequant_matmul():
            return slots, mx.array(slots[at].astype(np.int32)), None
        gather = slots if width is None else np.pad(slots, (0, width - len(slots)), mode="edge")
        return slots, mx.array(at.astype(np.int32)), mx.array(gather.astype(np.int32))

    def streamed_output(self, x: mx.array, expand, slot_ids: mx.array, weights: mx.array,
                        arrays: dict, gather: Optional[mx.array]) -> mx.array:
        """Device: the MoE's output (as __call__ gives it, for x and expand as given to it)
        from the cache's slots: the pool's `arrays` (or a compiled segment's inputs standing in
        for them) at slot_ids and weights [N, k], as streamed_slots gives them, in one part."""
        flat = _tokens(x)
        experts = self.streamed.store.pool(self.streamed.layer).modules(arrays, gather)
        y = self._from_slots(experts, flat, _flat_expand(expand, x), slot_ids, weights, flat)
        return y.reshape(expand[0].shape if expand is not None else x.shape)

    def streamed_queued(self, slots: np.ndarray, result: mx.array) -> None:
        """Host: `result`, queued, reads `slots`: they wait for it before reuse; the device
        starts on it while the host builds what follows."""
        self.streamed.store.fence(self.streamed.layer, slots, result)
        mx.async_eval(result)

    def streamed_prefetch(self, routing: dict) -> None:
        """Host: start reading the next layer's guessed experts (synced with the routing)."""
        if routing["guess"] is not None:
            store = self.streamed.store
            store.prefetch(store.next_layer[self.streamed.layer], np.array(routing["guess"]).reshape(-1))

    def _from_slots(self, experts, flat, expand, slot_ids, weights, chunk) -> mx.array:
        """Routed (from the cache's modules `experts` at slot_ids) + shared experts of the
        tokens `flat` [n, D] (expand flat too), computed as the resident model computes the
        chunk `chunk` [N, D] they are part of: the kernel and the row sorting decided for it."""
        q = self._kernel_operands(experts, chunk)
        if q is not None:
            return self._fused(experts, flat, expand, ids=slot_ids, weights=weights, q=q)
        k = self.gate.args.num_experts_per_tok
        return self._reference(experts, flat, slot_ids, weights, expand, sort_rows=chunk.shape[0] * k >= 64)


def _tokens(x: mx.array) -> mx.array:
    """x [..., D] -> [N, D] (an explicit shape: no-op when 2D)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _flat_expand(expand, x: mx.array):
    """The FFN site's (streams, post, comb) with the tokens of x flat, or None."""
    if expand is None:
        return None
    streams, post, comb = expand
    n, (hc, d) = math.prod(x.shape[:-1]), streams.shape[-2:]
    return streams.reshape(n, hc, d), post.reshape(n, hc), comb.reshape(n, hc, hc)


# A guess of the next layer's experts is made for decode-sized calls only: a prefill chunk's
# guess would name most experts and read them at the cost of the exact ones.
PREFETCH_TOKENS = 8


def token_parts(ids: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """Consecutive token ranges [lo, hi) of ids [N, k] whose distinct experts number at most
    `capacity` each: the whole range when they all fit."""
    if len(np.unique(ids)) <= capacity:
        return [(0, len(ids))]
    parts, lo, used = [], 0, set()
    for t, row in enumerate(ids.tolist()):
        if len(used | set(row)) > capacity:
            parts.append((lo, t))
            lo, used = t, set()
        used.update(row)
    parts.append((lo, len(ids)))
    return parts
