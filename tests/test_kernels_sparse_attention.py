"""Sparse attention with sink: the MLX reference against a float64 numpy transcription of
model-spec §3.7, plus the dispatch rules and the indexer-skip helper. CPU, runs in CI."""

import numpy as np
import pytest

import mlx.core as mx

from dsv4 import flags
from dsv4.kernels import sparse_attention as sa
from dsv4.kernels.selection import indexer_can_be_skipped, select_all_visible


def oracle(q, wkv, wi, ckv, ti, sinks, scale, cos=None, sin=None):
    """Spec §3.7 one query/head at a time, float64, probabilities not rounded."""
    B, S, H, D = q.shape
    out = np.zeros((B, S, H, D))
    for b in range(B):
        for s in range(S):
            rows = [wkv[b, j] for j in wi[b, s] if 0 <= j < wkv.shape[1]]
            if ckv is not None:
                rows += [ckv[b, j] for j in ti[b, s] if 0 <= j < ckv.shape[1]]
            for h in range(H):
                if rows:
                    kv = np.stack(rows)
                    logits = kv @ q[b, s, h] * scale
                    top = max(logits.max(), -1e30)
                    e = np.exp(logits - top)
                    out[b, s, h] = e @ kv / (e.sum() + np.exp(sinks[h] - top))
    if cos is not None:
        R = cos.shape[-1]
        z = out[..., D - 2 * R::2] + 1j * out[..., D - 2 * R + 1::2]
        z = z * np.exp(-1j * np.arctan2(sin, cos))[:, :, None, :]
        out[..., D - 2 * R::2], out[..., D - 2 * R + 1::2] = z.real, z.imag
    return out


def random_case(rng, B, S, H, D, W, N, w, k, dtype, invalid=0.3):
    f = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    wi = rng.integers(0, W, (B, S, w))
    ti = rng.integers(0, max(N, 1), (B, S, k))
    wi[rng.random(wi.shape) < invalid] = -1
    ti[rng.random(ti.shape) < invalid] = -1
    return dict(q=f(B, S, H, D), window_kv=f(B, W, D), window_idx=mx.array(wi.astype(np.int32)),
                compressed_kv=f(B, N, D), topk_idx=mx.array(ti.astype(np.int32)),
                sinks=mx.array(rng.standard_normal(H).astype(np.float32)), scale=D ** -0.5)


def as_np(case):
    g = lambda a: np.array(a.astype(mx.float32)).astype(np.float64)
    return (g(case["q"]), g(case["window_kv"]), np.array(case["window_idx"]), g(case["compressed_kv"]),
            np.array(case["topk_idx"]), np.array(case["sinks"]).astype(np.float64), case["scale"])


@pytest.mark.parametrize("S", [1, 5])
def test_reference_fp32_matches_spec(S):
    rng = np.random.default_rng()
    case = random_case(rng, 2, S, 3, 64, 9, 11, 6, 5, mx.float32)
    got = np.array(sa.sparse_attention_reference(**case))
    # fp32 throughout (probabilities rounded to fp32 = unchanged): only fp32 arithmetic error.
    np.testing.assert_allclose(got, oracle(*as_np(case)), rtol=1e-4, atol=1e-5)


def test_reference_bf16_matches_spec_within_rounding():
    rng = np.random.default_rng()
    case = random_case(rng, 1, 3, 4, 128, 16, 20, 16, 12, mx.bfloat16)
    got = np.array(sa.sparse_attention_reference(**case).astype(mx.float32))
    want = oracle(*as_np(case))
    # bf16 probabilities (relative error 2^-9 each) and the bf16 output (2^-9 of |o|):
    # together below 2^-7 of the largest |kv| entry.
    bound = 2.0 ** -7 * np.abs(as_np(case)[1]).max()
    assert np.abs(got - want).max() <= bound


def test_edge_cases_all_invalid_one_row_and_sink():
    rng = np.random.default_rng()
    case = random_case(rng, 1, 3, 2, 32, 4, 4, 3, 2, mx.float32, invalid=0.0)
    wi = np.array(case["window_idx"]); ti = np.array(case["topk_idx"])
    wi[0, 0] = -1; ti[0, 0] = -1            # query 0: nothing valid -> zeros
    wi[0, 1] = [2, -1, -1]; ti[0, 1] = -1   # query 1: exactly one row
    ti[0, 2] = [7, 99]                      # out-of-range compressed indices count as -1
    case.update(window_idx=mx.array(wi), topk_idx=mx.array(ti))
    got = np.array(sa.sparse_attention_reference(**case))
    assert np.all(got[0, 0] == 0)
    # One row: softmax weight exp(l)/(exp(l)+exp(sink)) times that row.
    qn, kvn, *_ = as_np(case)
    row = kvn[0, 2]
    for h in range(2):
        logit = row @ qn[0, 1, h] * case["scale"]
        weight = 1.0 / (1.0 + np.exp(float(np.array(case["sinks"])[h]) - logit))
        np.testing.assert_allclose(got[0, 1, h], weight * row, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, oracle(*as_np(case)), rtol=1e-4, atol=1e-5)


def test_without_compressed_rows():
    rng = np.random.default_rng()
    case = random_case(rng, 1, 2, 2, 32, 6, 1, 4, 1, mx.float32)
    q, wkv, wi, _, _, sinks, scale = as_np(case)
    case.update(compressed_kv=None, topk_idx=None)
    got = np.array(sa.sparse_attention(**case))
    np.testing.assert_allclose(got, oracle(q, wkv, wi, None, None, sinks, scale), rtol=1e-4, atol=1e-5)


def test_fused_inverse_rope():
    rng = np.random.default_rng()
    case = random_case(rng, 1, 2, 2, 64, 5, 5, 4, 3, mx.float32)
    theta = rng.uniform(-3, 3, (1, 2, 8)).astype(np.float32)
    cos, sin = np.cos(theta), np.sin(theta)
    got = np.array(sa.sparse_attention(**case, rope_cos=mx.array(cos), rope_sin=mx.array(sin)))
    np.testing.assert_allclose(got, oracle(*as_np(case), cos, sin), rtol=1e-4, atol=1e-5)


def test_fused_query_rotation():
    """Unrotated queries, rotated forward by the angles inside the op (and the output
    de-rotated): the oracle on queries rotated in float64 beforehand."""
    rng = np.random.default_rng()
    case = random_case(rng, 1, 2, 2, 64, 5, 5, 4, 3, mx.float32)
    theta = rng.uniform(-3, 3, (1, 2, 8)).astype(np.float32)
    cos, sin = np.cos(theta), np.sin(theta)
    got = np.array(sa.sparse_attention(**case, rope_cos=mx.array(cos), rope_sin=mx.array(sin),
                                       rotate_queries=True))
    q, *rest = as_np(case)
    z = (q[..., 64 - 16::2] + 1j * q[..., 64 - 16 + 1::2]) * np.exp(1j * theta)[:, :, None, :]
    q[..., 64 - 16::2], q[..., 64 - 16 + 1::2] = z.real, z.imag
    np.testing.assert_allclose(got, oracle(q, *rest, cos, sin), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="needs the angles"):
        sa.sparse_attention(**case, rotate_queries=True)


def test_rope_reference_is_the_models_rope():
    """The forward rotation by cos/sin of one position equals the model's RoPE there."""
    from dsv4.attention import rope
    rng = np.random.default_rng()
    x = mx.array(rng.standard_normal((1, 1, 4, 64)).astype(np.float32))
    freqs = mx.array((10000.0 ** (np.arange(16) / 16)).astype(np.float32))
    theta = 37 / freqs
    got = sa.rope_reference(x, mx.cos(theta), mx.sin(theta))
    np.testing.assert_allclose(np.array(got), np.array(rope(x, 37, freqs)), rtol=1e-5, atol=1e-5)


def test_dispatch_cpu_uses_reference_and_switch_selects_kernel(monkeypatch):
    rng = np.random.default_rng()
    case = random_case(rng, 1, 1, 2, 32, 4, 4, 2, 2, mx.float32)
    assert sa.backend() is None          # CI runs on CPU: always the reference
    called = []
    monkeypatch.setattr(sa, "sparse_attention_kernel", lambda *a, **k: called.append(1) or "kernel")
    np.testing.assert_array_equal(np.array(sa.sparse_attention(**case)),
                                  np.array(sa.sparse_attention_reference(**case)))
    monkeypatch.setattr(sa, "backend", lambda: "cuda")
    assert sa.sparse_attention(**case) == "kernel"
    with flags.override(kernel_sparse_attention=False):
        assert isinstance(sa.sparse_attention(**case), mx.array)
    odd = dict(case, q=case["q"][..., :16], window_kv=case["window_kv"][..., :16],
               compressed_kv=case["compressed_kv"][..., :16])
    assert isinstance(sa.sparse_attention(**odd), mx.array)   # D=16 is not a kernel shape
    prefill = random_case(rng, 1, sa.MAX_KERNEL_QUERIES + 1, 2, 32, 4, 4, 2, 2, mx.float32)
    assert isinstance(sa.sparse_attention(**prefill), mx.array)   # prefill: the reference
    assert called == [1]


@pytest.mark.parametrize("start_pos,length,ratio", [(0, 7, 2), (9, 1, 2), (3, 4, 1)])
def test_select_all_visible_equals_topk_when_everything_fits(start_pos, length, ratio):
    rng = np.random.default_rng()
    n = (start_pos + length) // ratio
    topk = n + 2
    assert indexer_can_be_skipped(n, topk) and not indexer_can_be_skipped(topk + 1, topk)
    positions = mx.arange(start_pos, start_pos + length, dtype=mx.int32)
    got = np.array(select_all_visible(positions, 2, ratio, n + 3))   # wider than needed: -1 pads
    assert got.shape == (2, length, n + 3)
    scores = rng.standard_normal((2, length, n))
    for b in range(2):
        for s in range(length):
            visible = (start_pos + s + 1) // ratio
            masked = np.where(np.arange(n) < visible, scores[b, s], -np.inf)
            picked = np.sort(np.argsort(-masked)[:topk])
            picked = picked[np.isfinite(masked[picked])]
            assert sorted(got[b, s][got[b, s] >= 0]) == list(picked)


def test_reference_in_query_blocks_equals_one_block(monkeypatch):
    rng = np.random.default_rng()
    case = random_case(rng, 1, 7, 2, 32, 9, 9, 4, 3, mx.float32)
    theta = rng.uniform(-3, 3, (1, 7, 4)).astype(np.float32)
    case.update(rope_cos=mx.array(np.cos(theta)), rope_sin=mx.array(np.sin(theta)))
    whole = np.array(sa.sparse_attention_reference(**case))
    monkeypatch.setattr(sa, "QUERY_BLOCK", 3)
    np.testing.assert_array_equal(np.array(sa.sparse_attention_reference(**case)), whole)


def test_batch_one_indices_broadcast_over_the_batch():
    rng = np.random.default_rng()
    case = random_case(rng, 2, 3, 2, 32, 5, 6, 4, 2, mx.float32)
    shared_w, shared_t = case["window_idx"][:1], case["topk_idx"][:1]
    got = np.array(sa.sparse_attention(**dict(case, window_idx=shared_w, topk_idx=shared_t)))
    full = dict(case, window_idx=mx.broadcast_to(shared_w, (2, 3, 4)), topk_idx=mx.broadcast_to(shared_t, (2, 3, 2)))
    np.testing.assert_allclose(got, oracle(*as_np(full)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_visible,size,kb", [(12, 4, 3), (13, 4, 3), (40, 8, 5), (41, 8, 5)])
def test_candidate_mask_is_the_visibility_while_candidates_do_not_matter(n_visible, size, kb):
    """candidates_matter is False exactly when the candidate source's mask keeps every visible
    row (then no mask is made): checked against Indexer._candidates on random scores."""
    from types import SimpleNamespace

    from dsv4.attention import Indexer
    from dsv4.kernels.selection import candidates_matter

    args = SimpleNamespace(candidate_block_size=size, candidate_topk_blocks=kb)
    rng = np.random.default_rng()
    n = 64                                              # the keys' capacity
    visible = mx.array([[n_visible]])
    scores = mx.array(rng.standard_normal((1, 1, n)).astype(np.float32))
    scores = mx.where(mx.arange(n) < visible, scores, -mx.inf)
    mask = np.array(Indexer._candidates(SimpleNamespace(args=args), scores, visible))[0, 0]
    keeps_all = bool(mask[:n_visible].all())
    assert candidates_matter(args, n_visible) == (not keeps_all)
    assert candidates_matter(args, n_visible) == (-(-n_visible // size) > kb)


def test_attention_threadgroups_switch_sets_the_row_splits(monkeypatch):
    """DSV4_ATTENTION_THREADGROUPS: the partial kernel's grid aims for that many threadgroups
    (a power of two of splits per head group, at most one per MIN_ROWS_PER_SPLIT rows)."""
    rng = np.random.default_rng()
    case = random_case(rng, 1, 1, 64, 512, 128, 600, 128, 512, mx.bfloat16)
    grids = []

    def partial(**kw):
        grids.append(kw["grid"])
        splits = kw["grid"][1] // 8
        return mx.zeros((64 * splits * 512,)), mx.zeros((64 * splits * 2,))

    monkeypatch.setattr(sa, "PARTIAL_KERNEL", partial)
    monkeypatch.setattr(sa, "MERGE_KERNEL", lambda **kw: [mx.zeros(kw["output_shapes"][0], mx.bfloat16)])
    for target in (256, 64, 1):
        with flags.override(attention_threadgroups=target):
            sa.sparse_attention_kernel(**case)
    assert [g[1] for g in grids] == [8 * 32, 8 * 8, 8 * 1]   # 8 groups of 8 heads x splits


def gathered_then_widened(q, window_kv, window_idx, compressed_kv, topk_idx, sinks, scale):
    """The reference as it was written up to 2026-12-04: each query's rows gathered as stored,
    the window's and the compressed ones concatenated, then widened to fp32."""
    B, S, H, D = q.shape

    def gather(kv, idx):
        n = kv.shape[1]
        idx = mx.broadcast_to(idx, (B, S, idx.shape[-1]))
        valid = (idx >= 0) & (idx < n)
        flat = mx.where(valid, idx, 0).astype(mx.int32) + (mx.arange(B, dtype=mx.int32) * n)[:, None, None]
        return mx.take(kv.reshape(B * n, D), flat.reshape(-1), axis=0).reshape(B, S, -1, D), valid

    rows, valid = gather(window_kv, window_idx)
    if compressed_kv is not None:
        c_rows, c_valid = gather(compressed_kv, topk_idx)
        rows, valid = mx.concatenate([rows, c_rows], axis=2), mx.concatenate([valid, c_valid], axis=2)
    kv32 = rows.astype(mx.float32)
    scores = mx.where(valid[:, :, None, :], (q.astype(mx.float32) @ kv32.swapaxes(-1, -2)) * scale, -mx.inf)
    top = mx.maximum(mx.max(scores, axis=-1, keepdims=True), -1e30)
    p = mx.exp(scores - top)
    denom = mx.sum(p, axis=-1, keepdims=True) + mx.exp(sinks.astype(mx.float32)[:, None] - top)
    return ((p.astype(rows.dtype).astype(mx.float32) @ kv32) / denom).astype(q.dtype)


# 10 window and 12 compressed rows, 6 + 5 selected a query: 5 or more queries select more rows
# than there are (every row widened once), 1 fewer (each query's gathered as stored).
@pytest.mark.parametrize("B,S,dtype,compressed", [(1, 5, mx.bfloat16, True), (2, 9, mx.float32, True),
                                                  (2, 4, mx.bfloat16, False), (1, 1, mx.bfloat16, True),
                                                  (2, 1, mx.bfloat16, False), (2, 1, mx.float32, True)])
def test_rows_widened_once_give_the_same_bits(monkeypatch, B, S, dtype, compressed):
    """Whether the reference widens every row once (prefill) or each query's gathered rows
    (decode), it gives bit for bit what gathering them as stored and widening after gave, in
    query blocks too, with indices past either part's end and window indices shared by the batch."""
    rng = np.random.default_rng()
    case = random_case(rng, B, S, 3, 64, 10, 12, 6, 5, dtype)
    wi, ti = np.array(case["window_idx"]), np.array(case["topk_idx"])
    wi[rng.random(wi.shape) < 0.1], ti[rng.random(ti.shape) < 0.1] = 10, 12   # one past each part's end
    case.update(window_idx=mx.array(wi[:1]), topk_idx=mx.array(ti))
    if not compressed:
        case.update(compressed_kv=None, topk_idx=None)
    monkeypatch.setattr(sa, "QUERY_BLOCK", 4)
    np.testing.assert_array_equal(np.array(sa.sparse_attention_reference(**case).astype(mx.float32)),
                                  np.array(gathered_then_widened(**case).astype(mx.float32)))
