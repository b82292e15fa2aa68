"""Reuse of the model cache across prompts that share a beginning.

A chat turn or a server request usually repeats the previous conversation and adds a
little. `PromptCache` keeps the cache of the last generation and the token ids it holds;
for a new prompt it trims the cache back to the longest common prefix and hands back only
the tokens that still have to be prefilled.

It also keeps a snapshot of the cache as it was right after the last prompt was prefilled
(`Reuse.on_prefilled`, given to stream_generate). A cache can only be trimmed back a bounded
number of tokens, and in thinking mode the next prompt drops the previous answer's
reasoning, so the previous prompt is often the longest reusable prefix: the snapshot keeps
it reachable however long the answer was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class Reuse:
    """What `PromptCache.prepare` decided for one prompt."""
    cache: Any              # the cache to generate with (prompt[:cached] already in it)
    new_tokens: list[int]   # prompt[cached:], what stream_generate must prefill
    cached: int             # prompt tokens taken from the cache
    on_prefilled: Optional[Callable[[Any], None]] = None  # for stream_generate: snapshot the prompt


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    """The cache of the last generation and the ids of the tokens in it."""

    def __init__(self, model, enabled: bool = True):
        self.model = model
        self.enabled = enabled
        self.cache: Optional[Any] = None
        self.tokens: list[int] = []
        self.prompt_cache: Optional[Any] = None   # snapshot after the last prompt's prefill
        self.prompt_tokens: list[int] = []

    def reset(self) -> None:
        self.cache, self.tokens = None, []
        self.prompt_cache, self.prompt_tokens = None, []

    def adopt(self, cache: Any, tokens: list[int]) -> None:
        """Take over a cache built elsewhere (loaded from a file) holding `tokens`."""
        if cache.offset != len(tokens):
            raise ValueError(f"the cache holds {cache.offset} tokens but {len(tokens)} token ids were given")
        self.cache, self.tokens = cache, list(tokens)

    def prepare(self, prompt: list[int]) -> Reuse:
        """The cache and the tokens to prefill for `prompt`. At least one prompt token is
        always left to prefill: generation needs the logits of the last one."""
        if not prompt:
            raise ValueError("the prompt is empty")
        cache, keep = self._best_start(prompt)
        drop = (cache.offset if cache is not None else 0) - keep
        if keep == 0:
            cache = self.model.make_cache()
        elif drop:
            cache.trim(drop)
        self.cache, self.tokens = cache, list(prompt[:keep])
        snapshot = (lambda c: self._remember_prompt(c, prompt)) if self.enabled else None
        return Reuse(cache, list(prompt[keep:]), keep, snapshot)

    def _best_start(self, prompt: list[int]) -> tuple[Optional[Any], int]:
        """The cache to continue from and how many prompt tokens it keeps: the live cache
        or (a copy of) the prompt snapshot, whichever keeps more after a feasible trim."""
        best, best_keep = None, 0
        if not self.enabled:
            return best, best_keep
        for cache, tokens, is_snapshot in ((self.cache, self.tokens, False),
                                           (self.prompt_cache, self.prompt_tokens, True)):
            if cache is None:
                continue
            keep = common_prefix(tokens, prompt[:-1])
            max_trim = getattr(cache, "max_trim", None)
            if keep > best_keep and (max_trim is None or len(tokens) - keep <= max_trim()):
                best, best_keep = (cache.copy() if is_snapshot else cache), keep
        return best, best_keep

    def _remember_prompt(self, cache: Any, prompt: list[int]) -> None:
        if hasattr(cache, "copy"):
            self.prompt_cache, self.prompt_tokens = cache.copy(), list(prompt)

    def record(self, tokens: list[int]) -> None:
        """After a generation: `tokens` is the prompt followed by every token produced; the
        cache holds a prefix of them (the last sampled token was never fed back)."""
        held = self.cache.offset
        if held > len(tokens):
            # Tokens in the cache that nobody can name: unusable for matching.
            self.reset()
        else:
            self.tokens = list(tokens[:held])
