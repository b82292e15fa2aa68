"""Speculative decoding with the DSpark draft stages (dsv4/draft.py): propose a block of
drafts after the pending token, verify them in one backbone forward of k+1 positions, keep
what the target accepts.

One cycle, with the pending token y at position n (the cache holds 0..n-1, the draft window
the main KV of 0..n-1):
- propose: the draft block after n-1 with y first; drafts d_1..d_k picked one after another
  (each row's logits plus the Markov bias of the token before it), through the same logit
  bias, penalties, temperature and top-p as the target's (q);
- verify: the backbone over [y, d_1..d_k] at n..n+k (Cache: multi-token decode) gives the
  target's distribution p_i at each position (bias and penalties counting the drafts before);
- accept: greedy, the longest prefix of drafts equal to the target's argmax, plus the
  target's token after it (so the tokens are plain decode's); sampled, each draft with
  probability min(1, p/q), on the first rejection a token from max(0, p - q) normalized,
  after k acceptances one from p_k (Leviathan et al. / Chen et al.: the output is
  distributed as plain sampling);
- the cache drops the rejected positions (Cache.trim, exact), the draft window takes the
  main KV of the kept ones (the verify's hidden means; drafts never enter it).

The verify runs where plain decode does (`Target`): on GPUs at fixed shapes (dsv4/step.py
FixedDecoder.feed: one compiled graph per count of positions, rejected positions rewound),
else the reference forward over the Cache (DSV4_FIXED_VERIFY); the propose likewise, on GPUs
one compiled graph per k over a draft window in rings (dsv4/draft_step.py FixedDraft), seeded
with all k + 1 verified rows before the acceptance is known, else op by op over the DraftCache
(DSV4_FIXED_PROPOSE). Either way a cycle reaches the host once: at the acceptance (j, the next
token, the drafts to hand out); a backbone with Engram layers hashes the drafts on the host too.
The next cycle's propose is started on the device before the cycle's tokens are handed out.

`Policy` picks k each cycle, 0 meaning a plain step (still seeding the draft window).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np

from . import flags
from .cache import Cache
from .draft import DraftCache, Proposal, pick_drafts
from .draft_step import FixedDraft, use_fixed_propose
from .sampling import LogitAdjustment, Sampling, picker, sampled_logits


class Target:
    """The backbone as the cycle feeds it: positions fed, every position's logits and the
    draft stages' inputs back, rejected positions taken back. Over the Cache (the reference
    forward) or, where DSV4_FIXED_VERIFY says, a fixed-shape decoder that holds the cache's
    state until `close`."""

    def __init__(self, model, cache: Cache):
        from .step import FixedDecoder, use_fixed_decode

        self.model, self.cache = model, cache
        fixed = flags.switch("fixed_verify", use_fixed_decode(model)) and cache.offset > 0
        self.decoder = FixedDecoder(model, cache) if fixed else None

    @property
    def offset(self) -> int:
        return self.cache.offset if self.decoder is None else self.decoder.pos

    def feed(self, ids: mx.array) -> tuple[mx.array, list]:
        """ids [n] int32 (may be unevaluated: the fixed-shape decoder takes them on the device)
        -> (fp32 logits [n, V], the draft stages' inputs [n, D] per target layer)."""
        if self.decoder is not None:
            logits, hidden = self.decoder.feed(ids[None], hidden=True)
            return logits[0], hidden
        hidden = []
        return self.model(np.array(ids, np.int64)[None], self.cache, hidden=hidden)[0], hidden

    def rewind(self, n: int) -> None:
        if self.decoder is not None:
            self.decoder.rewind(n)
        elif n:
            self.cache.trim(n)

    def close(self) -> None:
        """The state back in the cache (a fixed-shape decoder's)."""
        if self.decoder is not None:
            decoder, self.decoder = self.decoder, None
            decoder.close(decoder.pos)


def propose(model, draft_cache: DraftCache, token: int, k: int, adjust: LogitAdjustment,
            sampling: Sampling) -> Proposal:
    """k <= block drafts after `token`, the pending token at position draft_cache.end: the
    reference, op by op over the DraftCache (draft.pick_drafts says how they are picked)."""
    prev = mx.array([token], mx.int32)
    x = model.draft.hidden(model, draft_cache, prev)                # [1, block, D]
    return pick_drafts(model, x, prev, k, adjust, adjust.counts, sampling)


class ReferenceDraft:
    """The draft window as the DraftCache itself, drafts from `propose`: the interface of
    draft_step.FixedDraft (seed the verified rows, keep the accepted ones) where
    DSV4_FIXED_PROPOSE is off. The rows are seeded once the acceptance says how many."""

    def __init__(self, model, cache: DraftCache):
        self.model, self.cache, self.hidden = model, cache, None

    def propose(self, token: int, k: int, adjust: LogitAdjustment, sampling: Sampling,
                advance: None = None) -> Proposal:
        """FixedDraft.propose's, from a host token (no `advance`: the window is seeded once the
        acceptance is known)."""
        return propose(self.model, self.cache, token, k, adjust, sampling)

    def seed(self, hidden: list[mx.array]) -> None:
        self.hidden = hidden

    def keep(self, n: int) -> None:
        self.model.draft.seed(self.cache, [h[:n] for h in self.hidden], 1)
        self.hidden = None

    def close(self) -> None:
        pass


def accept(target_logits: mx.array, proposal: Proposal, sampling: Sampling) -> tuple[mx.array, mx.array]:
    """The target's logits [k+1, V] (bias and penalties applied row by row) and the proposal
    -> (number of drafts accepted j, the token after them), both on the device."""
    drafts, k = proposal.drafts, proposal.drafts.shape[0]
    if sampling.temp == 0:
        target = mx.argmax(target_logits, axis=-1).astype(mx.int32)           # [k+1]
        ok = target[:k] == drafts
    else:
        p_logits = sampled_logits(target_logits, sampling.temp, sampling.top_p)
        p = mx.softmax(p_logits, axis=-1)                                     # [k+1, V]
        q = mx.softmax(proposal.q_logits, axis=-1)                            # [k, V]
        rows = mx.arange(k)
        # accept d_i with probability min(1, p/q): u < p/q with u uniform in [0, 1)
        ok = mx.random.uniform(shape=(k,)) * q[rows, drafts] < p[rows, drafts]
        residual = mx.maximum(p[:k] - q, 0.0)
        replaced = mx.random.categorical(mx.log(residual))                     # [k]
        bonus = mx.random.categorical(p_logits[k:])                           # [1]
        target = mx.concatenate([replaced, bonus]).astype(mx.int32)
    accepted = mx.sum(mx.cumprod(ok.astype(mx.int32)))
    return accepted, target[accepted]


@dataclass
class Stats:
    """What a speculative generation did: counts and the time split (seconds)."""
    verifies: int = 0
    plain_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    # A cycle syncs once, at the acceptance: propose_s is the host's time to queue the propose
    # (started before the previous cycle's tokens are handed out, or with DSV4_DRAFT_PIPELINE
    # before its acceptance reached the host) and to cut the block (which waits for the
    # confidence where Adaptive's fit reads it); the draft stages' own compute on an
    # asynchronous device falls in verify_s, the rest of the cycle.
    propose_s: float = 0.0
    verify_s: float = 0.0
    plain_s: float = 0.0
    accepted_at: list = field(default_factory=list)   # per block row: drafts accepted there

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens each verify forward produced (accepted drafts plus the target's own)."""
        return (self.accepted + self.verifies) / self.verifies if self.verifies else 0.0

    def numbers(self) -> dict:
        """The result line's draft keys (top-level: benchmarks/ab.py reports them)."""
        return {"draft_acceptance": self.acceptance, "draft_tokens_per_verify": self.tokens_per_verify,
                "draft_verifies": self.verifies, "draft_plain_steps": self.plain_steps,
                "draft_propose_s": self.propose_s, "draft_verify_s": self.verify_s,
                "draft_plain_s": self.plain_s}

    def line(self) -> str:
        total = self.propose_s + self.verify_s + self.plain_s
        share = lambda s: f"{100 * s / total:.0f}%" if total else "-"
        return (f"Speculative: {self.verifies} verifies, {self.plain_steps} plain steps; acceptance "
                f"{self.acceptance:.3f} ({self.accepted}/{self.drafted}), {self.tokens_per_verify:.2f} "
                f"tokens per verify; time: propose (queued) {share(self.propose_s)}, verify "
                f"{share(self.verify_s)}, plain {share(self.plain_s)}")


class Policy:
    """k = min(most, what is left to generate): every cycle drafts as much as allowed."""

    def __init__(self, most: int):
        self.most = most

    def k(self, remaining: int) -> int:
        return max(0, min(self.most, remaining - 1))

    def truncate(self, k: int, confidence: mx.array) -> int:
        """k or fewer, given the confidence head's scores [k] (an unevaluated array: taking it
        to the host waits for the propose)."""
        return k

    def record_verify(self, k: int, accepted: int, confidence: np.ndarray, propose_s: float,
                      verify_s: float) -> None:
        pass

    def record_plain(self, seconds: float) -> None:
        pass


class Adaptive(Policy):
    """k for the most tokens per second, from what was measured so far (DSV4_DRAFT=auto).

    Expected tokens of a cycle verifying k drafts: 1 + sum_i P(drafts 1..i all accepted);
    its time: the propose plus a verify of k+1 positions (a linear fit of the verify times
    over the positions, plain steps counting as one position). Before the propose, k comes
    from the acceptance rate seen so far; after it, the confidence head's score of each row
    cuts the block where verifying more would lower the rate (the score is mapped to an
    acceptance probability by a logistic fit to the outcomes: an uninformative head gets a
    flat fit and changes nothing). While no k beats a plain step, plain steps run; after
    every `probe` of them PROBE_CYCLES cycles draft again (the interval doubles while
    probing does not pay, up to 256 steps)."""

    HISTORY = 512      # (score, accepted) pairs and times the estimates look back on
    PRIOR = 4          # rows of prior belief in the acceptance rate (half accepted)
    DECAY = 0.97       # weight of a row one row older: the rate remembers ~30 rows
    PROBE_CYCLES = 3   # cycles a probe drafts, to see enough rows

    def __init__(self, most: int, probe: int = 16):
        super().__init__(most)
        self.probe, self.first_probe = probe, probe
        self.since_probe, self.probing = 0, 0
        self.rows: list[tuple[float, bool]] = []     # (confidence score, accepted) of verified rows
        self.times: list[tuple[int, float]] = []     # (positions, seconds) of verifies and plain steps
        self.propose_s: Optional[float] = None
        self.fit = (0.0, 0.0)                       # logistic acceptance(score) = sigmoid(a*score + b)

    # --- estimates ------------------------------------------------------------------------------

    def _acceptance(self, scores: np.ndarray) -> np.ndarray:
        a, b = self.fit
        return 1.0 / (1.0 + np.exp(-np.clip(a * scores + b, -30, 30)))

    def _rate(self) -> float:
        """Acceptance of a draft whose predecessors were accepted: the rows seen, the recent
        ones weighing more (text changes), and PRIOR rows half accepted, so that a few unlucky
        rows do not turn drafting off and a run of them does."""
        ok = np.array([accepted for _, accepted in self.rows], np.float64)
        weight = self.DECAY ** np.arange(len(ok))[::-1]
        return float((weight @ ok + self.PRIOR / 2) / (weight.sum() + self.PRIOR))

    def _verify_s(self, positions: int) -> float:
        t = np.array(self.times, np.float64)
        if len(np.unique(t[:, 0])) < 2:
            return float(np.mean(t[:, 1]))
        slope, base = np.polyfit(t[:, 0], t[:, 1], 1)
        return max(float(base + slope * positions), 1e-9)

    def _best(self, accept_probs: np.ndarray) -> tuple[int, float]:
        """(k, tokens per second) of the best block prefix given each row's acceptance."""
        reach = np.concatenate([[1.0], np.cumprod(accept_probs)])     # P(rows < i accepted)
        rates = [reach[:k + 1].sum() / (self.propose_s + self._verify_s(k + 1))
                 for k in range(1, len(accept_probs) + 1)]
        k = int(np.argmax(rates)) + 1
        return k, rates[k - 1]

    def _refit(self) -> None:
        """Logistic regression of acceptance on the score: a few Newton steps from the last fit,
        each at most 1 in either weight, with a ridge so that a score that tells nothing leaves
        the slope at 0 and all-accepted rows do not send the intercept to infinity."""
        x = np.array([[score, 1.0] for score, _ in self.rows])
        y = np.array([ok for _, ok in self.rows], np.float64)
        w = np.array(self.fit)
        for _ in range(5):
            p = 1.0 / (1.0 + np.exp(-np.clip(x @ w, -30, 30)))
            grad = x.T @ (p - y) + w
            hess = (x * (p * (1 - p))[:, None]).T @ x + np.eye(2)
            w = w - np.clip(np.linalg.solve(hess, grad), -1.0, 1.0)
        self.fit = (float(w[0]), float(w[1]))

    # --- decisions --------------------------------------------------------------------------------

    def k(self, remaining: int) -> int:
        most = super().k(remaining)
        if most == 0 or not self.times:
            return 0                      # first a plain step: its time is the yardstick
        if self.propose_s is None:
            return most                   # then a block, to time the draft and a verify
        if self.probing:
            self.probing -= 1
            return most
        k, rate = self._best(np.full(most, self._rate()))
        if rate > 1.0 / self._verify_s(1):
            return k
        self.since_probe += 1
        if self.since_probe < self.probe:
            return 0
        self.since_probe, self.probing = 0, self.PROBE_CYCLES - 1
        self.probe = min(2 * self.probe, 256)
        return most

    def truncate(self, k: int, confidence: np.ndarray) -> int:
        if self.propose_s is None or len(self.rows) < 16:
            return k
        return self._best(self._acceptance(np.array(confidence[:k], np.float64)))[0]

    def record_verify(self, k, accepted, confidence, propose_s, verify_s) -> None:
        self.propose_s = propose_s if self.propose_s is None else 0.8 * self.propose_s + 0.2 * propose_s
        self.times = (self.times + [(k + 1, verify_s)])[-self.HISTORY:]
        seen = min(accepted + 1, k)       # rows decided: the accepted ones and the first rejected
        self.rows = (self.rows + [(float(c), i < accepted) for i, c in enumerate(confidence[:seen])])[-self.HISTORY:]
        self._refit()
        if self._best(np.full(self.most, self._rate()))[1] > 1.0 / self._verify_s(1):
            self.probe = self.first_probe  # drafting pays again: probe soon once it stops

    def record_plain(self, seconds: float) -> None:
        self.times = (self.times + [(1, seconds)])[-self.HISTORY:]


def speculative_tokens(model, cache: Cache, draft_cache: DraftCache, prompt_logits: mx.array,
                       sampling: Sampling, limit: int, policy: Policy,
                       stats: Optional[Stats] = None) -> Iterator[int]:
    """Tokens from the prompt's last logits [1, V] on, as `decode_tokens` gives them (greedy:
    the same tokens; sampled: the same distribution), until closed or `limit` are out (the
    last is not fed). `draft_cache` holds the main KV of the prompt's positions (Draft.seed
    after each prefill chunk). Once closed or done, the cache holds everything but the last
    token handed out, as after a plain loop."""
    adjust = LogitAdjustment(sampling, prompt_logits.shape[-1])
    first = int(picker(sampling.temp, sampling.top_p)(adjust(prompt_logits)).item())
    yield from drafted_tokens(model, cache, draft_cache, first, sampling, limit, policy, stats, adjust)


def drafted_tokens(model, cache: Cache, draft_cache: DraftCache, first: int, sampling: Sampling,
                   limit: int, policy: Policy, stats: Optional[Stats] = None,
                   adjust: Optional[LogitAdjustment] = None) -> Iterator[int]:
    """`first` (the pending token: sampled, not yet in the cache) and the tokens after it, as
    `speculative_tokens` gives them; the penalties count from `first` on unless `adjust` brings
    counts of its own (the server's lone session continues from tokens decoded before)."""
    if cache.tokens.shape[0] != 1:
        raise ValueError("speculative decoding runs one sequence at a time")
    stats = stats if stats is not None else Stats()
    adjust = adjust if adjust is not None else LogitAdjustment(sampling, model.args.vocab_size)
    pick = picker(sampling.temp, sampling.top_p)
    adjust.count(mx.array([first]))
    target = Target(model, cache)
    drafter = FixedDraft(model, draft_cache) if use_fixed_propose(model) else ReferenceDraft(model, draft_cache)

    # DSV4_DRAFT_PIPELINE: the next cycle's propose is queued behind the verify, from the device's
    # acceptance, before the host waits for it; so the device runs the propose while the host
    # reads the acceptance, hands the tokens out and queues the next verify.
    pipelined = isinstance(drafter, FixedDraft) and flags.get("draft_pipeline")

    def queue(remaining: int, token, advance: Optional[mx.array] = None) -> tuple[int, Optional[Proposal], float]:
        """(k, the propose of the cycle after `token` started on the device, the seconds that
        took): k from the policy for `remaining` tokens, 0 meaning a plain step; `advance`: the
        positions the window's end moves by once the host knows the acceptance."""
        t0 = time.perf_counter()
        k = policy.k(remaining)
        proposal = drafter.propose(token, k, adjust, sampling, advance) if k else None
        if proposal is not None:
            mx.async_eval(*[a for a in (proposal.drafts, proposal.q_logits, proposal.confidence) if a is not None])
        return k, proposal, time.perf_counter() - t0

    start, handed = target.offset, 0
    out, y = [], first        # tokens to hand out, then the pending one
    queued = None             # the next cycle's (k, proposal, seconds), where already queued
    try:
        while True:
            # The next cycle's propose runs on the device while these tokens are handed out.
            after = handed + len(out) + 1
            if queued is None and after < limit:
                queued = queue(limit - after, y)
            for token in out + [y]:
                handed += 1      # counted before the yield: a close there has handed it out
                yield token
                if handed == limit:
                    return
            (k, proposal, queued_s), queued = queued, None
            k = min(k, limit - handed - 1)   # a pipelined queue knew only the most tokens left
            t0 = time.perf_counter()
            if k <= 0:
                logits, hidden = target.feed(mx.array([y], mx.int32))
                drafter.seed(hidden)
                out, y = [], int(pick(adjust(logits)).item())
                drafter.keep(1)
                adjust.count(mx.array([y]))
                seconds = time.perf_counter() - t0
                stats.plain_steps += 1
                stats.plain_s += seconds
                policy.record_plain(seconds)
                continue
            k = policy.truncate(k, proposal.confidence)
            if k < proposal.drafts.shape[0]:
                proposal = Proposal(proposal.drafts[:k], None if proposal.q_logits is None
                                    else proposal.q_logits[:k], proposal.confidence[:k])
            t1 = time.perf_counter()
            logits, hidden = target.feed(mx.concatenate([mx.array([y], mx.int32), proposal.drafts]))
            drafter.seed(hidden)
            j, nxt = accept(adjust.rows(logits, proposal.drafts), proposal, sampling)
            adjust.count(proposal.drafts, j)
            adjust.count(nxt.reshape(1))
            mx.async_eval(j, nxt, proposal.drafts, proposal.confidence)
            next_s = 0.0
            if pipelined and handed + 1 < limit:
                queued = queue(limit - handed - 1, nxt, j + 1)
                next_s = queued[2]
            j, nxt, drafts = j.item(), nxt.item(), proposal.drafts.tolist()     # the cycle's one sync
            confidence = np.array(proposal.confidence)
            target.rewind(k - j)
            drafter.keep(j + 1)
            t2 = time.perf_counter()
            propose_s = queued_s + t1 - t0
            verify_s = t2 - t1 - next_s
            stats.verifies += 1
            stats.drafted += k
            stats.accepted += j
            stats.accepted_at += [0] * (k - len(stats.accepted_at))
            for row in range(j):
                stats.accepted_at[row] += 1
            stats.propose_s += propose_s
            stats.verify_s += verify_s
            policy.record_verify(k, j, confidence[:k], propose_s, verify_s)
            out, y = drafts[:j], nxt
    finally:
        excess = target.offset - (start + handed - 1)
        if excess > 0:
            target.rewind(excess)
        target.close()
        drafter.close()
