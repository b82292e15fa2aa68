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

At decode those launches ran one threadgroup per token where they reduce (one SM of a GPU's
hundred), and the projection's 2 MB of fp32 on 16-20 threadgroups. DSV4_KERNEL_MHC_WIDE
(`_wide`) gives a site's entry two launches that each spread a token over the whole GPU:
the partials (the projection with 16-byte loads, the sum of squares, and the collapse with
the previous site's pre, its sum of squares) over D / 32 SIMD groups, made by the expand
itself at the FFN site; then the finish, whose threadgroups each normalise 256 columns while
one more reduces the projection and runs the Sinkhorn.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels.dialect import Kernel, backend, constant, falls_back
from dsv4.kernels.qdq import HEADER as QDQ_HEADER
from dsv4.kernels.qdq import kernel_applies as qdq_kernel_applies
from dsv4.quant import qdq_fp8

PROJECT_THREADS = 256
PROJECT_TARGET_THREADGROUPS = 128
PROJECT_MIN_CHUNK = 1024
ROW_THREADS = 256
WIDE_MAX_TOKENS = 8   # decode and verify; prefill keeps the per-token launches
TILE_TOKENS = 4        # tokens per threadgroup of the prefill projection (DSV4_KERNEL_MHC_TILES)
TILES_MIN_TOKENS = 64  # fewer tokens (decode, verify) keep a threadgroup per token


class Projection(NamedTuple):
    """What `hc_expand` with the next site's fn hands that site's entry: the projection partials
    (`splits` per token) and, from the wide path, the new streams' collapse with the site's
    pre_in (else None)."""
    partial: mx.array
    splits: int
    collapsed: Optional[mx.array] = None


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


def hc_expand_reference(y, residual, post, comb, fn=None, pre=None):
    """Plain-MLX definition; see `hc_expand` (with fn: (streams, None), no projection made;
    `pre` is not used)."""
    y = y.reshape(*residual.shape[:-2], y.shape[-1])   # the same tokens, maybe laid out otherwise
    mixed = comb.swapaxes(-1, -2) @ residual.astype(mx.float32)
    out = (post[..., None] * y[..., None, :].astype(mx.float32) + mixed).astype(residual.dtype)
    return out if fn is None else (out, None)


_STREAM_HEADER = r"""
// Threadgroup sums of each thread's N partials (acc), SIMD groups added in index order,
// written to dst[0..N) by threads 0..N-1. red: warps x N floats of threadgroup memory. Every
// thread of the threadgroup must call it (it has a barrier).
template <int N, typename PR, typename PD>
KFN void store_partials(LOCAL const float* acc, PR red, uint32_t lane, uint32_t warp, uint32_t tid,
                        uint32_t warps, PD dst) {
  for (int o = 0; o < N; ++o) {
    const float v = simd_sum_f(acc[o]);
    if (lane == 0) red[warp * N + o] = v;
  }
  BARRIER();
  if ((int)tid < N) {
    float v = 0.0f;
    for (uint32_t w = 0; w < warps; ++w) v += red[w * N + tid];
    dst[tid] = v;
  }
}

// Stream j of the expand of token qi at one column, in fp32 (before its rounding):
// post_j y + sum_i comb[i][j] R_i, from r[i] = R_i and yv = y at that column.
template <int HC, typename PP>
KFN float expand_stream(LOCAL const float* r, float yv, PP post, PP comb, int qi, int j) {
  float v = post[qi * HC + j] * yv;
  for (int i = 0; i < HC; ++i) v += comb[(qi * HC + i) * HC + j] * r[i];
  return v;
}

// Expand of column d of token qi: out_j = post_j y + sum_i comb[i][j] R_i in fp32, stored in
// T; stored[j] gets the stored values back.
template <typename T, int HC, int D, typename PY, typename PP, typename PO>
KFN void expand_column(PY y, PY residual, PP post, PP comb, int qi, int d, PO out, LOCAL float* stored) {
  float r[HC];
  for (int i = 0; i < HC; ++i) r[i] = float(residual[((size_t)qi * HC + i) * D + d]);
  const float yv = float(y[(size_t)qi * D + d]);
  for (int j = 0; j < HC; ++j) {
    const T value = static_cast<T>(expand_stream<HC>(r, yv, post, comb, qi, j));
    out[((size_t)qi * HC + j) * D + d] = value;
    stored[j] = float(value);
  }
}
"""

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
  SHARED float red[32 * (NM + 1)];
  store_partials<NM + 1>(acc, red, lane, warp, tid, group_threads / 32,
                     partial + ((size_t)qi * SPLITS + split) * (NM + 1));
"""

# The projection of TT tokens per threadgroup (prefill, DSV4_KERNEL_MHC_TILES): each thread loads
# fn's NM values at its k once for the TT tokens, where _PROJECT_BODY's threadgroup per token
# reads the whole 2 MB of fn per token (from L2: what bounds it at prefill). A token's sums are
# _PROJECT_BODY's, in the same order (the same threads, splits and chunks): bit for bit.
_PROJECT_TILES_BODY = r"""
  // grid (THREADS, splits, ceil(tokens / TT)); params[0] = tokens.
  constexpr int K = HC * D;
  constexpr int NM = HC * (2 + HC);
  const int split = group_y, t0 = group_z * TT, tokens = (int)params[0];
  const int k_end = min(K, (split + 1) * CHUNK);
  float acc[TT][NM + 1];
  for (int t = 0; t < TT; ++t)
    for (int o = 0; o <= NM; ++o) acc[t][o] = 0.0f;
  for (int k = split * CHUNK + (int)tid; k < k_end; k += (int)group_threads) {
    float f[NM];
    for (int o = 0; o < NM; ++o) f[o] = fn[(size_t)o * K + k];
    for (int t = 0; t < TT; ++t) {
      const float x = t0 + t < tokens ? float(streams[(size_t)(t0 + t) * K + k]) : 0.0f;
      acc[t][NM] += x * x;
      for (int o = 0; o < NM; ++o) acc[t][o] += x * f[o];
    }
  }
  SHARED float red[32 * (NM + 1)];
  for (int t = 0; t < TT && t0 + t < tokens; ++t) {
    if (t > 0) BARRIER();   // the last token's sums are read out of red
    store_partials<NM + 1>(acc[t], red, lane, warp, tid, group_threads / 32,
                           partial + ((size_t)(t0 + t) * SPLITS + split) * (NM + 1));
  }
"""

_ROW_HEADER = QDQ_HEADER + r"""
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

// Column d of token qi: out = round(w_d * (h * n)), n the RMS factor; with FP8 also out_q = out
// rounded to e4m3 per 32 values (the 32 lanes of the SIMD group hold one block: they must all call).
template <typename T, int D, bool FP8, typename PW, typename PO>
KFN void norm_store(float h, float n, PW weight, int qi, int d, PO out, PO out_q) {
  const T v = static_cast<T>(float(weight[d]) * (h * n));
  out[(size_t)qi * D + d] = v;
  if (FP8) out_q[(size_t)qi * D + d] = static_cast<T>(qdq_pow2_lane<0>(float(v)));
}

// out = round(w * h * rsqrt(mean(h^2) + eps)), the sum of h^2 given per SIMD group in red[8].
// With FP8, out_q = out rounded to e4m3 per 32 values (qdq.HEADER's qdq_pow2_lane): the 32
// values d = 32 w + 256 e + lane of SIMD group w are one block, whole when D % 32 == 0.
template <typename T, int D, bool FP8, typename PR, typename PW, typename PO>
KFN void norm_part(PR red, float eps, PW weight, int qi, uint32_t tid, LOCAL const float* h,
                   PO out, PO out_q) {
  float total = 0.0f;
  for (int w = 0; w < 8; ++w) total += red[w];
  const float n = RSQRT(total / (float)D + eps);
  for (int e = 0; e < (D + 255) / 256; ++e) {
    const int d = (int)tid + 256 * e;
    if (d < D) norm_store<T, D, FP8>(h[e], n, weight, qi, d, out, out_q);
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
  norm_part<T, D, false>(red, params[0], weight, qi, tid, h, out, out);
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
    norm_part<T, D, FP8_COPY>(red, params[2], weight, qi, tid, h, out, OUT_Q);
  else
    mixes_from_projections<HC, D, ITERS>(mv, scale, base, params[0], params[1], qi, lane, pre, post, comb);
"""

_EXPAND_BODY = r"""
  // grid (D rounded up to 256, tokens, 1): out_j = post_j y + sum_i comb[i][j] R_i, in fp32.
  const int d = (int)(group_x * group_threads + tid);
  if (d >= D) return;
  float stored[HC];
  expand_column<T, HC, D>(y, residual, post, comb, (int)group_y, d, out, stored);
"""

_EXPAND_PROJECT_BODY = r"""
  // grid (D rounded up to 256, tokens, 1): the expand above, and over this threadgroup's 256
  // columns the next site's projection partials (as the projection kernel's): partial[qi, g] =
  // (sum over j, d of X'_j[d] fn[o, j D + d] for the NM mixes o, sum of X'_j[d]^2), of the
  // streams as rounded and stored.
  constexpr int NM = HC * (2 + HC);
  constexpr int K = HC * D;
  const int d = (int)(group_x * group_threads + tid);
  const int qi = group_y;
  float acc[NM + 1];
  for (int o = 0; o <= NM; ++o) acc[o] = 0.0f;
  if (d < D) {
    float stored[HC];
    expand_column<T, HC, D>(y, residual, post, comb, qi, d, out, stored);
    for (int j = 0; j < HC; ++j) {
      const float x = stored[j];
      acc[NM] += x * x;
      for (int o = 0; o < NM; ++o) acc[o] += x * fn[(size_t)o * K + j * D + d];
    }
  }
  SHARED float red[8 * (NM + 1)];
  store_partials<NM + 1>(acc, red, lane, warp, tid, group_threads / 32,
                     partial + ((size_t)qi * SPLITS + group_x) * (NM + 1));
"""

# The wide decode path (DSV4_KERNEL_MHC_WIDE): a site's entry in two launches that both spread
# one token over many threadgroups. First the partials, one SIMD group per 4 * 32 / HC columns
# of all HC streams (each lane one stream's 4 columns: 16-byte loads of fn); then the finish:
# every threadgroup RMS-normalises 256 columns, one more reduces the projection and runs the
# Sinkhorn.
_PARTIALS_BODY = r"""
  // grid (32 * SPLITS, tokens, 1), threadgroup 32: lane j * QW + q holds stream j at the 4
  // columns d..d+3 of quad q. partial[qi, group] = (the NM projections, sum of X^2, sum of h^2)
  // over this group's columns; collapsed[qi, d] = h = round(sum_c pre_c X_c), the collapse
  // with the previous site's pre, which the finish normalises.
  constexpr int K = HC * D;
  constexpr int NM = HC * (2 + HC);
  constexpr int QW = 32 / HC;
  const int qi = group_y;
  const int split = SPLIT_INDEX;
  const int j = (int)lane / QW, q = (int)lane % QW;
  const int d = (split * QW + q) * 4;
  const bool live = d < D;
  float x[4];
  STREAM_VALUES
  float acc[NM + 2];
  for (int o = 0; o < NM + 2; ++o) acc[o] = 0.0f;
  for (int e = 0; e < 4; ++e) acc[NM] += x[e] * x[e];
  if (live)
    for (int o = 0; o < NM; ++o) {
      const uint4 f = LOAD_U4(fn + (size_t)o * K + j * D + d, 0);
      acc[o] += x[0] * AS_FLOAT(f.x);
      acc[o] += x[1] * AS_FLOAT(f.y);
      acc[o] += x[2] * AS_FLOAT(f.z);
      acc[o] += x[3] * AS_FLOAT(f.w);
    }
  float p[HC];
  for (int c = 0; c < HC; ++c) p[c] = pre_in[qi * HC + c];
  for (int e = 0; e < 4; ++e) {
    float v = 0.0f;
    for (int c = 0; c < HC; ++c) v += p[c] * shuffle_f(x[e], c * QW + q);
    const T h = static_cast<T>(v);
    if (j == 0 && live) {
      collapsed[(size_t)qi * D + d + e] = h;
      acc[NM + 1] += float(h) * float(h);
    }
  }
  STORE_PARTIALS
"""
# The partials launch: a threadgroup (one SIMD group) per split.
_PARTIALS_OF_GROUP = {"SPLIT_INDEX": "(int)group_x", "STORE_PARTIALS": r"""SHARED float red[NM + 2];
  store_partials<NM + 2>(acc, red, lane, warp, tid, 1, partial + ((size_t)qi * SPLITS + split) * (NM + 2));"""}


def _filled(body: str, parts: dict) -> str:
    """body with each placeholder of `parts` replaced by its text."""
    for name, text in parts.items():
        body = body.replace(name, text)
    return body


# x[e]: the site's streams as they are.
_LOADED_VALUES = r"""
  for (int e = 0; e < 4; ++e) x[e] = live ? float(streams[((size_t)qi * HC + j) * D + d + e]) : 0.0f;
"""
# x[e]: the new streams of the expand (hc_expand's arithmetic), stored and taken as rounded.
_EXPANDED_VALUES = r"""
  for (int e = 0; e < 4; ++e) {
    x[e] = 0.0f;
    if (live) {
      float r[HC];
      for (int i = 0; i < HC; ++i) r[i] = float(residual[((size_t)qi * HC + i) * D + d + e]);
      const T v = static_cast<T>(expand_stream<HC>(r, float(y[(size_t)qi * D + d + e]), post, comb, qi, j));
      out[((size_t)qi * HC + j) * D + d + e] = v;
      x[e] = float(v);
    }
  }
"""

# The finish's RMS factor n from the sum of h^2 over the partials (each SIMD group sums them
# alike: the same factor everywhere), then one threadgroup's columns (COLUMN_GROUP: which 256).
_FINISH_FACTOR = r"""
    float ss = 0.0f;
    for (int s = (int)lane; s < SPLITS; s += 32) ss += partial[((size_t)qi * SPLITS + s) * (NM + 2) + NM + 1];
    const float n = RSQRT(simd_sum_f(ss) / (float)D + params[2]);
"""
_FINISH_COLUMN = r"""
      const int d = COLUMN_GROUP * 256 + (int)tid;
      if (d < D) norm_store<T, D, FP8_COPY>(float(collapsed[(size_t)qi * D + d]), n, weight, qi, d, X_OUT, OUT_Q);
"""
# The finish's mixes: the projection partials summed (SIMD group w the splits w, w + 8, ...),
# then SIMD group 0 runs the Sinkhorn.
_FINISH_MIXES = r"""
  SHARED float red[8 * (NM + 1)];
  SHARED float mv[NM + 1];
  if ((int)lane <= NM) {
    float v = 0.0f;
    for (int s = (int)warp; s < SPLITS; s += 8) v += partial[((size_t)qi * SPLITS + s) * (NM + 2) + lane];
    red[warp * (NM + 1) + lane] = v;
  }
  BARRIER();
  if ((int)tid <= NM) {
    float v = 0.0f;
    for (int w = 0; w < 8; ++w) v += red[w * (NM + 1) + tid];
    mv[tid] = v;
  }
  BARRIER();
  if (warp == 0)
    mixes_from_projections<HC, D, ITERS>(mv, scale, base, params[0], params[1], qi, lane, MIXES_OUT);
"""
_FINISH_BODY = r"""
  // grid (256 * (ceil(D / 256) + 1), tokens, 1): threadgroup g < ceil(D / 256) normalises
  // columns 256 g + tid of token qi; the last one makes the mixes.
  constexpr int NM = HC * (2 + HC);
  const int qi = group_y;
  if ((int)group_x * 256 < D) {""" + _FINISH_FACTOR + _FINISH_COLUMN.replace("COLUMN_GROUP", "(int)group_x") + r"""    return;
  }""" + _FINISH_MIXES

_F = mx.float32
PROJECT_KERNEL = Kernel(
    name="dsv4_hc_project", input_names=("streams", "fn"), output_names=("partial",),
    body=_PROJECT_BODY, header=_STREAM_HEADER,
    checks=(((mx.bfloat16, _F), (_F,), (("T", mx.bfloat16), ("HC", 4), ("D", 5120), ("SPLITS", 20), ("CHUNK", 1024))),
            ((_F, _F), (_F,), (("T", _F), ("HC", 4), ("D", 96), ("SPLITS", 1), ("CHUNK", 384)))))
PROJECT_TILES_KERNEL = Kernel(
    name="dsv4_hc_project_tiles", input_names=("streams", "fn", "params"), output_names=("partial",),
    body=_PROJECT_TILES_BODY, header=_STREAM_HEADER,
    checks=(((mx.bfloat16, _F, _F), (_F,),
             (("T", mx.bfloat16), ("HC", 4), ("D", 5120), ("SPLITS", 1), ("CHUNK", 20480), ("TT", TILE_TOKENS))),
            ((_F, _F, _F), (_F,), (("T", _F), ("HC", 4), ("D", 96), ("SPLITS", 1), ("CHUNK", 384), ("TT", 3)))))
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
_SINKHORN_COLLAPSE_NORM_CHECKS = (
    ((_F, _F, _F, _F, mx.bfloat16, _F, mx.bfloat16), (_F, _F, _F, mx.bfloat16),
     (("T", mx.bfloat16), ("HC", 4), ("D", 5120), ("ITERS", 20), ("SPLITS", 16))),
    ((_F,) * 7, (_F,) * 4, (("T", _F), ("HC", 4), ("D", 96), ("ITERS", 20), ("SPLITS", 1))))
SINKHORN_COLLAPSE_NORM_KERNEL = Kernel(
    name="dsv4_hc_sinkhorn_collapse_norm",
    input_names=("partial", "scale", "base", "params", "streams", "pre_in", "weight"),
    output_names=("pre", "post", "comb", "out"), header=_ROW_HEADER,
    body=_SINKHORN_COLLAPSE_NORM_BODY.replace("FP8_COPY", "false").replace("OUT_Q", "out"),
    checks=_SINKHORN_COLLAPSE_NORM_CHECKS)
# The same, also writing x rounded to fp8 per 32 values (the attention's wq_a/wkv input).
SINKHORN_COLLAPSE_NORM_FP8_KERNEL = Kernel(
    name="dsv4_hc_sinkhorn_collapse_norm_fp8",
    input_names=("partial", "scale", "base", "params", "streams", "pre_in", "weight"),
    output_names=("pre", "post", "comb", "out", "out_q"), header=_ROW_HEADER,
    body=_SINKHORN_COLLAPSE_NORM_BODY.replace("FP8_COPY", "true").replace("OUT_Q", "out_q"),
    checks=tuple((i, (*o, o[-1]), t) for i, o, t in _SINKHORN_COLLAPSE_NORM_CHECKS))
EXPAND_KERNEL = Kernel(
    name="dsv4_hc_expand", input_names=("y", "residual", "post", "comb"), output_names=("out",),
    body=_EXPAND_BODY, header=_STREAM_HEADER,
    checks=(((mx.bfloat16, mx.bfloat16, _F, _F), (mx.bfloat16,), (("T", mx.bfloat16), ("HC", 4), ("D", 5120))),
            ((_F, _F, _F, _F), (_F,), (("T", _F), ("HC", 4), ("D", 100)))))
EXPAND_PROJECT_KERNEL = Kernel(
    name="dsv4_hc_expand_project", input_names=("y", "residual", "post", "comb", "fn"),
    output_names=("out", "partial"), body=_EXPAND_PROJECT_BODY, header=_STREAM_HEADER,
    checks=(((mx.bfloat16, mx.bfloat16, _F, _F, _F), (mx.bfloat16, _F),
             (("T", mx.bfloat16), ("HC", 4), ("D", 5120), ("SPLITS", 20))),
            ((_F,) * 5, (_F, _F), (("T", _F), ("HC", 4), ("D", 100), ("SPLITS", 1)))))

_WIDE_HEADER = _STREAM_HEADER + _ROW_HEADER
ENTRY_PARTIALS_KERNEL = Kernel(
    name="dsv4_hc_entry_partials", input_names=("streams", "fn", "pre_in"),
    output_names=("partial", "collapsed"), header=_WIDE_HEADER,
    body=_filled(_PARTIALS_BODY, {"STREAM_VALUES": _LOADED_VALUES, **_PARTIALS_OF_GROUP}),
    checks=(((mx.bfloat16, _F, _F), (_F, mx.bfloat16), (("T", mx.bfloat16), ("HC", 4), ("D", 5120), ("SPLITS", 160))),
            ((_F, _F, _F), (_F, _F), (("T", _F), ("HC", 4), ("D", 100), ("SPLITS", 4)))))
EXPAND_PARTIALS_KERNEL = Kernel(
    name="dsv4_hc_expand_partials", input_names=("y", "residual", "post", "comb", "fn", "pre_in"),
    output_names=("out", "partial", "collapsed"), header=_WIDE_HEADER,
    body=_filled(_PARTIALS_BODY, {"STREAM_VALUES": _EXPANDED_VALUES, **_PARTIALS_OF_GROUP}),
    checks=(((mx.bfloat16, mx.bfloat16, _F, _F, _F, _F), (mx.bfloat16, _F, mx.bfloat16),
             (("T", mx.bfloat16), ("HC", 4), ("D", 5120), ("SPLITS", 160))),
            ((_F,) * 6, (_F,) * 3, (("T", _F), ("HC", 4), ("D", 100), ("SPLITS", 4)))))
# The finish's outputs: a site entry's x and mixes.
_ENTRY_OUTPUTS = {"X_OUT": "out", "MIXES_OUT": "pre, post, comb"}
_FINISH_CHECKS = (
    ((_F, _F, _F, _F, mx.bfloat16, mx.bfloat16), (_F, _F, _F, mx.bfloat16),
     (("T", mx.bfloat16), ("HC", 4), ("D", 5120), ("ITERS", 20), ("SPLITS", 160))),
    ((_F,) * 6, (_F,) * 4, (("T", _F), ("HC", 4), ("D", 96), ("ITERS", 20), ("SPLITS", 3))))
ENTRY_FINISH_KERNEL = Kernel(
    name="dsv4_hc_entry_finish", input_names=("partial", "scale", "base", "params", "collapsed", "weight"),
    output_names=("pre", "post", "comb", "out"), header=_ROW_HEADER,
    body=_filled(_FINISH_BODY, {"FP8_COPY": "false", "OUT_Q": "out", **_ENTRY_OUTPUTS}), checks=_FINISH_CHECKS)
# The same, also writing x rounded to fp8 per 32 values (the attention's wq_a/wkv input).
ENTRY_FINISH_FP8_KERNEL = Kernel(
    name="dsv4_hc_entry_finish_fp8", input_names=("partial", "scale", "base", "params", "collapsed", "weight"),
    output_names=("pre", "post", "comb", "out", "out_q"), header=_ROW_HEADER,
    body=_filled(_FINISH_BODY, {"FP8_COPY": "true", "OUT_Q": "out_q", **_ENTRY_OUTPUTS}),
    checks=tuple((i, (*o, o[-1]), t) for i, o, t in _FINISH_CHECKS))



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


def wide_entry(streams) -> bool:
    """The wide decode path applies (switch on, few tokens, quads of columns, whole lanes)."""
    *lead, hc, D = streams.shape
    return (flags.switch("kernel_mhc_wide", backend() == "cuda") and math.prod(lead) <= WIDE_MAX_TOKENS
            and 32 % hc == 0 and D % 4 == 0)


def _column_blocks(hc: int, D: int) -> int:
    """Partials per token on the wide path: one SIMD group per 4 * 32 / hc columns."""
    return math.ceil(D / (128 // hc))


def partials_shape(tokens: int, splits: int, hc: int) -> tuple:
    """The wide path's partials (and the projecting down launch's, experts.py): per token and
    split, the NM projections and two sums of squares."""
    return (tokens * splits * (hc * (2 + hc) + 2),)


def _entry_partials(streams, fn, pre_in) -> Projection:
    *lead, hc, D = streams.shape
    tokens, splits = math.prod(lead), _column_blocks(hc, D)
    partial, collapsed = ENTRY_PARTIALS_KERNEL(
        inputs=[streams, _float32(fn), _float32(pre_in)],
        output_shapes=[partials_shape(tokens, splits, hc), (tokens, D)],
        output_dtypes=[mx.float32, streams.dtype], grid=(32 * splits, tokens, 1), threadgroup=(32, 1, 1),
        template=[("T", streams.dtype), ("HC", hc), ("D", D), ("SPLITS", splits)])
    return Projection(partial, splits, collapsed)


def _tiles(tokens: int) -> bool:
    """Prefill's projection in tiles of TILE_TOKENS tokens (DSV4_KERNEL_MHC_TILES)."""
    return tokens >= TILES_MIN_TOKENS and flags.switch("kernel_mhc_tiles", backend() == "cuda")


def _project(streams, fn) -> Projection:
    """Launch the split-K projection kernel: a threadgroup per token and split, or (prefill)
    per TILE_TOKENS tokens and split."""
    *lead, hc, D = streams.shape
    tokens = math.prod(lead)
    splits = max(1, min(math.ceil(PROJECT_TARGET_THREADGROUPS / tokens), hc * D // PROJECT_MIN_CHUNK))
    splits = 1 << (splits.bit_length() - 1)   # a power of two: few compiled variants
    nm = hc * (2 + hc)
    template = [("T", streams.dtype), ("HC", hc), ("D", D), ("SPLITS", splits),
                ("CHUNK", math.ceil(hc * D / splits))]
    launch = dict(output_shapes=[(tokens * splits * (nm + 1),)], output_dtypes=[mx.float32],
                  threadgroup=(PROJECT_THREADS, 1, 1))
    if _tiles(tokens):
        (partial,) = PROJECT_TILES_KERNEL(
            inputs=[streams, _float32(fn), constant((float(tokens),))],
            grid=(PROJECT_THREADS, splits, math.ceil(tokens / TILE_TOKENS)),
            template=template + [("TT", TILE_TOKENS)], **launch)
    else:
        (partial,) = PROJECT_KERNEL(inputs=[streams, _float32(fn)], grid=(PROJECT_THREADS, splits, tokens),
                                    template=template, **launch)
    return Projection(partial, splits)


@falls_back(hc_mixes_reference, "kernel_mhc")
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
    partial, splits, *_ = _project(streams, fn)
    pre, post, comb = SINKHORN_KERNEL(
        inputs=[partial, _float32(scale), _float32(base), constant((float(norm_eps), float(hc_eps)))],
        output_shapes=[(*lead, hc), (*lead, hc), (*lead, hc, hc)], output_dtypes=[mx.float32] * 3,
        grid=(32, 1, math.prod(lead)), threadgroup=(32, 1, 1),
        template=[("HC", hc), ("D", D), ("ITERS", iterations), ("SPLITS", splits)])
    return pre, post, comb


@falls_back(hc_collapse_norm_reference, "kernel_mhc")
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
                                     norm_eps, hc_eps, iterations=20, x_shape=None, fp8_copy=False,
                                     projection=None):
    """Plain-MLX definition; see `hc_mixes_collapse_norm` (the mixes made from the streams:
    `projection` is not used)."""
    x = hc_collapse_norm_reference(streams, pre_in, norm_weight, rms_eps, x_shape)
    copy = (qdq_fp8(x),) if fp8_copy else ()
    return (x, *copy, *hc_mixes_reference(streams, fn, scale, base, norm_eps, hc_eps, iterations))


@falls_back(hc_mixes_collapse_norm_reference, "kernel_mhc")
def hc_mixes_collapse_norm(streams, pre_in, fn, scale, base, norm_weight, rms_eps, norm_eps,
                           hc_eps, iterations=20, x_shape=None, fp8_copy=False, projection=None):
    """One mHC site's entry: the sublayer input and this site's mixes, from the same streams.

    x = hc_collapse_norm(streams, pre_in, norm_weight, rms_eps), where pre_in is the previous
    site's pre (in any layout of the streams' tokens); (pre, post, comb) = hc_mixes(streams, fn,
    scale, base, norm_eps, hc_eps, iterations). Returns (x, pre, post, comb), shapes and dtypes
    as those two give them (x laid out as `x_shape` if given); with `fp8_copy`, (x,
    qdq_fp8(x), pre, post, comb): the input of the official fp8 matmuls, bit-identical.
    `projection`: what `hc_expand` returned with this site's fn (and pre_in) for the same streams.

    On the kernel path two launches instead of three (the projection, then one kernel that
    collapses and normalises, rounds the fp8 copy, while one of its SIMD groups finishes the
    mixes); one when the expand that made the streams also made their projection. With
    DSV4_KERNEL_MHC_WIDE, for up to WIDE_MAX_TOKENS tokens: the same launches, each spread
    over many threadgroups per token (the partials of the projection and of the collapse,
    then the normalisation and, in one more threadgroup, the Sinkhorn).
    """
    float_weight = norm_weight.dtype in (mx.bfloat16, mx.float16, mx.float32)
    if not _use_kernel(streams.dtype, streams.shape[-2]) or not float_weight:
        x = hc_collapse_norm(streams, pre_in, norm_weight, rms_eps, x_shape)
        copy = (qdq_fp8(x),) if fp8_copy else ()
        return (x, *copy, *hc_mixes(streams, fn, scale, base, norm_eps, hc_eps, iterations))
    *lead, hc, D = streams.shape
    # The fp8 copy in the kernel when the rounding kernel would run (32-value blocks whole in
    # a SIMD group's row); else the rounding after it.
    fused_copy = fp8_copy and D % 32 == 0 and qdq_kernel_applies(streams, 32)
    x_shape = x_shape or (*lead, D)
    outputs = dict(output_shapes=[(*lead, hc), (*lead, hc), (*lead, hc, hc), x_shape] + [x_shape] * fused_copy,
                   output_dtypes=[mx.float32] * 3 + [streams.dtype] * (1 + fused_copy))
    params = constant((float(norm_eps), float(hc_eps), float(rms_eps)))

    def entry(pre, post, comb, x, *copy):
        """The kernel's outputs as returned: the fp8 copy rounded after it where it made none."""
        return (x, *(copy or ([qdq_fp8(x)] if fp8_copy else [])), pre, post, comb)

    if projection is None and wide_entry(streams):
        projection = _entry_partials(streams, fn, pre_in)
    if projection is not None and projection.collapsed is not None:
        kernel = ENTRY_FINISH_FP8_KERNEL if fused_copy else ENTRY_FINISH_KERNEL
        groups = math.ceil(D / ROW_THREADS) + 1
        return entry(*kernel(
            inputs=[projection.partial, _float32(scale), _float32(base), params, projection.collapsed, norm_weight],
            grid=(ROW_THREADS * groups, math.prod(lead), 1), threadgroup=(ROW_THREADS, 1, 1),
            template=[("T", streams.dtype), ("HC", hc), ("D", D), ("ITERS", iterations),
                      ("SPLITS", projection.splits)], **outputs))
    partial, splits, *_ = projection if projection is not None else _project(streams, fn)
    kernel = SINKHORN_COLLAPSE_NORM_FP8_KERNEL if fused_copy else SINKHORN_COLLAPSE_NORM_KERNEL
    return entry(*kernel(
        inputs=[partial, _float32(scale), _float32(base), params, streams, _float32(pre_in), norm_weight],
        grid=(ROW_THREADS + 32, math.prod(lead), 1), threadgroup=(ROW_THREADS + 32, 1, 1),
        template=[("T", streams.dtype), ("HC", hc), ("D", D), ("ITERS", iterations), ("SPLITS", splits)],
        **outputs))


@falls_back(hc_expand_reference, "kernel_mhc")
def hc_expand(y, residual, post, comb, fn=None, pre=None):
    """New streams X'_j = post_j y + sum_i comb[i, j] R_i, computed in fp32.

    y [B, S, D] (sublayer output); residual [B, S, hc, D] (streams that entered the site);
    post [B, S, hc], comb [B, S, hc, hc] fp32. Returns [B, S, hc, D] in the residual's dtype.
    The tokens may be laid out otherwise (flat: residual [B*S, hc, D], post [B*S, hc], ...),
    y's apart from the others' (e.g. [B, S, D] with flat streams): the result has the residual's.

    With fn (the next site's [hc*(2+hc), hc*D] projection) returns (streams, projection):
    on the kernel path the same launch also makes the next site's projection partials, for
    `hc_mixes_collapse_norm(..., projection=...)`; elsewhere projection is None. `pre`: that
    site's pre_in ([B, S, hc] fp32, the pre of the site these streams entered), with which the
    wide path (DSV4_KERNEL_MHC_WIDE) also collapses the new streams in the same launch.
    """
    if not _use_kernel(residual.dtype) or y.dtype != residual.dtype:
        return hc_expand_reference(y, residual, post, comb, fn)
    *lead, hc, D = residual.shape
    tokens = math.prod(lead)
    if fn is not None and pre is not None and wide_entry(residual):
        splits = _column_blocks(hc, D)
        out, partial, collapsed = EXPAND_PARTIALS_KERNEL(
            inputs=[y, residual, _float32(post), _float32(comb), _float32(fn), _float32(pre)],
            output_shapes=[residual.shape, partials_shape(tokens, splits, hc), (tokens, D)],
            output_dtypes=[residual.dtype, mx.float32, residual.dtype],
            grid=(32 * splits, tokens, 1), threadgroup=(32, 1, 1),
            template=[("T", residual.dtype), ("HC", hc), ("D", D), ("SPLITS", splits)])
        return out, Projection(partial, splits, collapsed)
    splits = math.ceil(D / ROW_THREADS)
    grid = (splits * ROW_THREADS, tokens, 1)
    template = [("T", residual.dtype), ("HC", hc), ("D", D)]
    if fn is None or _tiles(tokens):   # (the entry then projects the new streams in tiles)
        (out,) = EXPAND_KERNEL(
            inputs=[y, residual, _float32(post), _float32(comb)],
            output_shapes=[residual.shape], output_dtypes=[residual.dtype],
            grid=grid, threadgroup=(ROW_THREADS, 1, 1), template=template)
        return out if fn is None else (out, None)
    out, partial = EXPAND_PROJECT_KERNEL(
        inputs=[y, residual, _float32(post), _float32(comb), _float32(fn)],
        output_shapes=[residual.shape, (tokens * splits * (hc * (2 + hc) + 1),)],
        output_dtypes=[residual.dtype, mx.float32],
        grid=grid, threadgroup=(ROW_THREADS, 1, 1), template=template + [("SPLITS", splits)])
    return out, Projection(partial, splits)
