"""The memory roofline a GPU benchmark compares itself with, measured in the same process.

`copy_roofline()` times a device-to-device copy of a large buffer with torch (or cupy), whose
copy kernels reach the card's real bandwidth, and counts read + written bytes: 4.28 TB/s on the
H200, where MLX's own copy reaches ~2.8. A step's effective bandwidth (the bytes its weights
occupy over its time) is reported as a share of this number. None where neither library has a
GPU (the CPU runs of a benchmark then leave the column out).

    python -m benchmarks.roofline          # prints the copy roofline and MLX's copy
"""

from __future__ import annotations

import argparse
import statistics
import time

COPY_BYTES = 1 << 32   # 4 GiB: far beyond any cache, short enough to time in ~10 ms


def _torch_copy(nbytes: int, repeats: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1.0)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e12


def copy_roofline(nbytes: int = COPY_BYTES, repeats: int = 20) -> float | None:
    """TB/s of a device copy by torch (read + write), or None without a CUDA torch."""
    return _torch_copy(nbytes, repeats)


def mlx_copy(nbytes: int = COPY_BYTES, repeats: int = 20) -> float:
    """TB/s of MLX's own copy of the same buffer (read + write), for comparison."""
    import mlx.core as mx
    src = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(src)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        dst = mx.array(src + 0)   # a fresh buffer: one read and one write of every element
        mx.eval(dst)
        times.append(time.perf_counter() - t)
        del dst
    return 2 * nbytes / statistics.median(times[1:]) / 1e12


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args(argv)
    torch_tbs = copy_roofline()
    print(f"torch device copy: {torch_tbs:.2f} TB/s" if torch_tbs else "torch device copy: no CUDA torch")
    print(f"MLX copy (x + 0):  {mlx_copy():.2f} TB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
