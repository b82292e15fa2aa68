"""What the scheduler asks of a model, answered for a dsv4 model by `ModelEngine`.

The scheduler owns the sessions; an engine owns how their caches are made and stepped:
`new_cache()`, `prefill(cache, tokens)` (one chunk: the scheduler decides how long),
`decode(caches, tokens)` (one token for each session, in one forward), `settle(cache)` (the
cache holds its whole state again: a decoder may keep it in its own buffers meanwhile) and
`snapshot(cache)` (a copy for the prefix cache).
A lone session may decode speculatively (DSV4_DRAFT, dsv4/speculative.py): `draft_window(cache)`
gives it a draft window (None when the model cannot draft), which its prefill chunks seed, and
`speculate(cache, window, token, sampling, limit)` then hands out its tokens one call at a time,
each cycle's verified block at once; settle() ends that as it ends the lone decoder.
Caches are then used through their own methods (offset, copy, trim, max_trim, nbytes, save),
and `load_cache(path)` reads one the disk tier wrote. Tests put a scripted engine in its place.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .. import flags
from ..batch_decode import decode_sessions
from ..batch_step import SessionsDecoder, use_batch_fixed_decode
from ..cache import load_cache
from ..generation import prefill
from ..sampling import Sampling
from ..step import decoder


class ModelEngine:
    def __init__(self, model, tokenizer, fingerprint: str = ""):
        """`fingerprint` names the weights and switches (disk_cache.model_fingerprint): a cache
        on disk is only reused by the model that wrote it."""
        self.model, self.tokenizer, self.fingerprint = model, tokenizer, fingerprint
        self.vocab_size = model.args.vocab_size
        self.context = model.args.max_position_embeddings
        self._alone: Optional[list] = None   # [cache, decoder, positions fed] of a lone session
        self._batch: Optional[tuple] = None  # (caches, dsv4.batch_step.SessionsDecoder) of a batch
        self._drafting: Optional[tuple] = None   # (cache, tokens) of a lone session drafting
        self.draft_stats = None                  # dsv4.speculative.Stats of every session that drafted
        self._constraint_tokenizer = None

    def new_cache(self):
        return self.model.make_cache()

    def snapshot(self, cache):
        """A copy of `cache` for the prefix cache, its arrays evaluated: an entry holds data,
        not a graph (trims leave lazy slices), and any thread may read it."""
        copy = cache.copy()
        mx.eval(list(copy.state().values()))
        return copy

    def prefill(self, cache, tokens: Sequence[int], window=None) -> mx.array:
        """Feed tokens after what `cache` holds (seeding the draft `window` with them); -> the
        last one's logits [V] (fp32)."""
        logits = prefill(self.model, np.array([tokens], np.int64), cache, draft_cache=window)
        return self.model.first_rank_logits(logits)[0]

    def draft_window(self, cache):
        """A draft window for a session continuing `cache`, or None (DSV4_DRAFT off, no stages)."""
        if self.model.draft is None or flags.get("draft") == "off":
            return None
        return self.model.draft.make_cache(cache.offset)

    def speculate(self, cache, window, token: int, sampling: Sampling, limit: int) -> int:
        """The token after `token` (the last one handed out, not yet fed) for a lone session,
        through speculative_tokens' loop (greedy: plain decode's tokens; sampled: its
        distribution), which runs on until settled; `limit` counts `token` and what may follow."""
        if self._drafting is None or self._drafting[0] is not cache:
            from ..speculative import Adaptive, Policy, Stats, drafted_tokens

            self.settle()
            most = min(flags.get("draft_k"), self.model.args.dspark_block_size)
            policy = Adaptive(most) if flags.get("draft") == "auto" else Policy(most)
            self.draft_stats = self.draft_stats or Stats()
            tokens = drafted_tokens(self.model, cache, window, token, sampling, limit, policy, self.draft_stats)
            next(tokens)   # `token` itself
            self._drafting = (cache, tokens)
        return next(self._drafting[1])

    def decode(self, caches: Sequence, tokens) -> mx.array:
        """Feed tokens[i] to caches[i] (ints, or for a lone session that runs ahead a token [1]
        still on the device); -> logits [B, V]. A lone session takes the decoder the
        switches pick (on a GPU the fixed-shape step), several the batched fixed-shape step on a
        GPU (dsv4.batch_step) or one forward of the reference path (dsv4.batch_decode). The
        fixed-shape decoders keep the sessions' state until settled, or until the batch changes.
        The logits are the first rank's too (a pipeline's last stage sends them there)."""
        return self.model.first_rank_logits(self._decode(caches, tokens))

    @property
    def runs_ahead(self) -> bool:
        """Whether a lone session's next step may be queued before its token reaches the host
        (DSV4_ASYNC_DECODE, as generation does): `decode` then takes the token on the device."""
        return flags.get("async_decode")

    def drop_ahead(self, cache) -> None:
        """Settle the lone session of `cache` without the step queued ahead of its last token."""
        if self._alone is not None and self._alone[0] is cache:
            self._alone[2] -= 1
        self.settle(cache)

    def _decode(self, caches: Sequence, tokens) -> mx.array:
        if len(caches) == 1:
            cache = caches[0]
            if self._alone is None or self._alone[0] is not cache:
                self.settle()
                self._alone = [cache, decoder(self.model, cache), cache.offset]
            alone = self._alone
            logits = alone[1](tokens if isinstance(tokens, mx.array) else mx.array(list(tokens)))
            alone[2] += 1
            return logits
        if not use_batch_fixed_decode(self.model):
            self.settle()
            return decode_sessions(self.model, caches, tokens)
        if self._batch is None or len(self._batch[0]) != len(caches) or \
                any(a is not b for a, b in zip(self._batch[0], caches)):
            self.settle()
            self._batch = (list(caches), SessionsDecoder(self.model, caches))
        return self._batch[1](mx.array(list(tokens)))

    def settle(self, cache=None) -> None:
        """Hand the fixed-shape decoders' state back to their caches: only the decoder that
        holds `cache`, when given (a batch's hands back all of its sessions); a drafting
        session's cache drops the positions verified past its last token."""
        if self._alone is not None and (cache is None or self._alone[0] is cache):
            _, step, fed = self._alone
            self._alone = None
            step.close(fed)
        if self._batch is not None and (cache is None or any(c is cache for c in self._batch[0])):
            _, batch = self._batch
            self._batch = None
            batch.close(batch.positions)
        if self._drafting is not None and (cache is None or self._drafting[0] is cache):
            _, tokens = self._drafting
            self._drafting = None
            tokens.close()

    def forget(self) -> None:
        """After a failed step: drop the decoders without writing their state back."""
        self._alone = self._drafting = self._batch = None

    def constraint_tokenizer(self):
        """The tokenizer as llguidance reads it (structured.py), made once (~1 s for V4.1's vocabulary)."""
        if self._constraint_tokenizer is None:
            from llguidance import LLTokenizer

            self._constraint_tokenizer = LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=sorted(self.tokenizer.eos_token_ids))
        return self._constraint_tokenizer

    def load_cache(self, path):
        """-> (cache, metadata) of a file a cache's save() wrote."""
        return load_cache(path, self.model)
