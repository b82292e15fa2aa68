"""Throughput and peak memory of the official converter on a synthetic checkpoint of a few GB.

    python -m benchmarks.convert_official --experts 96 --runs 2

Writes an official-layout checkpoint with `dsv4.testing` at wider-than-tiny widths into a
temporary directory (a fresh process, so its memory is not counted; expert codes are random
bytes, as `testing.fp4_weight` would take most of an hour here), then runs each variant of
`python -m dsv4_convert official` as a fresh process (`benchmarks.ab.run_once`), rounds in
alternating order; the child prints its own peak resident memory (`ru_maxrss`) as its result
line. Reports source bytes / wall second (MB/s, 1e6 bytes) and peak RSS as medians, checks that
every run of a variant wrote the same bytes, and writes `<date>-convert-official.md` to
benchmarks/results/. Everything written under the temporary directory is deleted at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks import ab, hardware  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RUN_TIMEOUT_S = 3600.0   # one conversion; the slowest default variant takes ~6 min

_MAKE = """
import sys
import numpy as np
from dsv4 import testing
from dsv4.testing import write_tiny_checkpoint

def fast_fp4_weight(rng, shape, std):
    # any byte is two valid e2m1 codes; the converter's speed does not depend on the values
    codes = rng.integers(0, 256, (*shape[:-1], shape[-1] // 2), dtype=np.uint8).view(np.int8)
    return codes, rng.integers(118, 124, (*shape[:-1], shape[-1] // 32), dtype=np.uint8)

testing.fp4_weight = fast_fp4_weight
experts = int(sys.argv[2])
write_tiny_checkpoint(sys.argv[1], seed=0, shards=int(sys.argv[3]), config_overrides=dict(
    hidden_size=2048, moe_intermediate_size=1024, n_routed_experts=experts, num_experts_per_tok=4,
    num_attention_heads=16, head_dim=128, q_lora_rank=512, o_lora_rank=256, index_n_heads=8,
    index_head_dim=64))
"""

VARIANTS = {
    "lossless": [],
    "lossless+verify": ["--verify"],
    "experts-affine4": ["--experts-bits", "4", "--experts-group-size", "64"],
}


# a small wrapper around the converter that prints its own peak RSS as the result line
_WRAP = """
import json, resource, runpy, sys
sys.argv = ["dsv4_convert", *sys.argv[1:]]
try:
    runpy.run_module("dsv4_convert", run_name="__main__")
except SystemExit as e:
    if e.code:
        raise
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("DSV4_RESULT " + json.dumps({"rss_mb": rss_mb}))
"""


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.suffix == ".safetensors":
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=96, help="routed experts per layer (size)")
    parser.add_argument("--shards", type=int, default=6, help="shards of the synthetic source")
    parser.add_argument("--runs", type=int, default=2, help="runs per variant")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    variants = args.variants.split(",")

    work = Path(tempfile.mkdtemp(prefix="dsv4-convert-bench-", dir=args.workdir))
    try:
        src = work / "src"
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", _MAKE, str(src), str(args.experts), str(args.shards)],
                       check=True)
        make_s = time.monotonic() - t0
        src_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        print(f"synthetic checkpoint: {src_bytes / 1e9:.2f} GB in {make_s:.0f} s", file=sys.stderr)
        rows = {v: [] for v in variants}
        digests = {v: set() for v in variants}
        order = [name for _, name in ab.schedule(variants, args.runs)]
        for name in order:
            dst = work / f"out-{name}"
            cmd = [sys.executable, "-c", _WRAP, "official", str(src), str(dst), "--quiet",
                   *VARIANTS[name]]
            wall, _, result = ab.run_once(cmd, ab.Variant(name), RUN_TIMEOUT_S)
            rss = result["rss_mb"]
            out_bytes = sum(p.stat().st_size for p in dst.iterdir() if p.suffix == ".safetensors")
            digests[name].add(_digest(dst))
            rows[name].append((wall, rss, out_bytes))
            print(f"{name}: {wall:.1f} s, {src_bytes / wall / 1e6:.0f} MB/s, peak RSS {rss:.0f} MB",
                  file=sys.stderr)
            shutil.rmtree(dst)
        load = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    date = datetime.now(timezone.utc)
    lines = [f"# Official converter: throughput and peak memory ({date:%Y-%m-%d %H:%M} UTC)", "",
             hardware.to_markdown(hardware.describe()), "",
             f"Synthetic official-layout checkpoint (`dsv4.testing.write_tiny_checkpoint`, expert "
             f"codes random bytes, hidden "
             f"2048, 8 layers, {args.experts} fp4 experts of 1024x2048 per layer, {args.shards} "
             f"shards): **{src_bytes / 1e9:.2f} GB** on local disk, written in {make_s:.0f} s. "
             f"Each run is a fresh `python -m dsv4_convert official SRC DST --quiet ...` process; "
             f"runs interleaved ({' '.join(order)}); the source is in the page cache after the "
             f"first run (the machine has more memory than the checkpoint). Rate = source bytes / "
             f"wall second. Peak RSS = the process's `ru_maxrss` (memory-mapped source pages "
             f"that were touched count too). Load average at the end: "
             f"{load[0]:.1f} on {os.cpu_count()} cores (shared machine).", "",
             "| variant | runs | median wall s | median MB/s | median peak RSS MB | output GB | same bytes every run |",
             "|---|---|---|---|---|---|---|"]
    for name in variants:
        wall = statistics.median(w for w, _, _ in rows[name])
        rss = statistics.median(m for _, m, _ in rows[name])
        lines.append(f"| {name} | {len(rows[name])} | {wall:.1f} | {src_bytes / wall / 1e6:.0f} | "
                     f"{rss:.0f} | {rows[name][0][2] / 1e9:.2f} | "
                     f"{'yes' if len(digests[name]) == 1 else 'NO'} |")
    lines += ["", "Every run: " + "; ".join(
        f"{n}: " + ", ".join(f"{w:.1f} s / {m:.0f} MB" for w, m, _ in rows[n]) for n in variants), ""]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = args.out_dir / f"{date:%Y-%m-%d}-convert-official.md"
    report.write_text("\n".join(lines))
    print(report)


if __name__ == "__main__":
    main()
