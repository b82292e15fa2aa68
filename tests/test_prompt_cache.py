"""PromptCache: reuse across prompts, including the prompt snapshot for answers that cannot
be trimmed away."""

import functools

import numpy as np

import dsv4
from dsv4.generation import stream_generate
from dsv4.model import Model
from dsv4.prompt_cache import PromptCache


def run(model, tok, prompt_cache, prompt, n):
    reuse = prompt_cache.prepare(prompt)
    out = [r.token for r in stream_generate(model, tok, reuse.new_tokens, max_tokens=n, cache=reuse.cache,
                                            on_prefilled=reuse.on_prefilled, ignore_eos=True)]
    prompt_cache.record(prompt + out)
    return reuse.cached, out


def test_next_prompt_reuses_the_snapshot_when_the_answer_cannot_be_trimmed(tiny_dir):
    model, tok = dsv4.load(tiny_dir)
    # A small trim reserve: the 40-token answer is beyond what the live cache can drop.
    model.make_cache = functools.partial(Model.make_cache, model, reserve=4)
    pc = PromptCache(model)
    first = list(np.random.default_rng(0).integers(7, 500, 30))
    run(model, tok, pc, first, 40)
    second = first + list(np.random.default_rng(1).integers(7, 500, 12))  # drops the answer
    cached, out = run(model, tok, pc, second, 10)
    assert cached == len(first)
    fresh = [r.token for r in stream_generate(model, tok, second, max_tokens=10, ignore_eos=True)]
    assert out == fresh


def test_live_cache_still_serves_an_extended_conversation(tiny_dir):
    model, tok = dsv4.load(tiny_dir)
    pc = PromptCache(model)
    first = list(np.random.default_rng(2).integers(7, 500, 20))
    _, answer = run(model, tok, pc, first, 8)
    second = first + answer + list(np.random.default_rng(3).integers(7, 500, 5))
    cached, out = run(model, tok, pc, second, 6)
    assert cached == len(first) + len(answer) - 1   # the last sampled token was never fed back
    fresh = [r.token for r in stream_generate(model, tok, second, max_tokens=6, ignore_eos=True)]
    assert out == fresh
