"""The rooflines a GPU benchmark compares itself with, measured in the same process.

`copy_roofline()` times a device-to-device copy of a large buffer with torch, whose copy
kernels reach the card's real bandwidth, and counts read + written bytes: 4.29 TB/s on the
H200, where MLX's own copy reached 2.8-3.7. A step's effective bandwidth (the bytes its weights
occupy over its time) is reported as a share of this number. None without a CUDA torch (the
CPU runs of a benchmark then leave the column out).

`matmul_roofline()` times a bf16 8192^3 matmul by torch (cuBLAS): the compute roofline a prefill
is compared with.

    python -m benchmarks.roofline          # prints both, and MLX's own copy and matmul
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


def matmul_roofline(n: int = 8192, repeats: int = 10) -> float | None:
    """TFLOP/s of a bf16 n x n x n matmul by torch (cuBLAS), or None without a CUDA torch: the
    compute roofline a prefill is measured against."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / statistics.median(times) / 1e12


def mlx_matmul(n: int = 8192, repeats: int = 10) -> float:
    """TFLOP/s of MLX's bf16 n x n x n matmul, for comparison."""
    import mlx.core as mx
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    b = mx.random.normal((n, n)).astype(mx.bfloat16)
    mx.eval(a @ b)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args(argv)
    torch_tbs = copy_roofline()
    print(f"torch device copy: {torch_tbs:.2f} TB/s" if torch_tbs else "torch device copy: no CUDA torch")
    print(f"MLX copy (x + 0):  {mlx_copy():.2f} TB/s")
    flops = matmul_roofline()
    print(f"torch bf16 matmul: {flops:.0f} TFLOP/s" if flops else "torch bf16 matmul: no CUDA torch")
    print(f"MLX bf16 matmul:   {mlx_matmul():.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
