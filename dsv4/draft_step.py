"""The DSpark draft stages at fixed shapes (DSV4_FIXED_PROPOSE): a propose is one compiled graph
per k, a seed one per row count, and neither needs the host between them.

The reference propose (dsv4/speculative.py `propose` over a `DraftCache`) concatenates the
window rows the stages hold with the block's and builds the window indices from Python ints, so
every cycle is a new graph run op by op. Here each stage's window lives in a ring of
`ring_size(window, block, [])` rows, position p in slot p % ring, and the window's end is an
int32 device array:

- `seed` writes the main KV of every position a verify fed (k + 1 rows, the rejected ones
  too) before the acceptance is known, so it is queued behind the verify without a sync;
  `keep(n)` then moves the window's end past the n accepted positions only. The rejected rows
  lie past the end, unseen, until the positions after the end are written again; the ring's
  spare `block` rows keep them off the window's rows;
- `propose` runs the three stages over the block (every row sees the window's slots, -1 where
  no position is held yet, and every block row), the head, the Markov picks (argmax, or draws
  from q with MLX's random state as the graph's input and output) and the confidence head.

The drafts, q-logits and confidence equal the reference's up to fp32 summation order
(tests/test_draft_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from . import flags
from .constants import keeping, ramp
from .draft import DraftCache, Proposal, pick_drafts
from .kernels import cuda_cache
from .sampling import LogitAdjustment, Sampling
from .step import StepState, ring_size, use_fixed_decode


def use_fixed_propose(model) -> bool:
    return flags.switch("fixed_propose", use_fixed_decode(model))


@dataclass
class BlockState(StepState):
    """A draft block's rows at positions pos .. pos + block - 1 as a stage's Attention asks
    (see attention.ForwardState): every row sees the window, positions pos - window .. pos - 1
    held in the stage's ring (from `held_from` on: a window started at a cache's offset holds
    nothing before it), and every row of the block (model-spec §7)."""
    held_from: Optional[mx.array] = None     # [1] int32

    def window(self, attn, rows: mx.array) -> tuple[mx.array, mx.array]:
        w, s = self.args.sliding_window, rows.shape[1]
        u = self.pos - w + ramp(w, mx.int32)                      # the window's positions
        held = mx.where(u >= self.held_from, u % self.ring, -1)
        idx = mx.concatenate([held, self.ring + ramp(s, mx.int32)])
        keys = mx.concatenate([self.buffers[f"{attn.layer}.window"], rows], axis=1)
        return keys, mx.broadcast_to(idx.reshape(1, 1, w + s), (1, s, w + s))


def _sampling_key(sampling: Sampling) -> tuple:
    """What a traced propose takes as constants from the sampling options."""
    return (sampling.temp, sampling.top_p, sampling.presence_penalty, sampling.frequency_penalty,
            tuple(sorted(sampling.logit_bias.items())))


class FixedDraft:
    """The draft window of one sequence at fixed shapes, taken from a `DraftCache` (its rows of
    positions end - n .. end - 1); `close` writes it back."""

    def __init__(self, model, cache: DraftCache):
        draft, args = model.draft, model.args
        self.model, self.cache, self.draft, self.args = model, cache, draft, args
        self.window = args.sliding_window
        self.ring = ring_size(self.window, draft.block_size, [])
        self.end = cache.end                   # the next position to seed, on the host
        dtype = model.activation_dtype
        self.buffers: dict[str, mx.array] = {}
        for i, stage in enumerate(draft.mtp):
            buf = mx.zeros((1, self.ring, args.head_dim), dtype)
            rows = cache.rows[i]
            if rows is not None and rows.shape[1]:
                if rows.shape[0] != 1:
                    raise ValueError("the fixed-shape draft window holds one sequence")
                slots = np.arange(self.end - rows.shape[1], self.end) % self.ring
                buf[:, mx.array(slots)] = rows.astype(dtype)
            self.buffers[f"{stage.attn.layer}.window"] = buf
        held = cache.rows[0]
        self.held_from = max(0, self.end - (0 if held is None else held.shape[1]))   # the first position held
        self._written = self.end               # past the last position seeded (kept or not)
        # Streamed experts bring the routing to the host mid-graph (dsv4/step.py does the same).
        streamed = any(stage.ffn.streamed is not None for stage in draft.mtp)
        self._compile = flags.get("compile") and not flags.get("stage_profile") and not streamed

    def _function(self, key: tuple, make):
        """A traced graph kept on the draft module (a server's sessions share them); switches
        are read while tracing, so their values are part of the key."""
        graphs = self.draft.__dict__.setdefault("_fixed_graphs", {})
        key = (self.ring, flags.snapshot()) + key
        if key not in graphs:
            graphs[key] = make()
        return graphs[key]

    def _end(self) -> mx.array:
        return mx.array([self.end], mx.int32)

    # --- the window -----------------------------------------------------------------------------

    @cuda_cache.builds_in_parallel("draft")
    def seed(self, hidden: list[mx.array]) -> None:
        """Write the main KV of the n positions from the window's end on, from what the
        backbone's step handed out ([n, D] per target layer, possibly unevaluated); the end
        stays where it is until `keep`."""
        n = hidden[0].shape[0]
        if n > self.ring - self.window:
            raise ValueError(f"a seed of {n} positions would overwrite window rows "
                             f"(ring {self.ring}, window {self.window})")

        def make():
            draft, args, ring = self.draft, self.args, self.ring

            def seed(hidden, end, buffers):
                state = StepState(args, end, ring, dict(buffers), {}, length=n)
                with keeping():
                    rows = draft.main_kv(draft.targets(hidden, 1), state)
                for stage, stage_rows in zip(draft.mtp, rows):
                    state.write(f"{stage.attn.layer}.window", stage_rows, state.slot)
                return state.buffers

            return mx.compile(seed) if self._compile else seed

        self.buffers = self._function(("seed", n), make)(hidden, self._end(), self.buffers)
        self._written = self.end + n

    def keep(self, n: int) -> None:
        """Move the window's end past the first n positions of the last seed."""
        if not 0 <= n <= self._written - self.end:
            raise ValueError(f"can keep 0..{self._written - self.end} seeded positions, not {n}")
        self.end += n

    # --- drafts ---------------------------------------------------------------------------------

    @cuda_cache.builds_in_parallel("draft")
    def propose(self, token, k: int, adjust: LogitAdjustment, sampling: Sampling,
                advance: Optional[mx.array] = None) -> Proposal:
        """k <= block drafts after `token` (an int, or an int32 device scalar), the pending token
        at position `end` (see dsv4/speculative.py `propose`), from one graph; nothing is
        evaluated. `advance` (an int32 device scalar) puts the block that many positions past
        `end`: the rows a verify's acceptance keeps, before the host knows how many (`keep`
        then moves `end` by the same)."""
        penalized = sampling.penalized

        def make():
            model, draft, args, ring = self.model, self.draft, self.args, self.ring

            def propose(token, end, held_from, buffers, counts):
                state = BlockState(args, end, ring, dict(buffers), {}, length=draft.block_size,
                                   held_from=held_from)
                with keeping():
                    x = draft.block(model, state, token)
                    p = pick_drafts(model, x, token, k, adjust, counts, sampling)
                return (p.drafts, p.confidence) + (() if p.q_logits is None else (p.q_logits,))

            if not self._compile:
                return propose
            if sampling.temp == 0:
                return mx.compile(propose)
            # The draws split MLX's global key as they do op by op: the key in and out of the graph.
            return mx.compile(propose, inputs=mx.random.state, outputs=mx.random.state)

        graph = self._function(("propose", k, _sampling_key(sampling)), make)
        counts = adjust.counts if penalized else mx.zeros((0,), mx.float32)
        token = token.reshape(1).astype(mx.int32) if isinstance(token, mx.array) else mx.array([token], mx.int32)
        end = self._end() if advance is None else self._end() + advance.astype(mx.int32)
        out = graph(token, end, mx.array([self.held_from], mx.int32), self.buffers, counts)
        return Proposal(out[0], out[2] if len(out) > 2 else None, out[1])

    # --- back to the cache ------------------------------------------------------------------------

    def close(self) -> None:
        """Write the window's rows (positions end - window .. end - 1, those held) back into the
        cache, whose end moves to this one's."""
        lo = max(self.end - self.window, self.held_from)
        slots = mx.array(np.arange(lo, self.end) % self.ring)
        for i, stage in enumerate(self.draft.mtp):
            self.cache.rows[i] = self.buffers[f"{stage.attn.layer}.window"][:, slots] if self.end > lo else None
        self.cache.end = self.end
        mx.eval([r for r in self.cache.rows if r is not None])
