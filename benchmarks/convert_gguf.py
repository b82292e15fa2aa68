"""The ds4 GGUF converter: what each way of handling the blocks costs, and what it keeps.

    python -m benchmarks.convert_gguf --experts 16 --runs 2

1. Per quant type, one core, 16 MiB of random valid blocks (Q8_0 from gguf's quantiser), best
   of 3: `convert.gguf_quants.to_affine` (--affine), and the exact decoders: dsv4.gguf_blocks
   (what --dequantize runs) next to gguf-py's numpy one.
2. Metadata at DeepSeek's vocabulary size: header parse, tokenizer rebuild, Engram token map.
3. Whole files: synthetic ds4-dialect GGUFs (tests/gguf_fixtures.py, 8 layers, `--experts`
   routed experts at V4.1's real width, 5120 <-> 2304; q2 and q4 recipes) converted by fresh
   processes, runs interleaved, in three ways: blocks referenced in place (the default),
   --copy-weights, --affine. Wall time of `convert()`, bytes written into the directory, peak RSS.
4. Resident bytes per tensor kind, read back from each output directory (shard headers plus
   `dsv4.tensors` references), against the GGUF's tensor bytes as gguf-py's reader gives them.
5. The same per kind for V4.1 Flash's real shapes (40 layers, 384 experts; ds4's tensor types),
   computed by the converter's planner over those shapes: what a real conversion keeps and
   writes; and for ds4's DSpark support file (`--draft`) in each of its precisions.
Writes `<date>-convert-gguf-native.md` to benchmarks/results/; the temporary files are deleted.
"""

from __future__ import annotations

import argparse
import json
import math
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
RUN_TIMEOUT_S = 3600.0   # one conversion; the default sizes take a minute at most
MODES = {"referenced": [], "copied": ["copy_weights"], "affine": ["affine"]}

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
config = gguf_fixtures.fixture_config(tok, hidden_size=5120, moe_intermediate_size=2304,
                                      n_routed_experts=experts)
gguf_fixtures.write_ds4_gguf(path, recipe, tokenizer=tok, config=config)
"""

_CONVERT = """
import json, resource, sys, time
from convert.gguf import Options, convert
src, dst, workers, flags = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
start = time.perf_counter()
report = convert(src, dst, Options(**{f: True for f in flags}), workers=workers, progress=False)
seconds = time.perf_counter() - start
own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print("DSV4_RESULT " + json.dumps({"convert_s": seconds, "rss_mb": own, "worker_rss_mb": kids,
                                   "report": report}))
"""


def _best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def per_type(megabytes: int) -> list[dict]:
    import mlx.core as mx
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    from convert import gguf_quants as gq
    from dsv4 import gguf_blocks
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

        def ours():
            return np.array(gguf_blocks.dequantize(mx.array(raw), qtype.name))

        assert np.array_equal(ours(), dequantize(raw, qtype)), qtype  # the speeds are of one result
        decode = {"dsv4": raw.nbytes / _best(ours) / 1e6,
                  "gguf": raw.nbytes / _best(lambda: dequantize(raw, qtype)) / 1e6}
        for bits in gq.ALLOWED_BITS[qtype]:
            if qtype == T.Q2_K and bits not in (2, 3, 4, 8):
                continue
            a = gq.to_affine(raw, qtype, bits)
            err = f"{(a.err_sq / a.ref_sq) ** 0.5:.4f}" if a.ref_sq else "exact"
            s = _best(lambda: gq.to_affine(raw, qtype, bits))
            rows.append({"type": qtype.name, "bits": bits, "mb_s": raw.nbytes / s / 1e6,
                         "err": err, "dsv4_mb_s": decode["dsv4"], "gguf_mb_s": decode["gguf"]})
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


def _kind_of(name: str, qtype: str) -> str:
    """The converter's tensor kind for a quantized module; the float tensors, always copied as
    they are, in one row per type."""
    from convert.gguf import _kind

    if qtype in ("F16", "F32", "BF16"):
        return f"float tensors ({qtype})"
    module = name.removesuffix(".scales").removesuffix(".biases")
    return f"{_kind(module)} ({qtype})"


def gguf_bytes_by_kind(path: Path) -> tuple[dict[str, int], dict[str, str]]:
    """GGUF tensor bytes per kind, and the GGUF type of each dsv4 module, by gguf-py's reader."""
    from gguf import GGUFReader

    from convert.gguf import dsv4_name

    by_kind, types = {}, {}
    for t in GGUFReader(str(path)).tensors:
        name = dsv4_name(t.name)
        if name is None:
            continue   # Engram tables (referenced, not resident) and the unused vision bias
        types[name.removesuffix(".weight")] = t.tensor_type.name
        kind = _kind_of(name, t.tensor_type.name)
        by_kind[kind] = by_kind.get(kind, 0) + int(t.n_bytes)
    return by_kind, types


def resident_by_kind(dst: Path, types: dict[str, str]) -> dict[str, int]:
    """Bytes the model directory gives the runtime per kind: every tensor in the shards (read
    from their headers) and every tensor referenced in place."""
    from dsv4.safetensors_file import read_header

    config = json.loads((dst / "config.json").read_text())
    sizes = {n: math.prod(r["shape"]) for n, r in config["dsv4"].get("tensors", {}).items()}
    for shard in sorted(dst.glob("model-*.safetensors")):
        sizes.update({n: info.nbytes for n, info in read_header(shard)[0].items()})
    out = {}
    for name, nbytes in sizes.items():
        module = name.removesuffix(".weight").removesuffix(".scales").removesuffix(".biases")
        kind = _kind_of(name, types.get(module) or types[name])
        out[kind] = out.get(kind, 0) + nbytes
    return out


def written_bytes(dst: Path) -> int:
    return sum(p.stat().st_size for p in dst.iterdir() if p.is_file())


# --- V4.1 Flash's real shapes ------------------------------------------------------------------

_Q8_0 = ("output", "attn_q_a", "attn_q_b", "attn_kv", "attn_output_a", "attn_output_b",
         "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
_F16 = ("token_embd", "hc_attn_fn", "hc_ffn_fn", "attn_compressor_kv", "attn_compressor_gate",
        "indexer.attn_k", "indexer.attn_q_b", "indexer.proj", "engram_kv")
_EXPERTS = {"q2": {"gate": "IQ2_XXS", "up": "IQ2_XXS", "down": "Q2_K"},
            "q4": {"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"}}


def ds4_type(gguf_name: str, recipe: str) -> str:
    """The type ds4's quantizer gives a tensor (reference/weight-formats.md §1.3, after
    deepseek41_quantize.py build_plan)."""
    suffix = gguf_name.split(".", 2)[2] if gguf_name.startswith("blk.") else gguf_name
    suffix = suffix.removesuffix(".weight")           # "ffn_gate_exps", "indexer.attn_k", ...
    if suffix.endswith("_exps"):
        return _EXPERTS[recipe][suffix.split("_")[1]]
    return "Q8_0" if suffix in _Q8_0 else "F16" if suffix in _F16 else "F32"


class RealShapeHeader:
    """The tensor list of a ds4 V4.1 Flash GGUF at the real shapes, offsets in plan order:
    what `convert.gguf.plan` reads of a GGUFSource (no file behind it)."""

    def __init__(self, recipe: str):
        from gguf import GGMLQuantizationType as T
        from gguf.constants import GGML_QUANT_SIZES

        from benchmarks.slice_decode import REAL
        from convert import gguf as conv
        from dsv4.config import ModelArgs

        self.args = ModelArgs.from_dict(dict(
            REAL, num_hidden_layers=40, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
            kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
            candidate_source_layer_id=20, engram_layer_ids=[1, 14]))
        from dsv4.layout import expected_tensors

        top, layer_names = ({v: k for k, v in names.items()} for names in (conv._TOP, conv.LAYER_NAMES))
        self.path = Path(f"V4.1 Flash {recipe} (real shapes)")
        self.expected = conv.expected_logical(expected_tensors(self.args), self.args.n_routed_experts)
        self.tensors, offset = {}, 0
        for name, shape in self.expected.items():
            if name in top:
                gguf = top[name]
            else:
                layer, rest = name.removeprefix("layers.").split(".", 1)
                gguf = f"blk.{layer}.{layer_names[rest]}"
            qtype = T[ds4_type(gguf, recipe)]
            block, size = GGML_QUANT_SIZES[qtype]
            nbytes = math.prod(shape) // block * size
            self.tensors[gguf] = conv.GGUFTensor(gguf, qtype, tuple(reversed(shape)), offset, nbytes)
            offset += nbytes
        self.parts = ((str(self.path), offset),)

    def locate(self, offset: int, nbytes: int):
        return self.parts[0][0], offset


class RealShapeDraftHeader:
    """The tensor list of ds4's DSpark support file at V4.1's shapes (three stages of 128
    routed experts, top-3, Markov rank 256) in one of its precisions (the tests' table of them,
    tests/gguf_fixtures.py DSPARK_RECIPES), as RealShapeHeader's."""

    def __init__(self, recipe: str):
        from gguf import GGMLQuantizationType as T
        from gguf.constants import GGML_QUANT_SIZES

        from tests.gguf_fixtures import DSPARK_RECIPES

        from convert import gguf as conv
        from convert import gguf_draft
        from dsv4.config import ModelArgs
        from dsv4.testing import draft_config

        text = RealShapeHeader("q2").args
        fields = dict(draft_config(text.num_hidden_layers), dspark_n_routed_experts=128,
                      dspark_num_experts_per_tok=3, dspark_markov_rank=256, dspark_noise_token_id=128799)
        self.args = ModelArgs.from_dict({**vars(text), **fields})
        types = DSPARK_RECIPES[recipe]
        experts, heads = types["experts"], types["heads"]
        ds4_names = {}
        for name in (f"mtp.{s}.{suffix}" for s in range(3) for suffix in
                     (*conv.LAYER_NAMES, "main_proj.weight", "main_norm.weight", "norm.weight",
                      "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                      "confidence_head.proj.weight")):
            if gguf_draft.dsv4_name(name) is not None:
                ds4_names[gguf_draft.dsv4_name(name)] = name
        self.path = Path(f"V4.1 Flash DSpark {recipe} (real shapes)")
        self.expected = gguf_draft.expected(self.args)
        self.tensors, offset = {}, 0
        for name, shape in self.expected.items():
            gguf = ds4_names[name]
            part = name.rsplit(".", 2)[-2]
            qtype = (experts[("w1", "w3", "w2").index(part)] if ".experts." in name else
                     heads[("embed", "head").index(part)] if ".markov_head." in name else
                     types["shared"] if ".shared_experts." in name else
                     types["att"] if part in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "main_proj") else
                     types["hc_fn"] if name.endswith("_fn") else T.F32)
            block, size = GGML_QUANT_SIZES[qtype]
            nbytes = math.prod(shape) // block * size
            self.tensors[gguf] = conv.GGUFTensor(gguf, qtype, tuple(reversed(shape)), offset, nbytes)
            offset += nbytes
        self.parts = ((str(self.path), offset),)

    def locate(self, offset: int, nbytes: int):
        return self.parts[0][0], offset


def real_shapes(drafts: tuple = ("native", "q4", "q2")) -> dict[str, dict]:
    """Per recipe: the planner's per-kind stats for the blocks kept (referenced) and --affine;
    per DSpark support precision of `drafts` ("dspark native", ...), the kept conversion's."""
    from convert import gguf as conv
    from convert import gguf_draft

    out = {}
    for recipe in ("q2", "q4"):
        header = RealShapeHeader(recipe)
        kept = conv.plan(header, header.expected, conv.Options())
        affine = conv.plan(header, header.expected, conv.Options(affine=True))
        out[recipe] = {"kept": kept[2], "affine": affine[2],
                       "written": sum(kept[1][n] for n in kept[0])}
    for recipe in drafts:
        header = RealShapeDraftHeader(recipe)
        kept = conv.plan(header, header.expected, conv.Options(), gguf_draft.dsv4_name,
                         gguf_draft.SKIPPED.match)
        out[f"dspark {recipe}"] = {"kept": kept[2], "written": sum(kept[1][n] for n in kept[0])}
    return out


# --- the report ----------------------------------------------------------------------------

def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def render(args, types, meta, sizes, order, results, resident, gguf_kinds, real) -> str:
    date = datetime.now(timezone.utc)
    lines = [f"# GGUF converter: blocks kept, referenced or copied, against --affine "
             f"({date:%Y-%m-%d %H:%M} UTC)", "", hardware.to_markdown(hardware.describe()), "",
             "## Per quant type (one core, in process)", "",
             f"{args.megabytes} MiB of GGUF blocks (rows of 4096 weights), best of 3; MB/s of GGUF "
             "bytes (1e6). *affine*: `convert.gguf_quants.to_affine` (--affine), added error = "
             "relative RMS against the exact values on these random blocks. *decode*: the exact "
             "fp32 values, dsv4.gguf_blocks in MLX on the CPU (what --dequantize runs) and gguf-py's "
             "numpy decoder (the tests' oracle); both give the same values, checked.", "",
             "| GGUF type | --affine to | affine MB/s | added error | decode MB/s dsv4 | "
             "decode MB/s gguf-py |", "|---|---|---|---|---|---|"]
    for r in types:
        lines.append(f"| {r['type']} | {r['bits']}-bit g32 | {r['mb_s']:.0f} | {r['err']} | "
                     f"{r['dsv4_mb_s']:.0f} | {r['gguf_mb_s']:.0f} |")
    lines += ["", "## Metadata at DeepSeek's vocabulary size", "",
              f"A GGUF header with {meta['tokens']:,} tokens and {meta['merges']:,} merges: gguf-py "
              f"parses it in {meta['header_s']:.1f} s, the tokenizer is rebuilt in "
              f"{meta['tokenizer_s']:.1f} s, the Engram token map checked in "
              f"{meta['token_map_s']:.1f} s: the fixed cost of every conversion.", "",
              "## Whole files", "",
              f"Synthetic ds4-dialect GGUFs (`tests/gguf_fixtures.py`: 8 layers, {args.experts} "
              f"routed experts per layer at V4.1's width, gate/up 5120 -> 2304 and down 2304 -> "
              f"5120, hidden 5120; q2 = IQ2_XXS gate/up + Q2_K down: {_mb(sizes['q2'])} MB; q4 = "
              f"Q4_K experts: {_mb(sizes['q4'])} MB; Q8_0 projections and shared experts, F16/F32 "
              f"rest, Engram tables referenced in place). Each run a fresh process calling "
              f"`convert.gguf.convert` with {args.workers} worker(s); runs interleaved "
              f"({', '.join(f'{r}/{m}' for r, m in order)}); the source in the page cache. "
              f"*convert s* is the call itself (imports and process start excluded); *written* "
              f"is every file of the output directory.", "",
              "| file | blocks | runs | median convert s | written MB | written / GGUF | "
              "peak RSS MB |", "|---|---|---|---|---|---|---|"]
    for (recipe, mode), runs in results.items():
        seconds = statistics.median(o["convert_s"] for o in runs)
        written = runs[0]["written"]
        lines.append(f"| {recipe} | {mode} | {len(runs)} | {seconds:.1f} | {_mb(written)} | "
                     f"{written / sizes[recipe]:.3f} | "
                     f"{statistics.median(max(o['rss_mb'], o['worker_rss_mb']) for o in runs):.0f} |")
    lines += ["", "Every run (convert s): " + "; ".join(
        f"{r}/{m}: " + ", ".join(f"{o['convert_s']:.1f}" for o in runs)
        for (r, m), runs in results.items()), ""]
    rate = copy_rate(results)
    lines += [f"Copying blocks costs {rate / 1e6:.0f} MB/s here (the extra bytes of --copy-weights "
              f"over their extra seconds, median over both files).", ""]
    lines += ["## Resident bytes per tensor kind (synthetic files)", "",
              "Read back from each output directory (shard headers + `dsv4.tensors` references) "
              "against the GGUF's tensor bytes by gguf-py's reader. Engram tables are left out "
              "(referenced in place by every mode, never resident).", ""]
    for recipe in ("q2", "q4"):
        lines += [f"### {recipe}", "", "| tensor kind | GGUF MB | referenced MB | ratio | copied MB "
                  "| ratio | affine MB | ratio |", "|---|---|---|---|---|---|---|---|"]
        kinds = gguf_kinds[recipe]
        totals = {m: 0 for m in MODES}
        for kind in sorted(kinds):
            row = [kind, _mb(kinds[kind])]
            for mode in MODES:
                got = resident[recipe, mode].get(kind, 0)
                totals[mode] += got
                row += [_mb(got), f"{got / kinds[kind]:.3f}"]
            lines.append("| " + " | ".join(row) + " |")
        total = sum(kinds.values())
        lines.append("| **total** | " + _mb(total) + " | " + " | ".join(
            f"{_mb(totals[m])} | {totals[m] / total:.3f}" for m in MODES) + " |")
        lines.append("")
    lines += ["## V4.1 Flash at its real shapes (computed, not converted)", "",
              "`convert.gguf.plan` over the tensor list of a ds4 V4.1 Flash GGUF (40 layers, 384 "
              "routed experts, hidden 5120, ds4's types per tensor: Q8_0 attention, shared experts "
              "and head; F16 embedding, mHC, compressor, indexer and Engram projections; F32 "
              "norms and router), no Engram tables. GiB = 2^30 bytes.", ""]
    drafts = {recipe: r for recipe, r in real.items() if recipe.startswith("dspark ")}
    for recipe, r in real.items():
        if recipe in drafts:
            continue
        lines += [f"### {recipe}", "", "| tensor kind | GGUF GiB | kept GiB | --affine GiB | "
                  "--affine / GGUF |", "|---|---|---|---|---|"]
        rows: dict[str, list[int]] = {}
        for kind, s in r["kept"].items():
            row = rows.setdefault(_kind_of(kind.split(" (")[0], s.source), [0, 0, 0])
            for i, n in enumerate((s.bytes_in, s.bytes_out, r["affine"][kind].bytes_out)):
                row[i] += n
        for kind, (gguf, kept, affine) in sorted(rows.items()):
            lines.append(f"| {kind} | {_gib(gguf)} | {_gib(kept)} | {_gib(affine)} | "
                         f"{affine / gguf:.3f} |")
        total_in = sum(s.bytes_in for s in r["kept"].values())
        kept = sum(s.bytes_out for s in r["kept"].values())
        affine = sum(s.bytes_out for s in r["affine"].values())
        lines += [f"| **total** | {_gib(total_in)} | {_gib(kept)} | {_gib(affine)} | "
                  f"{affine / total_in:.3f} |", "",
                  f"Referenced in place, the conversion writes {_gib(r['written'])} GiB (the float "
                  f"tensors); --copy-weights writes {_gib(kept)} GiB, which at the copy rate "
                  f"above (a page-cached source: a lower bound) adds "
                  f"{(kept - r['written']) / rate / 60:.0f} min.", ""]
    lines += ["### ds4's DSpark support file (`--draft`)", "",
              "The same planner over the support file's tensors (gguf-tools/deepseek41_dspark.py: "
              "three stages of 128 routed experts, Markov rank 256) in each of its precisions.", "",
              "| precision | GGUF GiB | kept GiB | written GiB |", "|---|---|---|---|"]
    for recipe, r in drafts.items():
        lines.append(f"| {recipe.removeprefix('dspark ')} | "
                     f"{_gib(sum(s.bytes_in for s in r['kept'].values()))} | "
                     f"{_gib(sum(s.bytes_out for s in r['kept'].values()))} | {_gib(r['written'])} |")
    return "\n".join(lines) + "\n"


def copy_rate(results: dict) -> float:
    """Bytes per second of copying blocks: --copy-weights against referencing, per file."""
    rates = []
    for recipe in ("q2", "q4"):
        ref, copied = results[recipe, "referenced"], results[recipe, "copied"]
        extra_s = (statistics.median(o["convert_s"] for o in copied)
                   - statistics.median(o["convert_s"] for o in ref))
        rates.append((copied[0]["written"] - ref[0]["written"]) / extra_s)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16, help="routed experts per layer (size)")
    parser.add_argument("--runs", type=int, default=2, help="runs per variant")
    parser.add_argument("--workers", type=int, default=1, help="worker processes per conversion")
    parser.add_argument("--megabytes", type=int, default=16, help="MiB of blocks per quant type")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    env = {"PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    real = real_shapes()
    types = per_type(args.megabytes)
    work = Path(tempfile.mkdtemp(prefix="dsv4-gguf-bench-", dir=args.workdir))
    results: dict[tuple[str, str], list] = {}
    sizes, resident, gguf_kinds, module_types = {}, {}, {}, {}
    try:
        meta = metadata_stage(work)
        variants = []
        for recipe in ("q2", "q4"):
            src = work / f"{recipe}.gguf"
            subprocess.run([sys.executable, "-c", _MAKE, str(src), recipe, str(args.experts)],
                           check=True, env={**os.environ, **env}, cwd=root)
            sizes[recipe] = src.stat().st_size
            gguf_kinds[recipe], module_types[recipe] = gguf_bytes_by_kind(src)
            variants += [(recipe, mode) for mode in MODES]
        order = [variant for _, variant in ab.schedule(variants, args.runs)]
        for recipe, mode in order:
            dst = work / f"out-{recipe}-{mode}"
            cmd = [sys.executable, "-c", _CONVERT, str(work / f"{recipe}.gguf"), str(dst),
                   str(args.workers), *MODES[mode]]
            _, _, out = ab.run_once(cmd, ab.Variant(f"{recipe}/{mode}", env), RUN_TIMEOUT_S)
            out["written"] = written_bytes(dst)
            results.setdefault((recipe, mode), []).append(out)
            if (recipe, mode) not in resident:
                resident[recipe, mode] = resident_by_kind(dst, module_types[recipe])
            print(f"{recipe}/{mode}: {out['convert_s']:.1f} s, {_mb(out['written'])} MB written",
                  file=sys.stderr)
            shutil.rmtree(dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    text = render(args, types, meta, sizes, order, results, resident, gguf_kinds, real)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = args.out_dir / f"{datetime.now(timezone.utc):%Y-%m-%d}-convert-gguf-native.md"
    report.write_text(text)
    print(report)


if __name__ == "__main__":
    main()
