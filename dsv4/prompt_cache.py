"""Reuse of the model cache across prompts that share a beginning.

A chat turn or a server request usually repeats the previous conversation and adds a
little. `PromptCache` keeps the cache of the last generation and the token ids it holds;
for a new prompt it trims the cache back to the longest common prefix and hands back only
the tokens that still have to be prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class Reuse:
    """What `PromptCache.prepare` decided for one prompt."""
    cache: Any              # the cache to generate with (prompt[:cached] already in it)
    new_tokens: list[int]   # prompt[cached:], what stream_generate must prefill
    cached: int             # prompt tokens taken from the cache


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

    def reset(self) -> None:
        self.cache, self.tokens = None, []

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
        keep = common_prefix(self.tokens, prompt[:-1]) if self.enabled and self.cache is not None else 0
        drop = len(self.tokens) - keep
        max_trim = getattr(self.cache, "max_trim", None)
        if keep == 0 or (max_trim is not None and drop > max_trim()):
            self.cache, keep = self.model.make_cache(), 0
        elif drop:
            self.cache.trim(drop)
        self.tokens = list(prompt[:keep])
        return Reuse(self.cache, list(prompt[keep:]), keep)

    def record(self, tokens: list[int]) -> None:
        """After a generation: `tokens` is the prompt followed by every token produced; the
        cache holds a prefix of them (the last sampled token was never fed back)."""
        held = self.cache.offset
        if held > len(tokens):
            # Tokens in the cache that nobody can name: unusable for matching.
            self.reset()
        else:
            self.tokens = list(tokens[:held])
