"""dsv4/draft_step.py: the fixed-shape propose and seed give the reference's drafts, q-logits
and confidence (dsv4/speculative.py `propose` over a DraftCache), cycle after cycle, in fp32
with the roundings off; the loop with them is checked in test_speculative.py."""

from typing import Optional

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import flags
from dsv4.draft_step import FixedDraft
from dsv4.sampling import LogitAdjustment, Sampling
from dsv4.speculative import propose

FP32 = dict(kv_qdq=False, act_quant=False)


@pytest.fixture(scope="module")
def tiny(draft_dir):
    with flags.override(draft="on"):
        return dsv4.load(draft_dir, dtype=mx.float32)[0]


SAMPLINGS = {"greedy": Sampling(),
             "greedy-penalized": Sampling(presence_penalty=0.8, frequency_penalty=0.5, logit_bias={7: 3.0}),
             "sampled": Sampling(temp=0.8, top_p=0.9),
             "sampled-penalized": Sampling(temp=1.2, frequency_penalty=0.7)}


CASES = [(name, True, 0, False) for name in SAMPLINGS] + [("greedy", False, 0, False), ("sampled", False, 0, False),
                                                          ("greedy", True, 10, False), ("sampled", True, 10, False),
                                                          ("greedy", True, 0, True), ("sampled", True, 10, True)]


@pytest.mark.parametrize("name,compiled,unseeded,tails", CASES,
                         ids=[f"{n}-{'compiled' if c else 'op-by-op'}{'-continued' if u else ''}{'-tails' if t else ''}"
                              for n, c, u, t in CASES])
def test_fixed_propose_gives_the_reference_proposals(tiny, name, compiled, unseeded, tails):
    """90 cycles after a 13-token prompt (window 8, ring 14: wrapped ~20 times): k cycling
    through 0 (a plain step, one row seeded) .. 5 and, independently, the drafts accepted
    through 0 .. k, so the window's end moves by every amount at every ring slot. Each cycle
    the verify's k + 1 hidden rows come from the backbone fed [y, drafts]; the reference seeds
    the accepted ones, the fixed window all of them and keeps the accepted. Same random state
    before each propose: the sampled drafts are the same draws. `unseeded`: the window starts
    after that many prompt positions (a chat turn continuing a cache), holding fewer rows than
    the window's positions for the first cycles. `tails` (DSV4_KERNEL_ROWS_POSITIONS): the
    block's and the seed's tails and attention take each position's angles."""
    with flags.override(compile=compiled, kernel_rows_positions=tails, **FP32):
        check_cycles(tiny, SAMPLINGS[name], unseeded)


@pytest.mark.gpu
@pytest.mark.parametrize("tails", [False, True])
@pytest.mark.parametrize("name", ["greedy", "sampled-penalized"])
def test_gpu_fixed_propose_with_kernels_gives_the_reference_proposals(tiny, name, tails):
    """The same on a GPU: the fixed propose compiled with the kernels (attention, experts, mHC,
    head, row tails; `tails`: the block's with each position's angles) against the reference
    propose without them, in fp32 (summation order apart: 1e-4)."""
    kernels_off = {flag: False for flag in flags.FLAGS if flag.startswith("kernel_")}
    with flags.override(compile=True, kernel_rows_positions=tails, **FP32):
        check_cycles(tiny, SAMPLINGS[name], 0, kernels_off, tol=1e-4)


def check_cycles(model, sampling: Sampling, unseeded: int, reference_switches: Optional[dict] = None,
                 tol: float = 1e-5) -> None:
    """The cycles of test_fixed_propose_gives_the_reference_proposals, the reference propose
    and seed under `reference_switches`."""
    reference_switches = reference_switches or {}
    draft = model.draft
    rng = np.random.default_rng(2)
    prompt = rng.integers(7, 500, (1, 13))
    cache, reference = model.make_cache(), draft.make_cache(unseeded)
    if unseeded:
        model(prompt[:, :unseeded], cache)
    hidden = []
    logits = model(prompt[:, unseeded:], cache, hidden=hidden)
    draft.seed(reference, hidden, 1)
    fixed = FixedDraft(model, reference.copy())
    adjust = LogitAdjustment(sampling, model.args.vocab_size)
    y = int(mx.argmax(logits[0, -1]).item())
    for cycle in range(90):
        k = cycle % 6
        if k:
            mx.random.seed(cycle)
            with flags.override(**reference_switches):
                want = propose(model, reference, y, k, adjust, sampling)
            mx.random.seed(cycle)
            got = fixed.propose(y, k, adjust, sampling)
            np.testing.assert_array_equal(np.array(got.drafts), np.array(want.drafts))
            pairs = [(got.confidence, want.confidence)]
            if sampling.temp:
                pairs.append((got.q_logits, want.q_logits))
            else:
                assert got.q_logits is None and want.q_logits is None
            for a, b in pairs:
                a, b = np.array(a), np.array(b)
                finite = np.isfinite(b)
                np.testing.assert_array_equal(np.isfinite(a), finite)   # top-p's cut rows alike
                np.testing.assert_allclose(a[finite], b[finite], rtol=tol, atol=tol)
            drafts = np.array(want.drafts).tolist()
        else:
            drafts = []
        logits = model(np.array([[y, *drafts]]), cache, hidden=(hidden := []))
        kept = 1 + (cycle // 6) % (k + 1)          # accepted drafts 0..k, plus y
        cache.trim(k + 1 - kept)
        with flags.override(**reference_switches):
            draft.seed(reference, [h[:kept] for h in hidden], 1)
        fixed.seed(hidden)
        fixed.keep(kept)
        assert fixed.end == reference.end
        adjust.count(mx.array([*drafts[:kept - 1], y]))
        y = int(mx.argmax(logits[0, kept - 1]).item())    # the target's token after them
    assert reference.end - 13 > 6 * fixed.ring
    twin = fixed.cache
    fixed.close()
    assert twin.end == reference.end
    for got, want in zip(twin.rows, reference.rows):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=tol, atol=tol)


def test_a_seed_longer_than_the_spare_ring_rows_is_refused(tiny):
    model = tiny
    cache, window = model.make_cache(), model.draft.make_cache()
    hidden = []
    model(np.arange(7, 20)[None], cache, hidden=hidden)
    model.draft.seed(window, hidden, 1)
    fixed = FixedDraft(model, window)
    spare = fixed.ring - model.args.sliding_window
    with pytest.raises(ValueError, match="would overwrite window rows"):
        fixed.seed([mx.zeros((spare + 1, model.args.hidden_size))] * len(hidden))
    fixed.seed([h[:2] for h in hidden])
    with pytest.raises(ValueError, match="can keep 0..2"):
        fixed.keep(3)
