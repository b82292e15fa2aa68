"""Every launch the kernel dispatchers make at V4.1's widths, checked against the GPU's limits.

A kernel that compiles can still be refused at its first launch: more threadgroup memory than
the GPU has (Apple GPUs: 32 KB), more than 1024 threads in a threadgroup, or SIMD groups that
are not whole (the bodies take lane = tid & 31 and reduce over 32 lanes). MLX finds out only
at eval, on the user's machine. Here, on any machine, the dispatchers are called at V4.1's
shapes (1-8 tokens, as a decode step or a draft verification has them) while they see a Metal
and then a CUDA backend (dialect.pretend_gpu); each launch they make is recorded, not run,
and must keep, for its backend (the numbers are dialect's):

  threadgroup memory  the sum of the body's `SHARED type name[n]...;` arrays (n evaluated
                      with the launch's template values and the header's and body's
                      `constexpr int`s),
                      each rounded up to 16 bytes, <= SHARED_MEMORY_BYTES[backend]
  threads             threadgroup x * y * z <= MAX_THREADS
  SIMD groups         threadgroup (a multiple of SIMD_WIDTH, 1, 1), grid whole threadgroups

    python tools/launch_limits.py      # also run by tools/metal_syntax_check.py
"""

from __future__ import annotations

import ast
import math
import operator
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv4 import flags  # noqa: E402
from dsv4.kernels import dialect  # noqa: E402
from dsv4.kernels.dialect import Kernel, compact  # noqa: E402

TOKENS = range(1, 9)
CONTEXT = 65536          # decode position: the compressed rows a layer attends over
PREFILL_TOKENS = 512     # a prefill chunk (dsv4.generation.PREFILL_CHUNK)
CUDA_PREFILL_TOKENS = 4096   # CUDA's (dsv4.generation.CUDA_PREFILL_CHUNK)
MAX_GROUPS_YZ = 65535    # threadgroups a CUDA grid may have on y and on z
_ELEMENT_BYTES = {"float": 4, "int": 4, "uint": 4, "uint32_t": 4, "int32_t": 4, "float2": 8,
                  "uint4": 16, "float4": 16, "half": 2, "bfloat16_t": 2, "uint16_t": 2, "uint8_t": 1, "bool": 1}
_ARRAY = re.compile(r"\bSHARED(_ATOMIC_U32|\s+\w+)\s+(\w+)((?:\s*\[[^\]]+\])+)\s*;")
_CONSTEXPR = re.compile(r"\bconstexpr\s+int\s+(\w+)\s*=\s*([^;]+);")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


@dataclass(frozen=True)
class Launch:
    kernel: Kernel
    dialect: str
    grid: tuple
    threadgroup: tuple
    template: tuple

    def __str__(self) -> str:
        values = ", ".join(f"{n}={v}" for n, v in self.template if isinstance(v, int))
        return f"{self.kernel.name} [{self.dialect}] grid {self.grid} threadgroup {self.threadgroup} ({values})"


def _integer(expr: str, names: dict) -> int:
    """A C integer expression of names (non-negative operands: / is floor division)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return int(node.value)
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"cannot evaluate {expr!r} (names: {sorted(names)})")
    text = re.sub(r"\b(\d+)[uU]\b", r"\1", expr).replace("/", "//")
    return value(ast.parse(text, mode="eval").body)


def threadgroup_bytes(kernel: Kernel, template) -> int:
    """Threadgroup memory the body declares for these template values."""
    body = compact(kernel.body)
    names = {"true": 1, "false": 0}
    names.update({n: int(v) for n, v in template if isinstance(v, int)})
    # The header's constants, then the body's; a constant no array size needs may fail to evaluate
    # (a header helper's own ones may be C beyond _integer's arithmetic).
    for text, skipped in ((compact(kernel.header), (ValueError, SyntaxError)), (body, ValueError)):
        for name, expr in _CONSTEXPR.findall(text):
            try:
                names[name] = _integer(expr, names)
            except skipped:
                pass
    types = {n: v for n, v in template if not isinstance(v, int)}
    total = 0
    for kind, name, dims in _ARRAY.findall(body):
        kind = kind.strip()
        if kind == "_ATOMIC_U32":
            element = 4
        elif kind in types:
            element = types[kind].size
        elif kind in _ELEMENT_BYTES:
            element = _ELEMENT_BYTES[kind]
        else:
            raise ValueError(f"{kernel.name}: threadgroup array {name} of unknown type {kind}")
        count = math.prod(_integer(d, names) for d in re.findall(r"\[([^\]]+)\]", dims))
        total += -(-count * element // 16) * 16
    return total


def problems(launch: Launch) -> list[str]:
    """What in `launch` its backend would refuse or the body's SIMD code would get wrong."""
    out = []
    shared, limit = threadgroup_bytes(launch.kernel, launch.template), dialect.SHARED_MEMORY_BYTES[launch.dialect]
    if shared > limit:
        out.append(f"{shared} bytes of threadgroup memory, more than {limit}")
    threads = math.prod(launch.threadgroup)
    if threads > dialect.MAX_THREADS:
        out.append(f"{threads} threads per threadgroup, more than {dialect.MAX_THREADS}")
    if launch.kernel.max_threads and threads > launch.kernel.max_threads:
        out.append(f"{threads} threads per threadgroup, more than its launch bounds ({launch.kernel.max_threads})")
    if launch.threadgroup[0] % dialect.SIMD_WIDTH or tuple(launch.threadgroup[1:]) != (1, 1):
        out.append(f"threadgroup {launch.threadgroup} is not ({dialect.SIMD_WIDTH} k, 1, 1): "
                   f"a SIMD group would be partial")
    if any(g % t for g, t in zip(launch.grid, launch.threadgroup)):
        out.append(f"grid {launch.grid} is not whole threadgroups of {launch.threadgroup}")
    if max(launch.grid[1:]) > MAX_GROUPS_YZ:
        out.append(f"grid {launch.grid}: more than {MAX_GROUPS_YZ} threadgroups on y or z")
    return [f"{launch}: {p}" for p in out]


def record(dialect_name: str, calls) -> list[Launch]:
    """The launches `calls()` makes while dispatchers see `dialect_name`'s GPU (outputs are zeros)."""
    launches = []

    def launch(kernel, *, output_shapes, output_dtypes, grid, threadgroup, template, **_):
        launches.append(Launch(kernel, dialect_name, tuple(grid), tuple(threadgroup), tuple(template)))
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    with dialect.pretend_gpu(dialect_name, launch):
        calls()
    return launches


def _zeros(*shape, dtype=mx.bfloat16):
    return mx.zeros(shape, dtype)   # lazy: never evaluated, so any width costs nothing


def _mx_matrix(shape, mode):
    from dsv4.kernels.experts import QuantizedMatrix

    bits = {"mxfp4": 4, "mxfp8": 8}[mode]
    *lead, rows, cols = shape
    return QuantizedMatrix(_zeros(*lead, rows, cols * bits // 32, dtype=mx.uint32),
                           _zeros(*lead, rows, cols // 32, dtype=mx.uint8), None, 32, bits, mode)


def _gguf_matrix(shape, qtype):
    from dsv4.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS
    from dsv4.kernels.gguf_dot import GGUFMatrix

    *lead, rows, cols = shape
    return GGUFMatrix(_zeros(*lead, rows, cols // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype], dtype=mx.uint8), qtype)


# (routed experts, shared expert and dense projections) of ds4's GGUF recipes
GGUF_RECIPES = (("IQ2_XXS", "Q8_0"), ("Q2_K", "Q4_K"), ("Q4_K", "Q8_0"))


def v41_calls():
    """Each dispatcher with a custom kernel, at V4.1's widths: what the model's decode and
    draft-verification steps call, with the official checkpoint's layouts (experts mxfp4,
    dense projections mxfp8) and ds4 GGUFs' (GGUF_RECIPES)."""
    from benchmarks.slice_decode import REAL, ROLES
    from dsv4.config import ModelArgs
    from dsv4.kernels import (experts, experts_prefill, head, indexer, matvec, matvec_tail, mhc, rows,
                              sparse_attention, swiglu, topk)
    from dsv4.kernels.router import route
    from dsv4.model import Model
    from dsv4.quant import qdq_fp4_pow2, qdq_fp8

    a = ModelArgs.from_dict({**REAL, **ROLES})
    D, hc, H, Dh, R = a.hidden_size, a.hc_mult, a.num_attention_heads, a.head_dim, a.qk_rope_head_dim // 2
    E, k, I = a.n_routed_experts, a.num_experts_per_tok, a.moe_intermediate_size
    nm = hc * (2 + hc)
    projections = {tuple(m.weight.shape) for _, m in Model(a).named_modules()
                   if isinstance(m, nn.Linear) and "bias" not in m}
    layouts = [(lambda shape: _mx_matrix(shape, "mxfp4"), lambda shape: _mx_matrix(shape, "mxfp8"))]
    layouts += [(lambda shape, r=r: _gguf_matrix(shape, r), lambda shape, d=d: _gguf_matrix(shape, d))
                for r, d in GGUF_RECIPES]
    fn, scale, base = _zeros(nm, hc * D, dtype=mx.float32), _zeros(3, dtype=mx.float32), _zeros(nm, dtype=mx.float32)
    for t in TOKENS:
        streams, pre = _zeros(1, t, hc, D), _zeros(1, t, hc, dtype=mx.float32)
        post, comb = _zeros(1, t, hc, dtype=mx.float32), _zeros(1, t, hc, hc, dtype=mx.float32)
        with flags.override(kernel_mhc_wide=False):   # the per-token launches (CUDA's default is wide)
            mhc.hc_mixes(streams, fn, scale, base, 1e-20, a.hc_eps)
            mhc.hc_collapse_norm(streams, pre, _zeros(D), 1e-20)
            for fp8_copy in (False, True):
                mhc.hc_mixes_collapse_norm(streams, pre, fn, scale, base, _zeros(D), 1e-20, 1e-20, a.hc_eps,
                                           fp8_copy=fp8_copy)
            mhc.hc_expand(_zeros(1, t, D), streams, post, comb)
            mhc.hc_expand(_zeros(1, t, D), streams, post, comb, fn=fn)
        with flags.override(kernel_mhc_wide=True):   # the wide decode path's launches
            for fp8_copy in (False, True):
                mhc.hc_mixes_collapse_norm(streams, pre, fn, scale, base, _zeros(D), 1e-20, 1e-20, a.hc_eps,
                                           fp8_copy=fp8_copy)
            mhc.hc_expand(_zeros(1, t, D), streams, post, comb, fn=fn, pre=pre)

        for compressed, selected in ((None, None), (_zeros(1, CONTEXT // 2, Dh), a.index_topk),
                                     (_zeros(1, CONTEXT, Dh), a.index_topk)):
            topk_idx = None if compressed is None else _zeros(1, t, selected, dtype=mx.int32)
            angles = _zeros(1, t, R, dtype=mx.float32)
            # the 4-row kernels, the 8-row ones, the staged partial (tensor cores) with the 8-row merge
            for switches in (dict(kernel_attention_rows8=False), dict(kernel_attention_rows8=True),
                             dict(kernel_attention_staged_decode=True)):
                with flags.override(**switches):
                    sparse_attention.sparse_attention(
                        _zeros(1, t, H, Dh), _zeros(1, a.sliding_window, Dh),
                        _zeros(1, t, a.sliding_window, dtype=mx.int32), compressed, topk_idx,
                        _zeros(H, dtype=mx.float32), Dh ** -0.5, angles, angles, rotate_queries=True)

        x = _zeros(t, D)
        logits = _zeros(t, E, dtype=mx.float32)
        route(logits, _zeros(E, dtype=mx.float32), k, 1.0, a.routed_scaling_factor, True)
        expand = (_zeros(t, hc, D), _zeros(t, hc, dtype=mx.float32), _zeros(t, hc, hc, dtype=mx.float32))
        # the expand that also makes the next site's entry partials (DSV4_KERNEL_MOE_NEXT_PROJECTION)
        projecting = expand + (_zeros(hc * (2 + hc), hc * D, dtype=mx.float32), _zeros(t, hc, dtype=mx.float32))
        for routed, dense in layouts:
            gate, up, down = routed((E, I, D)), routed((E, I, D)), routed((E, D, I))
            shared = (dense((I, D)), dense((I, D)), dense((D, I)))
            # mxfp4's integer unit; h handed to the GGUF down as limbs, from the integer and the
            # halves units
            for e, switches in ((None, {}), (expand, {}), (expand, dict(kernel_moe_dp4a=True)),
                                (expand, dict(kernel_gguf_dp4a_down=True)),
                                (expand, dict(kernel_gguf_dp4a_down=True, kernel_gguf_dp4a=False)),
                                (projecting, {}), (projecting, dict(kernel_gguf_dp4a_down=True)),
                                (expand, dict(kernel_moe_mma=True))):   # mxfp4's gate/up and down on tensor cores
                with flags.override(**switches):
                    experts.experts(x, _zeros(t, k, dtype=mx.int32), _zeros(t, k, dtype=mx.float32), gate, up,
                                    down, shared, a.swiglu_limit, True, e)
                    experts.routed_experts(x, logits, _zeros(E, dtype=mx.float32), k, 1.0,
                                           a.routed_scaling_factor, True, gate, up, down, shared, a.swiglu_limit,
                                           True, e)
            for n, d in projections:
                q = dense((n, d))
                if matvec.kernel_supports(_zeros(t, d), q):
                    for tokens, dp4a in ((False, False), (True, False), (True, True)):
                        # tokens: the multi-token launch (2..6 tokens); dp4a: GGUF rows in the integer units (x's limbs)
                        with flags.override(kernel_matvec_tokens=tokens, kernel_gguf_dp4a=dp4a):
                            matvec.quantized_matvec(_zeros(t, d), q, True)
            # wq_a and wkv with their tails (DSV4_KERNEL_MATVEC_TAIL), on x rounded by the mHC entry
            with flags.override(kernel_matvec_tail=True):
                for n, norm, rope in ((a.q_lora_rank, True, None), (Dh, True, (_zeros(R, dtype=mx.float32),) * 2)):
                    q = dense((n, D))
                    if matvec_tail.applies(_zeros(t, D), q, rows.FP8):
                        matvec_tail.projection_tail(_zeros(t, D), q, False, matvec_tail.arrivals(),
                                                    (_zeros(n), 1e-20), rope, rows.FP8)
            # The grouped wo_a: every group of heads through its rows in one launch (GGUF blocks;
            # MLX's packs through the multi-token launch only)
            g, q = a.o_groups, dense((a.o_groups * a.o_lora_rank, H * Dh // a.o_groups))
            for tokens in (False, True):   # as attention.py calls it: no input rounding
                with flags.override(kernel_matvec_tokens=tokens):
                    if matvec.kernel_supports(_zeros(t, g, H * Dh // g), q, groups=g):
                        matvec.quantized_matvec(_zeros(t, g, H * Dh // g), q, False, groups=g)

        for n, d in projections:   # the head product of a bf16 weight (the head, the gate, ...)
            for dtype in (mx.float32, mx.bfloat16):
                if head.kernel_applies(_zeros(t, d, dtype=dtype), _zeros(n, d)):
                    head.head_logits(_zeros(t, d, dtype=dtype), _zeros(n, d))

        for width in (a.index_head_dim, Dh, a.q_lora_rank, rows.MAX_WIDTH):
            for fmt in (rows.NO_QDQ, rows.FP8, rows.FP4, rows.FP4_E4M3):
                if rows.kernel_applies(_zeros(t, width), fmt):
                    rows.row_tail(_zeros(t, width), (_zeros(width), 1e-20), (_zeros(R, dtype=mx.float32),) * 2, fmt)
        rows.rope_angles(_zeros(1, dtype=mx.int32), _zeros(R, dtype=mx.float32), 1.0)
        qdq_fp8(_zeros(t, D))
        qdq_fp4_pow2(_zeros(t, a.index_n_heads, a.index_head_dim, dtype=mx.float32))

        for ratio, n in ((2, CONTEXT // 2), (1, CONTEXT)):
            q = _zeros(1, t, a.index_n_heads, a.index_head_dim, dtype=mx.float32)
            positions = _zeros(t, dtype=mx.int32)
            scores = indexer.indexer_scores(q, _zeros(1, n, a.index_head_dim), _zeros(1, t, a.index_n_heads),
                                            1.0, positions, ratio, _zeros(1, t, n, dtype=mx.bool_))
            topk.topk_visible(scores, a.index_topk, positions, ratio)

    # A prefill chunk (CUDA's, the larger) through the mHC projection in tiles and the row tails
    # with each position's angles: the queries' rows (every head) and the q-LoRA latent.
    t = CUDA_PREFILL_TOKENS
    streams, pre = _zeros(1, t, hc, D), _zeros(1, t, hc, dtype=mx.float32)
    with flags.override(kernel_mhc_tiles=True):
        mhc.hc_mixes_collapse_norm(streams, pre, fn, scale, base, _zeros(D), 1e-20, 1e-20, a.hc_eps, fp8_copy=True)
    angles = (_zeros(t, R, dtype=mx.float32),) * 2
    rows.row_tail(_zeros(1, t, H * Dh), None, angles, rows.NO_QDQ, shape=(1, t, H, Dh))
    rows.row_tail(_zeros(1, t, a.q_lora_rank), (_zeros(a.q_lora_rank), 1e-20), None, rows.FP8)
    rows.rope_angles(_zeros(1, dtype=mx.int32), _zeros(R, dtype=mx.float32), 1.0, t)

    # The hidden activation of a prefill chunk's routed pairs (and of the few-rows path, a decode
    # step's without the fused kernel), on every backend
    with flags.override(kernel_swiglu=True):
        for pairs in (t * k, k):
            swiglu.hidden(_zeros(pairs, 1, I), _zeros(pairs, 1, I), _zeros(pairs, dtype=mx.float32),
                          a.swiglu_limit, True)

    # A prefill chunk's indexer scores, its heads summed in one launch
    with flags.override(kernel_prefill_indexer=True):
        indexer.indexer_scores(_zeros(1, t, a.index_n_heads, a.index_head_dim, dtype=mx.float32),
                               _zeros(1, CONTEXT // 2, a.index_head_dim), _zeros(1, t, a.index_n_heads), 1.0,
                               _zeros(t, dtype=mx.int32), 2)

    # A prefill chunk's routed experts on CUDA tensor cores: PREFILL_TOKENS tokens' sorted pairs;
    # its sparse attention there (a threadgroup per 16 heads, or staged for all heads), with the
    # selected rows and without (window-only layers).
    if dialect.backend() == "cuda":
        for staged in (False, True):
            with flags.override(kernel_prefill_attention_mma=True, kernel_prefill_attention_staged=staged):
                for compressed in (None, _zeros(1, CONTEXT // 2, Dh)):
                    topk_idx = None if compressed is None else _zeros(1, PREFILL_TOKENS, a.index_topk, dtype=mx.int32)
                    angles = _zeros(1, PREFILL_TOKENS, R, dtype=mx.float32)
                    sparse_attention.sparse_attention(
                        _zeros(1, PREFILL_TOKENS, H, Dh), _zeros(1, a.sliding_window + PREFILL_TOKENS, Dh),
                        _zeros(1, PREFILL_TOKENS, a.sliding_window, dtype=mx.int32), compressed, topk_idx,
                        _zeros(H, dtype=mx.float32), Dh ** -0.5, angles, angles, rotate_queries=True)
        gate, down = _mx_matrix((E, I, D), "mxfp4"), _mx_matrix((E, D, I), "mxfp4")
        pairs = mx.array(np.sort(np.arange(PREFILL_TOKENS * k, dtype=np.uint32) % E))   # sorted, as RoutedExperts gives them
        for m, width in ((gate, D), (down, I)):
            # the fp16 launch; the bf16 launch, plain or streamed
            for bf16, stream in ((False, False), (True, False), (True, True)):
                with flags.override(kernel_prefill_experts_bf16=bf16, kernel_prefill_experts_stream=stream):
                    experts_prefill.prefill_experts(_zeros(PREFILL_TOKENS * k, 1, width), m.weight, m.scales, pairs,
                                                    32, 4, "mxfp4", sorted_indices=True)


def v41_problems() -> list[str]:
    """Every problem of every launch at V4.1's widths, on Metal and on CUDA (empty when all fit)."""
    return [p for name in dialect.SHARED_MEMORY_BYTES for launch in record(name, v41_calls)
            for p in problems(launch)]


if __name__ == "__main__":
    found = v41_problems()
    print("\n".join(found) or "every V4.1 launch fits the GPU limits")
    sys.exit(1 if found else 0)
