"""Decode speed on a shape-true slice of V4.1 Flash: dsv4 (kernels on / off) vs mlx-lm.

    python -m benchmarks.slice_decode [--contexts 512,8192] [--steps 32] [--small]
        [--experts q2,mxfp4 --dense q8_0,mxfp8]   # two slices, their variants interleaved

The slice has the real widths (hidden 5120, 64 heads x 512, q-LoRA 1280, 384 experts of
2304 in mxfp4, top-6 + shared, window 128, indexer 32 x 128 top-512, vocab 129280, bf16
head) and 7 layers covering every role: window-only (0, 1), ratio-2 kv+index source (2),
ratio-2 reuse (3), ratio-1 kv+index+candidate source (4), re-index inside the candidates
(5), ratio-1 reuse (6). No Engram (mlx-lm has none) unless `--engram`: then Engram before
layers 1 and 2 (the real model's 1 and 14: a window-only and a ratio-2 source layer), its
tables sparse files of the real row counts (holes read as zeros: the reads cost the page
cache's time, not an SSD's), and no mlx-lm. Random weights, built in memory on the device:
dense projections mxfp8 (quantized from random normals), experts random mxfp4 codes with
e8m0 scales 2^-7..2^-4. Both models get the same arrays.

Each variant prefills the context, then decodes `--steps` greedy tokens (one host sync per
token, as a chat loop does); variants are interleaved within one process and repeated.
Reports ms/token, tokens/s extrapolated to 40 layers, effective weight bandwidth (bytes of
the weights one step reads / time) and primitives per layer. `--small` runs the same at
toy widths (for the CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

ROLES = dict(num_hidden_layers=7, compress_ratios=[0, 0, 2, 2, 1, 1, 1], kv_source_layer_ids=[2, 4],
             index_source_layer_ids=[2, 4, 5], candidate_source_layer_id=4, engram_layer_ids=[])
REAL = dict(vocab_size=129280, hidden_size=5120, num_attention_heads=64, head_dim=512, q_lora_rank=1280,
            qk_rope_head_dim=64, o_groups=8, o_lora_rank=1024, moe_intermediate_size=2304,
            n_routed_experts=384, num_experts_per_tok=6, sliding_window=128, index_n_heads=32,
            index_head_dim=128, index_topk=512, candidate_topk_blocks=2048, candidate_block_size=8,
            rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                          "beta_fast": 32, "beta_slow": 1})
SMALL = dict(REAL, vocab_size=4096, hidden_size=512, num_attention_heads=8, head_dim=128,
             q_lora_rank=256, o_groups=4, o_lora_rank=128, moe_intermediate_size=256,
             n_routed_experts=32, index_n_heads=8, index_head_dim=64, index_topk=64,
             candidate_topk_blocks=16)
ENGRAM = dict(engram_layer_ids=[1, 2], engram_compressed_vocab_size=99092)
FP32 = ("hc_attn_", "hc_ffn_", "attn_sink", "gate.bias")
DENSE_FP8 = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_experts", "main_proj")


# ds4's GGUF recipes for the routed experts (gate, up, down); their shared expert is Q8_0.
GGUF_EXPERTS = {"q2": ("IQ2_XXS", "IQ2_XXS", "Q2_K"), "q4": ("Q4_K", "Q4_K", "Q4_K")}


def gguf_blocks_on_device(shape, qtype: str) -> mx.array:
    """Random valid GGUF blocks for a weight of `shape` [..., out, in], made on the device
    (dsv4.testing.gguf_block_weight's distribution; numpy would take minutes at real widths)."""
    from dsv4 import gguf_blocks
    from dsv4.testing import GGUF_SCALE_FIELDS

    *lead, n_in = shape
    per_row = n_in // gguf_blocks.BLOCK_WEIGHTS[qtype]
    raw = mx.random.randint(0, 256, (*lead, per_row, gguf_blocks.BLOCK_BYTES[qtype])).astype(mx.uint8)
    for at, scale in GGUF_SCALE_FIELDS[qtype]:
        d = (mx.random.uniform(0.2, 1.0, (*lead, per_row, 1)) * scale).astype(mx.float16).view(mx.uint8)
        raw = mx.concatenate([raw[..., :at], d, raw[..., at + 2:]], axis=-1)
    return raw.reshape(*lead, -1)


def keep_gguf(model, experts: str, dense: str) -> None:
    """Routed experts in a ds4 recipe (and their shared expert in Q8_0), and/or the dense
    projections in Q8_0, as GGUF-block layers with random blocks."""
    from dsv4.linear import GGUFExpertLinear, GGUFLinear, matrix_operand

    def dims(module):   # (out, in) of a quantized layer
        q = matrix_operand(module)
        return q.out_features, q.in_features

    for layer in model.layers:
        mods = {}
        if experts != "mxfp4":
            for w, qtype in zip(("w1", "w3", "w2"), GGUF_EXPERTS[experts]):
                e, (out, n_in) = layer.ffn.experts[w].weight.shape[0], dims(layer.ffn.experts[w])
                m = GGUFExpertLinear(n_in, out, e, qtype)
                m.weight = gguf_blocks_on_device((e, out, n_in), qtype)
                mods[f"ffn.experts.{w}"] = m
        targets = [f"ffn.shared_experts.{w}" for w in ("w1", "w3", "w2")] if experts != "mxfp4" else []
        if dense == "q8_0":
            targets += [p for p, m in layer.named_modules() if isinstance(m, nn.QuantizedLinear)
                        and "experts" not in p]
        for path in targets:
            old = dict(layer.named_modules())[path]
            out, n_in = dims(old)
            m = GGUFLinear(n_in, out, "Q8_0")
            m.weight = gguf_blocks_on_device((out, n_in), "Q8_0")
            mods[path] = m
        for path, m in mods.items():
            parent_path, name = path.rsplit(".", 1)
            mx.eval(m.weight)
            setattr(dict(layer.named_modules())[parent_path], name, m)
        mx.clear_cache()   # the replaced MX arrays' memory back to the device for the next layer


def quantize_randomly(module: nn.Module) -> dict:
    """Quantize `module` as the official checkpoint stores it (dense projections mxfp8, routed
    experts mxfp4 with random codes and e8m0 scales 2^-7..2^-4, the rest bf16 but the fp32
    tensors) and keep its random weights; returns its parameters by name."""
    def dense(path, m):
        return (hasattr(m, "to_quantized") and "experts" not in path.split(".")[-2:]
                and any(f".{n}" in f".{path}" for n in DENSE_FP8) and "compressor" not in path)

    nn.quantize(module, class_predicate=lambda p, m: dict(group_size=32, bits=8, mode="mxfp8")
                if dense(p, m) else (dict(group_size=32, bits=4, mode="mxfp4")
                                     if p.endswith(("experts.w1", "experts.w2", "experts.w3")) else False))
    params = {}
    for name, p in tree_flatten(module.parameters()):
        if ".experts.w" in name and name.endswith(".weight"):
            p = mx.random.randint(-2**31, 2**31 - 1, p.shape).view(mx.uint32)  # any nibble is valid e2m1
        elif ".experts.w" in name and name.endswith(".scales"):
            p = mx.random.randint(120, 124, p.shape).astype(mx.uint8)
        elif p.dtype == mx.float32 and not any(k in name for k in FP32):
            p = p.astype(mx.bfloat16)
        mx.eval(p)
        params[name] = p
    module.update(tree_unflatten(list(params.items())))
    return params


def sparse_engram_tables(model, where: Path) -> None:
    """Give the model Engram tables of the real row counts as sparse files in `where` (every
    row zeros), and a hasher whose token map folds the vocabulary onto the compressed ids."""
    from dsv4.engram import NgramHasher
    from dsv4.engram_store import Fp8Rows, InterleavedTable

    args = model.args
    hasher = NgramHasher(args, np.arange(args.vocab_size) % args.engram_compressed_vocab_size)
    tables = {}
    for layer in args.engram_layer_ids:
        path, rows = where / f"engram-{layer}.bin", hasher.table_rows[layer]
        with path.open("wb") as f:
            f.truncate(rows * Fp8Rows(args.engram_head_dim).row_bytes)
        tables[layer] = InterleavedTable(path, 0, rows, f"layers.{layer}.engram", args.engram_head_dim)
    model.set_engram(hasher, tables)


def build(config: dict, experts: str = "mxfp4", dense: str = "mxfp8"):
    """dsv4 and mlx-lm models sharing the same random quantized weights (no mlx-lm model when
    dsv4's keeps GGUF blocks or has Engram: mlx-lm has no such layers)."""
    from mlx_lm.models import deepseek_v41 as ref

    from dsv4.config import ModelArgs
    from dsv4.model import Model

    args = ModelArgs.from_dict(config)
    model = Model(args)
    params = quantize_randomly(model)
    if experts != "mxfp4" or dense != "mxfp8":
        # Without these references each layer's MX arrays go as its GGUF blocks replace them:
        # an 80 GB H100 held both sets no longer (the q2 slice ran out of memory on 2026-12-06).
        del params
        keep_gguf(model, experts, dense)
        return model, None, dict(tree_flatten(model.parameters()))
    if args.engram_layer_ids:
        return model, None, params

    rargs = ref.ModelArgs.from_dict({**config, "model_type": "deepseek_v41"})
    rmodel = ref.Model(rargs)
    rweights = {}
    for name, p in params.items():
        if ".experts.w" in name:
            layer, _, _, w, kind = name.split(".")[1:]
            proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[w]
            rweights[f"model.layers.{layer}.mlp.experts.switch_mlp.{proj}.{kind}"] = p
            continue
        key = ref._rename(name)
        if ".o_a_proj." in key:
            p = p.reshape(args.o_groups, -1, p.shape[-1])
        rweights[key] = p
    nn.quantize(rmodel, class_predicate=lambda p, m: (
        dict(group_size=32, bits=4 if "switch_mlp" in p else 8, mode="mxfp4" if "switch_mlp" in p else "mxfp8")
        if f"{p}.scales" in rweights else False))
    rmodel.load_weights(list(rweights.items()))
    return model, rmodel, params


def step_bytes(params: dict, args) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table and the
    experts not picked (6 of E routed)."""
    total = 0
    for name, p in params.items():
        if name.startswith("embed."):
            continue
        n = p.nbytes
        if ".experts.w" in name:
            n = n * args.num_experts_per_tok // args.n_routed_experts
        total += n
    return total


def prefilled(model, context: int) -> tuple:
    """A cache holding `context` random tokens (seeded by the length) and the greedy token
    after them."""
    from dsv4.generation import prefill

    ids = np.random.default_rng(context).integers(7, model.args.vocab_size, (1, context))
    cache = model.make_cache()
    return cache, mx.argmax(prefill(model, ids, cache), axis=-1)


def decode_dsv4(model, context: int, steps: int) -> tuple[float, list[int]]:
    """ms per decoded token after a prefilled context, through dsv4's decode loop (the
    decoder and the run-ahead the switches pick)."""
    from dsv4.generation import decode_tokens

    cache, first = prefilled(model, context)
    tokens = []
    for token in decode_tokens(model, cache, first, lambda l: mx.argmax(l, axis=-1), steps + 1):
        if not tokens:
            start = time.perf_counter()
        tokens.append(token)
    return (time.perf_counter() - start) / steps * 1e3, tokens


def decode_mlx_lm(rmodel, context: int, steps: int) -> tuple[float, list[int]]:
    """The same through mlx-lm's own loop (generate_step: one step in flight)."""
    from mlx_lm.generate import generate_step

    ids = np.random.default_rng(context).integers(7, rmodel.args.vocab_size, (context,))
    tokens = []
    for token, _ in generate_step(mx.array(ids), rmodel, max_tokens=steps + 1, prefill_step_size=512,
                                  prompt_cache=rmodel.make_cache(), sampler=lambda l: mx.argmax(l, axis=-1)):
        if not tokens:
            start = time.perf_counter()
        tokens.append(int(token))
    return (time.perf_counter() - start) / steps * 1e3, tokens


def ab_switches(spec: str) -> dict:
    """`--ab` 'name=value+name=value' as flags.override's keywords, each value parsed by its switch."""
    from dsv4 import flags

    changed = dict(item.split("=", 1) for item in spec.split("+"))
    return {k: flags.FLAGS[k].parse(v) for k, v in changed.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="512,8192")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true", help="toy widths (CPU)")
    p.add_argument("--experts", default="mxfp4",
                   help="routed experts in mxfp4 (official) or a ds4 GGUF recipe (q2: IQ2_XXS gate/up, "
                        "Q2_K down; q4: Q4_K), the shared expert then Q8_0; several, comma-separated "
                        "(e.g. q2,mxfp4): a slice each, their variants interleaved in one process")
    p.add_argument("--dense", default="mxfp8",
                   help="dense projections in mxfp8 (official) or GGUF Q8_0 (ds4); comma-separated, one "
                        "per --experts entry, or one for all")
    p.add_argument("--routed-experts", type=int,
                   help="routed experts a layer holds (default: the real 384; --small's 32): fewer fit "
                        "several slices on one card (mxfp4's 384 take ~50 GB, q2's ~27) and a step reads "
                        "the same 6 + the shared expert; only the router's matrix shrinks")
    p.add_argument("--engram", action="store_true",
                   help="Engram before layers 1 and 2, tables as sparse files of the real sizes (no mlx-lm)")
    p.add_argument("--variants", default="mlx-lm,dsv4 reference path,dsv4",
                   help="comma-separated, from: mlx-lm, dsv4 reference path, dsv4 fixed not compiled, dsv4")
    p.add_argument("--ab", action="append", default=[], metavar="SWITCH=VALUE[+SWITCH=VALUE]",
                   help="add a dsv4 variant with these switches (dsv4/flags.py names) changed, "
                        "e.g. --ab kernel_matvec=off; repeatable")
    p.add_argument("--stage-profile", action="store_true",
                   help="also decode once at the first context with DSV4_STAGE_PROFILE (uncompiled "
                        "step, a sync at every stage) and add the stage table to the report")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    recipes = parse_recipes(p, a.experts, a.dense)
    config = {**(SMALL if a.small else REAL), **ROLES}
    if a.routed_experts:
        if not config["num_experts_per_tok"] <= a.routed_experts <= config["n_routed_experts"]:
            p.error(f"--routed-experts {a.routed_experts}: expected {config['num_experts_per_tok']}.."
                    f"{config['n_routed_experts']}")
        config["n_routed_experts"] = a.routed_experts
    if a.engram:
        config.update(ENGRAM, engram_compressed_vocab_size=min(ENGRAM["engram_compressed_vocab_size"],
                                                               config["vocab_size"]))
    slices = []
    with tempfile.TemporaryDirectory(prefix="slice-engram-") as tables:
        for experts, dense in recipes:
            t0 = time.perf_counter()
            model, rmodel, params = build(config, experts, dense)
            if a.engram:
                (where := Path(tables) / f"{experts}-{dense}").mkdir()
                sparse_engram_tables(model, where)
            print(f"built {experts}/{dense} in {time.perf_counter() - t0:.1f} s", flush=True)
            slices.append(Slice(experts, dense, model, rmodel, params))
        return measure(a, slices)


@dataclass
class Slice:
    experts: str
    dense: str
    model: object
    rmodel: object   # mlx-lm's model of the same weights, or None
    params: dict

    @property
    def recipe(self) -> str:
        return f"{self.experts}/{self.dense}"


def parse_recipes(p, experts: str, dense: str) -> list[tuple[str, str]]:
    """(experts, dense) per slice from --experts and --dense (one dense for all, or one each)."""
    ex, de = experts.split(","), dense.split(",")
    if len(de) == 1:
        de *= len(ex)
    bad = [e for e in ex if e not in ("mxfp4", *GGUF_EXPERTS)] + [d for d in de if d not in ("mxfp8", "q8_0")]
    if bad or len(de) != len(ex) or len(set(zip(ex, de))) != len(ex):
        p.error(f"--experts {experts} --dense {dense}: expected experts from mxfp4, "
                f"{', '.join(GGUF_EXPERTS)} and dense from mxfp8, q8_0, one dense or one each, no pair twice")
    return list(zip(ex, de))


def measure(a, slices: list) -> int:
    from benchmarks.graph_ops import count_graph, launches, prompt_cache
    from benchmarks.hardware import describe, to_markdown
    from benchmarks.report import write_dated
    from benchmarks.roofline import copy_roofline
    from dsv4 import flags, profiler

    args = slices[0].model.args
    roof = copy_roofline()   # TB/s, this process, this card; None on the CPU
    if roof:
        print(f"roofline: torch device copy {roof:.2f} TB/s", flush=True)
    several = len(slices) > 1
    slice_bytes = {sl.recipe: step_bytes(sl.params, args) for sl in slices}   # weight bytes a step reads
    variants, nbytes = {}, {}   # name -> (run, switches); name -> its slice's bytes
    for sl in slices:
        model, rmodel = sl.model, sl.rmodel
        runs = {
            "mlx-lm": (lambda c, n, rmodel=rmodel: decode_mlx_lm(rmodel, c, n), {}),
            "dsv4 reference path": (lambda c, n, model=model: decode_dsv4(model, c, n), dict(fixed_decode="off")),
            "dsv4 fixed not compiled": (lambda c, n, model=model: decode_dsv4(model, c, n),
                                        dict(fixed_decode="on", compile=False)),
            "dsv4": (lambda c, n, model=model: decode_dsv4(model, c, n), dict(fixed_decode="on")),
        }
        names = [v for v in a.variants.split(",") if rmodel is not None or v != "mlx-lm"]
        chosen = {name: runs[name] for name in names}
        for spec in a.ab:
            chosen[f"dsv4 {spec}"] = (lambda c, n, model=model: decode_dsv4(model, c, n),
                                      {"fixed_decode": "on", **ab_switches(spec)})
        for name, run in chosen.items():
            label = f"{sl.recipe} {name}" if several else name
            variants[label], nbytes[label] = run, slice_bytes[sl.recipe]
    # Warm-up: kernel builds and graph traces happen here, not in the measured runs.
    for name, (run, fl) in variants.items():
        t = time.perf_counter()
        try:
            with flags.override(**fl):
                run(64, 4)
        except Exception as e:
            print(f"warm-up {name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        print(f"warm-up {name}: {time.perf_counter() - t:.1f} s", flush=True)
    rows, results = [], {}
    for context in [int(c) for c in a.contexts.split(",")]:
        times = {name: [] for name in variants}
        for r in range(a.repeats):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                run, fl = variants[name]
                t = time.perf_counter()
                try:
                    with flags.override(**fl):
                        ms, _ = run(context, a.steps)
                except Exception as e:   # one broken variant must not cost the others' numbers
                    print(f"context {context} {name}: FAILED {type(e).__name__}: {e}", flush=True)
                    continue
                times[name].append(ms)
                print(f"context {context} {name}: {ms:.2f} ms/token "
                      f"({time.perf_counter() - t:.1f} s with the prefill)", flush=True)
        for name, ts in times.items():
            if not ts:
                rows.append(f"| {context} | {name} | failed | | | | |")
                continue
            ms = statistics.median(ts)
            layers40 = ms * 40 / args.num_hidden_layers  # upper bound: head and embed scaled too
            gbs = nbytes[name] / (ms / 1e3) / 1e9
            share = f"{100 * gbs / 1e3 / roof:.0f}%" if roof else "-"
            results[f"{context}/{name}"] = dict(ms=ms, runs=ts, tps40=1e3 / layers40, gbs=gbs)
            rows.append(f"| {context} | {name} | {ms:.2f} [{min(ts):.2f}-{max(ts):.2f}] | "
                        f"{1e3 / ms:.1f} | {1e3 / layers40:.1f} | {gbs:.0f} | {share} |")
    per_slice = []
    for sl in slices:
        cache = prompt_cache(sl.model, 64)   # the machine's own prefill (a GPU's is quantized anyway)
        with flags.override(dequant_matmul="off"):
            counts = {path: count_graph(sl.model, 64, path == "fixed", cache) for path in ("reference", "fixed")}
        prims = {path: sum(c.values()) / args.num_hidden_layers for path, c in counts.items()}
        work = {path: sum(launches(c).values()) / args.num_hidden_layers for path, c in counts.items()}
        top = ", ".join(f"{name} {n / args.num_hidden_layers:.1f}" for name, n in counts["fixed"].most_common(12))
        per_slice.append(
            (f"{sl.recipe}: " if several else "") +
            f"weights read per step: {slice_bytes[sl.recipe] / 1e9:.3f} GB. dsv4 primitives per layer "
            f"(one decode step with its cache writes, `benchmarks/graph_ops.py`): reference path "
            f"{prims['reference']:.0f}, fixed-shape compiled step {prims['fixed']:.0f} (most frequent "
            f"per layer: {top}); without the view-only primitives (reshapes, broadcasts, slices): "
            f"reference {work['reference']:.0f}, fixed {work['fixed']:.0f}.")
    when = datetime.now()
    weights = "; ".join(f"experts {sl.experts}, dense {sl.dense}" for sl in slices) + \
        (", Engram before layers 1 and 2" if a.engram else "")
    lines = [f"# Decode on a {'toy-width' if a.small else 'shape-true'} V4.1 slice ({weights}): dsv4 vs mlx-lm", "",
             f"{when:%Y-%m-%d %H:%M}; {args.num_hidden_layers} layers (roles {ROLES['compress_ratios']}) of "
             f"{args.n_routed_experts} routed experts, "
             f"{a.steps} greedy steps after the context, median of {a.repeats} interleaved repeats "
             "after one warm-up run of each variant" + (", the slices' variants in one process." if several else "."),
             *per_slice, "",
             "| context | variant | ms/token [min-max] | tok/s (slice) | tok/s (40 layers, est.) | weight GB/s | of copy roofline |",
             "|---|---|---|---|---|---|---|", *rows, "",
             (f"Copy roofline, this process: torch's device copy {roof:.2f} TB/s (read + write, "
              "`benchmarks/roofline.py`)." if roof else "No CUDA torch: no copy roofline."), "",
             "40-layer estimate: ms/token x 40 / 7 (scales head and embedding too: a lower bound on "
             "tokens/s).", "", to_markdown(describe())]
    recipes = [(sl.experts, sl.dense) for sl in slices]
    tag = ("" if recipes == [("mxfp4", "mxfp8")] else "".join(f"-{e}-{d}" for e, d in recipes)) + \
        ("-engram" if a.engram else "")
    out = write_dated(a.out, when, f"slice-decode{tag}{'-small' if a.small else ''}", lines, data=results,
                      shown=12 + len(rows))
    if a.stage_profile:   # after the report is written: a profile cut short costs nothing else
        context = int(a.contexts.split(",")[0])
        with flags.override(fixed_decode="on", stage_profile=True):
            profiler.reset()
            decode_dsv4(slices[0].model, context, a.steps)
            stages = profiler.report()
        profiler.reset()
        print(stages)
        with out.open("a") as f:
            f.write(f"\nStage profile of the dsv4 step at context {context} (DSV4_STAGE_PROFILE=1: "
                    f"not compiled, a sync at every stage):\n\n```\n{stages}\n```\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
