"""Structured output: a response format (json_schema, json_object) enforced while sampling.

The schema becomes a grammar through llguidance (what ds4-server and vLLM use), compiled when the
request arrives, so a schema it cannot take is a 400 naming the parameter. Measured at V4.1's
vocabulary (benchmarks/results/2026-12-01-2302-structured-output.md): llguidance compiles a
schema in ~0.03 s and its mask costs ~80 us a token, and all 40 sampled outputs validated;
outlines-core's mask is faster (~35 us) but it took 6-13 s to compile each schema and 34 of 40
outputs broke the schema (it does not bound integers). xgrammar needs torch. Each step, the scheduler asks the session's constraint for the tokens the grammar
allows next and sets every other logit to -inf before sampling, then tells it the token sampled.
In thinking mode the constraint waits for `</think>`: the reasoning is free, the answer obeys.
The JSON is written as json.dumps writes it (", " and ": ", no other whitespace), which leaves a
model fewer ways to wander.
"""

from __future__ import annotations

import json
from typing import Optional

import mlx.core as mx
import numpy as np

from ..encoding import THINK_CLOSE
from .errors import RequestError

# How the grammar spells JSON: as json.dumps does.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Constraint:
    """One generation's grammar state."""

    def __init__(self, matcher, vocab_size: int, wait_for: Optional[int] = None):
        """wait_for: a token id before which nothing is constrained (thinking mode's `</think>`)."""
        self.matcher, self.vocab_size, self.wait_for = matcher, vocab_size, wait_for

    def mask(self, logits: mx.array) -> mx.array:
        """logits [1, V] with the tokens the grammar forbids next at -inf."""
        if self.wait_for is not None:
            return logits
        words = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(words, bitorder="little")[:self.vocab_size].astype(bool)
        return mx.where(mx.array(allowed), logits, -mx.inf)

    def advance(self, token: int) -> None:
        if self.wait_for is not None:
            if token == self.wait_for:
                self.wait_for = None
            return
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")


def schema_of(response_format: dict) -> dict:
    if response_format["type"] == "json_object":
        return {"type": "object"}
    return response_format["json_schema"]["schema"]


def constraint_for(prompt, service, param: str):
    """A factory of constraints for the prompt's response format or tool choice (None when
    neither asks for one), or a 400 naming the parameter whose grammar cannot be enforced. A
    response format goes with tools only under tool_choice none: its grammar forbids every call."""
    from .tool_choice import NO_CALLS_GRAMMAR, calls_grammar, required_functions

    choice, response_format = prompt.tool_choice, prompt.response_format
    if response_format is not None:
        if prompt.tools and choice.mode != "none":
            raise RequestError(f"{param} cannot be combined with tools (unless tool_choice is none)", param=param)
        return grammar_constraint(prompt, service, param, json_schema=schema_of(response_format))
    functions = required_functions(choice, prompt.tools)
    if functions is not None:
        return grammar_constraint(prompt, service, choice.param, lark=calls_grammar(functions, choice.parallel))
    if choice.mode == "none" and prompt.tools:
        return grammar_constraint(prompt, service, choice.param, lark=NO_CALLS_GRAMMAR)
    return None


def grammar_constraint(prompt, service, param: str, json_schema: Optional[dict] = None,
                       lark: Optional[str] = None):
    """A factory of constraints for a JSON schema or a lark grammar, checked against the
    model's vocabulary now (a 400 naming `param` if it cannot be enforced)."""
    from llguidance import LLMatcher

    engine = service.scheduler.engine
    tokenizer = engine.constraint_tokenizer()
    try:
        grammar = (LLMatcher.grammar_from_json_schema(json.dumps(json_schema), defaults=JSON_STYLE)
                   if lark is None else LLMatcher.grammar_from_lark(lark))
    except ValueError as error:
        raise RequestError(f"{param}: not a {'JSON schema' if lark is None else 'grammar'} ({error})",
                           param=param) from None
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if failed:
        raise RequestError(f"{param}: cannot be enforced: {messages[0]}", param=param)
    wait = service.scheduler.tokenizer.token_to_id(THINK_CLOSE) if prompt.mode == "thinking" else None
    return lambda: Constraint(LLMatcher(tokenizer, grammar), engine.vocab_size, wait)
