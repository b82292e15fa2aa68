"""Prefill's sparse attention with each query's rows staged once for all its heads (flag
`kernel_prefill_attention_staged`; auto: on under CUDA).

Why. attention_prefill.py's launch gives a threadgroup 16 heads of one query, so a query's 640
rows (640 KB at V4.1's widths) come from L2 once per group of 16 heads and pass: 8 times for
64 heads. At 2048 queries that is ~10.7 GB through L2 for ~171 GFLOP, and the launch took
4.1 ms on an H100, ~5% of the tensor cores' rate (2026-12-06-2006-prefill-profile-4096-c2048.md).

What. A threadgroup takes one query and 16 HG of its heads (all 64 of V4.1: HG = 4, 512
threads), and brings the query's rows into threadgroup memory 16 at a time by cp.async, the next
tile in flight while the current one multiplies. SIMD group w takes heads 16 (w / 4) .. + 15 and
the quarter w % 4 of the dims, so every staged row serves every head. The queries stay in
registers as A fragments (D/16 a lane); the scores never leave them: each SIMD group writes its
part of a tile's 16 x 16 scores (its dims) to threadgroup memory, and every SIMD group of the
head group adds the four parts in dim order, so all four hold the same full scores. The rows
go by twice: pass 0 takes the maxima, pass 1 recomputes the scores (the same sums in the same
order: the same values) and makes p, its sums and the PV product, the scores' D fragments
turned into PV's A fragments in registers. The queries' product is made twice (1.5x the FLOPs),
for no stored scores.

Numbers: attention_prefill.py's, the reference's: scores q . kv in fp32 times the scale;
M = max(max score, -1e30); p = exp(score - M), its fp32 sum plus exp(sink - M) the denominator;
p rounded to bf16 for PV, fp32 sums; out = numer / denom rounded to bf16. Only the fp32
summation order differs from the reference.

Fragments (PTX ISA, m16n8k16, lane = 4 q + t): A {(q, 2t..), (q+8, 2t..), (q, 2t+8..),
(q+8, 2t+8..)}, B {(2t.., q), (2t+8.., q)}, D {(q, 2t), (q, 2t+1), (q+8, 2t), (q+8, 2t+1)}.
- QK: the k positions of a 32-dim step stand for the dims a lane loads with one 16-byte word
  (attention_prefill.py's order; the queries' A takes the same); n-tile n is tile rows 8 n ...
- PV: k is the tile row (the scores' two n-tiles are A's two k halves). B packs two rows at one
  dim, so a lane loads four rows' 16-byte words at one chunk and pairs their halves with
  byte_perm: for n-tile 8 h + e its column n is dim dq D/4 + 64 h + 8 n + e, and a lane's D
  fragment holds 16 consecutive dims of a head (two 16-byte stores).
- Staged row r's chunk c (16 bytes) sits at chunk c ^ ((r & 6) ^ 4 (r & 1)): each 8-lane phase of
  both fragments' 16-byte loads meets 8 distinct bank groups.
"""

from __future__ import annotations

import math

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import attention_prefill
from dsv4.kernels.dialect import Kernel, backend, constant, falls_back, shared_memory_limit

HEADS = 16      # heads per SIMD group: the mma's M
TILE = 16       # rows staged at a time: PV's k
MAX_THREADS = 512   # 4 head groups of 4 SIMD groups: 128 registers a thread (launch bounds)

HEADER = attention_prefill.HEADER + r"""
// Whether row r (< NR) of query qi's list picks a row (prefill_row's test, without the pointer).
template <int NW, int NK, typename PI>
KFN bool prefill_row_valid(PI window_idx, PI topk_idx, int qi, int r, int W, int N) {
  if (r < NW) {
    const int j = window_idx[(size_t)qi * NW + r];
    return j >= 0 && j < W;
  }
  if (r >= NW + NK) return false;
  const int j = topk_idx[(size_t)qi * NK + (r - NW)];
  return j >= 0 && j < N;
}
// Staged row r's 16-byte chunk c sits at chunk c ^ staged_swizzle(r) of its row.
KFN int staged_swizzle(int r) { return (r & 6) ^ ((r & 1) << 2); }
// Tile `tile` of query qi's rows into `dst` (TILE x D/8 chunks) by cp.async, zeros for a row that
// picks nothing; one committed group a thread.
template <int D, int NW, int NK, typename PT, typename PI>
KFN void stage_rows(uint4* dst, PT window_kv, PI window_idx, PT compressed_kv, PI topk_idx, int b, int qi,
                    int tile, int W, int N, int tid, int threads) {
  constexpr int CH = D / 8;
  for (int i = tid; i < 16 * CH; i += threads) {
    const int r = i / CH, c = i % CH;
    PT row = prefill_row<D, NW, NK>(window_kv, window_idx, compressed_kv, topk_idx, b, qi, 16 * tile + r, W, N);
    uint4* at = dst + r * CH + (c ^ staged_swizzle(r));
    if (row) {
      cp_async16(at, row + 8 * c);
    } else {
      const uint4 zero = {0u, 0u, 0u, 0u};
      *at = zero;
    }
  }
  cp_async_commit();
}
"""

BODY_TEMPLATE = r"""
  // grid (128 HG, H / (16 HG), B * S): SIMD group w: heads h0 .. h0 + 15, dims dq DW ...
  constexpr int DW = D / 4;    // dims a SIMD group takes
  constexpr int CH = D / 8;    // 16-byte chunks a row
  constexpr int KK = DW / 32;  // QK's 32-dim steps
  constexpr int NB = DW / 64;  // PV's 64-dim blocks
  const int S = queries_shape[1], W = window_kv_shape[1], N = compressed_kv_shape[1];
  const int qi = (int)group_z, b = qi / S, hg = (int)warp >> 2, dq = (int)warp & 3;
  const int h0 = 16 * (HG * HEAD_GROUPS_Y + hg), q = (int)lane >> 2, t = (int)lane & 3;
  const float scale = params[0];
  SHARED uint4 rows[2][16 * CH];
  SHARED uint4 parts[4 * HG][2][32];

  // The queries' A fragments (heads h0 + q, h0 + q + 8): dims dq DW + 32 k + 8 t .. + 7.
  uint32_t qa[KK][8];
  for (int k = 0; k < KK; ++k) {
    const int c = dq * (DW / 8) + 4 * k + t;
    uint4 lo = LOAD_U4(queries + ((size_t)qi * H + h0 + q) * D, c);
    uint4 hi = LOAD_U4(queries + ((size_t)qi * H + h0 + q + 8) * D, c);
    ROTATE_QUERIES
    qa[k][0] = lo.x; qa[k][1] = hi.x; qa[k][2] = lo.y; qa[k][3] = hi.y;
    qa[k][4] = lo.z; qa[k][5] = hi.z; qa[k][6] = lo.w; qa[k][7] = hi.w;
  }
  // Where this lane's fragments sit in a staged tile (16-byte chunks): QK's row 8 n + q at the
  // chunks of k steps of parity p (add 8 (k >> 1)); PV's rows 2t, 2t + 1, 2t + 8, 2t + 9 at chunk
  // q of its 64-dim blocks (add 8 h). The swizzle changes only a chunk's low 3 bits.
  int qk_at[2][2], pv_at[4];
  for (int n = 0; n < 2; ++n)
    for (int p = 0; p < 2; ++p) {
      const int r = 8 * n + q;
      qk_at[n][p] = r * CH + dq * (DW / 8) + ((4 * p + t) ^ staged_swizzle(r));
    }
  for (int i = 0; i < 4; ++i) {
    const int r = 2 * t + (i & 1) + 8 * (i >> 1);
    pv_at[i] = r * CH + dq * (DW / 8) + (q ^ staged_swizzle(r));
  }
  float acc[8 * NB][4];
  for (int j = 0; j < 8 * NB; ++j) for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, s0 = 0.0f, s1 = 0.0f;

  TILES
  // Two buffers: tile g + 1 staged while tile g multiplies, or (RESIDENT, count <= 2) both at once.
  for (int i = 0; i < (RESIDENT ? count : 1); ++i)
    stage_rows<D, NW, NK>(rows[i], window_kv, window_idx, compressed_kv, topk_idx, b, qi, first + i, W, N, (int)tid,
                          (int)group_threads);
  for (int g = 0; g < 2 * count; ++g) {
    const int tile = first + g % count;
    if (g == 0 || !RESIDENT) {
      cp_async_wait<0>();
    }
    BARRIER();   // tile g landed for all; every SIMD group is done with tile g - 1 and its parts
    if (!RESIDENT && g + 1 < 2 * count) {
      stage_rows<D, NW, NK>(rows[(g + 1) & 1], window_kv, window_idx, compressed_kv, topk_idx, b, qi,
                            first + (g + 1) % count, W, N, (int)tid, (int)group_threads);
    }
    if (g == count) {   // pass 0's maxima, over the lanes t of each head
      for (int o = 1; o <= 2; o <<= 1) { m0 = FMAX(m0, simd_xor_f(m0, o)); m1 = FMAX(m1, simd_xor_f(m1, o)); }
      m0 = FMAX(m0, -1e30f); m1 = FMAX(m1, -1e30f);
    }
    const uint4* tr = rows[RESIDENT ? g % count : g & 1];

    // This SIMD group's part of the scores: heads q, q + 8 x tile rows 8 n + 2t, 8 n + 2t + 1.
    float d[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    for (int n = 0; n < 2; ++n) {
      for (int k = 0; k < KK; ++k) {
        const uint4 v = tr[qk_at[n][k & 1] + 8 * (k >> 1)];
        const uint32_t b0[2] = {v.x, v.y}, b1[2] = {v.z, v.w};
        mma_16816_bf16(d[n], qa[k], b0);
        mma_16816_bf16(d[n], qa[k] + 4, b1);
      }
    }
    for (int n = 0; n < 2; ++n) {
      const uint4 u = {AS_UINT(d[n][0]), AS_UINT(d[n][1]), AS_UINT(d[n][2]), AS_UINT(d[n][3])};
      parts[warp][n][lane] = u;
    }
    BARRIER();
    // The full scores: the head group's four parts in dim order.
    float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    for (int j = 0; j < 4; ++j) {
      for (int n = 0; n < 2; ++n) {
        const uint4 u = parts[4 * hg + j][n][lane];
        sc[n][0] += AS_FLOAT(u.x); sc[n][1] += AS_FLOAT(u.y); sc[n][2] += AS_FLOAT(u.z); sc[n][3] += AS_FLOAT(u.w);
      }
    }
    for (int n = 0; n < 2; ++n) {
      const int r = 16 * tile + 8 * n + 2 * t;
      const bool ok0 = prefill_row_valid<NW, NK>(window_idx, topk_idx, qi, r, W, N);
      const bool ok1 = prefill_row_valid<NW, NK>(window_idx, topk_idx, qi, r + 1, W, N);
      sc[n][0] = ok0 ? sc[n][0] * scale : -INFINITY; sc[n][1] = ok1 ? sc[n][1] * scale : -INFINITY;
      sc[n][2] = ok0 ? sc[n][2] * scale : -INFINITY; sc[n][3] = ok1 ? sc[n][3] * scale : -INFINITY;
    }
    if (g < count) {
      m0 = FMAX(m0, FMAX(FMAX(sc[0][0], sc[0][1]), FMAX(sc[1][0], sc[1][1])));
      m1 = FMAX(m1, FMAX(FMAX(sc[0][2], sc[0][3]), FMAX(sc[1][2], sc[1][3])));
      continue;
    }
    // p, its sums, and PV's A fragment: k = tile row (n-tile 0's columns, then n-tile 1's).
    uint32_t pa[4];
    for (int n = 0; n < 2; ++n) {
      const float p0 = EXP(sc[n][0] - m0), p1 = EXP(sc[n][1] - m0);
      const float p2 = EXP(sc[n][2] - m1), p3 = EXP(sc[n][3] - m1);
      s0 += p0 + p1; s1 += p2 + p3;
      pa[2 * n] = bf16_rne_bits(p0) | (bf16_rne_bits(p1) << 16);
      pa[2 * n + 1] = bf16_rne_bits(p2) | (bf16_rne_bits(p3) << 16);
    }
    // PV: n-tile 8 h + e's column q is dim 8 c + e, c = dq DW / 8 + 8 h + q.
    for (int h = 0; h < NB; ++h) {
      const uint4 ra = tr[pv_at[0] + 8 * h], rb = tr[pv_at[1] + 8 * h];
      const uint4 rc = tr[pv_at[2] + 8 * h], rd = tr[pv_at[3] + 8 * h];
      const uint32_t wa[4] = {ra.x, ra.y, ra.z, ra.w}, wb[4] = {rb.x, rb.y, rb.z, rb.w};
      const uint32_t wc[4] = {rc.x, rc.y, rc.z, rc.w}, wd[4] = {rd.x, rd.y, rd.z, rd.w};
      for (int e = 0; e < 8; ++e) {
        const uint32_t sel = (e & 1) ? 0x7632u : 0x5410u;
        const uint32_t bb[2] = {BYTE_PERM(wa[e >> 1], wb[e >> 1], sel), BYTE_PERM(wc[e >> 1], wd[e >> 1], sel)};
        mma_16816_bf16(acc[8 * h + e], pa, bb);
      }
    }
  }
  for (int o = 1; o <= 2; o <<= 1) { s0 += simd_xor_f(s0, o); s1 += simd_xor_f(s1, o); }
  EPILOGUE
"""


# The prefill launch's parts of BODY_TEMPLATE: its threadgroups' head groups on grid y, the
# queries as they come (rotated), every tile, and the output normalized by the sink's denominator.
_NORMALIZED = r"""  const float den0 = s0 + EXP(sinks[h0 + q] - m0), den1 = s1 + EXP(sinks[h0 + q + 8] - m1);
  // Heads q, q + 8: dims dq DW + 64 h + 16 t .. + 15 (columns 2t, then 2t + 1, of n-tiles 8 h ..).
  for (int h = 0; h < NB; ++h) {
    uint32_t o0[8], o1[8];
    for (int e = 0; e < 8; e += 2) {
      const int j = 8 * h + e;
      o0[e / 2] = bf16_rne_bits(DIV_RN(acc[j][0], den0)) | (bf16_rne_bits(DIV_RN(acc[j + 1][0], den0)) << 16);
      o0[4 + e / 2] = bf16_rne_bits(DIV_RN(acc[j][1], den0)) | (bf16_rne_bits(DIV_RN(acc[j + 1][1], den0)) << 16);
      o1[e / 2] = bf16_rne_bits(DIV_RN(acc[j][2], den1)) | (bf16_rne_bits(DIV_RN(acc[j + 1][2], den1)) << 16);
      o1[4 + e / 2] = bf16_rne_bits(DIV_RN(acc[j][3], den1)) | (bf16_rne_bits(DIV_RN(acc[j + 1][3], den1)) << 16);
    }
    const int dim = dq * DW + 64 * h + 16 * t;
    uint4* out0 = reinterpret_cast<uint4*>(out + ((size_t)qi * H + h0 + q) * D + dim);
    uint4* out1 = reinterpret_cast<uint4*>(out + ((size_t)qi * H + h0 + q + 8) * D + dim);
    const uint4 a0 = {o0[0], o0[1], o0[2], o0[3]}, a1 = {o0[4], o0[5], o0[6], o0[7]};
    const uint4 b0 = {o1[0], o1[1], o1[2], o1[3]}, b1 = {o1[4], o1[5], o1[6], o1[7]};
    out0[0] = a0; out0[1] = a1; out1[0] = b0; out1[1] = b1;
  }
"""
BODY = (BODY_TEMPLATE.replace("HEAD_GROUPS_Y", "(int)group_y")
        .replace("    ROTATE_QUERIES\n", "")
        .replace("  TILES\n", "  const int first = 0, count = NT;\n  constexpr bool RESIDENT = false;\n")
        .replace("  EPILOGUE\n", _NORMALIZED.lstrip("\n")))


def head_groups(H: int) -> int:
    """Groups of 16 heads a threadgroup takes: as many as divide H, up to 4 (512 threads)."""
    return max(g for g in (1, 2, 4) if (H // HEADS) % g == 0)


def tiles(rows: int) -> int:
    return math.ceil(rows / TILE)


def shared_bytes(D: int, H: int) -> int:
    """Threadgroup memory of a launch: two staged tiles of rows, the scores' parts."""
    return 2 * TILE * D * 2 + 4 * head_groups(H) * 2 * 32 * 16


def _shapes():
    """V4.1's prefill shapes (the syntax gate builds these): window 128 rows, top-512 selected or
    none (window-only layers)."""
    return tuple(((mx.bfloat16, mx.bfloat16, mx.int32, mx.bfloat16, mx.int32, mx.float32, mx.float32),
                  (mx.bfloat16,),
                  (("T", mx.bfloat16), ("D", 512), ("H", 64), ("NW", 128), ("NK", nk), ("HG", 4),
                   ("NT", tiles(128 + nk))))
                 for nk in (512, 1))


KERNEL = Kernel(
    name="dsv4_prefill_sparse_attention_staged",
    input_names=("queries", "window_kv", "window_idx", "compressed_kv", "topk_idx", "sinks", "params"),
    output_names=("out",), body=BODY, header=HEADER, dialects=("cuda",), checks=_shapes(), max_threads=MAX_THREADS)


def applies(q, window_kv, compressed_kv) -> bool:
    """The flag, CUDA, bf16 queries and rows, whole groups of 16 heads, D in steps of 256 (a
    SIMD group's quarter in 64-dim blocks), and a launch within shared memory."""
    H, D = q.shape[-2:]
    bf16 = (q.dtype == window_kv.dtype == mx.bfloat16
            and (compressed_kv is None or compressed_kv.dtype == mx.bfloat16))
    return (backend() == "cuda" and flags.switch("kernel_prefill_attention_staged", True) and bf16
            and H % HEADS == 0 and D % 256 == 0 and shared_bytes(D, H) <= shared_memory_limit("cuda"))


@falls_back(attention_prefill.reference, "kernel_prefill_attention_staged")
def prefill_attention(q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale):
    """attention_prefill.prefill_attention's contract (queries rotated, output not de-rotated)."""
    B, S, H, D = q.shape
    window_idx, compressed_kv, topk_idx = attention_prefill.launch_indices(q, window_idx, compressed_kv, topk_idx)
    hg = head_groups(H)
    (out,) = KERNEL(
        inputs=[q, window_kv, window_idx, compressed_kv, topk_idx, sinks.astype(mx.float32),
                constant((float(scale),))],
        output_shapes=[q.shape], output_dtypes=[q.dtype],
        grid=(128 * hg, H // (HEADS * hg), B * S), threadgroup=(128 * hg, 1, 1),
        template=[("T", q.dtype), ("D", D), ("H", H), ("NW", window_idx.shape[-1]), ("NK", topk_idx.shape[-1]),
                  ("HG", hg), ("NT", tiles(window_idx.shape[-1] + topk_idx.shape[-1]))])
    return out
