"""Registers, spills and threadgroup memory of the CUDA kernels at V4.1's widths, from ptxas
(NVRTC with --ptxas-options=-v, sm_90a, the text MLX builds: dsv4/kernels/cuda_cache.py), for
the experts and projection matvec kernels. Needs no GPU, only the test extra's NVRTC wheels.

    python -m benchmarks.kernel_registers [--gguf] [--nvdisasm PATH] [--out DIR]

Each kernel's first compile-gate instantiation (Kernel.checks: V4.1's mxfp4 experts with the
mxfp8 shared expert, top-6, I = 2304, D = 5120; the matvec at K = 5120 mxfp8) is compiled once.
Registers per thread bound the warps an SM keeps resident (65536 registers per SM): fewer
registers, more loads in flight to hide DRAM latency in these bandwidth-bound launches.
The decode tensor-core launches (experts_mma.py, attention_decode_staged.py), the prefill's
routed-experts launches (experts_prefill.py) and sparse attention launches (attention_prefill.py,
attention_prefill_staged.py) follow. `--nvdisasm PATH` adds each
kernel's innermost loops in SASS instructions (nvdisasm of the cubin). `--gguf`: the GGUF-block
launches instead (gguf_dot.py's rows_dot), every compile-gate instantiation: ds4's q2 and q4
recipes and a Q2_K/Q4_K mix, the matvec per GGUF type.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

PORTABLE = [("experts gate/up", "GATE_UP_KERNEL"), ("experts gate/up with the router's tail", "ROUTED_GATE_UP_KERNEL"),
            ("experts down", "DOWN_KERNEL"), ("projection matvec", "MATVEC_KERNEL")]


GGUF = [("experts gate/up", "GGUF_GATE_UP_KERNEL"), ("experts gate/up with the router's tail", "GGUF_ROUTED_GATE_UP_KERNEL"),
        ("experts down", "GGUF_DOWN_KERNEL"), ("projection matvec", "GGUF_MATVEC_KERNEL"),
        ("experts gate/up writing h as limbs", "GGUF_LIMBS_GATE_UP_KERNEL"),
        ("experts down over h as limbs", "GGUF_LIMBS_DOWN_KERNEL")]


# One GGUF unit alone (gguf_dot.py's GgufUnit<MODE>: its load and every chunk's dot8), for counting
# the PTX instructions it issues per 32 weights: its x comes from threadgroup memory, as in the kernels.
UNIT_PROBE_BODY = r"""
  typedef GgufUnit<MODE> U;
  SHARED float xs[256];
  xs[tid & 255u] = (float)tid;   // defined values: reads of an unwritten array fold away
  BARRIER();
  U a;
  a.load(w, (size_t)group_x * 4096, (int)tid);
  float acc = 0.0f;
#pragma unroll
  for (int c = 0; c < U::VALUES / 8; ++c) {
    float xv[8];
    for (int i = 0; i < 8; ++i) xv[i] = xs[8 * c + i];
    acc += a.dot8(c, xv, xv[0], tables);
  }
  out[tid] = acc;
"""
UNITS = [("Q8_0", 10), ("Q8_0 pairs", 14), ("Q8_0 wide", 20), ("IQ2_XXS", 13), ("IQ2_XXS wide", 23),
         ("Q2_K", 12), ("Q2_K wide", 22), ("Q4_K", 11)]


def unit_counts(paths, mode: int) -> dict:
    """PTX instruction counts of one GgufUnit<mode> (load + dots), per 32 weights: global loads by
    width, int-to-float conversions, all instructions."""
    import mlx.core as mx
    from dsv4.kernels import gguf_dot, nvrtc
    from dsv4.kernels.dialect import Kernel
    from dsv4.kernels.experts import X_HEADER
    from tools.metal_syntax_check import cuda_source

    kernel = Kernel(name="gguf_unit_probe", input_names=("w", "tables"), output_names=("out",),
                    body=UNIT_PROBE_BODY, header=X_HEADER + gguf_dot.HEADER,
                    checks=(((mx.uint8, mx.uint32), (mx.float32,), (("MODE", mode),)),))
    name, text = cuda_source(kernel, kernel.checks[0])
    ptx: list = []
    nvrtc.build(text, name, "compute_90a", str(paths[0]), paths[1], ptx=ptx)
    body = [ln.strip() for ln in ptx[0].splitlines()]
    body = [ln for ln in body if ln and not ln.startswith(("//", ".", "{", "}", "$", "ret"))]
    per = 32 / {10: 32, 14: 64, 20: 32, 13: 32, 23: 32, 12: 128, 22: 128, 11: 64}[mode]
    loads = {}
    for ln in body:
        m = re.match(r"ld\.global(?:\.nc)?((?:\.v[24])?)\.[usbf](\d+)", ln)
        if m:
            width = int(m.group(2)) // 8 * (int(m.group(1)[2:]) if m.group(1) else 1)
            loads[width] = loads.get(width, 0) + per
    cvt = sum(per for ln in body if re.match(r"cvt\.rn\.f32\.[us]\d+", ln))
    return dict(loads=loads, cvt=cvt, total=len(body) * per)


def resources(kernel, paths, check: int = 0) -> dict:
    from dsv4.kernels import nvrtc
    from tools.metal_syntax_check import cuda_source

    name, text = cuda_source(kernel, kernel.checks[check])
    log: list = []
    start = time.perf_counter()
    cubin, _ = nvrtc.build(text, name, "sm_90a", str(paths[0]), paths[1], options=("--ptxas-options=-v",), log=log)
    seconds = time.perf_counter() - start
    info = "".join(log)
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", info))
    smem = re.search(r"(\d+) bytes smem", info)
    return dict(registers=regs, spill=spill, smem=int(smem.group(1)) if smem else 0, seconds=seconds,
                template=", ".join(f"{n}={v}" for n, v in kernel.checks[check][2] if isinstance(v, int)),
                cubin=cubin)


def innermost_loops(cubin: bytes, nvdisasm: str) -> list:
    """SASS instructions in each innermost loop of a cubin (a backward branch's span holding no
    other), in code order: where a launch spends its issue slots (the lanes' unit loops)."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    count, labels, spans = 0, {}, []
    for line in text.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = count
        elif re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", line):
            target = re.search(r"BRA\s.*?(L_x_\d+)", line)
            if target and labels.get(target.group(1), count) < count:   # backward (not the final self-branch)
                spans.append((labels[target.group(1)], count))
            count += 1
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return [b - a + 1 for a, b in inner]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", action="store_true", help="the GGUF-block launches, every instantiation")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--nvdisasm", help="nvdisasm's path (the nvidia-cuda-nvdisasm wheel's, not in the test extra): "
                                      "each kernel's innermost loops in SASS instructions too")
    a = p.parse_args(argv)
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated
    from dsv4.kernels import (attention_decode_staged, attention_prefill, attention_prefill_staged, experts,
                              experts_mma, experts_prefill, matvec)
    from tools.metal_syntax_check import required_nvrtc_paths

    paths = required_nvrtc_paths()
    when = datetime.now()
    template = ["template"] if a.gguf else []   # GGUF: every instantiation, so each row names its own
    loops = ["innermost loops, SASS instructions"] if a.nvdisasm else []
    columns = ["launch", "kernel", *template, "registers / thread", "spill bytes", "static smem bytes", "NVRTC s", *loops]
    lines = [f"# CUDA kernel resources at V4.1's widths (ptxas, sm_90a){': GGUF blocks' if a.gguf else ''}", "",
             f"{when:%Y-%m-%d %H:%M}.", "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    if a.gguf:
        for what, attr in GGUF:
            kernel = getattr(experts, attr, None) or getattr(matvec, attr)
            for i in range(len(kernel.checks)):
                r = resources(kernel, paths, i)
                sizes = [", ".join(map(str, innermost_loops(r["cubin"], a.nvdisasm)))] if loops else []
                lines.append("| " + " | ".join([what, f"`{kernel.name}`", r["template"], str(r["registers"]), str(r["spill"]),
                                                 str(r["smem"]), f"{r['seconds']:.1f}", *sizes]) + " |")
                print(lines[-1], flush=True)
    if a.gguf:
        lines += ["", "## One unit's PTX per 32 weights (before ptxas)", "",
                  "The unit's load and dot8s alone (gguf_dot.py's GgufUnit<MODE>, x from threadgroup memory); "
                  "'wide' = DSV4_KERNEL_GGUF_WIDE, 'pairs' = DSV4_KERNEL_GGUF_Q8_PAIRS.", "",
                  "| unit | MODE | global loads | loads by bytes | int->float cvt | PTX instructions |",
                  "|---|---|---|---|---|---|"]
        for label, mode in UNITS:
            c = unit_counts(paths, mode)
            widths = ", ".join(f"{n:g} x {w} B" for w, n in sorted(c["loads"].items()))
            lines.append(f"| {label} | {mode} | {sum(c['loads'].values()):g} | {widths} | {c['cvt']:g} | {c['total']:g} |")
            print(lines[-1], flush=True)
    kernels = [(what, getattr(experts, attr, None) or getattr(matvec, attr), 0) for what, attr in PORTABLE]
    ints = next(i for i, c in enumerate(experts.GATE_UP_KERNEL.checks) if ("MODE", experts.MXFP4_INT) in c[2])
    kernels.insert(1, ("experts gate/up, mxfp4 in the integer unit (DSV4_KERNEL_MOE_DP4A)", experts.GATE_UP_KERNEL, ints))
    kernels += [(what, kernel, 0) for what, kernel in [
                ("experts gate/up with the router's tail on tensor cores (DSV4_KERNEL_MOE_MMA)",
                 experts_mma.ROUTED_GATE_UP_KERNEL),
                ("experts down on tensor cores (DSV4_KERNEL_MOE_MMA)", experts_mma.DOWN_KERNEL),
                ("decode sparse attention on tensor cores (DSV4_KERNEL_ATTENTION_STAGED_DECODE)",
                 attention_decode_staged.KERNEL),
                ("prefill routed experts (x staged in the launch)", experts_prefill.KERNEL),
                ("prefill routed experts, bf16 mma (DSV4_KERNEL_PREFILL_EXPERTS_BF16)", experts_prefill.KERNEL_BF16),
                ("prefill routed experts, bf16 fed a chunk ahead (DSV4_KERNEL_PREFILL_EXPERTS_STREAM)",
                 experts_prefill.KERNEL_STREAM),
                ("prefill sparse attention, a threadgroup per 16 heads", attention_prefill.KERNEL),
                ("prefill sparse attention, rows staged for all heads (DSV4_KERNEL_PREFILL_ATTENTION_STAGED)",
                 attention_prefill_staged.KERNEL)]]
    for what, kernel, check in [] if a.gguf else kernels:
        r = resources(kernel, paths, check)
        sizes = [", ".join(map(str, innermost_loops(r["cubin"], a.nvdisasm)))] if loops else []
        lines.append("| " + " | ".join([what, f"`{kernel.name}`", str(r["registers"]), str(r["spill"]), str(r["smem"]),
                                         f"{r['seconds']:.1f}", *sizes]) + " |")
        print(lines[-1], flush=True)
    lines += ["", to_markdown(describe())]
    write_dated(a.out, when, f"kernel-registers{'-gguf' if a.gguf else ''}", lines, shown=0)   # rows printed as made
    return 0


if __name__ == "__main__":
    sys.exit(main())
