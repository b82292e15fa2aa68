"""DSpark draft stages: V4.1's own drafter, `mtp.0..` in the checkpoint (model-spec §7).

Each stage is a block like the backbone's (single-pass mHC, RMSNorms, MoE with the draft
expert count and top-k) whose attention sees only a window: the rows of that window are the
backbone's "main KV" of the positions decoded so far, never the drafts. The main KV of
position t is the stage's own `kv_norm(wkv(main_x_t))`, rotated at t and rounded as window KV,
where `main_x_t = main_norm(main_proj(h_t))` and h_t concatenates, over
`dspark_target_layer_ids`, the backbone's streams entering that layer averaged over the
copies (`Model(..., hidden=[])` hands them out).

A draft block continues after position p: its rows sit at positions p+1 .. p+block, the first
holding the token that follows p, the others the noise token; every row attends to all the
window rows and to all the block's rows (not causal). The last stage's collapse x gives the
block's logits through the backbone's (tied) head after `norm`; each row's logits then get
the Markov head's bias of the token before it, so drafts are picked one after another; the
confidence head scores each row from x and that token's Markov embedding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .attention import RMSNorm, Rotation
from .config import ModelArgs
from .constants import derived, ramp
from .linear import Linear, fp8_linear
from .model import Block
from .sampling import LogitAdjustment, Sampling, sampled_logits


def draft_args(args: ModelArgs) -> ModelArgs:
    """The backbone's config with the draft stages' expert count and top-k."""
    return dataclasses.replace(args, n_routed_experts=args.dspark_n_routed_experts or args.n_routed_experts,
                               num_experts_per_tok=args.dspark_num_experts_per_tok or args.num_experts_per_tok)


def _fp32_product(owner: nn.Module, x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight.T in fp32 (the reference keeps these small heads' weights in fp32)."""
    w = derived(owner, "fp32_t", weight, lambda: weight.astype(mx.float32).T)
    return x.astype(mx.float32) @ w


class MarkovHead(nn.Module):
    """A rank-r bigram model: token -> embedding [r] -> logit bias over the vocabulary."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.head = Linear(rank, vocab, bias=False)

    def __call__(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """tokens [...] -> (fp32 logit bias [..., V], embedding [..., r])."""
        e = self.embed(tokens)
        return _fp32_product(self.head, e, self.head["weight"]), e


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = Linear(dim, 1, bias=False)

    def __call__(self, x: mx.array, markov_embed: mx.array) -> mx.array:
        """x [..., D], the Markov embedding of each row's previous token [..., r] -> fp32 [...]."""
        both = mx.concatenate([x, markov_embed.astype(x.dtype)], axis=-1)
        return _fp32_product(self.proj, both, self.proj["weight"])[..., 0]


class DraftStage(Block):
    """mtp.<stage>: a window-only block (ratio 0: model-spec §7), plus main_proj/main_norm on
    the first stage and the final norm, Markov and confidence heads on the last."""

    def __init__(self, args: ModelArgs, stage: int):
        super().__init__(draft_args(args), args.num_hidden_layers + stage)
        d = args.hidden_size
        if stage == 0:
            self.main_proj = Linear(d * len(args.dspark_target_layer_ids), d, bias=False)
            self.main_norm = RMSNorm(d, args.rms_norm_eps)
        if stage == args.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(d, args.rms_norm_eps)
            self.markov_head = MarkovHead(args.vocab_size, args.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(d + args.dspark_markov_rank)


class DraftCache:
    """Each stage's window rows: the main KV of positions end - n .. end - 1 (n <= window)."""

    def __init__(self, stages: int, window: int):
        self.rows: list[Optional[mx.array]] = [None] * stages    # [B, n, Dh] per stage
        self.window = window
        self.end = 0                                             # the next position to seed

    def append(self, stage: int, rows: mx.array) -> None:
        held = rows if self.rows[stage] is None else mx.concatenate([self.rows[stage], rows], axis=1)
        self.rows[stage] = held[:, -self.window:]

    def copy(self) -> "DraftCache":
        """A snapshot, as Cache.copy: later updates of either leave the other as it was."""
        twin = DraftCache(len(self.rows), self.window)
        twin.rows, twin.end = list(self.rows), self.end
        return twin


@dataclass
class DraftState:
    """What a stage's Attention asks of its state (see attention.ForwardState) for rows at
    positions start.. : the window rows are the cache's, followed by these rows."""
    start: int
    cache: DraftCache
    stage_of: dict           # attention layer id -> stage index

    fused = False

    def rotation(self, freqs: mx.array, offset=None, scale: float = 1.0) -> Rotation:
        return Rotation(self.start if offset is None else offset, freqs, scale)

    def output_angles(self, attn) -> None:
        return None

    def window(self, attn, rows: mx.array) -> tuple[mx.array, mx.array]:
        """Every block row sees every window row and every block row: indices [1, S, n]."""
        held = self.cache.rows[self.stage_of[attn.layer]]
        keys = rows if held is None else mx.concatenate([held, rows], axis=1)
        s, n = rows.shape[1], keys.shape[1]
        return keys, mx.broadcast_to(ramp(n, mx.int32, (1, 1, n)), (1, s, n))


class Draft(nn.Module):
    """The draft stages, `mtp` as the checkpoint names them; they use the backbone's embed
    and head (tied), so each call takes the backbone model."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        if not args.has_draft:
            raise ValueError("the config has no DSpark draft stages (num_nextn_predict_layers, dspark_block_size)")
        self.args = args
        self.mtp = [DraftStage(args, s) for s in range(args.num_nextn_predict_layers)]
        self.block_size = args.dspark_block_size

    def make_cache(self, start: int = 0) -> DraftCache:
        """An empty window whose first seeded position is `start` (the backbone cache's offset:
        rows are rotated at their absolute positions, as the reference's ring holds them)."""
        cache = DraftCache(len(self.mtp), self.args.sliding_window)
        cache.end = start
        return cache

    def _state(self, cache: DraftCache, start: int) -> DraftState:
        return DraftState(start, cache, {stage.layer: i for i, stage in enumerate(self.mtp)})

    def targets(self, hidden: list[mx.array], batch: int) -> mx.array:
        """What `Model(..., hidden=[])` filled ([B*S, D] per target layer) -> [B, S, layers*D]."""
        return mx.concatenate(hidden, axis=-1).reshape(batch, -1, len(hidden) * self.args.hidden_size)

    def main_kv(self, h: mx.array, state) -> list[mx.array]:
        """Each stage's window rows [B, S, Dh] of the positions `state` places (from its start
        on), given their target layers' hidden means h [B, S, layers*D]."""
        first = self.mtp[0]
        main_x = first.main_norm(fp8_linear(first.main_proj, h))
        return [stage.attn.window_rows(fp8_linear(stage.attn.wkv, main_x), state) for stage in self.mtp]

    def seed(self, cache: DraftCache, hidden: list[mx.array], batch: int) -> None:
        """Add the main KV of the positions the backbone just ran, from what `Model(...,
        hidden=[])` filled ([B*S, D] per target layer); positions follow cache.end."""
        h = self.targets(hidden, batch)
        s = h.shape[1]
        keep = min(s, cache.window)   # older rows would leave the window at once
        rows = self.main_kv(h[:, s - keep:], self._state(cache, cache.end + s - keep))
        for i, stage_rows in enumerate(rows):
            cache.append(i, stage_rows)
        cache.end += s

    def hidden(self, model, cache: DraftCache, token: mx.array) -> mx.array:
        """The last stage's collapse x [B, block, D] of the block after cache.end - 1 whose
        first row holds token [B] (the others the noise token)."""
        return self.block(model, self._state(cache, cache.end), token)

    def block(self, model, state, token: mx.array) -> mx.array:
        """`hidden` over any state that answers a stage's Attention for the block's rows (this
        module's DraftState, or dsv4/draft_step.py's at fixed shapes)."""
        b, k, hc, d = token.shape[0], self.block_size, self.args.hc_mult, self.args.hidden_size
        noise = mx.full((b, k - 1), self.args.dspark_noise_token_id, token.dtype)
        h = model.embed(mx.concatenate([token.reshape(b, 1), noise], axis=1))
        streams = mx.broadcast_to(h.reshape(b * k, 1, d), (b * k, hc, d))
        pre = mx.array(np.eye(1, hc, dtype=np.float32).repeat(b * k, axis=0))
        for stage in self.mtp:
            streams, pre = stage(streams, pre, state, (b, k))
        collapsed = mx.sum(pre[..., None] * streams.astype(mx.float32), axis=1).astype(streams.dtype)
        return collapsed.reshape(b, k, d)

    def logits(self, model, x: mx.array) -> mx.array:
        """fp32 logits [B, block, V] of the block's rows before the Markov bias."""
        return model.logits(self.mtp[-1].norm(x))

    def markov(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """The Markov head of each row's previous token: (bias [..., V] fp32, embedding [..., r])."""
        return self.mtp[-1].markov_head(tokens)

    def confidence(self, x: mx.array, markov_embed: mx.array) -> mx.array:
        """fp32 [B, n] scores of the block's first n rows given their Markov embeddings [B, n, r]."""
        n = markov_embed.shape[1]
        return self.mtp[-1].confidence_head(x[:, :n], markov_embed)


@dataclass
class Proposal:
    drafts: mx.array                  # [k] int32
    q_logits: Optional[mx.array]      # [k, V]: softmax is each draft's distribution (sampling)
    confidence: mx.array              # [k] fp32: the confidence head's score of each row


def pick_drafts(model, x: mx.array, token: mx.array, k: int, adjust: LogitAdjustment,
                counts: mx.array, sampling: Sampling) -> Proposal:
    """k drafts from the block's collapse x [1, block, D] after token [1] (int32): each row's
    logits plus the Markov bias of the token before it, through the target's logit bias,
    penalties (`counts` [V] in place of the generation's, each draft counted for the next),
    temperature and top-p (q); greedy picks the argmax, sampling draws from q."""
    draft = model.draft
    base = draft.logits(model, x)[0]                               # [block, V]
    prev, vocab = token, base.shape[-1]
    drafts, embeds, q_logits = [], [], []
    for row in range(k):
        bias, embed = draft.markov(prev)                           # [1, V], [1, r]
        logits = adjust(base[row] + bias[0], counts)
        if sampling.temp == 0:
            prev = mx.argmax(logits, axis=-1, keepdims=True).astype(mx.int32)
        else:
            q_logits.append(sampled_logits(logits, sampling.temp, sampling.top_p))
            prev = mx.random.categorical(q_logits[-1])[None].astype(mx.int32)
        if sampling.penalized:
            counts = counts + (ramp(vocab) == prev).astype(mx.float32)
        drafts.append(prev)
        embeds.append(embed)
    confidence = draft.confidence(x, mx.stack(embeds, axis=1))[0]
    return Proposal(mx.concatenate(drafts), mx.stack(q_logits) if q_logits else None, confidence)
