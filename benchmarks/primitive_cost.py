"""What one primitive costs the host that encodes it, by kind, on this machine's default device.

    python -m benchmarks.primitive_cost [--chain 200] [--repeats 15] [--out DIR]

A decode step on an H100 host waits on MLX's encoding (~10 µs a primitive for ~180 primitives:
benchmarks/results/2026-12-06-0845-host-encode.md). Whether fusing launches is the lever, or
something our launches carry (many inputs, long sources MLX hashes at every launch, views), is
told by chains of `--chain` primitives of one kind, each on the one before, timed in three parts
(median µs a primitive over `--repeats` chains): building the graph in Python ("build"),
`mx.async_eval` encoding and launching it ("encode"), and waiting for the result ("wait").
Kinds: a custom kernel of one input (dsv4.kernels.dialect, so a GPU backend), of 12 inputs, of
a ~30 KB source (through DSV4_KERNEL_SOURCE_FILES's includes as the switches have it, and
inline); MLX's add, reshape (a view), put_along_axis (the step's cache writes) and
quantized_matmul (mxfp8 512x512); and mx.compile'd chains of the one-input kernel and of add.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

BODY = "if (tid == 0 && group_x == 0) { out[0] = x[0] + 1.0f; }"


def _kernel(name: str, extra_inputs: int = 0, padding: int = 0):
    """A one-thread kernel adding 1 to x[0]; `extra_inputs` more inputs it does not read; a body
    `padding` bytes longer (statements that never run, so the source MLX hashes grows)."""
    from dsv4.kernels.dialect import Kernel

    pad = "".join(f"if (tid == 1000000 + {i}) {{ out[1] = x[1] * {i}.0f; }}\n" for i in range(padding // 48))
    return Kernel(name=name, input_names=("x",) + tuple(f"w{i}" for i in range(extra_inputs)),
                  output_names=("out",), body=BODY + pad)


def _launch(kernel, x, extra):
    return kernel(inputs=[x, *extra], output_shapes=[x.shape], output_dtypes=[x.dtype],
                  grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]


def kinds() -> dict:
    """name -> (one step of the chain: y -> y', the chain's first y)."""
    from dsv4.kernels.dialect import backend

    x8 = mx.zeros((8,), mx.float32)
    w = mx.random.normal((512, 512))
    wq, ws = mx.quantize(w, group_size=32, bits=8, mode="mxfp8")
    buf = mx.zeros((64, 512), mx.bfloat16)
    row = mx.ones((1, 512), mx.bfloat16)
    idx = mx.zeros((1, 512), mx.int32)
    mx.eval(x8, wq, ws, buf, row, idx)
    out = {
        "add": (lambda y: y + 1, x8),
        "reshape (view)": (lambda y: y.reshape(2, 4) if y.ndim == 1 else y.reshape(8), x8),
        "put_along_axis": (lambda b: mx.put_along_axis(b, idx, row, axis=0), buf),
        "quantized_matmul": (lambda v: mx.quantized_matmul(v, wq, ws, transpose=True, group_size=32,
                                                           bits=8, mode="mxfp8"),
                             mx.ones((1, 512), mx.float32)),
        "compiled add x10 (one call)": (mx.compile(lambda y: _repeat(lambda v: v + 1, y, 10)), x8),
    }
    if backend() is not None:
        one, many, long = _kernel("pc_one"), _kernel("pc_twelve", 11), _kernel("pc_long", padding=30_000)
        weights = [mx.zeros((8,), mx.float32) + i for i in range(11)]
        mx.eval(weights)
        out |= {
            "kernel, 1 input": (lambda y: _launch(one, y, []), x8),
            "kernel, 12 inputs": (lambda y: _launch(many, y, weights), x8),
            "kernel, ~30 KB source": (lambda y: _launch(long, y, []), x8),
            "kernel, ~30 KB source inline (DSV4_KERNEL_SOURCE_FILES=off)": (lambda y: _inline(long, y), x8),
            "compiled kernel x10 (one call)": (mx.compile(lambda y: _repeat(lambda v: _launch(one, v, []), y, 10)), x8),
        }
    return out


def _inline(kernel, x):
    from dsv4 import flags

    with flags.override(kernel_source_files="off"):
        return _launch(kernel, x, [])


def _repeat(step, y, n: int):
    for _ in range(n):
        y = step(y)
    return y


def measure(step, first, chain: int, repeats: int) -> dict:
    """Median µs a link of the chain: building, encoding (async_eval), waiting."""
    parts = {"build": [], "encode": [], "wait": []}
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        y = _repeat(step, first, chain)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        if i >= 3:   # the first chains build kernels and caches
            for part, t in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[part].append(1e6 * t / chain)
    return {part: statistics.median(v) for part, v in parts.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chain", type=int, default=200, help="links a chain (compiled kinds: calls)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path, help="write a dated report here")
    a = p.parse_args(argv)
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated

    when = datetime.now()
    lines = [f"# Host cost of one primitive, by kind ({mx.default_device()})", "",
             f"{when:%Y-%m-%d %H:%M}; chains of {a.chain} (compiled kinds: {a.chain} calls of 10), "
             f"median of {a.repeats}; µs a link.", "",
             "| kind | build | encode | wait | total |", "|---|---|---|---|---|"]
    for name, (step, first) in kinds().items():
        m = measure(step, first, a.chain, a.repeats)
        lines.append(f"| {name} | {m['build']:.2f} | {m['encode']:.2f} | {m['wait']:.2f} | "
                     f"{sum(m.values()):.2f} |")
        print(lines[-1], flush=True)
    lines += ["", to_markdown(describe())]
    if a.out:
        write_dated(a.out, when, "primitive-cost", lines, shown=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
