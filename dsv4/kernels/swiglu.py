"""The experts' hidden activation outside the fused decode kernel, in one launch (model-spec §4).

For the gate and up products g, u of a (token, expert) pair with router weight w:

    h = fp8(round(silu(min(g, L)) * clip(u, -L, L) * w))      (fp32, then x's dtype)

with fp8() the input rounding of the down matmul (act_quant: e4m3 per 32 values with a
power-of-two scale, dsv4.quant.qdq_fp8). In plain MLX that is ~10 launches over fp32 copies of
g and u: at a prefill chunk of 4096 tokens (24576 pairs x 2304) an H100 spent ~20 ms of a 4K
prefill's 204 in them (benchmarks/results/2026-12-07-1005-prefill-profile-4096-c4096.md).
Here a SIMD group takes a block of 32 values of a pair's row: the fused decode kernel's fp32
operations (`hidden_of`, silu as g / (1 + exp(-g))), the rounding as dsv4/kernels/qdq.py's
(bit-identical to the reference's). Against the reference's silu (MLX's g * sigmoid(g)), a value
may round to the next bf16 (and then fp8) step.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from dsv4 import flags
from dsv4.kernels import qdq
from dsv4.kernels.dialect import Kernel, backend, constant, falls_back
from dsv4.quant import qdq_fp8

DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def clamped_swiglu(g: mx.array, u: mx.array, limit: float) -> mx.array:
    """silu(min(g, limit)) * clip(u, -limit, limit) in fp32 (no clamp where limit <= 0)."""
    g, u = g.astype(mx.float32), u.astype(mx.float32)
    if limit > 0:
        g, u = mx.minimum(g, limit), mx.clip(u, -limit, limit)
    return nn.silu(g) * u


# A value of h from its gate and up sums, as the fused decode launch (experts.py) and this one make
# it: each sum rounded to TT as its matmul's output would be, the clamped SwiGLU, the router
# weight, rounded to TT.
HIDDEN_HEADER = r"""
template <typename TT> KFN float hidden_of(float g, float u, float limit, float route) {
  const float gv = FMIN(float(static_cast<TT>(g)), limit);
  const float uv = FMIN(FMAX(float(static_cast<TT>(u)), -limit), limit);
  return float(static_cast<TT>(gv / (1.0f + EXP(-gv)) * uv * route));
}
"""

_BODY = r"""
  // grid (pairs * I, 1, 1): a SIMD group a block of 32 of a pair's I values (I % 32 == 0).
  const uint32_t i = group_x * group_threads + tid;
  const float h = hidden_of<T>(float(gate[i]), float(up[i]), params[0], route[i / (uint32_t)I]);
  out[i] = static_cast<T>(ACTQ ? qdq_pow2_lane<0>(h) : h);
"""

KERNEL = Kernel(
    name="dsv4_swiglu_hidden", input_names=("gate", "up", "route", "params"), output_names=("out",),
    body=_BODY, header=qdq.HEADER + HIDDEN_HEADER,
    checks=tuple(((t, t, mx.float32, mx.float32), (t,), (("T", t), ("I", 2304), ("ACTQ", actq)))
                 for t in (mx.bfloat16, mx.float32) for actq in (True, False)))


def kernel_applies(g: mx.array, u: mx.array) -> bool:
    """A GPU (CUDA; auto leaves Metal off until a Mac measures it), g and u of one float dtype
    and shape, rows of whole blocks of 32."""
    dialect = backend()
    return (dialect is not None and flags.switch("kernel_swiglu", dialect == "cuda")
            and g.dtype in DTYPES and u.dtype == g.dtype and u.shape == g.shape
            and g.size > 0 and g.shape[-1] % qdq.BLOCK == 0)


def swiglu_hidden_reference(g: mx.array, u: mx.array, weights: mx.array, limit: float, act_quant: bool) -> mx.array:
    """Plain MLX: h in g's dtype, fp8-rounded per 32 values with act_quant; `weights` holds a
    router weight per row of g (g.size / g.shape[-1] of them)."""
    route = weights.astype(mx.float32).reshape(*g.shape[:-1], 1)
    h = (clamped_swiglu(g, u, limit) * route).astype(g.dtype)
    return qdq_fp8(h) if act_quant else h


@falls_back(swiglu_hidden_reference, "kernel_swiglu")
def swiglu_hidden(g: mx.array, u: mx.array, weights: mx.array, limit: float, act_quant: bool) -> mx.array:
    """`swiglu_hidden_reference` in one launch; call where `kernel_applies(g, u)`."""
    I = g.shape[-1]
    (h,) = KERNEL(inputs=[g, u, weights.astype(mx.float32).reshape(-1), constant((limit if limit > 0 else float("inf"),))],
                  output_shapes=[g.shape], output_dtypes=[g.dtype], grid=(g.size, 1, 1),
                  threadgroup=(qdq.threadgroup(g.size), 1, 1),
                  template=[("T", g.dtype), ("I", I), ("ACTQ", bool(act_quant))])
    return h


def hidden(g: mx.array, u: mx.array, weights: mx.array, limit: float, act_quant: bool) -> mx.array:
    """The experts' h from their gate and up products: the kernel where it applies."""
    fn = swiglu_hidden if kernel_applies(g, u) else swiglu_hidden_reference
    return fn(g, u, weights, limit, act_quant)
