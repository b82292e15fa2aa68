"""Throughput and peak memory of the ds4 GGUF converter.

    python -m benchmarks.convert_gguf --experts 32 --runs 2

1. Per quant type: `convert.gguf_quants.to_affine` on 16 MiB of random valid blocks (Q8_0
   from gguf's quantiser), best of 3, next to gguf's own numpy dequantisation of the same
   bytes (the reference decoder, the speed of `--dequantize`). One process, one core.
2. Whole file: a synthetic ds4-dialect GGUF (tests/gguf_fixtures.py at hidden 1024, 8
   layers, `--experts` routed experts of 1024x1024, q2 or q4 recipe) converted by fresh
   processes, runs interleaved, with 1 and 2 worker processes. Rate = GGUF bytes / wall
   second; peak RSS of the main process and of the largest worker (`ru_maxrss`).
Writes `<date>-convert-gguf.md` to benchmarks/results/; the temporary files are deleted.
"""

from __future__ import annotations

import argparse
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
RUN_TIMEOUT_S = 3600.0   # one conversion; the default sizes take seconds

_MAKE = """
import sys
import numpy as np
from dsv4 import testing
from tests import gguf_fixtures

def fast_fp4_weight(rng, shape, std):
    # the official fp4 experts are not used by the GGUF writer (its experts are random blocks)
    packed = np.zeros((*shape[:-1], shape[-1] // 2), np.int8)
    return packed, np.full((*shape[:-1], shape[-1] // 32), 120, np.uint8)

testing.fp4_weight = fast_fp4_weight
path, recipe, experts = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = gguf_fixtures.source_tokenizer()
config = gguf_fixtures.fixture_config(tok, hidden_size=1024, moe_intermediate_size=1024,
                                      n_routed_experts=experts)
gguf_fixtures.write_ds4_gguf(path, recipe, tokenizer=tok, config=config)
"""

_CONVERT = """
import json, resource, sys
from convert.gguf import convert
src, dst, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
report = convert(src, dst, workers=workers, progress=False)
own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print("DSV4_RESULT " + json.dumps({"rss_mb": own, "worker_rss_mb": kids, "report": report}))
"""


def per_type(megabytes: int) -> list[dict]:
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    from convert import gguf_quants as gq
    from tests.gguf_fixtures import random_blocks

    rng = np.random.default_rng(0)
    rows = []
    for qtype in (T.Q8_0, T.Q4_K, T.IQ2_XXS, T.Q2_K):
        n_in = 4096
        per_row = n_in // gq.BLOCK_WEIGHTS[qtype] * gq.BLOCK_BYTES[qtype]
        count = megabytes * 2**20 // per_row
        if qtype == T.Q8_0:
            raw = quantize(rng.normal(0, 0.02, (count, n_in)).astype(np.float32), T.Q8_0)
        else:
            raw = random_blocks(rng, qtype, (count, n_in), 1e-3)
        weights = count * n_in

        def best(fn) -> float:
            times = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times)

        base = best(lambda: dequantize(raw, qtype))
        for bits in gq.ALLOWED_BITS[qtype]:
            if qtype == T.Q2_K and bits not in (2, 3, 4, 8):
                continue
            a = gq.to_affine(raw, qtype, bits)
            err = f"{(a.err_sq / a.ref_sq) ** 0.5:.4f}" if a.ref_sq else "exact"
            s = best(lambda: gq.to_affine(raw, qtype, bits))
            rows.append({"type": qtype.name, "bits": bits, "mb_s": raw.nbytes / s / 1e6,
                         "mw_s": weights / s / 1e6, "err": err,
                         "gguf_mb_s": raw.nbytes / base / 1e6})
            print(f"{qtype.name} -> {bits}-bit: {rows[-1]['mb_s']:.0f} MB/s", file=sys.stderr)
    return rows


def metadata_stage(work: Path) -> dict:
    """Seconds to read a GGUF header with DeepSeek's vocabulary size (129,280 tokens,
    ~129 k merges of a synthetic byte-level BPE), rebuild the tokenizer and derive the
    Engram token map the converter checks."""
    import numpy as np
    from gguf import GGUFWriter
    from tokenizers import pre_tokenizers

    from convert import gguf_tokenizer
    from convert.gguf import GGUFSource
    from dsv4.engram import build_token_map

    rng = np.random.default_rng(0)
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet())
    merges, seen = [], set(tokens)
    while len(tokens) < 129280 - 800:
        a = tokens[3 + rng.integers(0, len(tokens) - 3)]
        b = tokens[3 + rng.integers(0, min(len(tokens) - 3, 2000))]
        if len(a) + len(b) <= 12 and a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    tokens += [f"<｜place▁holder▁no▁{i}｜>" for i in range(800)]
    path = work / "vocab.gguf"
    w = GGUFWriter(str(path), "deepseek41")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 803) + [3] * 800)
    w.add_token_merges(merges)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    t0 = time.perf_counter()
    src = GGUFSource(path)
    t1 = time.perf_counter()
    tok = gguf_tokenizer.build(src.need("tokenizer.ggml.tokens"), src.need("tokenizer.ggml.token_type"),
                               src.need("tokenizer.ggml.merges"), "joyai-llm", 0, 1, True, False)
    t2 = time.perf_counter()
    build_token_map(tok)
    t3 = time.perf_counter()
    return {"tokens": len(tokens), "merges": len(merges), "header_s": t1 - t0,
            "tokenizer_s": t2 - t1, "token_map_s": t3 - t2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32, help="routed experts per layer (size)")
    parser.add_argument("--runs", type=int, default=2, help="runs per variant")
    parser.add_argument("--megabytes", type=int, default=16, help="MiB of blocks per quant type")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    types = per_type(args.megabytes)
    work = Path(tempfile.mkdtemp(prefix="dsv4-gguf-bench-", dir=args.workdir))
    results: dict[str, list] = {}
    sizes, reports = {}, {}
    try:
        meta = metadata_stage(work)
        variants = []
        for recipe in ("q2", "q4"):
            src = work / f"{recipe}.gguf"
            subprocess.run([sys.executable, "-c", _MAKE, str(src), recipe, str(args.experts)],
                           check=True, env=env, cwd=root)
            sizes[recipe] = src.stat().st_size
            variants += [(recipe, 1), (recipe, 2)]
        order = [variant for _, variant in ab.schedule(variants, args.runs)]
        for recipe, workers in order:
            dst = work / f"out-{recipe}-{workers}"
            name = f"{recipe} workers={workers}"
            cmd = [sys.executable, "-c", _CONVERT, str(work / f"{recipe}.gguf"), str(dst),
                   str(workers)]
            wall, _, out = ab.run_once(cmd, ab.Variant(name), RUN_TIMEOUT_S)
            results.setdefault(name, []).append((wall, out))
            reports[recipe] = out["report"]
            print(f"{name}: {wall:.1f} s, {sizes[recipe] / wall / 1e6:.0f} MB/s", file=sys.stderr)
            shutil.rmtree(dst)
        load = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    date = datetime.now(timezone.utc)
    lines = [f"# GGUF converter: throughput and peak memory ({date:%Y-%m-%d %H:%M} UTC)", "",
             hardware.to_markdown(hardware.describe()), "",
             "## Per quant type (one core, in process)", "",
             f"`convert.gguf_quants.to_affine` on {args.megabytes} MiB of GGUF blocks (rows of "
             "4096 weights), best "
             "of 3. MB/s counts GGUF bytes (1e6). *gguf dequant* is gguf-py's numpy decoder on the "
             "same bytes (what `--dequantize` runs). Added error = relative RMS against the "
             "GGUF values on these random blocks.", "",
             "| GGUF type | MLX affine | MB/s | M weights/s | added error | gguf dequant MB/s |",
             "|---|---|---|---|---|---|"]
    for r in types:
        lines.append(f"| {r['type']} | {r['bits']}-bit g32 | {r['mb_s']:.0f} | {r['mw_s']:.0f} | "
                     f"{r['err']} | {r['gguf_mb_s']:.0f} |")
    lines += ["", "## Metadata at DeepSeek's vocabulary size", "",
              f"A GGUF header with {meta['tokens']:,} tokens and {meta['merges']:,} merges (a "
              f"synthetic byte-level BPE): gguf-py parses it in {meta['header_s']:.1f} s (pure "
              f"Python), the tokenizer is rebuilt in {meta['tokenizer_s']:.1f} s and the Engram "
              f"token map checked against dsv4's in {meta['token_map_s']:.1f} s. This is the "
              f"fixed cost of every conversion before any weight is read.",
              "", "## Whole file", "",
              f"Synthetic ds4-dialect GGUFs (`tests/gguf_fixtures.py`: hidden 1024, 8 layers, "
              f"{args.experts} routed experts of 1024x1024 per layer; q2 = IQ2_XXS gate/up + Q2_K "
              f"down: {sizes['q2'] / 1e6:.0f} MB; q4 = Q4_K experts: {sizes['q4'] / 1e6:.0f} MB; "
              f"Q8_0 projections, F16/F32 rest, Engram tables referenced in place). Each run is a "
              f"fresh process calling `convert.gguf.convert`; runs interleaved "
              f"({', '.join(f'{r}/{w}' for r, w in order)}); the source is in the page cache. "
              f"Load average at the end: {load[0]:.1f} on {os.cpu_count()} cores (shared machine).",
              "",
              "| file | workers | runs | median wall s | median MB/s | peak RSS main MB "
              "| peak RSS worker MB |",
              "|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        recipe, workers = name.split(" workers=")
        wall = statistics.median(w for w, _ in runs)
        lines.append(f"| {recipe} | {workers} | {len(runs)} | {wall:.1f} | "
                     f"{sizes[recipe] / wall / 1e6:.0f} | "
                     f"{statistics.median(o['rss_mb'] for _, o in runs):.0f} | "
                     f"{statistics.median(o['worker_rss_mb'] for _, o in runs):.0f} |")
    lines += ["", "Every run (wall s): " + "; ".join(
        f"{n}: " + ", ".join(f"{w:.1f}" for w, _ in runs) for n, runs in results.items()), "",
        "### Conversion report of the q2 file (per tensor kind, summed over layers)", "",
        "| tensor kind | from | to | MB in | MB out | added error |", "|---|---|---|---|---|---|"]
    for kind, r in reports["q2"].items():
        err = r.get("added_relative_rms_error")
        lines.append(f"| {kind} | {r['from']} | {r['to']} | {r['bytes_in'] / 1e6:.1f} | "
                     f"{r['bytes_out'] / 1e6:.1f} | {'exact' if err is None else f'{err:.4f}'} |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = args.out_dir / f"{date:%Y-%m-%d}-convert-gguf.md"
    report.write_text("\n".join(lines) + "\n")
    print(report)


if __name__ == "__main__":
    main()
