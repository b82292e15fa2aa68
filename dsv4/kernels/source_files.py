"""CUDA kernel text that reaches MLX as two `#include` lines (flag `kernel_source_files`).

MLX's CUDA backend (0.32.4, custom_kernel.cpp) hashes the whole source of a custom kernel at
every launch (std::hash, to name its module), and a decode step launches ~100 of them: ~580 KB
of text a step at ~0.28 µs a KB on an H100's host, where the step waits on the host's encoding
(benchmarks/results/2026-12-06-1138-primitive-cost.md, 2026-12-06-0845-host-encode.md). So the
header and the body are written once to files named by their content, and MLX gets
`#include "<file>"` in their place: NVRTC reads the files (an absolute path needs no include
directory), the compiler sees the same text, and MLX hashes ~1 KB a kernel.

MLX passes an input's shape, strides or ndim only when the source it is given names
`<input>_shape` (`_strides`, `_ndim`), so the body's line names those it uses in a comment.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from dsv4 import flags
from dsv4.atomic_file import atomic_file


def in_use() -> bool:
    """Whether CUDA kernels reach MLX through the files (flag kernel_source_files; auto: on)."""
    return flags.switch("kernel_source_files", True)


def directory() -> Path:
    """Beside the kernel cache (a stable path keeps the builds' names stable), else in /tmp."""
    from dsv4.kernels import cuda_cache

    builds = cuda_cache.directory()
    if builds is not None:
        return builds / "sources"
    return Path(tempfile.gettempdir()) / f"dsv4-cuda-sources-{os.getuid()}"


def written(where: Path, name: str, part: str, text: str) -> Path:
    """<where>/<name>-<sha256 of text>.<part>.cuh holding `text`, written whole if absent."""
    path = where / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:20]}.{part}.cuh"
    if not path.exists():
        where.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as f:
            f.write(text.encode())
    return path


def stub(name: str, header: str, body: str, input_names: tuple[str, ...]) -> tuple[str, str]:
    """(header, body) for MLX: each an #include of its text, the body's with the shape, strides
    and ndim names the body uses (what MLX looks for to pass them)."""
    where = directory()
    inputs = "|".join(map(re.escape, input_names))
    uses = sorted(set(re.findall(rf"\b(?:{inputs})_(?:shape|strides|ndim)\b", body))) if input_names else []
    named = f"// uses {' '.join(uses)}\n" if uses else ""
    return (f'#include "{written(where, name, "h", header)}"\n',
            f'#include "{written(where, name, "body", body)}"\n{named}')
