"""Why a fused experts launch takes its time: Nsight Compute's stall reasons per issued
instruction, the instructions issued, the L1's wavefronts and the SMs' active cycles, for the
gate/up or down launch of each recipe (mxfp4, ds4's q2 / q4) and unit variant (GPU, CUDA).

    ncu --metrics $(python -m benchmarks.ncu_experts metrics) --csv --page raw \\
        -k regex:"gate_up|experts_down" python -m benchmarks.ncu_experts run \\
        --launch gate_up --recipes q2,mxfp4 --variants "default|dp4a" > ncu.csv
    python -m benchmarks.ncu_experts report ncu.csv [--out DIR]

`run` calls the launch twice per (recipe, variant, tokens), evaluated one at a time, and prints
the calls' order on a line `ORDER ...` (which lands in ncu's output); `report` pairs ncu's rows
with that order, keeps each pair's second call (the first may include a kernel's build) and
writes a dated report. The variants are benchmarks/gguf_native.py's (EXPERT_VARIANTS, or
MX_VARIANTS for mxfp4), run with 6 distinct experts a token, act_quant, 384 experts of V4.1's
shapes. A stall column is the average number of warps stalled for that reason per issued
instruction (ncu's smsp__average_warps_issue_stalled_*_per_issue_active): their sum over the
warps a scheduler holds is the cycles an instruction waits.
"""

from __future__ import annotations

import argparse
import csv
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

STALLS = {"long_scoreboard": "long scoreboard", "short_scoreboard": "short scoreboard", "mio_throttle": "MIO",
          "lg_throttle": "LG", "math_pipe_throttle": "math pipe", "wait": "wait", "not_selected": "not selected",
          "selected": "selected", "barrier": "barrier", "no_instruction": "no instruction",
          "dispatch_stall": "dispatch", "branch_resolving": "branch", "imc_miss": "IMC miss"}
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
# (metric, column, scale): the other columns.
OTHERS = [("gpu__time_duration.sum", "µs", 1e-3), ("smsp__inst_executed.sum", "warp instructions (M)", 1e-6),
          ("smsp__issue_active.avg.pct_of_peak_sustained_active", "issue slots busy %", 1.0),
          ("smsp__warps_active.avg.per_cycle_active", "warps a scheduler", 1.0),
          ("l1tex__data_pipe_lsu_wavefronts.sum", "L1 wavefronts (M)", 1e-6),
          ("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "global load sectors (M)", 1e-6),
          ("sm__cycles_active.avg", "SM active cycles (k)", 1e-3), ("sm__cycles_elapsed.avg", "elapsed cycles (k)", 1e-3),
          ("launch__registers_per_thread", "registers", 1.0), ("dram__bytes_read.sum", "DRAM MB read", 1e-6)]


def metrics() -> str:
    """The comma-separated metrics `report` reads, for ncu's --metrics."""
    return ",".join([STALL_METRIC.format(k) for k in STALLS] + [m for m, _, _ in OTHERS])


def run(launch: str, recipes: list[str], variants: list[str] | None, tokens: list[int]) -> None:
    import mlx.core as mx

    from benchmarks.gguf_native import EXPERT_VARIANTS, MX_VARIANTS, decode_inputs, recipe_weights
    from dsv4 import flags
    from dsv4.kernels import experts as ex

    order = []
    for recipe in recipes:
        gate, up, down, shared = recipe_weights(recipe)
        table = MX_VARIANTS if recipe == "mxfp4" else EXPERT_VARIANTS
        for t in tokens:
            x, idx, w = decode_inputs(t)
            for label in [v for v in table if variants is None or v in variants]:
                with flags.override(**table[label]):
                    limbs = ex.limbs_between(down, shared[2], True)
                    h = ex.gate_up_kernel(x, idx, w, gate, up, shared, 10.0, True, limbs=limbs)[0]
                    mx.eval(h)
                    for call in range(2):
                        out = (ex.gate_up_kernel(x, idx, w, gate, up, shared, 10.0, True, limbs=limbs)[0]
                               if launch == "gate_up" else ex.down_kernel(h, idx, down, shared[2]))
                        mx.eval(out)
                        mx.synchronize()
                        order.append(f"{recipe}|{label}|{t}|{call}")
    print("ORDER " + ";".join(order), flush=True)


def report(path: Path, out: Path, launch: str) -> Path:
    from benchmarks.report import write_dated

    text = path.read_text().splitlines()
    orders = [ln.split(" ", 1)[1].split(";") for ln in text if ln.startswith("ORDER ")]
    rows = list(csv.reader(ln for ln in text if ln.startswith('"')))
    if not orders or len(rows) < 2:
        raise ValueError(f"{path}: expected ncu's --csv --page raw rows and the ORDER line `run` prints")
    header, data = rows[0], rows[2:]   # rows[1]: the units
    order = orders[-1]
    if len(order) != len(data):
        raise ValueError(f"{path}: {len(data)} profiled launches for {len(order)} calls: profile with "
                         f"-k regex:\"gate_up|experts_down\" and one launch kind a run")
    col = {name: i for i, name in enumerate(header)}
    stall_cols = [k for k in STALLS if STALL_METRIC.format(k) in col]
    lines = [f"# The fused experts' {launch} launch under Nsight Compute ({datetime.now():%Y-%m-%d %H:%M})", "",
             "Stall reasons: warps stalled per issued instruction (ncu's smsp__average_warps_issue_stalled_*); "
             "the second of each variant's two calls.", "",
             "| recipe | variant | tokens | " + " | ".join(STALLS[k] for k in stall_cols) + " | "
             + " | ".join(c for _, c, _ in OTHERS) + " |",
             "|---|---|---|" + "---|" * (len(stall_cols) + len(OTHERS))]
    for tag, row in zip(order, data):
        recipe, label, tokens, call = tag.split("|")
        if call == "0":
            continue
        value = lambda metric: float(row[col[metric]].replace(",", ""))
        stalls = " | ".join(f"{value(STALL_METRIC.format(k)):.2f}" for k in stall_cols)
        rest = " | ".join(f"{value(m) * scale:.1f}" if m in col else "-" for m, _, scale in OTHERS)
        lines.append(f"| {recipe} | {label} | {tokens} | {stalls} | {rest} |")
    return write_dated(out, datetime.now(), f"ncu-experts-{launch.replace('_', '-')}", lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("metrics", help="print the metrics for ncu's --metrics")
    r = sub.add_parser("run", help="the launches for ncu to profile")
    r.add_argument("--launch", choices=("gate_up", "down"), default="gate_up")
    r.add_argument("--recipes", default="q2,mxfp4", help="comma-separated: mxfp4, q2, q4")
    r.add_argument("--variants", help="'|'-separated labels (default: every variant of each recipe)")
    r.add_argument("--tokens", default="1,8")
    w = sub.add_parser("report", help="the dated report from ncu's CSV")
    w.add_argument("csv", type=Path)
    w.add_argument("--launch", choices=("gate_up", "down"), default="gate_up", help="for the title")
    w.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    if a.command == "metrics":
        print(metrics())
    elif a.command == "run":
        run(a.launch, a.recipes.split(","), a.variants.split("|") if a.variants else None,
            [int(t) for t in a.tokens.split(",")])
    else:
        try:
            report(a.csv, a.out, a.launch)
        except (OSError, ValueError) as e:
            print(f"ncu_experts: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
