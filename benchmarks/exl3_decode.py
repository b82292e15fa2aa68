"""Seconds to decode one DeepSeek V4.1 Flash routed-expert matrix from EXL3 with the MLX decoder.

One matrix is w1/w3 of one expert: in 5120, out 2304, trellis int16 [320, 144, 16K]. The
whole published pack has 46,080 such matrices (40 layers x 384 experts x 3; w2 is the same
size transposed), so the projection is 46,080 x the median.

    python -m benchmarks.exl3_decode                 # this machine, writes the dated report
    python -m benchmarks.exl3_decode --json X.json   # only measure (e.g. on the GPU machine)
    python -m benchmarks.exl3_decode --merge X.json  # report, with another machine's numbers
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks import hardware  # noqa: E402
from convert import exl3_decode  # noqa: E402

MATRICES_PER_PACK = 46_080
IN_FEATURES, OUT_FEATURES = 5120, 2304
CASES = [(2, "mcg"), (3, "mul1"), (4, "mul1")]


def time_call(fn, reps: int) -> float:
    mx.eval(fn())  # warm-up: tables, kernels
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(reps: int) -> dict:
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()[0]
    rows = []
    for k_bits, codebook in CASES:
        trellis = mx.array(rng.integers(-32768, 32768, (IN_FEATURES // 16, OUT_FEATURES // 16,
                                                        16 * k_bits), dtype=np.int16))
        suh = mx.array(rng.standard_normal(IN_FEATURES).astype(np.float16))
        svh = mx.array(rng.standard_normal(OUT_FEATURES).astype(np.float16))
        mx.eval(trellis, suh, svh)
        w_hat = time_call(lambda: exl3_decode.reconstruct(trellis, codebook), reps)
        weight = time_call(lambda: exl3_decode.linear_weight(trellis, suh, svh, codebook), reps)
        rows.append({"K": k_bits, "codebook": codebook, "reconstruct_s": w_hat,
                     "linear_weight_s": weight})
        print(f"K={k_bits} {codebook}: reconstruct {w_hat:.3f} s, with Hadamards {weight:.3f} s",
              flush=True)
    # other work on a shared machine slows every number: say how busy it was
    return {"date": datetime.date.today().isoformat(), "hardware": hardware.describe(),
            "reps": reps, "rows": rows, "load_average": [load_before, os.getloadavg()[0]]}


def table(result: dict) -> str:
    lines = ["| K | codebook | Ŵ only (s) | full weight (s) | Mweights/s | projected pack (h) |",
             "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        full = row["linear_weight_s"]
        lines.append(f"| {row['K']} | {row['codebook']} | {row['reconstruct_s']:.4f} | {full:.4f} "
                     f"| {IN_FEATURES * OUT_FEATURES / full / 1e6:.1f} "
                     f"| {full * MATRICES_PER_PACK / 3600:.2f} |")
    return "\n".join(lines)


def report(local: dict, others: list[dict]) -> str:
    parts = [f"# EXL3 expert decode with the MLX decoder ({local['date']})", "",
             f"One {OUT_FEATURES}x{IN_FEATURES} routed-expert matrix (random trellis), "
             "`convert.exl3_decode.linear_weight` (trellis -> fp32 weight, both Hadamards) "
             "and `reconstruct` (Ŵ only), median of "
             f"{local['reps']} runs after one warm-up, in one process. Projected pack time = "
             f"{MATRICES_PER_PACK:,} matrices x the median, one process, decode only "
             "(no reading, requantising or writing).", ""]
    for result in [local, *others]:
        parts += [f"## {result['hardware'].get('mlx_device') or result['hardware']['cpu']} "
                  f"({result['hardware']['mlx_backend']})", "", hardware.to_markdown(result["hardware"]),
                  "", f"1-minute load average before/after: {result['load_average'][0]:.1f} / "
                  f"{result['load_average'][1]:.1f} on {result['hardware']['cpu_cores']} cores", "",
                  table(result), ""]
        if result.get("note"):
            parts += [result["note"], ""]
    return "\n".join(parts)


def exllamav3_section(info: dict) -> list[str]:
    """exllamav3's own CUDA kernels on the same matrix, as timed by tools/exl3_groundtruth."""
    t = info["timing"]
    k, n = t["shape_in_out"]
    version = info["exllamav3_version"].split("=")[-1].strip().strip('"')
    lines = [f"## For comparison: exllamav3 {version} "
             f"CUDA kernels on {info['gpu']} (torch {info['torch']})", "",
             f"One {n}x{k} matrix, K={t['K']} {t['codebook']}, CUDA-event time per call "
             "(tools/exl3_groundtruth/make_vectors.py). These are not MLX numbers.", "",
             "| exllamav3 call | seconds | projected pack (s) |", "|---|---|---|"]
    for name, sec in t["seconds"].items():
        lines.append(f"| `{name}` | {sec:.2e} | {sec * MATRICES_PER_PACK:.1f} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the measurement here, no report")
    parser.add_argument("--merge", type=Path, nargs="*", default=[],
                        help="measurements from other machines to add to the report")
    parser.add_argument("--exllamav3", type=Path,
                        default=Path("tests/fixtures/exl3/exl3_groundtruth_info.json"),
                        help="exllamav3's own kernel timings to quote (from the ground-truth run)")
    parser.add_argument("--note", action="append", default=[],
                        help="a paragraph to add to the report")
    args = parser.parse_args()
    result = measure(args.reps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        return
    others = [json.loads(path.read_text()) for path in args.merge]
    text = report(result, others)
    if args.exllamav3.is_file():
        text += "\n" + "\n".join(exllamav3_section(json.loads(args.exllamav3.read_text())))
    text += "".join(f"\n{note}\n" for note in args.note)
    out = Path(__file__).parent / "results" / f"{result['date']}-exl3-decode.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
