"""Streamed experts (--expert-cache-gb) on a synthetic model with V4.1 Flash's expert widths.

    python -m benchmarks.expert_stream                       # ~29 GB model in /tmp, dated report
    python -m benchmarks.expert_stream --prefill 512 --decode 64 --runs 3   # the H200's sizes
    python -m benchmarks.expert_stream --keep --dir D        # keep (or reuse) the model in D
    python -m benchmarks.expert_stream --parts steps,model --segments both   # compiled segments vs op by op
    python -m benchmarks.expert_stream --parts steps --steps-batch 4      # the same for the server's batch

The model: 4 layers at the real widths of V4.1 Flash (hidden 5120, 64 heads x 512, q-LoRA 1280,
window 128, window-only attention), each with 384 routed experts of 2304 x 5120 in mxfp4 (18.9 MB
an expert with gate, up and down; 7.2 GB a layer, 29 GB in all), top-6 + the shared expert,
random weights, no Engram, a small vocabulary; written as a dsv4 model directory (one shard per
stacked expert tensor). Every part drops the files from the page cache first (posix_fadvise
DONTNEED; the store itself reads around the cache, expert_io_hints), so reads hit the disk.

1. Roofline and miss path, interleaved: this script's own pread benchmark of random whole-expert
   reads (the six pieces of one expert of a random layer, in chunks over a pool of threads;
   buffered and O_DIRECT; every read in flight, or waiting after each 6 experts as a decode
   lookup does), and the ExpertStore's lookups alone (no model compute, every lookup a miss) per
   read chunk and worker count. The best pread rate is the disk's random-read bandwidth at the
   expert read size; target: the store's miss path at >= 70% of it.
2. Policies: hit rates of lru, frequency and layer at V4.1 Flash's counts (43 layers x 384
   experts, top-6; narrow widths: hit rates depend on counts only) by the store's own lookups
   with the reads stubbed out, on routing traces: uniform (what a random model routes) and
   skewed + local (a Zipf popularity per layer, tokens reusing recent experts; its parameters
   are stated in the report, not measured from V4.1).
3. Trained routing: hit rates and the prefetch's accuracy on the demo checkpoint (a trained
   tiny model: 8 experts, top-2).
4. The model: each cache size in a fresh process (interleaved A B | B A), prefill and decode
   tokens/s, hit rate and MB read per decoded token, prefill experts read against those
   selected, prefetch accuracy, the miss path's GB/s; every size must produce the same tokens
   (streaming claims exactness; tests/test_expert_streaming.py checks it against resident).
   `--segments both` runs each size with the fixed-shape step as compiled segments
   (DSV4_EXPERT_STEP_SEGMENTS=1, dsv4/step_segments.py) and op by op, and reports the decode's
   seconds per token outside the reads (decode time less the lookups' waits) for each.
5. The step's host syncs (--parts steps): the demo checkpoint decoded greedily on the
   fixed-shape step (forced on, also on a CPU), resident (one compiled graph) against streamed
   with every expert cached (no reads once warm) as compiled segments and op by op; the median
   ms per token after a warm-up, and what each streamed layer adds to the resident step. With
   --steps-batch B: B sessions at different positions on the server's batched fixed-shape step
   (dsv4/batch_step.py), ms per step of the batch, tokens/s of all sessions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks import ab, hardware  # noqa: E402

LAYERS = 4


def spec(layers: int, **widths) -> dict:
    """Config fields of a window-only model of `layers` layers with V4.1 Flash's routing (384
    experts, top-6) and its widths, or the `widths` given."""
    return dict(dict(hidden_size=5120, num_attention_heads=64, head_dim=512, q_lora_rank=1280,
                     qk_rope_head_dim=64, o_groups=8, o_lora_rank=1024, moe_intermediate_size=2304,
                     n_routed_experts=384, num_experts_per_tok=6, sliding_window=128,
                     index_n_heads=32, index_head_dim=128, index_topk=512,
                     candidate_topk_blocks=2048, candidate_block_size=8,
                     compress_ratios=[0] * layers, kv_source_layer_ids=[], index_source_layer_ids=[],
                     candidate_source_layer_id=None, engram_layer_ids=[], num_hidden_layers=layers,
                     rope_scaling={"type": "yarn", "factor": 16,
                                   "original_max_position_embeddings": 65536,
                                   "beta_fast": 32, "beta_slow": 1}), **widths)


REAL = spec(LAYERS)
# Hit rates depend on the counts (experts, top-k, layers, slots), not on the widths: the policy
# study uses V4.1 Flash's 43 layers at narrow widths.
COUNTS = spec(43, hidden_size=256, num_attention_heads=4, head_dim=64, q_lora_rank=64, o_groups=2,
              o_lora_rank=64, moe_intermediate_size=64)
FP32 = ("hc_attn_", "hc_ffn_", "attn_sink", "gate.bias")
DENSE_FP8 = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_experts")
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
MXFP8 = {"group_size": 32, "bits": 8, "mode": "mxfp8"}
# Skewed + local routing traces (part 3): popularity ~ 1 / rank**ZIPF within a layer; a token
# takes each of its experts with probability REUSE from the experts of the last WINDOW tokens.
ZIPF, REUSE, WINDOW = 0.8, 0.5, 8


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --- the synthetic model -------------------------------------------------------------------------

def write_model(root: Path, fields: dict = REAL, seed: int = 0) -> Path:
    """The synthetic dsv4 model directory of `fields` in `root` (made once; kept if complete)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from dsv4 import safetensors_file
    from dsv4.config import ModelArgs
    from dsv4.model import Model
    from dsv4.testing import tiny_config, train_tokenizer

    if (root / "config.json").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(512)
    config = tiny_config(vocab_size=tokenizer.get_vocab_size(), **fields)
    args = ModelArgs.from_dict(config)
    model = Model(args)

    def dense(path, m):
        return hasattr(m, "to_quantized") and any(f".{n}" in f".{path}" for n in DENSE_FP8) \
            and ".experts." not in f".{path}."
    nn.quantize(model, class_predicate=lambda p, m: MXFP8 if dense(p, m) else False)
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    tensors, weight_map = {}, {}
    for name, p in tree_flatten(model.parameters()):
        if ".ffn.experts." in name:
            continue
        if name.endswith("gate.weight"):   # the router: random, so the routing is not a tie
            p = mx.random.normal(p.shape) * args.hidden_size ** -0.5
        elif name.endswith("gate.bias"):
            p = mx.random.normal(p.shape) * 0.05
        if p.dtype == mx.float32 and not any(k in name for k in FP32):
            p = p.astype(mx.bfloat16)
        mx.eval(p)
        if p.dtype == mx.bfloat16:
            tensors[name] = ("BF16", np.array(p.view(mx.uint16)))
        else:
            tensors[name] = (safetensors_file.dtype_name(np.array(p)), np.array(p))
    layers = args.num_hidden_layers
    shards = 1 + layers * 6
    first = f"model-00001-of-{shards:05d}.safetensors"
    safetensors_file.write(root / first, tensors)
    weight_map.update({n: first for n in tensors})
    quantization = dict(MXFP8)
    d, inter, e = args.hidden_size, args.moe_intermediate_size, args.n_routed_experts
    shard = 1
    for layer in range(layers):
        for w, (out, n_in) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
            quantization[f"layers.{layer}.ffn.experts.{w}"] = dict(MXFP4)
            for kind, shape, make in (
                    ("weight", (e, out, n_in // 8), lambda s: np.frombuffer(rng.bytes(4 * int(np.prod(s))),
                                                                            np.uint32).reshape(s)),
                    ("scales", (e, out, n_in // 32), lambda s: rng.integers(120, 124, s, dtype=np.uint8))):
                shard += 1
                file = f"model-{shard:05d}-of-{shards:05d}.safetensors"
                name = f"layers.{layer}.ffn.experts.{w}.{kind}"
                array = make(shape)
                safetensors_file.write(root / file, {name: ("U32" if kind == "weight" else "U8", array)})
                weight_map[name] = file
                del array
                if array_bytes(shape) > 1 << 30:
                    log(f"wrote {file} ({name})")
    config.update(config.pop("text_config"))
    config.pop("quantization_config")
    config["quantization"] = quantization
    config["dsv4"] = {"format_version": 1, "source": {"kind": "synthetic"}, "engram": {}}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=1))
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return root


def array_bytes(shape) -> int:
    return 4 * int(np.prod(shape))


def shard_files(root: Path) -> list[Path]:
    return sorted(root.glob("model-*.safetensors"))


def drop_page_cache(files) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def expert_regions(root: Path) -> list[list[tuple[Path, int, int]]]:
    """For each layer, the six (file, offset of expert 0, bytes an expert) of its experts."""
    from dsv4.safetensors_file import Checkpoint

    ckpt = Checkpoint(root, "model*.safetensors")
    out = []
    for layer in range(json.loads((root / "config.json").read_text())["num_hidden_layers"]):
        regions = []
        for w in ("w1", "w3", "w2"):
            for kind in ("weight", "scales"):
                info = ckpt[f"layers.{layer}.ffn.experts.{w}.{kind}"]
                regions.append((info.file, info.offset, info.nbytes // info.shape[0]))
        out.append(regions)
    return out


def sizes(root: Path) -> tuple[int, int, int]:
    """(bytes of one expert, of the least cache, of all experts) of a synthetic model."""
    config = json.loads((root / "config.json").read_text())
    per_expert = sum(per for _, _, per in expert_regions(root)[0])
    layers, k, e = config["num_hidden_layers"], config["num_experts_per_tok"], config["n_routed_experts"]
    return per_expert, per_expert * k * layers, per_expert * e * layers


def traces(kind: str, tokens: int, layers: int, seed: int) -> np.ndarray:
    """Routing [tokens, layers, k] of distinct experts per (token, layer)."""
    e, k = REAL["n_routed_experts"], REAL["num_experts_per_tok"]
    rng = np.random.default_rng(seed)
    out = np.zeros((tokens, layers, k), np.int64)
    popularity = 1.0 / np.arange(1, e + 1) ** ZIPF
    popularity /= popularity.sum()
    ranks = [rng.permutation(e) for _ in range(layers)]   # each layer its own popular experts
    for t in range(tokens):
        for layer in range(layers):
            if kind == "uniform":
                out[t, layer] = rng.choice(e, k, replace=False)
                continue
            recent = np.unique(out[max(0, t - WINDOW):t, layer]) if t else np.zeros(0, np.int64)
            chosen: list[int] = []
            while len(chosen) < k:
                if len(recent) and rng.random() < REUSE:
                    pick = int(rng.choice(recent))
                else:
                    pick = int(ranks[layer][rng.choice(e, p=popularity)])
                if pick not in chosen:
                    chosen.append(pick)
            out[t, layer] = chosen
    return out


def replay(store, routing: np.ndarray) -> None:
    """The store's lookups for `routing`, layer by layer, as decode makes them."""
    for token in routing:
        for layer, experts in enumerate(token):
            store.lookup(layer, np.unique(experts), 1)


# --- 1. the disk and the miss path ---------------------------------------------------------------

def pread_experts(root: Path, experts: int, threads: int, chunk: int, direct: bool, seed: int) -> float:
    """GB/s reading `experts` random whole experts (their six pieces in `chunk`-byte preads over
    `threads` threads), page cache dropped first; O_DIRECT reads aligned spans into aligned
    buffers, as a cache-bypassing reader must."""
    regions = expert_regions(root)
    rng = np.random.default_rng(seed)
    picks = [(int(rng.integers(len(regions))), int(rng.integers(REAL["n_routed_experts"])))
             for _ in range(experts)]
    drop_page_cache(shard_files(root))
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = {path: os.open(path, flags) for path in {r[0] for layer in regions for r in layer}}
    align = 4096
    local = threading.local()

    def read(fd, offset, n):
        if direct:
            lo, hi = offset // align * align, -(-(offset + n) // align) * align
            buf = getattr(local, "buf", None)
            if buf is None or len(buf) < hi - lo:
                import mmap
                local.buf = buf = mmap.mmap(-1, max(hi - lo, chunk + 2 * align))  # page-aligned
            return min(n, os.preadv(fd, [memoryview(buf)[:hi - lo]], lo) - (offset - lo))
        buf = getattr(local, "buf", None)
        if buf is None or len(buf) < n:
            local.buf = buf = bytearray(max(n, chunk))
        return os.preadv(fd, [memoryview(buf)[:n]], offset)

    tasks = []
    for layer, e in picks:
        for path, first, per in regions[layer]:
            for lo in range(0, per, chunk):
                tasks.append((fds[path], first + e * per + lo, min(chunk, per - lo)))
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        done = sum(pool.map(lambda t: read(*t), tasks))
    seconds = time.perf_counter() - start
    for fd in fds.values():
        os.close(fd)
    return done / seconds / 1e9


ROOF_VARIANTS = [(direct, threads, chunk, 0) for direct in (False, True) for threads in (8, 32)
                 for chunk in (1 << 20, 4 << 20)] + [(True, 16, 2 << 20, 6)]
STORE_SETTINGS = [(2048, 16, False), (1024, 16, False), (4096, 32, False), (1024, 64, False),
                  (2048, 16, True), (1024, 32, True)]   # (read chunk KiB, workers, O_DIRECT)


def io_rates(root: Path, experts: int, repeats: int) -> tuple[list[dict], list[dict]]:
    """The roofline variants and the store's miss path, interleaved (A B .. | .. B A) so that the
    shared disk's drift hits all alike: medians over `repeats` of `experts` experts each.
    Roofline (direct, threads, chunk, batch): batch 0 keeps every read in flight, batch 6 waits
    after each 6 experts as a decode lookup does. Store (chunk KiB, workers): decode lookups of
    uniform routing at the least cache, every lookup a miss; GB/s = bytes / time waited."""
    import dsv4
    from dsv4 import flags

    _, least, _ = sizes(root)
    layers = len(expert_regions(root))
    model, _ = dsv4.load(root, expert_cache_gb=f"{least / 1e9:.9f}")
    store = model.expert_store
    k = REAL["num_experts_per_tok"]

    def store_rate(chunk_kb, workers, direct, seed):
        routing = traces("uniform", max(1, experts // (k * layers)), layers, seed)
        drop_page_cache(shard_files(root))
        store.reset_stats()
        with flags.override(expert_read_chunk_kb=chunk_kb, expert_read_workers=workers,
                            expert_io_direct=direct):
            replay(store, routing)
        t = store.totals()
        return t.bytes_read / t.read_seconds / 1e9

    def roof_rate(direct, threads, chunk, batch, seed):
        if not batch:
            return pread_experts(root, experts, threads, chunk, direct, seed)
        rates = [pread_experts(root, batch, threads, chunk, direct, seed * 100 + i) for i in range(experts // batch)]
        return len(rates) / sum(1 / r for r in rates)   # the same bytes per batch: harmonic mean

    variants = [("roof", v) for v in ROOF_VARIANTS] + [("store", v) for v in STORE_SETTINGS]
    results: dict = {v: [] for v in variants}
    for r in range(repeats):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            kind, setting = v
            seed = 1000 * r + variants.index(v)   # other experts each time: no hits from before
            rate = roof_rate(*setting, seed=seed) if kind == "roof" else store_rate(*setting, seed=seed)
            results[v].append(rate)
            log(f"{kind} {setting}: {rate:.3f} GB/s")
    store.close()
    stats = lambda values: {"gbps": statistics.median(values), "min": min(values), "max": max(values)}
    roof = [{"direct": d, "threads": t, "chunk_mb": c >> 20, "batch": b, **stats(results["roof", (d, t, c, b)])}
            for d, t, c, b in ROOF_VARIANTS]
    store_rows = [{"chunk_kb": c, "workers": w, "direct": d, **stats(results["store", (c, w, d)])}
                  for c, w, d in STORE_SETTINGS]
    return roof, store_rows


# --- 2. the policies, by the store alone ---------------------------------------------------------

def stub_reads(store) -> None:
    """For the policy study: lookups pick victims and count hits; the reads do nothing."""
    from dsv4.pread_pool import Reads

    def own_only(pool, layer, experts, slots):
        pool.own(layer, experts, slots)
        return Reads([], lambda: None)

    store._start_reads = own_only


def policy_sweep(root: Path, fractions: list[float], tokens: int) -> list[dict]:
    """Hit rates of each policy per trace and cache size, on the model of `root` (V4.1's counts)."""
    import dsv4
    from dsv4 import flags

    rows = []
    _, least, everything = sizes(root)
    layers = json.loads((root / "config.json").read_text())["num_hidden_layers"]
    for kind in ("uniform", "skewed"):
        routing = traces(kind, tokens, layers, seed=7)
        for fraction in fractions:
            budget = max(least, fraction * everything)
            for policy in ("lru", "frequency", "layer"):
                with flags.override(expert_cache_policy=policy):
                    model, _ = dsv4.load(root, expert_cache_gb=f"{budget / 1e9:.9f}")
                store = model.expert_store
                stub_reads(store)
                replay(store, routing[:tokens // 4])          # warms the cache
                store.reset_stats()
                replay(store, routing[tokens // 4:])
                t = store.totals()
                store.close()
                rows.append({"trace": kind, "fraction": budget / everything, "policy": policy,
                             "hit_rate": t.hits / max(1, t.hits + t.misses)})
                log(f"policy {kind} {100 * budget / everything:.0f}% {policy}: {rows[-1]['hit_rate']:.3f}")
    return rows


# --- 3. trained routing: the demo checkpoint -----------------------------------------------------

def demo_routing(tokens: int) -> list[dict]:
    """Hit rate and prefetch accuracy on the routing of a trained model (dsv4/demo: 8 experts,
    top-2, 8 layers), decoding greedily from a prompt of its training domain, at the least
    cache and at half the experts, for each policy, prefetch on."""
    import mlx.core as mx

    import dsv4
    from dsv4 import flags
    from dsv4.generation import decode_tokens, prefill

    rows = []
    for share in ("least", 0.5):
        for policy in ("lru", "frequency", "layer"):
            with flags.override(expert_cache_policy=policy):
                probe, tokenizer = dsv4.load(None, expert_cache_gb="1")
                least, everything = probe.expert_store.least_bytes, probe.expert_store.nbytes
                probe.expert_store.close()
                budget = least if share == "least" else max(least, share * everything)
                model, _ = dsv4.load(None, expert_cache_gb=f"{budget / 1e9:.9f}")
                store = model.expert_store
                ids = np.array([tokenizer.encode("The for statement is used to iterate over the elements of")])
                cache = model.make_cache()
                logits = prefill(model, ids, cache)
                store.reset_stats()
                for _ in decode_tokens(model, cache, mx.argmax(logits, axis=-1), lambda l: mx.argmax(l, axis=-1),
                                       tokens):
                    pass
                t = store.totals()
                store.close()
            rows.append({"cache": share, "slots": sum(p.slots for p in store.pools), "policy": policy,
                         "hit_rate": t.hits / max(1, t.hits + t.misses),
                         "prefetch_accuracy": t.guessed_right / max(1, t.guessed),
                         "prefetch_hits": t.prefetch_hits / max(1, t.hits + t.misses)})
            log(f"demo {share} {policy}: hits {rows[-1]['hit_rate']:.3f}, prefetch "
                f"{rows[-1]['prefetch_accuracy']:.3f}")
    return rows


# --- 4. the model, one cache size per process ----------------------------------------------------

def child(args) -> None:
    """One run of the model (cache size from DSV4_EXPERT_CACHE_GB): a DSV4_RESULT line."""
    import mlx.core as mx

    import dsv4
    from dsv4.generation import decode_tokens, prefill

    drop_page_cache(shard_files(args.dir))
    model, _ = dsv4.load(args.dir)
    store = model.expert_store
    ids = np.random.default_rng(5).integers(7, model.args.vocab_size, (1, args.prefill))
    cache = model.make_cache()
    start = time.perf_counter()
    logits = prefill(model, ids, cache)
    prompt_s = time.perf_counter() - start
    p = store.totals()
    store.reset_stats()
    tokens, start = [], None
    for token in decode_tokens(model, cache, mx.argmax(logits, axis=-1), lambda l: mx.argmax(l, axis=-1),
                               args.decode + 1):
        if start is None:
            start = time.perf_counter()
        tokens.append(token)
    decode_s = time.perf_counter() - start
    d = store.totals()
    result = {"cache_gb": store.nbytes / 1e9, "slots": sum(pool.slots for pool in store.pools),
              "prompt_tps": args.prefill / prompt_s, "generation_tps": args.decode / decode_s,
              "step_s_per_token": (decode_s - d.read_seconds) / args.decode,
              "prefill_selected": p.hits + p.misses, "prefill_read": p.misses,
              "prefill_gbps": p.bytes_read / max(p.read_seconds, 1e-9) / 1e9,
              "hit_rate": d.hits / max(1, d.hits + d.misses),
              "mb_per_token": d.bytes_read / 1e6 / args.decode,
              "miss_gbps": d.bytes_read / max(d.read_seconds, 1e-9) / 1e9,
              "read_s_per_token": d.read_seconds / args.decode,
              "prefetch_accuracy": d.guessed_right / max(1, d.guessed),
              "prefetch_hits_per_token": d.prefetch_hits / args.decode,
              "tokens": tokens}
    store.close()
    print("DSV4_RESULT " + json.dumps(result), flush=True)


SEGMENTS = {"off": {"": "0"}, "on": {"": "1"}, "both": {" op by op": "0", " segments": "1"}}


def model_runs(args, fractions: list[float]) -> dict:
    _, least, everything = sizes(args.dir)
    variants = []
    for fraction in fractions:
        budget = max(least, fraction * everything)
        for label, segments in SEGMENTS[args.segments].items():
            variants.append(ab.Variant(f"{budget / 1e9:.2f}GB{label}".replace(" ", "_"),
                                       {"DSV4_EXPERT_CACHE_GB": f"{budget / 1e9:.9f}",
                                        "DSV4_EXPERT_STEP_SEGMENTS": segments}, exact=True))
    base = [sys.executable, "-m", "benchmarks.expert_stream", "--child", "--dir", str(args.dir),
            "--prefill", str(args.prefill), "--decode", str(args.decode)]
    runs = ab.run_variants(base, variants, args.runs, 0, timeout_s=args.timeout, log=log)
    names = [v.name for v in variants]
    return {"summary": ab.summarize(runs, names), "names": names,
            "exactness": ab.check_exactness(runs, variants), "everything": everything}


# --- 5. the step's host syncs: the demo checkpoint -----------------------------------------------

STEP_VARIANTS = [ab.Variant("resident", {"DSV4_EXPERT_CACHE_GB": ""}, exact=True),
                 ab.Variant("streamed_segments", {"DSV4_EXPERT_CACHE_GB": "1", "DSV4_EXPERT_STEP_SEGMENTS": "1"},
                            exact=True),
                 ab.Variant("streamed_op_by_op", {"DSV4_EXPERT_CACHE_GB": "1", "DSV4_EXPERT_STEP_SEGMENTS": "0"},
                            exact=True)]


def child_steps(args) -> None:
    """One greedy decode of the demo checkpoint on the fixed-shape step (of --steps-batch
    sessions): a DSV4_RESULT line with the median ms per step after the first quarter (warm-up:
    traces, the cache filling)."""
    import mlx.core as mx

    import dsv4
    from dsv4.generation import decode_tokens, prefill

    model, tokenizer = dsv4.load(None)
    store = getattr(model, "expert_store", None)
    ids = np.array([tokenizer.encode("The for statement is used to iterate over the elements of")])
    if args.steps_batch > 1:
        steps = batch_tokens(model, ids, args.steps_batch, args.steps_decode)
    else:
        cache = model.make_cache()
        logits = prefill(model, ids, cache)
        steps = decode_tokens(model, cache, mx.argmax(logits, axis=-1), lambda l: mx.argmax(l, axis=-1),
                              args.steps_decode)
    warm = args.steps_decode // 4
    tokens, times, last = [], [], time.perf_counter()
    for token in steps:
        now = time.perf_counter()
        times.append(now - last)
        tokens.extend(np.ravel(token).tolist())   # a batch's step: each session's token
        if len(times) == warm and store is not None:
            store.reset_stats()
        last = time.perf_counter()
    ms = 1e3 * statistics.median(times[warm:])
    result = {"ms_per_token": ms, "generation_tps": 1e3 * args.steps_batch / ms,
              "layers": model.args.num_hidden_layers,
              "timed_misses": store.totals().misses if store is not None else 0, "tokens": tokens}
    if store is not None:
        store.close()
    print("DSV4_RESULT " + json.dumps(result), flush=True)


def batch_tokens(model, ids: np.ndarray, sessions: int, steps: int):
    """Each step's greedy tokens of `sessions` sessions decoded together on the batched
    fixed-shape step, session i prefilled with ids less its last 2i tokens (at different
    positions); on the host every step, as the server's scheduler samples."""
    import mlx.core as mx

    from dsv4.batch_step import SessionsDecoder
    from dsv4.generation import prefill

    caches = [model.make_cache() for _ in range(sessions)]
    first = [mx.argmax(prefill(model, ids[:, :ids.shape[1] - 2 * i], c), axis=-1) for i, c in enumerate(caches)]
    dec = SessionsDecoder(model, caches)
    token = mx.concatenate(first)
    for _ in range(steps):
        token = mx.argmax(dec(token), axis=-1)
        yield np.array(token).tolist()
    dec.close(dec.positions)


def step_runs(args) -> dict:
    base = [sys.executable, "-m", "benchmarks.expert_stream", "--child-steps",
            "--steps-decode", str(args.steps_decode), "--steps-batch", str(args.steps_batch)]
    for v in STEP_VARIANTS:
        v.env["DSV4_FIXED_DECODE"] = "on"
    runs = ab.run_variants(base, STEP_VARIANTS, args.steps_runs, 0, timeout_s=args.timeout, log=log)
    names = [v.name for v in STEP_VARIANTS]
    return {"summary": ab.summarize(runs, names), "names": names,
            "exactness": ab.check_exactness(runs, STEP_VARIANTS)}


# --- the report ----------------------------------------------------------------------------------

def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def report(args, machine, parts: dict, started) -> str:
    lines = ["# Streamed experts (--expert-cache-gb)", "",
             f"Date: {started:%Y-%m-%d %H:%M} UTC. Commit {ab.code_revision()}.", "", "## Machine", "",
             hardware.to_markdown(machine), "",
             f"Load average (1 min) at start / end: {args.load_start} / {ab._load_average()}.", "",
             f"Reproduce: `python -m benchmarks.expert_stream {shlex.join(args.argv)}`", ""]
    if not (args.dir / "config.json").is_file():   # the steps part alone
        return "\n".join(lines + step_report(args, parts))
    per_expert, least, everything = sizes(args.dir)
    lines += [f"Disk: the model lives in {args.dir} ({_filesystem(args.dir)}).", "",
              "## Setup", "",
              f"A synthetic model with V4.1 Flash's expert widths: {LAYERS} layers with 384 experts of 2304 x 5120 in mxfp4 each ({per_expert / 1e6:.2f} MB an "
              f"expert, {everything / 1e9:.1f} GB of experts; the least cache, top-6 in every layer, "
              f"{least / 1e9:.3f} GB), real attention widths, window-only layers, random weights. Page "
              "cache dropped (posix_fadvise DONTNEED) before every measurement; the store reads around "
              "it (expert_io_hints: each piece dropped once read).", ""]
    if "io" in parts:
        roof_rows, store_rows = parts["io"]
        roof = max(r["gbps"] for r in roof_rows if not r["batch"])
        batched = max(r["gbps"] for r in roof_rows if r["batch"])
        lines += ["## 1. Roofline (this script's pread benchmark) and the store's miss path", "",
                  f"Each measurement reads {args.io_experts} random (layer, expert) pairs, the page cache "
                  f"dropped first; all variants interleaved, {args.io_repeats} rounds, medians [min - max]. "
                  "Roofline: an expert's six pieces in chunks over a pool of threads, every read in "
                  "flight (batch -) or waiting after each 6 experts as a decode lookup does (batch 6). "
                  "Store: ExpertStore.lookup (the MoE's call) on decode lookups of uniform routing at "
                  "the least cache, so every lookup misses; GB/s = bytes read / time the lookups "
                  "waited.", ""]
        lines += table(["reader", "O_DIRECT", "threads", "chunk", "batch", "GB/s", "range", "of roofline"],
                       [["pread bench", r["direct"], r["threads"], f"{r['chunk_mb']} MiB", r["batch"] or "-",
                         f"{r['gbps']:.3f}", f"{r['min']:.3f} - {r['max']:.3f}", f"{100 * r['gbps'] / roof:.0f}%"]
                        for r in roof_rows] +
                       [["store", "yes (aligned buffer + copy)" if r["direct"] else "no (DONTNEED each piece)",
                         r["workers"], f"{r['chunk_kb']} KiB", 6,
                         f"{r['gbps']:.3f}", f"{r['min']:.3f} - {r['max']:.3f}", f"{100 * r['gbps'] / roof:.0f}%"]
                        for r in store_rows])
        best = max(store_rows, key=lambda r: r["gbps"])
        default = next(r for r in store_rows if (r["chunk_kb"], r["workers"], r["direct"]) == (2048, 16, False))
        lines += ["", f"Roofline (the best median with every read in flight): **{roof:.3f} GB/s**; "
                  f"waiting after each 6 experts: {batched:.3f} GB/s. The store's miss path at the "
                  f"defaults (2048 KiB, 16 workers, buffered): **{default['gbps']:.3f} GB/s = "
                  f"{100 * default['gbps'] / roof:.0f}% of the roofline**; best setting "
                  f"{best['chunk_kb']} KiB x {best['workers']}{' O_DIRECT' if best['direct'] else ''}: "
                  f"{best['gbps']:.3f} GB/s = {100 * best['gbps'] / roof:.0f}%.", ""]
    if "policy" in parts:
        lines += ["## 2. Eviction policies: hit rates (the store's lookups, reads stubbed)", "",
                  f"V4.1 Flash's counts (43 layers x 384 experts, top-6) at narrow widths: hit rates "
                  f"depend on counts only. Traces of {args.policy_tokens} decode tokens, the first quarter "
                  f"warming the cache: uniform (a random model's routing) and skewed + local (popularity "
                  f"~ 1/rank^{ZIPF} per layer; each expert with probability {REUSE} one of the last "
                  f"{WINDOW} tokens' experts). The skewed trace is invented, not measured from V4.1: it "
                  "asks whether a policy exploits skew and locality at all.", ""]
        by: dict = {}
        for r in parts["policy"]:
            by.setdefault((r["trace"], f"{100 * r['fraction']:.0f}%"), {})[r["policy"]] = r["hit_rate"]
        lines += table(["trace", "cache (of all experts)", "lru", "frequency", "layer"],
                       [[t, c, *(f"{v[p]:.3f}" for p in ("lru", "frequency", "layer"))]
                        for (t, c), v in by.items()])
        lines += [""]
    if "demo" in parts:
        lines += ["## 3. Trained routing: the demo checkpoint (8 experts, top-2, 8 layers)", "",
                  f"{args.demo_tokens} greedy decode tokens after a prompt of its training domain; prefetch "
                  "on (layer L+1's router on layer L's input). A random guess of 2 of 8 experts is right "
                  "25% of the time.", ""]
        lines += table(["cache", "slots", "policy", "hit rate", "prefetch accuracy", "hits from prefetch"],
                       [[r["cache"], r["slots"], r["policy"], f"{r['hit_rate']:.3f}",
                         f"{r['prefetch_accuracy']:.3f}", f"{r['prefetch_hits']:.3f}"] for r in parts["demo"]])
        lines += [""]
    if "model" in parts:
        m = parts["model"]
        s = m["summary"]
        keys = [("prompt_tps", "prefill tok/s"), ("generation_tps", "decode tok/s"),
                ("step_s_per_token", "decode s / token outside reads"), ("hit_rate", "hit rate"),
                ("mb_per_token", "MB read / token"), ("miss_gbps", "miss GB/s"),
                ("read_s_per_token", "read s / token"), ("prefetch_accuracy", "prefetch accuracy"),
                ("prefill_selected", "prefill experts selected"), ("prefill_read", "prefill experts read")]
        lines += ["## 4. The model: decode and prefill against cache size, one process each", "",
                  f"Prefill {args.prefill} tokens, then {args.decode} greedy decode tokens; {args.runs} "
                  "run(s) per size, interleaved; medians. Hit rate, MB/token, miss GB/s and prefetch "
                  "accuracy are the decode's; 'prefill experts selected' counts the (layer, expert) "
                  "lookups of the prompt's chunks, 'read' the ones that missed. 'Outside reads': the "
                  "decode's time less the lookups' waits for misses. 'segments': the fixed-shape step as "
                  "compiled segments (DSV4_EXPERT_STEP_SEGMENTS=1); 'op by op': the step uncompiled.", ""]
        lines += table(["cache"] + [label for _, label in keys],
                       [[name] + [f"{s[name][k].median:.4g}" if k in s[name] else "-" for k, _ in keys]
                        for name in m["names"]])
        lines += ["", "Outputs: " + ("**EXACTNESS CHECK FAILED**: " + "; ".join(m["exactness"])
                                      if m["exactness"] else "every cache size produced the same tokens."), ""]
    return "\n".join(lines + step_report(args, parts))


def step_report(args, parts: dict) -> list[str]:
    lines = []
    if "steps" in parts:
        m = parts["steps"]
        s = {name: m["summary"][name] for name in m["names"]}
        layers = s["resident"]["layers"].median
        resident = s["resident"]["ms_per_token"].median
        batch = (f" of {args.steps_batch} sessions at different positions decoded together (the server's "
                 "batched step, dsv4/batch_step.py; ms per step of the batch, tok/s of all sessions)"
                 if args.steps_batch > 1 else "")
        lines += ["## 5. The step's host syncs: the demo checkpoint", "",
                  f"Greedy decode of {args.steps_decode} tokens on the fixed-shape step{batch} (forced on), "
                  "the median ms per step (a token alone) after the first quarter; streamed with every "
                  "expert cached, so "
                  f"few reads once warm ('misses timed' counts them); {args.steps_runs} run(s) per variant, "
                  f"interleaved, medians. {layers:.0f} streamed layers: 'per layer' is what each adds "
                  "to the resident model's single compiled step (its sync and host work).", ""]
        lines += table(["variant", "ms / token", "tok/s", "per layer (ms)", "misses timed"],
                       [[name, f"{v['ms_per_token'].median:.3f}", f"{v['generation_tps'].median:.1f}",
                         "-" if name == "resident" else f"{(v['ms_per_token'].median - resident) / layers:.3f}",
                         f"{v['timed_misses'].median:.0f}"] for name, v in s.items()])
        lines += ["", "Outputs: " + ("**EXACTNESS CHECK FAILED**: " + "; ".join(m["exactness"])
                                      if m["exactness"] else "every variant produced the same tokens."), ""]
    return lines


def _filesystem(path: Path) -> str:
    import subprocess
    try:
        out = subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True, timeout=10).stdout
        fields = out.splitlines()[1].split()
        return f"{fields[1]} on {fields[0]}"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown filesystem"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "dsv4-expert-stream")
    parser.add_argument("--keep", action="store_true", help="leave the model directories in place")
    parser.add_argument("--prefill", type=int, default=4, help="prompt tokens of each model run")
    parser.add_argument("--decode", type=int, default=4, help="decoded tokens of each model run")
    parser.add_argument("--runs", type=int, default=1, help="model runs per cache size")
    parser.add_argument("--fractions", default="0,0.12,0.25",
                        help="model cache sizes as fractions of all experts (0: the least cache)")
    parser.add_argument("--policy-fractions", default="0.02,0.05,0.1,0.25,0.5")
    parser.add_argument("--io-experts", type=int, default=48, help="experts read per I/O measurement")
    parser.add_argument("--io-repeats", type=int, default=4)
    parser.add_argument("--policy-tokens", type=int, default=400)
    parser.add_argument("--demo-tokens", type=int, default=128)
    parser.add_argument("--segments", default="on", choices=sorted(SEGMENTS),
                        help="model runs with the fixed-shape step as compiled segments (the default, as DSV4_EXPERT_STEP_SEGMENTS), op by op, or both")
    parser.add_argument("--steps-decode", type=int, default=96, help="decoded tokens of each steps run")
    parser.add_argument("--steps-runs", type=int, default=2, help="runs per variant of the steps part")
    parser.add_argument("--steps-batch", type=int, default=1,
                        help="sessions decoded together in the steps part (> 1: the server's batched step)")
    parser.add_argument("--parts", default="io,policy,demo,model", help="of io,policy,demo,model,steps")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out-dir", type=Path, default=ab.DEFAULT_OUT_DIR)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-steps", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.child or args.child_steps:
        (child if args.child else child_steps)(args)
        return 0
    wanted = set(args.parts.split(","))
    started = datetime.now(timezone.utc)
    args.load_start = ab._load_average()
    machine = hardware.describe()
    made = [d for d in (args.dir, args.dir.with_name(args.dir.name + "-counts")) if not (d / "config.json").is_file()]
    if wanted & {"io", "policy", "model"}:
        write_model(args.dir)
    parts: dict = {}
    try:
        if "io" in wanted:
            parts["io"] = io_rates(args.dir, args.io_experts, args.io_repeats)
        if "policy" in wanted:
            counts = write_model(args.dir.with_name(args.dir.name + "-counts"), COUNTS)
            parts["policy"] = policy_sweep(counts, [float(f) for f in args.policy_fractions.split(",")],
                                           args.policy_tokens)
        if "demo" in wanted:
            parts["demo"] = demo_routing(args.demo_tokens)
        if "model" in wanted:
            parts["model"] = model_runs(args, [float(f) for f in args.fractions.split(",")])
        if "steps" in wanted:
            parts["steps"] = step_runs(args)
        text = report(args, machine, parts, started)
    finally:
        for directory in made if not args.keep else []:
            shutil.rmtree(directory, ignore_errors=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"{started:%Y-%m-%d-%H%M}-expert-stream.md"
    out.write_text(text)
    raw = {k: v for k, v in parts.items() if k not in ("model", "steps")}
    for part in ("model", "steps"):
        if part in parts:
            raw[part] = {name: {key: dataclasses.asdict(stats) for key, stats in metrics.items()}
                         for name, metrics in parts[part]["summary"].items()}
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    log(f"wrote {out} and its raw numbers")
    return 1 if any(parts.get(p, {}).get("exactness") for p in ("model", "steps")) else 0


if __name__ == "__main__":
    sys.exit(main())
