"""GGUF blocks kept as they are (issue 21) at V4.1's expert shapes, on a GPU.

    python benchmarks/gguf_native.py [--out benchmarks/results]

Routed experts 384 x (2304 x 5120), top-6, the shared expert, act_quant (the model's numerics):
ds4's q2 (IQ2_XXS gate/up, Q2_K down, Q8_0 shared) and q4 (Q4_K, Q8_0 shared) recipes in the
fused GGUF kernels against the official mxfp4 experts (mxfp8 shared) in the fused mx kernels
(MX_VARIANTS: their float unit, and their integer one, DSV4_KERNEL_MOE_DP4A).

1. Decode: the fused experts (gate/up + down launches) for 1, 2, 4 and 8 tokens of distinct
   experts: time per call (medians of the eval, kernels_bench.timed) and the rate at which it reads the
   weights it uses, for each GGUF unit variant (VARIANTS: the blocks as before, Q8_0 pairs, the
   wide 16-byte loads, Q8_0's bias off in fp16; for the experts also EXPERT_VARIANTS' fp16-subnormal
   codes and q2's tensor-core gate/up) interleaved in one run, with whether its output equals the first's; the
   same for the GGUF Q8_0 dense matvec at the dense projections' shapes (1 and 8 tokens), and
   for a verify's 2-6 tokens (--verify-tokens) its multi-token launch (DSV4_KERNEL_MATVEC_TOKENS:
   each unit decoded once for every token) against a threadgroup a token, the grouped wo_a too.
2. Prefill: one MoE layer's experts over a 512-token chunk, 8 chunks (4096 tokens), through
   the path prefill takes: GGUF (only the selected experts decoded, a batch at a time) against
   the affine mapping the converter used to write (IQ2_XXS -> 3-bit, Q2_K -> 4-bit, Q4_K ->
   4-bit; gather_qmm), tokens per second.

Also measures the device copy roofline with torch where torch is installed (the H200 has it).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.kernels_bench import compare, copy_bandwidth, hardware, max_diff, random_mx  # noqa: E402
from benchmarks.report import write_dated  # noqa: E402
from benchmarks.slice_decode import GGUF_EXPERTS, gguf_blocks_on_device  # noqa: E402
from dsv4 import flags  # noqa: E402
from dsv4.kernels import experts as ex  # noqa: E402
from dsv4.kernels import matvec as mv  # noqa: E402
from dsv4.kernels.gguf_dot import GGUFMatrix  # noqa: E402

E, I, D, K = 384, 2304, 5120, 6
AFFINE_BITS = {"IQ2_XXS": 3, "Q2_K": 4, "Q4_K": 4, "Q8_0": 8}


def torch_copy_bandwidth() -> float | None:
    """Bytes read + written per second by torch's device copy of 4 GiB, or None without torch/CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.empty(2 ** 31, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * a.numel() * a.element_size() / statistics.median(times)


def gguf(shape, qtype) -> GGUFMatrix:
    m = GGUFMatrix(gguf_blocks_on_device(shape, qtype), qtype)
    mx.eval(m.weight)
    return m


def recipe_weights(name: str):
    if name == "mxfp4":
        mats = [random_mx(s, "mxfp4") for s in ((E, I, D), (E, I, D), (E, D, I))]
        shared = tuple(random_mx(s, "mxfp8") for s in ((I, D), (I, D), (D, I)))
    else:
        g, u, d = GGUF_EXPERTS[name]
        mats = [gguf((E, I, D), g), gguf((E, I, D), u), gguf((E, D, I), d)]
        shared = tuple(gguf(s, "Q8_0") for s in ((I, D), (I, D), (D, I)))
    mx.eval([m.weight for m in mats + list(shared)])
    return (*mats, shared)


def expert_bytes(m) -> float:
    per = m.weight.nbytes + (m.scales.nbytes if hasattr(m, "scales") else 0)
    return per / (E if m.weight.ndim == 3 else 1)


# The GGUF units' variants (switches read when a launch is made, so one process interleaves them).
_PORTABLE = dict(kernel_gguf_q8_pairs=False, kernel_gguf_wide=False, kernel_gguf_halves=False,
                 kernel_gguf_q8_hsub=False, kernel_gguf_dp4a=False, kernel_gguf_dp4a_down=False)
VARIANTS = {"blocks": _PORTABLE,
            "Q8_0 pairs": dict(_PORTABLE, kernel_gguf_q8_pairs=True),
            "wide": dict(_PORTABLE, kernel_gguf_wide=True),
            "Q8_0 hsub": dict(_PORTABLE, kernel_gguf_wide=True, kernel_gguf_q8_hsub=True),
            "dp4a": dict(_PORTABLE, kernel_gguf_wide=True, kernel_gguf_q8_hsub=True, kernel_gguf_dp4a=True)}
# The experts' units with fp16-subnormal codes (on the wide units; the dense Q8_0 matvec has none).
_HALVES = dict(VARIANTS["wide"], kernel_gguf_halves=True)
EXPERT_VARIANTS = dict(VARIANTS, halves=_HALVES,
                       **{"Q8_0 hsub": dict(_HALVES, kernel_gguf_q8_hsub=True),   # the experts' on the halves units
                          "dp4a": dict(_HALVES, kernel_gguf_q8_hsub=True, kernel_gguf_dp4a=True)})
# dp4a with h handed to the down launch as limbs, which it reads in the integer units.
EXPERT_VARIANTS["dp4a, down"] = dict(EXPERT_VARIANTS["dp4a"], kernel_gguf_dp4a_down=True)
# The backend's defaults, and with the down launch's shared expert over several SIMD groups
# (DSV4_KERNEL_MOE_SHARED_SPLITS=0: by its row's bytes).
EXPERT_VARIANTS["default"] = {}
EXPERT_VARIANTS["default, split"] = dict(kernel_moe_shared_splits=0)
# The official mxfp4 experts: the float unit, and the integer one (DSV4_KERNEL_MOE_DP4A).
MX_VARIANTS = {"mx": {}, "mx dp4a": dict(kernel_moe_dp4a=True), "mx split": dict(kernel_moe_shared_splits=0)}


def under(switches: dict, fn):
    def run():
        with flags.override(**switches):
            return fn()
    return run


def decode_inputs(tokens: int):
    """x [tokens, D] (bf16), the experts [tokens, K] (all distinct) and their router weights."""
    x = (mx.random.normal((tokens, D)) * 2).astype(mx.bfloat16)
    idx = mx.random.permutation(E)[: tokens * K].reshape(tokens, K).astype(mx.int32)
    w = mx.random.uniform(0.1, 1.0, (tokens, K))
    mx.eval(x, idx, w)
    return x, idx, w


def decode_rows(name, weights, tokens_list, only=None):
    """(recipe, variant, tokens, seconds, bytes, gate/up cell, down cell) per variant and token
    count; the variants (EXPERT_VARIANTS, or MX_VARIANTS for mxfp4; those named in `only` if
    given) interleaved in one run."""
    gate, up, down, shared = weights
    variants = MX_VARIANTS if name == "mxfp4" else EXPERT_VARIANTS
    variants = {k: v for k, v in variants.items() if only is None or k in only}
    rows = []
    if not variants:   # none of this recipe's variants asked for
        return rows
    for tokens in tokens_list:
        x, perm, w = decode_inputs(tokens)
        runs, outputs = {}, {}
        for label, switches in variants.items():
            with flags.override(**switches):   # h as this variant's down launch reads it (limbs or bf16)
                limbs = ex.limbs_between(down, shared[2], True)
                h = ex.gate_up_kernel(x, perm, w, gate, up, shared, 10.0, True, limbs=limbs)[0]
            mx.eval(h)
            runs[f"{label} both"] = under(switches, lambda: ex.experts_kernel(x, perm, w, gate, up, down, shared, 10.0, True))
            runs[f"{label} gate/up"] = under(switches, lambda limbs=limbs: ex.gate_up_kernel(
                x, perm, w, gate, up, shared, 10.0, True, limbs=limbs)[0])
            runs[f"{label} down"] = under(switches, lambda h=h: ex.down_kernel(h, perm, down, shared[2]))
            outputs[label] = runs[f"{label} both"]()
        t = compare(runs)
        first = next(iter(outputs.values()))
        gate_up_bytes = tokens * K * (expert_bytes(gate) + expert_bytes(up)) + expert_bytes(shared[0]) + expert_bytes(shared[1])
        down_bytes = tokens * K * expert_bytes(down) + expert_bytes(shared[2])
        for label in variants:
            gu, dn = t[f"{label} gate/up"], t[f"{label} down"]
            same = "yes" if mx.array_equal(outputs[label], first).item() else f"max diff {max_diff(outputs[label], first):.3g}"
            rows.append((name, label, tokens, t[f"{label} both"], gate_up_bytes + down_bytes,
                         f"{gu * 1e6:.1f} ({gate_up_bytes / gu / 1e12:.2f})",
                         f"{dn * 1e6:.1f} ({down_bytes / dn / 1e12:.2f})", same))
    return rows


def matvec_rows(tokens_list):
    """(N, K, tokens, {variant: seconds}, bytes) per dense Q8_0 shape, the variants interleaved."""
    rows = []
    for n, k in ((1280, 5120), (32768, 1280), (5120, 8192), (2304, 5120)):
        q = gguf((n, k), "Q8_0")
        for tokens in tokens_list:
            x = (mx.random.normal((tokens, k))).astype(mx.bfloat16)
            mx.eval(x)
            t = compare({label: under(switches, lambda: mv.quantized_matvec(x, q, True))
                         for label, switches in VARIANTS.items()})
            rows.append((n, k, tokens, t, q.weight.nbytes))
    return rows


# A verify's few tokens through the dense Q8_0 projections: a threadgroup a token (the one-token
# launch), or the multi-token launch; the CUDA default units (hsub) and the integer ones (dp4a).
TOKENS_VARIANTS = {"hsub": VARIANTS["Q8_0 hsub"], "hsub, tokens": dict(VARIANTS["Q8_0 hsub"], kernel_matvec_tokens=True),
                   "dp4a": VARIANTS["dp4a"], "dp4a, tokens": dict(VARIANTS["dp4a"], kernel_matvec_tokens=True)}


def matvec_tokens_rows(tokens_list):
    """(shape, tokens, {variant: seconds}, bytes, same) per dense Q8_0 shape and V4.1's grouped wo_a
    (8 groups of 1024 rows over 4096 inputs), the TOKENS_VARIANTS interleaved; same: whether each
    multi-token launch's output equals its one-token launch's bit for bit."""
    rows = []
    for n, k, groups in ((1280, 5120, 1), (32768, 1280, 1), (5120, 8192, 1), (2304, 5120, 1), (8 * 1024, 4096, 8)):
        q = gguf((n, k), "Q8_0")
        for tokens in tokens_list:
            x = (mx.random.normal((tokens, groups, k) if groups > 1 else (tokens, k))).astype(mx.bfloat16)
            mx.eval(x)
            runs = {label: under(switches, lambda: mv.quantized_matvec(x, q, True, groups))
                    for label, switches in TOKENS_VARIANTS.items()}
            out = {label: run() for label, run in runs.items()}
            same = {label: mx.array_equal(out[label], out[label.split(",")[0]]).item() for label in out if "," in label}
            shape = f"{n} x {k}" + (f" in {groups} groups" if groups > 1 else "")
            rows.append((shape, tokens, compare(runs), q.weight.nbytes, same))
    return rows


def affine_of(m: GGUFMatrix) -> ex.QuantizedMatrix:
    """The affine mapping's layout (group 32, the converter's default bits) with random codes:
    what the converter wrote before blocks were kept (speed only, not its values)."""
    bits = AFFINE_BITS[m.qtype]
    lead = m.weight.shape[:-1]
    q = mx.random.randint(-2 ** 31, 2 ** 31 - 1, (*lead, m.in_features * bits // 32)).view(mx.uint32)
    s = (mx.random.uniform(0.001, 0.01, (*lead, m.in_features // 32))).astype(mx.bfloat16)
    b = -s * (2 ** (bits - 1))
    mx.eval(q, s, b)
    return ex.QuantizedMatrix(q, s, b, 32, bits, "affine")


def prefill_rows(name, weights, chunk=512, chunks=8):
    """One MoE layer's routed experts over chunks of tokens: the GGUF layers' prefill path
    against gather_qmm on the affine mapping."""
    from dsv4.linear import GGUFExpertLinear, QuantizedExpertLinear
    from dsv4.kernels.swiglu import clamped_swiglu

    gate, up, down, _ = weights
    layers = {}
    for label, mats in (("gguf", (gate, up, down)), ("affine", tuple(affine_of(m) for m in (gate, up, down)))):
        mods = []
        for m in mats:
            if isinstance(m, GGUFMatrix):
                layer = GGUFExpertLinear(m.in_features, m.out_features, E, m.qtype)
                layer.weight = m.weight
            else:
                layer = QuantizedExpertLinear(32, m.bits, "affine")
                layer.weight, layer.scales, layer.biases = m.weight, m.scales, m.biases
            mods.append(layer)
        layers[label] = mods
    x = (mx.random.normal((chunk, D)) * 2).astype(mx.bfloat16)
    ids = mx.stack([mx.random.permutation(E)[:K] for _ in range(chunk)]).astype(mx.int32)
    mx.eval(x, ids)
    flat = ids.reshape(-1)
    order = mx.argsort(flat)
    xs = x[order // K][:, None, :]
    e = flat[order]

    def moe(mods):
        w1, w3, w2 = mods
        h = clamped_swiglu(w1(xs, e, True), w3(xs, e, True), 10.0).astype(mx.bfloat16)
        return w2(h, e, True)

    w = mx.random.uniform(0.1, 1.0, (chunk, K))
    runs = {"gguf kernels": lambda: ex.experts(x, ids, w, gate, up, down),   # the fused kernels at 512 tokens
            "gguf decode-and-matmul": lambda: moe(layers["gguf"]),
            "affine gather_qmm": lambda: moe(layers["affine"])}
    out = []
    for label, run in runs.items():
        mx.eval(run())
        t = time.perf_counter()
        for _ in range(chunks):
            mx.eval(run())
        out.append((name, label, chunk * chunks / (time.perf_counter() - t)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--verify-tokens", default="2,4,6", help="token counts of the dense multi-token table ('' for none)")
    p.add_argument("--no-prefill", action="store_true", help="decode timings only")
    p.add_argument("--experts-only", action="store_true", help="the fused experts' table only (no dense matvec, no prefill)")
    p.add_argument("--variants", help="the experts' variants to run, '|'-separated labels (default: all)")
    a = p.parse_args(argv)
    only = set(a.variants.split("|")) if a.variants else None
    if only and not only <= set(EXPERT_VARIANTS) | set(MX_VARIANTS):
        p.error(f"--variants: unknown {sorted(only - set(EXPERT_VARIANTS) - set(MX_VARIANTS))}; "
                f"expected labels among {sorted(set(EXPERT_VARIANTS) | set(MX_VARIANTS))}")
    tokens = [int(t) for t in a.tokens.split(",")]
    torch_bw = torch_copy_bandwidth()
    mlx_bw = copy_bandwidth()
    lines = [f"# GGUF blocks in the decode kernels at V4.1's expert shapes ({datetime.datetime.now():%Y-%m-%d %H:%M})", "",
             (f"Copy roofline: torch {torch_bw / 1e12:.2f} TB/s" if torch_bw else "Copy roofline: no torch")
             + f"; MLX elementwise {mlx_bw / 1e12:.2f} TB/s (read + write).", "",
             "## Fused experts, decode (6 distinct experts per token + the shared expert, act_quant)", "",
             "GGUF variants interleaved in one run: blocks (the units as they were), Q8_0 pairs "
             "(DSV4_KERNEL_GGUF_Q8_PAIRS), wide (DSV4_KERNEL_GGUF_WIDE: 16-byte loads for Q8_0, IQ2_XXS, "
             "Q2_K), halves (DSV4_KERNEL_GGUF_HALVES: codes as fp16 subnormals, on the wide units), Q8_0 hsub "
             "(DSV4_KERNEL_GGUF_Q8_HSUB: Q8_0's int8 bias off two at a time in fp16; the experts' on the "
             "halves units), dp4a (DSV4_KERNEL_GGUF_DP4A: q2's and q4's gate/up and the Q8_0 matvec in "
             "integer units over x's fp8 values as limbs; the down launches run hsub), dp4a, down "
             "(DSV4_KERNEL_GGUF_DP4A_DOWN: and h handed over as limbs, the down launch in the integer "
             "units), default (the backend's defaults) and default, split (with "
             "DSV4_KERNEL_MOE_SHARED_SPLITS=0: the down launch's shared expert over several SIMD groups; "
             "for mxfp4: mx split). 'same' = "
             "the output equals the first variant's bit for bit.", "",
             "| experts | variant | tokens | µs/call | weights read (MB) | effective TB/s | gate/up alone µs (TB/s) "
             "| down alone µs (TB/s) | same |",
             "|---|---|---|---|---|---|---|---|---|"]
    prefill = []
    for name in ("mxfp4", "q2", "q4"):
        weights = recipe_weights(name)
        for n, label, t, sec, nbytes, gate_up, down, same in decode_rows(name, weights, tokens, only):
            lines.append(f"| {n} | {label} | {t} | {sec * 1e6:.1f} | {nbytes / 1e6:.1f} | {nbytes / sec / 1e12:.2f} | "
                         f"{gate_up} | {down} | {same} |")
            print(lines[-1], flush=True)
        if name != "mxfp4" and not (a.no_prefill or a.experts_only):
            prefill += prefill_rows(name, weights)
            print(prefill[-2:], flush=True)
        del weights
    if not a.experts_only:   # the dense Q8_0 matvec tables
        labels = list(VARIANTS)
        lines += ["", "## GGUF Q8_0 dense matvec (act_quant fused), the variants interleaved", "",
                  "| N x K | tokens | MB | " + " | ".join(f"{v} µs (TB/s)" for v in labels) + " |",
                  "|---|---|---|" + "---|" * len(labels)]
        for n, k, t_count, t, nbytes in matvec_rows([v for v in tokens if v in (1, 8)] or tokens[:1]):
            cells = " | ".join(f"{t[v] * 1e6:.1f} ({nbytes / t[v] / 1e12:.2f})" for v in labels)
            lines.append(f"| {n} x {k} | {t_count} | {nbytes / 1e6:.1f} | {cells} |")
            print(lines[-1], flush=True)
        verify = [int(t) for t in a.verify_tokens.split(",") if t]
        labels = list(TOKENS_VARIANTS)
        lines += ["", "## GGUF Q8_0 dense matvec for a verify's tokens: a threadgroup a token, or the multi-token "
                  "launch (DSV4_KERNEL_MATVEC_TOKENS), interleaved", "",
                  "'same': the multi-token launch's output equals the one-token launch's bit for bit.", "",
                  "| N x K | tokens | MB | " + " | ".join(f"{v} µs (TB/s)" for v in labels) + " | same |",
                  "|---|---|---|" + "---|" * len(labels) + "---|"]
        for shape, t_count, t, nbytes, same in matvec_tokens_rows(verify):
            cells = " | ".join(f"{t[v] * 1e6:.1f} ({nbytes / t[v] / 1e12:.2f})" for v in labels)
            flags_same = ", ".join(f"{v}: {'yes' if ok else 'no'}" for v, ok in same.items())
            lines.append(f"| {shape} | {t_count} | {nbytes / 1e6:.1f} | {cells} | {flags_same} |")
            print(lines[-1], flush=True)
    if prefill:   # none with --no-prefill
        lines += ["", "## Prefill: one MoE layer's routed experts, 8 chunks of 512 tokens", "",
                  "| recipe | path | tokens/s |", "|---|---|---|"]
        lines += [f"| {n} | {label} | {tps:.0f} |" for n, label, tps in prefill]
    by = {(n, label): tps for n, label, tps in prefill}
    for n in ("q2", "q4"):
        if (n, "gguf kernels") in by:
            lines.append(f"\n{n}: the GGUF kernels take {by[n, 'affine gather_qmm'] / by[n, 'gguf kernels']:.2f}x "
                         f"the affine path's time.")
    lines += ["", hardware()]
    write_dated(a.out, datetime.datetime.now(), "gguf-native", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
