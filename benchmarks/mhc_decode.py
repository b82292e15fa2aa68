"""mHC at decode: the per-token kernels against the wide path (DSV4_KERNEL_MHC_WIDE) at V4.1's shapes.

    python -m benchmarks.mhc_decode [--tokens 1,4] [--ncu] [--out DIR]

One layer's mHC as a decode step runs it (hidden 5120, hc = 4, bf16 streams, fp32 mixes): the
attention site's entry with the fp8 copy (2 launches), the expand that also makes the FFN
site's partials (1), the FFN site's entry (1). The two paths alternate (A B B A ...) in one
process, each timing batches of calls that end in one `mx.eval`: host encoding included, the
same launch count on both sides. The report gives medians and the ratio, and for each path the
largest difference of every output from the plain-MLX reference's (fp32, TF32 off), the share
of x equal between the paths and whether the expand's streams are (bit for bit, by design).
`--ncu` (CUDA; Nsight Compute's `ncu` on PATH or in /usr/local/cuda/bin) also runs the same
layer under ncu for each token count and lists the GPU µs per launch of every kernel, without
host time, at ncu's locked clocks. Writes a dated Markdown report under --out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")   # the reference's fp32 projection in fp32, not TF32

import mlx.core as mx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.kernels_bench import compare, max_diff  # noqa: E402
from benchmarks.step_profile import NCU_METRICS, ncu_path, summarize_ncu  # noqa: E402
from dsv4 import flags  # noqa: E402
from dsv4.kernels import mhc  # noqa: E402
from dsv4.kernels.dialect import backend  # noqa: E402

D, HC, NM, ITERS = 5120, 4, 24, 20
EPS = (1e-6, 1e-6, 1e-6)   # RMSNorm, the mixes' RMS factor, hc_eps (V4.1's)
PATHS = {"per-token": False, "wide": True}
KERNELS = {"per-token": ("dsv4_hc_project", "dsv4_hc_sinkhorn_collapse_norm_fp8", "dsv4_hc_expand_project",
                         "dsv4_hc_sinkhorn_collapse_norm"),
           "wide": ("dsv4_hc_entry_partials", "dsv4_hc_entry_finish_fp8", "dsv4_hc_expand_partials",
                    "dsv4_hc_entry_finish")}
NCU_REPEATS = 3


def layer_inputs(tokens: int) -> dict:
    """One layer's mHC operands, tokens flat as the model keeps them."""
    mx.random.seed(tokens)
    c = dict(streams=mx.random.normal((tokens, HC, D)).astype(mx.bfloat16),
             pre=mx.random.uniform(0.2, 1.0, (tokens, HC)),
             y=mx.random.normal((tokens, D)).astype(mx.bfloat16))   # the attention's output
    for site in ("attn", "ffn"):
        c[f"{site}_fn"] = mx.random.normal((NM, HC * D)) / (HC * D) ** 0.5
        c[f"{site}_scale"], c[f"{site}_base"] = mx.random.uniform(0.5, 2, (3,)), mx.random.normal((NM,))
        c[f"{site}_weight"] = mx.random.uniform(0.5, 1.5, (D,)).astype(mx.bfloat16)
    mx.eval(c)
    return c


def layer(c: dict, wide: bool, kernels: bool = True) -> dict:
    """Block.__call__'s mHC calls (dsv4/model.py) for one layer, without its sublayers."""
    site = lambda s: (c[f"{s}_fn"], c[f"{s}_scale"], c[f"{s}_base"], c[f"{s}_weight"], *EPS, ITERS)
    with flags.override(kernel_mhc_wide=wide, kernel_mhc=kernels):
        x, x_fp8, a_pre, a_post, a_comb = mhc.hc_mixes_collapse_norm(c["streams"], c["pre"], *site("attn"),
                                                                     fp8_copy=True)
        streams, projection = mhc.hc_expand(c["y"], c["streams"], a_post, a_comb, c["ffn_fn"], a_pre)
        x_ffn, f_pre, f_post, f_comb = mhc.hc_mixes_collapse_norm(streams, a_pre, *site("ffn"),
                                                                  projection=projection)
    return dict(x=x, x_fp8=x_fp8, attn_mixes=(a_pre, a_post, a_comb), streams=streams, x_ffn=x_ffn,
                ffn_mixes=(f_pre, f_post, f_comb))


def differences(got: dict, want: dict) -> dict:
    out = {}
    for k, g in got.items():
        pairs = zip(g, want[k]) if isinstance(g, tuple) else [(g, want[k])]
        out[k] = max(max_diff(a, b) for a, b in pairs)
    return out


def profiled(tokens: int) -> None:
    """Both paths' layer, NCU_REPEATS times each, between cuProfilerStart/Stop (what `ncu
    --profile-from-start off` records), after a warm-up that builds every kernel."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    c = layer_inputs(tokens)
    for wide in PATHS.values():
        for _ in range(3):
            mx.eval(layer(c, wide))
    mx.synchronize()
    cuda.cuProfilerStart()
    for _ in range(NCU_REPEATS):
        for wide in PATHS.values():
            mx.eval(layer(c, wide))
    mx.synchronize()
    cuda.cuProfilerStop()


def ncu_table(tokens: int) -> list[str]:
    ncu = ncu_path()
    if ncu is None:
        return [f"--ncu: no ncu found; GPU times at {tokens} token(s) skipped.", ""]
    cmd = [ncu, "--profile-from-start", "off", "--metrics", NCU_METRICS, "--csv", sys.executable,
           "-m", "benchmarks.mhc_decode", "--profiled", str(tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    rows = summarize_ncu(out.stdout)
    if not rows:
        print((out.stdout + out.stderr)[-3000:], file=sys.stderr)
        return [f"--ncu: ncu recorded no kernels at {tokens} token(s) (exit status {out.returncode}).", ""]
    path_of = {k: p for p, names in KERNELS.items() for k in names}
    lines = [f"GPU time under ncu, {tokens} token(s), {NCU_REPEATS} layers per path (locked clocks):", "",
             "| kernel | path | launches | µs per launch | DRAM KB read per launch |", "|---|---|---|---|---|"]
    per_layer = {p: 0.0 for p in PATHS}
    for name, count, us, dram in sorted(rows, key=lambda r: (path_of.get(r[0], "~"), r[0])):
        path = path_of.get(name, "other")
        lines.append(f"| `{name}` | {path} | {count} | {us / count:.1f} | {dram / count / 1e3:.1f} |")
        if path in per_layer:
            per_layer[path] += us / NCU_REPEATS
    base, wide = per_layer["per-token"], per_layer["wide"]
    lines += ["", f"One layer's mHC on the GPU: per-token {base:.1f} µs, wide {wide:.1f} µs"
              + (f" ({base / wide:.2f}x)." if wide else "."), ""]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,4", help="token counts (decode: 1, a verify: k + 1)")
    p.add_argument("--ncu", action="store_true", help="also time each kernel on the GPU under ncu")
    p.add_argument("--profiled", type=int, help=argparse.SUPPRESS)   # the run under ncu
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    if backend() is None:
        sys.exit("mhc_decode needs a GPU backend (Metal or CUDA) on the default device")
    if a.profiled:
        profiled(a.profiled)
        return 0
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated

    when = datetime.now()
    lines = ["# mHC at decode: per-token kernels vs the wide path (DSV4_KERNEL_MHC_WIDE)", "",
             f"{when:%Y-%m-%d %H:%M}; hidden {D}, hc {HC}, bf16 streams; one layer = the attention site's "
             "entry with the fp8 copy, the expand with the FFN site's projection, the FFN site's entry "
             "(4 launches on either path). Wall time per layer (host encoding included), medians of "
             "interleaved rounds.", "",
             "Effective rate: the bytes a layer's mHC must move at least (both sites' fp32 projections, the "
             "streams and y read once, the new streams, x, its fp8 copy and the FFN's x written once) over "
             "its wall time.", "",
             "| tokens | per-token µs | wide µs | per-token/wide | GB/s per-token, wide | max abs diff to the "
             "reference: per-token | wide | x equal between paths | streams equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for tokens in (int(t) for t in a.tokens.split(",")):
        c = layer_inputs(tokens)
        t = compare({name: (lambda w=wide: layer(c, w)) for name, wide in PATHS.items()})
        got = {name: layer(c, wide) for name, wide in PATHS.items()}
        want = layer(c, False, kernels=False)
        diffs = {name: differences(g, want) for name, g in got.items()}
        old, new = got["per-token"], got["wide"]
        same_x = mx.mean((old["x"] == new["x"]).astype(mx.float32)).item()
        same_streams = bool(mx.array_equal(old["streams"], new["streams"]).item())
        fmt = lambda d: ", ".join(f"{k} {v:.1e}" for k, v in d.items())
        moved = 2 * c["attn_fn"].nbytes + tokens * 2 * (2 * HC * D + D + 3 * D)
        lines.append(f"| {tokens} | {t['per-token'] * 1e6:.1f} | {t['wide'] * 1e6:.1f} | "
                     f"{t['per-token'] / t['wide']:.2f}x | {moved / t['per-token'] / 1e9:.0f}, "
                     f"{moved / t['wide'] / 1e9:.0f} | {fmt(diffs['per-token'])} | {fmt(diffs['wide'])} | "
                     f"{same_x:.4f} | {same_streams} |")
        if a.ncu:
            notes += ncu_table(tokens)
    lines += [""] + notes + [to_markdown(describe())]
    write_dated(a.out, when, "mhc-decode", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
