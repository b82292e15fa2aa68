"""mHC (manifold-constrained hyper-connections) ops, model-spec §2.2: mixes, collapse + RMSNorm, expand.

Streams are [B, S, hc, D] (bf16 in the model, hc = 4). Each op has a plain-MLX reference and
a kernel; the dispatchers `hc_mixes`, `hc_collapse_norm`, `hc_mixes_collapse_norm` (both of
a site's entry ops on the same streams) and `hc_expand` pick one.

Kernels: the mixes are one split-K projection kernel (many threadgroups share the 2 MB fp32
projection at decode) and one SIMD group per token for the RMS factor, sigmoids, softmax and
all Sinkhorn iterations in registers (one comb entry per lane); collapse + RMSNorm is one
kernel (one threadgroup per token). A site's collapse + RMSNorm can instead ride along in the
Sinkhorn kernel (8 more SIMD groups per token): two launches for the site's entry instead of
three. Expand is one elementwise kernel.
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


def hc_collapse_norm_reference(streams, pre, weight, eps, shape=None):
    """Plain-MLX definition; see `hc_collapse_norm`."""
    pre = pre.reshape(streams.shape[:-1])   # the same tokens, maybe laid out otherwise
    collapsed = mx.sum(pre[..., None] * streams.astype(mx.float32), axis=-2).astype(streams.dtype)
    h = collapsed.astype(mx.float32)
    h = h * mx.rsqrt(mx.mean(h * h, axis=-1, keepdims=True) + eps)
    out = (h * weight.astype(mx.float32)).astype(streams.dtype)
    return out if shape is None else out.reshape(shape)


def hc_expand_reference(y, residual, post, comb):
    """Plain-MLX definition; see `hc_expand`."""
    y = y.reshape(*residual.shape[:-2], y.shape[-1])   # the same tokens, maybe laid out otherwise
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

_ROW_HEADER = r"""
KFN float shuffle_f(float v, int src) { return AS_FLOAT((uint32_t)simd_shuffle_i((int)AS_UINT(v), src)); }

// pre/post/comb of token qi from its HC*(2+HC) projections and sum of squares mv[NM], by one
// whole SIMD group (HC*HC <= 32): the RMS factor, sigmoids, row softmax and ITERS Sinkhorn
// column normalisations. Lane i*HC+j holds comb[i][j] (lanes past HC*HC repeat the first
// ones); each row/column sum gathers its HC entries by shuffles and adds them in index order,
// as one thread looping over the matrix would.
template <int HC, int D, int ITERS, typename PM, typename PF, typename PO>
KFN void mixes_from_projections(PM mv, PF scale, PF base, float norm_eps, float hc_eps, int qi,
                                uint32_t lane, PO pre, PO post, PO comb) {
  constexpr int K = HC * D;
  constexpr int NM = HC * (2 + HC);
  const float r = RSQRT(mv[NM] / (float)K + norm_eps);
  if ((int)lane < HC) {
    const int c = (int)lane;
    pre[qi * HC + c] = 1.0f / (1.0f + EXP(-(mv[c] * r * scale[0] + base[c]))) + hc_eps;
    post[qi * HC + c] = 2.0f / (1.0f + EXP(-(mv[HC + c] * r * scale[1] + base[HC + c])));
  }
  const int l = (int)lane % (HC * HC), i = l / HC, j = l % HC;
  float v = mv[2 * HC + l] * r * scale[2] + base[2 * HC + l];
  float top = -INFINITY;
  for (int k = 0; k < HC; ++k) top = FMAX(top, shuffle_f(v, i * HC + k));
  v = EXP(v - top);
  float sum = 0.0f;
  for (int k = 0; k < HC; ++k) sum += shuffle_f(v, i * HC + k);
  v = v / sum + hc_eps;
  for (int it = 0; it < ITERS; ++it) {
    if (it > 0) {
      sum = 0.0f;
      for (int k = 0; k < HC; ++k) sum += shuffle_f(v, i * HC + k);
      v = v / (sum + hc_eps);
    }
    sum = 0.0f;
    for (int k = 0; k < HC; ++k) sum += shuffle_f(v, k * HC + j);
    v = v / (sum + hc_eps);
  }
  if ((int)lane < HC * HC) comb[qi * HC * HC + l] = v;
}

// Collapse of token qi by 256 threads: h[e] = round(sum_c pre_c X_c) at d = tid + 256 e
// (0 past D); returns this thread's sum of h^2.
template <typename T, int HC, int D, typename PX, typename PP>
KFN float collapse_part(PX streams, PP pre, int qi, uint32_t tid, LOCAL float* h) {
  float p[HC];
  for (int c = 0; c < HC; ++c) p[c] = pre[qi * HC + c];
  float ss = 0.0f;
  for (int e = 0; e < (D + 255) / 256; ++e) {
    const int d = (int)tid + 256 * e;
    h[e] = 0.0f;
    if (d < D) {
      float v = 0.0f;
      for (int c = 0; c < HC; ++c) v += p[c] * float(streams[((size_t)qi * HC + c) * D + d]);
      h[e] = float(static_cast<T>(v));
      ss += h[e] * h[e];
    }
  }
  return ss;
}

// out = round(w * h * rsqrt(mean(h^2) + eps)), the sum of h^2 given per SIMD group in red[8].
template <typename T, int D, typename PR, typename PW, typename PO>
KFN void norm_part(PR red, float eps, PW weight, int qi, uint32_t tid, LOCAL const float* h,
                   PO out) {
  float total = 0.0f;
  for (int w = 0; w < 8; ++w) total += red[w];
  const float n = RSQRT(total / (float)D + eps);
  for (int e = 0; e < (D + 255) / 256; ++e) {
    const int d = (int)tid + 256 * e;
    if (d < D) out[(size_t)qi * D + d] = static_cast<T>(float(weight[d]) * (h[e] * n));
  }
}
"""

_SINKHORN_BODY = r"""
  // grid (32, 1, tokens): one SIMD group per token runs the 4x4 Sinkhorn in registers.
  constexpr int NM = HC * (2 + HC);
  const int qi = group_z;
  SHARED float mv[NM + 1];
  for (int o = (int)tid; o <= NM; o += 32) {
    float v = 0.0f;
    for (int s = 0; s < SPLITS; ++s) v += partial[((size_t)qi * SPLITS + s) * (NM + 1) + o];
    mv[o] = v;
  }
  BARRIER();
  mixes_from_projections<HC, D, ITERS>(mv, scale, base, params[0], params[1], qi, lane, pre, post, comb);
"""

_COLLAPSE_NORM_BODY = r"""
  // grid (256, tokens, 1): h = round(sum_c pre_c X_c); out = round(w * h * rsqrt(mean(h^2) + eps)).
  const int qi = group_y;
  float h[(D + 255) / 256];
  SHARED float red[8];
  const float ss = simd_sum_f(collapse_part<T, HC, D>(streams, pre, qi, tid, h));
  if (lane == 0) red[warp] = ss;
  BARRIER();
  norm_part<T, D>(red, params[0], weight, qi, tid, h, out);
"""

_SINKHORN_COLLAPSE_NORM_BODY = r"""
  // grid (288, tokens, 1): SIMD groups 0-7 collapse token qi with the previous site's pre and
  // RMS-normalise it (as the collapse kernel); SIMD group 8 meanwhile sums the projection
  // partials and runs the Sinkhorn (as the Sinkhorn kernel).
  constexpr int NM = HC * (2 + HC);
  const int qi = group_y;
  const bool mixer = warp == 8;
  float h[(D + 255) / 256];
  SHARED float red[8];
  SHARED float mv[NM + 1];
  if (!mixer) {
    const float ss = simd_sum_f(collapse_part<T, HC, D>(streams, pre_in, qi, tid, h));
    if (lane == 0) red[warp] = ss;
  } else {
    for (int o = (int)lane; o <= NM; o += 32) {
      float v = 0.0f;
      for (int s = 0; s < SPLITS; ++s) v += partial[((size_t)qi * SPLITS + s) * (NM + 1) + o];
      mv[o] = v;
    }
  }
  BARRIER();
  if (!mixer)
    norm_part<T, D>(red, params[2], weight, qi, tid, h, out);
  else
    mixes_from_projections<HC, D, ITERS>(mv, scale, base, params[0], params[1], qi, lane, pre, post, comb);
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
    output_names=("pre", "post", "comb"), body=_SINKHORN_BODY, header=_ROW_HEADER,
    checks=(((_F, _F, _F, _F), (_F, _F, _F), (("HC", 4), ("D", 5120), ("ITERS", 20), ("SPLITS", 20))),))
COLLAPSE_NORM_KERNEL = Kernel(
    name="dsv4_hc_collapse_norm", input_names=("streams", "pre", "weight", "params"),
    output_names=("out",), body=_COLLAPSE_NORM_BODY, header=_ROW_HEADER,
    checks=(((mx.bfloat16, _F, mx.bfloat16, _F), (mx.bfloat16,), (("T", mx.bfloat16), ("HC", 4), ("D", 5120))),
            ((mx.bfloat16, _F, _F, _F), (mx.bfloat16,), (("T", mx.bfloat16), ("HC", 4), ("D", 5120))),
            ((_F, _F, _F, _F), (_F,), (("T", _F), ("HC", 4), ("D", 100)))))
SINKHORN_COLLAPSE_NORM_KERNEL = Kernel(
    name="dsv4_hc_sinkhorn_collapse_norm",
    input_names=("partial", "scale", "base", "params", "streams", "pre_in", "weight"),
    output_names=("pre", "post", "comb", "out"), body=_SINKHORN_COLLAPSE_NORM_BODY, header=_ROW_HEADER,
    checks=(((_F, _F, _F, _F, mx.bfloat16, _F, mx.bfloat16), (_F, _F, _F, mx.bfloat16),
             (("T", mx.bfloat16), ("HC", 4), ("D", 5120), ("ITERS", 20), ("SPLITS", 16))),
            ((_F,) * 7, (_F,) * 4, (("T", _F), ("HC", 4), ("D", 100), ("ITERS", 20), ("SPLITS", 1)))))
EXPAND_KERNEL = Kernel(
    name="dsv4_hc_expand", input_names=("y", "residual", "post", "comb"), output_names=("out",),
    body=_EXPAND_BODY,
    checks=(((mx.bfloat16, mx.bfloat16, _F, _F), (mx.bfloat16,), (("T", mx.bfloat16), ("HC", 4), ("D", 5120))),
            ((_F, _F, _F, _F), (_F,), (("T", _F), ("HC", 4), ("D", 100)))))


def _float32(a):
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def _use_kernel(dtype, hc=4) -> bool:
    # hc * hc <= 32: the Sinkhorn holds one comb entry per lane of a SIMD group.
    return bool(flags.get("kernel_mhc")) and backend() is not None and hc * hc <= 32 and dtype in (
        mx.bfloat16, mx.float16, mx.float32)


@functools.lru_cache(maxsize=None)
def _compiled_mixes_reference(norm_eps: float, hc_eps: float, iterations: int):
    # ~90 tiny element-wise ops per site (20 Sinkhorn rounds) as one compiled graph.
    return mx.compile(functools.partial(hc_mixes_reference, norm_eps=norm_eps, hc_eps=hc_eps,
                                        iterations=iterations))


def _project(streams, fn):
    """Launch the split-K projection kernel; returns (partial sums, splits)."""
    *lead, hc, D = streams.shape
    tokens = math.prod(lead)
    splits = max(1, min(math.ceil(PROJECT_TARGET_THREADGROUPS / tokens), hc * D // PROJECT_MIN_CHUNK))
    splits = 1 << (splits.bit_length() - 1)   # a power of two: few compiled variants
    nm = hc * (2 + hc)
    (partial,) = PROJECT_KERNEL(
        inputs=[streams, _float32(fn)], output_shapes=[(tokens * splits * (nm + 1),)],
        output_dtypes=[mx.float32], grid=(PROJECT_THREADS, splits, tokens),
        threadgroup=(PROJECT_THREADS, 1, 1),
        template=[("T", streams.dtype), ("HC", hc), ("D", D), ("SPLITS", splits),
                  ("CHUNK", math.ceil(hc * D / splits))])
    return partial, splits


def hc_mixes(streams, fn, scale, base, norm_eps, hc_eps, iterations=20):
    """The three mixes of one mHC site from the streams entering it.

    streams [B, S, hc, D]; fn [hc*(2+hc), hc*D] fp32; scale [3] fp32; base [hc*(2+hc)] fp32.
    Returns pre [B, S, hc], post [B, S, hc], comb [B, S, hc, hc], all fp32: pre = sigmoid + eps,
    post = 2 sigmoid, comb = Sinkhorn(softmax) with `iterations` column normalisations.
    """
    if not _use_kernel(streams.dtype, streams.shape[-2]):
        if flags.get("compile"):
            return _compiled_mixes_reference(float(norm_eps), float(hc_eps), int(iterations))(
                streams, fn, scale, base)
        return hc_mixes_reference(streams, fn, scale, base, norm_eps, hc_eps, iterations)
    *lead, hc, D = streams.shape
    partial, splits = _project(streams, fn)
    pre, post, comb = SINKHORN_KERNEL(
        inputs=[partial, _float32(scale), _float32(base), constant((float(norm_eps), float(hc_eps)))],
        output_shapes=[(*lead, hc), (*lead, hc), (*lead, hc, hc)], output_dtypes=[mx.float32] * 3,
        grid=(32, 1, math.prod(lead)), threadgroup=(32, 1, 1),
        template=[("HC", hc), ("D", D), ("ITERS", iterations), ("SPLITS", splits)])
    return pre, post, comb


def hc_collapse_norm(streams, pre, weight, eps, shape=None):
    """RMSNorm of the collapse sum_c pre_c X_c (fp32 sum rounded to the streams' dtype).

    streams [B, S, hc, D]; pre [B, S, hc] fp32; weight [D] (any float dtype). Returns
    [B, S, D] in the streams' dtype: w * h * rsqrt(mean(h^2) + eps) in fp32, rounded once
    (dsv4.attention.RMSNorm's formula, the official one). The tokens may be laid out otherwise
    (flat: streams [B*S, hc, D]), pre's apart from the streams'; the result has the streams'
    or `shape` (e.g. [B, S, D] from flat streams: the kernel writes it so, no reshape).
    """
    if not _use_kernel(streams.dtype) or weight.dtype not in (mx.bfloat16, mx.float16, mx.float32):
        return hc_collapse_norm_reference(streams, pre, weight, eps, shape)
    *lead, hc, D = streams.shape
    tokens = math.prod(lead)
    (out,) = COLLAPSE_NORM_KERNEL(
        inputs=[streams, _float32(pre), weight, constant((float(eps),))],
        output_shapes=[shape or (*lead, D)], output_dtypes=[streams.dtype],
        grid=(ROW_THREADS, tokens, 1), threadgroup=(ROW_THREADS, 1, 1),
        template=[("T", streams.dtype), ("HC", hc), ("D", D)])
    return out


def hc_mixes_collapse_norm_reference(streams, pre_in, fn, scale, base, norm_weight, rms_eps,
                                     norm_eps, hc_eps, iterations=20, x_shape=None):
    """Plain-MLX definition; see `hc_mixes_collapse_norm`."""
    x = hc_collapse_norm_reference(streams, pre_in, norm_weight, rms_eps, x_shape)
    return (x, *hc_mixes_reference(streams, fn, scale, base, norm_eps, hc_eps, iterations))


def hc_mixes_collapse_norm(streams, pre_in, fn, scale, base, norm_weight, rms_eps, norm_eps,
                           hc_eps, iterations=20, x_shape=None):
    """One mHC site's entry: the sublayer input and this site's mixes, from the same streams.

    x = hc_collapse_norm(streams, pre_in, norm_weight, rms_eps), where pre_in is the previous
    site's pre (in any layout of the streams' tokens); (pre, post, comb) = hc_mixes(streams, fn, scale, base, norm_eps, hc_eps,
    iterations). Returns (x, pre, post, comb), shapes and dtypes as those two give them (x
    laid out as `x_shape` if given). On the kernel path two launches instead of three: the
    projection, then one kernel that collapses and normalises while one of its SIMD groups
    finishes the mixes.
    """
    float_weight = norm_weight.dtype in (mx.bfloat16, mx.float16, mx.float32)
    if not _use_kernel(streams.dtype, streams.shape[-2]) or not float_weight:
        x = hc_collapse_norm(streams, pre_in, norm_weight, rms_eps, x_shape)
        return (x, *hc_mixes(streams, fn, scale, base, norm_eps, hc_eps, iterations))
    *lead, hc, D = streams.shape
    partial, splits = _project(streams, fn)
    pre, post, comb, x = SINKHORN_COLLAPSE_NORM_KERNEL(
        inputs=[partial, _float32(scale), _float32(base),
                constant((float(norm_eps), float(hc_eps), float(rms_eps))), streams,
                _float32(pre_in), norm_weight],
        output_shapes=[(*lead, hc), (*lead, hc), (*lead, hc, hc), x_shape or (*lead, D)],
        output_dtypes=[mx.float32] * 3 + [streams.dtype],
        grid=(ROW_THREADS + 32, math.prod(lead), 1), threadgroup=(ROW_THREADS + 32, 1, 1),
        template=[("T", streams.dtype), ("HC", hc), ("D", D), ("ITERS", iterations), ("SPLITS", splits)])
    return x, pre, post, comb


def hc_expand(y, residual, post, comb):
    """New streams X'_j = post_j y + sum_i comb[i, j] R_i, computed in fp32.

    y [B, S, D] (sublayer output); residual [B, S, hc, D] (streams that entered the site);
    post [B, S, hc], comb [B, S, hc, hc] fp32. Returns [B, S, hc, D] in the residual's dtype.
    The tokens may be laid out otherwise (flat: residual [B*S, hc, D], post [B*S, hc], ...),
    y's apart from the others' (e.g. [B, S, D] with flat streams): the result has the residual's.
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
