"""dsv4.speculative: greedy speculative decoding gives plain decode's tokens (and cache);
sampled, each emitted token is distributed as plain sampling's (chi-square against the exact
distributions, many seeds)."""

import json
import math
import re

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import flags, speculative
from dsv4.generation import decode_tokens, prefill
from dsv4.sampling import Sampling, make_sampler, picker, sampled_logits
from dsv4.speculative import Policy, Proposal, Stats, accept, speculative_tokens

TOKENS = 256
# The propose and verify paths: the reference (op by op over the DraftCache and the Cache), the
# fixed-shape propose alone (dsv4/draft_step.py), and both at fixed shapes (the GPUs' default).
PATHS = {"reference": dict(fixed_propose=False, fixed_verify=False),
         "fixed-propose": dict(fixed_propose=True, fixed_verify=False),
         "fixed": dict(fixed_propose=True, fixed_verify=True)}


@pytest.fixture(scope="module")
def tiny(draft_dir):
    with flags.override(draft="on"):
        return dsv4.load(draft_dir)[0]


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(0).integers(7, 500, (1, 19))


def plain(model, prompt, n, sampling=Sampling()):
    """decode_tokens' tokens and the cache it leaves."""
    cache = model.make_cache()
    logits = prefill(model, prompt, cache)
    sampler = make_sampler(sampling)
    return list(decode_tokens(model, cache, sampler(logits), sampler, n)), cache


def speculate(model, prompt, n, policy, sampling=Sampling(), stats=None):
    """speculative_tokens' tokens (the prompt prefilled and the draft window seeded) and the cache."""
    cache, window = model.make_cache(), model.draft.make_cache()
    hidden = []
    logits = model(prompt, cache, hidden=hidden)[:, -1]
    model.draft.seed(window, hidden, 1)
    tokens = list(speculative_tokens(model, cache, window, logits, sampling, n, policy, stats))
    return tokens, cache


def next_logits(model, cache, token) -> np.ndarray:
    return np.array(model(np.array([[token]]), cache.copy())[0, -1])


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """p-value of Pearson's statistic, cells with expected count < 5 pooled (Wilson-Hilferty
    approximation of the chi-square tail, plenty for a 1e-4 threshold)."""
    order = np.argsort(expected)
    obs, exp = observed[order].astype(float), expected[order].astype(float)
    small = np.cumsum(exp) < 5 * np.arange(1, len(exp) + 1)   # pool the small tail first
    if small.any():
        cut = int(np.argmin(small)) if not small.all() else len(exp) - 1
        obs = np.concatenate([[obs[:cut + 1].sum()], obs[cut + 1:]])
        exp = np.concatenate([[exp[:cut + 1].sum()], exp[cut + 1:]])
    stat, df = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    if df == 0:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


# --- greedy ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_run(tiny, prompt):
    return plain(tiny, prompt, TOKENS)


@pytest.mark.parametrize("k, path", [(k, "fixed") for k in range(1, 6)] +
                         [(5, path) for path in ("reference", "fixed-propose")])
def test_greedy_gives_plain_decodes_tokens_and_cache(tiny, prompt, plain_run, k, path):
    """256 tokens past a window of 8 and ratio-2 groups, with the checkpoint's (random) draft
    stages: nearly every draft rejected at the first row. Every k through the GPUs' path; the
    other paths at the longest block (the scripted rejections below take every k through the
    reference verify)."""
    want, want_cache = plain_run
    stats = Stats()
    with flags.override(**PATHS[path]):
        got, cache = speculate(tiny, prompt, TOKENS, Policy(k), stats=stats)
    assert got == want
    assert stats.verifies > 0 and stats.drafted >= stats.verifies
    np.testing.assert_array_equal(cache.tokens, want_cache.tokens)
    np.testing.assert_array_equal(next_logits(tiny, cache, got[-1]), next_logits(tiny, want_cache, want[-1]))


class Scripted:
    """Stands in for `speculative.propose` (the reference propose's: DSV4_FIXED_PROPOSE off):
    drafts the known continuation, wrong at block row `wrong` (cycling 0..k: k = no error), so
    every rejection position is met."""

    def __init__(self, continuation: list[int], start: int, k: int):
        self.continuation, self.start, self.k, self.cycle, self.wrong_at = continuation, start, k, 0, []

    def __call__(self, model, window, token, k, adjust, sampling):
        at = window.end - self.start            # the pending token's place in the continuation
        assert self.continuation[at] == token
        drafts = list(self.continuation[at + 1:at + 1 + k])
        wrong = self.cycle % (self.k + 1)
        if wrong < k:
            drafts[wrong] = (drafts[wrong] + 1) % model.args.vocab_size
        self.wrong_at.append(min(wrong, k))
        self.cycle += 1
        return Proposal(mx.array(drafts, mx.int32), None, mx.zeros((k,)))


@pytest.mark.parametrize("verify", ["reference", "fixed"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_after_a_rejection_at_every_block_position(tiny, prompt, plain_run, monkeypatch, k, verify):
    """Drafts right up to a chosen row, that row wrong, cycling through every row (and none):
    each cycle keeps exactly the drafts before the wrong one, and the tokens and the cache
    after 256 tokens are plain decode's; the verify over the Cache or at fixed shapes
    (DSV4_FIXED_VERIFY: k + 1 positions a step, rejected ones rewound)."""
    want, want_cache = plain_run
    script = Scripted(want, prompt.shape[1], k)
    monkeypatch.setattr(speculative, "propose", script)
    stats = Stats()
    with flags.override(fixed_verify=verify == "fixed", fixed_propose=False):
        got, cache = speculate(tiny, prompt, TOKENS, Policy(k), stats=stats)
    assert got == want
    n = stats.verifies
    assert stats.accepted == sum(script.wrong_at[:n])
    assert set(script.wrong_at[:n]) == set(range(k + 1))
    np.testing.assert_array_equal(cache.tokens, want_cache.tokens)
    np.testing.assert_array_equal(next_logits(tiny, cache, got[-1]), next_logits(tiny, want_cache, want[-1]))


def test_greedy_with_penalties_and_bias(tiny, prompt, monkeypatch):
    """Penalties count the drafts before each verified position (the scripted drafts are
    mostly right, so whole blocks are accepted under the penalties)."""
    sampling = Sampling(presence_penalty=0.8, frequency_penalty=0.5, logit_bias={7: 3.0, 9: -2.0})
    want, _ = plain(tiny, prompt, 96, sampling)
    script = Scripted(want, prompt.shape[1], 4)
    monkeypatch.setattr(speculative, "propose", script)
    with flags.override(fixed_propose=False):
        got, _ = speculate(tiny, prompt, 96, Policy(4), sampling)
    assert got == want


@pytest.mark.parametrize("verify", ["reference", "fixed"])
def test_stopping_inside_a_block_leaves_the_cache_of_the_tokens_handed_out(tiny, prompt, monkeypatch, verify):
    want, _ = plain(tiny, prompt, 40)
    script = Scripted(want, prompt.shape[1], 5)
    monkeypatch.setattr(speculative, "propose", script)
    cache, window = tiny.make_cache(), tiny.draft.make_cache()
    hidden = []
    logits = tiny(prompt, cache, hidden=hidden)[:, -1]
    tiny.draft.seed(window, hidden, 1)
    with flags.override(fixed_verify=verify == "fixed", fixed_propose=False):
        tokens = speculative_tokens(tiny, cache, window, logits, Sampling(), 40, Policy(5))
        got = [next(tokens) for _ in range(23)]
        tokens.close()
    assert got == want[:23]
    assert cache.offset == prompt.shape[1] + 22
    np.testing.assert_array_equal(cache.tokens[0, prompt.shape[1]:], want[:22])


# --- sampled -----------------------------------------------------------------------------------

SETTINGS = [(1.0, 1.0), (0.7, 0.8), (1.5, 0.5)]


@pytest.mark.parametrize("temp,top_p", SETTINGS)
def test_sampled_logits_are_what_the_sampler_draws_from(temp, top_p):
    """p and q of the speculative sampler are the plain sampler's distribution."""
    logits = mx.array(np.random.default_rng(1).normal(0, 1.5, (1, 12)).astype(np.float32))
    mx.random.seed(3)
    n = 20000
    draws = np.array(picker(temp, top_p)(mx.broadcast_to(logits, (n, 12))))
    p = np.array(mx.softmax(sampled_logits(logits, temp, top_p), axis=-1))[0]
    assert chi_square_p(np.bincount(draws, minlength=12), n * p) > 1e-4
    assert (p[draws] > 0).all()   # nothing outside the nucleus


class Chain:
    """A synthetic target and draft over a tiny vocabulary: logits depend on the last two
    tokens (tables drawn once), so every position has its own p and q."""

    def __init__(self, vocab: int, seed: int, sampling: Sampling, wrong: bool = False):
        rng = np.random.default_rng(seed)
        self.vocab, self.rng = vocab, rng
        target = rng.normal(0, 1.2, (vocab * vocab, vocab)).astype(np.float32)
        draft = rng.normal(0, 1.2, (vocab * vocab, vocab)).astype(np.float32)
        if wrong:   # the draft puts its mass on the one token the target never picks
            target[:, 0], draft[:], draft[:, 0] = -30.0, -30.0, 10.0
        self.target = mx.array(target)
        # q as the speculative sampler makes it (propose), and its probabilities to draw from
        self.q_logits = sampled_logits(mx.array(draft), sampling.temp, sampling.top_p)
        self.q = np.array(mx.softmax(self.q_logits, axis=-1), np.float64)

    def context(self, history) -> int:
        return history[-2] * self.vocab + history[-1]


def run_chain(chain: Chain, sampling: Sampling, k: int, emit: int) -> list[int]:
    """The first `emit` tokens after [0, 0] from speculative cycles: drafts drawn from q, the
    real `accept` on the target's rows after each prefix of the drafts."""
    history = [0, 0]
    while len(history) < 2 + emit:
        drafts, contexts = [], []
        for _ in range(k):
            contexts.append(chain.context(history + drafts))
            q = chain.q[contexts[-1]]
            drafts.append(int(chain.rng.choice(chain.vocab, p=q / q.sum())))
        rows = mx.array([chain.context(history + drafts[:i]) for i in range(k + 1)])
        proposal = Proposal(mx.array(drafts, mx.int32), chain.q_logits[mx.array(contexts)], mx.zeros((k,)))
        j, nxt = accept(chain.target[rows], proposal, sampling)
        history += drafts[:int(j.item())] + [int(nxt.item())]
    return history[2:2 + emit]


def chain_distribution(chain: Chain, sampling: Sampling, emit: int) -> np.ndarray:
    """The exact joint distribution of plain sampling's first `emit` tokens [V ** emit]."""
    v = chain.vocab
    p = np.array(mx.softmax(sampled_logits(chain.target, sampling.temp, sampling.top_p), axis=-1), np.float64)
    probs, prefixes = np.ones(1), [[0, 0]]
    for _ in range(emit):
        probs = (probs[:, None] * np.stack([p[chain.context(h)] for h in prefixes])).reshape(-1)
        prefixes = [h + [t] for h in prefixes for t in range(v)]
    return probs


@pytest.mark.parametrize("temp,top_p,k,wrong", [(1.0, 1.0, 2, False), (0.7, 0.8, 3, False),
                                               (1.5, 0.5, 3, False), (1.0, 0.9, 2, True)],
                         ids=["t1.0-p1.0-k2", "t0.7-p0.8-k3", "t1.5-p0.5-k3", "always-wrong-k2"])
def test_accepting_keeps_the_target_distribution(temp, top_p, k, wrong):
    """Joint distribution of the first 3 tokens over 4 tokens (64 cells), 3000 seeds, against
    exact enumeration of plain sampling."""
    sampling = Sampling(temp=temp, top_p=top_p)
    chain = Chain(4, 7, sampling, wrong)
    exact = chain_distribution(chain, sampling, 3)
    mx.random.seed(11 + k)
    n = 3000
    seen = np.zeros(64)
    for _ in range(n):
        a, b, c = run_chain(chain, sampling, k, 3)
        seen[16 * a + 4 * b + c] += 1
    assert chi_square_p(seen, n * exact) > 1e-4, (seen, n * exact)
    assert seen[exact == 0].sum() == 0


@pytest.mark.parametrize("path", ["reference", "fixed-propose"])
def test_sampled_generation_matches_plain_sampling_on_the_model(tiny, prompt, path):
    """On the tiny model (its random draft stages mostly wrong): the token after the first,
    over 200 seeds, against p(first) p(second | first) computed from the model."""
    sampling = Sampling(temp=0.8, top_p=0.9)
    cache, window = tiny.make_cache(), tiny.draft.make_cache()
    hidden = []
    logits = tiny(prompt, cache, hidden=hidden)[:, -1]
    tiny.draft.seed(window, hidden, 1)
    first = np.array(mx.softmax(sampled_logits(logits, 0.8, 0.9), axis=-1))[0]
    support = np.flatnonzero(first)
    second = {int(t): np.array(mx.softmax(sampled_logits(
        tiny(np.array([[t]]), cache.copy())[:, -1], 0.8, 0.9), axis=-1))[0] for t in support}
    n, seen = 200, {}
    for seed in range(n):
        mx.random.seed(seed)
        c, w = cache.copy(), window.copy()
        with flags.override(**PATHS[path]):
            a, b = speculative_tokens(tiny, c, w, logits, sampling, 2, Policy(3))
        seen[(a, b)] = seen.get((a, b), 0) + 1
    cells = [(a, b) for a in second for b in np.flatnonzero(second[a])]
    expected = np.array([n * first[a] * second[a][b] for a, b in cells])
    observed = np.array([seen.pop((a, int(b)), 0) for a, b in cells])
    assert not seen   # nothing outside the support
    assert chi_square_p(observed, expected) > 1e-4


# --- choosing k ----------------------------------------------------------------------------------

def drive(policy, accept_rate, verify_s, propose_s=0.3, plain_s=1.0, cycles=400, scores=None, seed=0):
    """Run `policy` against a simulated drafter: each draft accepted with `accept_rate`
    (or by its score: `scores(row)` -> (score, accepted)); times in units of a plain step.
    Returns the k chosen at each cycle (0: a plain step) and the tokens per unit of time."""
    rng = np.random.default_rng(seed)
    ks, tokens, clock = [], 0, 0.0
    for _ in range(cycles):
        k = policy.k(10 ** 6)
        if k == 0:
            policy.record_plain(plain_s)
            ks.append(0)
            tokens, clock = tokens + 1, clock + plain_s
            continue
        rows = [scores(i) if scores else (0.0, rng.random() < accept_rate) for i in range(k)]
        confidence = np.array([score for score, _ in rows])
        k = policy.truncate(k, confidence)
        accepted = 0
        while accepted < k and rows[accepted][1]:
            accepted += 1
        policy.record_verify(k, accepted, confidence, propose_s, verify_s(k + 1))
        ks.append(k)
        tokens, clock = tokens + accepted + 1, clock + propose_s + verify_s(k + 1)
    return ks, tokens / clock


def test_adaptive_k_drafts_the_most_while_it_pays():
    ks, rate = drive(speculative.Adaptive(5), 0.9, verify_s=lambda n: 1.0 + 0.05 * (n - 1))
    assert ks[0] == 0 and all(k == 5 for k in ks[2:])
    assert rate > 3.0   # tokens per plain-step time


def test_adaptive_k_turns_drafting_off_while_it_does_not_pay():
    """A draft that is never right: plain steps, with probes further and further apart (their
    cost: under 3% of plain decode's rate over these 800 tokens, less the longer it runs)."""
    ks, rate = drive(speculative.Adaptive(5), 0.0, verify_s=lambda n: 1.0 + 0.2 * (n - 1), cycles=800)
    starts = [i for i in range(3, len(ks)) if ks[i] > 0 and ks[i - 1] == 0]
    gaps = np.diff(starts)
    assert len(starts) <= 6 and all(b >= a for a, b in zip(gaps, gaps[1:])) and gaps[-1] > 4 * gaps[0]
    assert np.mean(np.array(ks) == 0) > 0.95
    assert rate > 0.96   # plain decode's is 1.0


def best_fixed_rate(accept_rate, verify_s, propose_s, most=5) -> float:
    """Tokens per plain-step time of the best fixed k (or plain decode, 1.0)."""
    return max([1.0] + [sum(accept_rate ** i for i in range(k + 1)) / (propose_s + verify_s(k + 1))
                        for k in range(1, most + 1)])


@pytest.mark.parametrize("accept_rate,slope,propose_s", [(0.8, 0.5, 0.1), (0.6, 0.1, 0.3), (0.95, 0.3, 0.2),
                                                        (0.9, 0.05, 0.3)])
def test_adaptive_k_gets_near_the_best_fixed_k(accept_rate, slope, propose_s):
    """Where the verify grows with its positions, the best k is in the middle (the rate is
    flat near it): the adaptive choice gets within 6% of the best fixed k's rate (with
    acceptance 0.3 drafting gains 7% at best; the probes for it cost about that)."""
    verify_s = lambda n: 1.0 + slope * (n - 1)
    _, rate = drive(speculative.Adaptive(5), accept_rate, verify_s, propose_s=propose_s, cycles=600)
    assert rate >= 0.94 * best_fixed_rate(accept_rate, verify_s, propose_s)


def test_adaptive_k_cuts_the_block_where_the_confidence_says_the_drafts_go_wrong():
    """Rows scored above 0 are accepted, below 0 not: once the fit has seen that, each block
    stops at the first low score (here row 2)."""
    scores = lambda row: (2.0, True) if row < 2 else (-2.0, False)
    policy = speculative.Adaptive(5)
    ks, _ = drive(policy, None, verify_s=lambda n: 1.0 + 0.1 * (n - 1), scores=scores)
    assert policy.fit[0] > 0
    assert all(k == 2 for k in ks[40:])


# --- generation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["on", "auto"])
def test_stream_generate_with_draft_gives_the_plain_text(tiny, draft_dir, mode):
    from dsv4.generation import stream_generate
    from dsv4.tokenizer import Tokenizer

    tokenizer = Tokenizer(draft_dir)
    plain_run = list(stream_generate(tiny, tokenizer, "Readability counts.", max_tokens=48, ignore_eos=True,
                                     draft="off"))
    with flags.override(draft_k=3):
        drafted = list(stream_generate(tiny, tokenizer, "Readability counts.", max_tokens=48, ignore_eos=True,
                                       draft=mode))
    assert [r.token for r in drafted] == [r.token for r in plain_run]
    assert plain_run[-1].speculative is None
    stats = drafted[-1].speculative
    assert stats.verifies + stats.plain_steps == 47 - stats.accepted
    assert stats.drafted <= 3 * stats.verifies


def test_generate_cli_reports_the_drafting(draft_dir, capsys):
    from dsv4 import generation

    with pytest.raises(SystemExit) as done:
        generation.main(["--model", str(draft_dir), "--draft", "on", "--draft-k", "2", "-m", "12",
                         "--raw", "-p", "Simple is better", "--bench-json"])
    out = capsys.readouterr().out
    assert (done.value.code or 0) == 0
    found = re.search(r"Speculative: (\d+) verifies, (\d+) plain steps; acceptance [\d.]+ \((\d+)/(\d+)\)", out)
    assert found, out
    result = json.loads(out.split("DSV4_RESULT ")[1])   # the same numbers for benchmarks/ab.py
    verifies, plain_steps, accepted, drafted = map(int, found.groups())
    assert (result["draft_verifies"], result["draft_plain_steps"]) == (verifies, plain_steps)
    assert result["draft_acceptance"] == pytest.approx(accepted / drafted)


# --- the bundled demo's trained draft stages ---------------------------------------------------

# Written for these tests, not in the demo's training corpus (CPython's pydoc topics).
DEMO_PROMPT = ("A dictionary maps keys to values. You can look up the value of a key with square "
               "brackets, and a for loop over a dictionary goes through its keys in the order they "
               "were inserted.")


@pytest.fixture(scope="module")
def demo():
    with flags.override(draft="on"):
        return dsv4.load()


def demo_acceptance(model, tokenizer, tokens=128) -> Stats:
    from dsv4.generation import stream_generate

    return list(stream_generate(model, tokenizer, DEMO_PROMPT, max_tokens=tokens, ignore_eos=True,
                                draft="on"))[-1].speculative


@pytest.fixture(scope="module")
def demo_plain(demo):
    model, tokenizer = demo
    prompt = np.array([tokenizer.encode(DEMO_PROMPT)])
    return prompt, *plain(model, prompt, TOKENS)


@pytest.mark.parametrize("k, path", [(k, "fixed") for k in range(1, 6)] + [(5, "reference")])
def test_demo_greedy_speculation_gives_plain_decodes_tokens(demo, demo_plain, k, path):
    """256 tokens (window 16, ratio-2 groups) with drafts that are often right. Every k through
    the GPUs' path, the reference verify at the longest block (as on the tiny checkpoint)."""
    model, _ = demo
    prompt, want, want_cache = demo_plain
    stats = Stats()
    with flags.override(**PATHS[path]):
        got, cache = speculate(model, prompt, TOKENS, Policy(k), stats=stats)
    assert got == want
    assert stats.tokens_per_verify > 1.2, stats.line()
    np.testing.assert_array_equal(cache.tokens, want_cache.tokens)


@pytest.mark.parametrize("sampling", [Sampling(presence_penalty=0.8, frequency_penalty=0.5, logit_bias={7: 3.0}),
                                      Sampling(temp=0.8, top_p=0.9, presence_penalty=0.5)],
                         ids=["greedy", "sampled"])
def test_demo_pipelined_cycles_give_the_waiting_loops_tokens(demo, demo_plain, sampling):
    """DSV4_DRAFT_PIPELINE queues each propose from the acceptance on the device (the pending
    token, the window's end and the penalties' counts there): the waiting loop's tokens and
    acceptance, the same draws when sampled. Only a cycle near the end may differ, where the
    pipelined propose drafted for the most tokens left and its block was cut; greedy, both are
    plain decode's."""
    model, _ = demo
    prompt = demo_plain[0]
    runs = {}
    for pipeline in (False, True):
        stats = Stats()
        mx.random.seed(3)
        with flags.override(**PATHS["fixed"], draft_pipeline=pipeline):
            runs[pipeline] = speculate(model, prompt, 96, Policy(4), sampling, stats)[0], stats
    (waited, waited_stats), (pipelined, pipelined_stats) = runs[False], runs[True]
    assert pipelined[:-5] == waited[:-5] and len(pipelined) == len(waited) == 96
    assert pipelined_stats.accepted >= 0.9 * waited_stats.accepted and pipelined_stats.tokens_per_verify > 1.2
    if sampling.temp == 0:
        assert pipelined == waited == plain(model, prompt, 96, sampling)[0]


def test_demo_draft_stages_are_trained(demo, tmp_path):
    """Greedy acceptance on a text the demo never saw, against the same backbone with
    dsv4.testing's random draft stages."""
    import shutil

    from dsv4.config import ModelArgs
    from dsv4.loader import DEMO_DIR
    from dsv4.safetensors_file import Checkpoint, view
    from dsv4.testing import official_tensors, write_sharded

    model, tokenizer = demo
    trained = demo_acceptance(model, tokenizer)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / name, tmp_path / name)
    stored = Checkpoint(DEMO_DIR, "model*.safetensors")
    tensors = {n: (info.dtype, np.array(view(info))) for n, info in stored.tensors.items()}
    random_stages = official_tensors(ModelArgs.from_dict(json.loads((DEMO_DIR / "config.json").read_text())), seed=0)
    tensors.update({n: t for n, t in random_stages.items() if n.startswith("mtp.")})
    write_sharded(tmp_path, tensors, shards=3)
    with flags.override(draft="on"):
        untrained = demo_acceptance(*dsv4.load(tmp_path))
    # Measured: 41 of 420 drafts, 1.48 tokens per verify (a third of the blocks keep their
    # first draft); the random stages' drafts are never right.
    assert trained.acceptance > 0.05 and trained.tokens_per_verify > 1.25, trained.line()
    assert untrained.acceptance < 0.02, untrained.line()


# --- chat and the server -------------------------------------------------------------------------

def test_chat_with_draft_gives_the_plain_answers(demo):
    """Two turns (the second continues the first's cache, so its draft window starts at the
    cache's offset) with the demo's trained drafts: the answers are plain decode's."""
    from dsv4.chat import ChatSession

    model, tokenizer = demo
    turns = [DEMO_PROMPT, "And what does a set do?"]

    def answers(mode):
        session = ChatSession(model, tokenizer, max_tokens=32)
        with flags.override(draft=mode, draft_k=4):
            return [session.ask(text)[1] for text in turns]

    plain_turns, drafted = answers("off"), answers("on")
    assert [t.generated for t in drafted] == [t.generated for t in plain_turns]
    assert drafted[1].cached_tokens > 0 and plain_turns[0].speculative is None
    assert all(t.speculative.verifies > 0 for t in drafted)
    assert "Speculative:" in drafted[1].line()


def test_chat_and_server_take_the_draft_options():
    import subprocess
    import sys

    run = lambda *args, **kw: subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                                             timeout=120, **kw)
    chat = run("dsv4.chat", "--draft", "on", "--draft-k", "2", "--max-tokens", "12", input="Hello\n/quit\n")
    assert chat.returncode == 0 and re.search(r"\[Speculative: \d+ verifies", chat.stdout), chat.stdout + chat.stderr
    for command in ("dsv4.chat", "dsv4.server"):
        bad = run(command, "--draft", "maybe", input="")
        assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
            "error: --draft='maybe': expected one of off, on, auto"], bad.stderr


@pytest.fixture
def draft_server():
    from dsv4.serve.engine import ModelEngine
    from tests.server_helpers import inprocess_server

    with flags.override(draft="on", draft_k=4):
        served = inprocess_server(lambda: ModelEngine(*dsv4.load()), max_context=4096)
        try:
            yield served
        finally:
            served.stop()


def plain_answer(model, tokenizer, question: str, max_tokens: int) -> str:
    from dsv4.encoding import encode_messages, parse_completion
    from dsv4.generation import stream_generate

    prompt = tokenizer.encode(encode_messages([{"role": "user", "content": question}]))
    text = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, draft="off"))
    return parse_completion(text).content


def test_server_speculates_for_a_lone_session_with_plain_decodes_answers(demo, draft_server):
    """Requests in turn (each alone, the second from the first's cached prefix) draft; two at
    once are decoded together (the drafting one drops its window); every answer is plain
    decode's."""
    from concurrent.futures import ThreadPoolExecutor

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=draft_server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    model, tokenizer = demo
    ask = lambda q: client.chat.completions.create(model="demo", messages=[{"role": "user", "content": q}],
                                                   max_tokens=32).choices[0].message.content
    questions = [DEMO_PROMPT, DEMO_PROMPT + " A set holds each value once.", "What is a tuple?"]
    alone = [ask(q) for q in questions[:2]]
    from tests.server_helpers import get_json

    stats = get_json(draft_server.host, draft_server.port, "/v1/stats")[1]["draft"]
    assert stats["draft_verifies"] > 0 and stats["draft_acceptance"] > 0, stats
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(ask, questions[1:]))
    assert draft_server.scheduler.stats["largest_batch"] == 2
    for question, reply in zip(questions[:2] + questions[1:], alone + together):
        assert reply == plain_answer(model, tokenizer, question, 32)


def test_workloads_line_carries_the_drafting(draft_dir, capsys):
    """benchmarks/workloads.py on a text prompt: drafted greedy tokens equal plain ones and the
    line has the draft numbers (what the DSpark report's A/B reads)."""
    from benchmarks import ab, workloads

    def result(mode, *extra):
        with flags.override(draft=mode, draft_k=2):
            workloads.main(["--model", str(draft_dir), "--prompt", "Readability counts.",
                            "--generation-tokens", "12", *extra])
        return ab.parse_result(capsys.readouterr().out)

    plain_run, drafted = result("off"), result("on")
    assert drafted["tokens"] == plain_run["tokens"] and "draft_acceptance" not in plain_run
    # every token after the first came from a verify (its accepted drafts and one more) or a plain step
    assert round(drafted["draft_tokens_per_verify"] * drafted["draft_verifies"]) + drafted["draft_plain_steps"] == 11
    sampled = result("on", "--temp", "0.8", "--seed", "3")
    assert sampled["workload"] == "custom" and sampled["draft_verifies"] > 0
