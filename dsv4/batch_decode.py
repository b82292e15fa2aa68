"""One decode step for several sessions at once, each at its own position (the server's batch).

The dense work of a step (embedding, mHC, MoE, norms, head, and the attention's projections)
runs once over the batch of B tokens, which is what batching buys: each weight is read once
per step instead of once per session, and on the CPU each op is built once instead of B times.
What depends on a session's cache (appending its window row, compressing, selecting, the rows
it attends to) runs per session through the reference path's `ForwardState`, so every cache
evolves exactly as it would if its session ran alone.

The attention then runs once over the batch: each session's window rows are gathered into one
[B, window, D] array, its compressed rows padded to the longest session's count, and its top-k
padded with -1 (never attended). `decode_sessions` gives every session's logits for its token.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .attention import Rotation
from .cache import Cache
from .constants import ramp


def _padded(rows: list[Optional[mx.array]], fill, axis: int) -> Optional[mx.array]:
    """Per-session arrays [1, ...] (None: nothing) -> one [B, ...] array, each padded with `fill`
    along `axis` to the longest (None when no session has any)."""
    present = [r for r in rows if r is not None]
    if not present:
        return None
    longest = max(r.shape[axis] for r in present)
    like = present[0]
    out = []
    for r in rows:
        have = 0 if r is None else r.shape[axis]
        if have == longest:
            out.append(r)
            continue
        shape = list(like.shape)
        shape[axis] = longest - have
        pad = mx.full(shape, fill, like.dtype)
        out.append(pad if r is None else mx.concatenate([r, pad], axis=axis))
    return mx.concatenate(out, axis=0)


class RaggedState:
    """What `Attention.__call__` asks of its state, for a batch of single-token sessions at
    different positions: RoPE at each session's position, the rest per session."""

    fused = False   # the reference path's ops, one by one

    def __init__(self, states: Sequence):
        """states: each session's ForwardState (the reference caches), or its dsv4.step
        StepState (fixed-shape buffers: dsv4.batch_step); their start an int or an int32 [1]."""
        self.states = list(states)
        # [B] int32: mx.fast.rope rotates each batch row at its own offset.
        self.start = mx.concatenate([mx.array(s.start, mx.int32).reshape(1) for s in self.states])
        self.topk: Optional[mx.array] = None
        self._compressed: dict[int, Optional[mx.array]] = {}

    def rotation(self, freqs: mx.array, offset=None, scale: float = 1.0) -> Rotation:
        return Rotation(self.start if offset is None else offset, freqs, scale)

    def output_angles(self, attn) -> None:
        return None

    def window(self, attn, rows: mx.array) -> tuple[mx.array, mx.array]:
        """Append each session's row; -> the rows each query sees, gathered in window order
        [B, window, D], and their indices [B, 1, window] (-1 before position 0)."""
        seen, index = [], []
        for i, state in enumerate(self.states):
            held, idx = state.window(attn, rows[i:i + 1])         # idx [1, 1, window]
            seen.append(mx.take(held[0], mx.maximum(idx[0, 0], 0), axis=0))
            index.append(mx.where(idx[0] >= 0, ramp(idx.shape[-1], mx.int32), -1))
        return mx.stack(seen), mx.stack(index)

    def compress(self, attn, x: mx.array) -> None:
        for i, state in enumerate(self.states):
            state.compress(attn, x[i:i + 1])
        self._compressed.pop(attn.layer, None)

    def compressed(self, layer: int) -> Optional[mx.array]:
        if layer not in self._compressed:
            self._compressed[layer] = _padded([s.compressed(layer) for s in self.states], 0, axis=1)
        return self._compressed[layer]

    def select(self, attn, x: mx.array, qr: mx.array) -> Optional[mx.array]:
        """Each session's top-k [1, 1, k_i] (None before it has compressed rows) -> [B, 1, max k_i],
        -1 where a session picks nothing."""
        return _padded([s.select(attn, x[i:i + 1], qr[i:i + 1]) for i, s in enumerate(self.states)],
                       -1, axis=2)


def decode_sessions(model, caches: Sequence[Cache], tokens: Sequence[int]) -> mx.array:
    """Feed tokens[i] to the session of caches[i] (each at its own position) in one forward;
    -> logits [B, V] fp32. Each cache advances by one position, as `model([[t]], cache)` would."""
    ids = model.checked_ids(np.asarray(tokens, np.int64).reshape(-1, 1))
    states = [model.forward_state(cache, ids[i:i + 1]) for i, cache in enumerate(caches)]
    reads = [model.start_engram_reads(ids[i:i + 1], cache.tokens, cache.offset)
             for i, cache in enumerate(caches)]
    width = model.args.engram_head_dim
    rows = lambda layer: mx.concatenate([r[layer].wait().reshape(1, 1, -1, width) for r in reads])
    logits = model.forward(mx.array(ids), RaggedState(states), rows)
    for i, cache in enumerate(caches):
        cache.tokens = np.concatenate([cache.tokens, ids[i:i + 1]], axis=1)
    return logits[:, -1]
