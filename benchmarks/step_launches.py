"""How many launches a fixed-shape step of n positions makes on a GPU, counted on any machine.

    python -m benchmarks.step_launches [--positions 1,2,4,6] [--model DIR] [--report]

A verify of n positions (DSpark) or a plain step is encoded launch by launch by the host (MLX's
per-launch cost, ~10 µs on CUDA), so the launch count bounds how fast a host-bound step can be.
This builds the step as a GPU would, without one: dsv4 dispatches as under CUDA
(dialect.pretend_gpu), and each custom-kernel launch is recorded and answered with zeros that
depend on its inputs (so the graph upstream of it stays whole); the step (compiled, DSV4_COMPILE) is then
walked as benchmarks/graph_ops.py walks one (view-only primitives left out, and fills: the
zeros standing in for the kernels' outputs are fills too). MLX's own
primitives are counted as the CPU builds them, except mx.fast.rope, which a GPU runs as one
kernel and the CPU builds from a dozen primitives: it is recorded as one launch.
Default: the toy-width slice of benchmarks/slice_decode.py with draft stages; the steps come
after a 64-token prefill, each from the same position (rewound).
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

from benchmarks.graph_ops import launches, primitive_counts, write_report  # noqa: E402


@contextlib.contextmanager
def faked_cuda_dispatch():
    """Inside: dsv4 dispatches as under CUDA (dialect.pretend_gpu); yields the Counter of
    kernel launches by name, mx.fast.rope's included."""
    from dsv4.kernels import dialect

    calls = collections.Counter()

    def launch(kernel, **kw):
        calls[kernel.name] += 1
        outs = [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        inputs = [a for a in kw.get("inputs", []) if isinstance(a, mx.array)]
        return mx.depends(outs, inputs) if inputs else outs

    def rope(x, *args, **kw):   # one kernel on a GPU, a dozen primitives as the CPU builds it
        calls["mx.fast.rope"] += 1
        return mx.depends([mx.zeros(x.shape, x.dtype)], [x])[0]

    saved_rope, mx.fast.rope = mx.fast.rope, rope
    try:
        with dialect.pretend_gpu("cuda", launch):
            yield calls
    finally:
        mx.fast.rope = saved_rope


def count(model, positions: list[int], prompt_tokens: int = 64) -> dict[int, tuple[int, collections.Counter]]:
    """n -> (MLX primitives that launch, the kernel launches by name) of one fixed-shape step of
    n positions (n = 1: the decode step; n > 1: FixedDecoder.feed with the draft inputs)."""
    import numpy as np

    from dsv4 import flags
    from dsv4.step import FixedDecoder

    out = {}
    ids = np.random.default_rng(0).integers(7, min(500, model.args.vocab_size), (1, prompt_tokens))
    with flags.override(fixed_decode="on", dequant_matmul="off"), faked_cuda_dispatch() as calls:
        cache = model.make_cache(reserve=8)
        mx.eval(model(ids, cache))
        dec = FixedDecoder(model, cache)
        mx.eval(dec.buffers)
        for n in positions:
            calls.clear()
            if n == 1:
                outputs = [dec(mx.array([5]))]
            else:
                logits, inputs = dec.feed(mx.full((1, n), 5, mx.int32), hidden=True)
                outputs = [logits, *inputs]
            counts = primitive_counts(outputs + list(dec.buffers.values()))
            del counts["Full"]   # the zeros standing in for kernel outputs are Full primitives too
            out[n] = (sum(launches(counts).values()), collections.Counter(calls))
            mx.eval(outputs, dec.buffers)                # the next step's graph starts here
            dec.rewind(n)
        dec.close(cache.offset)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--positions", default="1,2,4,6")
    p.add_argument("--model", help="a checkpoint with draft stages (default: the toy-width slice)")
    p.add_argument("--report", action="store_true", help="write a dated report to benchmarks/results/")
    a = p.parse_args(argv)
    positions = [int(n) for n in a.positions.split(",")]
    if a.model:
        import dsv4
        from dsv4 import flags

        with flags.override(draft="on"):
            model, _ = dsv4.load(a.model)
    else:
        from benchmarks.slice_decode import ROLES, SMALL, build
        from benchmarks.speculative_steps import DRAFT_SMALL, with_draft

        config = {**SMALL, **ROLES}
        model, _, _ = build(config)
        with_draft(model, {**config, **DRAFT_SMALL})
    from dsv4 import flags

    lines = ["| DSV4_KERNEL_ROWS_POSITIONS | positions | MLX primitives | kernels (dsv4's, RoPE) | launches | / one-position step |",
             "|---|---|---|---|---|---|"]
    for tails in (False, True):
        with flags.override(kernel_rows_positions=tails):
            counted = count(model, positions)
        one = counted[1][0] + sum(counted[1][1].values()) if 1 in counted else None
        for n, (prims, calls) in counted.items():
            kernels = sum(calls.values())
            ratio = f"{(prims + kernels) / one:.2f}" if one else "-"
            lines.append(f"| {'on' if tails else 'off'} | {n} | {prims} | {kernels} | {prims + kernels} | {ratio} |")
    print("\n".join(lines))
    if a.report:
        when = datetime.now()
        out = write_report(f"{when:%Y-%m-%d-%H%M}-step-launches.md",
                           f"# Launches of a fixed-shape step of n positions (faked CUDA dispatch)\n\n"
                           f"{when:%Y-%m-%d %H:%M}; model `{a.model or 'toy-width slice with draft stages'}`, "
                           f"64-token prefill, compiled step.", lines)
        print(f"report: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
