"""Decode at fixed shapes: one token per sequence per step, one compiled graph for every step.

The reference forward (`Model.__call__` with a `Cache`) takes any chunk, but its arrays grow
every step (concatenation) and its window indices and selection are built from Python ints,
so each decode step is a new graph, rebuilt op by op in Python. Here the state lives in
buffers whose shapes do not change from step to step:

- window rows and compressor inputs: rings of `ring_size` rows, position p in slot p % ring
  (more than the window, so the state handed back keeps `reserve` positions for exact trims);
- compressed rows and index keys: buffers of a capacity that doubles when full (the graph is
  traced again then, a logarithmic number of times);
- positions are int32 device arrays; a group's latent is pooled every step and written to
  its row, which stays invisible (past the visible count) until the group completes.

What differs from step to step only on the host (whether an index source has rows yet and
whether every row makes its top-k) picks one of a few traced variants. The result equals the
reference path up to fp32 summation order (top-k rows come out in another order, padded with
-1): in fp32, logits within ~1e-6 over 64 steps (tests/test_step.py). In bf16 those last-bit
differences flip bf16 (and fp8/fp4) roundings now and then; on the demo checkpoint the logits
of teacher-forced steps differ by a median 0.4% (1.2% with the official roundings) and greedy
tokens agree until a near tie (top-2 margin 0.03 at step 32).

`decoder(model, cache)` gives the decoder the switches ask for; `stream_generate` drives it
with one step in flight (DSV4_ASYNC_DECODE). A model whose experts stream from disk needs each
layer's routing on the host mid-step: its step runs as compiled segments with the expert lookups
between them (dsv4/step_segments.py, DSV4_EXPERT_STEP_SEGMENTS), or op by op. A model with
Engram hashes each step's tokens on the host: its step runs as compiled pieces, the layers before
the first Engram layer queued before that sync (dsv4/step_pieces.py, DSV4_ENGRAM_PIECES).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Optional

import mlx.core as mx
import numpy as np

from . import encode_thread, engram_queued, flags, step_pieces, step_segments
from .attention import Rotation, finish_rows
from .cache import Cache
from .constants import keeping, ramp
from .kernels import cuda_cache
from .kernels.dialect import backend
from .kernels.rows import rope_angles
from .kernels.selection import candidates_matter, indexer_can_be_skipped, select_all_visible
from .model import Model

MIN_CAPACITY = 256


def ring_size(window: int, reserve: int, ratios: list[int]) -> int:
    """Rows of the window and compressor-input rings: the window, the trim reserve, and one
    position for the step the async loop runs ahead; a multiple of every compress ratio so
    that a group's inputs sit in consecutive slots."""
    step = math.lcm(*[r for r in ratios if r] or [1])
    return -(-(window + reserve + 1) // step) * step


def pooled_groups(length: int, ratio: int) -> int:
    """Groups of `ratio` positions a step of `length` positions pools, wherever it starts: the
    one holding its first position and every later one its positions can reach."""
    return 1 if length == 1 else (length - 2) // ratio + 2


def capacity_for(rows: int) -> int:
    return max(MIN_CAPACITY, 1 << (rows - 1).bit_length() if rows > 1 else 1)


def use_fixed_decode(model) -> bool:
    on = flags.switch("fixed_decode", backend() is not None and mx.default_device() == mx.gpu)
    # The reference's shared-key quirk depends on which layer published last: not traced here.
    return on and not flags.get("index_key_quirk")


@dataclass
class StepState:
    """What the layers of one fixed-shape step share: positions and the buffers."""
    args: object
    pos: mx.array                 # [1] int32, the position of this step's token
    ring: int
    buffers: dict                 # "layer.name" -> array, replaced as layers write
    regimes: dict                 # index source layer -> "none" | "all" | "score" | "score+candidates"
    completing: frozenset = frozenset()   # layers whose compressor completes a group at this step
    length: int = 1               # positions fed by this step: pos .. pos + length - 1
    topk: Optional[mx.array] = None
    candidates: Optional[mx.array] = None
    angles: dict = field(default_factory=dict)

    def __post_init__(self):
        w, n = self.args.sliding_window, self.length
        self.start = self.pos                      # the rope offset, as in ForwardState
        self.positions = self.pos if n == 1 else self.pos + ramp(n, mx.int32)   # [n]
        self.slot = self.positions % self.ring
        # Each query's positions t-w+1 .. t, oldest first, as ring slots [1, n, w]; -1 before 0.
        u = self.positions.reshape(1, n, 1) - w + 1 + ramp(w, mx.int32, (1, 1, w))
        self.window_idx = mx.where(u >= 0, mx.maximum(u, 0) % self.ring, -1)
        # The projection tails run as kernels (where a GPU has them) with each position's angles.
        self.fused = n == 1 or bool(flags.get("kernel_rows_positions"))

    def write(self, name: str, rows: mx.array, at: mx.array) -> mx.array:
        """Rows [B, n, D] into buffer `name` from row `at` ([1] int32) on, or at the rows `at`
        ([n] int32). A scatter, not a slice_update: MLX's CUDA backend runs a dynamic-offset
        slice_update with a thread per element of the whole buffer (23-34 µs per one-row write
        at decode sizes on the H200), a scatter with one per element written. Either reuses the
        buffer when nothing else holds it (MLX donates its input)."""
        buf = self.buffers[name]
        at = at if rows.shape[1] == at.shape[0] else at + ramp(rows.shape[1])
        index = mx.broadcast_to(at[None, :, None], rows.shape)
        self.buffers[name] = mx.put_along_axis(buf, index, rows.astype(buf.dtype), axis=1)
        return self.buffers[name]

    def rotation(self, freqs: mx.array, offset=None, scale: float = 1.0) -> Rotation:
        """RoPE placement at this step's positions (or from `offset`, an int32 array: the first
        compressed row the step pools, scale its ratio), with the cos/sin of their angles ([R]
        for one position, [S, R] for several); made once per step for each (freqs, placement),
        in one launch. While `fused`, projection tails run as one kernel with those angles."""
        offset = self.pos if offset is None else offset
        if not self.fused:
            return Rotation(offset, freqs, scale)
        key = (id(freqs), id(offset), scale)
        if key not in self.angles:
            # Rows from the step's position: one a position; compressed rows: one a pooled group
            # (pooled_groups of ratio 1 is the step's length too).
            rows = pooled_groups(self.length, round(scale))
            self.angles[key] = rope_angles(offset, freqs, scale, rows)
        return Rotation(offset, freqs, scale, self.angles[key])

    # What `Attention.__call__` asks of its state (see attention.ForwardState), here over the
    # fixed-shape buffers.

    def output_angles(self, attn) -> Optional[tuple[mx.array, mx.array]]:
        """cos/sin of the queries' angles ([R] for one position, [S, R] for several): the
        attention rotates its queries and de-rotates its output with them."""
        return self.rotation(attn._freqs).angles

    def window(self, attn, rows: mx.array) -> tuple[mx.array, mx.array]:
        return self.write(f"{attn.layer}.window", rows, self.slot), self.window_idx

    def compressed(self, layer: int) -> Optional[mx.array]:
        return self.buffers.get(f"{layer}.compressed")

    def compress(self, attn, x: mx.array) -> None:
        layer, r, comp = attn.layer, attn.ratio, attn.compressor
        if r == 1:
            # The norm as the projection tail (one kernel on a GPU: RMSNorm is two launches).
            latents, first = finish_rows(comp.wkv(x), comp.norm, fused=self.fused), self.pos
        else:
            kv, gate = comp.inputs(x)
            kv = self.write(f"{layer}.comp_kv", kv, self.slot)
            gate = self.write(f"{layer}.comp_gate", gate, self.slot)
            if self.length == 1 and layer not in self.completing:
                # The group's row is pooled once, at its last position: until then nobody
                # sees it (rows < (pos + 1) // r are visible, close() keeps those).
                return
            # A step of several positions (a speculative verify) pools every group they touch,
            # complete or not: a row past the visible count stays unseen until its group's last
            # position writes it again, so no trace depends on where the step starts.
            first = self.pos // r
            b, _, d = kv.shape
            groups = pooled_groups(self.length, r)
            if groups == 1:
                take = lambda a: mx.slice(a, (first * r) % self.ring, axes=(1,), slice_size=(b, r, d))
                latents = comp.pool(take(kv), take(gate), x.dtype, keepdims=True)
            else:   # the groups' rows in one gather (they may wrap the ring), pooled at once
                at = (first * r + ramp(groups * r, mx.int32)) % self.ring
                take = lambda a: mx.take(a, at, axis=1).reshape(b, groups, r, d)
                latents = comp.pool(take(kv), take(gate), x.dtype)
        row, keys = attn.compressed_rows(latents, first, self)
        self.write(f"{layer}.compressed", row, first)
        if keys is not None:
            self.write(f"{layer}.index_keys", keys, first)

    def candidates_matter(self, args, layer: int, n: int) -> bool:
        """The regime says (from the visible rows, known on the host; n is the capacity)."""
        return self.regimes[layer] == "score+candidates"

    def select(self, attn, x: mx.array, qr: mx.array) -> Optional[mx.array]:
        regime = self.regimes[attn.layer]
        if regime == "none":
            return None
        if regime == "all":
            return select_all_visible(self.positions, x.shape[0], attn.ratio, self.args.index_topk)
        keys = self.buffers[f"{self.args.kv_source(attn.layer)}.index_keys"]
        return attn.indexer(x, qr, keys, self, attn._freqs, attn.ratio)


class FixedDecoder:
    """Runs decode steps on fixed-shape buffers taken from `cache`; `close(keep)` writes the
    state of the first `keep` positions back into the cache, which holds no arrays until then."""

    def __init__(self, model, cache: Cache):
        a = model.args
        if cache.offset == 0:
            raise ValueError("the fixed-shape decoder continues a prefilled cache (offset 0)")
        self.model, self.cache, self.args = model, cache, a
        self.ratios = cache.ratios
        self.ring = ring_size(a.sliding_window, cache.reserve, self.ratios)
        self.start = self.pos = self.high = cache.offset   # high: past the last position written
        self.batch = cache.tokens.shape[0]
        self.fed: list[mx.array] = []              # tokens fed, [B] each, not yet on the host
        self.host_tokens = cache.tokens            # kept current only when Engram reads on the host
        self._reads: Optional[step_pieces.PendingRows] = None   # the last step's host reads
        self._checks = engram_queued.Checks()      # the queued reads (DSV4_ENGRAM_QUEUED) to check
        dtype = model.activation_dtype
        self.buffers: dict[str, mx.array] = {}
        self.valid_from: dict[str, int] = {}       # first position a ring holds correctly
        for i, lc in enumerate(cache.layers):
            attn = model.layers[i].get("attn")   # a pipeline's stage holds some layers only
            if attn is None:
                continue
            if "wkv" in attn:   # not a layer of an earlier stage that this one replays
                self._ring(f"{i}.window", lc.window, lc.window_start, a.head_dim, dtype)
            if "compressor" in attn and self.ratios[i] > 1:   # ratio 1 pools nothing
                self._ring(f"{i}.comp_kv", lc.comp_kv, lc.comp_start, a.head_dim, mx.float32)
                self._ring(f"{i}.comp_gate", lc.comp_gate, lc.comp_start, a.head_dim, mx.float32)
            if "compressor" in attn:
                rows = self.pos // self.ratios[i] + 1
                self._buffer(f"{i}.compressed", lc.compressed, rows, a.head_dim, dtype)
                if "indexer" in attn and "wk" in attn.indexer:
                    self._buffer(f"{i}.index_keys", lc.index_keys, rows, a.index_head_dim, dtype)
        need = max(0, self.pos - a.sliding_window + 1)
        held = min((v for n, v in self.valid_from.items() if n.endswith(".window")), default=0)
        if held > need:
            raise ValueError(f"the cache holds window rows from position {held}, "
                             f"decoding position {self.pos} needs them from {need}")
        # The cache's arrays now live in the buffers: drop them, so that a long context is not
        # held twice while decoding (close() puts the state back).
        mx.eval(self.buffers)
        for lc in cache.layers:
            for name in lc.FIELDS:
                setattr(lc, name, None)
        cache.checked_out = True
        # What each step's choice of traced graph reads, worked out once.
        self._index_sources = [(layer, self.ratios[layer], a.is_candidate_source(layer))
                               for layer in sorted(a.index_source_layer_ids)
                               if layer < len(self.ratios) and self.ratios[layer]]
        self._pooling = [(i, r) for i, r in enumerate(self.ratios) if r > 1 and f"{i}.comp_kv" in self.buffers]
        self._grow_at = self._next_growth()

    # --- buffers ----------------------------------------------------------------------------

    def _ring(self, name, rows: Optional[mx.array], first: int, width: int, dtype) -> None:
        buf = mx.zeros((self.batch, self.ring, width), dtype)
        lo = first
        if rows is not None and rows.shape[1]:
            lo = max(first, first + rows.shape[1] - self.ring + 1)
            positions = np.arange(lo, first + rows.shape[1])
            buf[:, mx.array(positions % self.ring)] = rows[:, lo - first:].astype(dtype)
        self.buffers[name], self.valid_from[name] = buf, lo

    def _buffer(self, name, rows: Optional[mx.array], needed: int, width: int, dtype) -> None:
        n = 0 if rows is None else rows.shape[1]
        buf = mx.zeros((self.batch, capacity_for(max(needed, n)), width), dtype)
        if n:
            buf[:, :n] = rows.astype(dtype)
        self.buffers[name] = buf

    def _grow(self, length: int = 1) -> None:
        """Double the buffers the coming step of `length` positions would write past."""
        def last(r):   # a position in the last row of ratio r the step writes
            return self.pos + (length - 1 if r == 1 else (pooled_groups(length, r) - 1) * r)

        if max(map(last, filter(None, self.ratios)), default=self.pos) < self._grow_at:
            return
        for name in self._growing_ends():
            r = self.ratios[int(name.split(".")[0])]
            while last(r) >= self.buffers[name].shape[1] * r:
                buf = self.buffers[name]
                grown = mx.zeros((buf.shape[0], capacity_for(buf.shape[1] + 1), buf.shape[2]), buf.dtype)
                grown[:, :buf.shape[1]] = buf
                self.buffers[name] = grown
        self._grow_at = self._next_growth()

    def _growing_ends(self) -> dict:
        """Each compressed-row buffer (they grow) -> the first position whose row falls past it."""
        return {name: buf.shape[1] * self.ratios[int(name.split(".")[0])]
                for name, buf in self.buffers.items() if name.endswith((".compressed", ".index_keys"))}

    def _next_growth(self) -> int:
        return min(self._growing_ends().values(), default=math.inf)

    def _regimes(self, skip: bool, length: int = 1) -> tuple:
        """How each index source selects at this step (known on the host from the position),
        as sorted (layer, regime) pairs; `skip` is the indexer_skip switch. A step of several
        positions takes its last position's regime, which selects what the earlier ones need."""
        a, out = self.args, []
        for layer, ratio, candidate_source in self._index_sources:
            n = (self.pos + length) // ratio
            matter = candidate_source and candidates_matter(a, n)
            if n == 0:
                out.append((layer, "none"))
            elif skip and indexer_can_be_skipped(n, a.index_topk) and not matter:
                out.append((layer, "all"))
            else:
                out.append((layer, "score+candidates" if matter else "score"))
        return tuple(out)

    # --- the step ---------------------------------------------------------------------------

    def _completing(self) -> frozenset:
        """Layers whose compressor (ratio > 1) completes a group at this step."""
        return frozenset(i for i, r in self._pooling if (self.pos + 1) % r == 0)

    def variant(self, length: int = 1) -> tuple:
        """What this step's traced graph depends on besides the switches and the shapes, all
        known on the host: the ring, the index sources' regimes and the completing groups
        (none for several positions: those pool every group they touch)."""
        completing = self._completing() if length == 1 else frozenset()
        return self.ring, self._regimes(flags.get("indexer_skip"), length), completing

    def _function(self, length: int = 1, hidden: bool = False):
        """The step at this position. Traced graphs live on the model (a server's requests
        share them); switches are read while tracing, so their values are part of the key,
        with the index sources' regimes and the completing groups. Picking one is all the
        host work a step adds to running its graph. One position gives the last logits [B, V];
        several (or `hidden`) give every position's [B, n, V] and the draft stages' inputs."""
        switches = flags.snapshot()
        ring, regimes, completing = self.variant(length)
        steps = self.model.__dict__.setdefault("_fixed_steps", {})
        every = length > 1 or hidden
        key = (ring, regimes, completing, switches) + ((length, hidden) if every else ())
        # Streamed experts (dsv4/expert_store.py) bring each layer's routing to the host
        # mid-step: such a model's step runs as compiled segments, or op by op.
        how = step_segments.mode(self.model, self.batch * length)
        # A traced graph's primitives keep the stream it was traced on, and only that stream's
        # thread encodes them (dsv4/encode_thread.py builds steps on its own).
        key += (how, str(mx.default_stream(mx.default_device())))
        if key not in steps:
            model, args = self.model, self.args
            state = lambda pos, buffers: StepState(args, pos, ring, dict(buffers), dict(regimes), completing, length)

            def step(token, pos, engram, buffers):
                s = state(pos, buffers)
                rows = lambda layer: engram[str(layer)]
                inputs = []
                with keeping():   # (a pipeline's stage takes no draft inputs: no `hidden` there)
                    logits = (model.forward(token, s, rows, inputs) if hidden
                              else model.forward(token, s, rows))
                if every:
                    return (logits, inputs), s.buffers
                return logits[:, -1], s.buffers

            steps[key] = step_segments.runner(how, model, step, state, every, hidden)
        return steps[key]

    @cuda_cache.builds_in_parallel("decode")
    def __call__(self, token: mx.array) -> mx.array:
        """Feed token [B] (any integer dtype, e.g. argmax's uint32; may be unevaluated) at the
        next position; -> logits [B, V] fp32."""
        fed = token   # kept as given: an array the encoder thread encodes (dsv4/encode_thread.py)
        token = token.reshape(self.batch, 1)   # the embedding gathers with any index dtype: no cast
        engram = self._engram_rows(token)
        self._grow()
        step = self._function()
        logits, self.buffers = step(token, mx.array([self.pos], mx.int32), engram, self.buffers)
        self._advance([fed.reshape(self.batch)] if fed.ndim != 1 else [fed])
        return logits

    @cuda_cache.builds_in_parallel("decode")
    def feed(self, tokens: mx.array, hidden: bool = False) -> tuple[mx.array, list]:
        """Feed tokens [B, n] at the next n positions in one step (a speculative verify);
        -> (logits [B, n, V] fp32, the draft stages' inputs [B*n, D] per target layer if
        `hidden`, else []). `rewind` takes positions back."""
        n = tokens.shape[1]
        if max(self.high, self.pos + n) - self.pos > self.room:
            raise ValueError(f"a step of {n} positions at {self.pos} would overwrite window rows "
                             f"it reads (ring {self.ring}: at most {self.room} positions past "
                             f"the step's first may have been written)")
        engram = self._engram_rows(tokens)
        self._grow(n)
        step = self._function(n, hidden)
        (logits, inputs), self.buffers = step(tokens, mx.array([self.pos], mx.int32), engram, self.buffers)
        self._advance([tokens[:, i] for i in range(n)])
        return logits, inputs

    @property
    def lazy_steps(self) -> bool:
        """Whether a one-position step evaluates nothing while it is built but through
        dsv4/encode_thread.py (its Engram rows' tokens, its pieces): compiled whole or in pieces,
        not around streamed experts' lookups, its queued Engram reads (if any) on its own stream,
        one process (a pipeline's stage or a tensor-parallel rank exchanges on streams of its
        own). Such a step may be built on arrays that the encoder's thread is still encoding
        (which encodes its own stream's only)."""
        one_process = isinstance(self.model, Model) and self.model.plan.size == 1
        queued = bool(self.args.engram_layer_ids) and engram_queued.applies(self.model)
        return (one_process and step_segments.mode(self.model, self.batch) in ("compiled", "pieces")
                and not (queued and engram_queued.reads_stream_of_their_own()))

    def state(self) -> list:
        """What the steps so far leave besides their outputs: the buffers they wrote (each step's
        writes are read by the next, and by close()). The tokens fed are the loop's own arrays,
        evaluated or queued before they were fed."""
        return list(self.buffers.values())

    @property
    def room(self) -> int:
        """How far past a step's first position the rings may hold written positions while it
        still finds the window (and the groups) it reads: its own and any rewound."""
        return self.ring - max(self.args.sliding_window, *filter(None, self.ratios), 1) + 1

    def rewind(self, n: int) -> None:
        """Take back the last n positions fed (their rows stay in the rings and buffers, unseen,
        until later steps write those positions again)."""
        if not 0 <= n <= self.pos - self.start:
            raise ValueError(f"can rewind 0..{self.pos - self.start} positions, not {n}")
        if self.high - (self.pos - n) > self.room - 1:
            raise ValueError(f"rewinding {n} positions would need window rows the ring "
                             f"({self.ring}) no longer holds")
        if n:
            self._settle_reads()
            self._checks.all()
            self.pos -= n
            del self.fed[len(self.fed) - n:]
            self.host_tokens = self.host_tokens[:, :self.pos]

    def _advance(self, positions: list) -> None:
        """Record the tokens [B] fed at the next positions, one array each."""
        self.fed.extend(positions)
        self.pos += len(positions)
        self.high = max(self.high, self.pos)

    def _engram_rows(self, tokens: mx.array) -> Mapping:
        """The Engram rows of the step feeding tokens [B, n]: read in the step's graph
        (dsv4/engram_queued.py), else on the host when the step first asks for them
        (dsv4/step_pieces.py), the decoder's host tokens growing by them then."""
        if not self.args.engram_layer_ids:
            return {}
        self._settle_reads()
        if engram_queued.applies(self.model):
            width = self.args.engram_max_ngram_size - 1
            recent = self.fed[max(0, len(self.fed) - width):]   # the positions from start on
            before = self.host_tokens[:, max(0, self.start - width + len(recent)):self.start]
            past = mx.concatenate([mx.array(before)] + [t.reshape(self.batch, 1) for t in recent], axis=1)
            reads = engram_queued.QueuedRows(self.model, tokens, past, self.pos)
            self._checks.add(reads)
            return reads
        missing = self.pos - self.host_tokens.shape[1]   # steps whose rows were read in the graph
        if missing:
            recent = mx.stack(self.fed[-missing:], axis=1)
            encode_thread.evaluate(recent)
            self.host_tokens = np.concatenate([self.host_tokens, np.array(recent, dtype=np.int64)], axis=1)

        def fed(ids: np.ndarray) -> None:
            self.host_tokens = np.concatenate([self.host_tokens, ids], axis=1)

        shape = (self.batch, tokens.shape[1], -1, self.args.engram_head_dim)
        self._reads = step_pieces.PendingRows(self.model, tokens, self.host_tokens, self.pos, shape, fed)
        return self._reads

    def _settle_reads(self) -> None:
        """Finish the last step's host reads: its tokens join the host tokens."""
        if self._reads is not None:
            self._reads.resolve()
            self._reads = None

    # --- back to the cache --------------------------------------------------------------------

    def close(self, keep: int) -> None:
        """Write the state of positions < keep (start <= keep <= pos) back into the cache."""
        if not self.start <= keep <= self.pos:
            raise ValueError(f"can keep {self.start}..{self.pos} positions, not {keep}")
        cache = self.cache
        cache.checked_out = False
        for i, lc in enumerate(cache.layers):
            if f"{i}.window" in self.buffers:
                lc.window, lc.window_start = self._unring(f"{i}.window", keep)
            if f"{i}.comp_kv" in self.buffers:
                lc.comp_kv, lc.comp_start = self._unring(f"{i}.comp_kv", keep)
                lc.comp_gate, _ = self._unring(f"{i}.comp_gate", keep)
            if f"{i}.compressed" in self.buffers:
                n = keep // self.ratios[i]
                lc.compressed = self.buffers[f"{i}.compressed"][:, :n] if n else None
                if f"{i}.index_keys" in self.buffers:
                    lc.index_keys = self.buffers[f"{i}.index_keys"][:, :n] if n else None
                    cache.key_publisher = i
        fed = keep - self.start
        if fed:
            new = np.array(mx.stack(self.fed[:fed], axis=1), dtype=np.int64)
            cache.tokens = np.concatenate([cache.tokens, new], axis=1)
        mx.eval([a for lc in cache.layers for a in (lc.window, lc.compressed, lc.index_keys,
                                                   lc.comp_kv, lc.comp_gate) if a is not None])
        self.buffers = {}
        self._checks.all()   # after the cache has its state back: a bad row leaves it usable

    def _unring(self, name: str, keep: int) -> tuple[mx.array, int]:
        """Rows of positions lo..keep-1 held in a ring, oldest first, and lo. The step run
        ahead may have overwritten position keep - ring, so at most ring - 1 are kept, and a
        rewound step the positions below `high` - ring."""
        lo = max(self.valid_from[name], keep - self.ring + 1, self.high - self.ring, 0)
        slots = mx.array(np.arange(lo, keep) % self.ring)
        return self.buffers[name][:, slots], lo


class ReferenceDecoder:
    """The same interface over the reference forward (the token goes to the host first)."""

    def __init__(self, model, cache: Cache):
        self.model, self.cache = model, cache

    def __call__(self, token: mx.array) -> mx.array:
        ids = np.array(token, dtype=np.int64).reshape(-1, 1)
        return self.model(ids, self.cache)[:, -1]

    def close(self, keep: int) -> None:
        self.cache.trim(self.cache.offset - keep)

    lazy_steps = False   # each step brings its token to the host first


def decoder(model, cache: Cache):
    """The decoder the switches ask for (DSV4_FIXED_DECODE)."""
    return FixedDecoder(model, cache) if use_fixed_decode(model) else ReferenceDecoder(model, cache)
