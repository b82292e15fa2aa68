"""Every runtime switch of dsv4, in one place.

Each switch has a name, an environment variable `DSV4_<NAME>`, a default and one
line saying why it exists. Benchmarks A/B them in fresh processes by setting the
environment; tests flip them with `override()`. `python -m dsv4.generate --help`
and `python -m dsv4.flags` list them with their current values.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import sys
from dataclasses import dataclass
from typing import Iterator, Optional, Union

from .errors import InputError, option_name

Value = Union[bool, int, str]

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


class FlagError(InputError):
    """A DSV4_* variable holds a value its switch does not take."""


@dataclass(frozen=True)
class Flag:
    name: str
    default: Value
    doc: str
    choices: tuple[str, ...] = ()   # the words a str switch takes
    minimum: Optional[int] = None   # the least value an int switch takes

    @functools.cached_property   # read on every get(): a decode step reads every switch
    def env(self) -> str:
        return f"DSV4_{self.name.upper()}"

    def parse(self, text: str) -> Value:
        if isinstance(self.default, bool):
            low = text.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise FlagError(f"{self.env}={text!r}: expected one of 0/1/true/false/on/off")
        if isinstance(self.default, int):
            try:
                value = int(text)
            except ValueError:
                raise FlagError(f"{self.env}={text!r}: expected an integer") from None
            if self.minimum is not None and value < self.minimum:
                raise FlagError(f"{self.env}={text!r}: expected an integer >= {self.minimum}")
            return value
        if self.choices:
            if text.strip().lower() not in self.choices:
                raise FlagError(f"{self.env}={text!r}: expected one of {', '.join(self.choices)}")
            return text.strip().lower()
        return text


FLAGS: dict[str, Flag] = {}
_overrides: dict[str, Value] = {}


AUTO_ON_OFF = ("auto", *sorted(_TRUE | _FALSE))


def define(name: str, default: Value, doc: str, choices: tuple[str, ...] = (),
           minimum: Optional[int] = None) -> Flag:
    if name in FLAGS:
        raise ValueError(f"flag {name!r} is defined twice")
    flag = Flag(name, default, doc, choices, minimum)
    FLAGS[name] = flag
    return flag


def get(name: str) -> Value:
    """The switch's value: a test override, else the environment, else the default."""
    return _value(FLAGS[name], os.environ)


def _value(flag: Flag, environ) -> Value:
    if flag.name in _overrides:
        return _overrides[flag.name]
    text = environ.get(flag.env)
    return flag.default if text is None else flag.parse(text)


def snapshot() -> tuple:
    """Every switch's value in definition order: the key of what was built under them. A decode
    step takes one, so the environment is read in one pass: os.environ.get of an unset variable
    raises and catches a KeyError inside, ~1 µs a switch (72 µs a step on this project's CPU,
    against ~30 this way)."""
    ours = {k: v for k, v in os.environ.items() if k.startswith("DSV4_")}
    return tuple(_value(flag, ours) for flag in FLAGS.values())


def switch(name: str, auto: bool) -> bool:
    """An auto/on/off switch's state: `auto` when it is "auto", else its on/off value."""
    value = get(name)
    if isinstance(value, bool):   # tests may override with a bool
        return value
    low = value.strip().lower()
    if low == "auto":
        return auto
    if low in _TRUE or low in _FALSE:
        return low in _TRUE
    raise FlagError(f"{FLAGS[name].env}={value!r}: expected auto, on or off")


@contextlib.contextmanager
def override(**values: Value) -> Iterator[None]:
    """Set switches for the duration of a with-block (tests, benchmarks in-process)."""
    for name in values:
        if name not in FLAGS:
            raise KeyError(f"unknown flag {name!r}; known: {sorted(FLAGS)}")
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def from_options(**values: Optional[Value]) -> dict[str, Value]:
    """Command-line options that stand for switches (--draft for DSV4_DRAFT), parsed as the
    variables are, for override(); an error names the option. None: not given."""
    out = {}
    for name, value in values.items():
        if value is not None:
            flag = FLAGS[name]
            try:
                out[name] = flag.parse(str(value))
            except FlagError as e:
                raise FlagError(str(e).replace(flag.env, option_name(name))) from None
    return out


def check_environment(environ=os.environ, warn=None) -> None:
    """Check every DSV4_* variable now, before minutes of loading: a bad value raises a
    FlagError naming it, an unknown name (a typo, or a switch that was removed) is warned
    about on `warn` (stderr)."""
    known = {flag.env: flag for flag in FLAGS.values()}
    for env, text in sorted(environ.items()):
        if not env.startswith("DSV4_"):
            continue
        flag = known.get(env)
        if flag is None:
            close = difflib.get_close_matches(env, known, n=1, cutoff=0.8)
            hint = f" (did you mean {close[0]}?)" if close else ""
            print(f"warning: {env} is not a dsv4 switch{hint}; python -m dsv4.flags lists them",
                  file=warn or sys.stderr, flush=True)
        else:
            flag.parse(text)


def describe() -> str:
    """One line per switch: env var, current value, default, doc."""
    lines = []
    for flag in FLAGS.values():
        lines.append(f"{flag.env:<28} = {get(flag.name)!s:<8} (default {flag.default}) {flag.doc}")
    return "\n".join(lines)


# --- numerics of the model (model-spec §11) ---------------------------------------------
define("kv_qdq", True,
       "round window KV to fp8/32, compressed KV to fp4(e4m3)/16 and indexer q/k to fp4/32 "
       "as the official model does; off gives the unquantized math")
define("act_quant", True,
       "round the inputs of fp8/fp4 matmuls to fp8 per 32 values as the official model does")
define("index_key_quirk", False,
       "decode: ratio-2 index sources score against the last published keys, as the "
       "reference code does (model-spec 3.9); off uses each layer's own owner keys")
define("pipeline_memory", "",
       "--parallel pipeline: each rank's share of the weights; empty: equal shares, 'auto': in "
       "proportion to each rank's physical memory, or one size per rank (e.g. 512,256)")
define("join_timeout", 60,
       "--parallel: seconds a rank waits for its ring peers to connect before it stops with an "
       "error naming the one it waited for (MLX's ring accept waits forever)", minimum=1)
define("answer_timeout", 60,
       "--parallel server: seconds rank 0 waits for the other ranks to take its next call (they "
       "wait for it, so they answer at once) before it stops with an error naming them (MLX's ring "
       "waits forever once it has noticed a lost peer between calls)", minimum=1)
define("indexer_skip", True,
       "skip the indexer's scoring while every visible compressed row makes its top-k "
       "(the selection is then known); exact")
define("dequant_matmul", "auto",
       "quantized layers keep a dequantized copy of their weight (once, on first use) and "
       "use plain matmuls: auto (on for the CPU device, where MLX's quantized matmul is "
       "slow; costs the memory of the dense copy), on, off", choices=AUTO_ON_OFF)

define("prefill_chunk", 0,
       "tokens per prefill chunk of generate and chat (the server's scheduler picks its own); 0 "
       "(default): 4096 under CUDA, 512 elsewhere. On an H100 slice chunks of 4096 prefilled 4K "
       "tokens at 18782 tokens/s against 17692 in chunks of 2048, 32K at 14402 against 13594 "
       "(benchmarks/results/2026-12-06-2007-slice-prefill.md); on the H200 chunks of 2048, evaluated "
       "layer by layer (DSV4_PREFILL_EVAL_LAYERS), prefilled 32K in 3.85 s against 5.16 in chunks of "
       "512 (2026-12-04-0848-slice-prefill.md). Metal keeps 512 until a Mac measures it",
       minimum=0)
define("prefill_eval_layers", "auto",
       "a prefill chunk evaluated layer by layer (async: mx.async_eval after each layer, the "
       "host building the next meanwhile; sync: mx.eval) instead of as one graph: auto "
       "(default): async under CUDA for chunks of 16 positions or more (not decode steps, their "
       "batches or a draft's verification), where chunks of 2048 took 3.85 s at 32K tokens with it and "
       "16.6 s without (benchmarks/results/2026-12-04-0848-slice-prefill.md, "
       "2026-12-04-0254-prefill-profile-32768-c2048.md); off elsewhere until a Mac measures it; "
       "async, sync, off", choices=("auto", "off", "async", "sync"))
define("dequant_prefill", "auto",
       "mxfp8/mxfp4 projections of 512 rows or more (prefill chunks; bf16/fp16 activations) "
       "dequantize their weight for each product and use a plain matmul instead of MLX's "
       "quantized_matmul; the dense copy lives for that product only. auto (default): on under "
       "CUDA, where it measured 1.1-2.9x faster at 512 and 2048 rows on the H200's dense V4.1 "
       "shapes, and not at 128 (benchmarks/results/2026-12-04-0241-prefill-matmuls.md); the "
       "routed experts keep gather_qmm (MLX's gather_mm was slower there even on bf16 weights "
       "made beforehand; see kernel_prefill_experts_mma); off on Metal until a Mac measures "
       "it; on, off", choices=AUTO_ON_OFF)

define("head_quant", "off",
       "keep the output head quantized: off (as loaded, bf16 officially), mxfp8 or affine8 "
       "(group 32); saves ~40% of a decode step's bytes on GPUs, adds the logit error "
       "reported by benchmarks/head_quant.py", choices=("off", "mxfp8", "affine8"))

# --- Engram store (on-disk tables) -----------------------------------------------------
# Defaults from benchmarks/results/2026-11-29-142127-engram-reads.md (python -m
# benchmarks.engram_reads: 2 x 2.95 GiB tables, page cache dropped before every pass).
define("engram_parallel_decode", True,
       "split each decode read (24 rows per table) over engram_decode_workers pread workers "
       "(13.4 -> 2.3 ms/token for two tables with engram_readahead, rows on an SSD); off: one "
       "serial reader thread, faster where the rows are in the page cache (the workers wait for "
       "the GIL the step's encoding holds: the H100 slice 6.94 vs 5.09 ms/token, "
       "benchmarks/results/2026-12-05-1514-slice-decode-engram.md)")
define("engram_decode_workers", 4,
       "pread workers for one decode read of one table (two tables read at once); 4 beat 2 and 8", minimum=1)
define("engram_prefill_workers", 16,
       "pread workers for a batch read (prefill: all rows of a prompt, sorted and deduplicated); "
       "1.9x the rows/s of one worker, 32 within noise of 16", minimum=1)
define("engram_readahead", True,
       "each read worker first asks the kernel for all its rows (posix_fadvise WILLNEED, Linux) "
       "so the disk serves them at once, then preads them (2.7x on parallel decode)")
define("engram_native_reads", True,
       "read Engram rows on the native reader's C++ threads (dsv4/native/reads.cpp, built on "
       "first use with the C++ compiler): no GIL until the rows are waited for, so the reads run "
       "while the decoder encodes the step; the same rows and errors. Off, or without a "
       "compiler: Python threads (engram_parallel_decode, engram_decode_workers), which wait for "
       "the GIL the encoding holds")
define("engram_row_cache", 0,
       "rows kept per table in a least-recently-used cache of raw rows; 0 = off "
       "(no measured gain even when every row repeats: the OS page cache serves repeats)", minimum=0)
define("engram_io_hints", True,
       "tell the OS the table is read at random: posix_fadvise RANDOM on Linux (no effect beyond "
       "noise there), F_NOCACHE and no read-ahead on macOS (keeps 95 GiB tables out of the cache)")
define("engram_resident", False,
       "load every Engram table into memory as mxfp8 when it is opened (needs ~95 GiB per table)")

# --- streamed experts (dsv4/expert_store.py) ----------------------------------------------
define("expert_cache_gb", "",
       "stream the routed experts from disk into a cache of this many GB (or auto: the memory "
       "left after the resident weights, less headroom) instead of loading them; empty: all "
       "resident. The generate, chat and server option --expert-cache-gb sets it")
define("expert_cache_policy", "layer",
       "which cached expert a miss overwrites: layer (the slots of the layers just passed first: "
       "decode visits the layers in a cycle), lru, or frequency (decayed use counts); layer "
       "matched or beat lru at every size and frequency lost on the skewed trace at V4.1's "
       "counts (benchmarks/expert_stream.py)", choices=("layer", "lru", "frequency"))
define("expert_prefetch", True,
       "decode: guess layer L+1's experts by its router on layer L's input and start reading "
       "them while layer L computes")
define("expert_read_workers", 16,
       "pread workers a lookup's misses are split over (the pread pool the Engram tables use)",
       minimum=2)
define("expert_read_chunk_kb", 2048,
       "the largest piece of an expert one pread worker reads at once, in KiB", minimum=4)
define("expert_io_hints", True,
       "read experts around the OS cache: F_NOCACHE on macOS, each piece dropped from the cache "
       "once read on Linux (150 GB of experts would otherwise push the resident weights out)")
define("expert_step_segments", True,
       "with streamed experts, run the fixed-shape decode step (alone or the server's batch) as "
       "compiled segments that end at each streamed layer's routing, the host's lookup between "
       "them (dsv4/step_segments.py); off runs the step op by op (H200, demo checkpoint with 8 "
       "streamed layers, every expert cached: 8.6 vs 19.0 ms/token, resident 4.6, the same tokens: "
       "benchmarks/results/2026-12-03-1318-expert-stream.md)")
define("expert_native_reads", True,
       "read streamed experts on the native reader's C++ threads (dsv4/native/reads.cpp, built on "
       "first use with the C++ compiler): no GIL until a layer waits for them, so misses and "
       "prefetches read while the host encodes; the same bytes and errors. Off, without a "
       "compiler, or with expert_io_direct: the Python pread workers")
define("expert_io_direct", False,
       "Linux: read experts with O_DIRECT into each worker's aligned buffer, then copy them into "
       "their slots, instead of through the page cache")

# --- kernels ------------------------------------------------------------------------------
define("kernel_sparse_attention", True,
       "sparse attention with sink through the custom GPU kernel (Metal/CUDA); off runs the "
       "plain-MLX reference")
define("attention_threadgroups", 256,
       "threadgroups the sparse-attention kernel aims for (its rows split between them, then "
       "merged): more keep a large GPU busy at decode, fewer make the merge cheaper", minimum=1)
define("kernel_attention_rows8", "auto",
       "sparse attention at decode (bf16, 256/512 dims) takes 8 rows per step per SIMD group (one "
       "transposed shuffle reduction for their dots, 16-byte loads of 512 consecutive bytes) and "
       "merges its splits over D/128 SIMD groups per head (dsv4/kernels/sparse_attention.py). auto "
       "(default): on under CUDA, where the slice's step at 512 took 2.60 ms against 2.70 on an H100 "
       "(benchmarks/results/2026-12-06-0355-slice-decode.md); off on Metal until a Mac measures it; "
       "on, off (the 4-row kernels)", choices=AUTO_ON_OFF)
define("kernel_moe", True,
       "routed + shared experts for 1-8 tokens through the fused GPU kernel; off runs the "
       "gather_qmm reference")
define("kernel_moe_dp4a", False,
       "GPU, with act_quant: the fused experts' gate/up launch over mxfp4 routed experts in an integer "
       "unit (dsv4/kernels/experts.py, MXFP4_INT): twice a code's value is an integer, x's fp8 values "
       "are integer limbs (as DSV4_KERNEL_GGUF_DP4A's units take them), so each pack's dot product is "
       "exact in DP4A and scaled once, where the float unit decodes every code to fp32 and multiplies "
       "(issue-bound at ~4.2 instructions a weight on the H200); within the fp32 bound, not the same "
       "bits. The mxfp8 shared expert keeps the float unit. Off (default): slower on an H100, the slice's "
       "step at 512 2.84 ms against 2.70 (benchmarks/results/2026-12-06-0355-slice-decode.md)")
define("kernel_moe_mma", False,
       "CUDA: the fused experts' gate/up and down launches make their mxfp4 routed slots on tensor "
       "cores (dsv4/kernels/experts_mma.py): bf16 mma.sync, the codes decoded with their group's "
       "power of two as the prefill's tensor-core launch decodes them (~2.7 instructions a weight "
       "against ~4.2), each lane's loads of several chunks issued together; the gate/up launch's "
       "threadgroups, x copy and epilogue, the down launch's 16 rows a threadgroup (the shared "
       "expert's rows_dot at 4 x 8). Exact products summed in fp32 in another order. Off (default): "
       "slower on the H200, gate/up 67.7 against 65.7 µs at one token and 175.9 against 165.0 at four, "
       "down 37.9 against 27.1 and 103.9 against 78.7, the slice's step 2.54 against 2.31 ms "
       "(benchmarks/results/2026-12-07-1709-experts-shapes-mma.md, 2026-12-07-1711-slice-decode.md); on")
define("kernel_moe_shared_splits", 1,
       "the fused experts' down launch: SIMD groups on the shared expert's rows, each a part of its "
       "inputs, beside one per routed expert, so that the threadgroup's slowest SIMD group is no "
       "longer the shared expert's alone (ds4's q2 recipe: its Q8_0 rows 2448 bytes against Q2_K's "
       "756; the official mxfp8 against mxfp4 about 2x); its parts are summed before the expert's "
       "rounding, within the fp32 bound of one group's sums. 1 (default): one SIMD group, as before; an "
       "H100 measured no gain at one token (q2's down 55.1 against 54.9 µs, mxfp4's 29.7 against "
       "30.1: the launch is bound by its instructions), 5% for q4 at 4-8 tokens (benchmarks/results/"
       "2026-12-06-0605-gguf-native.md). 0: the shared row's bytes over a routed row's, rounded "
       "(1-4); 2-4: that many",
       minimum=0)
define("kernel_qdq", True,
       "fp8 / fp4 rounding with power-of-two scales (matmul inputs, window KV, indexer q/k) in "
       "one GPU launch each, bit-identical; off runs the plain-MLX reference (~8 launches)")
define("kernel_rows", True,
       "fixed-shape decode: each projection's tail (RMSNorm, RoPE of the last dims, fp8/fp4 "
       "rounding) in one GPU launch instead of ~12 ops, and the cos/sin of each RoPE placement "
       "in one instead of 3; off runs the plain-MLX ops")
define("kernel_router", True,
       "MoE router for 1-8 tokens: the gate product from the bf16 input and weight in one GPU "
       "launch (the head kernel's; no fp32 cast or copy), then sqrt-softplus scores, biased top-k "
       "and the normalized weights in one more (~8 launches otherwise); off runs the plain-MLX ops")
define("kernel_moe_route", True,
       "the router's tail (scores, biased top-k, weights) inside the fused experts kernel's "
       "gate/up launch instead of a launch of its own (needs kernel_moe and kernel_router); "
       "the same code, so the same experts and weights")
define("kernel_indexer", True,
       "the indexer's scores of the compressed rows for 1-8 queries (products with every key, "
       "ReLU, head weights, visibility and candidate masks) in one GPU launch (~7 otherwise, "
       "with an fp32 copy of the keys); off runs the plain-MLX ops")
define("kernel_prefill_indexer", "auto",
       "a prefill chunk's indexer scores: the weighted ReLU of the queries' [heads, rows] products "
       "summed over heads in one launch over the matmul's output (dsv4/kernels/indexer.py "
       "HEAD_SUM_KERNEL), where plain MLX reads and writes the fp32 products three times (max, "
       "multiply, sum); the same products, the heads summed in another fp32 order. auto (default): "
       "on under CUDA, where an H100's slice prefilled 32K tokens at 20746 tokens/s against 15633 "
       "and 4K at 26334 against 25012 (benchmarks/results/2026-12-07-1028-slice-prefill.md); off on "
       "Metal until a Mac measures it; on, off", choices=AUTO_ON_OFF)
define("kernel_topk", True,
       "the indexer's top-k rows (ties to the lower row) and their visibility for 1-8 queries in "
       "one GPU launch by radix selection (~4 launches otherwise, the partition a full sort); "
       "off runs the plain-MLX ops")
define("kernel_prefill_rows", "auto",
       "a prefill chunk (the reference path, more than one position) runs its projection tails "
       "(norm, RoPE of the last dims, fp8/fp4 rounding) and the attention output's inverse RoPE "
       "as dsv4/kernels/rows.py launches with each position's angles ([S, R] from one launch), as "
       "the fixed-shape step does, instead of plain-MLX ops (RoPE: fp32 casts and transposes of "
       "the whole [S, 64, 512] queries and output). The same roundings; cos/sin and the norm's "
       "fp32 sums as the kernels compute them. auto (default): on under CUDA, where with "
       "DSV4_KERNEL_MHC_TILES and DSV4_KERNEL_PREFILL_ATTENTION_STAGED the slice prefilled 4K at 22019 "
       "tokens/s against 20511 with the staged attention alone on an H100 (32K: 15406 against 15415; "
       "benchmarks/results/2026-12-07-0742-slice-prefill.md); off on Metal until a Mac runs it; on, off",
       choices=AUTO_ON_OFF)
define("kernel_rows_positions", True,
       "a fixed-shape step of several positions (DSpark's verify, a draft block) runs its "
       "projection tails (norm, RoPE, rounding) as dsv4/kernels/rows.py kernels with each "
       "position's angles ([S, R] from one launch), and its attention rotates queries and output "
       "inside the kernel, as a one-position step does: a 4-position verify of the slice launches "
       "187 kernels instead of 345 (a plain step 155; benchmarks/gpu_path.py --positions) and took "
       "6.14 ms instead of 6.43 on the H200 (2026-12-03-1746-speculative-steps.md). Off: plain "
       "ops for those tails, as before")
define("kernel_matvec", "auto",
       "quantized projections of 1-8 tokens (mxfp8/mxfp4/affine) with the fp8 input rounding "
       "fused, through the custom GPU matvec kernel: auto (default) where it measured faster than "
       "rounding + MLX's quantized_matmul on the H200, i.e. an input still to be rounded and >= "
       "2048 rows (wo_b: 31.5 vs 37.6 µs, benchmarks/results/2026-11-29-1815-kernels-matvec-h200.md); "
       "on: every such projection; off: quantized_matmul", choices=AUTO_ON_OFF)
define("kernel_prefill_experts_mma", "auto",
       "CUDA: the routed experts of a prefill chunk (MX layouts, bf16) on tensor cores, a "
       "threadgroup per 32 pairs of one expert and 64 rows (dsv4/kernels/experts_prefill.py), "
       "instead of MLX's gather_qmm. auto (default): under CUDA for chunks whose experts average a "
       "full tile (32 pairs an expert: 2048 tokens at V4.1's top-6 of 384), where it took 7.0 ms "
       "against 11.6 a projection (benchmarks/results/2026-12-04-0831-prefill-matmuls.md) and, "
       "with the CUDA defaults of the prefill chunk, its evaluation and the attention kernel, "
       "the slice's 32K prefill 3.31 s against 3.85 without both kernels "
       "(2026-12-04-0848-slice-prefill.md); with chunks of 512 (8 pairs an expert) it was "
       "slower (5.84 s against 5.16); on: from 64 pairs; off", choices=AUTO_ON_OFF)
define("kernel_prefill_experts_bf16", "auto",
       "CUDA, with DSV4_KERNEL_PREFILL_EXPERTS_MMA: the launch's mma in bf16, where each weight "
       "times its group's scale and each value of x are exact, so the tensor core sums a pair's "
       "row over the whole input with no per-group scaling, and tiles of 64 pairs by 128 rows "
       "(dsv4/kernels/experts_prefill.py KERNEL_BF16; matrices of 32 rows or more). Exact products summed in fp32 as before, in another order. auto (default): on, where an H100 "
       "took 2.91 ms against 4.70 for gate 5120->2304 at 2048 tokens, 2.77 against 4.62 for down "
       "(benchmarks/results/2026-12-06-0352-prefill-matmuls.md), and the slice's prefill ran 16493 "
       "tokens/s against 12858 at 4K, 12944 against 10644 at 32K (2026-12-06-0353-slice-prefill.md); "
       "on, off (the fp16 launch)", choices=AUTO_ON_OFF)
define("kernel_prefill_experts_stream", "auto",
       "CUDA, with DSV4_KERNEL_PREFILL_EXPERTS_BF16: its tiles and exact products fed without "
       "waiting (dsv4/kernels/experts_prefill.py KERNEL_STREAM): a lane loads a whole group of each "
       "of its rows in 16-byte words a chunk ahead, and each chunk's x comes by cp.async into one of "
       "two buffers while the chunk before multiplies, where the bf16 launch waits out a load's "
       "latency every group and chunk. The same products summed in fp32 in another order. auto "
       "(default): on under CUDA, where an H100 took 2.49 against 3.41 ms for the gate at 2048 "
       "tokens, 3.07 against 4.65 at 4096, down 2.39 against 3.20 and 3.10 against 4.58 "
       "(benchmarks/results/2026-12-06-2006-prefill-matmuls.md), and the slice prefilled 4K tokens "
       "at 17692 tokens/s against 16016, 32K at 13594 against 12628 (2026-12-06-2007-slice-prefill.md); "
       "on; off (the bf16 launch)", choices=AUTO_ON_OFF)
define("kernel_prefill_attention_mma", "auto",
       "CUDA: prefill's sparse attention (more queries than the decode kernel takes, bf16) on tensor "
       "cores, a threadgroup per query and 16 heads streaming the query's rows into bf16 mma.sync "
       "(dsv4/kernels/attention_prefill.py), instead of the reference's per-query gathers of fp32 "
       "rows; the same roundings, another fp32 summation order. auto (default): on under CUDA, "
       "where it took 6.98 ms against 16.96 for 2048 queries (benchmarks/results/"
       "2026-12-04-0831-prefill-matmuls.md) and the slice's 4K prefill 0.49 s against 0.54 "
       "(2026-12-04-0848-slice-prefill.md); on, off", choices=AUTO_ON_OFF)
define("kernel_attention_staged_decode", False,
       "CUDA: decode's sparse attention (a verify's too) on tensor cores: the prefill's staged launch "
       "with each query's rows split over threadgroups of all its heads, 32 rows each, kept in "
       "threadgroup memory for both passes (dsv4/kernels/attention_decode_staged.py), then the 8-row "
       "merge, instead of the 8-row kernel's SIMD group per head (33 µs a layer under ncu on an H100, "
       "latency-bound). The 8-row kernels' roundings, another fp32 summation order. Off (default): "
       "the H200's step 2.42 against 2.31 ms at 512, 2.65 against 2.54 at 8K "
       "(benchmarks/results/2026-12-07-1711-slice-decode.md); on")
define("kernel_prefill_attention_staged", "auto",
       "CUDA: prefill's sparse attention with a threadgroup per query and all its heads (up to 64), "
       "the query's rows staged once in threadgroup memory by cp.async for every head, the scores "
       "recomputed in a second pass instead of stored (dsv4/kernels/attention_prefill_staged.py), "
       "instead of kernel_prefill_attention_mma's threadgroup per 16 heads, which reads each row from "
       "L2 once per 16 heads and pass. The same roundings, another fp32 summation order. auto "
       "(default): on under CUDA, where the slice prefilled 4K at 20511 tokens/s against 19000 and 32K "
       "at 15415 against 14523 on an H100 (benchmarks/results/2026-12-07-0742-slice-prefill.md); on, off",
       choices=AUTO_ON_OFF)
define("kernel_matvec_long_threadgroups", "auto",
       "the one-token matvec launch (DSV4_KERNEL_MATVEC; GGUF blocks always): fewer, longer "
       "threadgroups, since each copies and rounds the whole x before its first load: K split over "
       "SIMD groups only while a row a SIMD group leaves fewer than 32 threadgroups, and 4 or 2 rows "
       "a SIMD group while that leaves 32 (dsv4/kernels/matvec.py work_split). On an H100, one "
       "token: wq_a 8.0-8.2 against 12.0-12.3 µs (mxfp8, Q8_0), wkv 7.5-8.4 against 10.3-10.4 "
       "(benchmarks/results/2026-12-06-1429-matvec-split.md); off: K split while fewer than 2048 rows "
       "are in flight, 4 or 2 rows while 128 threadgroups remain. auto (default): on under CUDA, off "
       "on Metal until a Mac measures it; on, off", choices=AUTO_ON_OFF)
define("kernel_matvec_joined", False,
       "a one-token step's projections of one input that take the matvec kernel together (wq_a and "
       "wkv: mxfp8 or GGUF Q8_0, the same width in) as one launch over their rows stacked, where MLX's "
       "quantized_matmul (or the kernel) runs them one launch each: a launch a layer fewer in a step "
       "whose host encodes ~10 µs a launch. The rows are laid out once, on first use, as one matrix "
       "of which each layer keeps a view (no memory added); each output row is the kernel's dot "
       "product of that row (fp32, within the summation bound of MLX's). Off (default): an H100 timed "
       "it with DSV4_KERNEL_MOE_NEXT_PROJECTION at 2.42 against 2.39 ms a step, 13 launches fewer "
       "(benchmarks/results/2026-12-07-0744-slice-decode.md); on")
define("kernel_matvec_tail", False,
       "CUDA, the fixed-shape step (1-8 tokens): wq_a and wkv each with its tail in one launch "
       "(dsv4/kernels/matvec_tail.py): the matvec kernel's rows, then the last of a token's "
       "threadgroups to finish takes its row through the row-tail stages (q_norm and the fp8 "
       "rounding; kv_norm, RoPE and the fp8 rounding), where a matvec launch and a row-tail launch "
       "ran each: two launches a layer fewer, the same values in the same order. Off (default) "
       "until a GPU has timed it; on")
define("kernel_matvec_tokens", False,
       "GPU projections of 2-6 tokens (a DSpark verify, a batch of sessions) that take the matvec "
       "kernel (DSV4_KERNEL_MATVEC; GGUF blocks always) in one pass over the weight: each "
       "threadgroup decodes its rows' packs or GGUF units once and multiplies them by every token's "
       "x, staged 1024 values at a time for all the tokens, where the one-token launch decodes every "
       "weight once a token (at eight tokens ~4x one token's time on the H200, the GGUF Q8_0 ones "
       "4-5x: benchmarks/results/2026-12-04-1903-gguf-native.md). MLX's packs: the same sums in the "
       "same order, and the grouped wo_a too, in place of gather_qmm; GGUF rows (ds4's dense Q8_0, the grouped wo_a too, and the integer units of "
       "DSV4_KERNEL_GGUF_DP4A): the same where a unit is 32 values, else within the fp32 bound "
       "(dsv4/kernels/matvec.py, gguf_dot.py's TokensDot; statically 1.8-2.7x fewer instructions a "
       "weight a token at 4 tokens: benchmarks/results/2026-12-05-0150-gguf-tokens-static.md). Off "
       "(default): its gains at a verify so far are small against the noise (the H200: verify(3) "
       "5.40 -> 4.91 ms, verify(5) 6.98 -> 6.51, verify(2) and (4) unchanged, "
       "2026-12-05-0507-verify-matvec-tokens.md; an H100 with DSV4_KERNEL_MATVEC=on: verify(4) 6.35 "
       "against 6.82, 2026-12-06-0552-verify-matvec.md)")
define("kernel_gguf_dp4a", "auto",
       "GPU: the fused experts' gate/up launch over IQ2_XXS, Q4_K, Q2_K or Q8_0 routed experts with a "
       "Q8_0 (or no) shared expert (ds4's q2 and q4 recipes), and the GGUF matvec over Q8_0, IQ2_XXS, "
       "Q4_K or Q2_K projections (ds4's dense ones are Q8_0), under act_quant: x's fp8-rounded values "
       "copied as integers (e4m3 * 2^9, three signed bytes each, and the sums of each 8 and 32 for the "
       "K-quants' mins) and each unit's dot product made exactly in integers, four values a DP4A "
       "(IQ2_XXS's signs put on its grid bytes by byte masks it computes), converted to fp32 once a "
       "sub-block (32 values; Q2_K's 16): within the fp32 summation bound of the reference. auto (default): under CUDA for Q4_K, Q8_0 "
       "and IQ2_XXS, where the H200 measured ds4's q4 gate/up at 64.7 against 95.3 µs at one token and 292 "
       "against 555 at eight, and the dense Q8_0 matvec as fast or faster at every shape (5120 x 8192: "
       "27.0 against 31.2 µs at one token, 102 against 131 at eight; benchmarks/results/"
       "2026-12-05-0503-gguf-native.md), and an H100 ds4's q2 gate/up at 77.0 against 81.1 µs at one "
       "token and 351 against 391 at eight (2026-12-06-0829-gguf-native.md: since IQ2_XXS's unit computes "
       "its sign masks, where it gathered them from a 2 KB table and lost to the halves units); "
       "on: every type with an integer unit; off", choices=AUTO_ON_OFF)
define("kernel_gguf_dp4a_down", False,
       "GPU: the fused experts' down launch over GGUF Q2_K, Q4_K or Q8_0 routed experts with a Q8_0 (or "
       "no) shared expert (ds4's q2 and q4 recipes) in the integer units of DSV4_KERNEL_GGUF_DP4A, under "
       "act_quant: the gate/up launch writes each fp8 block of h as the integer limbs the units read "
       "(dsv4/kernels/experts.py's STORE_LIMBS; 176 bytes a block for bf16's 64), where the down "
       "launch read bf16 h and the float units; within the fp32 summation bound of the reference. "
       "Off (default): the H200 measured Q4_K's down 36.8 against 43.9 µs at one token (202 against "
       "220 at eight) but Q2_K's 42.4 against 41.7 (245 against 219), and the q4 slice's A/B within "
       "its noise (benchmarks/results/2026-12-05-1229-gguf-native.md, 2026-12-05-1232-slice-decode-q4-q8_0.md)")
define("kernel_gguf_q8_pairs", False,
       "GPU kernels over GGUF Q8_0 rows (the dense projections and shared experts of ds4's files) "
       "read two blocks at a time: 68 bytes from a 4-byte boundary in 17 u32 loads, where one block "
       "takes 17 u16 loads (dsv4/kernels/gguf_dot.py); the same values and sums. Off (default): no "
       "faster on the H200 (q2's experts 214.9 µs against 219.3 with the plain units, q4's 228.4 "
       "against 221.5, a 5120x8192 matvec 72.4 against 60.0: "
       "benchmarks/results/2026-12-03-1318-gguf-native.md); a Mac has not measured it")
define("kernel_gguf_wide", "auto",
       "GPU kernels over GGUF rows read Q8_0, IQ2_XXS and Q2_K blocks with 16-byte loads of the "
       "aligned words that hold them, realigned in registers (3 loads a Q8_0 block where it took 17; "
       "IQ2_XXS 3 + 4 grid loads per 32 weights where it took 5 + 8, its signs computed), "
       "dsv4/kernels/gguf_dot.py; the same values. auto (default): on CUDA, where the H200 measured "
       "the fused experts at one token 199 vs 219 us (q2) and 201 vs 222 us (q4), bit-identical "
       "(benchmarks/results/2026-12-03-1318-gguf-native.md); off on Metal until a Mac measures it; "
       "on, off. Takes precedence over DSV4_KERNEL_GGUF_Q8_PAIRS", choices=AUTO_ON_OFF)
define("kernel_gguf_q8_hsub", "auto",
       "GPU kernels over GGUF Q8_0 rows in the wide unit (DSV4_KERNEL_GGUF_WIDE) take the int8s' bias "
       "of 128 off two at a time in fp16 (1024 + u less 1152, exact), where each took an fp32 "
       "subtraction after widening (dsv4/kernels/gguf_dot.py int8s2): the same values and sums, "
       "1633 against 1761 SASS instructions a lane's unit of the q2 gate/up's Q8_0 slot. auto "
       "(default): on CUDA, where the H200 measured the q2 experts 114 vs 118 us at one token and "
       "617 vs 633 at eight, the dense 1280 x 5120 matvec 22 vs 26 us, bit-identical "
       "(benchmarks/results/2026-12-04-1903-gguf-native.md); off on Metal until a Mac measures it; "
       "on, off", choices=AUTO_ON_OFF)
define("kernel_gguf_halves", "auto",
       "GPU kernels over GGUF rows make the codes fp16 subnormals, their scales carrying the 2^24 "
       "(dsv4/kernels/gguf_dot.py): IQ2_XXS's grid entry read as such pairs from a table and each word's "
       "two signs put on by one multiply, two signed weights a conversion, where the wide unit flips "
       "x's sign per value; Q2_K's and Q4_K's codes without the "
       "1024 offset and its subtraction. The same products and sums, so the same outputs; IQ2_XXS and "
       "Q2_K on the wide units' loads (DSV4_KERNEL_GGUF_WIDE). auto (default): on CUDA, where the H200 "
       "measured the fused experts 216 vs 231 us (q2) and 206 vs 214 (q4) at one token, 751 vs 821 and "
       "835 vs 864 at eight, bit-identical, and the q2 slice 2.82 vs 2.99 ms/token "
       "(benchmarks/results/2026-12-03-2111-gguf-native.md), and with the table of pairs the q2 gate/up "
       "463 vs 543 us at eight tokens, the same at one (2026-12-04-1623-gguf-halves-iq2.md); off on Metal until a Mac measures it; on, off",
       choices=AUTO_ON_OFF)
define("kernel_swiglu", "auto",
       "the experts' hidden activation where the fused decode kernel does not make it (prefill "
       "chunks, the routed pairs sorted by expert): the clamped SwiGLU, the router weight, the "
       "rounding to the activation dtype and to fp8 in one launch (dsv4/kernels/swiglu.py), "
       "where plain MLX makes ~10 launches over fp32 copies; silu as the decode kernel computes "
       "it, so a value may round one bf16 (fp8) step from the reference's. auto (default): on "
       "under CUDA, where an H100's slice prefilled 4K tokens at 24898 tokens/s against 23690 and "
       "32K at 16651 against 16552 (benchmarks/results/2026-12-07-1016-slice-prefill.md); off on "
       "Metal until a Mac measures it; on, off", choices=AUTO_ON_OFF)
define("kernel_head", True,
       "fp32 logits of 1-8 tokens from the bf16 head in one pass through a custom GPU kernel (also "
       "the compressors' fp32 kv and gate inputs, both in one launch); off runs x_fp32 @ W.T, for "
       "which MLX converts the whole head to an fp32 temporary every step")
define("kernel_first_launch_check", "auto",
       "run each kernel instantiation's first launch at its call, so that a kernel MLX cannot "
       "build or launch falls back to its plain-MLX reference with one warning (MLX builds a "
       "custom kernel at its first eval, after the call): auto = on for Metal, where no kernel "
       "has run before a user's Mac, off for CUDA (its kernels are checked on the H200; the one "
       "H200 run with it on warned of a fallback in tests/test_model_gpu.py, not yet explained)",
       choices=AUTO_ON_OFF)
define("kernel_cache", "auto",
       "CUDA: build each custom kernel once with NVRTC into MLX's disk cache ($MLX_PTX_CACHE_DIR; "
       "auto (default) points it at ~/.cache/dsv4/cuda-kernels/mlx-<version>-<gpu> unless set, or "
       "give a directory), so later processes load it instead of compiling it again (MLX never "
       "writes custom kernels there): a second start's warm-up 1.9 s instead of 36 s on the H200 "
       "slice (benchmarks/results/2026-12-02-0406-cold-start.md), and the kernels a step first "
       "asks for build in parallel; off: MLX builds them in every process, one at a time "
       "(dsv4/kernels/cuda_cache.py)")
define("kernel_source_files", "auto",
       "CUDA: each custom kernel's header and body reach MLX as two #include lines of files named "
       "by their content (beside the kernel cache, else in /tmp; dsv4/kernels/source_files.py), not "
       "inline: MLX hashes a kernel's whole source at every launch, ~0.28 µs a KB on an H100's host "
       "(a 30 KB source 14.5 µs to encode against 6.0; the notes of benchmarks/results/2026-12-06-1138-primitive-cost.md), "
       "~580 KB a decode step. The same text compiled. auto (default): on; on, off (inline)",
       choices=AUTO_ON_OFF)
define("kernel_mhc", True,
       "mHC mixes (Sinkhorn), collapse+RMSNorm and expand through custom GPU kernels; off runs "
       "the plain-MLX reference")
define("kernel_mhc_wide", "auto",
       "decode (1-8 tokens): each mHC site entry's two launches spread a token over the whole GPU "
       "(partials of the projection and collapse on D/32 SIMD groups, the expand's included; then "
       "the RMSNorm over D/256 threadgroups beside the Sinkhorn's), where they ran on one SM per "
       "token at ~15-20 µs each; the same roundings. auto (default): on under CUDA, where the slice's "
       "step at 512 took 2.52 ms against 2.70 on an H100, and 2.42 against 2.72 with "
       "DSV4_KERNEL_ATTENTION_ROWS8 (benchmarks/results/2026-12-06-0355-slice-decode.md, "
       "2026-12-06-0357-slice-decode.md); off on Metal until a Mac measures it; on, off",
       choices=AUTO_ON_OFF)

define("kernel_moe_next_projection", False,
       "decode (the wide mHC entry, DSV4_KERNEL_MHC_WIDE): the experts' down launch, which expands "
       "the FFN site's streams, also makes the next layer's attention-site entry partials (its "
       "projection, sums of squares and collapse, as the partials launch makes them), so that entry "
       "is one launch, its finish: a launch a layer fewer, where no Engram lies between the layers. "
       "The collapse is the partials launch's arithmetic; the projection sums in another fp32 "
       "order. Off (default): an H100 timed it with DSV4_KERNEL_MATVEC_JOINED at 2.42 against 2.39 ms "
       "a step (benchmarks/results/2026-12-07-0744-slice-decode.md); on")

define("kernel_mhc_tiles", "auto",
       "prefill (64 tokens or more): an mHC site's projection (the mixes' 24 dot products over the "
       "4 x 5120 streams) by threadgroups of 4 tokens, each thread loading the 2 MB fp32 projection "
       "matrix's values at its columns once for the 4, where a threadgroup per token reads all of "
       "it per token (the expand's fused projection too, which then leaves it to the next site's "
       "entry); the same sums in the same order. auto (default): on under CUDA (with "
       "DSV4_KERNEL_PREFILL_ROWS: see it for the H100's numbers); off on Metal until a Mac measures "
       "it; on, off", choices=AUTO_ON_OFF)

# --- decode loop ----------------------------------------------------------------------------
define("fixed_decode", "auto",
       "decode one token per step at fixed shapes (dsv4/step.py): window and compressor inputs "
       "in rings, compressed rows in buffers of doubling capacity, positions as device arrays, "
       "so one graph (compiled with DSV4_COMPILE) serves every step: auto (on for GPU "
       "backends; the CPU keeps the reference path, whose results do not depend on chunking), "
       "on, off", choices=AUTO_ON_OFF)
define("fixed_verify", "auto",
       "speculative decoding's verify (and its plain steps) at fixed shapes: the draft's k + 1 "
       "positions in one compiled step over the fixed-shape decoder's buffers, rejected "
       "positions rewound (dsv4/step.py FixedDecoder.feed); auto (wherever DSV4_FIXED_DECODE is "
       "on), on, off (the reference forward over the Cache, 4.2x a plain step on the H200 "
       "slice: benchmarks/results/2026-12-02-0406-speculative-steps.md)", choices=AUTO_ON_OFF)
define("fixed_propose", "auto",
       "speculative decoding's propose at fixed shapes: the draft stages, the head, the Markov "
       "picks and the confidence as one compiled graph per k over the draft window in rings, "
       "seeded with every verified row before the acceptance is known, so a cycle reaches the "
       "host once (dsv4/draft_step.py); exact against the op-by-op propose, on the H200 slice "
       "3.2-3.45 ms against 6.2-6.5 (benchmarks/results/2026-12-03-1500-speculative-steps.md), "
       "1.6-1.7x cheaper on the CPU (2026-12-03-1244-speculative-steps-demo.md): auto (default: "
       "wherever DSV4_FIXED_DECODE is on), on, off (op by op over the DraftCache)", choices=AUTO_ON_OFF)
define("draft_pipeline", True,
       "speculative decoding over the fixed-shape propose (DSV4_FIXED_PROPOSE) queues the next "
       "cycle's propose behind the verify, from the acceptance on the device (the window's end "
       "and the pending token as device arrays), before the host waits for that acceptance: the "
       "device runs the propose while the host reads the acceptance and queues the next verify, "
       "where the propose's encoding waited for the acceptance. The same tokens (sampled: the "
       "same draws). On (default): the H200 slice's cycle 7.44 -> 6.20 ms at k = 1, 9.22 -> 8.13 at "
       "k = 3, 12.01 -> 9.59 at k = 5 (benchmarks/results/2026-12-05-1236-speculative-steps.md); "
       "off waits first")
define("batch_fixed_decode", "auto",
       "sessions decoded together (the server's batch) at fixed shapes, one compiled graph for "
       "the batch (dsv4/batch_step.py): auto (wherever DSV4_FIXED_DECODE is on), on, off (one "
       "forward of the reference path, dsv4/batch_decode.py)", choices=AUTO_ON_OFF)
define("async_decode", True,
       "build and queue the next decode step before the current token reaches the host "
       "(one step in flight, as mlx-lm does); off waits for each token first")
define("encode_thread", False,
       "with async_decode, MLX encodes each queued decode step (mx.async_eval, ~10 us a primitive) "
       "on a thread of its own while the loop builds the next step's graph (dsv4/encode_thread.py): "
       "a host-bound step costs the longer of the two instead of their sum; the same tokens. "
       "The fixed-shape step, whole or in Engram pieces (the tokens Engram hashes and each piece "
       "go through the thread), in one process; not around streamed experts' lookups. "
       "Off until a GPU has timed it")
define("engram_pieces", True,
       "with Engram, run the compiled fixed-shape step (decode, a speculative verify, the server's "
       "batch) as pieces queued one by one (dsv4/step_pieces.py): the layers before the first "
       "Engram layer are queued before the step's tokens reach the host for hashing, the rest in "
       "runs built while the device runs the one before, so the device no longer idles through "
       "the hashing, the reads and the whole graph's replay every token; the same logits. On "
       "(default): the H100 slice with Engram 8.81 -> 7.94 ms/token at 512, 7.65 -> 7.05 at 8K "
       "(benchmarks/results/2026-12-05-1513-slice-decode-engram.md). Off: one graph, queued after "
       "the reads")
define("engram_queued", False,
       "read a decode step's Engram rows inside its graph (dsv4/engram_queued.py): the row ids "
       "hashed on the device, the rows read by a native MLX primitive (pread on C++ threads, no "
       "GIL; dsv4/native builds it on first use with the C++ compiler), so the whole step is "
       "queued before its token is known and the device, not the host, waits for the reads; the "
       "same rows and logits. The reads run on a CPU stream, or on CUDA (whose CPU-stream events "
       "synchronize the device: the slice hung, benchmarks/results/"
       "2026-12-05-1740-engram-queued-cuda.md) as a host function in the step's stream, built "
       "with CUDA's headers (dsv4/native/reads_cuda.h). Off (default): an H100 timed the Engram "
       "slice 5.75 against 5.84 ms/token at 512, the ranges overlapping, without recording which "
       "reads ran (benchmarks/results/2026-12-06-0630-slice-decode-engram.md). "
       "Without the build (on CUDA: its CUDA part), or with engram_resident or engram_row_cache, "
       "the rows are read on the host (engram_pieces)")
define("compile", True,
       "mx.compile the fixed-shape decode step whole and the small fixed-shape pieces of the "
       "reference path (mHC mixes with their Sinkhorn rounds, QDQ); off runs them op by op")

# --- speculative decoding (dsv4/speculative.py) -----------------------------------------------
define("draft", "off",
       "DSpark speculative decoding with the checkpoint's own draft stages (mtp.*): off (the "
       "stages are not loaded), on (verify every draft block, DSV4_DRAFT_K drafts each), auto "
       "(choose k from the measured acceptance and step times, and decode plainly while "
       "drafting does not pay); greedy output is identical to plain decode, sampled output "
       "has the same distribution", choices=("off", "on", "auto"))
define("draft_k", 5,
       "the most drafts verified per step (the draft block holds dspark_block_size, 5 in V4.1)",
       minimum=1)
# generate's, chat's and the server's options for them (from_options)
OPTION_HELP = {"draft": "speculative decoding with the checkpoint's DSpark draft stages: off, on or auto "
                        "(default DSV4_DRAFT)",
               "draft_k": "the most drafts verified per step (default DSV4_DRAFT_K)"}

# --- profiling ----------------------------------------------------------------------------
define("stage_profile", False,
       "time every stage of each decode step (dsv4/profiler.py) and print the table at the end; "
       "each stage boundary forces a sync, so decode gets slower")


if __name__ == "__main__":
    print(describe())
