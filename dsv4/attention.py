"""V4.1 attention: Q-LoRA, window KV, Compressor, Indexer, sparse attention with sink,
grouped low-rank output (model-spec §3).

Every layer attends to its sliding window of raw KV rows. Layers with a compress
ratio also attend to the compressed rows of their kv source, picked per query by the
top-k of the most recent index source. Which layer plays which role comes from the
config (`ModelArgs.kv_source`, `index_source`, `uses_candidates`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import distributed, encode_thread, flags, profiler
from .cache import Cache, LayerCache
from .constants import derived, ramp
from .kernels.indexer import indexer_scores
from .kernels.matvec import kernel_supports as matvec_kernel_supports
from .kernels.matvec import quantized_matvec
from .kernels.topk import topk_indices, topk_visible
from .kernels.selection import candidates_matter, indexer_can_be_skipped, select_all_visible
from .kernels import head as head_kernel
from .kernels import rows
from .kernels.dialect import backend
from .kernels.sparse_attention import sparse_attention
from .config import ModelArgs
from .linear import (GGUFLinear, Linear, QuantizedLinear, dequant_matmul, dequant_prefill, dequantize,
                     fp8_linear, fp8_linear_tail, fp8_linears, matrix_operand)
from .quant import qdq_fp4_e4m3, qdq_fp4_pow2, qdq_fp8


class RMSNorm(nn.Module):
    """w * x * rsqrt(mean(x^2) + eps), computed in fp32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dim,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        h = x.astype(mx.float32)
        h = h * mx.rsqrt(mx.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (h * self.weight.astype(mx.float32)).astype(x.dtype)


# Grouped wo_a computes up to this many tokens (decode, verification) as a gathered row per
# token and group, beyond that (prefill) as one product per group.
GROUPED_GATHER_MAX_TOKENS = 8


# --- RoPE ---------------------------------------------------------------------------------

def rope_frequencies(args: ModelArgs, ratio: int) -> np.ndarray:
    """omega_k of the interleaved RoPE: base theta for window-only layers, YaRN-scaled
    compress theta for layers with a ratio (no mscale)."""
    dims = args.qk_rope_head_dim
    base = args.compress_rope_theta if ratio else args.rope_theta
    omega = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    scaling = args.rope_scaling or {}
    factor = float(scaling.get("factor", 1.0))
    if ratio and factor > 1:
        original = float(scaling.get("original_max_position_embeddings", 65536))

        def corr(rotations: float) -> float:
            return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(float(scaling.get("beta_fast", 32)))), 0)
        high = min(math.ceil(corr(float(scaling.get("beta_slow", 1)))), dims - 1)
        if low == high:
            high += 0.001
        blend = np.clip((np.arange(dims // 2) - low) / (high - low), 0, 1)
        omega = omega / factor * blend + omega * (1 - blend)
    return omega.astype(np.float32)


_FULL_WIDTH: dict = {}


def _full_width(freqs: mx.array, dims: int) -> mx.array:
    """freqs preceded by infinite wavelengths for the leading dims: angle 0 rotates nothing,
    so one mx.fast.rope over the whole row equals rotating its tail (no slice, no concat)."""
    key = (id(freqs), dims)
    hit = _FULL_WIDTH.get(key)
    if hit is None or hit[0] is not freqs:
        pad = mx.full((dims // 2 - freqs.shape[0],), mx.inf, mx.float32)
        hit = (freqs, mx.concatenate([pad, freqs.astype(mx.float32)]))
        encode_thread.evaluate(hit[1])
        _FULL_WIDTH[key] = hit
    return hit[1]


def rope(x: mx.array, offset, freqs: mx.array, scale: float = 1.0,
         inverse: bool = False) -> mx.array:
    """Rotate adjacent pairs of the last 2*len(freqs) dims of x [B, S, (H,) D] at positions
    scale * (offset + s) (offset an int or an int32 array); freqs are the wavelengths 1/omega.
    `inverse` rotates back. The rotation is computed in fp32 and rounded once to x's dtype, as
    the official model does: mx.fast.rope on bf16 input rounds its products in bf16 (39% of
    the elements off by an ulp, enough to flip the fp8 rounding of window KV rows and take a
    random tiny model's bf16 logits ~30% away from the reference's after two tokens)."""
    b, s, d = x.shape[0], x.shape[1], x.shape[-1]
    full = _full_width(freqs, d)
    dtype = x.dtype
    x = x.astype(mx.float32)
    if x.ndim == 4:   # mx.fast.rope wants the positions on axis -2
        x = x.reshape(b, x.shape[2], 1, d) if s == 1 else x.swapaxes(1, 2)
    out = mx.fast.rope(x, d, traditional=True, base=None, scale=scale, offset=offset,
                       freqs=-full if inverse else full)
    if out.ndim == 4:
        out = out.reshape(b, 1, out.shape[1], d) if s == 1 else out.swapaxes(1, 2)
    return out.astype(dtype)


@dataclass(frozen=True)
class Rotation:
    """Where RoPE puts a chunk's rows: positions scale * (offset + s), wavelengths freqs.
    `angles` = (cos, sin) [R] fp32 of a single position, given by the fixed-shape decode step
    so that a projection's tail can run as one kernel."""
    offset: object                 # int or int32 array
    freqs: mx.array
    scale: float = 1.0
    angles: Optional[tuple] = None


def finish_rows(x: mx.array, norm: Optional[RMSNorm] = None, rot: Optional[Rotation] = None,
                qdq=None, fused: bool = False, shape: Optional[tuple] = None,
                dtype: Optional[mx.Dtype] = None) -> mx.array:
    """A projection's tail: RMSNorm, then RoPE, then one of the QDQ roundings (each optional),
    on x reshaped to `shape` first if given (rows of shape[-1], e.g. split into heads), the
    result cast to `dtype` if given. `fused` (the fixed-shape step) runs it as one kernel
    where dsv4/kernels/rows.py can (which writes its output in that shape and dtype: no
    reshape, no cast)."""
    fmt = {None: rows.NO_QDQ, qdq_fp8: rows.FP8, qdq_fp4_pow2: rows.FP4, qdq_fp4_e4m3: rows.FP4_E4M3}.get(qdq)
    if (fused and fmt is not None and (rot is None or rot.angles is not None)
            and rows.kernel_applies(x, fmt, x.shape[-1] if shape is None else shape[-1])):
        return rows.row_tail(x, None if norm is None else (norm.weight, norm.eps),
                             None if rot is None else rot.angles, fmt, shape, dtype)
    if shape is not None:
        x = x.reshape(shape)
    if norm is not None:
        x = norm(x)
    if rot is not None:
        x = rope(x, rot.offset, rot.freqs, scale=rot.scale)
    x = x if qdq is None else qdq(x)
    return x if dtype is None else x.astype(dtype)


# --- selection ------------------------------------------------------------------------------

def window_indices(start: int, length: int, held_start: int, window: int) -> mx.array:
    """[S, window] row of each query's window positions in the held rows, -1 for none."""
    t = start + np.arange(length)[:, None]
    u = t - window + 1 + np.arange(window)[None, :]
    return mx.array(np.where(u >= max(held_start, 0), u - held_start, -1).astype(np.int32))


# --- per-forward shared state ------------------------------------------------------------------

def prefill_row_kernels(length: int) -> bool:
    """Whether a reference-path forward of `length` positions runs its projection tails (norm,
    RoPE, rounding) and the output's inverse RoPE as dsv4/kernels/rows.py launches with each
    position's angles (flag `kernel_prefill_rows`), as the fixed-shape step does."""
    return (length > 1 and bool(flags.get("kernel_rows")) and backend() is not None
            and flags.switch("kernel_prefill_rows", backend() == "cuda"))


@dataclass
class ForwardState:
    """What layers of one forward hand to later layers (model-spec 3.6)."""
    start: int
    length: int
    cache: Cache
    positions: mx.array
    window_idx: mx.array                     # [1, S, window] rows of the held window, -1 none
    topk: Optional[mx.array] = None          # [B, S, k] of the latest index source
    candidates: Optional[mx.array] = None    # [B, S, N] bool of the candidate source
    emitted: dict = field(default_factory=dict)  # kv source layer -> latents emitted now
    # The projection tails as row kernels with each row's angles (prefill_row_kernels), else
    # every op on its own.
    fused: bool = False
    angles: dict = field(default_factory=dict)   # (freqs, offset, scale) -> cos, sin [S, R]

    # What `Attention.__call__` asks of its state, here over the growing `Cache` (the
    # reference path); dsv4.step.StepState answers the same over fixed-shape buffers.

    def rotation(self, freqs: mx.array, offset=None, scale: float = 1.0) -> Rotation:
        """RoPE placement of this chunk's rows (offset defaults to the chunk's start; the first
        compressed row it completes, scale its ratio), with the cos/sin of their angles [S, R]
        while `fused` (one launch each, made once per forward)."""
        offset = self.start if offset is None else offset
        if not self.fused:
            return Rotation(offset, freqs, scale)
        key = (id(freqs), offset, scale)
        if key not in self.angles:
            # From offset to the chunk's end: its positions, or the compressed rows it completes.
            count = (self.start + self.length) // round(scale) - offset
            self.angles[key] = rows.rope_angles(mx.array([offset], mx.int32), freqs, scale, count)
        return Rotation(offset, freqs, scale, self.angles[key])

    def output_angles(self, attn: "Attention") -> None:
        """The cos/sin to de-rotate the output inside the attention: none here, the output is
        de-rotated on its own."""
        return None

    def window(self, attn: "Attention", rows: mx.array) -> tuple[mx.array, mx.array]:
        """Append this chunk's window rows -> (the held window rows, each query's indices)."""
        return self.cache.append_window(self.cache[attn.layer], rows), self.window_idx

    def compressed(self, layer: int) -> Optional[mx.array]:
        return self.cache[layer].compressed

    def compress(self, attn: "Attention", x: mx.array) -> None:
        """Pool the groups this chunk completes and append their rows (and index keys)."""
        lc = self.cache[attn.layer]
        latents, first = attn.compressor(x, self, lc)
        if latents is None:
            self.emitted[attn.layer] = False
            return
        self.emitted[attn.layer] = True
        row, keys = attn.compressed_rows(latents, first, self)
        lc.compressed = row if lc.compressed is None else mx.concatenate([lc.compressed, row], axis=1)
        if keys is not None:
            lc.index_keys = keys if lc.index_keys is None else mx.concatenate([lc.index_keys, keys], axis=1)
            self.cache.key_publisher = attn.layer

    def select(self, attn: "Attention", x: mx.array, qr: mx.array) -> Optional[mx.array]:
        """This index source's top-k [B, S, k], or None before any compressed row exists."""
        b = x.shape[0]
        keys = self._index_keys(attn)
        n = 0 if keys is None else keys.shape[1]
        if n == 0:
            return None
        # While every visible row makes the top-k, scores cannot change the selection; the
        # candidate source still scores while its mask can drop rows (re-index layers read it).
        if (flags.get("indexer_skip") and indexer_can_be_skipped(n, attn.args.index_topk)
                and not self.candidates_matter(attn.args, attn.layer, n)):
            if attn.args.is_candidate_source(attn.layer):
                self.candidates = None
            return select_all_visible(self.positions, b, attn.ratio, n)
        return attn.indexer(x, qr, keys, self, attn._freqs, attn.ratio)

    def candidates_matter(self, args: ModelArgs, layer: int, n: int) -> bool:
        """Whether `layer`, a candidate source over n held rows, makes a mask that can drop a
        visible row (dsv4.kernels.selection.candidates_matter); None stands for it otherwise."""
        return args.is_candidate_source(layer) and candidates_matter(args, n)

    def _index_keys(self, attn: "Attention") -> Optional[mx.array]:
        source = attn.args.kv_source(attn.layer)
        cache = self.cache
        if (flags.get("index_key_quirk") and self.emitted.get(source) is False
                and cache.key_publisher is not None):
            # The reference scores against the last published keys, cut to this layer's count.
            end = (self.start + self.length) // attn.ratio
            return cache[cache.key_publisher].index_keys[:, :end]
        return cache[source].index_keys


class Compressor(nn.Module):
    """Pools groups of `ratio` tokens into one latent (ratio 1: one latent per token)."""

    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(args.hidden_size, args.head_dim, bias=False)
        if ratio > 1:
            self.wgate = Linear(args.hidden_size, args.head_dim, bias=False)
        self.norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def __call__(self, x: mx.array, state: ForwardState, lc: LayerCache) -> tuple[Optional[mx.array], int]:
        """-> (latents [B, n, Dh] of the groups completed by this chunk or None, first group index)."""
        r, start, end = self.ratio, state.start, state.start + state.length
        if r == 1:
            return self.norm(self.wkv(x)), start
        state.cache.append_compressor_inputs(lc, *self.inputs(x))
        first, last = start // r, end // r
        if last == first:
            return None, first
        lo = first * r - lc.comp_start
        hi = last * r - lc.comp_start
        b, d = x.shape[0], lc.comp_kv.shape[-1]
        kv = lc.comp_kv[:, lo:hi].reshape(b, last - first, r, d)
        gate = lc.comp_gate[:, lo:hi].reshape(b, last - first, r, d)
        state.cache.evict_compressor_inputs(lc)
        return self.pool(kv, gate, x.dtype), first

    def inputs(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The fp32 kv and gate inputs of x's tokens [B, S, Dh] (pooled once a group completes)."""
        wkv, wgate = self.wkv["weight"], self.wgate["weight"]
        if flags.get("kernel_head") and head_kernel.supports(x, wkv) and wgate.dtype == wkv.dtype:
            # Both products in one launch of the head kernel (bf16 weights and x read as stored).
            both = derived(self.wkv, f"with_gate_{id(wgate)}", wkv, lambda: mx.concatenate([wkv, wgate]))
            kv_gate = head_kernel.head_logits(x, both)
            d = wkv.shape[0]
            return kv_gate[..., :d], kv_gate[..., d:]
        h = x.astype(mx.float32)
        fp32 = lambda m: derived(m, "fp32_t", m.weight, lambda: m.weight.astype(mx.float32).T)
        return h @ fp32(self.wkv), h @ fp32(self.wgate)

    def pool(self, kv: mx.array, gate: mx.array, dtype: mx.Dtype, keepdims: bool = False) -> mx.array:
        """Groups [B, n, ratio, Dh] of inputs -> their latents [B, n, Dh]; with keepdims, one
        group [B, ratio, Dh] -> its latent [B, 1, Dh] (no expand before, no squeeze after)."""
        pooled = mx.sum(kv * mx.softmax(gate, axis=-2), axis=-2, keepdims=keepdims)
        return self.norm(pooled.astype(dtype))


class Indexer(nn.Module):
    """Scores compressed positions for each query and keeps the top-k (model-spec 3.6)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args = args
        self.layer = layer
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = Linear(args.hidden_size, self.n_heads, bias=False)
        if layer in args.kv_source_layer_ids:
            self.wk = Linear(args.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def keys(self, latents: mx.array, rot: Rotation, fused: bool = False) -> mx.array:
        return finish_rows(self.wk(latents), self.k_norm, rot,
                           qdq_fp4_pow2 if flags.get("kv_qdq") else None, fused)

    def __call__(self, x: mx.array, qr_in: mx.array, keys: mx.array, state: ForwardState,
                 freqs: mx.array, ratio: int) -> mx.array:
        """qr_in: the q-LoRA latent as matmul input (Attention.queries)."""
        b, s, _ = x.shape
        q = finish_rows(self.wq_b(qr_in), None, state.rotation(freqs),
                        qdq_fp4_pow2 if flags.get("kv_qdq") else None, state.fused,
                        (b, s, self.n_heads, self.head_dim), mx.float32)   # scored in fp32
        candidates = None
        if not self.args.is_candidate_source(self.layer) and self.args.uses_candidates(self.layer):
            candidates = state.candidates
        scores = indexer_scores(q, keys, self.weights_proj(x), self.head_dim ** -0.5 * self.n_heads ** -0.5,
                                state.positions, ratio, candidates)                    # [B,S,N]
        n = keys.shape[1]
        if self.args.is_candidate_source(self.layer):
            matter = state.candidates_matter(self.args, self.layer, n)
            visible = (state.positions[:, None] + 1) // ratio                              # [S,1]
            state.candidates = self._candidates(scores, visible) if matter else None
        return topk_visible(scores, min(self.args.index_topk, n), state.positions, ratio)

    def _candidates(self, scores: mx.array, visible: mx.array) -> mx.array:
        """Blocks of positions ranked by their best score, the newest always kept."""
        size = self.args.candidate_block_size
        b, s, n = scores.shape
        pad = -n % size   # none at the fixed step's capacities: no Pad launch then
        padded = mx.pad(scores, [(0, 0), (0, 0), (0, pad)], constant_values=-mx.inf) if pad else scores
        blocks = mx.max(padded.reshape(b, s, -1, size), axis=-1)
        nb = blocks.shape[-1]
        newest = mx.where(visible > 0, (visible - 1) // size, -1)                          # [S,1]
        blocks = mx.where(ramp(nb) == newest, mx.inf, blocks)
        kb = min(self.args.candidate_topk_blocks, nb)
        chosen = topk_indices(blocks, kb)
        keep = mx.take_along_axis(blocks, chosen, axis=-1) > -mx.inf
        mask = mx.put_along_axis(mx.zeros(blocks.shape, mx.bool_), chosen, keep, axis=-1)
        return mx.repeat(mask, size, axis=-1)[..., :n]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, plan: distributed.Plan = distributed.SINGLE):
        """`plan`: the output groups this rank computes (their heads with them), and the sum
        of every rank's output projection (dsv4.distributed)."""
        super().__init__()
        self.args = args
        self.layer = layer
        self.ratio = args.ratio(layer)
        self.plan = plan
        self.groups = len(plan.attention_groups(args))
        self.head_dim = args.head_dim
        self.n_heads = args.num_attention_heads // args.o_groups * self.groups
        self.wq_a = Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = Linear(args.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        group_in = self.n_heads * self.head_dim // self.groups
        self.wo_a = Linear(group_in, self.groups * args.o_lora_rank, bias=False)
        self.wo_b = Linear(self.groups * args.o_lora_rank, args.hidden_size, bias=False)
        self.attn_sink = mx.zeros((self.n_heads,), mx.float32)
        if self.ratio and layer in args.kv_source_layer_ids:
            self.compressor = Compressor(args, self.ratio)
        if self.ratio and layer in args.index_source_layer_ids:
            self.indexer = Indexer(args, layer)
        self._freqs = mx.array(1.0 / rope_frequencies(args, self.ratio))

    def __call__(self, x: mx.array, state, x_fp8: Optional[mx.array] = None) -> mx.array:
        """One chunk's attention. `state` (ForwardState for the reference path over the growing
        cache, dsv4.step.StepState for the fixed-shape decode step) holds the cache and answers
        window / compress / select / compressed / output_angles. x_fp8: x already rounded as
        wq_a and wkv take it (fp8_input), if the caller has it."""
        # With the angles from the state the attention rotates the queries as it loads them
        # and de-rotates its output (fused into the kernel where it runs).
        angles = state.output_angles(self)
        tailed = self.tailed_projections(x, x_fp8, state)
        if tailed is None:
            latent, kv = fp8_linears(x, self.wq_a, self.wkv, rounded=x_fp8)   # rounded once for both
            qr, q = self.queries(latent, state, rotate=angles is None)
            window_row = self.window_rows(kv, state)
        else:
            qr, window_row = tailed
            q = self.head_queries(qr, state, rotate=angles is None)
        window, window_idx = state.window(self, window_row)
        compressed = topk = None
        if self.ratio:
            if "compressor" in self:
                state.compress(self, x)
            if "indexer" in self:
                state.topk = profiler.mark("indexer", state.select(self, x, qr))
            compressed, topk = state.compressed(self.args.kv_source(self.layer)), state.topk
            if compressed is None or topk is None:
                compressed = topk = None
        if angles is not None:   # written as grouped wo_a takes it
            b, s = x.shape[:2]
            o = self.attend(q, window, window_idx, compressed, topk, *angles, shape=self._wo_a_input(b, s),
                            rotate_queries=True)
            return self.project_out(o, b, s)
        return self.output(self.attend(q, window, window_idx, compressed, topk), state)

    # The pieces below are the steps of __call__, written once for both states: positions may
    # be arrays, and the tails of the projections may run fused (state.fused).

    def queries(self, latent: mx.array, state, rotate: bool = True) -> tuple[mx.array, mx.array]:
        """wq_a's output [B, S, q_lora_rank] -> (the q-LoRA latent as matmul input [B, S,
        q_lora_rank], queries [B, S, H, Dh], rotated unless `rotate` is False)."""
        qr_in = finish_rows(latent, self.q_norm, qdq=qdq_fp8 if flags.get("act_quant") else None,
                            fused=state.fused)
        return qr_in, self.head_queries(qr_in, state, rotate)

    def head_queries(self, qr_in: mx.array, state, rotate: bool = True) -> mx.array:
        """The q-LoRA latent as matmul input [B, S, q_lora_rank] -> queries [B, S, H, Dh],
        rotated unless `rotate` is False."""
        b, s, _ = qr_in.shape
        shape = (b, s, self.n_heads, self.head_dim)
        if not rotate:
            return self.wq_b(qr_in).reshape(shape)
        return finish_rows(self.wq_b(qr_in), rot=state.rotation(self._freqs), fused=state.fused, shape=shape)

    def tailed_projections(self, x: mx.array, x_fp8: Optional[mx.array], state) -> Optional[tuple]:
        """(the q-LoRA latent as queries() makes it, the window KV row as window_rows() makes it),
        each projection and its tail one launch (DSV4_KERNEL_MATVEC_TAIL, the fixed-shape step),
        or None where those launches do not run."""
        rot = state.rotation(self._freqs)
        if not (state.fused and rot.angles is not None and flags.get("kernel_matvec_tail")):
            return None
        fmt = lambda on: rows.FP8 if on else rows.NO_QDQ
        qr = fp8_linear_tail(self.wq_a, x, (self.q_norm.weight, self.q_norm.eps), None,
                             fmt(flags.get("act_quant")), rounded=x_fp8)
        row = fp8_linear_tail(self.wkv, x, (self.kv_norm.weight, self.kv_norm.eps), rot.angles,
                              fmt(flags.get("kv_qdq")), rounded=x_fp8)
        return None if qr is None or row is None else (qr, row)

    def window_rows(self, kv: mx.array, state) -> mx.array:
        """wkv's output [B, S, Dh] -> this chunk's window KV rows as the cache holds them."""
        return finish_rows(kv, self.kv_norm, state.rotation(self._freqs),
                           qdq_fp8 if flags.get("kv_qdq") else None, state.fused)

    def attend(self, q, window, window_idx, compressed, topk, rope_cos=None, rope_sin=None,
               shape=None, rotate_queries=False) -> mx.array:
        """Sparse attention with sink; with the cos/sin of the queries' angles the output
        comes back de-rotated (fused into the kernel), and unrotated queries (`rotate_queries`)
        are rotated first; laid out as `shape` if given."""
        return sparse_attention(q, window, window_idx, compressed, topk, self.attn_sink,
                                self.head_dim ** -0.5, rope_cos, rope_sin, shape, rotate_queries)

    def output(self, o: mx.array, state) -> mx.array:
        """Attention output [B, S, H, Dh] -> [B, S, hidden]: inverse RoPE (with the queries'
        angles negated, as a row kernel, where the state has them), then project_out."""
        rot = state.rotation(self._freqs)
        if rot.angles is not None and rows.kernel_applies(o, rows.NO_QDQ):
            cos, sin = rot.angles
            o = rows.row_tail(o, rope=(cos, -sin))
        else:
            o = rope(o, rot.offset, self._freqs, inverse=True)
        return self.project_out(o, *o.shape[:2])

    def project_out(self, o: mx.array, b: int, s: int) -> mx.array:
        """De-rotated attention output [B, S, H, Dh] (or laid out as grouped wo_a takes it,
        `_wo_a_input(b, s)`) -> [B, S, hidden]: grouped wo_a, wo_b, summed over the ranks
        that hold the other groups."""
        y = fp8_linear(self.wo_b, self._grouped_wo_a(o, b, s))
        return self.plan.combine(y) if self.groups < self.args.o_groups else y

    def _wo_a_input(self, b: int, s: int) -> tuple:
        """[B*S, G, 1, H*Dh/G]: each token's group of heads as one row of grouped wo_a's input."""
        g = self.groups
        return (b * s, g, 1, self.n_heads * self.head_dim // g)

    def compressed_rows(self, latents: mx.array, first, state) -> tuple[mx.array, Optional[mx.array]]:
        """Latents of groups first.. -> (their compressed KV rows, their index keys or None
        when this layer's indexer does not publish keys)."""
        rot = state.rotation(self._freqs, first, self.ratio)
        row = finish_rows(latents, rot=rot, qdq=qdq_fp4_e4m3 if flags.get("kv_qdq") else None,
                          fused=state.fused)
        keys = None
        if "indexer" in self and "wk" in self.indexer:
            keys = self.indexer.keys(latents, rot, state.fused)
        return row, keys

    def _grouped_wo_a(self, o: mx.array, b: int, s: int) -> mx.array:
        """Each group of heads through its own block of wo_a: [B, S, H, Dh] -> [B, S, G*L]."""
        g = self.groups
        x = o.reshape(self._wo_a_input(b, s))   # all dims given: no reshape when o is laid out so
        rows = self.args.o_lora_rank
        w = self.wo_a
        quantized = isinstance(w, QuantizedLinear) and not dequant_matmul()
        grouped = lambda name: derived(w, f"grouped_{name}", w[name], lambda: w[name].reshape(g, rows, -1))
        if quantized and b * s > GROUPED_GATHER_MAX_TOKENS:
            # Prefill: each group's tokens as one batched product, the weight read once per
            # group (a gathered row per token re-reads it per token: 7x slower at 512 tokens).
            per_group = x[:, :, 0].swapaxes(0, 1)                                # [G, B*S, in]
            arrays = (grouped("weight"), grouped("scales"), None if w.get("biases") is None else grouped("biases"))
            if dequant_prefill(w, per_group[0]):   # rows per product: the tokens
                out = per_group @ dequantize(w, x.dtype, arrays).swapaxes(-1, -2)
            else:
                out = mx.quantized_matmul(per_group, *arrays, transpose=True, group_size=w.group_size,
                                          bits=w.bits, mode=w.mode)
            out = out.swapaxes(0, 1).astype(o.dtype)
        elif quantized and matvec_kernel_supports(x.reshape(b * s, g, -1), matrix_operand(w), groups=g):
            # 2-6 tokens (a verify) under DSV4_KERNEL_MATVEC_TOKENS: every group in one launch that
            # decodes each weight once for all the tokens, where gather_qmm decodes it once a token.
            out = quantized_matvec(x.reshape(b * s, g, -1), matrix_operand(w), act_quant=False, groups=g)
        elif quantized:
            # Both index arrays given (left out, MLX makes the left one with an Arange per call),
            # as uint32 (other index types cost a cast per call).
            out = mx.gather_qmm(x, grouped("weight"), grouped("scales"),
                                None if w.get("biases") is None else grouped("biases"),
                                lhs_indices=ramp(b * s * g, mx.uint32, (b * s, g)),
                                rhs_indices=ramp(g, mx.uint32, (1, g)),
                                transpose=True, group_size=w.group_size,
                                bits=w.bits, mode=w.mode)
        elif isinstance(w, GGUFLinear) and matvec_kernel_supports(x.reshape(b * s, g, -1), w.matrix(), groups=g):
            # GGUF blocks: every group through its block of rows in one grouped matvec launch.
            out = quantized_matvec(x.reshape(b * s, g, -1), w.matrix(), act_quant=False, groups=g)
        else:
            # Each group is a plain product with its block of rows.
            if isinstance(w, GGUFLinear):
                weight = w.dequantized() if dequant_matmul() else w.matrix().dequantized()
            else:
                weight = w.dequantized(o.dtype) if isinstance(w, QuantizedLinear) else w.weight
            weight = weight.reshape(g, rows, -1)
            out = mx.stack([x[:, j, 0].astype(weight.dtype) @ weight[j].T for j in range(g)], axis=1)
            out = out.astype(o.dtype)
        return out.reshape(b, s, g * rows)

