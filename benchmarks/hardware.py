"""The machine a benchmark ran on, for the header of every report.

`describe()` returns a flat dict (chip/CPU, cores, memory, OS, Python, MLX version and backend,
accelerator); `to_markdown(info)` renders it as a small Markdown table. Every benchmark report in
`benchmarks/results/` starts with it, so numbers from different machines are never confused.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys


def _run(cmd: list[str]) -> str:
    """stdout of a small system query, or '' where the tool does not exist on this OS."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_name() -> str:
    if sys.platform == "darwin":
        return _run(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    if sys.platform == "darwin":
        text = _run(["sysctl", "-n", "hw.memsize"])
        return round(int(text) / 2**30, 1) if text.isdigit() else None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) * 1024 / 2**30, 1)
    except OSError:
        pass
    return None


def _mlx() -> dict:
    """MLX version, the backend arrays run on by default, and that device's own description."""
    try:
        import mlx.core as mx
    except ImportError:
        return {"mlx_version": "not installed", "mlx_backend": "none"}
    device = mx.default_device()
    if device.type == mx.gpu:
        backend = "metal" if mx.metal.is_available() else "cuda"
    else:
        backend = "cpu"
    info = {"mlx_version": mx.__version__, "mlx_backend": backend}
    details = mx.device_info()
    if "device_name" in details:
        info["mlx_device"] = str(details["device_name"])
    memory = details.get("memory_size") or details.get("total_memory")
    if memory:
        info["mlx_device_memory_gb"] = round(int(memory) / 2**30, 1)
    return info


def _gpu_names() -> str:
    """NVIDIA GPUs by name (CUDA machines); '' elsewhere."""
    text = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return ", ".join(line.strip() for line in text.splitlines() if line.strip())


def describe() -> dict:
    """Flat description of this machine and its MLX; all values are str, int or float."""
    info = {
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "memory_gb": _memory_gb(),
        "os": platform.platform(),
        "python": platform.python_version(),
    }
    info.update(_mlx())
    gpus = _gpu_names()
    if gpus:
        info["gpus"] = gpus
    return {key: value for key, value in info.items() if value not in (None, "")}


def to_markdown(info: dict) -> str:
    """A two-column Markdown table of `describe()`'s dict."""
    rows = ["| field | value |", "|---|---|"]
    rows += [f"| {key} | {value} |" for key, value in info.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    argparse.ArgumentParser(prog="python -m benchmarks.hardware", description=__doc__).parse_args()
    print(to_markdown(describe()))
