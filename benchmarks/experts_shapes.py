"""Launch shapes of the fused experts kernels (rows_dot's ROWS x LANES) at V4.1 shapes.

    python benchmarks/experts_shapes.py --out benchmarks/results/DATE-experts-shapes.md
    ncu --metrics gpu__time_duration.sum -k regex:"gate_up|experts_down" \\
        python benchmarks/experts_shapes.py --ncu      # GPU time per launch, no host time

Shapes: 384 experts of 2304 x 5120 in mxfp4, top-6, a shared expert in mxfp8, act_quant (the
model's numerics); with `--recipe q2|q4`, ds4's GGUF blocks instead (benchmarks/gguf_native.py's
recipes, the Q8_0 shared expert; the backend's default units). Each variant sets
`dsv4.kernels.experts`' ROWS_GATE_UP / LANES_GATE_UP (the gate/up launch) or ROWS_DOWN /
LANES_DOWN (the down launch), or for GGUF blocks the routed type's GGUF_GATE_UP_SHAPES /
GGUF_DOWN_SHAPES entry, and times that launch alone for 1,
4 and 8 tokens: variants of one launch run interleaved (A B B A ...) in one process, each
timing a batch of calls ending in one `mx.eval`, so the per-call time includes the host's
share (the same for every variant of a launch). The report gives medians, the rate at which
the launch reads its weights, and the largest difference from the plain-MLX stage
(`hidden_reference` / `down_reference`). `--ncu` only makes a few calls of each variant, in
the order the report lists them, for a profiler to time. Needs a GPU backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.gguf_native import expert_bytes, recipe_weights  # noqa: E402
from benchmarks.kernels_bench import compare, copy_bandwidth, hardware, max_diff, random_mx  # noqa: E402
from dsv4.kernels import experts as ex  # noqa: E402
from dsv4.kernels.dialect import backend  # noqa: E402
from dsv4.kernels.gguf_dot import GGUFMatrix  # noqa: E402

E, I, D, K = 384, 2304, 5120, 6
GATE_UP = [(4, 32), (2, 16), (2, 32), (1, 32), (8, 32)]
DOWN = [(2, 8), (4, 32), (1, 8), (4, 8), (1, 16), (2, 16), (4, 16), (2, 32), (8, 32)]
NCU_CALLS = 4


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'4x32,2x8' -> [(4, 32), (2, 8)]: ROWS x LANES, LANES a power of two <= 32."""
    shapes = []
    for item in text.split(","):
        rows, _, lanes = item.partition("x")
        try:
            rows, lanes = int(rows), int(lanes)
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {item!r}: want ROWSxLANES, e.g. 2x8") from None
        # A SIMD group makes ROWS * 32 / LANES rows; a threadgroup's 32 rows of h need that to divide 32.
        if lanes not in (1, 2, 4, 8, 16, 32) or rows < 1 or 32 % (rows * 32 // lanes):
            raise argparse.ArgumentTypeError(f"shape {item!r}: LANES must be a power of two <= 32 and "
                                             f"ROWS * 32 / LANES must divide 32")
        shapes.append((rows, lanes))
    return shapes


def weights(recipe: str = "mxfp4"):
    if recipe != "mxfp4":
        return recipe_weights(recipe)
    gate, up, down = (random_mx(s, "mxfp4") for s in ((E, I, D), (E, I, D), (E, D, I)))
    shared = tuple(random_mx(s, "mxfp8") for s in ((I, D), (I, D), (D, I)))
    mx.eval(gate.weight, up.weight, down.weight, [m.weight for m in shared])
    return gate, up, down, shared


def shape_setters(gate, down) -> dict:
    """{launch: (its committed shape, a function setting it)}: the routed type's entry of the
    GGUF tables for GGUF blocks, the module's ROWS/LANES for MLX's packs."""
    if isinstance(gate, GGUFMatrix):
        tables = {"gate_up": (ex.GGUF_GATE_UP_SHAPES, gate.qtype), "down": (ex.GGUF_DOWN_SHAPES, down.qtype)}
        return {name: (table[qtype], lambda shape, table=table, qtype=qtype: table.update({qtype: shape}))
                for name, (table, qtype) in tables.items()}

    def set_gate_up(shape):
        ex.ROWS_GATE_UP, ex.LANES_GATE_UP = shape

    def set_down(shape):
        ex.ROWS_DOWN, ex.LANES_DOWN = shape

    return {"gate_up": ((ex.ROWS_GATE_UP, ex.LANES_GATE_UP), set_gate_up),
            "down": ((ex.ROWS_DOWN, ex.LANES_DOWN), set_down)}


def only_experts(m, rows: mx.array):
    """Stacked experts m cut to the experts `rows`."""
    if isinstance(m, GGUFMatrix):
        return GGUFMatrix(m.weight[rows], m.qtype)
    return dataclasses.replace(m, weight=m.weight[rows], scales=m.scales[rows],
                               biases=None if m.biases is None else m.biases[rows])


def inputs(tokens: int):
    x = (mx.random.normal((tokens, D)) * 2).astype(mx.bfloat16)
    idx = mx.stack([mx.random.permutation(E)[:K] for _ in range(tokens)]).astype(mx.int32)
    w = mx.random.uniform(0.1, 1.0, (tokens, K))
    mx.eval(x, idx, w)
    return x, idx, w


def launches(tokens, gate, up, down, shared):
    """{launch: (set_shape, call, reference, bytes read)} for the given token count."""
    x, idx, w = inputs(tokens)
    used = sorted(set(idx.flatten().tolist()))
    experts = len(used)
    # The references over the experts used alone (GGUF blocks dequantize a whole stack).
    rows = mx.array(used)
    local = mx.array([[used.index(e) for e in row] for row in idx.tolist()], mx.int32)
    gate_u, up_u, down_u = (only_experts(m, rows) for m in (gate, up, down))
    h = ex.hidden_reference(x, local, w, gate_u, up_u, shared, 10.0, True)
    mx.eval(h)
    setters = shape_setters(gate, down)
    return experts, {
        "gate_up": (setters["gate_up"][1], lambda: ex.gate_up_kernel(x, idx, w, gate, up, shared, 10.0, True)[0], h,
                    experts * (expert_bytes(gate) + expert_bytes(up)) + expert_bytes(shared[0]) + expert_bytes(shared[1])),
        "down": (setters["down"][1], lambda: ex.down_kernel(h, idx, down, shared[2]),
                 ex.down_reference(h, local, down_u, shared[2]), experts * expert_bytes(down) + expert_bytes(shared[2])),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="Markdown report to write")
    p.add_argument("--gate-up", type=parse_shapes, default=GATE_UP, metavar="RxL,...")
    p.add_argument("--down", type=parse_shapes, default=DOWN, metavar="RxL,...")
    p.add_argument("--tokens", default="1,4,8")
    p.add_argument("--ncu", action="store_true", help=f"{NCU_CALLS} calls of each variant, no timing")
    p.add_argument("--recipe", choices=("mxfp4", "q2", "q4"), default="mxfp4",
                   help="the official mxfp4 experts, or ds4's q2 / q4 GGUF blocks")
    a = p.parse_args()
    if backend() is None:
        sys.exit("experts_shapes needs a GPU backend (Metal or CUDA) on the default device")
    if a.out is None and not a.ncu:
        p.error("--out is required (or --ncu)")
    shapes = {"gate_up": a.gate_up, "down": a.down}
    gate, up, down, shared = weights(a.recipe)
    defaults = {name: shape for name, (shape, _) in shape_setters(gate, down).items()}
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# Fused experts launch shapes ({a.recipe}) — {now:%Y-%m-%d %H:%M} UTC", "", hardware(), "",
             f"Copy bandwidth measured here: {copy_bandwidth() / 1e12:.2f} TB/s (read + write of 2 GiB). "
             f"Committed defaults: gate/up {'x'.join(map(str, defaults['gate_up']))}, "
             f"down {'x'.join(map(str, defaults['down']))} (ROWS x LANES).", ""]
    for tokens in (int(t) for t in a.tokens.split(",")):
        experts, todo = launches(tokens, gate, up, down, shared)
        for name, (set_shape, call, reference, nbytes) in todo.items():
            variants = {}
            for shape in shapes[name]:
                variants["x".join(map(str, shape))] = (lambda s=shape: (set_shape(s), call())[1])
            if a.ncu:
                for fn in variants.values():
                    for _ in range(NCU_CALLS):
                        mx.eval(fn())
                continue
            times = compare(variants)
            lines += [f"## {name}, {tokens} token(s), {experts} experts: {nbytes / 1e6:.1f} MB of weights", "",
                      "| ROWS x LANES | µs per call | weight GB/s | max |kernel - reference| | of max |reference| |",
                      "|---|---|---|---|---|"]
            scale = mx.max(mx.abs(reference.astype(mx.float32))).item()
            for label, fn in variants.items():
                lines.append(f"| {label} | {times[label] * 1e6:.1f} | {nbytes / times[label] / 1e9:.0f} | "
                             f"{max_diff(fn(), reference):.2e} | {scale:.2e} |")
            lines.append("")
        for name, (set_shape, *_) in todo.items():
            set_shape(defaults[name])   # the next token count's reference runs on the defaults
    if not a.ncu:
        a.out.write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
