"""Launches of the fixed-shape step as a GPU backend builds it, counted on any machine.

    python -m benchmarks.gpu_path [--real] [--context 64] [--report]
    python -m benchmarks.gpu_path --positions 1,2,4,6 [--model DIR] [--report]
    python -m benchmarks.gpu_path --propose 1,3,5 [--model DIR] [--report]

Without Metal or CUDA every kernel dispatcher takes its plain-MLX reference, so counting the
step here (benchmarks/graph_ops.py) shows a graph no GPU runs. This tells every dispatcher
that a GPU backend is present (dialect.pretend_gpu) and stands in for each custom kernel call
with one node (zeros of the kernel's output shapes, made once before the step is traced, tied
to its inputs by `mx.depends`), then counts the compiled fixed-shape step of the shape-true
slice (benchmarks/slice_decode.py; toy widths by default, `--real` for V4.1's). Each stand-in
is one launch; the other primitives are what MLX launches itself (graph_ops.VIEWS launch
nothing). The count depends on the step's regimes: at `--context` c the step decodes position c.

`--propose`: DSpark's compiled greedy propose of k drafts (dsv4/draft_step.py) after a 64-token
prefill, on the same model as `--positions`: its launches and the dsv4 kernels among them.

`--positions`: steps of n positions (n = 1 the decode step; n > 1 DSpark's verify,
FixedDecoder.feed with the draft stages' inputs), each from the same position after a 64-token
prefill, with DSV4_KERNEL_ROWS_POSITIONS off and on, on the toy-width slice with draft stages
(or `--model`, a checkpoint with draft stages). A verify is encoded launch by launch by the
host (~14 µs a launch on the H200), so the count bounds how fast a host-bound one can be. There
mx.fast.rope, one kernel on a GPU and a dozen primitives as the CPU builds it, is stood in for
too.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from datetime import datetime
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

STAND_IN = "Depends"   # the node each custom kernel call becomes (the model itself has none)


@contextlib.contextmanager
def as_gpu_backend(rope: bool = False):
    """Dispatchers see a GPU backend; custom kernels (and, with `rope`, mx.fast.rope) become
    stand-ins. Yields (the list of (kernel, shapes) whose stand-in outputs had to be made while
    a graph was being built (a warm-up pass makes them all first, so that none appears in a
    counted graph), a one-item list: whether a counted graph is being built, the Counter of
    stand-in calls by kernel name)."""
    from dsv4.kernels import dialect

    made, late, building, calls = {}, [], [False], collections.Counter()

    def zeros(shape, dtype, name):
        key = (tuple(shape), dtype)
        if key not in made:
            made[key] = mx.zeros(shape, dtype)
            if building[0]:
                late.append((name, key))
            else:
                mx.eval(made[key])
        return made[key]

    def stand_in(kernel, *, inputs, output_shapes, output_dtypes, **_):
        calls[kernel.name] += 1
        outs = [zeros(s, d, kernel.name) for s, d in zip(output_shapes, output_dtypes)]
        return mx.depends(outs, list(inputs))

    def rope_stand_in(x, *args, **kwargs):
        calls["mx.fast.rope"] += 1
        return mx.depends([zeros(x.shape, x.dtype, "mx.fast.rope")], [x])[0]

    saved_rope = mx.fast.rope
    try:
        if rope:
            mx.fast.rope = rope_stand_in
        with dialect.pretend_gpu("cuda", stand_in):
            yield late, building, calls
    finally:
        mx.fast.rope = saved_rope


def count(model, context: int) -> collections.Counter:
    """Primitive counts of the compiled fixed-shape step at position `context`, GPU path."""
    from benchmarks.graph_ops import count_graph, prompt_cache
    from dsv4 import flags

    cache = prompt_cache(model, context)   # this machine's own prefill: only the step is counted
    with as_gpu_backend() as (late, building, _):
        with flags.override(dequant_matmul="off", compile=False):
            count_graph(model, context, fixed=True, cache=cache)   # warm-up: every stand-in's zeros
        building[0] = True
        with flags.override(dequant_matmul="off", compile=True):
            counts = count_graph(model, context, fixed=True, cache=cache)
    if late:
        raise RuntimeError(f"stand-in outputs made while counting (they would be counted): {late}")
    return counts


def count_positions(model, positions: list[int], prompt_tokens: int = 64) -> dict[int, tuple[int, collections.Counter]]:
    """n -> (launches, the stand-in calls by kernel name) of one compiled fixed-shape step of n
    positions (n = 1: the decode step; n > 1: FixedDecoder.feed with the draft inputs), GPU path."""
    import numpy as np

    from benchmarks.graph_ops import launches, primitive_counts
    from dsv4 import flags
    from dsv4.step import FixedDecoder

    ids = np.random.default_rng(0).integers(7, min(500, model.args.vocab_size), (1, prompt_tokens))

    def steps(dec, counted: dict) -> None:
        for n in positions:
            calls.clear()
            if n == 1:
                outputs = [dec(mx.array([5]))]
            else:
                logits, inputs = dec.feed(mx.full((1, n), 5, mx.int32), hidden=True)
                outputs = [logits, *inputs]
            counts = primitive_counts(outputs + list(dec.buffers.values()))
            counted[n] = (counts[STAND_IN] + sum(launches(counts).values()), collections.Counter(calls))
            mx.eval(outputs, dec.buffers)                # the next step's graph starts here
            dec.rewind(n)

    out = {}
    cache = model.make_cache(reserve=8)
    mx.eval(model(ids, cache))   # this machine's own prefill: only the steps are counted
    with as_gpu_backend(rope=True) as (late, building, calls), flags.override(fixed_decode="on", dequant_matmul="off"):
        dec = FixedDecoder(model, cache)
        mx.eval(dec.buffers)
        with flags.override(compile=False):
            steps(dec, {})                               # warm-up: every stand-in's zeros
        building[0] = True
        with flags.override(compile=True):
            steps(dec, out)
        dec.close(cache.offset)
    if late:
        raise RuntimeError(f"stand-in outputs made while counting (they would be counted): {late}")
    return out


def count_propose(model, ks: list[int], context: int = 64) -> dict[int, tuple[int, collections.Counter]]:
    """k -> (launches, the stand-in calls by kernel name) of one compiled fixed-shape greedy propose
    of k drafts (dsv4/draft_step.py FixedDraft.propose) after a `context`-token prefill, GPU path."""
    from benchmarks.graph_ops import launches, primitive_counts
    from benchmarks.step_profile import draft_prefill, proposer
    from dsv4 import flags

    window, token = draft_prefill(model, context)   # this machine's own prefill: only the proposes are counted

    def proposes(counted: dict) -> None:
        # each pass from the prefill's window (close() writes it); FixedDraft reads `compile` when made
        fixed, propose = proposer(model, window.copy(), token)
        mx.eval(fixed.buffers)                           # its window, out of the counted graphs
        for k in ks:
            calls.clear()
            p = propose(k)
            outputs = [a for a in (p.drafts, p.confidence, p.q_logits) if a is not None]
            counts = primitive_counts(outputs)
            counted[k] = (counts[STAND_IN] + sum(launches(counts).values()), collections.Counter(calls))
            mx.eval(outputs)
        fixed.close()

    out = {}
    with as_gpu_backend(rope=True) as (late, building, calls), \
            flags.override(fixed_decode="on", fixed_propose="on", dequant_matmul="off"):
        with flags.override(compile=False):
            proposes({})                                 # warm-up: every stand-in's zeros
        building[0] = True
        with flags.override(compile=True):
            proposes(out)
    if late:
        raise RuntimeError(f"stand-in outputs made while counting (they would be counted): {late}")
    return out


def propose_table(model, ks: list[int]) -> list[str]:
    """Report lines: count_propose's launches and the dsv4 kernels among them, by name."""
    counted = count_propose(model, ks)
    names = sorted({name for _, calls in counted.values() for name in calls})
    lines = ["| drafts k | launches | of them kernels (dsv4's, RoPE) |", "|---|---|---|"]
    lines += [f"| {k} | {total} | {sum(calls.values())} |" for k, (total, calls) in counted.items()]
    lines += ["", "| kernel | " + " | ".join(f"k = {k}" for k in counted) + " |", "|---" * (len(counted) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(str(calls[name]) for _, calls in counted.values()) + " |" for name in names]
    return lines


def positions_table(model, positions: list[int]) -> list[str]:
    """Report lines: count_positions with DSV4_KERNEL_ROWS_POSITIONS off and on."""
    from dsv4 import flags

    lines = ["| DSV4_KERNEL_ROWS_POSITIONS | positions | launches | of them kernels (dsv4's, RoPE) | / one-position step |",
             "|---|---|---|---|---|"]
    for tails in (False, True):
        with flags.override(kernel_rows_positions=tails):
            counted = count_positions(model, positions)
        one = counted[1][0] if 1 in counted else None
        for n, (total, calls) in counted.items():
            ratio = f"{total / one:.2f}" if one else "-"
            lines.append(f"| {'on' if tails else 'off'} | {n} | {total} | {sum(calls.values())} | {ratio} |")
    return lines


def summary(counts: collections.Counter, layers: int) -> list[str]:
    from benchmarks.graph_ops import launches, table

    kernels = counts[STAND_IN]
    mlx_launches = sum(launches(counts).values())
    total = sum(counts.values())
    lines = [f"launches per step: {kernels + mlx_launches} ({(kernels + mlx_launches) / layers:.1f} per "
             f"layer, {layers} layers): {kernels} custom kernels, {mlx_launches} MLX primitives; "
             f"with the view-only primitives {total} ({total / layers:.1f} per layer)", ""]
    named = collections.Counter({("custom kernel" if k == STAND_IN else k): n for k, n in counts.items()})
    return lines + table(named, layers, 30, width=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", action="store_true", help="V4.1's widths (more than 24 GB of memory: the run was OOM-killed on a 24 GB machine)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--positions", help="count steps of these numbers of positions (e.g. 1,2,4,6) instead")
    p.add_argument("--propose", help="count DSpark proposes of these numbers of drafts (e.g. 1,3,5) instead")
    p.add_argument("--model", help="with --positions or --propose: a checkpoint with draft stages (default: the "
                                    "toy-width slice)")
    p.add_argument("--report", action="store_true", help="write a dated report to benchmarks/results/")
    a = p.parse_args(argv)
    from benchmarks.graph_ops import write_report
    from benchmarks.slice_decode import REAL, ROLES, SMALL, build

    when = datetime.now()
    # The modes over a model with draft stages: report slug, what is counted, how.
    draft_modes = {"propose": ("propose-launches", "a DSpark propose of k drafts",
                               "compiled greedy propose (DSV4_FIXED_PROPOSE)", propose_table),
                   "positions": ("step-launches", "a fixed-shape step of n positions", "compiled step", positions_table)}
    mode = "propose" if a.propose else "positions" if a.positions else None
    if mode:
        slug, title, how, table = draft_modes[mode]
        lines = table(positions_model(a.model), [int(n) for n in getattr(a, mode).split(",")])
        name = f"{when:%Y-%m-%d-%H%M}-{slug}.md"
        heading = (f"# Launches of {title} (GPU path, counted on the CPU)\n\n"
                   f"{when:%Y-%m-%d %H:%M}; model `{a.model or 'toy-width slice with draft stages'}`, "
                   f"64-token prefill, {how}.")
    else:
        model, _, _ = build({**(REAL if a.real else SMALL), **ROLES})
        lines = summary(count(model, a.context), model.args.num_hidden_layers)
        name = f"{when:%Y-%m-%d-%H%M}-gpu-path-primitives.md"
        heading = (f"# Primitives of the fixed decode step on the GPU path (counted on the CPU)\n\n"
                   f"{when:%Y-%m-%d %H:%M}; {'shape-true' if a.real else 'toy-width'} slice "
                   f"(benchmarks/slice_decode.py), the step at position {a.context}.")
    print("\n".join(lines))
    if a.report:
        print(f"report: {write_report(name, heading, lines)}")
    return 0


def positions_model(path: str | None):
    """A checkpoint with its draft stages, or the toy-width slice with random ones."""
    if path:
        import dsv4
        from dsv4 import flags

        with flags.override(draft="on"):
            return dsv4.load(path)[0]
    from benchmarks.slice_decode import ROLES, SMALL, build
    from benchmarks.speculative_steps import DRAFT_SMALL, with_draft

    config = {**SMALL, **ROLES}
    model, _, _ = build(config)
    with_draft(model, {**config, **DRAFT_SMALL})
    return model


if __name__ == "__main__":
    raise SystemExit(main())
