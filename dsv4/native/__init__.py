"""dsv4's C++ extensions for MLX, built on first use against the MLX in this environment.

An extension here is one C++ source (dsv4/native/<name>.cpp) that defines MLX primitives and binds
them with nanobind into a module `_<name>` whose functions take and return `mx.array`s. It is
built by one compiler command, into `<cache>/dsv4/native/<key>/` (`$XDG_CACHE_HOME` or
`~/.cache`), where the key covers the sources, MLX's version and library, nanobind's version, the
Python ABI, the compiler and (on CUDA) the headers found, so a changed environment builds again
and a build is never mixed with another's. A build takes ~7 s on two cores and shows a line while
it runs.

What it needs: a C++20 compiler (`$CXX`, else `c++`: Xcode's command line tools on a Mac, g++ or
clang++ on Linux), Python's headers, the `nanobind` package (a dependency of dsv4) of the ABI
mlx.core was built with, and MLX's headers and library (in the mlx wheel). `load` raises
`Unavailable` with the reason when one is missing or the build fails; callers then take their
pure-Python path.

Where MLX runs on CUDA, the build also takes CUDA's headers (cuda.h and what cuda_runtime.h
includes: `$CUDA_HOME`'s, /usr/local/cuda's, or the nvidia pip packages' that MLX's CUDA wheels
install, the `nvidia-cuda-runtime` and `nvidia-cuda-crt` ones) for the primitives' CUDA parts
(-DDSV4_CUDA; `cuda_headers()`). Without them the extension builds for CPU streams only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from ..progress import Waiting

SOURCES = Path(__file__).parent
SYSTEM_CUDA = Path("/usr/local/cuda/include")
_loaded: dict[str, ModuleType] = {}


class Unavailable(RuntimeError):
    """The extension cannot be built or loaded here (the message says why)."""


def cache_directory() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dsv4" / "native"


def _mlx_package() -> Path:
    return Path(mx.__file__).resolve().parent


def _limited_api() -> bool:
    """Whether mlx.core was built for Python's stable ABI: nanobind shares types only between
    modules built alike."""
    return ".abi3." in Path(mx.__file__).name


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CXX") or "c++")


def _nanobind() -> ModuleType:
    try:
        import nanobind
    except ImportError as e:
        raise Unavailable("the nanobind package is not installed (pip install nanobind)") from e
    return nanobind


def _on_cuda() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def _nvidia_packages() -> list[str]:
    """Where the nvidia pip packages are installed (a namespace package), if anywhere."""
    spec = importlib.util.find_spec("nvidia")
    return list((spec.submodule_search_locations if spec else None) or [])


def cuda_headers() -> list[Path] | None:
    """The include directories holding cuda.h, cuda_runtime.h and crt/host_config.h, or None
    where one is missing. Searched: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, then the nvidia pip
    packages (cu13/include, cuda_runtime/include, cuda_nvcc/include, ...)."""
    roots = [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    roots.append(SYSTEM_CUDA)
    for base in _nvidia_packages():
        roots += sorted(Path(base).glob("*/include"))
    found = []
    for header in ("cuda.h", "cuda_runtime.h", "crt/host_config.h"):
        where = next((r for r in roots if (r / header).is_file()), None)
        if where is None:
            return None
        if where not in found:
            found.append(where)
    return found


def _cuda_flags() -> list[str]:
    """-DDSV4_CUDA and CUDA's include directories where MLX runs on CUDA and they are there."""
    headers = cuda_headers() if _on_cuda() else None
    if not headers:
        return []
    shim = SOURCES / "shim"   # fmt's one declaration MLX's CUDA headers need (see shim/fmt/format.h)
    return ["-DDSV4_CUDA", *(f"-I{h}" for h in headers), "-idirafter", str(shim)]


def _command(name: str, output: Path, cuda: bool = True) -> list[str]:
    mlx = _mlx_package()
    nb = Path(_nanobind().include_dir()).parent
    python = sysconfig.get_paths()["include"]
    if not (Path(python) / "Python.h").is_file():
        raise Unavailable(f"Python's headers are missing ({python}/Python.h)")
    command = _compiler() + [
        "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-DNDEBUG",
        "-DNB_COMPACT_ASSERTIONS", "-DNB_DOMAIN=mlx",   # mlx.core's nanobind domain: shared types
        f"-I{nb / 'include'}", f"-I{nb / 'ext' / 'robin_map' / 'include'}", f"-I{python}",
        f"-I{mlx / 'include'}", *(_cuda_flags() if cuda else []),
        str(SOURCES / f"{name}.cpp"), str(nb / "src" / "nb_combined.cpp"),
        f"-L{mlx / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx / 'lib'}", "-o", str(output)]
    if "-DDSV4_CUDA" in command:
        command.insert(-2, "-ldl")   # the CUDA driver's functions, looked up in MLX's libcuda
    if _limited_api():
        command.insert(-2, "-DPy_LIMITED_API=0x030C0000")
    if platform.system() == "Darwin":
        command[-2:-2] = ["-undefined", "dynamic_lookup"]
    return command


def _suffix() -> str:
    return ".abi3.so" if _limited_api() else sysconfig.get_config_var("EXT_SUFFIX")


def _key(name: str, cuda: bool = True) -> str:
    compiler = subprocess.run(_compiler() + ["--version"], capture_output=True, text=True)
    sources = [SOURCES / f"{name}.cpp", *sorted(SOURCES.glob("*.h"))]
    parts = [*(s.read_bytes() for s in sources), mx.__version__.encode(), str(_mlx_package()).encode(),
             _nanobind().__version__.encode(), _suffix().encode(), compiler.stdout.encode(),
             " ".join(_cuda_flags() if cuda else []).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _build(name: str, target: Path, cuda: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        partial = Path(work) / target.name
        command = _command(name, partial, cuda)
        with Waiting(f"building dsv4's {name} extension", "once per MLX version", after_s=2.0):
            try:
                done = subprocess.run(command, capture_output=True, text=True)
            except OSError as e:
                raise Unavailable(f"no C++ compiler ({command[0]}: {e.strerror}); set CXX") from e
        if done.returncode:
            log = (done.stderr or done.stdout).strip().splitlines()
            first = next((line for line in log if "error" in line), log[0] if log else done.returncode)
            raise Unavailable(f"building {name} failed: {first} "
                              f"(command: {shlex.join(command)})")
        os.replace(partial, target)   # whole, or not at all: another process may load it now


def load(name: str) -> ModuleType:
    """The extension `_<name>` built from dsv4/native/<name>.cpp (built first when needed). Where
    its CUDA part does not build or load, it is built without it (said once)."""
    if name in _loaded:
        return _loaded[name]
    if not _compiler_exists():
        raise Unavailable(f"no C++ compiler ({_compiler()[0]} not found; set CXX)")
    try:
        module = _load(name, cuda=True)
    except Unavailable as e:
        if not _cuda_flags():
            raise
        print(f"dsv4: the {name} extension is built without its CUDA part ({e})", file=sys.stderr)
        module = _load(name, cuda=False)
    _loaded[name] = module
    return module


def _load(name: str, cuda: bool) -> ModuleType:
    target = cache_directory() / _key(name, cuda) / f"_{name}{_suffix()}"
    if not target.is_file():
        _build(name, target, cuda)
    spec = importlib.util.spec_from_file_location(f"_{name}", target)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise Unavailable(f"loading {target} failed: {e}") from e
    return module


def _compiler_exists() -> bool:
    from shutil import which
    return which(_compiler()[0]) is not None
