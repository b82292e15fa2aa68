"""Sparse attention with sink over a shared K=V latent (model-spec §3.7).

For each query, one softmax runs over the window rows it may see and the compressed rows
its indexer selected, with the per-head sink logit added to the denominator only:

    l_j = (q_h . kv_j) * scale                       (fp32; an index of -1 picks nothing)
    M   = max(max_j l_j, -1e30)
    o_h = sum_j exp(l_j - M) kv_j / (sum_j exp(l_j - M) + exp(sink_h - M))

The probabilities are rounded to the KV dtype (bf16 in the model) before the PV product,
as the official kernel does; the denominator stays fp32. A query with no valid row gets
zeros. Optionally the rotary slice of the output is de-rotated (inverse RoPE), fused, and the
queries arrive unrotated and are rotated by the same angles as they are loaded (the query
projection's RoPE tail, fused: one launch less per layer at decode).

The kernel gives each threadgroup one query, a group of up to 8 heads (one SIMD group per
head) and a slice of the query's rows; a second kernel merges the slices. The heads of a
group read each KV row once from memory together (the other groups hit the cache), the
gather is never materialised, and splitting the rows keeps the GPU busy at decode (S = 1).
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import attention_prefill, attention_prefill_staged
from dsv4.kernels.dialect import Kernel, backend, constant, falls_back
from dsv4.kernels.experts import _HEADER as EXPERTS_HEADER

HEADS_PER_GROUP = 8
MIN_ROWS_PER_SPLIT = 8
# Beyond this many queries per call (prefill), the reference's tensor-core matmuls win. On the
# H200 the kernel was 3.3x faster at S = 1, 1.6x at S = 4, 0.83x at S = 16 and 0.35x at S = 64
# (benchmarks/results/2026-11-29-1444-kernels-h200.md); the crossover lies near S = 12.
MAX_KERNEL_QUERIES = 8


QUERY_BLOCK = 128   # the reference gathers rows per query: bound its memory in prefill


def sparse_attention_reference(q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale,
                               rope_cos=None, rope_sin=None, shape=None, rotate_queries=False):
    """Plain-MLX definition of the op; see `sparse_attention` for the contract."""
    return _with_rope(attention_core, q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale,
                      rope_cos, rope_sin, shape, rotate_queries)


def _with_rope(core, q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale, rope_cos, rope_sin,
               shape, rotate_queries):
    """core(q, ...) with the queries rotated first (rotate_queries) and the output de-rotated
    (rope_cos given) by rope_reference, laid out as `shape`."""
    if rotate_queries:
        q = rope_reference(q, rope_cos, rope_sin)
    out = core(q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale)
    if rope_cos is not None:
        out = rope_reference(out, rope_cos, rope_sin, inverse=True)
    return out if shape is None else out.reshape(shape)


def attention_core(q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale):
    """The attention of rotated queries, its output not de-rotated, in plain MLX."""
    rows, dtype, valid = _query_rows(window_kv, window_idx, compressed_kv, topk_idx, q.shape[0])
    blocks = [_attend(q[:, lo:lo + QUERY_BLOCK], rows(lo, lo + QUERY_BLOCK), dtype, valid[:, lo:lo + QUERY_BLOCK],
                      sinks, scale)
              for lo in range(0, q.shape[1], QUERY_BLOCK)]
    return blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=1)


def _attend(q, kv32, dtype, valid, sinks, scale):
    """Queries q [B, S, H, D] over their rows kv32 [B, S, n, D] (fp32, stored as `dtype`)
    -> [B, S, H, D] in q's dtype."""
    scores = (q.astype(mx.float32) @ kv32.swapaxes(-1, -2)) * scale         # [B, S, H, n]
    scores = mx.where(valid[:, :, None, :], scores, -mx.inf)
    top = mx.maximum(mx.max(scores, axis=-1, keepdims=True), -1e30)
    p = mx.exp(scores - top)
    denom = mx.sum(p, axis=-1, keepdims=True) + mx.exp(sinks.astype(mx.float32)[:, None] - top)
    numer = p.astype(dtype).astype(mx.float32) @ kv32
    return (numer / denom).astype(q.dtype)


def rope_reference(x, cos, sin, inverse: bool = False):
    """Rotate the last 2*R dims of x [B, S, H, D] in interleaved pairs (model-spec §3.3) by the
    angles of cos, sin ([B, S, R] fp32: each query's position; [R]: one for every query).
    Pair k = dims (D-2R+2k, D-2R+2k+1): forward (a, b) -> (a cos - b sin, a sin + b cos), as
    the projection tail (dsv4/kernels/rows.py) rotates, or `inverse` (a cos + b sin,
    -a sin + b cos); in fp32, rounded to x's dtype."""
    R = cos.shape[-1]
    D = x.shape[-1]
    rot = x[..., D - 2 * R:].astype(mx.float32).reshape(*x.shape[:-1], R, 2)
    a, b = rot[..., 0], rot[..., 1]
    c, s = cos[..., None, :], sin[..., None, :]
    pair = [a * c + b * s, b * c - a * s] if inverse else [a * c - b * s, a * s + b * c]
    out = mx.stack(pair, axis=-1).reshape(*x.shape[:-1], 2 * R)
    return mx.concatenate([x[..., :D - 2 * R], out.astype(x.dtype)], axis=-1)


def _query_rows(window_kv, window_idx, compressed_kv, topk_idx, B):
    """(rows(lo, hi) -> the fp32 rows [B, hi - lo, n, D] of queries lo..hi-1: their window rows,
    then their selected compressed rows; the rows' stored dtype; their validity [B, S, n]).
    When the queries select more rows than there are (prefill), every row is widened to fp32
    once and each query's are gathered from there; otherwise (decode) each query's rows are
    gathered as stored, then widened: the same values either way."""
    parts = [(window_kv, window_idx)] + ([] if compressed_kv is None else [(compressed_kv, topk_idx)])
    D = window_kv.shape[-1]
    sizes = [kv.shape[1] for kv, _ in parts]
    batch = lambda rows: (mx.arange(B, dtype=mx.int32) * rows)[:, None, None]   # each batch's first row
    local, valid = [], []
    for (kv, sel), m in zip(parts, sizes):
        sel = mx.broadcast_to(sel, (B, *sel.shape[1:]))   # [1, S, k] is shared by the batch
        ok = (sel >= 0) & (sel < m)
        local.append(mx.where(ok, sel, 0).astype(mx.int32))   # an invalid one: its part's first row
        valid.append(ok)
    valid = valid[0] if len(valid) == 1 else mx.concatenate(valid, axis=-1)
    S, n, total = local[0].shape[1], valid.shape[-1], sum(sizes)
    if S * n > total:
        source = mx.concatenate([kv for kv, _ in parts], axis=1) if len(parts) > 1 else window_kv
        wide = source.reshape(B * total, D).astype(mx.float32)
        index = mx.concatenate([i + (o + batch(total)) for i, o in zip(local, (0, sizes[0]))], axis=-1)
        return (lambda lo, hi: mx.take(wide, index[:, lo:hi].reshape(-1), axis=0).reshape(B, -1, n, D),
                window_kv.dtype, valid)

    def rows(lo, hi):
        got = [mx.take(kv.reshape(B * m, D), (i[:, lo:hi] + batch(m)).reshape(-1), axis=0).reshape(B, -1, i.shape[-1], D)
               for (kv, _), i, m in zip(parts, local, sizes)]
        return (got[0] if len(got) == 1 else mx.concatenate(got, axis=2)).astype(mx.float32)

    return rows, window_kv.dtype, valid


# RoPE of a pair of dims in fp32 (the decode kernels' fused rotations; attention_decode_staged.py's too).
ROPE_HEADER = r"""
// RoPE of the pair v[0], v[1] (dims d, d + 1, d even) if it lies in the last 2R dims of a row
// of D values, at the angles cos/sin[qi*R + k], in fp32: forward (a cos - b sin,
// a sin + b cos) or, INVERSE, back (a cos + b sin, b cos - a sin).
template <int D, int R, bool INVERSE, typename PC>
KFN void rotate_pair(LOCAL float* v, int d, PC cosv, PC sinv, int qi) {
  const int first_rot = D - 2 * R;
  if (R > 0 && d >= first_rot) {
    const int k = (d - first_rot) / 2;
    const float c = cosv[(size_t)qi * R + k];
    const float sn = sinv[(size_t)qi * R + k];
    const float a = v[0], bb = v[1];
    v[0] = INVERSE ? a * c + bb * sn : a * c - bb * sn;
    v[1] = INVERSE ? bb * c - a * sn : a * sn + bb * c;
  }
}
"""

# Lanes read their slice of a row (DPL consecutive values) with 16-byte loads where they can:
# scalar 2-byte loads at a 32-byte lane stride cost the partial kernel 8x the memory
# instructions (ncu: 56 µs per layer at decode for 0.5 MB of rows, latency-bound). The rows
# start 16-byte aligned (MLX buffers do; a row of D % 256 == 0 bf16 values keeps it).
_HEADER = EXPERTS_HEADER + r"""
// DPL consecutive values at p as fp32: VEC, bf16 read 8 at a time (p 16-byte aligned,
// DPL % 8 == 0); otherwise one at a time.
template <int DPL, bool VEC, typename P>
KFN void load_lane(P p, LOCAL float* v) {
  if (VEC) {
    for (int k = 0; k < DPL / 8; ++k) load_bf16_8(p, 0, k, v + 8 * k);
  } else {
    for (int i = 0; i < DPL; ++i) v[i] = float(p[i]);
  }
}

// Row r of query qi's list (its NW window indices, then its NK top-k ones) in the kernels'
// numbering: window row j as j, compressed row j as W + j; -1 where the index picks nothing.
template <typename PI>
KFN int query_row(PI window_idx, PI topk_idx, int qi, int r, int NW, int NK, int W, int N) {
  if (r < NW) {
    const int j = window_idx[(size_t)qi * NW + r];
    return (j >= 0 && j < W) ? j : -1;
  }
  const int j = topk_idx[(size_t)qi * NK + (r - NW)];
  return (j >= 0 && j < N) ? W + j : -1;
}

""" + ROPE_HEADER + r"""
// rotate_pair on this lane's DPL values v (dims lane*DPL.., pairs adjacent).
template <int D, int DPL, int R, bool INVERSE, typename PC>
KFN void rotate_lane(LOCAL float* v, PC cosv, PC sinv, int qi, uint32_t lane) {
  for (int i = 0; i < DPL; i += 2) rotate_pair<D, R, INVERSE>(v + i, (int)lane * DPL + i, cosv, sinv, qi);
}

// DPL consecutive fp32 values at p, 4 at a time when DPL % 4 == 0 (p 16-byte aligned).
template <int DPL, typename P>
KFN void load_lane_f32(P p, LOCAL float* v) {
  if (DPL % 4 == 0) {
    for (int k = 0; k < DPL / 4; ++k) {
      const uint4 q = LOAD_U4(p, k);
      v[4 * k] = AS_FLOAT(q.x); v[4 * k + 1] = AS_FLOAT(q.y);
      v[4 * k + 2] = AS_FLOAT(q.z); v[4 * k + 3] = AS_FLOAT(q.w);
    }
  } else {
    for (int i = 0; i < DPL; ++i) v[i] = p[i];
  }
}
"""

_PARTIAL_BODY = r"""
  // grid (32*G, n_head_groups*splits, B*S); one SIMD group per head.
  constexpr int DPL = D / 32;
  const int S = q_shape[1], W = window_kv_shape[1], N = compressed_kv_shape[1];
  const int NW = window_idx_shape[2], NK = topk_idx_shape[2];
  const int RPS = (NW + NK + SPLITS - 1) / SPLITS;
  const int qi = group_z;
  const int b = qi / S;
  const int split = group_y % SPLITS;
  const int h = (group_y / SPLITS) * G + warp;
  if (h >= H) return;
  const float scale = params[0];
  const size_t part = ((size_t)qi * H + h) * SPLITS + split;

  float qv[DPL];
  load_lane<DPL, VEC>(q + ((size_t)qi * H + h) * D + lane * DPL, qv);
  if (ROPE_Q > 0) {
    // The query's RoPE, each value rounded as the projection tail rounds it (the values it
    // leaves alone are already in T).
    rotate_lane<D, DPL, ROPE_Q, false>(qv, rope_cos, rope_sin, qi, lane);
    for (int i = 0; i < DPL; ++i) qv[i] = float(static_cast<T>(qv[i]));
  }
  float m = -INFINITY, l = 0.0f;
  float acc[DPL];
  for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;

  const int r_begin = split * RPS;
  const int r_end = min(NW + NK, r_begin + RPS);
  for (int base = r_begin; base < r_end; base += 32) {
    // Each lane fetches one row's index; rows are then taken 4 at a time from the lanes.
    const int r = base + (int)lane;
    const int my_row = r < r_end ? query_row(window_idx, topk_idx, qi, r, NW, NK, W, N) : -1;
    const int count = min(32, r_end - base);
    for (int c = 0; c < count; c += 4) {
      int rows[4];
      float kv[4][DPL];
      float s[4];
      bool any = false;
      for (int u = 0; u < 4; ++u) {
        rows[u] = simd_shuffle_i(my_row, c + u);   // lanes past the end hold -1
        any = any || rows[u] >= 0;
      }
      if (!any) continue;
      for (int u = 0; u < 4; ++u) {
        for (int i = 0; i < DPL; ++i) kv[u][i] = 0.0f;
        if (rows[u] >= W) {
          load_lane<DPL, VEC>(compressed_kv + ((size_t)b * N + (rows[u] - W)) * D + lane * DPL, kv[u]);
        } else if (rows[u] >= 0) {
          load_lane<DPL, VEC>(window_kv + ((size_t)b * W + rows[u]) * D + lane * DPL, kv[u]);
        }
      }
      float m_new = m;
      for (int u = 0; u < 4; ++u) {
        float dot = 0.0f;
        for (int i = 0; i < DPL; ++i) dot += qv[i] * kv[u][i];
        s[u] = simd_sum_f(dot) * scale;
        if (rows[u] < 0) s[u] = -INFINITY;
        m_new = FMAX(m_new, s[u]);
      }
      const float corr = EXP(m - m_new);
      l *= corr;
      for (int i = 0; i < DPL; ++i) acc[i] *= corr;
      for (int u = 0; u < 4; ++u) {
        const float p = EXP(s[u] - m_new);
        l += p;
        const float p_rounded = float(static_cast<T>(p));   // bf16 probabilities before PV
        for (int i = 0; i < DPL; ++i) acc[i] += p_rounded * kv[u][i];
      }
      m = m_new;
    }
  }
  for (int i = 0; i < DPL; ++i) part_acc[part * D + lane * DPL + i] = acc[i];
  if (lane == 0) {
    part_ml[part * 2] = m;
    part_ml[part * 2 + 1] = l;
  }
"""

_MERGE_BODY = r"""
  // grid (32, H, B*S): one SIMD group merges one (query, head).
  constexpr int DPL = D / 32;
  const int qi = group_z;
  const int h = group_y;
  const size_t first = ((size_t)qi * H + h) * SPLITS;
  float top = -1e30f;
  for (int s = 0; s < SPLITS; ++s) top = FMAX(top, part_ml[(first + s) * 2]);
  float denom = EXP(sinks[h] - top);
  float o[DPL];
  for (int i = 0; i < DPL; ++i) o[i] = 0.0f;
  for (int s = 0; s < SPLITS; ++s) {
    const float w = EXP(part_ml[(first + s) * 2] - top);
    denom += w * part_ml[(first + s) * 2 + 1];
    float p[DPL];
    load_lane_f32<DPL>(part_acc + (first + s) * D + lane * DPL, p);
    for (int i = 0; i < DPL; ++i) o[i] += w * p[i];
  }
  const size_t out_off = ((size_t)qi * H + h) * D + lane * DPL;
  for (int i = 0; i < DPL; ++i) o[i] = float(static_cast<T>(o[i] / denom));
  // Inverse RoPE on the last 2*ROPE_HALF dims, after the output's rounding (as unfused).
  rotate_lane<D, DPL, ROPE_HALF, true>(o, rope_cos, rope_sin, qi, lane);
  for (int i = 0; i < DPL; ++i) out[out_off + i] = static_cast<T>(o[i]);
"""

# The 8-row kernels (flag `kernel_attention_rows8`; bf16, D % 256 == 0). Per SIMD group and
# step: 8 rows' loads in flight at once (the 4-row kernel waits on memory twice as often), their
# 8 dot products summed across the lanes by one transposed butterfly (9 shuffles where 8 sums
# take 40; lane l ends with the whole dot of row (l >> 2) & 7), and the rows held as bf16 words
# (32 registers a row less than fp32 values). A lane's values are striped (8-value chunk c at
# dims 256c + 8 lane), so one 16-byte load of the SIMD group reads 512 consecutive bytes.
# The merge spreads each (query, head) over D/128 SIMD groups of 4 dims a lane, the splits'
# maxima and sums over the lanes: the 4-row merge's 64 SIMD groups each walked every split's
# 512 values alone (ncu: 27 µs a layer for 4 MB of partials, latency-bound).
_ROWS8_HEADER = r"""
KFN int striped_dim(uint32_t lane, int i) { return 256 * (i / 8) + 8 * (int)lane + (i % 8); }

KFN uint4 zero_u4() { uint4 z; z.x = 0u; z.y = 0u; z.z = 0u; z.w = 0u; return z; }

// Products with the 8C bf16 values of the words w (two a word, the low half first), in fp32.
template <int C>
KFN float dot_bf16_words(LOCAL const float* v, LOCAL const uint4* w) {
  float s = 0.0f;
  for (int k = 0; k < C; ++k) {
    const uint32_t ws[4] = {w[k].x, w[k].y, w[k].z, w[k].w};
    for (int j = 0; j < 4; ++j) {
      s += v[8 * k + 2 * j] * AS_FLOAT(ws[j] << 16);
      s += v[8 * k + 2 * j + 1] * AS_FLOAT(ws[j] & 0xffff0000u);
    }
  }
  return s;
}

template <int C>
KFN void add_bf16_words(LOCAL float* acc, float p, LOCAL const uint4* w) {
  for (int k = 0; k < C; ++k) {
    const uint32_t ws[4] = {w[k].x, w[k].y, w[k].z, w[k].w};
    for (int j = 0; j < 4; ++j) {
      acc[8 * k + 2 * j] += p * AS_FLOAT(ws[j] << 16);
      acc[8 * k + 2 * j + 1] += p * AS_FLOAT(ws[j] & 0xffff0000u);
    }
  }
}

// Float f of lane src, through the int shuffle.
KFN float shuffle_f(float f, int src) { return AS_FLOAT((uint32_t)simd_shuffle_i((int)AS_UINT(f), src)); }
"""

_ROWS8_PARTIAL_BODY = r"""
  // grid (32*G, n_head_groups*splits, B*S); one SIMD group per head, its rows 8 at a time.
  constexpr int DPL = D / 32;
  constexpr int C = DPL / 8;   // 8-value chunks a lane
  const int S = q_shape[1], W = window_kv_shape[1], N = compressed_kv_shape[1];
  const int NW = window_idx_shape[2], NK = topk_idx_shape[2];
  const int RPS = ((NW + NK + SPLITS - 1) / SPLITS + 7) / 8 * 8;   // whole steps of 8 rows
  const int qi = group_z;
  const int b = qi / S;
  const int split = group_y % SPLITS;
  const int h = (group_y / SPLITS) * G + warp;
  if (h >= H) return;
  const float scale = params[0];
  const size_t part = ((size_t)qi * H + h) * SPLITS + split;

  float qv[DPL];
  for (int k = 0; k < C; ++k) load_bf16_8(q + ((size_t)qi * H + h) * D + 256 * k, 0, lane, qv + 8 * k);
  if (ROPE_Q > 0) {   // as the 4-row kernel: rotated in fp32, rounded to T
    for (int i = 0; i < DPL; i += 2) rotate_pair<D, ROPE_Q, false>(qv + i, striped_dim(lane, i), rope_cos, rope_sin, qi);
    for (int i = 0; i < DPL; ++i) qv[i] = float(static_cast<T>(qv[i]));
  }
  float m = -INFINITY, l = 0.0f;
  float acc[DPL];
  for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
  const bool up16 = (lane & 16u) != 0, up8 = (lane & 8u) != 0, up4 = (lane & 4u) != 0;
  const int row_of_lane = ((int)lane >> 2) & 7;   // the row whose whole dot this lane ends with

  const int r_begin = split * RPS;
  const int r_end = min(NW + NK, r_begin + RPS);
  for (int base = r_begin; base < r_end; base += 32) {
    // Each lane fetches one row's index; rows are then taken 8 at a time from the lanes.
    const int r = base + (int)lane;
    const int my_row = r < r_end ? query_row(window_idx, topk_idx, qi, r, NW, NK, W, N) : -1;
    const int count = min(32, r_end - base);
    for (int c = 0; c < count; c += 8) {
      int rows[8];
      bool any = false;
      for (int u = 0; u < 8; ++u) {
        rows[u] = simd_shuffle_i(my_row, c + u);   // lanes past the end hold -1
        any = any || rows[u] >= 0;
      }
      if (!any) continue;
      uint4 kv[8][C];
      for (int u = 0; u < 8; ++u) {
        GLOBAL T* src = rows[u] >= W ? compressed_kv + ((size_t)b * N + (rows[u] - W)) * D
                                     : window_kv + ((size_t)b * W + max(rows[u], 0)) * D;
        for (int k = 0; k < C; ++k) kv[u][k] = rows[u] >= 0 ? LOAD_U4(src + 256 * k, lane) : zero_u4();
      }
      float d8[8], d4[4], d2[2];
      for (int u = 0; u < 8; ++u) d8[u] = dot_bf16_words<C>(qv, kv[u]);
      // Each step keeps half of the rows and adds the other lane's half of them.
      for (int i = 0; i < 4; ++i) d4[i] = (up16 ? d8[i + 4] : d8[i]) + simd_xor_f(up16 ? d8[i] : d8[i + 4], 16);
      for (int i = 0; i < 2; ++i) d2[i] = (up8 ? d4[i + 2] : d4[i]) + simd_xor_f(up8 ? d4[i] : d4[i + 2], 8);
      float dot = (up4 ? d2[1] : d2[0]) + simd_xor_f(up4 ? d2[0] : d2[1], 4);
      dot += simd_xor_f(dot, 2);
      dot += simd_xor_f(dot, 1);
      int mine = rows[0];
      for (int u = 1; u < 8; ++u) mine = row_of_lane == u ? rows[u] : mine;
      const float s = mine >= 0 ? dot * scale : -INFINITY;
      // Over the 8 rows: lanes l, l^4, l^8, ... hold them all.
      float top = FMAX(s, simd_xor_f(s, 4));
      top = FMAX(top, simd_xor_f(top, 8));
      top = FMAX(top, simd_xor_f(top, 16));
      const float m_new = FMAX(m, top);
      const float p = EXP(s - m_new);
      float p_sum = p + simd_xor_f(p, 4);
      p_sum += simd_xor_f(p_sum, 8);
      p_sum += simd_xor_f(p_sum, 16);
      const float corr = EXP(m - m_new);
      l = l * corr + p_sum;
      for (int i = 0; i < DPL; ++i) acc[i] *= corr;
      const float p_rounded = float(static_cast<T>(p));   // bf16 probabilities before PV
      for (int u = 0; u < 8; ++u) add_bf16_words<C>(acc, shuffle_f(p_rounded, 4 * u), kv[u]);
      m = m_new;
    }
  }
  for (int i = 0; i < DPL; ++i) part_acc[part * D + striped_dim(lane, i)] = acc[i];
  if (lane == 0) {
    part_ml[part * 2] = m;
    part_ml[part * 2 + 1] = l;
  }
"""

# The merge of query qi's head h over its splits, dims 128 CHUNK.. by one SIMD group, 4 a lane.
_ROWS8_MERGE_CORE = r"""
  const size_t first = ((size_t)qi * H + h) * SPLITS;
  float top = -1e30f;
  for (int s = (int)lane; s < SPLITS; s += 32) top = FMAX(top, part_ml[(first + s) * 2]);
  top = simd_max_f(top);
  float denom = 0.0f;
  for (int s = (int)lane; s < SPLITS; s += 32)
    denom += EXP(part_ml[(first + s) * 2] - top) * part_ml[(first + s) * 2 + 1];
  denom = simd_sum_f(denom) + EXP(sinks[h] - top);
  const int d0 = 128 * CHUNK + 4 * (int)lane;
  float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int s = 0; s < SPLITS; ++s) {
    const float w = EXP(part_ml[(first + s) * 2] - top);
    float p[4];
    load_lane_f32<4>(part_acc + (first + s) * D + d0, p);
    for (int i = 0; i < 4; ++i) o[i] += w * p[i];
  }
  const size_t out_off = ((size_t)qi * H + h) * D + d0;
  for (int i = 0; i < 4; ++i) o[i] = float(static_cast<T>(o[i] / denom));
  // Inverse RoPE on the last 2*ROPE_HALF dims, after the output's rounding (as unfused).
  for (int i = 0; i < 4; i += 2) rotate_pair<D, ROPE_HALF, true>(o + i, d0 + i, rope_cos, rope_sin, qi);
  for (int i = 0; i < 4; ++i) out[out_off + i] = static_cast<T>(o[i]);
"""
_ROWS8_MERGE_BODY = r"""
  // grid (32*D/128, H, B*S): D/128 SIMD groups merge one (query, head), 4 dims a lane.
  const int qi = group_z;
  const int h = group_y;""" + _ROWS8_MERGE_CORE.replace("CHUNK", "(int)warp")


def _vector_loads(dtype, D: int) -> bool:
    """Whether the partial kernel's lanes read rows 8 bf16 values at a time."""
    return dtype == mx.bfloat16 and (D // 32) % 8 == 0


_CHECK_TYPES = ((mx.bfloat16, 512, 64, 32), (mx.float32, 64, 3, 8))

PARTIAL_KERNEL = Kernel(
    name="dsv4_sparse_attention_partial",
    input_names=("q", "window_kv", "window_idx", "compressed_kv", "topk_idx", "params",
                 "rope_cos", "rope_sin"),
    output_names=("part_acc", "part_ml"),
    body=_PARTIAL_BODY, header=_HEADER,
    checks=tuple(
        ((t, t, mx.int32, t, mx.int32, mx.float32, mx.float32, mx.float32), (mx.float32, mx.float32),
         (("T", t), ("D", d), ("H", h), ("G", min(h, HEADS_PER_GROUP)), ("SPLITS", 32), ("ROPE_Q", r),
          ("VEC", _vector_loads(t, d))))
        for t, d, h, r in _CHECK_TYPES),
)

MERGE_KERNEL = Kernel(
    name="dsv4_sparse_attention_merge",
    input_names=("part_acc", "part_ml", "sinks", "rope_cos", "rope_sin"),
    output_names=("out",),
    body=_MERGE_BODY, header=_HEADER,
    checks=tuple(
        ((mx.float32, mx.float32, mx.float32, mx.float32, mx.float32), (t,),
         (("T", t), ("D", d), ("H", h), ("ROPE_HALF", r), ("SPLITS", 5)))
        for t, d, h, r in _CHECK_TYPES),
)


_ROWS8_CHECKS = ((512, 64, 32), (256, 11, 0))

ROWS8_PARTIAL_KERNEL = Kernel(
    name="dsv4_sparse_attention_rows8_partial",
    input_names=PARTIAL_KERNEL.input_names, output_names=PARTIAL_KERNEL.output_names,
    body=_ROWS8_PARTIAL_BODY, header=_HEADER + _ROWS8_HEADER,
    checks=tuple(
        ((mx.bfloat16, mx.bfloat16, mx.int32, mx.bfloat16, mx.int32, mx.float32, mx.float32, mx.float32),
         (mx.float32, mx.float32),
         (("T", mx.bfloat16), ("D", d), ("H", h), ("G", min(h, HEADS_PER_GROUP)), ("SPLITS", 32), ("ROPE_Q", r)))
        for d, h, r in _ROWS8_CHECKS),
)

ROWS8_MERGE_KERNEL = Kernel(
    name="dsv4_sparse_attention_rows8_merge",
    input_names=MERGE_KERNEL.input_names, output_names=MERGE_KERNEL.output_names,
    body=_ROWS8_MERGE_BODY, header=_HEADER,
    checks=tuple(
        ((mx.float32,) * 5, (mx.bfloat16,), (("T", mx.bfloat16), ("D", d), ("H", h), ("ROPE_HALF", r), ("SPLITS", s)))
        for (d, h, r), s in zip(_ROWS8_CHECKS, (32, 37))),
)


def rows8_applies(q) -> bool:
    """Whether the 8-row kernels take this call: the switch, and bf16 rows of 256 or 512 values."""
    return (flags.switch("kernel_attention_rows8", backend() == "cuda") and q.dtype == mx.bfloat16
            and q.shape[-1] in (256, 512))


def kernel_supports(q, window_kv, compressed_kv, rope_cos) -> bool:
    """The shapes and dtypes the kernel handles; anything else runs the reference."""
    D = q.shape[-1]
    if q.shape[0] * q.shape[1] > MAX_KERNEL_QUERIES:
        return False
    if D % 32 or D // 32 > 32 or q.dtype not in (mx.bfloat16, mx.float16, mx.float32):
        return False
    if window_kv.dtype != q.dtype or (compressed_kv is not None and compressed_kv.dtype != q.dtype):
        return False
    if rope_cos is not None and ((D // 32) % 2 or 2 * rope_cos.shape[-1] > D):
        return False
    return True


def _int32(a):
    return a if a.dtype == mx.int32 else a.astype(mx.int32)


def _float32(a):
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


@falls_back(sparse_attention_reference, "kernel_sparse_attention")
def sparse_attention_kernel(q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale,
                            rope_cos=None, rope_sin=None, shape=None, rotate_queries=False):
    """The GPU kernel path; same contract as `sparse_attention` (call that instead)."""
    B, S, H, D = q.shape
    # [1, S, w] -> [B, S, w] (only where it differs: a broadcast is a graph node even when idle)
    fit = lambda idx: idx if idx.shape[0] == B else mx.broadcast_to(idx, (B, S, idx.shape[-1]))
    window_idx = fit(window_idx)
    if compressed_kv is not None:
        topk_idx = fit(topk_idx)
    if compressed_kv is None:   # one never-selected row stands for the missing cache
        compressed_kv = constant((((0.0,) * D,),), q.dtype)                  # [1, 1, D]
        topk_idx = constant((((-1,),) * S,) * B, mx.int32)                   # [B, S, 1]
    groups = math.ceil(H / HEADS_PER_GROUP)
    G = min(H, HEADS_PER_GROUP)
    rows = window_idx.shape[-1] + topk_idx.shape[-1]
    # Splits depend only on the batch and head counts and a coarse row count, so few variants
    # get compiled; a split past the last row writes an empty partial.
    splits = max(1, min(math.ceil(flags.get("attention_threadgroups") / (B * S * groups)),
                        math.ceil(rows / MIN_ROWS_PER_SPLIT)))
    splits = 1 << (splits - 1).bit_length()
    rope_half = 0 if rope_cos is None else rope_cos.shape[-1]
    if rope_cos is None:
        rope_cos = rope_sin = constant((0.0,) * 8)
    elif rope_cos.size != B * S * rope_half:   # [R] shared by several queries: one row each
        rope_cos, rope_sin = (mx.broadcast_to(a, (B, S, rope_half)) for a in (rope_cos, rope_sin))
    rope_cos, rope_sin = _float32(rope_cos), _float32(rope_sin)
    rope_q = rope_half if rotate_queries else 0
    from dsv4.kernels import attention_decode_staged as staged   # (it builds on this module's header)
    rows8 = rows8_applies(q)
    if staged.applies(q, window_kv, compressed_kv):   # tensor cores; the 8-row merge
        part_acc, part_ml, splits = staged.partials(q, window_kv, _int32(window_idx), compressed_kv, _int32(topk_idx),
                                                    scale, rope_cos, rope_sin, rope_q)
        rows8 = True
    else:
        template = [("T", q.dtype), ("D", D), ("H", H), ("G", G), ("SPLITS", splits), ("ROPE_Q", rope_q)]
        partial_outputs = dict(output_shapes=[(B * S * H * splits * D,), (B * S * H * splits * 2,)],
                               output_dtypes=[mx.float32, mx.float32])
        inputs = [q, window_kv, _int32(window_idx), compressed_kv, _int32(topk_idx), constant((float(scale),)),
                  rope_cos, rope_sin]
        launch = dict(grid=(32 * G, groups * splits, B * S), threadgroup=(32 * G, 1, 1))
        part_acc, part_ml = (ROWS8_PARTIAL_KERNEL if rows8 else PARTIAL_KERNEL)(
            inputs=inputs, **partial_outputs, **launch,
            template=template if rows8 else template + [("VEC", _vector_loads(q.dtype, D))])
    merge_threads = 32 * D // 128 if rows8 else 32
    (out,) = (ROWS8_MERGE_KERNEL if rows8 else MERGE_KERNEL)(
        inputs=[part_acc, part_ml, _float32(sinks), rope_cos, rope_sin],
        output_shapes=[q.shape if shape is None else shape], output_dtypes=[q.dtype],
        grid=(merge_threads, H, B * S), threadgroup=(merge_threads, 1, 1),
        template=[("T", q.dtype), ("D", D), ("H", H), ("ROPE_HALF", rope_half), ("SPLITS", splits)])
    return out


def sparse_attention(q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale,
                     rope_cos=None, rope_sin=None, shape=None, rotate_queries=False):
    """Attention of each query over its window rows and selected compressed rows, with sink.

    q             [B, S, H, D]  queries (bf16 in the model; fp16/fp32 also accepted)
    window_kv     [B, W, D]     window rows (K = V), same dtype as q
    window_idx    [B|1, S, w]   int: rows of window_kv each query sees; -1 (or >= W) = none
    compressed_kv [B, N, D]     compressed rows (window_kv's dtype), or None (layers without compression)
    topk_idx      [B|1, S, k]   int: rows of compressed_kv each query sees; -1 = none
    sinks         [H]           fp32 sink logits (denominator only)
    scale         float         softmax scale (512**-0.5 in V4.1)
    rope_cos/sin  [B, S, R]     optional fp32 cos/sin of each query's RoPE angles ([R]: the
                                same for every query): the last 2R dims of the output are
                                de-rotated (interleaved pairs)
    rotate_queries  q arrives unrotated: its last 2R dims are first rotated forward by the
                same angles (`rope_reference`, rounded to q's dtype); needs rope_cos/sin
    shape         optional layout of the output (the same size; the kernel writes it so)
    returns       [B, S, H, D]  in q's dtype; zeros for a query with no valid row

    Uses the GPU kernel when the backend has one, flag `kernel_sparse_attention` is on and
    B*S <= MAX_KERNEL_QUERIES (decode, draft verification); for more queries (prefill) on CUDA
    a tensor-core kernel: attention_prefill_staged.py's where flag
    `kernel_prefill_attention_staged` is on, else attention_prefill.py's where
    `kernel_prefill_attention_mma` is; else `sparse_attention_reference`.
    """
    if rotate_queries and rope_cos is None:
        raise ValueError("rotate_queries needs the angles (rope_cos, rope_sin)")
    if topk_idx is not None and topk_idx.shape[-1] == 0:
        compressed_kv = topk_idx = None   # nothing selected yet (e.g. the first tokens)
    if (flags.get("kernel_sparse_attention") and backend() is not None
            and kernel_supports(q, window_kv, compressed_kv, rope_cos)):
        return sparse_attention_kernel(q, window_kv, window_idx, compressed_kv, topk_idx, sinks,
                                       scale, rope_cos, rope_sin, shape, rotate_queries)
    rows = window_idx.shape[-1] + (0 if compressed_kv is None else topk_idx.shape[-1])
    if attention_prefill_staged.applies(q, window_kv, compressed_kv):
        return _with_rope(attention_prefill_staged.prefill_attention, q, window_kv, window_idx, compressed_kv,
                          topk_idx, sinks, scale, rope_cos, rope_sin, shape, rotate_queries)
    if attention_prefill.applies(q, window_kv, compressed_kv, rows):
        return _with_rope(attention_prefill.prefill_attention, q, window_kv, window_idx, compressed_kv,
                          topk_idx, sinks, scale, rope_cos, rope_sin, shape, rotate_queries)
    return sparse_attention_reference(q, window_kv, window_idx, compressed_kv, topk_idx, sinks,
                                      scale, rope_cos, rope_sin, shape, rotate_queries)
