"""A one-token projection and its tail in one launch (flag `kernel_matvec_tail`; CUDA, off until
a GPU has timed it):

    y[t] = tail(round_T(W q(x[t])))      tail = rows.py's RMSNorm -> RoPE -> rounding stages

Why. A fixed-shape decode step's wq_a and wkv are each a matvec launch and then a row-tail
launch (the q-LoRA latent's q_norm and fp8 rounding; the window KV row's kv_norm, RoPE and fp8
rounding): four of a layer's ~20 launches, in a step whose host encodes each launch in ~10 µs
(benchmarks/results/2026-12-06-0845-host-encode.md) and whose row tails are ~4 µs of GPU each
for a row of 512-1280 values.

What. matvec.py's launch (its split of the rows over threadgroups, its arithmetic) writes each
row's sum, rounded to T, to a scratch row in fp32; then each threadgroup arrives on its token's
counter, and the last to arrive (whichever that is) takes the token's whole row through
rows.py's stages (its 256 threads hold the row as the row-tail launch's threadgroup does) and
writes y. So the values are the two launches' exactly, in the same fp32 order.

The counters are one uint32 per token in a buffer the projection's layer owns (`arrivals`),
zero between launches: the last arrival puts its token's back to 0. Launches that share a buffer
must not run at once; one layer's projection is one launch per step, each step after the last.
CUDA only: Metal has no device-wide fence before Metal 3.2, and Macs keep the two launches.
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import matvec as mv
from dsv4.kernels import rows
from dsv4.kernels.dialect import Kernel, backend, constant
from dsv4.kernels.experts import _HEADER, MODE_IDS, X_HEADER, X_INTS, X_STRIDE
from dsv4.kernels.gguf_dot import HEADER as GGUF_HEADER, Q8_0_HSUB, GGUFMatrix
from dsv4.kernels.qdq import HEADER as QDQ_HEADER

_EPILOGUE = r"""
  // Every threadgroup's rows are in raw: the last of token t's to arrive runs the tail.
  DEVICE_FENCE();
  BARRIER();
  SHARED uint32_t last_arrival[1];
  if (tid == 0) {
    const uint32_t threadgroups = (uint32_t)((N + tg_rows - 1) / tg_rows);
    const bool last = DEVICE_ARRIVE(arrivals, t) + 1u == threadgroups;
    if (last) DEVICE_RESET(arrivals, t);
    last_arrival[0] = last ? 1u : 0u;
  }
  BARRIER();
  if (last_arrival[0] == 0u) return;
  DEVICE_FENCE();""" + rows.held_row("(size_t)t", "LOAD_CG(raw + row * D + d)", "y[row * D + d]")

BODY = mv._stored(mv._BODY, "raw[{i}] = float(static_cast<T>({v}))") + _EPILOGUE

_INPUTS = ("x", "w", "s", "b", "weight", "cosv", "sinv", "params", "arrivals")
_OUTPUTS = ("y", "raw")


def _checks(gguf: bool):
    """V4.1's two tails at decode (the compile gates build these): wq_a 1280 rows with q_norm and
    the fp8 rounding, wkv 512 with kv_norm, RoPE and the fp8 rounding; mxfp8 packs or GGUF Q8_0."""
    u32, u8, bf16, f32 = mx.uint32, mx.uint8, mx.bfloat16, mx.float32
    out = []
    for n, r, split, rows_ in ((1280, 0, 1, 4), (512, 32, 1, 2)):   # work_split's, K = 5120
        if gguf:
            layout = (("MODE", Q8_0_HSUB), ("BITS", 0), ("GS", 0))   # Q8_0 as CUDA reads it
            operands = (bf16, u8, u32, u32)
        else:
            layout = (("MODE", MODE_IDS["mxfp8"]), ("BITS", 8), ("GS", 32))
            operands = (bf16, u32, u8, u32)
        template = ((("T", bf16),) + layout + (("SPLIT", split), ("ROWS", rows_), ("K", 5120), ("XS", X_STRIDE),
                    ("ACTQ", False), ("GROUPS", 1), ("D", n), ("R", r), ("NORM", True), ("QDQ", 1 + rows.FP8)))
        out.append((operands + (bf16, f32, f32, f32, u32), (bf16, f32), template))
    return tuple(out)


TAIL_KERNEL = Kernel(name="dsv4_quantized_matvec_tail", input_names=_INPUTS, output_names=_OUTPUTS, body=BODY,
                     header=_HEADER + QDQ_HEADER, dialects=("cuda",), checks=_checks(False))
GGUF_TAIL_KERNEL = Kernel(name="dsv4_gguf_matvec_tail", input_names=_INPUTS, output_names=_OUTPUTS, body=BODY,
                          header=X_HEADER + GGUF_HEADER + QDQ_HEADER, dialects=("cuda",), checks=_checks(True))


def applies(x: mx.array, q, qdq: int) -> bool:
    """Whether the projection of x (1-8 tokens) by q and its tail run as one launch: the flag, CUDA,
    what the one-token matvec launch takes (not the multi-token one), and a row the tail's
    threadgroup holds (rows.kernel_applies)."""
    if not (flags.get("kernel_matvec_tail") and backend() == "cuda" and mv.kernel_supports(x, q)):
        return False
    tokens = x.size // x.shape[-1]
    integer = isinstance(q, GGUFMatrix) and q.integer
    return (not mv.tokens_applies(q, tokens, 1, integer) and q.out_features % 32 == 0
            and rows.kernel_applies(x, qdq, q.out_features))


def arrivals() -> mx.array:
    """A zeroed counter buffer for one projection's launches (one uint32 per token)."""
    return mx.zeros((mv.MAX_TOKENS,), mx.uint32)


def projection_tail(x: mx.array, q, act_quant: bool, counters: mx.array, norm=None, rope=None,
                    qdq: int = rows.NO_QDQ) -> mx.array:
    """rows.row_tail(matvec.quantized_matvec(x, q, act_quant), norm, rope, qdq) in one launch; x
    [..., K] -> [..., N] in x's dtype. `counters`: the projection's own buffer (`arrivals`), used
    by no launch that may run at the same time. Call only where `applies(x, q, qdq)`."""
    K, N = x.shape[-1], q.out_features
    tokens = x.size // K
    gguf = isinstance(q, GGUFMatrix)
    integer = gguf and bool(act_quant) and q.integer
    split, rows_ = mv.work_split(N, K, q.block_values)
    weight, eps = norm if norm is not None else (constant((0.0,) * 8), 0.0)
    cos, sin = rope if rope is not None else (constant((0.0,) * 8), constant((0.0,) * 8))
    positions = cos.shape[0] if cos.ndim == 2 else 1
    layout = q.template(integer=True) if integer else q.template()
    y, _ = (GGUF_TAIL_KERNEL if gguf else TAIL_KERNEL)(
        inputs=[x] + q.operands() + [weight, cos, sin, constant((float(eps), 1.0, float(positions))), counters],
        output_shapes=[(*x.shape[:-1], N), (tokens * N,)], output_dtypes=[x.dtype, mx.float32],
        grid=(32 * mv.WARPS, math.ceil(N * split / (mv.WARPS * rows_)), tokens), threadgroup=(32 * mv.WARPS, 1, 1),
        template=[("T", x.dtype)] + layout + [
            ("SPLIT", split), ("ROWS", rows_), ("K", K), ("XS", X_INTS if integer else X_STRIDE),
            ("ACTQ", bool(act_quant)), ("GROUPS", 1), ("D", N), ("R", 0 if rope is None else cos.shape[-1]),
            ("NORM", norm is not None), ("QDQ", 1 + qdq)])
    return y
