"""dsv4.sampling: every option checked where it enters, and the penalties and logit bias
against a numpy transcription of OpenAI's formula."""

import math

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4.errors import InputError
from dsv4.generation import stream_generate
from dsv4.sampling import Sampling, check_max_tokens, check_seed, make_sampler, option_name


@pytest.mark.parametrize("options,named", [
    (dict(temp=-0.1), "temp"), (dict(temp=math.nan), "temp"), (dict(temp=math.inf), "temp"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=-1.0), "top_p"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias[5]"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"7": 1.0}), "logit_bias"), (dict(temp=True), "temp"),
])
def test_out_of_range_options_name_themselves(options, named):
    with pytest.raises(InputError, match=r"^" + named.replace("[", r"\[")):
        Sampling(**options).check(vocab_size=100)
    spelled = option_name(named) if "[" not in named and named != "logit_bias" else named
    with pytest.raises(InputError, match=r"^" + spelled.replace("[", r"\[")):
        Sampling(**options).check(vocab_size=100, spell=option_name)


def test_edges_that_are_allowed():
    Sampling(temp=0.0, top_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
             logit_bias={0: -100.0, 99: 100.0}).check(vocab_size=100)
    assert check_max_tokens(1) == 1 and check_seed(0) == 0 and check_seed(None) is None
    with pytest.raises(InputError, match="logit_bias: token 100"):
        Sampling(logit_bias={100: 1.0}).check(vocab_size=100)
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(InputError, match="max_tokens"):
            check_max_tokens(bad)
    with pytest.raises(InputError, match="seed"):
        check_seed(-5)


def penalized_greedy_oracle(logits: np.ndarray, steps: int, presence: float, frequency: float,
                            bias: dict) -> list[int]:
    """OpenAI's formula in float64: mu[j] - c[j] * frequency - (c[j] > 0) * presence + bias[j]."""
    counts = np.zeros(logits.shape[-1])
    picked = []
    for _ in range(steps):
        mu = logits.astype(np.float64) - counts * frequency - (counts > 0) * presence
        for token, value in bias.items():
            mu[token] += value
        picked.append(int(np.argmax(mu)))
        counts[picked[-1]] += 1
    return picked


@pytest.mark.parametrize("presence,frequency,bias", [
    (0.0, 0.7, {}), (1.3, 0.0, {}), (0.4, 0.25, {3: 1.5}), (0.0, 0.0, {11: 2.0, 2: -100.0}),
    (-0.5, 0.3, {}),
])
def test_penalties_and_bias_follow_the_formula(presence, frequency, bias):
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(1, 16)).astype(np.float32) * 1.5
    sample = make_sampler(Sampling(0.0, 1.0, presence, frequency, bias))
    got = [int(sample(mx.array(logits)).item()) for _ in range(24)]
    want = penalized_greedy_oracle(logits[0], 24, presence, frequency, bias)
    assert got == want
    if presence or frequency:  # the test means something: the penalties change the picks
        assert len(set(got)) > 1


def test_logit_bias_bans_and_forces_tokens_when_sampling():
    logits = mx.array(np.linspace(0, 3, 12, dtype=np.float32)[None])
    mx.random.seed(1)
    banned = make_sampler(Sampling(temp=1.0, logit_bias={11: -100.0, 10: -100.0}))
    forced = make_sampler(Sampling(temp=1.0, logit_bias={4: 100.0}))
    draws = [int(banned(logits).item()) for _ in range(300)]
    assert 11 not in draws and 10 not in draws and len(set(draws)) > 3
    assert {int(forced(logits).item()) for _ in range(50)} == {4}


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return dsv4.load(tiny_dir)


@pytest.mark.parametrize("options", [dict(max_tokens=0), dict(max_tokens=-3), dict(top_p=0.0),
                                     dict(temp=-1.0), dict(seed=-1), dict(logit_bias={10 ** 9: 1.0})])
def test_stream_generate_refuses_before_any_work(tiny, options):
    model, tok = tiny
    cache = model.make_cache()
    with pytest.raises(InputError):
        next(stream_generate(model, tok, [5, 6, 7], cache=cache, **options))
    assert cache.offset == 0   # nothing was prefilled


def test_generation_stops_at_the_context_and_longer_prompts_are_refused(tiny):
    model, tok = tiny
    context = model.args.max_position_embeddings
    try:
        model.args.max_position_embeddings = 10
        with pytest.raises(InputError, match="context is 10 tokens"):
            next(stream_generate(model, tok, list(range(3, 13))))
        out = list(stream_generate(model, tok, list(range(3, 10)), max_tokens=50, ignore_eos=True))
        assert len(out) == 3 and out[-1].finish_reason == "length"
        cache = model.make_cache()
        list(stream_generate(model, tok, list(range(3, 8)), max_tokens=2, cache=cache, ignore_eos=True))
        with pytest.raises(InputError, match="prompt has 10 tokens"):   # what the cache holds counts
            next(stream_generate(model, tok, [3, 4, 5, 6], cache=cache))
    finally:
        model.args.max_position_embeddings = context
