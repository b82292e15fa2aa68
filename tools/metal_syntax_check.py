"""Offline compile gates for dsv4's kernel bodies.

Metal (no Mac needed): each kernel body is wrapped exactly the way `mx.fast.metal_kernel`
wraps it (MLX's `write_signature`: template line, `[[kernel]]` signature with one buffer per
input and output, the attributes the body names, the explicit template instantiation), then
compiled by clang as C++17 against tools/metal_shim/metal_stdlib.h (tools/cxx.py picks the
clang). A syntax or type error fails.

CUDA (no GPU needed): the body is wrapped the way `mx.fast.cuda_kernel` wraps it (the text the
kernel cache reproduces, dsv4/kernels/cuda_cache.py) and compiled for sm_90a by NVRTC, the
library MLX's CUDA backend compiles custom kernels with at run time, as the kernel cache builds
it (from NVIDIA's PyPI wheels nvidia-cuda-nvrtc-cu12, -runtime-cu12 and -cccl-cu12, which the
test extra installs on Linux x86-64), or by nvcc; MLX's device utilities are stood in for by
the CUDA headers they include and Shape/Strides, which is all the bodies use.

Launches (tools/launch_limits.py): every launch the dispatchers make at V4.1's widths fits the
GPU's limits (threadgroup memory, threads, whole SIMD groups), on Metal and on CUDA.

    python tools/metal_syntax_check.py          # Metal gate and launch limits
    python tools/metal_syntax_check.py --cuda   # also the CUDA gate (NVRTC, else nvcc)
"""

from __future__ import annotations

import importlib
import pkgutil
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dsv4.kernels import cuda_cache, nvrtc  # noqa: E402
from dsv4.kernels.dialect import Kernel  # noqa: E402
from tools.cxx import cxx_command  # noqa: E402
from tools.launch_limits import v41_problems  # noqa: E402

SHIM = ROOT / "tools" / "metal_shim"

METAL_TYPES = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t",
               mx.int32: "int32_t", mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.int64: "int64_t",
               mx.bool_: "bool"}
# MLX's list of Metal thread attributes; a signature gets those the body names.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"),
)


def all_kernels() -> list[Kernel]:
    """Every Kernel defined at module level in dsv4.kernels."""
    import dsv4.kernels as package
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"dsv4.kernels.{info.name}")
        found += [v for v in vars(module).values() if isinstance(v, Kernel)]
    return found


def _template_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return METAL_TYPES[value]


def metal_source(kernel: Kernel, check) -> str:
    """The text `mx.fast.metal_kernel` compiles for one instantiation (minus MLX's utils)."""
    in_types, out_types, template = check
    header, body = kernel.source("metal")
    name = f"custom_kernel_{kernel.name}"
    lines = [header]
    if template:
        kinds = ["typename" if not isinstance(v, int) else ("bool" if isinstance(v, bool) else "int")
                 for _, v in template]
        lines.append("template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, template)) + ">")
    params = []
    for n, t in zip(kernel.input_names, in_types):
        params.append(f"  const device {METAL_TYPES[t]}* {n} [[buffer({len(params)})]]")
        for suffix, kind in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                             ("_ndim", "const constant int&")):
            if n + suffix in body:
                params.append(f"  {kind} {n}{suffix} [[buffer({len(params)})]]")
    params += [f"  device {METAL_TYPES[t]}* {n} [[buffer({len(params) + i})]]"
               for i, (n, t) in enumerate(zip(kernel.output_names, out_types))]
    params += [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES if a in body]
    lines.append(f"[[kernel]] void {name}(\n" + ",\n".join(params) + ") {")
    lines += [body, "}"]
    if template:
        args = "<" + ", ".join(_template_value(v) for _, v in template) + ">"
        # Metal spells this `template [[host_name("...")]] [[kernel]] decltype(f<..>) f<..>;`;
        # plain clang rejects attributes there, and they carry no type information.
        lines.append(f"template decltype({name}{args}) {name}{args};")
    return "\n".join(lines) + "\n"


def cuda_source(kernel: Kernel, check) -> tuple[str, str]:
    """(kernel name, the text `mx.fast.cuda_kernel` compiles) for one instantiation: the
    runtime's own reproduction (dsv4/kernels/cuda_cache.py), inputs taken as arrays of ndim 1."""
    in_types, out_types, template = check
    return cuda_cache.mlx_source(kernel, [(t, 1) for t in in_types], out_types, template)


def _run(cmd: list[str], source: str, suffix: str) -> str | None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"kernel{suffix}"
        path.write_text(source)
        result = subprocess.run(cmd + [str(path)], capture_output=True, text=True, cwd=tmp)
    if result.returncode == 0:
        return None
    return result.stderr or result.stdout


def check_metal(kernel: Kernel) -> list[str]:
    """Errors (empty when clean) of every instantiation of `kernel`'s Metal source."""
    # An object file, not -fsyntax-only, which zig's driver cannot run (tools/cxx.py).
    cmd = cxx_command() + ["-x", "c++", "-std=c++17", "-c", "-o", "kernel.o", "-Wno-unknown-attributes",
                           "-include", str(SHIM / "metal_stdlib.h")]
    errors = []
    for check in kernel.checks:
        err = _run(cmd, metal_source(kernel, check), ".metal.cpp")
        if err:
            errors.append(f"{kernel.name} {check[2]}:\n{err}")
    return errors


def nvrtc_paths() -> tuple[Path, list[Path]] | None:
    """libnvrtc and the include directories from NVIDIA's PyPI wheels, or None if not installed."""
    import importlib.util

    found = {}
    for name in ("cuda_nvrtc", "cuda_runtime", "cuda_cccl"):
        spec = importlib.util.find_spec(f"nvidia.{name}")
        if spec is None or not spec.submodule_search_locations:
            return None
        found[name] = Path(list(spec.submodule_search_locations)[0])
    libs = sorted((found["cuda_nvrtc"] / "lib").glob("libnvrtc.so*"))
    if not libs:
        return None
    return libs[0], [found["cuda_cccl"] / "include", found["cuda_runtime"] / "include"]


def required_nvrtc_paths() -> tuple[Path, list[Path]]:
    """nvrtc_paths for a tool that cannot run without NVRTC: else one error line, exit status 2."""
    paths = nvrtc_paths()
    if paths is None:
        print("error: NVRTC is not installed (pip install -e '.[test]' installs it)", file=sys.stderr)
        raise SystemExit(2)
    return paths


def nvrtc_compile(source: tuple[str, str], paths: tuple[Path, list[Path]]) -> str | None:
    """Compile one instantiation for sm_90a as MLX's CUDA backend does on the H200 (the kernel
    cache's own build, nvrtc.build): None if it compiles, else the log."""
    library, includes = paths
    name, text = source
    try:
        nvrtc.build(text, name, "sm_90a", str(library), includes)
    except nvrtc.BuildError as e:
        return str(e)
    return None


_OPENING = "namespace mlx::core::cu {"   # each CUDA text: its includes, then its own namespace block


def _includes(text: str) -> str:
    return text.split(_OPENING, 1)[0]


def programs(sources: list[tuple[str, str]]) -> list[list[int]]:
    """The instantiations of one kernel grouped into as few NVRTC programs as can hold them (as
    indices into `sources`): a program's texts share their includes, and its kernels' names
    differ (two instantiations may overload one name with different parameter types)."""
    groups: list[list[int]] = []
    for i, (name, text) in enumerate(sources):
        group = next((g for g in groups if _includes(sources[g[0]][1]) == _includes(text)
                      and all(sources[j][0] != name for j in g)), None)
        if group is None:
            groups.append([i])
        else:
            group.append(i)
    return groups


def one_program(sources: list[tuple[str, str]]) -> tuple[str, str]:
    """The texts of one of `programs`' groups as one NVRTC program, named by its first kernel."""
    return sources[0][0], _includes(sources[0][1]) + "".join(_OPENING + text.split(_OPENING, 1)[1]
                                                            for _, text in sources)


def check_cuda_nvrtc(kernel: Kernel, paths: tuple[Path, list[Path]]) -> list[str]:
    """Errors (empty when clean) of every instantiation of `kernel`'s CUDA source, by NVRTC.
    They compile in as few programs as `programs` allows, which parses the headers once a
    program (~1.2 s of each instantiation's ~1.5-2 s on the CI's cores). A program that fails
    is compiled again one instantiation at a time, to say which ones fail."""
    sources = [cuda_source(kernel, check) for check in kernel.checks]
    errors = []
    for group in programs(sources):
        together = nvrtc_compile(one_program([sources[i] for i in group]), paths)
        if together is None:
            continue
        alone = [(i, nvrtc_compile(sources[i], paths)) for i in group]
        errors += [f"{kernel.name} {kernel.checks[i][2]}:\n{err}" for i, err in alone if err]
        if all(err is None for _, err in alone):
            errors.append(f"{kernel.name}: each instantiation compiles alone, but not in one program:\n{together}")
    return errors


def check_cuda(kernel: Kernel, nvcc: str) -> list[str]:
    cmd = [nvcc, "-std=c++17", "-arch=sm_90", "-c", "-o", "/dev/null"]
    errors = []
    for check in kernel.checks:
        text = cuda_source(kernel, check)[1].replace(f'#include "{nvrtc.UTILS_NAME}"', nvrtc.UTILS_STANDIN)
        err = _run(cmd, text, ".cu")
        if err:
            errors.append(f"{kernel.name} {check[2]}:\n{err}")
    return errors


def main(argv: list[str]) -> int:
    try:
        cxx_command()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kernels = all_kernels()
    errors = []
    for k in kernels:
        if not k.checks:
            errors.append(f"{k.name}: no instantiations listed in Kernel.checks")
        if "metal" in k.dialects:
            errors += check_metal(k)
    errors += v41_problems()
    if "--cuda" in argv:
        paths, nvcc = nvrtc_paths(), shutil.which("nvcc")
        if paths is not None:
            for k in kernels:
                errors += check_cuda_nvrtc(k, paths)
        elif nvcc is not None:
            for k in kernels:
                errors += check_cuda(k, nvcc)
        else:
            errors.append("--cuda: neither NVRTC (pip install nvidia-cuda-nvrtc-cu12 "
                          "nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12) nor nvcc is installed")
    for e in errors:
        print(e, file=sys.stderr)
    print(f"{len(kernels)} kernels, {sum(len(k.checks) for k in kernels)} instantiations: "
          f"{'FAILED' if errors else 'ok'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
