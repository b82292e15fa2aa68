"""How the next token is picked: the sampling options, checked where they enter (the CLIs,
the Python API and the server all call `Sampling.check` and `check_max_tokens`), and the
sampler they make.

The penalties are OpenAI's: each generated token's logit is lowered by
`frequency_penalty * count + presence_penalty * (count > 0)`, counting the tokens this
generation has produced so far (not the prompt's), before temperature and top-p apply;
`logit_bias` adds a fixed value to the logits of the tokens it names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import mlx.core as mx

from .constants import ramp
from .errors import InputError, option_name  # noqa: F401 (the CLIs spell options by it)

PENALTY_RANGE = 2.0      # OpenAI's bounds for presence_penalty and frequency_penalty
LOGIT_BIAS_RANGE = 100.0  # and for the values of logit_bias


def _number(name: str, value, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{name}={value!r}: expected a finite number")
    if value < low or value > high or (low_open and value == low):
        bound = f"{'>' if low_open else '>='} {low:g} and <= {high:g}" if math.isfinite(high) else \
            f"{'>' if low_open else '>='} {low:g}"
        raise InputError(f"{name}={value!r}: expected a number {bound}")
    return float(value)


def check_max_tokens(max_tokens, name: str = "max_tokens") -> int:
    """The number of tokens to generate: an integer >= 1."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InputError(f"{name}={max_tokens!r}: expected an integer >= 1")
    return max_tokens


def check_seed(seed, name: str = "seed") -> Optional[int]:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64):
        raise InputError(f"{name}={seed!r}: expected an integer >= 0")
    return seed


@dataclass(frozen=True)
class Sampling:
    temp: float = 0.0                 # 0: greedy
    top_p: float = 1.0                # nucleus mass, in (0, 1]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)   # token id -> added to its logit

    def check(self, vocab_size: Optional[int] = None, spell: Callable[[str], str] = str) -> "Sampling":
        """Self, or an InputError naming the first option out of range (as `spell` writes the
        option's name: a command line says --top-p where Python says top_p)."""
        _number(spell("temp"), self.temp, 0.0, math.inf)
        _number(spell("top_p"), self.top_p, 0.0, 1.0, low_open=True)
        _number(spell("presence_penalty"), self.presence_penalty, -PENALTY_RANGE, PENALTY_RANGE)
        _number(spell("frequency_penalty"), self.frequency_penalty, -PENALTY_RANGE, PENALTY_RANGE)
        if not isinstance(self.logit_bias, Mapping):
            raise InputError(f"logit_bias={self.logit_bias!r}: expected a map of token ids to numbers")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or \
                    (vocab_size is not None and token >= vocab_size):
                known = f" < {vocab_size}" if vocab_size is not None else ""
                raise InputError(f"logit_bias: token {token!r} is not a token id (expected an integer >= 0{known})")
            _number(f"logit_bias[{token}]", bias, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
        return self

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


class LogitAdjustment:
    """The logit_bias and penalties of one generation, with the counts of what it produced."""

    def __init__(self, sampling: Sampling, vocab: int):
        self.sampling = sampling
        bias = [0.0] * vocab
        for token, value in sampling.logit_bias.items():
            if token < vocab:
                bias[token] = value
        self.bias = mx.array(bias, mx.float32) if sampling.logit_bias else None
        self.counts = mx.zeros((vocab,), mx.float32)

    def __call__(self, logits: mx.array, counts: Optional[mx.array] = None) -> mx.array:
        """logits [..., V] as the sampler sees them, after the tokens counted (or `counts`
        [..., V] in their place)."""
        s = self.sampling
        if self.bias is not None:
            logits = logits + self.bias
        if s.penalized:
            counts = self.counts if counts is None else counts
            logits = logits - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).astype(mx.float32)
        return logits

    def rows(self, logits: mx.array, tokens: mx.array) -> mx.array:
        """logits [n + 1, V] of consecutive positions after the tokens counted, row i also after
        tokens[:i] ([n]): each row as the sampler would see it there."""
        if not self.sampling.penalized:
            return self(logits)
        seen = self._seen(tokens).astype(mx.float32)
        before = mx.concatenate([mx.zeros((1, logits.shape[-1]), mx.float32), mx.cumsum(seen, axis=0)])
        return self(logits, self.counts + before)

    def count(self, tokens: mx.array, first: Optional[mx.array] = None) -> None:
        """Count the tokens [n] the generation produced, or only the first `first` of them (an
        int32 device scalar: no host sync)."""
        if self.sampling.penalized:
            seen = self._seen(tokens.reshape(-1))
            if first is not None:
                seen = seen & (ramp(seen.shape[0]) < first)[:, None]
            self.counts = self.counts + seen.astype(mx.float32).sum(0)

    def _seen(self, tokens: mx.array) -> mx.array:
        """[n, V] bool: row i marks tokens[i]."""
        return ramp(self.counts.shape[0])[None] == tokens[:, None]


def make_sampler(sampling: Sampling = Sampling()) -> Callable[[mx.array], mx.array]:
    """logits [1, V] (fp32) -> token [1]. Called once per generated token, in order: the
    penalties count what it returned before."""
    pick = picker(sampling.temp, sampling.top_p)
    if not sampling.logit_bias and not sampling.penalized:
        return pick
    state: dict = {}

    def sample(logits: mx.array) -> mx.array:
        if not state:
            state["adjust"] = LogitAdjustment(sampling, logits.shape[-1])
        adjust = state["adjust"]
        token = pick(adjust(logits))
        adjust.count(token)
        return token

    return sample


def sampled_logits(logits: mx.array, temp: float, top_p: float) -> mx.array:
    """The logits [..., V] whose softmax the sampler of temp > 0 and top_p draws from: mlx-lm's
    order, top-p on the temperature-1 distribution, then the temperature (the speculative
    sampler's p and q)."""
    from mlx_lm.sample_utils import apply_top_p

    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    return logprobs * (1.0 / temp)


def picker(temp: float, top_p: float) -> Callable[[mx.array], mx.array]:
    """The bare sampler: logits [..., V] (after bias and penalties) -> token [...]."""
    if temp == 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler

    sample = mlx_lm_sampler(temp=temp, top_p=top_p)
    return lambda logits: sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
