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


def _cuda_torch():
    """torch where it has a CUDA device, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_seconds(torch, run, repeats: int) -> float:
    """Median seconds of run() by CUDA events, after one untimed call."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _mlx_seconds(make, repeats: int) -> float:
    """Median seconds to evaluate make()'s result, after one untimed evaluation."""
    import mlx.core as mx
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        mx.eval(make())
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def copy_roofline(nbytes: int = COPY_BYTES, repeats: int = 20) -> float | None:
    """TB/s of a device copy by torch (read + write), or None without a CUDA torch."""
    torch = _cuda_torch()
    if torch is None:
        return None
    def timed():   # the buffers go when it returns, before the cache is emptied for MLX
        src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
        dst = torch.empty_like(src)
        return _torch_seconds(torch, lambda: dst.copy_(src), repeats)

    seconds = timed()
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds / 1e12


def mlx_copy(nbytes: int = COPY_BYTES, repeats: int = 20) -> float:
    """TB/s of MLX's own copy of the same buffer (read + write), for comparison."""
    import mlx.core as mx
    src = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(src)
    return 2 * nbytes / _mlx_seconds(lambda: src + 0, repeats) / 1e12   # a fresh buffer each time


def matmul_roofline(n: int = 8192, repeats: int = 10) -> float | None:
    """TFLOP/s of a bf16 n x n x n matmul by torch (cuBLAS), or None without a CUDA torch: the
    compute roofline a prefill is measured against."""
    torch = _cuda_torch()
    if torch is None:
        return None
    def timed():
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        return _torch_seconds(torch, lambda: a @ b, repeats)

    seconds = timed()
    torch.cuda.empty_cache()
    return 2 * n ** 3 / seconds / 1e12


def mlx_matmul(n: int = 8192, repeats: int = 10) -> float:
    """TFLOP/s of MLX's bf16 n x n x n matmul, for comparison."""
    import mlx.core as mx
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    b = mx.random.normal((n, n)).astype(mx.bfloat16)
    mx.eval(a, b)
    return 2 * n ** 3 / _mlx_seconds(lambda: a @ b, repeats) / 1e12


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args(argv)
    copy, flops = copy_roofline(), matmul_roofline()
    print(f"torch device copy: {copy:.2f} TB/s" if copy else "torch device copy: no CUDA torch")
    print(f"MLX copy (x + 0):  {mlx_copy():.2f} TB/s")
    print(f"torch bf16 matmul: {flops:.0f} TFLOP/s" if flops else "torch bf16 matmul: no CUDA torch")
    print(f"MLX bf16 matmul:   {mlx_matmul():.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
