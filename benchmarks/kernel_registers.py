"""Registers, spills and threadgroup memory of the CUDA kernels at V4.1's widths, from ptxas
(NVRTC with --ptxas-options=-v, sm_90a, the text MLX builds: dsv4/kernels/cuda_cache.py), for
the portable experts/matvec kernels against their tensor-core launches (DSV4_KERNEL_MOE_MMA,
DSV4_KERNEL_MATVEC_MMA). Needs no GPU, only the test extra's NVRTC wheels.

    python -m benchmarks.kernel_registers [--gguf] [--out DIR]

Each kernel's first compile-gate instantiation (Kernel.checks: V4.1's mxfp4 experts with the
mxfp8 shared expert, top-6, I = 2304, D = 5120; the matvec at K = 5120 mxfp8) is compiled once.
Registers per thread bound the warps an SM keeps resident (65536 registers per SM): fewer
registers, more loads in flight to hide DRAM latency in these bandwidth-bound launches.
`--gguf`: the GGUF-block launches instead (gguf_dot.py's rows_dot), every compile-gate
instantiation: ds4's q2 and q4 recipes and a Q2_K/Q4_K mix, the matvec per GGUF type.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

PAIRS = [("experts gate/up", "GATE_UP_KERNEL", "MMA_GATE_UP_KERNEL"),
         ("experts gate/up with the router's tail", "ROUTED_GATE_UP_KERNEL", "MMA_ROUTED_GATE_UP_KERNEL"),
         ("experts down", "DOWN_KERNEL", "MMA_DOWN_KERNEL"),
         ("projection matvec", "MATVEC_KERNEL", "MMA_MATVEC_KERNEL")]


GGUF = [("experts gate/up", "GGUF_GATE_UP_KERNEL"), ("experts gate/up with the router's tail", "GGUF_ROUTED_GATE_UP_KERNEL"),
        ("experts down", "GGUF_DOWN_KERNEL"), ("projection matvec", "GGUF_MATVEC_KERNEL")]


def resources(kernel, paths, check: int = 0) -> dict:
    from dsv4.kernels import cuda_cache
    from tools.metal_syntax_check import cuda_source

    name, text = cuda_source(kernel, kernel.checks[check])
    log: list = []
    start = time.perf_counter()
    cuda_cache.nvrtc_build(text, name, "sm_90a", str(paths[0]), paths[1], options=("--ptxas-options=-v",), log=log)
    seconds = time.perf_counter() - start
    info = "".join(log)
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", info))
    smem = re.search(r"(\d+) bytes smem", info)
    return dict(registers=regs, spill=spill, smem=int(smem.group(1)) if smem else 0, seconds=seconds,
                template=", ".join(f"{n}={v}" for n, v in kernel.checks[check][2] if isinstance(v, int)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", action="store_true", help="the GGUF-block launches, every instantiation")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    from benchmarks.hardware import describe, to_markdown
    from dsv4.kernels import experts, matvec
    from tools.metal_syntax_check import nvrtc_paths

    paths = nvrtc_paths()
    if paths is None:
        print("error: NVRTC is not installed (pip install -e '.[test]' installs it)", file=sys.stderr)
        return 2
    when = datetime.now()
    template = ["template"] if a.gguf else []   # GGUF: every instantiation, so each row names its own
    columns = ["launch", "kernel", *template, "registers / thread", "spill bytes", "static smem bytes", "NVRTC s"]
    lines = [f"# CUDA kernel resources at V4.1's widths (ptxas, sm_90a){': GGUF blocks' if a.gguf else ''}", "",
             f"{when:%Y-%m-%d %H:%M}.", "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    if a.gguf:
        for what, attr in GGUF:
            kernel = getattr(experts, attr, None) or getattr(matvec, attr)
            for i in range(len(kernel.checks)):
                r = resources(kernel, paths, i)
                lines.append(f"| {what} | `{kernel.name}` | {r['template']} | {r['registers']} | {r['spill']} | "
                             f"{r['smem']} | {r['seconds']:.1f} |")
                print(lines[-1], flush=True)
    for what, portable, mma in [] if a.gguf else PAIRS:
        for attr in (portable, mma):
            kernel = getattr(experts, attr, None) or getattr(matvec, attr)
            r = resources(kernel, paths)
            lines.append(f"| {what} | `{kernel.name}` | {r['registers']} | {r['spill']} | {r['smem']} | {r['seconds']:.1f} |")
            print(lines[-1], flush=True)
    lines += ["", to_markdown(describe())]
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"{when:%Y-%m-%d-%H%M}-kernel-registers{'-gguf' if a.gguf else ''}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
