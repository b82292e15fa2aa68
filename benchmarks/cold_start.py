"""Cold start: from a fresh process's start to its first decoded tokens on the shape-true V4.1
slice, with and without the CUDA kernel cache (DSV4_KERNEL_CACHE, dsv4/kernels/cuda_cache.py).

    python -m benchmarks.cold_start [--small] [--runs 2] [--caches off,auto]   # fresh processes (the H200)
    python -m benchmarks.cold_start --count                  # kernel instantiations (any machine)

Every run is a fresh process that times its phases from its own start:
  import       python's start to dsv4's model and MLX imported
  weights      the slice's random weights made (stands for loading them; not cold-start work)
  warm-up      generation.warm_up: one token through a throwaway cache (kernel builds)
  first tokens a 64-token prefill and 4 decode steps through the decode loop (the fixed-shape
               step's trace and its kernels' builds)
Variants, run in turn, each with a fresh directory for MLX's disk cache (MLX_PTX_CACHE_DIR),
used by --runs processes one after the other: kernel cache off (MLX keeps only its own JIT
kernels there, dsv4's are compiled by NVRTC in every process) and on (dsv4 writes its builds
there too). The report gives each run's phases, the kernels dsv4 built and found, the files
in the directory, and whether every run decoded the same tokens (the weights are seeded); and
for each variant's first run, the builds it wrote in the order written, with the gaps between
them (MLX compiles its own one at a time: which of them a first start waits for).

--count needs no GPU: the distinct instantiations (kernel, template values) that the
dispatchers make at V4.1's widths (tools/launch_limits.v41_calls: 1-8 tokens, official and
GGUF layouts), by kernel: each is one NVRTC build in a process without the cache.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

MARK = "DSV4_COLD_START "


def child(small: bool, start: float) -> None:
    """One run (in its own process): the phases' seconds since `start`, when the parent
    started it (time.time())."""
    import mlx.core as mx

    import dsv4.model  # noqa: F401
    from benchmarks.slice_decode import REAL, ROLES, SMALL, build, decode_dsv4
    from dsv4.generation import warm_up
    from dsv4.kernels import cuda_cache

    phases = {"import": time.time() - start}
    mx.random.seed(0)
    t = time.time()
    model, _, _ = build({**(SMALL if small else REAL), **ROLES})
    phases["weights"] = time.time() - t
    t = time.time()
    warm_up(model)
    phases["warm-up"] = time.time() - t
    t = time.time()
    _, tokens = decode_dsv4(model, 64, 4)
    phases["first tokens"] = time.time() - t
    phases["to first tokens"] = time.time() - start - phases["weights"]
    print(MARK + json.dumps(dict(phases=phases, tokens=[int(x) for x in tokens],
                                 built=cuda_cache.builds.built, found=cuda_cache.builds.found,
                                 build_s=cuda_cache.builds.seconds)), flush=True)


def run_child(small: bool, cache: str, mlx_dir: Path) -> dict:
    env = dict(os.environ, DSV4_KERNEL_CACHE=cache, MLX_PTX_CACHE_DIR=str(mlx_dir))
    started = time.time()
    cmd = [sys.executable, "-m", "benchmarks.cold_start", "--child", repr(started)] + (["--small"] if small else [])
    result = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith(MARK)]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"run failed ({result.returncode}): {result.stderr[-3000:]}")
    out = json.loads(lines[-1][len(MARK):])
    builds = sorted((p.stat().st_mtime, p.relative_to(mlx_dir).as_posix()) for p in mlx_dir.rglob("*.ptx"))
    out["files"] = len(builds)
    out["written"] = [(t - started, name) for t, name in builds if t >= started]
    return out


def written_table(written: list) -> list[str]:
    """The builds a run wrote, in the order written: MLX writes each as it finishes compiling
    it, one at a time, so the gap before a file is about its build (or the work between)."""
    if not written:
        return ["none"]
    lines = ["| s after start | gap s | file |", "|---|---|---|"]
    last = 0.0
    for t, name in written:
        lines.append(f"| {t:.1f} | {t - last:.1f} | `{name[:90]}` |")
        last = t
    return lines


def count_instantiations() -> list[str]:
    from tools.launch_limits import record, v41_calls

    launches = record("cuda", v41_calls)
    distinct = {(launch.kernel.name, launch.template) for launch in launches}
    by_kernel = collections.Counter(name for name, _ in distinct)
    lines = [f"{len(launches)} launches at V4.1's widths (1-8 tokens, official and GGUF layouts), "
             f"{len(distinct)} distinct instantiations:", "", "| kernel | instantiations |", "|---|---|"]
    lines += [f"| `{name}` | {n} |" for name, n in by_kernel.most_common()]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="toy widths")
    p.add_argument("--runs", type=int, default=2, help="processes per variant, one after the other")
    p.add_argument("--caches", default="off,auto", help="the kernel cache settings to run, in turn")
    p.add_argument("--count", action="store_true", help="only count the kernel instantiations (no GPU needed)")
    p.add_argument("--child", type=float, metavar="STARTED", help=argparse.SUPPRESS)   # a run, started then
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    if a.child is not None:
        child(a.small, a.child)
        return 0
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated

    when = datetime.now()
    lines = [f"# Cold start{' (toy widths)' if a.small else ''}: fresh processes to their first tokens", "",
             f"{when:%Y-%m-%d %H:%M}.", ""]
    if a.count:
        lines += count_instantiations()
    else:
        lines += ["| variant | run | import s | warm-up s | first tokens s | to first tokens s (less weights) | "
                  "dsv4 built / found | build s | .ptx files | tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
        tokens, summary, first_runs = None, {}, {}
        for cache in a.caches.split(","):
            with tempfile.TemporaryDirectory(prefix="dsv4-cold-start-") as tmp:
                for r in range(1, a.runs + 1):
                    out = run_child(a.small, cache, Path(tmp))
                    ph = out["phases"]
                    same = "same" if tokens in (None, out["tokens"]) else "DIFFERENT"
                    tokens = tokens or out["tokens"]
                    summary.setdefault(cache, []).append(ph["to first tokens"])
                    first_runs.setdefault(cache, out["written"])
                    lines.append(f"| kernel cache {cache} | {r} | {ph['import']:.1f} | {ph['warm-up']:.1f} | "
                                 f"{ph['first tokens']:.1f} | {ph['to first tokens']:.1f} | {out['built']} / "
                                 f"{out['found']} | {out['build_s']:.1f} | {out['files']} | {same} |")
                    print(lines[-1], flush=True)
        lines += ["", "Later runs, median seconds to the first tokens (less the weights): " + ", ".join(
            f"cache {c}: {statistics.median(s[1:]):.1f}" for c, s in summary.items() if len(s) > 1)]
        for cache, written in first_runs.items():
            lines += ["", f"Builds the first run with the kernel cache {cache} wrote (`custom_kernel_*`: dsv4's "
                      "when the cache is on; the others MLX's own):", ""] + written_table(written)
    lines += ["", to_markdown(describe())]
    write_dated(a.out, when, f"cold-start{'-count' if a.count else ''}{'-small' if a.small else ''}", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
