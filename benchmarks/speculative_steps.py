"""What a speculative cycle costs on the shape-true V4.1 slice with DSpark draft stages, against
one plain decode step: the verify of k+1 = 2..6 positions, the propose of k drafts, in ms;
from those the break-even acceptance and the speedup to expect at given acceptance rates.

    python -m benchmarks.speculative_steps [--context 512] [--repeats 20] [--small | --model DIR]
                                           [--experts q2|q4] [--dense q8_0]

The slice is benchmarks/slice_decode.py's (real widths, 7 layers with every role, random
quantized weights as the official checkpoint stores them, or with --experts / --dense the
backbone's routed experts and dense projections as ds4's GGUF blocks) plus three draft stages at V4.1's
shapes (128 routed experts of 2304 in mxfp4, top-3, Markov rank 256, main_proj 15360 -> 5120
in mxfp8) reading the slice's last three layers. At `--context` positions:
  * plain: ms per token of plain decode as generation runs it (decode_tokens: the fixed-shape
    compiled step on GPUs, the reference forward on the CPU, one step run ahead) — the yardstick;
  * verify(n): one step of n positions with the draft stages' hidden means, as
    dsv4/speculative.py runs it (`Target`: at fixed shapes where DSV4_FIXED_VERIFY is on, the
    GPU's default, else the reference forward over the Cache), the target's rows through the
    acceptance, then the positions taken back (exact) so every repeat is alike; verify(1) is
    that path's own single step (the cycle's plain step);
  * propose(k): the draft block (three stages over the window and the block's 5 rows), the
    head, and k draft picks (the Markov head between them), both ways, interleaved: `reference`
    op by op over the DraftCache, `fixed` one compiled graph over the window's rings
    (dsv4/draft_step.py, DSV4_FIXED_PROPOSE);
  * seed(n): the draft window taking a verify's n rows (main_proj, each stage's window KV),
    both ways (the fixed seed writes all n rows; the reference, as the loop does, the kept ones:
    here all n);
  * cycle(k): dsv4/speculative.py's loop itself (drafted_tokens, k drafts a cycle, greedy) over
    --cycle-tokens tokens, ms per cycle, with each propose path (the verify the switches pick;
    `pipelined`: the fixed propose queued from the device's acceptance, DSV4_DRAFT_PIPELINE);
    with the slice's random draft stages nearly every draft is rejected, so a cycle makes one
    token and its time is the propose, the verify and the loop's own host work.
A cycle verifying k drafts at acceptance a yields (1 - a^(k+1)) / (1 - a) tokens in
propose(k) + verify(k+1); its speedup over plain decode is that over the tokens plain decode
makes in the same time. `--small` runs the same at toy widths (for the CPU); `--model` on a
checkpoint's own draft stages (`demo`: the bundled demo, whose stages are trained).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.slice_decode import (GGUF_EXPERTS, REAL, ROLES, SMALL, build, decode_dsv4,  # noqa: E402
                                     quantize_randomly)

DRAFT = dict(num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=128799,
             dspark_target_layer_ids=[4, 5, 6], dspark_markov_rank=256, dspark_n_routed_experts=128,
             dspark_num_experts_per_tok=3)
DRAFT_SMALL = dict(DRAFT, dspark_noise_token_id=4000, dspark_markov_rank=64, dspark_n_routed_experts=16)
ACCEPTANCE = (0.5, 0.6, 0.7, 0.8, 0.9)


def with_draft(model, config: dict) -> None:
    """Random draft stages for the slice model, quantized as the official ones."""
    from dsv4.config import ModelArgs
    from dsv4.draft import Draft

    args = ModelArgs.from_dict({**config, "compress_ratios": config["compress_ratios"] + [0, 0, 0]})
    model.args = args   # the forward hands out the draft stages' inputs by its config
    draft = Draft(args)
    quantize_randomly(draft)
    model.draft = draft


def interleaved(variants: dict, repeats: int) -> dict[str, list[float]]:
    """ms of each call of each variant (which evaluates what it computes), A B B A ..., after
    one untimed call of each."""
    for fn in variants.values():
        fn()
    out = {name: [] for name in variants}
    for r in range(repeats):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            t = time.perf_counter()
            variants[name]()
            out[name].append((time.perf_counter() - t) * 1e3)
    return out


def timed(fn, repeats: int) -> list[float]:
    """ms of each call of fn (which evaluates what it computes), after one untimed call."""
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


# The loop's propose paths: op by op, the fixed-shape graph waiting for each acceptance, and the
# fixed-shape graph queued from the device's acceptance (DSV4_DRAFT_PIPELINE).
PROPOSE_PATHS = {"reference": dict(fixed_propose=False), "fixed": dict(fixed_propose=True, draft_pipeline=False),
                 "pipelined": dict(fixed_propose=True, draft_pipeline=True)}
PLAIN_STEPS = 16   # the fewest steps a plain decode run times


def measure(model, context: int, repeats: int, cycle_tokens: int) -> dict[str, list[float]]:
    from dsv4 import flags
    from dsv4.draft_step import FixedDraft
    from dsv4.generation import prefill
    from dsv4.sampling import LogitAdjustment, Sampling
    from dsv4.speculative import Target, accept, propose

    args, draft = model.args, model.draft
    ids = np.random.default_rng(context).integers(7, args.vocab_size, (1, context))
    cache, window = model.make_cache(), draft.make_cache()
    logits = prefill(model, ids, cache, draft_cache=window)
    token = int(mx.argmax(logits, axis=-1).item())
    greedy = Sampling()
    adjust = LogitAdjustment(greedy, args.vocab_size)
    times: dict[str, list[float]] = {}

    # Plain decode as generation runs it (decode_tokens: the decoder and run-ahead the switches
    # pick), three runs of PLAIN_STEPS or more steps after an untimed one: untimed, the first run's
    # compile (42-47 ms a token on the H200) left the median to two runs of `repeats` steps.
    decode_dsv4(model, context, 2)
    times["plain"] = [decode_dsv4(model, context, max(repeats, PLAIN_STEPS))[0] for _ in range(3)]

    target = Target(model, cache)
    verified = {}
    for n in range(1, 7):
        drafts = mx.array(np.random.default_rng(n).integers(7, args.vocab_size, n - 1), mx.int32)

        def verify():
            rows, hidden = target.feed(mx.concatenate([mx.array([token], mx.int32), drafts]))
            verified[n] = hidden
            if n > 1:
                j, nxt = accept(adjust.rows(rows, drafts), _proposal(drafts), greedy)
            else:
                j, nxt = mx.array(0), mx.argmax(rows[-1])
            mx.eval(j, nxt, hidden)
            target.rewind(n)

        times[f"verify({n})"] = timed(verify, repeats)
    target.close()

    fixed = FixedDraft(model, window.copy())
    for k in range(1, args.dspark_block_size + 1):
        times.update(interleaved({
            f"propose({k}) reference": lambda: mx.eval(proposal_arrays(propose(model, window, token, k, adjust, greedy))),
            f"propose({k}) fixed": lambda: mx.eval(proposal_arrays(fixed.propose(token, k, adjust, greedy)))}, repeats))
    for n in range(1, args.dspark_block_size + 2):
        hidden = verified[n]

        def seed_reference():
            twin = window.copy()
            draft.seed(twin, hidden, 1)
            mx.eval(twin.rows)

        def seed_fixed():
            fixed.seed(hidden)
            mx.eval(fixed.buffers)

        times.update(interleaved({f"seed({n}) reference": seed_reference, f"seed({n}) fixed": seed_fixed}, repeats))

    # The loop itself, continuing the cache and the window (each run ends with its last token
    # pending, the window's end at the cache's offset).
    runs = {}
    for k in sorted({1, 3, args.dspark_block_size}):
        for path in PROPOSE_PATHS:
            def run(k=k, path=path):
                nonlocal token
                with flags.override(**PROPOSE_PATHS[path]):
                    ms, token = cycle_times(model, cache, window, token, k, cycle_tokens)
                return [ms]
            runs[f"cycle({k}) {path}"] = run
    names = list(runs)
    for name in names:
        runs[name]()   # compiles
    for r in range(max(3, repeats // 2)):
        for name in (names if r % 2 == 0 else names[::-1]):
            times.setdefault(name, []).extend(runs[name]())
    return times


def proposal_arrays(proposal) -> list:
    """What a propose computes on the device (the drafts, their q logits, the confidence)."""
    return [a for a in (proposal.drafts, proposal.q_logits, proposal.confidence) if a is not None]


def cycle_times(model, cache, window, token: int, k: int, tokens: int) -> tuple[float, int]:
    """(mean ms per cycle of the speculative loop, greedy with k drafts a cycle, from `token`
    on over `tokens` tokens; the last token, pending)."""
    from dsv4.sampling import Sampling
    from dsv4.speculative import Policy, Stats, drafted_tokens

    stats = Stats()
    start = None
    for last in drafted_tokens(model, cache, window, token, Sampling(), tokens, Policy(k), stats):
        start = start or time.perf_counter()   # from the first token handed out
    return (time.perf_counter() - start) * 1e3 / stats.verifies, last


def _proposal(drafts):
    from dsv4.speculative import Proposal

    return Proposal(drafts, None, mx.zeros(drafts.shape))


def speedup(a: float, k: int, med: dict[str, float], path: str = "fixed") -> float:
    tokens = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
    return tokens * med["plain"] / (med[f"propose({k}) {path}"] + med[f"verify({k + 1})"])


def break_even(k: int, med: dict[str, float], path: str = "fixed") -> float:
    """The acceptance at which verifying k drafts a cycle matches plain decode (1 if never)."""
    lo, hi = 0.0, 0.999999
    if speedup(hi, k, med, path) < 1:
        return 1.0
    if speedup(lo, k, med, path) >= 1:
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(mid, k, med, path) < 1 else (lo, mid)
    return hi


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--cycle-tokens", type=int, default=16, help="tokens of each timed run of the loop")
    p.add_argument("--small", action="store_true", help="toy widths (CPU)")
    p.add_argument("--model", help="a checkpoint with draft stages instead of the slice ('demo': the bundled one)")
    p.add_argument("--experts", choices=("mxfp4", *GGUF_EXPERTS), default="mxfp4",
                   help="the slice's routed experts: the official mxfp4, or ds4's q2/q4 GGUF blocks (its shared expert Q8_0)")
    p.add_argument("--dense", choices=("mxfp8", "q8_0"), default="mxfp8",
                   help="the slice's dense projections: the official mxfp8 or ds4's GGUF Q8_0")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated

    t0 = time.perf_counter()
    if a.model:
        import dsv4
        from dsv4 import flags

        with flags.override(draft="on"):
            model = dsv4.load(None if a.model == "demo" else a.model)[0]
        what = f"the checkpoint {a.model} with its DSpark draft stages"
    else:
        config = {**(SMALL if a.small else REAL), **ROLES}
        model, _, _ = build(config, a.experts, a.dense)
        with_draft(model, {**config, **(DRAFT_SMALL if a.small else DRAFT)})
        what = f"a {'toy-width' if a.small else 'shape-true'} V4.1 slice with DSpark draft stages"
        if (a.experts, a.dense) != ("mxfp4", "mxfp8"):
            what += f" (backbone: routed experts {a.experts}, dense {a.dense}; the stages' in mxfp4/mxfp8)"
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    times = measure(model, a.context, a.repeats, a.cycle_tokens)
    from dsv4 import flags
    from dsv4.step import use_fixed_decode
    path = ("fixed-shape steps (DSV4_FIXED_VERIFY)" if flags.switch("fixed_verify", use_fixed_decode(model))
            else "the reference forward over the Cache")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    when = datetime.now()
    rows = [f"| {name} | {med[name]:.2f} [{min(ts):.2f}-{max(ts):.2f}] | {med[name] / med['plain']:.2f} |"
            for name, ts in times.items()]
    k_max = model.args.dspark_block_size
    gain = [f"| {k} | {break_even(k, med):.2f} | " + " | ".join(f"{speedup(x, k, med):.2f}" for x in ACCEPTANCE) + " |"
            for k in range(1, k_max + 1)]
    ratio4 = med["verify(4)"] / med["plain"]
    cycle = lambda k, path: f"{med[f'cycle({k}) {path}']:.2f}" if f"cycle({k}) {path}" in med else "-"
    paths = [f"| {k} | {med[f'propose({k}) reference']:.2f} | {med[f'propose({k}) fixed']:.2f} | "
             f"{med[f'propose({k}) reference'] / med[f'propose({k}) fixed']:.2f} | "
             f"{med[f'propose({k}) fixed'] / med['plain']:.2f} | {cycle(k, 'reference')} | {cycle(k, 'fixed')} | "
             f"{cycle(k, 'pipelined')} |"
             for k in range(1, k_max + 1)]
    lines = [f"# Speculative decoding step costs on {what}", "",
             f"{when:%Y-%m-%d %H:%M}; {model.args.num_hidden_layers} layers + "
             f"{model.args.num_nextn_predict_layers} draft stages, context "
             f"{a.context}, median [min-max] of {a.repeats} repeats after one untimed call "
             f"(cycle(k): of {max(3, a.repeats // 2)} runs of {a.cycle_tokens} tokens, each run's "
             f"mean per cycle); the verify through {path}.", "",
             "| step | ms | / plain step |", "|---|---|---|", *rows, "",
             f"A 4-position verify costs {ratio4:.2f}x a plain decode step (target: <= 1.4x).", "",
             "The propose both ways (ms, medians of interleaved calls) and the loop's cycle with each "
             "(ms per cycle: propose, verify, seed and the host's bookkeeping; pipelined: the fixed propose queued from the device's acceptance, DSV4_DRAFT_PIPELINE):", "",
             "| k | propose reference | propose fixed | reference / fixed | fixed / plain step | "
             "cycle reference | cycle fixed | cycle pipelined |", "|---|---|---|---|---|---|---|---|", *paths, "",
             "Speedup over plain decode by drafts per cycle k and acceptance a (per draft, given the "
             "ones before it accepted), with the fixed propose; break-even: the acceptance where "
             "drafting k pays nothing.", "",
             "| k | break-even a | " + " | ".join(f"a = {x}" for x in ACCEPTANCE) + " |",
             "|---|---|" + "---|" * len(ACCEPTANCE), *gain, "",
             *([] if a.model else [
                 "The slice has 7 of the 40 layers: on the full model the backbone's share of every step "
                 "grows about 40/7-fold while the propose stays the same, so the speedups here are lower "
                 "bounds for the same acceptance.", ""]), to_markdown(describe())]
    tag = "-demo" if a.model == "demo" else "-model" if a.model else "-small" if a.small else ""
    tag += "".join(f"-{v}" for v in (a.experts, a.dense) if v not in ("mxfp4", "mxfp8") and not a.model)
    write_dated(a.out, when, f"speculative-steps{tag}", lines, data={"context": a.context, "ms": times}, shown=-1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
