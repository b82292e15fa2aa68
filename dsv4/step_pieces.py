"""The fixed-shape decode step of a model with Engram, compiled in pieces so the device runs ahead.

A step's Engram rows come from tables on disk, addressed by hashing its tokens on the host
(dsv4/engram.py, dsv4/engram_store.py): the one host sync such a step needs. As one traced graph
the step takes the rows as inputs, so the decoder waited for the previous step's token before it
queued anything of the next: the device idled through the hashing, the reads, the replay of the
whole graph and the encoding of its first launches, every token.

With DSV4_ENGRAM_PIECES the fixed-shape step (dsv4/step.py FixedDecoder: decode and a
speculative verify; dsv4/batch_step.py: the server's batch) runs as compiled pieces, each queued
(mx.async_eval) as soon as it is built:

    piece 0   embed, the layers before the first Engram layer   queued before the sync
    piece 1   the first Engram layer                            after the sync and its reads
    piece j   the next 2^(j-1) layers, the last with the head   built while the one before runs

So the device runs layer 0 while the host waits for the token, hashes it and reads the rows, and
each later piece is encoded while the one before it runs (a layer's graph takes the host a few
times less than the device). A later Engram layer's reads are waited for only when its piece is
built: they overlap the layers before it. Each piece is the model's own code (Model.embed_streams,
run_layers, finish); what crosses a boundary is the streams and pre, the index sources' top-k and
candidate blocks and the buffers, as between dsv4/step_segments.py's segments. The logits are
bit-identical to the one graph's (tests/test_step_pieces.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import encode_thread, engram_queued, flags
from .constants import keeping
from .kernels import cuda_cache
from .model import Model


class PendingRows(Mapping):
    """A step's Engram rows by layer ("layer" -> [B, S, heads, dim], as the traced step takes
    them), read when first asked for: then the tokens reach the host (the sync), are hashed after
    `past` (the tokens before, the last at position offset - 1) and every table's reads start,
    and `fed(ids)` hands the ids [B, S] back to the decoder. A layer's rows are waited for when
    they are asked for."""

    def __init__(self, model, tokens: mx.array, past: np.ndarray, offset: int, shape: tuple,
                 fed: Callable[[np.ndarray], None]):
        self.model, self.tokens, self.past, self.offset = model, tokens, past, offset
        self.shape, self.fed = shape, fed
        self.requests: Optional[dict] = None
        self.rows: dict[str, mx.array] = {}

    def resolve(self) -> None:
        if self.requests is None:
            encode_thread.evaluate(self.tokens)
            ids = np.array(self.tokens, dtype=np.int64)     # the one host sync Engram needs
            self.requests = {str(layer): request for layer, request
                             in self.model.start_engram_reads(ids, self.past, self.offset).items()}
            self.fed(ids)

    def __getitem__(self, layer: str) -> mx.array:
        self.resolve()
        if layer not in self.rows:
            self.rows[layer] = self.requests[layer].wait().reshape(self.shape)
        return self.rows[layer]

    def __iter__(self):
        self.resolve()
        return iter(self.requests)

    def __len__(self) -> int:
        self.resolve()
        return len(self.requests)


class JoinedRows(Mapping):
    """The server's batch's rows by layer: its sessions' (maybe pending) rows joined along the
    batch when a layer's are asked for."""

    def __init__(self, sessions: list[Mapping]):
        self.sessions = sessions

    def __getitem__(self, layer: str) -> mx.array:
        return mx.concatenate([rows[layer] for rows in self.sessions])

    def __iter__(self):
        return iter(self.sessions[0])

    def __len__(self) -> int:
        return len(self.sessions[0])


def applies(model) -> bool:
    """Whether DSV4_ENGRAM_PIECES takes this model's compiled step: a whole model with Engram
    layers (a pipeline's stage runs its own forward, dsv4/distributed/pipeline.py) whose rows are
    read on the host (not dsv4/engram_queued.py's)."""
    return (bool(flags.get("engram_pieces")) and isinstance(model, Model) and bool(model.args.engram_layer_ids)
            and not engram_queued.applies(model))


def spans(layers: int, first_engram: int) -> list[tuple[int, int]]:
    """The pieces' layers [lo, hi): those before the first Engram layer, that layer, then runs
    doubling in length to the last layer."""
    cuts, size = [0, first_engram], 1
    while cuts[-1] < layers:
        cuts.append(min(cuts[-1] + size, layers))
        size *= 2
    return list(zip(cuts, cuts[1:]))


class EngramPieces:
    """A traced step's interface, (tokens [B, n], pos, Engram rows, buffers) -> (out, buffers),
    over compiled pieces queued one by one; `state(pos, buffers)` makes a piece's StepState.
    The rows may be a PendingRows: the first piece is queued before anything asks for them.
    out is the last position's logits [B, V], or with `every` (logits [B, n, V], the draft
    stages' inputs if `hidden`)."""

    def __init__(self, model, state: Callable, every: bool, hidden: bool):
        self.model, self.state, self.every, self.hidden = model, state, every, hidden
        layers = model.args.engram_layer_ids
        self.spans = spans(len(model.layers), min(layers))
        self.engram = [[str(layer) for layer in layers if lo <= layer < hi] for lo, hi in self.spans]
        self.pieces = [mx.compile(self._piece(j, lo, hi)) for j, (lo, hi) in enumerate(self.spans)]

    def _piece(self, j: int, lo: int, hi: int) -> Callable:
        model, blocks, last = self.model, self.model.layers, j == len(self.spans) - 1

        def piece(tokens, pos, engram, buffers, carried):
            state = self.state(pos, buffers)
            state.topk, state.candidates = carried.get("topk"), carried.get("candidates")
            lead, hidden = tokens.shape, [] if self.hidden else None
            with keeping():
                streams, pre = model.embed_streams(tokens) if j == 0 else (carried["streams"], carried["pre"])
                streams, pre = model.run_layers(blocks[lo:hi], streams, pre, state, lead,
                                                lambda layer: engram[str(layer)], hidden)
                out = {"logits": model.finish(streams, pre, lead)} if last else {"streams": streams, "pre": pre}
            return {**out, "topk": state.topk, "candidates": state.candidates, "buffers": state.buffers,
                    "hidden": hidden}

        return piece

    def __call__(self, tokens: mx.array, pos, engram: Mapping, buffers):
        encode_thread.async_eval(tokens)   # its own evaluation: the sync below waits for it, not for piece 0
        carried, hidden = {}, []
        for j, piece in enumerate(self.pieces):
            out = piece(tokens, pos, {layer: engram[layer] for layer in self.engram[j]}, buffers, carried)
            buffers = out["buffers"]
            hidden += out["hidden"] or []
            carried = {name: out.get(name) for name in ("streams", "pre", "topk", "candidates")}
            # The last piece the caller queues with what it samples. While a first call's kernels
            # build, nothing is queued early: the step's own end joins the builds first.
            if j < len(self.pieces) - 1 and not cuda_cache.building():
                encode_thread.async_eval([a for _, a in tree_flatten([carried, buffers, hidden]) if a is not None])
        logits = out["logits"]
        return ((logits, hidden) if self.every else logits[:, -1]), buffers
