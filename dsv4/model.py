"""DeepSeek V4.1 Flash: embed -> 4 residual streams -> blocks -> collapse -> norm -> head.

`model(input_ids [B, S], cache)` returns fp32 logits [B, S, vocab] and advances the
cache by S positions (any S: prefill chunks, single-token decode, draft verification).
Parameter names are the official checkpoint's (see dsv4.layout).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import distributed, flags, profiler
from .attention import Attention, ForwardState, RMSNorm, prefill_row_kernels, window_indices
from .cache import Cache
from .config import ModelArgs
from .engram import Engram, NgramHasher
from .linear import Linear
from .kernels import cuda_cache, head as head_kernel
from .kernels.dialect import backend
from .kernels.mhc import Projection, hc_collapse_norm, hc_expand, hc_mixes_collapse_norm, wide_entry
from .moe import MoE


AUTO_EVAL_MIN_TOKENS = 16   # prefill_eval_layers auto: prompt chunks, not steps of <= 8 positions


def layer_evaluation(state, lead: tuple[int, int]) -> Optional[Callable]:
    """How a prefill chunk's layers are evaluated one by one (flag `prefill_eval_layers`:
    mx.async_eval or mx.eval after each layer), or None: the chunk's graph evaluated whole,
    as a decode step's always is (its fixed-shape state is traced, not evaluated). auto: async
    under CUDA for chunks of AUTO_EVAL_MIN_TOKENS positions or more (a batch of decode steps
    or a draft's verification stays one graph)."""
    how = flags.get("prefill_eval_layers")
    if how == "auto":
        how = "async" if backend() == "cuda" and lead[1] >= AUTO_EVAL_MIN_TOKENS else "off"
    if how == "off" or not isinstance(state, ForwardState) or lead[0] * lead[1] == 1:
        return None
    return mx.async_eval if how == "async" else mx.eval


def projects_ahead(block, streams: mx.array) -> bool:
    """Whether the block before `block` makes its attention site's entry partials in its MoE's
    expand (flag `kernel_moe_next_projection`): the wide entry's few tokens, and no Engram
    between them (it changes the streams that enter the site)."""
    return (bool(flags.get("kernel_moe_next_projection")) and "engram" not in block
            and wide_entry(streams))


class Block(nn.Module):
    """(Engram) -> attention site -> MoE site, with single-pass mHC (model-spec 2.1)."""

    def __init__(self, args: ModelArgs, layer: int, plan: distributed.Plan = distributed.SINGLE):
        super().__init__()
        self.args = args
        self.layer = layer
        mix = (2 + args.hc_mult) * args.hc_mult
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", mx.zeros((mix, args.hc_mult * args.hidden_size), mx.float32))
            setattr(self, f"hc_{site}_base", mx.zeros((mix,), mx.float32))
            setattr(self, f"hc_{site}_scale", mx.ones((3,), mx.float32))
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer, plan)
        self.ffn = MoE(args, plan)
        if layer in args.engram_layer_ids:
            self.engram = Engram(args)

    def __call__(self, streams: mx.array, pre: mx.array, state: ForwardState,
                 lead: tuple[int, int]) -> tuple[mx.array, mx.array]:
        """streams [B*S, hc, D] (tokens flat: the kernels' and the MoE's layout), pre the
        previous site's [B*S, hc], lead = (B, S) -> the new streams and this block's pre."""
        return self.run(streams, pre, state, lead)[:2]

    def run(self, streams: mx.array, pre: mx.array, state: ForwardState, lead: tuple[int, int],
            projection: Optional[Projection] = None, next_fn: Optional[mx.array] = None) -> tuple:
        """`__call__` -> (streams, pre, the next site's projection or None). `projection`: what
        the block before made of these streams for this block's attention site; `next_fn`: the
        next block's attention fn, whose projection the MoE's expand then makes too."""
        x, expand, pre = self.ffn_input(streams, pre, state, lead, projection)
        if next_fn is None:
            return profiler.mark("moe", self.ffn(x, expand=expand)), pre, None
        streams, projection = self.ffn(x, expand=expand + (next_fn, pre))
        return profiler.mark("moe", streams), pre, projection

    def ffn_input(self, streams: mx.array, pre: mx.array, state: ForwardState,
                  lead: tuple[int, int], projection: Optional[Projection] = None) -> tuple[mx.array, tuple, mx.array]:
        """The block up to its MoE: -> (the MoE's input x [B*S, D], expand = (streams, post,
        comb) of the FFN site, this block's pre)."""
        a = self.args
        mixes = (a.rms_norm_eps, a.hc_eps, a.hc_sinkhorn_iters)
        # Each site's input (collapse with the previous site's pre, RMSNorm) and its own mixes;
        # the attention takes x as [B, S, D] (written so by the kernel, no reshape).
        # With act_quant the same launch also rounds x to fp8 for wq_a and wkv.
        x, *x_fp8, a_pre, a_post, a_comb = hc_mixes_collapse_norm(
            streams, pre, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base,
            self.attn_norm.weight, self.attn_norm.eps, *mixes, x_shape=(*lead, streams.shape[-1]),
            fp8_copy=bool(flags.get("act_quant")), projection=projection)
        x = profiler.mark("attention", self.attn(x, state, *x_fp8))
        # The expand also projects the new streams for the FFN site's mixes (kernel path).
        streams, projection = hc_expand(x, streams, a_post, a_comb, self.hc_ffn_fn, a_pre)
        streams = profiler.mark("mhc", streams)
        x, f_pre, f_post, f_comb = hc_mixes_collapse_norm(
            streams, a_pre, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base,
            self.ffn_norm.weight, self.ffn_norm.eps, *mixes, projection=projection)
        return x, (streams, f_post, f_comb), f_pre


class Model(nn.Module):
    def __init__(self, args: ModelArgs, plan: distributed.Plan = distributed.SINGLE):
        """`plan` (dsv4.distributed): this rank's share of each layer; one process: all of it."""
        super().__init__()
        self.args = args
        self.plan = plan
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Block(args, i, plan) for i in range(args.num_hidden_layers)]
        # Layers of one RoPE frequency set share one array: a decode step computes the angles
        # of its position once per set (dsv4/step.py keys them by array).
        shared = {}
        for block in self.layers:
            block.attn._freqs = shared.setdefault(bool(block.attn.ratio), block.attn._freqs)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = Linear(args.hidden_size, args.vocab_size, bias=False)
        # Set by the loader: Engram tables by layer id and the n-gram hasher.
        self._engram_tables: dict[int, object] = {}
        self._hasher: Optional[NgramHasher] = None
        # Set by the loader where the checkpoint has them: the DSpark draft stages (dsv4.draft).
        self.draft = None

    def set_engram(self, hasher: NgramHasher, tables: dict[int, object],
                   layers: Optional[tuple[int, ...]] = None) -> None:
        """`layers`: the Engram layers this model runs (default all; a pipeline stage its own)."""
        needed = self.args.engram_layer_ids if layers is None else layers
        missing = [l for l in needed if l not in tables]
        if missing:
            raise ValueError(f"no Engram table for layer(s) {missing}")
        for layer, table in tables.items():
            if table.rows != hasher.table_rows[layer]:
                raise ValueError(f"Engram table {table.name} has {table.rows} rows, the hashing "
                                 f"addresses {hasher.table_rows[layer]}")
        self._hasher, self._engram_tables = hasher, dict(tables)

    def make_cache(self, reserve: int = 256) -> Cache:
        ratios = self.args.compress_ratios[: self.args.num_hidden_layers]
        return Cache(list(ratios), self.args.sliding_window, reserve)

    def start_engram_reads(self, ids: np.ndarray, past: np.ndarray, offset: int) -> dict[int, object]:
        """Hash the new tokens ids [B, S] (after the tokens `past` [B, >= 0], the last of
        which sits at position offset - 1) and start every Engram table's reads; returns
        the requests by layer."""
        if not self.args.engram_layer_ids:
            return {}
        if self._hasher is None:
            raise RuntimeError("the model has Engram layers but no tables: load it with dsv4.load")
        rows = self._hasher.row_ids(ids, past, offset)
        return {layer: table.start(rows[layer]) for layer, table in self._engram_tables.items()}

    @cuda_cache.builds_in_parallel("forward")
    def __call__(self, input_ids, cache: Optional[Cache] = None,
                 hidden: Optional[list] = None, last: bool = False) -> mx.array:
        """fp32 logits [B, S, V] of input_ids [B, S] after what `cache` holds ([B, 1, V] of the
        last position only with `last`: a prefill's); with a list `hidden`, also the draft
        stages' inputs (see `forward`)."""
        return self.feed(input_ids, cache, lambda ids, state, rows: self.forward(ids, state, rows, hidden, last))

    def feed(self, input_ids, cache: Optional[Cache], forward: Callable) -> mx.array:
        """`forward(ids, state, engram_rows)` (this model's, or a pipeline stage's) over input_ids
        after what `cache` holds (a new cache if None): the ids checked, the forward state and the
        Engram reads made, the ids appended to the cache's tokens."""
        ids = self.checked_ids(input_ids)
        cache = cache if cache is not None else self.make_cache()
        b, s = ids.shape
        state = self.forward_state(cache, ids)
        requests = self.start_engram_reads(ids, cache.tokens, cache.offset)
        rows = lambda layer: requests[layer].wait().reshape(b, s, -1, self.args.engram_head_dim)
        logits = forward(mx.array(ids), state, rows)
        cache.tokens = np.concatenate([cache.tokens, ids], axis=1)
        return logits

    @property
    def activation_dtype(self) -> mx.Dtype:
        """The streams' dtype: the embedding's."""
        return self.embed.weight.dtype

    def shared_sampler(self, sampler):
        """The sampler as generation runs it: here as is; a pipeline's ranks also share the
        last stage's token with it (dsv4.distributed.pipeline.Pipelined)."""
        return sampler

    def first_rank_logits(self, logits: mx.array) -> mx.array:
        """The logits as rank 0 has them (the server samples there): here as they are; a
        pipeline's last stage sends them to its first (dsv4.distributed.pipeline.Pipelined)."""
        return logits

    def checked_ids(self, input_ids) -> np.ndarray:
        """input_ids as int64 [B, S], or a ValueError naming the first id outside the vocabulary."""
        ids = np.asarray(input_ids, dtype=np.int64)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {ids.shape}")
        bad = (ids < 0) | (ids >= self.args.vocab_size)
        if bad.any():
            pos = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"token id {int(ids[pos])} at position {pos} is outside the "
                             f"vocabulary [0, {self.args.vocab_size})")
        return ids

    def forward_state(self, cache: Cache, ids: np.ndarray) -> ForwardState:
        """The reference path's state for feeding ids [B, S] after what `cache` holds (the
        cache's token ids are not advanced here: the caller appends ids after the forward)."""
        cache.require_state()
        if cache.offset and cache.tokens.shape[0] != ids.shape[0]:
            raise ValueError(f"batch {ids.shape[0]} does not match the cache's {cache.tokens.shape[0]}")
        b, s = ids.shape
        if cache.offset == 0:
            cache.tokens = np.zeros((b, 0), np.int64)
        start = cache.offset
        # Every layer's window holds the same positions, so one set of indices serves all.
        window = window_indices(start, s, cache[0].window_start, self.args.sliding_window)[None]
        return ForwardState(start=start, length=s, cache=cache, window_idx=window,
                            positions=mx.arange(start, start + s, dtype=mx.int32), fused=prefill_row_kernels(s))

    def forward(self, ids: mx.array, state, engram_rows: Callable[[int], mx.array],
                hidden: Optional[list] = None, last: bool = False) -> mx.array:
        """The layers over ids [B, S] with a state that knows the cache (ForwardState or the
        fixed-shape step's); `engram_rows(layer)` gives the table rows [B, S, heads, dim]
        (called when that layer is reached, so reads overlap the earlier layers). A list
        `hidden` gets, for each of `dspark_target_layer_ids` in layer order, the streams
        entering that layer averaged over the copies, [B*S, D] (the draft stages' input).
        `last`: the logits of the last position only."""
        lead = ids.shape
        streams, pre = self.embed_streams(ids)
        streams, pre = self.run_layers(self.layers, streams, pre, state, lead, engram_rows, hidden)
        return self.finish(streams, pre, lead, last)

    # The three parts of `forward`, apart for a pipeline (dsv4.distributed.pipeline) whose
    # stages each run some of them.

    def embed_streams(self, ids: mx.array) -> tuple[mx.array, mx.array]:
        """ids [B, S] -> (streams [B*S, hc, D], the first site's pre [B*S, hc] fp32)."""
        b, s = ids.shape
        hc, d = self.args.hc_mult, self.args.hidden_size
        h = profiler.mark("embed", self.embed(ids))
        # Streams travel with their tokens flat, [B*S, hc, D]; pre starts as copy 0 (host data:
        # a constant to the compiled step).
        streams = mx.broadcast_to(h.reshape(b * s, 1, d), (b * s, hc, d))
        pre = mx.array(np.eye(1, hc, dtype=np.float32).repeat(b * s, axis=0))
        return streams, pre

    def run_layers(self, blocks, streams: mx.array, pre: mx.array, state, lead: tuple[int, int],
                   engram_rows: Callable[[int], mx.array], hidden: Optional[list] = None):
        """`blocks` (consecutive layers) over streams and pre (as `embed_streams` gives them)
        -> the streams and pre after the last of them; see `forward` for the rest."""
        evaluate = layer_evaluation(state, lead)
        projection = None
        for i, block in enumerate(blocks):
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            next_fn = after.hc_attn_fn if after is not None and projects_ahead(after, streams) else None
            streams, pre, projection = block.run(self.layer_input(block, streams, lead, engram_rows, hidden),
                                                 pre, state, lead, projection, next_fn)
            if evaluate is not None:
                evaluate(streams, pre)
        return streams, pre

    def run_to_moe(self, blocks, streams: mx.array, pre: mx.array, state, lead: tuple[int, int],
                   engram_rows: Callable[[int], mx.array], hidden: Optional[list] = None):
        """`run_layers` over `blocks` but the last, which stops at its MoE's input: -> (x,
        expand, pre) as Block.ffn_input gives them. A streamed MoE needs its routing on the
        host: a compiled decode step ends a graph there (dsv4/step_segments.py)."""
        streams, pre = self.run_layers(blocks[:-1], streams, pre, state, lead, engram_rows, hidden)
        block = blocks[-1]
        return block.ffn_input(self.layer_input(block, streams, lead, engram_rows, hidden), pre, state, lead)

    def layer_input(self, block, streams: mx.array, lead: tuple[int, int],
                    engram_rows: Callable[[int], mx.array], hidden: Optional[list]) -> mx.array:
        """The streams entering `block`: through its Engram where it has one; the draft stages'
        input recorded where it is a target layer."""
        b, s = lead
        hc, d = self.args.hc_mult, self.args.hidden_size
        if "engram" in block:
            rows = engram_rows(block.layer)
            streams = profiler.mark("engram", block.engram(streams.reshape(b, s, hc, d), rows))
            streams = streams.reshape(b * s, hc, d)
        if hidden is not None and block.layer in self.args.dspark_target_layer_ids:
            hidden.append(mx.mean(streams.astype(mx.float32), axis=1).astype(streams.dtype))
        return streams

    def finish(self, streams: mx.array, pre: mx.array, lead: tuple[int, int], last: bool = False) -> mx.array:
        """The last layer's streams and pre -> fp32 logits [B, S, V] ([B, 1, V] of the last
        position with `last`: a prefill chunk skips the head's product for every other row)."""
        if last:
            b, s = lead
            streams, pre = streams.reshape(b, s, *streams.shape[1:])[:, -1], pre.reshape(b, s, -1)[:, -1]
            lead = (b, 1)
        x = hc_collapse_norm(streams, pre, self.norm.weight, self.norm.eps, (*lead, self.args.hidden_size))
        return profiler.mark("head", self.logits(x))

    def logits(self, x: mx.array) -> mx.array:
        """fp32 logits of the normed x; the head may be plain bf16 (official) or quantized
        (GGUF Q8_0, EXL3). A few tokens through a bf16 head take the one-pass kernel."""
        head = self.head
        if (isinstance(head, nn.Linear) and "bias" not in head
                and head_kernel.kernel_applies(x, head.weight)):
            return head_kernel.head_logits(x, head.weight)
        return head(x.astype(mx.float32)).astype(mx.float32)
