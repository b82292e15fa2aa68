"""Sessions at different positions decoded together at fixed shapes: the server's batch on GPUs.

dsv4.batch_decode runs the batch through the reference path, whose arrays grow every step and
whose graph is rebuilt op by op; here each session keeps its state in the fixed-shape buffers of
its own `FixedDecoder` (dsv4/step.py: rings, compressed-row buffers whose capacity doubles), and
one step is one graph for the batch, compiled once and reused until a shape changes (a buffer
doubles, the batch changes) or an index source changes how it selects:

- the dense work (embedding, mHC, MoE, norms, head, the attention's projections) runs once over
  the B tokens [B, 1], which is what batching buys;
- what reads or writes a session's state runs through that session's `StepState`, at its own
  position (an int32 device array, so positions do not enter the trace);
- the attention runs over the batch (batch_decode.RaggedState over the StepStates): each session's
  window rows gathered in window order, its compressed-row buffer padded to the largest capacity,
  its top-k padded with -1.

So that the graph does not depend on where each session is inside its compression groups, every
step pools every compressor's group: the row of a group not yet complete is written but stays
invisible (rows < (pos + 1) // ratio are seen) until its last position writes it whole, exactly
as the lone decoder writes it then. The index sources select the same way for the whole batch:
the most general regime any session needs (none < all rows < scored < scored with candidate
blocks), each of which gives a session that needed less the same rows (in another order: fp32 sums
in another order, as the lone fixed-shape step differs from the reference path).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from . import flags, step_pieces, step_segments
from .batch_decode import RaggedState
from .constants import keeping
from .kernels import cuda_cache
from .step import FixedDecoder, StepState, use_fixed_decode

REGIMES = ("none", "all", "score", "score+candidates")   # each selects what the ones before it do


def use_batch_fixed_decode(model) -> bool:
    """DSV4_BATCH_FIXED_DECODE (auto: where the lone session takes the fixed-shape step)."""
    # The reference's shared-key quirk depends on which layer published last: not traced here.
    return flags.switch("batch_fixed_decode", use_fixed_decode(model)) and not flags.get("index_key_quirk")


def batch_regimes(per_session: Sequence[tuple]) -> tuple:
    """The sessions' (layer, regime) pairs -> one pair per layer: the most general regime."""
    layers = [layer for layer, _ in per_session[0]]
    return tuple((layer, max((dict(s)[layer] for s in per_session), key=REGIMES.index)) for layer in layers)


class SessionsState(RaggedState):
    """The batch's state inside a step: RaggedState over the sessions' StepStates, with what a
    compiled segment hands to the next (dsv4/step_segments.py) named as on the lone step's
    StepState: `buffers` and `candidates` (the candidate source's blocks), one per session."""

    @property
    def buffers(self) -> list[dict]:
        return [s.buffers for s in self.states]

    @property
    def candidates(self) -> list:
        return [s.candidates for s in self.states]

    @candidates.setter
    def candidates(self, blocks) -> None:
        for s, c in zip(self.states, blocks or [None] * len(self.states)):
            s.candidates = c


class SessionsDecoder:
    """Decode steps for sessions at different positions, one forward each, at fixed shapes.
    Each cache is checked out into its session's buffers (it holds no arrays meanwhile);
    `close(keeps)` writes each session's first keeps[i] positions back."""

    def __init__(self, model, caches: Sequence):
        self.model, self.args = model, model.args
        self.sessions = [FixedDecoder(model, cache) for cache in caches]
        if any(d.batch != 1 for d in self.sessions):
            raise ValueError("each cache holds one sequence")
        # Every compressor pools at every step (see the module docstring).
        self.pooling = frozenset(i for d in self.sessions for i, _ in d._pooling)

    @property
    def positions(self) -> list[int]:
        return [d.pos for d in self.sessions]

    def _function(self):
        """The traced step for this batch; graphs live on the model (the server's batches share them)."""
        switches = flags.snapshot()
        rings = tuple(d.ring for d in self.sessions)
        regimes = batch_regimes([d.variant()[1] for d in self.sessions])
        steps = self.model.__dict__.setdefault("_fixed_batch_steps", {})
        key = (rings, regimes, self.pooling, switches)
        # Streamed experts bring each layer's routing to the host mid-step: compiled segments
        # (the batch's tokens routed together), or op by op.
        how = step_segments.mode(self.model, len(self.sessions))
        key += (how,)
        if key not in steps:
            model, args, pooling = self.model, self.args, self.pooling
            state = lambda positions, buffers: SessionsState(
                [StepState(args, pos, ring, dict(held), dict(regimes), pooling)
                 for pos, ring, held in zip(positions, rings, buffers)])

            def step(tokens, positions, engram, buffers):
                s = state(positions, buffers)
                with keeping():
                    logits = model.forward(tokens, s, lambda layer: engram[str(layer)])
                return logits[:, -1], s.buffers

            steps[key] = step_segments.runner(how, model, step, state, every=False, hidden=False)
        return steps[key]

    @cuda_cache.builds_in_parallel("decode")
    def __call__(self, tokens: mx.array) -> mx.array:
        """Feed tokens [B] (any integer dtype) at each session's next position; -> logits [B, V] fp32."""
        tokens = tokens.reshape(len(self.sessions), 1)
        parts = [tokens[i:i + 1] for i in range(len(self.sessions))]
        mx.async_eval(parts)   # their own evaluation: waiting for them never waits for a queued piece
        engram = step_pieces.JoinedRows([d._engram_rows(t) for d, t in zip(self.sessions, parts)])
        for d in self.sessions:
            d._grow()
        step = self._function()
        positions = [mx.array([d.pos], mx.int32) for d in self.sessions]
        logits, buffers = step(tokens, positions, engram, [d.buffers for d in self.sessions])
        for i, (d, held) in enumerate(zip(self.sessions, buffers)):
            d.buffers = held
            d.fed.append(tokens[i:i + 1, 0])
            d.pos += 1
        return logits

    def close(self, keeps: Sequence[int]) -> None:
        """Write the state of each session's positions < keeps[i] back into its cache."""
        for d, keep in zip(self.sessions, keeps):
            d.close(keep)
