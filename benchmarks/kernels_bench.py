"""Custom kernels against their plain-MLX references and mlx_lm's deepseek_v41 path, at V4.1 shapes.

    python benchmarks/kernels_bench.py --out benchmarks/results/DATE-kernels-HOST.md

Shapes: hidden 5120, 64 heads x 512, a 128-row window + 512 selected compressed rows (of 8192),
384 experts of 2304 x 5120 in mxfp4 with top-6 + a shared expert in mxfp8, hc = 4.
The matvec section times dsv4's dense mxfp8 projections for one token with the fp8 input
rounding fused (one launch) against today's path (the rounding kernel, then MLX's
quantized_matmul) and the quantized_matmul alone.
The mHC section also times one site's entry (`hc_mixes_collapse_norm`, 2 launches) against the
separate mixes + collapse kernels (3) and the references.
Variants of one op run interleaved (A B B A ...) in one process, each timing a batch of
calls ending in one `mx.eval`; the report gives medians, the ratio, and the largest
difference between the kernel's output and the reference's. Needs a GPU backend.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from dsv4.kernels import experts as ex  # noqa: E402
from dsv4.kernels import matvec as mv  # noqa: E402
from dsv4.kernels import mhc  # noqa: E402
from dsv4.kernels import sparse_attention as sa  # noqa: E402
from dsv4.kernels.dialect import Kernel, backend  # noqa: E402
from dsv4.quant import qdq_fp8  # noqa: E402

NOOP = Kernel(name="dsv4_bench_noop", input_names=("a",), output_names=("b",),
              body="  if (tid == 0 && group_x == 0) b[0] = a[0];\n")

ROUNDS = 8
CALLS = 20


def timed(fn, calls=CALLS) -> float:
    """Seconds per call of evaluating a batch of `calls` calls (outputs kept alive): the graph is
    built first and only its one eval is timed, i.e. the GPU's time with MLX's encoding overlapped.
    Building it (Python and MLX's graph, ~20-50 us a call) is left out, as a compiled decode step
    does not pay it; timed with it, a call of a few tens of microseconds measured mostly that."""
    mx.synchronize()
    outs = [fn() for _ in range(calls)]
    start = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - start) / calls


def compare(variants: dict, rounds=ROUNDS) -> dict:
    """Median seconds per call of each variant, interleaved A B B A ... after a warm-up."""
    names = list(variants)
    for fn in variants.values():
        mx.eval(fn())
        timed(fn, 3)
    samples = {n: [] for n in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            samples[n].append(timed(variants[n]))
    return {n: statistics.median(s) for n, s in samples.items()}


def max_diff(a, b) -> float:
    return mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()


@functools.lru_cache(maxsize=1)
def copy_bandwidth() -> float:
    """Bytes read + written per second by an elementwise pass over 2 GiB."""
    a = mx.random.uniform(shape=(2 ** 30,)).astype(mx.bfloat16)
    mx.eval(a)
    t = statistics.median(timed(lambda: a + 1, 5) for _ in range(5))
    return 2 * a.nbytes / t


def hardware() -> str:
    gpu = "unknown GPU"
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip() or gpu
    except (OSError, subprocess.SubprocessError):
        if backend() == "metal":
            gpu = str(mx.metal.device_info())
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return (f"GPU: {gpu}; CPU: {cpu} x{os.cpu_count()}; memory {mem:.0f} GiB; "
            f"OS: {platform.platform()}; MLX {mx.__version__} ({backend()} backend)")


def row(name, times, base, extra=""):
    cells = " | ".join(f"{times[k] * 1e6:.1f}" for k in times)
    return f"| {name} | {cells} | {times[base] / times['kernel']:.2f}x | {extra} |"


def bench_attention(lines):
    import mlx_lm.models.deepseek_v41 as ml
    lines += ["## Sparse attention with sink (H=64, D=512, window 128 + 512 selected of 8192)", "",
              "| case | kernel µs | reference µs | mlx_lm µs | reference/kernel | max |kernel-ref| |",
              "|---|---|---|---|---|---|"]
    for S, rope in [(1, False), (1, True), (4, False), (16, False), (64, False)]:
        B, H, D, W, N = 1, 64, 512, 128, 8192
        q = mx.random.normal((B, S, H, D)).astype(mx.bfloat16)
        wkv = mx.random.normal((B, W, D)).astype(mx.bfloat16)
        ckv = mx.random.normal((B, N, D)).astype(mx.bfloat16)
        wi = mx.broadcast_to(mx.arange(W, dtype=mx.int32), (B, S, W))
        ti = mx.random.randint(0, N, (B, S, 512)).astype(mx.int32)
        sinks = mx.random.normal((H,))
        cos = sin = None
        if rope:
            theta = mx.random.uniform(-3, 3, (B, S, 32))
            cos, sin = mx.cos(theta), mx.sin(theta)
        args = (q, wkv, wi, ckv, ti, sinks, D ** -0.5, cos, sin)
        variants = {"kernel": lambda: sa.sparse_attention_kernel(*args),
                    "reference": lambda: sa.sparse_attention_reference(*args),
                    "mlx_lm": lambda: ml._sparse_attention(q, [wkv, ckv], [wi, ti], sinks=sinks, scale=D ** -0.5)}
        t = compare(variants)
        diff = max_diff(variants["kernel"](), variants["reference"]())
        lines.append(row(f"S={S}{' + inverse RoPE' if rope else ''}", t, "reference", f"{diff:.2e}"))
    lines.append("")


def random_mx(shape, mode):
    """Random packed weights + e8m0 scales: fp4 codes are all finite; fp8 bytes keep exponents <= 7."""
    n_words = shape[-1] * (4 if mode == "mxfp4" else 8) // 32
    words = mx.random.randint(-2 ** 31, 2 ** 31 - 1, (*shape[:-1], n_words), dtype=mx.int32).view(mx.uint32)
    if mode == "mxfp8":
        words = words & 0x77777777
    scales = mx.random.randint(118, 124, (*shape[:-1], shape[-1] // 32)).astype(mx.uint8)
    return ex.QuantizedMatrix(words, scales, None, 32, 4 if mode == "mxfp4" else 8, mode)


def mlx_lm_moe(x, idx, w, gate, up, down, shared, limit):
    """mlx_lm deepseek_v41's MoE: SwitchGLU (gather_qmm in bf16, limit-clamped SwiGLU), router
    weights applied after the down projection, shared MLP added in fp32."""
    from mlx_lm.models.deepseek_v41 import DeepseekV41SwiGLU
    act = DeepseekV41SwiGLU(limit)
    xe = mx.expand_dims(x, (-2, -3))
    qm = lambda a, m, i: mx.gather_qmm(a, m.weight, m.scales, m.biases, rhs_indices=i, transpose=True, **m.kwargs())
    routed = qm(act(qm(xe, up, idx), qm(xe, gate, idx)), down, idx).squeeze(-2)
    out = mx.sum(routed.astype(mx.float32) * w[..., None], axis=1)
    sg, su, sd = shared
    lin = lambda a, m: mx.quantized_matmul(a, m.weight, m.scales, m.biases, transpose=True, **m.kwargs())
    out = out + lin(act(lin(x, su), lin(x, sg)).astype(x.dtype), sd).astype(mx.float32)
    return out.astype(x.dtype)


def bench_experts(lines, bandwidth):
    E, I, D, K = 384, 2304, 5120, 6
    gate, up, down = random_mx((E, I, D), "mxfp4"), random_mx((E, I, D), "mxfp4"), random_mx((E, D, I), "mxfp4")
    shared = (random_mx((I, D), "mxfp8"), random_mx((I, D), "mxfp8"), random_mx((D, I), "mxfp8"))
    mx.eval(gate.weight, up.weight, down.weight, [m.weight for m in shared])
    per_expert = sum(m.weight.nbytes + m.scales.nbytes for m in (gate, up, down)) / E
    shared_bytes = sum(m.weight.nbytes + m.scales.nbytes for m in shared)
    lines += ["## Routed experts (384 x 2304x5120 mxfp4, top-6) + shared expert (mxfp8)", "",
              f"Copy bandwidth measured here: {bandwidth / 1e12:.2f} TB/s (read + write of 2 GiB).", "",
              "| case | kernel µs | reference µs | mlx_lm gather_qmm µs | mlx_lm/kernel | kernel weight GB/s, % of copy bw; max |kernel-ref| |",
              "|---|---|---|---|---|---|"]
    for T, act_quant in [(1, False), (1, True), (4, False), (8, False)]:
        x = (mx.random.normal((T, D)) * 2).astype(mx.bfloat16)
        idx = mx.stack([mx.random.permutation(E)[:K] for _ in range(T)]).astype(mx.int32)
        w = mx.random.uniform(0.1, 1.0, (T, K))
        unique = len(set(idx.flatten().tolist()))
        args = (x, idx, w, gate, up, down, shared, 10.0, act_quant)
        variants = {"kernel": lambda: ex.experts_kernel(*args),
                    "reference": lambda: ex.experts_reference(*args),
                    "mlx_lm": lambda: mlx_lm_moe(x, idx, w, gate, up, down, shared, 10.0)}
        t = compare(variants)
        diff = max_diff(variants["kernel"](), variants["reference"]())
        gbs = (unique * per_expert + shared_bytes) / t["kernel"]
        lines.append(row(f"T={T}{' act_quant' if act_quant else ''} ({unique} experts)", t, "mlx_lm",
                         f"{gbs / 1e9:.0f} GB/s, {100 * gbs / bandwidth:.0f}%; {diff:.2e}"))
    # The FFN site's mHC expand fused into the down kernel ("sum6 + HC4") vs a separate expand.
    x = (mx.random.normal((1, D)) * 2).astype(mx.bfloat16)
    idx = mx.random.permutation(E)[:K].reshape(1, K).astype(mx.int32)
    w = mx.random.uniform(0.1, 1.0, (1, K))
    residual = mx.random.normal((1, 4, D)).astype(mx.bfloat16)
    post, comb = mx.random.uniform(0, 2, (1, 4)), mx.random.uniform(0, 1, (1, 4, 4))
    site = (residual, post, comb)
    import mlx_lm.models.deepseek_v41 as ml
    t = compare({"kernel": lambda: ex.experts_kernel(x, idx, w, gate, up, down, shared, 10.0, False, site),
                 "reference": lambda: mhc.hc_expand(ex.experts_kernel(x, idx, w, gate, up, down, shared), *site),
                 "mlx_lm": lambda: ml._expand(mlx_lm_moe(x, idx, w, gate, up, down, shared, 10.0), *site)})
    lines.append(row("T=1 + mHC expand fused (reference column: kernel then expand kernel)", t, "mlx_lm", ""))
    lines.append("")


MATVEC_SHAPES = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_b", 5120, 8192),
                 ("indexer wq_b", 4096, 1280), ("shared expert w1", 2304, 5120)]


def bench_matvec(lines, bandwidth):
    lines += ["## Dense mxfp8 projections, T=1, act_quant (fused rounding + matvec)", "",
              f"Copy bandwidth measured here: {bandwidth / 1e12:.2f} TB/s (read + write of 2 GiB).", "",
              "| case | kernel µs | qdq + quantized_matmul µs | quantized_matmul µs | qdq+qmm/kernel | "
              "kernel weight GB/s, % of copy bw; max |kernel-ref| |", "|---|---|---|---|---|---|"]
    for name, N, K in MATVEC_SHAPES:
        q = random_mx((N, K), "mxfp8")
        x = (mx.random.normal((1, K)) * 2).astype(mx.bfloat16)
        mx.eval(q.weight, q.scales, x)
        qmm = lambda a: mx.quantized_matmul(a, q.weight, q.scales, q.biases, transpose=True, **q.kwargs())
        variants = {"kernel": lambda: mv.quantized_matvec(x, q, True),
                    "today": lambda: qmm(qdq_fp8(x)),
                    "qmm": lambda: qmm(x)}
        t = compare(variants)
        diff = max_diff(variants["kernel"](), mv.matvec_reference(x, q, True))
        gbs = (q.weight.nbytes + q.scales.nbytes) / t["kernel"]
        lines.append(row(f"{name} {N}x{K}", t, "today", f"{gbs / 1e9:.0f} GB/s, {100 * gbs / bandwidth:.0f}%; {diff:.2e}"))
    lines.append("")


def bench_head(lines, bandwidth):
    """The bf16 head (129280 x 5120) to fp32 logits for one token: the one-pass kernel against
    what the model did before it (x_fp32 @ W.T: MLX widens W to an fp32 temporary first) and
    mlx-lm's bf16 product (bf16 logits: not the reference's numerics, the speed to beat)."""
    from dsv4.kernels import head
    V, D = 129280, 5120
    w = (mx.random.normal((V, D)) / D ** 0.5).astype(mx.bfloat16)
    x = mx.random.normal((1, D)) * 3
    xb = x.astype(mx.bfloat16)
    mx.eval(w, x, xb)
    t = compare({"kernel": lambda: head.head_logits(x, w),
                 "reference": lambda: x @ w.T,
                 "mlx_lm": lambda: xb @ w.T})
    diff = max_diff(head.head_logits(x, w), x @ w.T)
    gbs = w.nbytes / t["kernel"]
    lines += ["## Head: 129280 x 5120 bf16 -> fp32 logits, T=1", "",
              "| case | kernel µs | x_fp32 @ W.T µs | mlx_lm bf16 x @ W.T µs | mlx_lm/kernel | "
              "kernel weight GB/s, % of copy bw; max |kernel-ref| |", "|---|---|---|---|---|---|",
              row("T=1", t, "mlx_lm", f"{gbs / 1e9:.0f} GB/s, {100 * gbs / bandwidth:.0f}%; {diff:.2e}"),
              f"(x_fp32 @ W.T / kernel: {t['reference'] / t['kernel']:.2f}x)", ""]


def bench_mhc(lines):
    D = 5120
    lines += ["## mHC (hc = 4, D = 5120)", "",
              "| case | kernel µs | reference µs | reference/kernel | max |kernel-ref| |", "|---|---|---|---|---|"]
    for T in (1, 8):
        X = mx.random.normal((1, T, 4, D)).astype(mx.bfloat16)
        fn = mx.random.normal((24, 4 * D)) * 0.01
        scale, base = mx.random.uniform(0.5, 2, (3,)), mx.random.normal((24,))
        pre, post, comb = mhc.hc_mixes_reference(X, fn, scale, base, 1e-20, 1e-6)
        weight = mx.random.uniform(0.5, 1.5, (D,)).astype(mx.bfloat16)
        y = mx.random.normal((1, T, D)).astype(mx.bfloat16)
        cases = {
            "mixes (projection + Sinkhorn)": (lambda: mhc.hc_mixes(X, fn, scale, base, 1e-20, 1e-6),
                                              lambda: mhc.hc_mixes_reference(X, fn, scale, base, 1e-20, 1e-6)),
            "collapse + RMSNorm": (lambda: mhc.hc_collapse_norm(X, pre, weight, 1e-20),
                                   lambda: mhc.hc_collapse_norm_reference(X, pre, weight, 1e-20)),
            "expand": (lambda: mhc.hc_expand(y, X, post, comb), lambda: mhc.hc_expand_reference(y, X, post, comb)),
        }
        for name, (kern, ref) in cases.items():
            t = compare({"kernel": kern, "reference": ref})
            k_out, r_out = kern(), ref()
            k_out = k_out if isinstance(k_out, tuple) else (k_out,)
            r_out = r_out if isinstance(r_out, tuple) else (r_out,)
            diff = max(max_diff(a, b) for a, b in zip(k_out, r_out))
            lines.append(f"| T={T} {name} | {t['kernel'] * 1e6:.1f} | {t['reference'] * 1e6:.1f} | "
                         f"{t['reference'] / t['kernel']:.2f}x | {diff:.2e} |")
    lines.append("")
    bench_site_entry(lines, D)


def bench_site_entry(lines, D):
    """One mHC site's entry (collapse + RMSNorm with the previous pre, and this site's mixes):
    the fused dispatcher (2 launches) vs the two separate dispatchers (3) vs the references."""
    lines += ["### mHC site entry: hc_mixes_collapse_norm", "",
              "| case | fused µs (2 launches) | mixes + collapse kernels µs (3) | reference µs | "
              "separate/fused | reference/fused | max |fused-ref| |", "|---|---|---|---|---|---|---|"]
    for T in (1, 8):
        X = mx.random.normal((1, T, 4, D)).astype(mx.bfloat16)
        fn = mx.random.normal((24, 4 * D)) * 0.01
        scale, base = mx.random.uniform(0.5, 2, (3,)), mx.random.normal((24,))
        pre_in = mx.random.uniform(0, 1, (1, T, 4))
        weight = mx.random.uniform(0.5, 1.5, (D,)).astype(mx.bfloat16)
        args = (X, pre_in, fn, scale, base, weight, 1e-6, 1e-6, 1e-6, 20)
        variants = {"kernel": lambda: mhc.hc_mixes_collapse_norm(*args),
                    "separate": lambda: (mhc.hc_collapse_norm(X, pre_in, weight, 1e-6),
                                         *mhc.hc_mixes(X, fn, scale, base, 1e-6, 1e-6, 20)),
                    "reference": lambda: mhc.hc_mixes_collapse_norm_reference(*args)}
        t = compare(variants)
        diff = max(max_diff(a, b) for a, b in zip(variants["kernel"](), variants["reference"]()))
        lines.append(f"| T={T} | {t['kernel'] * 1e6:.1f} | {t['separate'] * 1e6:.1f} | {t['reference'] * 1e6:.1f} | "
                     f"{t['separate'] / t['kernel']:.2f}x | {t['reference'] / t['kernel']:.2f}x | {diff:.2e} |")
    lines.append("")


def overhead(lines):
    """Per-call cost of launching an empty custom kernel and of one tiny MLX op: the floor
    under every timing below (CPU-side graph building and launch, not GPU work)."""
    a = mx.zeros((8,), mx.float32)
    mx.eval(a)
    t = compare({"kernel": lambda: NOOP(inputs=[a], output_shapes=[(8,)], output_dtypes=[mx.float32],
                                        grid=(32, 1, 1), threadgroup=(32, 1, 1))[0],
                 "reference": lambda: a + 1})
    lines += [f"Launch floor: empty custom kernel {t['kernel'] * 1e6:.1f} µs per call, one tiny MLX op "
              f"{t['reference'] * 1e6:.1f} µs per call.", ""]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Markdown report to write")
    parser.add_argument("--only", choices=["attention", "experts", "matvec", "head", "mhc"], action="append")
    args = parser.parse_args()
    if backend() is None:
        sys.exit("kernels_bench needs a GPU backend (Metal or CUDA) on the default device")
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# Custom kernels vs references — {now:%Y-%m-%d %H:%M} UTC", "", hardware(), "",
             f"Medians of {ROUNDS} interleaved rounds of {CALLS} calls per variant (µs per call).", ""]
    overhead(lines)
    todo = args.only or ["attention", "experts", "matvec", "head", "mhc"]
    steps = {"attention": lambda: bench_attention(lines),
             "experts": lambda: bench_experts(lines, copy_bandwidth()),
             "matvec": lambda: bench_matvec(lines, copy_bandwidth()),
             "head": lambda: bench_head(lines, copy_bandwidth()),
             "mhc": lambda: bench_mhc(lines)}
    for name in todo:
        print(f"[kernels_bench] {name} ...", flush=True)
        steps[name]()
        args.out.write_text("\n".join(lines) + "\n")   # partial report survives a timeout
    print("\n".join(lines))


if __name__ == "__main__":
    main()
