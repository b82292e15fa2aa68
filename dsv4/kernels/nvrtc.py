"""NVRTC through ctypes: one CUDA source to a cubin, in this process or in a child of its own.

Standard library only, so that a child runs this file by its path without importing MLX or
dsv4. Builds run in children because NVRTC's threads in one process serialize much of their
work: on the H200's 16 cores, 26 kernels built on 16 threads took 191 s of build time for
~160 s of wall time, about what one after another takes; on two cores, four builds took 3.3 s
on two threads against 2.5 s in two processes and 4.5 s one after another
(benchmarks/nvrtc_builds.py, benchmarks/results/2026-12-03-1949-nvrtc-builds.md).
"""

from __future__ import annotations

import ctypes
import pickle
import subprocess
import sys
from pathlib import Path

UTILS_NAME = "mlx/backend/cuda/device/utils.cuh"
# What dsv4's bodies need of MLX's utils.cuh: the CUDA types it includes, Shape and Strides.
UTILS_STANDIN = """#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/cstdint>
#include <cuda/std/array>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
"""


class BuildError(RuntimeError):
    """NVRTC refused a source (the message is its log)."""


def build(source: str, name: str, arch: str, library: str | None, includes: list[Path],
          options: tuple = (), log: list | None = None, ptx: list | None = None) -> tuple[bytes, str]:
    """Compile `source` as MLX does (--device-as-default-execution-space, the target `arch` such
    as sm_90a, utils.cuh stood in for): (cubin, lowered name of `name`). `options` are added to
    MLX's (benchmarks: --ptxas-options=-v); `log` gets NVRTC's log appended; `ptx` the PTX (a
    virtual `arch` such as compute_90a has no cubin: b"")."""
    lib = ctypes.CDLL(library or "libnvrtc.so")
    prog = ctypes.c_void_p()
    headers = (ctypes.c_char_p * 1)(UTILS_STANDIN.encode())
    names = (ctypes.c_char_p * 1)(UTILS_NAME.encode())
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 1, headers, names):
        raise BuildError("nvrtcCreateProgram failed")
    try:
        full = f"mlx::core::cu::{name}".encode()
        lib.nvrtcAddNameExpression(prog, full)
        opts = [b"--device-as-default-execution-space", f"--gpu-architecture={arch}".encode()]
        opts += [f"--include-path={p}".encode() for p in includes]
        opts += [o.encode() for o in options]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        text = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, text)
        if rc != 0:
            raise BuildError(text.value.decode(errors="replace"))
        if log is not None:
            log.append(text.value.decode(errors="replace"))
        if ptx is not None:
            size = ctypes.c_size_t()
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, text)
            ptx.append(text.value.decode())
        lowered = ctypes.c_char_p()
        lib.nvrtcGetLoweredName(prog, full, ctypes.byref(lowered))
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)):
            size.value = 0
        cubin = ctypes.create_string_buffer(size.value)
        if size.value:
            lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw, lowered.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def build_in_child(source: str, name: str, arch: str, library: str | None,
                   includes: list[Path]) -> tuple[bytes, str]:
    """`build` in a fresh Python process running this file: the same (cubin, lowered name), or
    BuildError with NVRTC's log (or the child's, if it died)."""
    job = pickle.dumps((source, name, arch, library, [str(p) for p in includes]))
    done = subprocess.run([sys.executable, "-I", __file__], input=job, capture_output=True)
    if done.returncode != 0:
        raise BuildError(done.stderr.decode(errors="replace").strip() or f"NVRTC child exited {done.returncode}")
    status, *result = pickle.loads(done.stdout)
    if status == "refused":
        raise BuildError(result[0])
    return result[0], result[1]


def _child() -> None:
    source, name, arch, library, includes = pickle.load(sys.stdin.buffer)
    try:
        reply = ("built", *build(source, name, arch, library, [Path(p) for p in includes]))
    except BuildError as e:
        reply = ("refused", str(e))
    sys.stdout.buffer.write(pickle.dumps(reply))


if __name__ == "__main__":
    _child()
