"""Primitives of the fixed decode step as a GPU backend builds it, counted on any machine.

    python -m benchmarks.gpu_path [--real] [--context 64] [--report]

Without Metal or CUDA every kernel dispatcher takes its plain-MLX reference, so counting the
step here (benchmarks/graph_ops.py) shows a graph no GPU runs. This tells every dispatcher
that a GPU backend is present and stands in for each custom kernel call with one node (zeros
of the kernel's output shapes, made once before the step is traced, tied to its inputs by
`mx.depends`), then counts the compiled fixed-shape step of the shape-true slice
(benchmarks/slice_decode.py; toy widths by default, `--real` for V4.1's). Each stand-in is one
launch; the other primitives are what MLX launches itself (graph_ops.VIEWS launch nothing).
The count depends on the step's regimes: at `--context` c the step decodes position c.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import pkgutil
import sys
from datetime import datetime
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

STAND_IN = "Depends"   # the node each custom kernel call becomes (the model itself has none)


@contextlib.contextmanager
def as_gpu_backend():
    """Dispatchers see a GPU backend; custom kernels become stand-ins. Yields the list of
    (kernel, shapes) whose stand-in outputs had to be made while a graph was being built
    (a warm-up pass makes them all first, so that none appears in a counted graph)."""
    import dsv4
    import dsv4.kernels as kernels_pkg
    from dsv4.kernels import dialect

    made, late, building = {}, [], [False]

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
        outs = [zeros(s, d, kernel.name) for s, d in zip(output_shapes, output_dtypes)]
        return mx.depends(outs, list(inputs))

    modules = [importlib.import_module(f"dsv4.kernels.{m.name}") for m in pkgutil.iter_modules(kernels_pkg.__path__)]
    modules += [importlib.import_module(f"dsv4.{m}") for m in ("attention", "linear", "model", "moe", "step")]
    saved = [(m, m.backend) for m in modules if hasattr(m, "backend")]
    call = dialect.Kernel.__call__
    try:
        for m, _ in saved:
            m.backend = lambda: "cuda"
        dialect.Kernel.__call__ = stand_in
        yield late, building
    finally:
        dialect.Kernel.__call__ = call
        for m, fn in saved:
            m.backend = fn
    del dsv4


def count(model, context: int) -> collections.Counter:
    """Primitive counts of the compiled fixed-shape step at position `context`, GPU path."""
    from benchmarks.graph_ops import count_graph
    from dsv4 import flags

    with as_gpu_backend() as (late, building):
        with flags.override(dequant_matmul="off", compile=False):
            count_graph(model, context, fixed=True)          # warm-up: every stand-in's zeros
        building[0] = True
        with flags.override(dequant_matmul="off", compile=True):
            counts = count_graph(model, context, fixed=True)
    if late:
        raise RuntimeError(f"stand-in outputs made while counting (they would be counted): {late}")
    return counts


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
    p.add_argument("--report", action="store_true", help="write a dated report to benchmarks/results/")
    a = p.parse_args(argv)
    from benchmarks.slice_decode import REAL, ROLES, SMALL, build

    model, _, _ = build({**(REAL if a.real else SMALL), **ROLES})
    lines = summary(count(model, a.context), model.args.num_hidden_layers)
    print("\n".join(lines))
    if a.report:
        from benchmarks.graph_ops import write_report

        when = datetime.now()
        out = write_report(f"{when:%Y-%m-%d-%H%M}-gpu-path-primitives.md",
                           f"# Primitives of the fixed decode step on the GPU path (counted on the CPU)\n\n"
                           f"{when:%Y-%m-%d %H:%M}; {'shape-true' if a.real else 'toy-width'} slice "
                           f"(benchmarks/slice_decode.py), the step at position {a.context}.", lines)
        print(f"report: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
