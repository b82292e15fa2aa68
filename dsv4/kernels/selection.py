"""Skipping work that cannot change the result: indexer scoring when every row is selected, the
candidate blocks when every block is kept.

The indexer keeps the top k of the compressed rows a query can see (model-spec §3.6). While
the cache holds at most k compressed rows, every visible row is kept whatever the scores, so
the scoring (the indexer's q projection, the score matmul, the candidate-block pass and the
top-k) can be skipped and the selection written down directly.
"""

from __future__ import annotations

import mlx.core as mx

from dsv4.constants import ramp


def candidates_matter(args, n_compressed: int) -> bool:
    """Whether the candidate source's block mask can drop a visible row: only when more blocks
    hold visible rows (at most `n_compressed`) than the candidate top-k keeps. Otherwise every
    such block is kept (its best score is finite, the others' -inf): the mask is the visibility,
    which the scores apply anyway, and the blocks need not be ranked."""
    return -(-n_compressed // args.candidate_block_size) > args.candidate_topk_blocks


def indexer_can_be_skipped(n_compressed: int, topk: int) -> bool:
    """True when all `n_compressed` rows (the most any query sees) fit in the top `topk`."""
    return n_compressed <= topk


def select_all_visible(positions: mx.array, batch: int, ratio: int, width: int) -> mx.array:
    """The indexer's selection when it keeps everything: [batch, S, width] int32.

    The query at absolute position t (`positions` [S], int32) sees compressed rows
    j < (t+1)//ratio; row j is listed at column j (ascending, as the reference sorts its
    top-k), -1 past the visible count. Use only when the visible count is at most `width`
    and `indexer_can_be_skipped` holds.
    """
    visible = ((positions + 1) // ratio)[None, :, None]                 # [1, S, 1]
    rows = ramp(width, mx.int32, (1, 1, width))                         # a constant at its shape
    idx = mx.where(rows < visible, rows, -1)                            # [1, S, width]
    return mx.broadcast_to(idx, (batch, positions.shape[0], width))
