"""How much memory a run took, measured where the backend can tell.

On a GPU backend (Metal, CUDA) MLX's allocator holds every array, so its peak is the model's
footprint. On the CPU backend MLX's count misses what it does not allocate itself (weights
mapped from the safetensors files, numpy buffers), so the process's peak resident set is
the honest number there.
"""

from __future__ import annotations

import resource
import sys

import mlx.core as mx


def peak() -> tuple[float, str]:
    """(GB, what was measured)."""
    if mx.default_device() == mx.gpu:
        return mx.get_peak_memory() / 1e9, "MLX peak"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9, "process peak RSS"
