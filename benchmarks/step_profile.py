"""Where one fixed-shape decode step's time goes: host encode vs GPU, and GPU time per kernel.

    python -m benchmarks.step_profile [--small] [--context 512] [--kernels] [--verify N | --propose K]
                                      [--experts q2 --dense q8_0 --routed-experts 192] [--out DIR]

On the shape-true slice of benchmarks/slice_decode.py (or `--small`), after a prefill and a
warm-up, with the decode loop's run-ahead (one step in flight):

- split: per step, the host time to build and queue the next step (`step(y)` + `async_eval`:
  the compiled graph's replay and MLX's encoding of every primitive; "of which the graph": up to
  `async_eval`, the Python step and the replay) and the time then spent
  waiting for the current token; the same steps chained without any host read; and, one step
  at a time, encode then the GPU's remaining run. When encode >= the whole step, the host is
  the bottleneck and only fewer primitives help; when the wait dominates, the GPU is.
- `--kernels` (CUDA, needs Nsight Compute's `ncu` on PATH or in /usr/local/cuda/bin): re-runs
  itself under ncu around exactly one step and lists every kernel family with its launches,
  GPU time, DRAM bytes read and their rate. ncu runs kernels one at a time at locked clocks,
  so the total is longer than a real step; the shares are what to read.
- `--verify N`: the same for DSpark's verify of N positions instead of a decode step: the
  slice with draft stages (benchmarks/speculative_steps.py), FixedDecoder.feed of N tokens with
  the draft stages' inputs, as speculative.Target runs it, rewound after each; the split then
  has no run-ahead (a verify's rows are read before the next is built): encode, then the GPU.
- `--propose K`: the same for DSpark's fixed-shape propose of K drafts (dsv4/draft_step.py
  FixedDraft.propose, greedy: the draft block through the three stages, the head, the Markov
  head between the K picks) over the draft window a prefill seeded; encode, then the GPU.

Writes a dated Markdown report under --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

# One pass of ncu's counters: metrics needing more passes (the stall reasons) replay every launch
# and save and restore the slice's ~30 GB of buffers each time, which outlasted a 555 s device call
# on 2026-12-06; profile those on a single launch (benchmarks/ncu_experts.py) instead.
NCU_METRICS = "gpu__time_duration.sum,dram__bytes_read.sum"


def decoder_after_prefill(model, context: int):
    """(cache, the decoder the switches pick, the first token) after a prefilled context."""
    from benchmarks.slice_decode import prefilled
    from dsv4.step import decoder

    cache, first = prefilled(model, context)
    return cache, decoder(model, cache), first


def split(model, context: int, steps: int) -> dict:
    """Median ms per step of: encode (host), wait (for the token in flight), the loop's step;
    chained steps; one step at a time (encode, then the GPU's remaining run)."""
    cache, step, y = decoder_after_prefill(model, context)
    mx.eval(y)
    encode, graph, wait = [], [], []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        ahead = mx.argmax(step(y), axis=-1)
        tg = time.perf_counter()
        mx.async_eval(ahead)
        t1 = time.perf_counter()
        int(y.item())
        wait.append(time.perf_counter() - t1)
        encode.append(t1 - t0)
        graph.append(tg - t0)
        y = ahead
    int(y.item())
    loop = (time.perf_counter() - start) / steps
    start = time.perf_counter()
    for _ in range(steps):
        y = mx.argmax(step(y), axis=-1)
        mx.async_eval(y)
    mx.eval(y)
    chained = (time.perf_counter() - start) / steps
    alone = []
    for _ in range(steps):
        t0 = time.perf_counter()
        y = mx.argmax(step(y), axis=-1)
        mx.async_eval(y)
        t1 = time.perf_counter()
        mx.eval(y)
        alone.append((t1 - t0, time.perf_counter() - t1))
    step.close(cache.offset)
    ms = lambda v: 1e3 * statistics.median(v)
    return {"loop": 1e3 * loop, "encode": ms(encode), "graph": ms(graph), "wait": ms(wait), "chained": 1e3 * chained,
            "alone encode": ms([a for a, _ in alone]), "alone run": ms([b for _, b in alone])}


def encode_then_run(queue, steps: int, after=lambda: None) -> dict:
    """Median ms of `steps` calls, one at a time: encode (host, up to queue() returning the
    arrays it queued), then the GPU's remaining run; `after` follows each call."""
    alone = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = queue()
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.eval(out)
        alone.append((t1 - t0, time.perf_counter() - t1))
        after()
    ms = lambda v: 1e3 * statistics.median(v)
    return {"encode": ms([a for a, _ in alone]), "run": ms([b for _, b in alone])}


def verify_split(model, context: int, n: int, steps: int) -> dict:
    """Median ms of one n-position verify (feed with the draft stages' inputs, rewound after):
    encode (host, up to the queued step), then the GPU's remaining run."""
    cache, dec, y = decoder_after_prefill(model, context)
    tokens = mx.broadcast_to(y.astype(mx.int32).reshape(1, 1), (1, n))
    times = encode_then_run(lambda: list(dec.feed(tokens, hidden=True)), steps, lambda: dec.rewind(n))
    dec.close(cache.offset)
    return {"verify": times["encode"] + times["run"], **times}


def draft_prefill(model, context: int):
    """(the draft window a prefilled context seeded, the greedy token after it)."""
    from dsv4.generation import prefill

    ids = np.random.default_rng(context).integers(7, model.args.vocab_size, (1, context))
    cache, window = model.make_cache(), model.draft.make_cache()
    token = int(mx.argmax(prefill(model, ids, cache, draft_cache=window), axis=-1).item())
    return window, token


def proposer(model, window, token: int):
    """(FixedDraft over `window`, greedy propose(token, k))."""
    from dsv4.draft_step import FixedDraft
    from dsv4.sampling import LogitAdjustment, Sampling

    greedy = Sampling()
    fixed, adjust = FixedDraft(model, window), LogitAdjustment(greedy, model.args.vocab_size)
    return fixed, lambda k: fixed.propose(token, k, adjust, greedy)


def proposer_after_prefill(model, context: int):
    """(FixedDraft over the draft window a prefilled context seeded, greedy propose(token, k))."""
    return proposer(model, *draft_prefill(model, context))


def propose_split(model, context: int, k: int, steps: int) -> dict:
    """Median ms of one fixed-shape propose of k drafts: encode (host), then the GPU's run."""
    from benchmarks.speculative_steps import proposal_arrays

    fixed, propose = proposer_after_prefill(model, context)
    times = encode_then_run(lambda: proposal_arrays(propose(k)), steps)
    fixed.close()
    return {"propose": times["encode"] + times["run"], **times}


def kernel_family(name: str) -> str:
    """A readable family name: dsv4 kernels without their template suffix, MLX kernels
    without their arguments."""
    name = re.sub(r"\(.*", "", name).replace("void ", "")
    m = re.match(r"(?:mlx::)?custom_kernel_(dsv4_[a-z0-9_]+?)_(?:bfloat16|float|half|uint|int|bool|[0-9])", name)
    return m.group(1) if m else name[:80]


def ncu_kernels(text: str) -> list[dict]:
    """ncu --csv output -> each profiled launch in launch order: {"name": kernel name, metric: value}."""
    lines = text[text.index('"ID"'):] if '"ID"' in text else ""
    per_kernel = collections.defaultdict(dict)   # keeps the IDs' (launch) order
    for row in csv.DictReader(io.StringIO(lines)):
        if row.get("Metric Name"):
            per_kernel[row["ID"]]["name"] = row["Kernel Name"]
            per_kernel[row["ID"]][row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    return list(per_kernel.values())


def summarize_ncu(text: str) -> list[tuple[str, int, float, float]]:
    """ncu --csv output -> [(family, launches, µs, DRAM bytes read)], by time."""
    families = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k in ncu_kernels(text):
        f = families[kernel_family(k["name"])]
        f[0] += 1
        f[1] += k.get("gpu__time_duration.sum", 0.0) / 1e3      # ns -> µs
        f[2] += k.get("dram__bytes_read.sum", 0.0)
    return sorted(((n, c, t, b) for n, (c, t, b) in families.items()), key=lambda r: -r[2])


def ncu_path() -> str | None:
    cuda_ncu = "/usr/local/cuda/bin/ncu"
    return shutil.which("ncu") or (cuda_ncu if os.path.exists(cuda_ncu) else None)


def profiled_step(model, context: int, verify: int = 0, propose: int = 0) -> None:
    """One step (or one verify of `verify` positions, or one propose of `propose` drafts) between
    cuProfilerStart/Stop (what `ncu --profile-from-start off` records)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    if propose:
        from benchmarks.speculative_steps import proposal_arrays

        fixed, make = proposer_after_prefill(model, context)
        run, done = lambda: mx.eval(proposal_arrays(make(propose))), fixed.close
    else:
        cache, step, y = decoder_after_prefill(model, context)
        done = lambda: step.close(cache.offset)
        if verify:
            tokens = mx.broadcast_to(y.astype(mx.int32).reshape(1, 1), (1, verify))
            run = lambda: (mx.eval(step.feed(tokens, hidden=True)), step.rewind(verify))
        else:
            run = lambda: mx.eval(mx.argmax(step(y), axis=-1))
    for _ in range(6):                       # kernels built, graphs traced and cached
        run()
    mx.synchronize()
    cuda.cuProfilerStart()
    run()
    mx.synchronize()
    cuda.cuProfilerStop()
    done()


def profiled_what(a) -> str:
    return (f"a propose of {a.propose} drafts" if a.propose else f"a verify of {a.verify} positions"
            if a.verify else "one step")


def ncu_table(args: list[str], what: str) -> list[str]:
    """Report lines: every kernel family that `python -m <args>` runs between cuProfilerStart
    and Stop, under ncu (one pass of NCU_METRICS), or why there are none."""
    ncu = ncu_path()
    if ncu is None:
        return ["", "--kernels: no ncu found; kernel table skipped."]
    cmd = [ncu, "--profile-from-start", "off", "--metrics", NCU_METRICS, "--csv", sys.executable, "-m", *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    rows = summarize_ncu(out.stdout)
    if not rows:
        tail = (out.stdout + out.stderr).strip().splitlines()[-1:] or ["(no output)"]
        print((out.stdout + out.stderr)[-3000:], file=sys.stderr)
        return ["", f"--kernels: ncu recorded no kernels (exit status {out.returncode}): {tail[0]}"]
    total = sum(t for _, _, t, _ in rows)
    return ["", f"Kernels of {what} under ncu: "
            f"{sum(c for _, c, _, _ in rows)} launches, {total:.0f} µs of GPU time at ncu's locked clocks.", "",
            "| kernel | launches | µs | share | DRAM MB read | TB/s |", "|---|---|---|---|---|---|",
            *[f"| `{n}` | {c} | {t:.1f} | {100 * t / total:.1f}% | {b / 1e6:.2f} | "
              f"{b / (t * 1e-6) / 1e12 if t else 0:.2f} |" for n, c, t, b in rows]]


def kernel_table(a) -> list[str]:
    """ncu_table of one profiled step (or verify, or propose) of this script's slice."""
    args = ["benchmarks.step_profile", "--profiled-step", "--context", str(a.context), "--verify", str(a.verify),
            "--propose", str(a.propose), "--experts", a.experts, "--dense", a.dense]
    args += ["--routed-experts", str(a.routed_experts)] if a.routed_experts else []
    return ncu_table(args + (["--small"] if a.small else []), profiled_what(a))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="toy widths (CPU)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--kernels", action="store_true", help="also profile one step's kernels under ncu")
    p.add_argument("--verify", type=int, default=0, help="profile a verify of N positions instead")
    p.add_argument("--propose", type=int, default=0, help="profile a fixed propose of K drafts instead")
    p.add_argument("--experts", default="mxfp4", help="routed experts: mxfp4 or a ds4 GGUF recipe (slice_decode's)")
    p.add_argument("--dense", default="mxfp8", help="dense projections: mxfp8 or q8_0 (slice_decode's)")
    p.add_argument("--routed-experts", type=int, help="routed experts a layer holds (slice_decode's)")
    p.add_argument("--profiled-step", action="store_true", help=argparse.SUPPRESS)   # the run under ncu
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    if a.verify and a.propose:
        p.error("--verify and --propose: one at a time")
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated
    from benchmarks.slice_decode import REAL, ROLES, SMALL, build, parse_recipes
    from dsv4 import flags

    # The ncu run first: its process then has the GPU's memory to itself (this one, holding a
    # slice with draft stages and MLX's cache, left it too little).
    kernel_lines = kernel_table(a) if a.kernels and not a.profiled_step else []
    recipes = parse_recipes(p, a.experts, a.dense)
    if len(recipes) != 1:
        p.error(f"--experts {a.experts}: one recipe at a time")
    (experts, dense), = recipes
    config = {**(SMALL if a.small else REAL), **ROLES}
    if a.routed_experts:
        config["n_routed_experts"] = a.routed_experts
    model, _, _ = build(config, experts, dense)
    if a.verify or a.propose:
        from benchmarks.speculative_steps import DRAFT, DRAFT_SMALL, with_draft

        with_draft(model, {**config, **(DRAFT_SMALL if a.small else DRAFT)})
    with flags.override(fixed_decode="on", fixed_propose="on"):
        if a.profiled_step:
            profiled_step(model, a.context, a.verify, a.propose)
            return 0
        if a.propose:
            measure = lambda c, s: propose_split(model, c, a.propose, s)
        elif a.verify:
            measure = lambda c, s: verify_split(model, c, a.verify, s)
        else:
            measure = lambda c, s: split(model, c, s)
        measure(64, 4)                       # warm-up: kernel builds, traces
        runs = [measure(a.context, a.steps) for _ in range(3)]
    when = datetime.now()
    what = profiled_what(a) if a.verify or a.propose else "decode step"
    lines = [f"# {what[0].upper() + what[1:]} profile: {'toy-width' if a.small else 'shape-true'} V4.1 slice", "",
             f"{when:%Y-%m-%d %H:%M}; context {a.context}, experts {experts}, dense {dense}"
             f"{f', {a.routed_experts} routed experts' if a.routed_experts else ''}, {a.steps} steps per run, "
             "3 runs (medians per step, ms).", ""]
    first = "propose" if a.propose else "verify" if a.verify else None
    columns = ((first, "encode", "run") if first else
               ("loop", "encode", "graph", "wait", "chained", "alone encode", "alone run"))
    lines += ([f"| run | {first} | encode (host) | GPU after encode |", "|---|---|---|---|"] if first else
              ["| run | loop step | encode (host) | of which the graph | wait for token | chained | alone: encode "
               "| alone: GPU after encode |", "|---|---|---|---|---|---|---|---|"])
    for i, r in enumerate(runs):
        lines.append(f"| {i + 1} | " + " | ".join(f"{r[k]:.2f}" for k in columns) + " |")
    lines += kernel_lines
    lines += ["", to_markdown(describe())]
    tag = (f"-verify{a.verify}" if a.verify else "") + (f"-propose{a.propose}" if a.propose else "") + \
        ("-small" if a.small else "") + ("" if (experts, dense) == ("mxfp4", "mxfp8") else f"-{experts}-{dense}")
    write_dated(a.out, when, f"step-profile{tag}", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
