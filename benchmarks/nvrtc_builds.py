"""How CUDA kernel builds go faster: NVRTC one after another, on threads of this process, or each
in a child process (dsv4/kernels/nvrtc.py build_in_child, as the kernel cache builds). Needs no
GPU, only NVRTC (the test extra's wheels, or the GPU machine's).

    python -m benchmarks.nvrtc_builds [--kernels 4] [--workers N] [--out DIR]

The first `--kernels` compile-gate instantiations of dsv4's kernels (tools/metal_syntax_check,
sm_90a) are built once as a warm-up, then in each way in turn: wall seconds for all of them and
the builds' own seconds summed (on threads that serialize, each build's own time grows).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", type=int, default=4, help="how many kernel instantiations to build")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="threads or processes at once")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated
    from dsv4.kernels import nvrtc
    from tools.metal_syntax_check import all_kernels, cuda_source, required_nvrtc_paths

    paths = required_nvrtc_paths()
    library, includes = str(paths[0]), paths[1]
    kernels = [k for k in all_kernels() if k.checks][:a.kernels]
    sources = [cuda_source(k, k.checks[0]) for k in kernels]

    def timed(build, source) -> float:
        start = time.perf_counter()
        build(source[1], source[0], "sm_90a", library, includes)
        return time.perf_counter() - start

    def run(build, workers: int) -> tuple[float, float]:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            own = list(pool.map(lambda s: timed(build, s), sources))
        return time.perf_counter() - start, sum(own)

    timed(nvrtc.build, sources[0])   # NVRTC loaded, headers in the page cache
    ways = [("one after another", nvrtc.build, 1), (f"{a.workers} threads of this process", nvrtc.build, a.workers),
            (f"{a.workers} child processes", nvrtc.build_in_child, a.workers)]
    when = datetime.now()
    lines = ["# NVRTC builds: one after another, threads, child processes", "",
             f"{when:%Y-%m-%d %H:%M}; the first instantiation of {', '.join(f'`{k.name}`' for k in kernels)}, "
             f"for sm_90a.", "", "| way | wall s | builds' own s, summed |", "|---|---|---|"]
    for label, build, workers in ways:
        wall, own = run(build, workers)
        lines.append(f"| {label} | {wall:.2f} | {own:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", to_markdown(describe())]
    write_dated(a.out, when, "nvrtc-builds", lines, shown=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
