"""Values a compiled decode step should receive as constants instead of recomputing.

Inside a compiled graph an `mx.arange`, or a cast or reshape of a weight, is a primitive run at
every call (a launch on a GPU, and for a cast a full copy of the weight). Ramps are made once
and kept. `kept` keeps a value derived from a weight on its module until the weight is replaced
(the CPU's dense copies of quantized weights), but for a module marked `single_use` (the expert
cache's modules, whose slots are refilled from disk, and whose arrays inside a compiled segment
are the graph's inputs, which cannot be evaluated while tracing): there it is computed inline.
`derived` keeps only inside `keeping()`, which
the fixed-shape decode step enters while it traces: elsewhere (training, where weights change
and carry gradients) it computes inline.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from . import encode_thread

_keeping = False


_NUMPY = {mx.int32: np.int32, mx.int64: np.int64, mx.uint32: np.uint32, mx.float32: np.float32}


@lru_cache(maxsize=512)
def ramp(n: int, dtype: mx.Dtype = mx.int32, shape: tuple = None) -> mx.array:
    """0, 1, .., n-1 as an array of host data (so a graph traced by mx.compile takes it as a
    constant, not an Arange primitive, even on the first call), laid out as `shape` (default
    [n]; a reshape inside the graph would be a primitive too); treat as read-only."""
    return mx.array(np.arange(n, dtype=_NUMPY[dtype]).reshape(shape or (n,)))


@contextlib.contextmanager
def keeping() -> Iterator[None]:
    global _keeping
    saved, _keeping = _keeping, True
    try:
        yield
    finally:
        _keeping = saved


def kept(owner, key: str, source: mx.array, make: Callable[[], mx.array]) -> mx.array:
    """make() (a function of `source`, a weight of `owner`), evaluated once and kept on the
    owner; made again if the weight array was replaced; made inline for a single-use owner."""
    if owner.__dict__.get("single_use"):
        return make()
    store = owner.__dict__.setdefault("_derived", {})
    hit = store.get(key)
    if hit is None or hit[0] is not source:
        value = make()
        encode_thread.evaluate(value)
        store[key] = (source, value)
    return store[key][1]


def derived(owner, key: str, source: mx.array, make: Callable[[], mx.array]) -> mx.array:
    """`kept` inside `keeping()`, else make() inline."""
    return kept(owner, key, source, make) if _keeping else make()
