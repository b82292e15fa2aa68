"""mHC (manifold-constrained hyper-connections) ops, model-spec §2.2: mixes, collapse + RMSNorm, expand.

Streams are [B, S, hc, D] (bf16 in the model, hc = 4). Each op has a plain-MLX reference and
a kernel; the dispatchers `hc_mixes`, `hc_collapse_norm` and `hc_expand` pick one.

Kernels: the mixes are one split-K projection kernel (many threadgroups share the 2 MB fp32
projection at decode) and one kernel per token for the RMS factor, sigmoids, softmax and all
Sinkhorn iterations in registers; collapse + RMSNorm is one kernel (one threadgroup per
token); expand is one elementwise kernel.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels.dialect import Kernel, backend, constant

PROJECT_THREADS = 256
PROJECT_TARGET_THREADGROUPS = 128
PROJECT_MIN_CHUNK = 1024
ROW_THREADS = 256


def hc_mixes_reference(streams, fn, scale, base, norm_eps, hc_eps, iterations=20):
    """Plain-MLX definition; see `hc_mixes`."""
    hc = streams.shape[-2]
    x = streams.reshape(*streams.shape[:-2], -1).astype(mx.float32)
    r = mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + norm_eps)
    m = (x @ fn.T) * r
    pre = mx.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * mx.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    c = mx.softmax(c, axis=-1, precise=True) + hc_eps
    c = c / (mx.sum(c, axis=-2, keepdims=True) + hc_eps)
    for _ in range(iterations - 1):
        c = c / (mx.sum(c, axis=-1, keepdims=True) + hc_eps)
        c = c / (mx.sum(c, axis=-2, keepdims=True) + hc_eps)
    return pre, post, c


def hc_collapse_norm_reference(streams, pre, weight, eps):
    """Plain-MLX definition; see `hc_collapse_norm`."""
    collapsed = mx.sum(pre[..., None] * streams.astype(mx.float32), axis=-2).astype(streams.dtype)
    h = collapsed.astype(mx.float32)
    h = h * mx.rsqrt(mx.mean(h * h, axis=-1, keepdims=True) + eps)
    return (h * weight.astype(mx.float32)).astype(streams.dtype)


def hc_expand_reference(y, residual, post, comb):
    """Plain-MLX definition; see `hc_expand`."""
    mixed = comb.swapaxes(-1, -2) @ residual.astype(mx.float32)
    return (post[..., None] * y[..., None, :].astype(mx.float32) + mixed).astype(residual.dtype)


_PROJECT_BODY = r"""
  // grid (THREADS, splits, tokens): partial sums of the NM projections and of x^2 over one chunk.
  constexpr int K = HC * D;
  constexpr int NM = HC * (2 + HC);
  const int qi = group_z, split = group_y;
  const int k_end = min(K, (split + 1) * CHUNK);
  float acc[NM + 1];
  for (int o = 0; o <= NM; ++o) acc[o] = 0.0f;
  for (int k = split * CHUNK + (int)tid; k < k_end; k += (int)group_threads) {
    const float x = float(streams[(size_t)qi * K + k]);
    acc[NM] += x * x;
    for (int o = 0; o < NM; ++o) acc[o] += x * fn[(size_t)o * K + k];
  }
  SHARED float red[32][NM + 1];
  for (int o = 0; o <= NM; ++o) {
    const float v = simd_sum_f(acc[o]);
    if (lane == 0) red[warp][o] = v;
  }
  BARRIER();
  if ((int)tid <= NM) {
    float v = 0.0f;
    for (uint32_t w = 0; w < group_threads / 32; ++w) v += red[w][tid];
    partial[((size_t)qi * SPLITS + split) * (NM + 1) + tid] = v;
  }
"""

_SINKHORN_BODY = r"""
  // grid (32, 1, tokens): one SIMD group per token; lane 0 runs the 4x4 Sinkhorn in registers.
  constexpr int K = HC * D;
  constexpr int NM = HC * (2 + HC);
  const int qi = group_z;
  const float norm_eps = params[0], hc_eps = params[1];
  SHARED float mv[NM + 1];
  for (int o = (int)tid; o <= NM; o += 32) {
    float v = 0.0f;
    for (int s = 0; s < SPLITS; ++s) v += partial[((size_t)qi * SPLITS + s) * (NM + 1) + o];
    mv[o] = v;
  }
  BARRIER();
  if (tid == 0) {
    const float r = RSQRT(mv[NM] / (float)K + norm_eps);
    for (int c = 0; c < HC; ++c) {
      pre[qi * HC + c] = 1.0f / (1.0f + EXP(-(mv[c] * r * scale[0] + base[c]))) + hc_eps;
      post[qi * HC + c] = 2.0f / (1.0f + EXP(-(mv[HC + c] * r * scale[1] + base[HC + c])));
    }
    float C[HC][HC];
    for (int i = 0; i < HC; ++i) {
      float top = -INFINITY;
      for (int j = 0; j < HC; ++j) {
        C[i][j] = mv[2 * HC + HC * i + j] * r * scale[2] + base[2 * HC + HC * i + j];
        top = FMAX(top, C[i][j]);
      }
      float sum = 0.0f;
      for (int j = 0; j < HC; ++j) { C[i][j] = EXP(C[i][j] - top); sum += C[i][j]; }
      for (int j = 0; j < HC; ++j) C[i][j] = C[i][j] / sum + hc_eps;
    }
    for (int it = 0; it < ITERS; ++it) {
      if (it > 0) {
        for (int i = 0; i < HC; ++i) {
          float sum = 0.0f;
          for (int j = 0; j < HC; ++j) sum += C[i][j];
          for (int j = 0; j < HC; ++j) C[i][j] = C[i][j] / (sum + hc_eps);
        }
      }
      for (int j = 0; j < HC; ++j) {
        float sum = 0.0f;
        for (int i = 0; i < HC; ++i) sum += C[i][j];
        for (int i = 0; i < HC; ++i) C[i][j] = C[i][j] / (sum + hc_eps);
      }
    }
    for (int i = 0; i < HC; ++i)
      for (int j = 0; j < HC; ++j) comb[(qi * HC + i) * HC + j] = C[i][j];
  }
"""

_COLLAPSE_NORM_BODY = r"""
  // grid (256, tokens, 1): h = round(sum_c pre_c X_c); out = round(w * h * rsqrt(mean(h^2) + eps)).
  constexpr int EPT = (D + 255) / 256;
  const int qi = group_y;
  float p[HC];
  for (int c = 0; c < HC; ++c) p[c] = pre[qi * HC + c];
  float h[EPT];
  float ss = 0.0f;
  for (int e = 0; e < EPT; ++e) {
    const int d = (int)tid + 256 * e;
    h[e] = 0.0f;
    if (d < D) {
      float v = 0.0f;
      for (int c = 0; c < HC; ++c) v += p[c] * float(streams[((size_t)qi * HC + c) * D + d]);
      h[e] = float(static_cast<T>(v));
      ss += h[e] * h[e];
    }
  }
  SHARED float red[8];
  ss = simd_sum_f(ss);
  if (lane == 0) red[warp] = ss;
  BARRIER();
  float total = 0.0f;
  for (int w = 0; w < 8; ++w) total += red[w];
  const float n = RSQRT(total / (float)D + params[0]);
  for (int e = 0; e < EPT; ++e) {
    const int d = (int)tid + 256 * e;
    if (d < D) out[(size_t)qi * D + d] = static_cast<T>(float(weight[d]) * (h[e] * n));
  }
"""

_EXPAND_BODY = r"""
  // grid (D rounded up to 256, tokens, 1): out_j = post_j y + sum_i comb[i][j] R_i, in fp32.
  const int d = (int)(group_x * group_threads + tid);
  if (d >= D) return;
  const int qi = group_y;
  float r[HC];
  for (int i = 0; i < HC; ++i) r[i] = float(residual[((size_t)qi * HC + i) * D + d]);
  const float yv = float(y[(size_t)qi * D + d]);
  for (int j = 0; j < HC; ++j) {
    float v = post[qi * HC + j] * yv;
    for (int i = 0; i < HC; ++i) v += comb[(qi * HC + i) * HC + j] * r[i];
    out[((size_t)qi * HC + j) * D + d] = static_cast<T>(v);
  }
"""

_F = mx.float32
PROJECT_KERNEL = Kernel(
    name="dsv4_hc_project", input_names=("streams", "fn"), output_names=("partial",),
    body=_PROJECT_BODY,
    checks=(((mx.bfloat16, _F), (_F,), (("T", mx.bfloat16), ("HC", 4), ("D", 5120), ("SPLITS", 20), ("CHUNK", 1024))),
            ((_F, _F), (_F,), (("T", _F), ("HC", 4), ("D", 96), ("SPLITS", 1), ("CHUNK", 384)))))
SINKHORN_KERNEL = Kernel(
    name="dsv4_hc_sinkhorn", input_names=("partial", "scale", "base", "params"),
    output_names=("pre", "post", "comb"), body=_SINKHORN_BODY,
    checks=(((_F, _F, _F, _F), (_F, _F, _F), (("HC", 4), ("D", 5120), ("ITERS", 20), ("SPLITS", 20))),))
COLLAPSE_NORM_KERNEL = Kernel(
    name="dsv4_hc_collapse_norm", input_names=("streams", "pre", "weight", "params"),
    output_names=("out",), body=_COLLAPSE_NORM_BODY,
    checks=(((mx.bfloat16, _F, mx.bfloat16, _F), (mx.bfloat16,), (("T", mx.bfloat16), ("HC", 4), ("D", 5120))),
            ((mx.bfloat16, _F, _F, _F), (mx.bfloat16,), (("T", mx.bfloat16), ("HC", 4), ("D", 5120))),
            ((_F, _F, _F, _F), (_F,), (("T", _F), ("HC", 4), ("D", 100)))))
EXPAND_KERNEL = Kernel(
    name="dsv4_hc_expand", input_names=("y", "residual", "post", "comb"), output_names=("out",),
    body=_EXPAND_BODY,
    checks=(((mx.bfloat16, mx.bfloat16, _F, _F), (mx.bfloat16,), (("T", mx.bfloat16), ("HC", 4), ("D", 5120))),
            ((_F, _F, _F, _F), (_F,), (("T", _F), ("HC", 4), ("D", 100)))))


def _float32(a):
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def _use_kernel(dtype) -> bool:
    return bool(flags.get("kernel_mhc")) and backend() is not None and dtype in (
        mx.bfloat16, mx.float16, mx.float32)


@functools.lru_cache(maxsize=None)
def _compiled_mixes_reference(norm_eps: float, hc_eps: float, iterations: int):
    # ~90 tiny element-wise ops per site (20 Sinkhorn rounds) as one compiled graph.
    return mx.compile(functools.partial(hc_mixes_reference, norm_eps=norm_eps, hc_eps=hc_eps,
                                        iterations=iterations))


def hc_mixes(streams, fn, scale, base, norm_eps, hc_eps, iterations=20):
    """The three mixes of one mHC site from the streams entering it.

    streams [B, S, hc, D]; fn [hc*(2+hc), hc*D] fp32; scale [3] fp32; base [hc*(2+hc)] fp32.
    Returns pre [B, S, hc], post [B, S, hc], comb [B, S, hc, hc], all fp32: pre = sigmoid + eps,
    post = 2 sigmoid, comb = Sinkhorn(softmax) with `iterations` column normalisations.
    """
    if not _use_kernel(streams.dtype):
        if flags.get("compile"):
            return _compiled_mixes_reference(float(norm_eps), float(hc_eps), int(iterations))(
                streams, fn, scale, base)
        return hc_mixes_reference(streams, fn, scale, base, norm_eps, hc_eps, iterations)
    *lead, hc, D = streams.shape
    tokens = math.prod(lead)
    K = hc * D
    splits = max(1, min(math.ceil(PROJECT_TARGET_THREADGROUPS / tokens), K // PROJECT_MIN_CHUNK))
    splits = 1 << (splits.bit_length() - 1)   # a power of two: few compiled variants
    chunk = math.ceil(K / splits)
    nm = hc * (2 + hc)
    (partial,) = PROJECT_KERNEL(
        inputs=[streams, _float32(fn)], output_shapes=[(tokens * splits * (nm + 1),)],
        output_dtypes=[mx.float32], grid=(PROJECT_THREADS, splits, tokens),
        threadgroup=(PROJECT_THREADS, 1, 1),
        template=[("T", streams.dtype), ("HC", hc), ("D", D), ("SPLITS", splits), ("CHUNK", chunk)])
    pre, post, comb = SINKHORN_KERNEL(
        inputs=[partial, _float32(scale), _float32(base), constant((float(norm_eps), float(hc_eps)))],
        output_shapes=[(*lead, hc), (*lead, hc), (*lead, hc, hc)], output_dtypes=[mx.float32] * 3,
        grid=(32, 1, tokens), threadgroup=(32, 1, 1),
        template=[("HC", hc), ("D", D), ("ITERS", iterations), ("SPLITS", splits)])
    return pre, post, comb


def hc_collapse_norm(streams, pre, weight, eps):
    """RMSNorm of the collapse sum_c pre_c X_c (fp32 sum rounded to the streams' dtype).

    streams [B, S, hc, D]; pre [B, S, hc] fp32; weight [D] (any float dtype). Returns
    [B, S, D] in the streams' dtype: w * h * rsqrt(mean(h^2) + eps) in fp32, rounded once
    (dsv4.attention.RMSNorm's formula, the official one).
    """
    if not _use_kernel(streams.dtype) or weight.dtype not in (mx.bfloat16, mx.float16, mx.float32):
        return hc_collapse_norm_reference(streams, pre, weight, eps)
    *lead, hc, D = streams.shape
    tokens = math.prod(lead)
    (out,) = COLLAPSE_NORM_KERNEL(
        inputs=[streams, _float32(pre), weight, constant((float(eps),))],
        output_shapes=[(*lead, D)], output_dtypes=[streams.dtype],
        grid=(ROW_THREADS, tokens, 1), threadgroup=(ROW_THREADS, 1, 1),
        template=[("T", streams.dtype), ("HC", hc), ("D", D)])
    return out


def hc_expand(y, residual, post, comb):
    """New streams X'_j = post_j y + sum_i comb[i, j] R_i, computed in fp32.

    y [B, S, D] (sublayer output); residual [B, S, hc, D] (streams that entered the site);
    post [B, S, hc], comb [B, S, hc, hc] fp32. Returns [B, S, hc, D] in the residual's dtype.
    """
    if not _use_kernel(residual.dtype) or y.dtype != residual.dtype:
        return hc_expand_reference(y, residual, post, comb)
    *lead, hc, D = residual.shape
    tokens = math.prod(lead)
    (out,) = EXPAND_KERNEL(
        inputs=[y, residual, _float32(post), _float32(comb)],
        output_shapes=[residual.shape], output_dtypes=[residual.dtype],
        grid=(math.ceil(D / ROW_THREADS) * ROW_THREADS, tokens, 1), threadgroup=(ROW_THREADS, 1, 1),
        template=[("T", residual.dtype), ("HC", hc), ("D", D)])
    return out
