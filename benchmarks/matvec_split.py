"""Every launch shape of the one-token matvec at V4.1's dense projections, on a GPU.

    python -m benchmarks.matvec_split [--formats mxfp8,Q8_0] [--out benchmarks/results]

The one-token matvec (dsv4/kernels/matvec.py) runs a threadgroup of 8 SIMD groups, each on
ROWS rows, or SPLIT SIMD groups on one row's slices of K; `work_split` picks (SPLIT, ROWS) by
the rows in flight and a floor of threadgroups (split_limits: DSV4_KERNEL_MATVEC_LONG_THREADGROUPS
on or off). This times
every (SPLIT, ROWS) the launch can run (`split_fits`) for each projection and weight format
(mxfp8: the official dense weights; Q8_0: ds4's, the integer unit where CUDA takes it),
interleaved (kernels_bench.compare: a batch of calls in one eval), act_quant on, and marks what
`work_split` picks with the switch on and off. Rates are of the weight's bytes.
'same': the output equals the picked shape's bit for bit (ROWS changes no sum; SPLIT adds a
row's slices in another order, within the fp32 bound).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.gguf_native import gguf, torch_copy_bandwidth  # noqa: E402
from benchmarks.kernels_bench import compare, hardware, random_mx  # noqa: E402
from benchmarks.report import write_dated  # noqa: E402
from dsv4 import flags  # noqa: E402
from dsv4.kernels import matvec as mv  # noqa: E402

# V4.1's dense projections of a decode step: (name, N, K, groups).
SHAPES = [("wq_a", 1280, 5120, 1), ("wkv", 512, 5120, 1), ("wq_b", 32768, 1280, 1),
          ("wo_a", 8192, 4096, 8), ("wo_b", 5120, 8192, 1), ("indexer wq_b", 4096, 1280, 1)]
SHAPES_SMALL = [("wq_a", 256, 512, 1), ("wo_a", 512, 256, 4), ("wo_b", 1024, 512, 1)]
WORK = [(s, r) for s in (1, 2, 4) for r in (1, 2, 4) if s == 1 or r == 1]
POLICIES = ("on", "off")   # DSV4_KERNEL_MATVEC_LONG_THREADGROUPS


def matrix(fmt: str, n: int, k: int):
    if fmt == "Q8_0":
        return gguf((n, k), "Q8_0")
    q = random_mx((n, k), fmt)
    mx.eval(q.weight, q.scales)
    return q


def weight_bytes(q) -> int:
    return sum(a.nbytes for a in (q.weight, getattr(q, "scales", None)) if a is not None)


def picks(n: int, k: int, q, groups: int) -> dict:
    """(SPLIT, ROWS) -> the switch's values under which work_split picks it."""
    out = {}
    for policy in POLICIES:
        with flags.override(kernel_matvec_long_threadgroups=policy):
            out.setdefault(mv.work_split(n, k, q.block_values, groups), []).append(policy)
    return out


def table(fmt: str, shapes) -> list[str]:
    lines = [f"## {fmt}", "", "| projection | N x K | MB | SPLIT x ROWS | threadgroups | µs | TB/s | picked: long threadgroups | same |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, n, k, groups in shapes:
        q = matrix(fmt, n, k)
        if groups > 1 and fmt != "Q8_0":
            continue   # MLX's packs take gather_qmm for the grouped wo_a
        x = (mx.random.normal((1, groups, k) if groups > 1 else (1, k)) * 2).astype(mx.bfloat16)
        if not mv.kernel_supports(x, q, groups):
            continue
        shapes_ok = [w for w in WORK if mv.split_fits(n, k, q.block_values, groups, *w)]
        variants = {w: (lambda w=w: mv.quantized_matvec(x, q, True, groups, work=w)) for w in shapes_ok}
        times = compare(variants)
        picked = picks(n, k, q, groups)
        base = mv.quantized_matvec(x, q, True, groups)
        mb = weight_bytes(q) / 1e6
        for w in shapes_ok:
            same = bool(mx.array_equal(variants[w](), base).item())
            tgs = -(-n * w[0] // (mv.WARPS * w[1]))
            lines.append(f"| {name} | {n} x {k}{f' in {groups} groups' if groups > 1 else ''} | {mb:.1f} | "
                         f"{w[0]} x {w[1]} | {tgs} | {times[w] * 1e6:.1f} | {mb / 1e6 / times[w]:.2f} | "
                         f"{', '.join(map(str, picked.get(w, []))) or ''} | {'yes' if same else 'no'} |")
    return lines + [""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="mxfp8,Q8_0", help="comma-separated: mxfp8, Q8_0")
    p.add_argument("--small", action="store_true", help="toy shapes (the CPU: checks the script, times nothing real)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    when = datetime.now()
    copy = torch_copy_bandwidth()
    lines = ["# The one-token matvec's launch shapes at V4.1's dense projections", "",
             f"{when:%Y-%m-%d %H:%M}; act_quant on, one token, bf16 x; µs: median per call of interleaved "
             "batches (kernels_bench.compare).", ""]
    if copy:
        lines += [f"Copy roofline, this process: torch's device copy {copy / 1e12:.2f} TB/s (read + write).", ""]
    for fmt in a.formats.split(","):
        lines += table(fmt, SHAPES_SMALL if a.small else SHAPES)
    lines += [hardware()]
    write_dated(a.out, when, "matvec-split", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
