"""The fixed-shape decode step of a model whose routed experts stream from disk, compiled in segments.

A streamed MoE (dsv4/expert_store.py) needs its routing on the host in the middle of the step:
the experts its tokens select are looked up, and the misses read into the cache's slots, before
they are computed. A traced graph cannot stop for the host, so with DSV4_EXPERT_STEP_SEGMENTS
the step (dsv4/step.py, and the server's batch, dsv4/batch_step.py, whose B tokens each streamed
layer routes and looks up together) runs as one traced graph per stretch between two streamed
routings:

    segment 0   embed, the layers before the first streamed MoE, its router    -> routing
    segment j   layer L(j-1)'s experts from the slots, ..., layer L(j)'s router -> routing
    segment m   the last streamed layer's experts, the layers after it, head   -> logits

where a routing is the ids and weights, and with expert_prefetch the next layer's guess. Each
segment is the model's own code (Model.run_layers / run_to_moe / finish, MoE.streamed_routing and
streamed_output), run from a layer's experts to the next router; what crosses a boundary is an
input of the next graph: the MoE's input and the FFN site's expand and pre, the index sources'
top-k and candidate blocks, the buffers, and the slot ids with the cache's pool arrays (the
store writes the slots in place: the graph reads them as it reads any input). Between two
segments the host does what MoE._streamed does op by op (streamed_chosen: the one sync of the
layer; streamed_slots: the lookup and its reads; after queueing the next segment,
streamed_queued: the slots fenced; streamed_prefetch), in the same order, so the store sees the
same calls and the logits are bit-identical to the resident model's (tests/test_expert_streaming.py).
Which prefetches have landed by a lookup depends on timing, and the slots still loading are not
evicted: with prefetch on, hit rates can differ from op by op's (and run to run); tokens do not.

Each segment's traced graphs are cached as the whole step's are (by variant and switches, on
the model), and every shape is fixed: the CPU's dense path multiplies by copies of the used
slots, padded to the step's tokens x top-k. A step whose tokens could select more experts than
a layer's pool holds (its tokens would go in parts) runs op by op.

What the host's turn costs per streamed layer (benchmarks/expert_stream.py --parts steps, on this
project's 2-core CPU: benchmarks/results/2026-12-03-1232-expert-stream.md): the demo checkpoint
(8 streamed layers, every expert cached, so no reads) decodes at 25.1 ms per token as segments,
37.5 ms op by op and 20.8 ms resident (one compiled graph): each streamed layer adds ~0.55 ms
as segments (the sync that drains the device, the lookup, a graph's call) against ~2.1 ms op by
op (which also builds the layer's graph in Python every step). The server's batch of 4 sessions
(--steps-batch 4, 2026-12-03-1311): 40.1 ms a step as segments, 51.2 op by op, 24.0 resident,
most of the difference the CPU dense path's copies of the 8 slots a layer uses each step
(without that path: 49.4 / 61.8 / 48.4). On the H200 (2026-12-03-1318), one session: 8.6 ms per token
as segments, 19.0 op by op, 4.6 resident: ~0.50 ms a streamed layer against ~1.8 ms, the same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import mlx.core as mx

from . import flags, step_pieces
from .constants import keeping


def mode(model, tokens: int) -> str:
    """How a fixed-shape step over `tokens` tokens runs: "compiled" (one traced graph),
    "pieces" (compiled pieces queued one by one around Engram's sync, dsv4/step_pieces.py),
    "segments" (compiled segments around the streamed experts' lookups) or "ops" (op by op:
    DSV4_COMPILE=0, the stage profile, or streamed experts without segments or whose pools
    could not hold the step's picks)."""
    if not flags.get("compile") or flags.get("stage_profile"):
        return "ops"
    if getattr(model, "expert_store", None) is None:
        return "pieces" if step_pieces.applies(model) else "compiled"
    return "segments" if flags.get("expert_step_segments") and fits(model, tokens) else "ops"


def runner(how: str, model, step: Callable, state: Callable, every: bool, hidden: bool) -> Callable:
    """The step as `mode` says it runs: `step` (tokens, pos, Engram rows, buffers) -> (out,
    buffers), traced whole, as SegmentedStep or EngramPieces over `state`, or as it is. The rows
    are a mapping by layer, maybe read only when first asked for (dsv4/step_pieces.py
    PendingRows): a traced graph takes them all as a dict."""
    if how == "segments":
        return SegmentedStep(model, state, every, hidden)
    if how == "pieces":
        return step_pieces.EngramPieces(model, state, every, hidden)
    if how == "compiled":
        traced = mx.compile(step)
        return lambda tokens, pos, engram, buffers: traced(tokens, pos, dict(engram), buffers)
    return step


def fits(model, tokens: int) -> bool:
    """Whether every streamed layer's pool holds what `tokens` tokens can select at once (else a
    step's tokens would go in parts, each fenced before the next part's reads)."""
    store, k = model.expert_store, model.args.num_experts_per_tok
    return all(tokens * k <= store.capacity(block.layer) for block in model.layers
               if block.ffn.streamed is not None)


class SegmentedStep:
    """A traced step's interface, (tokens [B, n], pos, Engram rows, buffers) -> (out, buffers),
    over compiled segments with the host's expert lookups between them. `state(pos, buffers)`
    makes the step's state: a StepState (pos [1] int32, buffers a dict), or the batch's
    SessionsState (dsv4/batch_step.py: one of each per session). out is the last position's
    logits [B, V], or with `every` (logits [B, n, V], the draft stages' inputs if `hidden`)."""

    def __init__(self, model, state: Callable, every: bool, hidden: bool):
        self.model, self.state, self.every, self.hidden = model, state, every, hidden
        blocks = model.layers
        self.stops = [i for i, block in enumerate(blocks) if block.ffn.streamed is not None]
        self.moes = [blocks[i].ffn for i in self.stops]
        self.segments = [mx.compile(self._segment(j)) for j in range(len(self.stops) + 1)]

    def _segment(self, j: int) -> Callable:
        model, blocks = self.model, self.model.layers
        first = self.stops[j - 1] + 1 if j else 0
        stop = self.stops[j] if j < len(self.stops) else None

        def segment(tokens, pos, engram, buffers, carried, fetched):
            state = self.state(pos, buffers)
            state.topk, state.candidates = carried.get("topk"), carried.get("candidates")
            rows = lambda layer: engram[str(layer)]
            lead, hidden = tokens.shape, [] if self.hidden else None
            with keeping():
                if j == 0:
                    streams, pre = model.embed_streams(tokens)
                else:
                    streams = blocks[first - 1].ffn.streamed_output(carried["x"], carried["expand"], **fetched)
                    pre = carried["pre"]
                if stop is None:
                    streams, pre = model.run_layers(blocks[first:], streams, pre, state, lead, rows, hidden)
                    out = {"logits": model.finish(streams, pre, lead)}
                else:
                    x, expand, pre = model.run_to_moe(blocks[first:stop + 1], streams, pre, state, lead,
                                                      rows, hidden)
                    out = {"x": x, "expand": expand, "pre": pre, "routing": blocks[stop].ffn.streamed_routing(x)}
            return {**out, "topk": state.topk, "candidates": state.candidates, "buffers": state.buffers,
                    "hidden": hidden}

        return segment

    def __call__(self, tokens: mx.array, pos: mx.array, engram: Mapping, buffers: dict):
        width = tokens.size * self.model.args.num_experts_per_tok   # the dense path's gathered slots
        engram = dict(engram)
        carried, fetched, hidden = {}, None, []
        for j, segment in enumerate(self.segments):
            out = segment(tokens, pos, engram, buffers, carried, fetched)
            buffers = out["buffers"]
            hidden += out["hidden"] or []
            if j:   # the previous layer's experts are queued: as MoE._streamed after its part
                done = self.moes[j - 1]
                done.streamed_queued(slots, out["logits"] if j == len(self.moes) else out["routing"]["ids"])
                done.streamed_prefetch(routing)
            if j == len(self.moes):
                break
            moe, routing = self.moes[j], out["routing"]
            slots, slot_ids, gather = moe.streamed_slots(moe.streamed_chosen(routing), width)
            pool = moe.streamed.store.pool(moe.streamed.layer)
            fetched = {"slot_ids": slot_ids, "weights": routing["weights"], "arrays": pool.arrays, "gather": gather}
            carried = {name: out[name] for name in ("x", "expand", "pre", "topk", "candidates")}
        logits = out["logits"]
        return ((logits, hidden) if self.every else logits[:, -1]), buffers
