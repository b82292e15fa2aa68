"""Prefill on the shape-true V4.1 slice: dsv4 vs mlx-lm, and against the compute roofline.

    python -m benchmarks.slice_prefill [--contexts 4096,32768] [--repeats 2] [--small]
                                       [--ab SWITCH=VALUE[+SWITCH=VALUE]] ...

The slice, its random weights and both models are benchmarks/slice_decode.py's. Each engine
prefills `--contexts` random tokens its own way (dsv4: generation.prefill, chunks of
PREFILL_CHUNK; mlx-lm: generate_step's prompt processing, prefill_step_size 2048) up to the
first token's logits, timed from the call to the evaluated logits; the engines alternate,
after one warm-up prefill of each at each length (a first prefill at a new length builds and
traces kernels for its shapes; once only at 1024 tokens, the first engine timed at 32K took
15.5 s where the next ones took 4-6, benchmarks/results/2026-12-04-0833-slice-prefill.md).

The compute roofline is the FLOPs one prompt token costs on the slice (counted from the
weights and the shapes, `flops_per_token`) over the bf16 matmul rate torch measures in the
same process (`benchmarks/roofline.py`): the tokens/s a prefill would reach if every FLOP ran
at that rate. Counted: every matmul of a layer (dense projections, the shared expert, the
router, top-k of the routed experts), the attention over each query's window and selected
compressed rows, the indexer's scores over the rows it sees; not counted: the head (one
position per prompt), norms, mHC and the other elementwise work.
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
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.slice_decode import REAL, ROLES, SMALL, ab_switches, build  # noqa: E402

GROUP = 32   # weights per scale in the slice's mxfp4 / mxfp8 layouts


def matmul_flops(model) -> float:
    """2 x the weight elements one token multiplies by in the layers: the routed experts at
    top-k of E, the embedding and the head left out."""
    args, params = model.args, dict(tree_flatten(model.parameters()))
    total = 0.0
    for name, p in params.items():
        if not name.endswith(".weight") or name.startswith(("embed.", "head.")) or ".layers." not in f".{name}":
            continue
        scales = params.get(name[:-len("weight")] + "scales")
        # Packed codes: count the weights (a scale per group of 32), not the uint32 words.
        elements = p.size if scales is None else scales.size * GROUP
        if ".experts.w" in name:
            elements = elements * args.num_experts_per_tok / args.n_routed_experts
        if p.ndim >= 2:
            total += 2 * elements
    return total


def attention_flops(args, context: int) -> float:
    """Per prompt token, averaged over positions 0..context-1: the sparse attention (scores and
    values over the window and the selected compressed rows, every head) and the indexer's
    scores over every row its query sees."""
    t = np.arange(context)
    total = 0.0
    for layer in range(args.num_hidden_layers):
        ratio = args.ratio(layer)
        rows = np.minimum(args.sliding_window, t + 1).astype(np.float64)
        if ratio:
            visible = (t + 1) // ratio
            rows = rows + np.minimum(args.index_topk, visible)
            if layer in args.index_source_layer_ids:
                total += float(np.mean(2 * args.index_n_heads * args.index_head_dim * visible))
        total += float(np.mean(4 * args.num_attention_heads * args.head_dim * rows))
    return total


def flops_per_token(model, context: int) -> float:
    return matmul_flops(model) + attention_flops(model.args, context)


def prefill_dsv4(model, context: int) -> float:
    """Seconds from the call to the evaluated logits of the last prompt position."""
    from dsv4.generation import prefill

    ids = np.random.default_rng(context).integers(7, model.args.vocab_size, (1, context))
    cache = model.make_cache()
    start = time.perf_counter()
    mx.eval(prefill(model, ids, cache))
    return time.perf_counter() - start


def prefill_with(changed: dict, model, context: int) -> float:
    from dsv4 import flags

    with flags.override(**changed):
        return prefill_dsv4(model, context)


def prefill_mlx_lm(rmodel, context: int) -> float:
    """The same through mlx-lm's generate_step, up to its first token."""
    from mlx_lm.generate import generate_step

    ids = np.random.default_rng(context).integers(7, rmodel.args.vocab_size, (context,))
    start = time.perf_counter()
    for _ in generate_step(mx.array(ids), rmodel, max_tokens=1, prefill_step_size=2048,
                           prompt_cache=rmodel.make_cache(), sampler=lambda l: mx.argmax(l, axis=-1)):
        break
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--small", action="store_true", help="toy widths (CPU)")
    p.add_argument("--variants", default="dsv4,mlx-lm", help="comma-separated, from: dsv4, mlx-lm")
    p.add_argument("--ab", action="append", default=[], metavar="SWITCH=VALUE[+SWITCH=VALUE]",
                   help="add a dsv4 variant with these switches (dsv4/flags.py names) changed, "
                        "e.g. --ab prefill_chunk=2048+prefill_eval_layers=async; repeatable")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated
    from benchmarks.roofline import matmul_roofline

    config = {**(SMALL if a.small else REAL), **ROLES}
    t0 = time.perf_counter()
    model, rmodel, _ = build(config)
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    rate = matmul_roofline()   # TFLOP/s; None on the CPU
    if rate:
        print(f"roofline: torch bf16 matmul {rate:.0f} TFLOP/s", flush=True)
    runs = {"dsv4": lambda c: prefill_dsv4(model, c), "mlx-lm": lambda c: prefill_mlx_lm(rmodel, c)}
    runs = {name: runs[name] for name in a.variants.split(",") if name}
    for spec in a.ab:
        runs[f"dsv4 {spec}"] = lambda c, changed=ab_switches(spec): prefill_with(changed, model, c)
    rows, results = [], {}
    for context in [int(c) for c in a.contexts.split(",")]:
        flops = flops_per_token(model, context)
        for name, run in list(runs.items()):   # at this length: kernel builds and traces of new shapes
            try:
                print(f"warm-up {name} at {context}: {run(context):.1f} s", flush=True)
            except Exception as e:   # one broken variant must not cost the others' numbers
                print(f"warm-up {name}: FAILED {type(e).__name__}: {e}", flush=True)
                del runs[name]
        times = {name: [] for name in runs}
        for r in range(a.repeats):
            for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                try:
                    times[name].append(runs[name](context))
                except Exception as e:
                    print(f"context {context} {name}: FAILED {type(e).__name__}: {e}", flush=True)
                    continue
                print(f"context {context} {name}: {context / times[name][-1]:.0f} tokens/s", flush=True)
        for name, ts in times.items():
            if not ts:
                rows.append(f"| {context} | {name} | failed | | | |")
                continue
            s = statistics.median(ts)
            tps = context / s
            share = f"{100 * tps * flops / (rate * 1e12):.1f}%" if rate else "-"
            results[f"{context}/{name}"] = dict(seconds=ts, tps=tps, flops_per_token=flops)
            rows.append(f"| {context} | {name} | {s:.2f} [{min(ts):.2f}-{max(ts):.2f}] | {tps:.0f} | "
                        f"{tps * flops / 1e12:.1f} | {share} |")
    when = datetime.now()
    roof = (f"Compute roofline, this process: torch's bf16 matmul {rate:.0f} TFLOP/s (8192^3, "
            "`benchmarks/roofline.py`)." if rate else "No CUDA torch: no compute roofline.")
    lines = [f"# Prefill on a {'toy-width' if a.small else 'shape-true'} V4.1 slice: dsv4 vs mlx-lm", "",
             f"{when:%Y-%m-%d %H:%M}; {model.args.num_hidden_layers} layers (roles "
             f"{ROLES['compress_ratios']}), experts mxfp4, dense mxfp8; median [min-max] of "
             f"{a.repeats} alternating repeats after one warm-up prefill of each engine at each length.",
             f"FLOPs per prompt token (the layers' matmuls {matmul_flops(model) / 1e9:.2f} GFLOP, "
             "plus attention and indexer, which grow with the context; see the script's help).", "",
             "| context | engine | seconds [min-max] | tokens/s | TFLOP/s | of the compute roofline |",
             "|---|---|---|---|---|---|", *rows, "", roof, "", to_markdown(describe())]
    write_dated(a.out, when, f"slice-prefill{'-small' if a.small else ''}", lines, data=results, shown=8 + len(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
