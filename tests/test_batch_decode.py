"""decode_sessions: sessions at different positions decoded in one forward give, bit for bit,
the logits and caches of each session decoded alone (the tiny checkpoint has every layer role
and two Engram layers; prompts from 1 token, before any compressed row, to past the window)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4.batch_decode import decode_sessions
from dsv4.generation import prefill

TEXTS = ["def fibonacci(n):", "x", "The quick brown fox jumps over the lazy dog. " * 5, "import os", "ab"]


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return dsv4.load(str(tiny_dir))


def alone(model, prompt, steps):
    """Greedy decode of one session by the plain forward: (tokens, logits of each, cache)."""
    cache = model.make_cache()
    logits = prefill(model, np.array([prompt]), cache)[0]
    tokens, seen = [], []
    for n in range(steps):
        seen.append(np.array(logits))
        tokens.append(int(mx.argmax(logits)))
        if n + 1 < steps:
            logits = model(np.array([[tokens[-1]]]), cache)[0, -1]
    return tokens, seen, cache


def assert_same_cache(a, b):
    assert a.offset == b.offset and np.array_equal(a.tokens, b.tokens)
    for mine, theirs in zip(a.layers, b.layers):
        assert (mine.window_start, mine.comp_start) == (theirs.window_start, theirs.comp_start)
        for name in mine.FIELDS:
            x, y = getattr(mine, name), getattr(theirs, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert x.shape == y.shape and mx.array_equal(x, y).item(), name


def test_sessions_decoded_together_equal_each_alone(loaded):
    model, tokenizer = loaded
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert min(map(len, prompts)) == 1 and max(map(len, prompts)) > model.args.sliding_window
    steps = 24
    # Session i joins at step 3*i and the first leaves early: the batch changes as a server's does.
    joins = [3 * i for i in range(len(prompts))]
    ends = [steps - 10] + [joins[i] + steps for i in range(1, len(prompts))]
    expected = [alone(model, p, end - join) for p, join, end in zip(prompts, joins, ends)]

    caches = [model.make_cache() for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    pending: dict[int, int] = {}   # session -> its token not yet fed
    for step in range(max(ends)):
        for i, join in enumerate(joins):
            if step == join:
                logits = prefill(model, np.array([prompts[i]]), caches[i])[0]
                assert np.array_equal(np.array(logits), expected[i][1][0])
                pending[i] = int(mx.argmax(logits))
                tokens[i].append(pending[i])
        active = [i for i in sorted(pending) if len(tokens[i]) < ends[i] - joins[i]]
        for i in [i for i in pending if i not in active]:
            del pending[i]
        if not active:
            continue
        logits = decode_sessions(model, [caches[i] for i in active], [pending[i] for i in active])
        assert logits.shape == (len(active), model.args.vocab_size)
        for row, i in enumerate(active):
            assert np.array_equal(np.array(logits[row]), expected[i][1][len(tokens[i])]), (i, len(tokens[i]))
            pending[i] = int(mx.argmax(logits[row]))
            tokens[i].append(pending[i])
    for i in range(len(prompts)):
        assert tokens[i] == expected[i][0]
        assert_same_cache(caches[i], expected[i][2])
