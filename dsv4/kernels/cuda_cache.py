"""CUDA kernel builds kept on disk across processes (flag `kernel_cache`).

MLX's CUDA backend (0.32.4, mlx/backend/cuda/custom_kernel.cpp and jit_module.cpp) builds each
instantiation of an `mx.fast.cuda_kernel` with NVRTC at its first launch in every process, and
never writes the result to its disk cache (it asks `get_jit_module` for no disk cache). It does
look there first, though: `<dir>/<module>.ptx` (the cubin) with `<module>.txt` ("name<TAB>lowered
name" per kernel), where `<dir>` is $MLX_PTX_CACHE_DIR (else <tmp>/mlx/<version>/ptx, read once,
at MLX's first build) and `<module>` is `custom_kernel_<name><template values>_<hex of
std::hash of the source MLX generates>`. So dsv4 builds an instantiation itself the first time
it is called (the source text MLX would generate, the NVRTC library MLX loaded, MLX's options),
writes it there, and MLX loads it in milliseconds then and in every later process instead of
compiling it (0.5-3 s each, most of a fresh process's warm-up). MLX's own JIT kernels (quantized
matmuls, mx.compile's fused ops) already write their builds to that directory; the flag points
it at a directory that outlives /tmp.

Where dsv4's text differed from MLX's, the file name would not match: MLX would compile as
before (slower, never wrong). The one thing dsv4 supplies in MLX's place is the header
`mlx/backend/cuda/device/utils.cuh`, of which the kernel bodies use only Shape and Strides
(the compile gate, tools/metal_syntax_check.py, builds every body this same way).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import time
import warnings
from functools import lru_cache, wraps
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx

from dsv4 import flags
from dsv4.atomic_file import atomic_file
from dsv4.kernels import source_files
from dsv4.kernels.nvrtc import build_in_child

# mlx/backend/cuda/utils.cpp dtype_to_cuda_type (the source's types) and
# mlx/backend/common/compiled.cpp get_type_string (the kernel name's template values).
CUDA_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
              mx.int64: "int64_t", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
              mx.uint64: "uint64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
              mx.float32: "float", mx.float64: "double"}
TYPE_STRINGS = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t",
                mx.float64: "double", mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t",
                mx.int32: "int32_t", mx.int64: "int64_t", mx.uint8: "uint8_t", mx.uint16: "uint16_t",
                mx.uint32: "uint32_t", mx.uint64: "uint64_t"}

DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
MAX_FILE_NAME = 245   # jit_module.cpp get_ptx_path: longer module names become directories


def _template_value(value, spell_type) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return spell_type[value]


def kernel_name(name: str, template) -> str:
    """`custom_kernel_<name>` and its template values, as MLX names an instantiation."""
    parts = []
    for _, v in template:
        if isinstance(v, bool):
            parts.append("_t" if v else "_f")
        elif isinstance(v, int):
            parts.append(f"_{v}")
        else:
            parts.append("_" + TYPE_STRINGS[v])
    return f"custom_kernel_{name}" + "".join(parts)


def mlx_source(kernel, inputs, output_dtypes, template) -> tuple[str, str]:
    """(kernel name, the CUDA source MLX generates) for one instantiation of `kernel`;
    `inputs` are (dtype, ndim) pairs, in input order (custom_kernel.cpp build_kernel)."""
    header, body = kernel.launch_source("cuda", source_files.in_use())
    name = kernel_name(kernel.name, template)
    lines = [DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
             f"__global__ void {name}(\n"]
    for n, (dtype, ndim) in zip(kernel.input_names, inputs):
        lines.append(f"    const {CUDA_TYPES[dtype]}* {n},\n")
        if ndim > 0:
            for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if n + suffix in body:
                    lines.append(f"    const __grid_constant__ {kind} {n}{suffix},\n")
    outs = [f"    {CUDA_TYPES[t]}* {n}" for n, t in zip(kernel.output_names, output_dtypes)]
    lines.append(",\n".join(outs) + ") {\n")
    if template:
        for n, v in template:
            if isinstance(v, bool) or isinstance(v, int):
                lines.append(f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {n} = "
                             f"{_template_value(v, CUDA_TYPES)};\n")
            else:
                lines.append(f"  using {n} = {CUDA_TYPES[v]};\n")
        lines.append("\n")
    lines += [body, "\n}\n\n} // namespace mlx::core::cu\n"]
    return name, "".join(lines)


_MASK = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def std_hash(data: bytes, seed: int = 0xC70F6907) -> int:
    """std::hash<std::string> of libstdc++ (64-bit std::_Hash_bytes), which MLX's module names use."""
    n = len(data)
    h = (seed ^ (n * _MUL)) & _MASK
    aligned = n & ~7
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i:i + 8], "little")
        h ^= (_shift_mix(word * _MUL & _MASK) * _MUL) & _MASK
        h = h * _MUL & _MASK
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = h * _MUL & _MASK
    h = _shift_mix(h) * _MUL & _MASK
    return _shift_mix(h)


def module_path(directory: Path, name: str, source: str) -> Path:
    """Where MLX looks for the build of this source (jit_module.cpp get_ptx_path)."""
    module = f"{name}_{std_hash(source.encode()):x}"
    path = Path(directory)
    while len(module) > MAX_FILE_NAME:
        path, module = path / module[:MAX_FILE_NAME], module[MAX_FILE_NAME:]
    return path / (module + ".ptx")


# --- where the builds live ---------------------------------------------------------------

def _gpu_slug() -> str:
    """The first NVIDIA GPU's model (a cubin is for one architecture), without starting CUDA."""
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        with contextlib.suppress(OSError):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    return re.sub(r"[^A-Za-z0-9]+", "-", line.split(":", 1)[1].strip()).strip("-").lower()
    return "gpu"


def default_directory() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dsv4" / "cuda-kernels" / f"mlx-{mx.__version__}-{_gpu_slug()}"


def setting() -> Path | None:
    """The flag's directory (auto, on: the default one), or None when it is off."""
    value = str(flags.get("kernel_cache")).strip()
    if value.lower() in ("off", "0", "false", "no", ""):
        return None
    return default_directory() if value.lower() in ("auto", "on", "1", "true", "yes") else Path(value).expanduser()


def configure(environ=os.environ) -> None:
    """Point MLX's build cache at the flag's directory (unless $MLX_PTX_CACHE_DIR is set). MLX
    reads the variable at its first build, so this runs when dsv4's kernels are imported."""
    where = setting()
    if where is not None and "MLX_PTX_CACHE_DIR" not in environ:
        environ["MLX_PTX_CACHE_DIR"] = str(where)


def directory() -> Path | None:
    """The directory MLX reads builds from, or None when the cache is off."""
    d = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(d) if d and setting() is not None else None


# --- NVRTC ---------------------------------------------------------------------------------

def _loaded_library(stem: str) -> str | None:
    """The path of a shared library this process has loaded (MLX's own NVRTC), else None."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1] if line.split() else ""
            if f"/{stem}.so" in path:
                return path
    return None


def nvidia_roots() -> list[Path]:
    """site-packages/nvidia directories (NVIDIA's PyPI wheels; MLX's CUDA build finds its
    libraries and headers there)."""
    roots = []
    with contextlib.suppress(ImportError):
        import nvidia
        roots += [Path(p) for p in nvidia.__path__]
    roots.append(Path(mx.__file__).resolve().parent.parent / "nvidia")
    return [r for i, r in enumerate(roots) if r.is_dir() and r not in roots[:i]]


def nvrtc_library() -> str | None:
    loaded = _loaded_library("libnvrtc")
    if loaded:
        return loaded
    for root in nvidia_roots():
        for sub in ("cu13", "cuda_nvrtc"):
            found = sorted((root / sub / "lib").glob("libnvrtc.so*"))
            found = [f for f in found if "builtins" not in f.name and "alt" not in f.name]
            if found:
                return str(found[0])
    return None


def include_dirs() -> list[Path]:
    """CUDA runtime and CCCL headers, where MLX's build looks for them (jit_module.cpp)."""
    mlx_include = Path(mx.__file__).resolve().parent / "include"
    candidates = [mlx_include / "cccl"]
    for root in nvidia_roots():
        candidates += [root / "cu13" / "include" / "cccl", root / "cu13" / "include",
                       root / "cuda_cccl" / "include", root / "cuda_runtime" / "include"]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates.append(Path(home) / "include")
    return [c for c in candidates if (c / "cuda_bf16.h").exists() or (c / "cuda" / "std" / "array").exists()]


@lru_cache(maxsize=1)
def device_arch() -> str:
    """sm_<major><minor>[a] of CUDA device 0, as MLX targets it (the 'a' from compute 9 on)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    cuda.cuDeviceGet(ctypes.byref(dev), 0)
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)   # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    return f"sm_{major.value}{minor.value}" + ("a" if major.value >= 9 else "")


def write_build(path: Path, name: str, lowered: str, cubin: bytes) -> None:
    """The .txt first, then the .ptx, each whole or not at all: MLX takes the .ptx's presence
    to mean both are there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path.with_suffix(".txt")) as f:
        f.write(f"mlx::core::cu::{name}\t{lowered}\n".encode())
    with atomic_file(path) as f:
        f.write(cubin)


# --- the hook Kernel.__call__ runs ---------------------------------------------------------

class Builds:
    """What this process built, for the warm-up's progress line and the benchmarks."""

    def __init__(self):
        self.built, self.found, self.seconds = 0, 0, 0.0   # seconds: the builds' own, summed
        self.scope: str | None = None
        self.failed = False
        self.pending: list = []   # (kernel name, future) of builds not yet waited for

    def line(self, last: str, final: bool = False) -> None:
        text = (f"{self.scope or 'dsv4'}: built {self.built} CUDA kernel(s), {self.seconds:.1f} s of NVRTC "
                f"(kept for later starts), {last}")
        if self.scope is None:
            print(text, file=sys.stderr, flush=True)
        else:
            print("\r" + text + " ", end="\n" if final else "", file=sys.stderr, flush=True)


builds = Builds()
_seen: set = set()


@lru_cache(maxsize=1)
def _pool():
    from concurrent.futures import ThreadPoolExecutor

    # Each thread waits on a child process that runs NVRTC (dsv4/kernels/nvrtc.py says why).
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 4, thread_name_prefix="nvrtc")


def _build(path: Path, name: str, source: str, arch: str) -> float:
    start = time.perf_counter()
    cubin, lowered = build_in_child(source, name, arch, nvrtc_library(), include_dirs())
    write_build(path, name, lowered, cubin)
    return time.perf_counter() - start


def ensure(kernel, inputs, output_dtypes, template) -> None:
    """Before MLX's first launch of this instantiation: its build in the cache directory, made
    now if absent; inside `progress`, started on a pool of NVRTC threads that `wait` joins (a
    build not joined before MLX's eval is compiled by MLX as well, meanwhile). A failure warns
    once and leaves the building to MLX for the process."""
    where = directory()
    key = (kernel, tuple((a.dtype, a.ndim) for a in inputs), tuple(output_dtypes), tuple(template))
    if where is None or builds.failed or key in _seen:
        return
    _seen.add(key)
    name, source = mlx_source(kernel, [(a.dtype, a.ndim) for a in inputs], output_dtypes, template)
    path = module_path(where, name, source)
    if path.exists():
        builds.found += 1
        return
    builds.pending.append((kernel.name, _pool().submit(_build, path, name, source, device_arch())))
    if builds.scope is None:
        wait()


def building() -> bool:
    """Whether builds started inside `progress` are not joined yet (evaluating what launches
    them now would have MLX compile them too)."""
    return bool(builds.pending)


def wait() -> None:
    """Join the builds started so far (before evaluating what launches them)."""
    while builds.pending:
        kernel, future = builds.pending.pop(0)
        try:
            builds.seconds += future.result()
        except Exception as e:   # MLX builds it as before
            if not builds.failed:
                warnings.warn(f"kernel cache: could not build {kernel} ({e!r}); MLX builds the CUDA kernels "
                              f"itself in this process (DSV4_KERNEL_CACHE=off silences this)", RuntimeWarning)
            builds.failed = True
            continue
        builds.built += 1
        builds.line(f"last {kernel}")


@contextlib.contextmanager
def progress(scope: str) -> Iterator[None]:
    """Kernels first called inside the block build in parallel (call `wait` before evaluating)
    and redraw one progress line on stderr, ended with the block. Inside another such block
    it adds nothing: the outer one joins and reports."""
    if builds.scope is not None:
        yield
        return
    before = builds.built
    builds.scope = scope
    try:
        yield
    finally:
        wait()
        if builds.built > before:
            builds.line("done", final=True)
        builds.scope = None


def builds_in_parallel(scope: str) -> Callable:
    """Decorator: the function's kernels build in parallel, joined before it returns its
    (unevaluated) results, whose evaluation then finds them all built. A step's graph asks
    for its kernels while it is traced, before anything is evaluated: outside such a block
    each would build alone, one after another (~2 s each on the H200's host)."""
    def wrap(fn: Callable) -> Callable:
        @wraps(fn)
        def run(*args, **kwargs):
            with progress(scope):
                return fn(*args, **kwargs)
        return run
    return wrap
