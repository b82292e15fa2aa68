"""mHC: four residual copies mixed by learned, Sinkhorn-normalised weights (model-spec 2.2).

A site (attention or MoE of a block) computes its mixes from the streams entering it:
`pre` (how to collapse the copies into the sublayer input), `post` (how to spread the
sublayer output over the copies) and `comb` (a doubly-stochastic 4x4 mixing of the
residual copies). V4.1 is "single-pass": a site collapses with the `pre` of the
previous site and hands its own `pre` to the next one. All mixes are fp32.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import flags
from .config import ModelArgs


def sinkhorn(comb: mx.array, iters: int, eps: float) -> mx.array:
    """softmax rows + eps, then normalise columns, then iters-1 times rows and columns."""
    c = mx.softmax(comb, axis=-1) + eps
    c = c / (mx.sum(c, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (mx.sum(c, axis=-1, keepdims=True) + eps)
        c = c / (mx.sum(c, axis=-2, keepdims=True) + eps)
    return c


def _mixes(streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, *, hc: int,
           norm_eps: float, hc_eps: float, iters: int) -> tuple[mx.array, mx.array, mx.array]:
    flat = streams.reshape(*streams.shape[:2], -1).astype(mx.float32)
    r = mx.rsqrt(mx.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    m = (flat @ fn.T) * r
    pre = mx.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * mx.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    return pre, post, sinkhorn(comb, iters, hc_eps)


@functools.lru_cache(maxsize=None)
def _compiled_mixes(hc: int, norm_eps: float, hc_eps: float, iters: int):
    # ~90 tiny element-wise ops per site (20 Sinkhorn rounds): one compiled graph.
    return mx.compile(functools.partial(_mixes, hc=hc, norm_eps=norm_eps, hc_eps=hc_eps, iters=iters))


def hc_mixes(streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array,
             args: ModelArgs) -> tuple[mx.array, mx.array, mx.array]:
    """streams [B, S, hc, D] -> pre [B, S, hc], post [B, S, hc], comb [B, S, hc, hc] (fp32)."""
    config = dict(hc=args.hc_mult, norm_eps=args.rms_norm_eps, hc_eps=args.hc_eps,
                  iters=args.hc_sinkhorn_iters)
    if flags.get("compile"):
        return _compiled_mixes(**config)(streams, fn, scale, base)
    return _mixes(streams, fn, scale, base, **config)


def collapse(streams: mx.array, pre: mx.array) -> mx.array:
    """sum_c pre_c * X_c in fp32, in the streams' dtype: [B, S, D]."""
    out = mx.sum(pre[..., None] * streams.astype(mx.float32), axis=2)
    return out.astype(streams.dtype)


def expand(y: mx.array, residual: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """X'_j = post_j * y + sum_i comb[i, j] * R_i in fp32: [B, S, hc, D]."""
    mixed = mx.sum(comb[..., None] * residual.astype(mx.float32)[..., :, None, :], axis=2)
    out = post[..., None] * y.astype(mx.float32)[..., None, :] + mixed
    return out.astype(residual.dtype)

