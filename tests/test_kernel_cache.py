"""The CUDA kernel cache (dsv4/kernels/cuda_cache.py): the file MLX's CUDA backend looks for
before it compiles a custom kernel, written by dsv4.

Oracles: libstdc++'s own std::_Hash_bytes (called through ctypes) for the module names' hash;
MLX 0.32.4's build_kernel (custom_kernel.cpp), transcribed by hand below, for the source text;
NVRTC for the builds (a cubin holding the lowered name it reports). That MLX loads what dsv4
writes is checked on the GPU (marked gpu): a build whose body differs from the source's runs in
its place."""

import ctypes
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from dsv4 import flags
from dsv4.kernels import cuda_cache, nvrtc
from dsv4.kernels.dialect import Kernel

PROBE = Kernel(name="dsv4_cache_probe", input_names=("a", "s"), output_names=("out",),
               body="out[tid] = (float)a[tid] * (FLAG ? 1.0f : 0.0f) + (float)ADD + (float)s_shape[0];\n")
TEMPLATE = [("T", mx.bfloat16), ("ADD", 3), ("FLAG", True)]


def libstdcxx_hash(data: bytes) -> int:
    lib = ctypes.CDLL("libstdc++.so.6")
    fn = lib._ZSt11_Hash_bytesPKvmm   # std::_Hash_bytes(const void*, size_t, size_t)
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    return fn(data, len(data), 0xC70F6907)


@pytest.mark.skipif(sys.platform != "linux", reason="libstdc++ is the oracle")
def test_module_hash_is_libstdcxx_std_hash():
    rng = np.random.default_rng()
    cases = [b"", b"a", b"hello", bytes(range(8)), bytes(range(9))]
    cases += [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in range(1, 40)]
    cases.append(cuda_cache.mlx_source(PROBE, [(mx.bfloat16, 1), (mx.int32, 2)], [mx.float32], TEMPLATE)[1].encode())
    for data in cases:
        assert cuda_cache.std_hash(data) == libstdcxx_hash(data), data[:16]
    assert cuda_cache.std_hash(b"hello") != cuda_cache.std_hash(b"hellp")


@pytest.mark.parametrize("files", [False, True], ids=["inline", "source files"])
def test_source_is_mlx_build_kernel_text(files):
    header, body = PROBE.launch_source("cuda", files)
    with flags.override(kernel_source_files="on" if files else "off"):
        name, text = cuda_cache.mlx_source(PROBE, [(mx.bfloat16, 1), (mx.int32, 2)], [mx.float32], TEMPLATE)
    assert name == "custom_kernel_dsv4_cache_probe_bfloat16_t_3_t"
    # custom_kernel.cpp: default header, the kernel's header, the namespace, the signature (a
    # shape argument only for the input whose name+'_shape' the body names), the constants.
    assert text == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_dsv4_cache_probe_bfloat16_t_3_t(\n"
        "    const __nv_bfloat16* a,\n"
        "    const int32_t* s,\n"
        "    const __grid_constant__ Shape s_shape,\n"
        "    float* out) {\n"
        "  using T = __nv_bfloat16;\n  constexpr int ADD = 3;\n  constexpr bool FLAG = true;\n\n"
        + body + "\n}\n\n} // namespace mlx::core::cu\n")
    # a 0-d input gets no shape argument; no template, no constants block
    with flags.override(kernel_source_files="on" if files else "off"):
        _, scalar = cuda_cache.mlx_source(PROBE, [(mx.bfloat16, 1), (mx.int32, 0)], [mx.float32], [])
    assert "s_shape" not in scalar.split(") {")[0] and "constexpr" not in scalar


def test_module_path_is_mlx_ptx_path(tmp_path):
    name, text = cuda_cache.mlx_source(PROBE, [(mx.bfloat16, 1), (mx.int32, 1)], [mx.float32], TEMPLATE)
    path = cuda_cache.module_path(tmp_path, name, text)
    assert path == tmp_path / f"{name}_{libstdcxx_hash(text.encode()):x}.ptx"
    long = "custom_kernel_" + "x" * 600
    split = cuda_cache.module_path(tmp_path, long, text)
    module = f"{long}_{libstdcxx_hash(text.encode()):x}"
    assert split == tmp_path / module[:245] / module[245:490] / (module[490:] + ".ptx")


def test_configure_points_mlx_at_the_flag_directory(tmp_path):
    env = {}
    with flags.override(kernel_cache="off"):
        cuda_cache.configure(env)
    assert env == {}
    with flags.override(kernel_cache=str(tmp_path / "k")):
        cuda_cache.configure(env)
    assert env == {"MLX_PTX_CACHE_DIR": str(tmp_path / "k")}
    with flags.override(kernel_cache="auto"):
        cuda_cache.configure(env)   # a directory the user chose stays
    assert env == {"MLX_PTX_CACHE_DIR": str(tmp_path / "k")}
    for on in ("auto", "On", "1"):
        env.clear()
        with flags.override(kernel_cache=on):
            cuda_cache.configure(env)
        assert env["MLX_PTX_CACHE_DIR"] == str(cuda_cache.default_directory()) and \
            f"mlx-{mx.__version__}-" in env["MLX_PTX_CACHE_DIR"]


class Inputs:   # what ensure reads of an array
    def __init__(self, dtype, ndim):
        self.dtype, self.ndim = dtype, ndim


def test_ensure_builds_once_what_mlx_will_look_for(tmp_path, monkeypatch):
    from tools.metal_syntax_check import nvrtc_paths

    paths = nvrtc_paths()
    if paths is None:
        pytest.fail("NVRTC is not installed: pip install -e '.[test]' installs it (nvidia-cuda-nvrtc-cu12)")
    library, includes = paths
    monkeypatch.setattr(cuda_cache, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(cuda_cache, "nvrtc_library", lambda: str(library))
    monkeypatch.setattr(cuda_cache, "include_dirs", lambda: includes)
    monkeypatch.setattr(cuda_cache, "_seen", set())
    monkeypatch.setattr(cuda_cache, "builds", cuda_cache.Builds())
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    ins = [Inputs(mx.bfloat16, 1), Inputs(mx.int32, 1)]
    with flags.override(kernel_cache="off"):
        cuda_cache.ensure(PROBE, ins, [mx.float32], TEMPLATE)
    assert list(tmp_path.iterdir()) == []

    with flags.override(kernel_cache="auto"), cuda_cache.progress("warm-up"):
        cuda_cache.ensure(PROBE, ins, [mx.float32], TEMPLATE)
        cuda_cache.ensure(PROBE, ins, [mx.float32], TEMPLATE)            # seen: nothing to do
        cuda_cache.ensure(PROBE, ins, [mx.float32], TEMPLATE[:2] + [("FLAG", False)])
        assert len(cuda_cache.builds.pending) == 2 and cuda_cache.builds.built == 0   # in parallel, joined by wait
        cuda_cache.wait()
        assert cuda_cache.builds.built == 2
    name, text = cuda_cache.mlx_source(PROBE, [(mx.bfloat16, 1), (mx.int32, 1)], [mx.float32], TEMPLATE)
    ptx = cuda_cache.module_path(tmp_path, name, text)
    cubin = ptx.read_bytes()
    assert cubin[:4] == b"\x7fELF"
    full, lowered = ptx.with_suffix(".txt").read_text().rstrip("\n").split("\t")
    assert full == "mlx::core::cu::" + name and lowered.startswith("_ZN3mlx4core2cu") and name in lowered
    assert lowered.encode() in cubin   # the symbol MLX's cuModuleGetFunction asks for
    builds = [p for p in tmp_path.iterdir() if p.is_file()]   # (sources/: source_files' includes)
    assert sorted(p.suffix for p in builds) == [".ptx", ".ptx", ".txt", ".txt"]   # no .partial

    # a later process finds the build and compiles nothing
    monkeypatch.setattr(cuda_cache, "_seen", set())
    monkeypatch.setattr(cuda_cache, "builds", cuda_cache.Builds())
    with flags.override(kernel_cache="auto"):
        cuda_cache.ensure(PROBE, ins, [mx.float32], TEMPLATE)
    assert (cuda_cache.builds.built, cuda_cache.builds.found) == (0, 1)


def test_a_child_process_builds_what_this_process_would(monkeypatch):
    """The kernel cache's builds run in children (NVRTC's threads in one process serialize):
    the child's cubin and lowered name are the in-process build's, and a source NVRTC refuses
    comes back as BuildError with NVRTC's log."""
    from tools.metal_syntax_check import nvrtc_paths

    library, includes = nvrtc_paths()
    with flags.override(kernel_source_files="off"):   # the body inline, for the broken copy below
        name, text = cuda_cache.mlx_source(PROBE, [(mx.bfloat16, 1), (mx.int32, 1)], [mx.float32], TEMPLATE)
    here = nvrtc.build(text, name, "sm_90a", str(library), includes)
    assert nvrtc.build_in_child(text, name, "sm_90a", str(library), includes) == here
    assert here[0][:4] == b"\x7fELF"
    with pytest.raises(nvrtc.BuildError, match='identifier "nope" is undefined'):
        nvrtc.build_in_child(text.replace("out[", "nope["), name, "sm_90a", str(library), includes)


def test_a_step_builds_its_kernels_in_parallel_and_joins_them_before_returning(tmp_path, monkeypatch):
    """builds_in_parallel (the decoders' steps, the model's forward): the kernels a call asks
    for are all started before the first is joined, and all are built when it returns (so
    MLX's evaluation finds them); inside an outer progress block they are the outer's to join."""
    started, joined = [], []
    monkeypatch.setattr(cuda_cache, "directory", lambda: tmp_path)
    monkeypatch.setattr(cuda_cache, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(cuda_cache, "_seen", set())
    monkeypatch.setattr(cuda_cache, "builds", cuda_cache.Builds())

    def build(path, name, source, arch):
        started.append(name)
        return 0.0

    class Done:
        def __init__(self, name):
            self.name = name

        def result(self):
            joined.append((self.name, len(started)))
            return 0.0

    monkeypatch.setattr(cuda_cache, "_pool", lambda: type("Pool", (), {
        "submit": staticmethod(lambda fn, path, name, *a: (fn(path, name, *a), Done(name))[1])})())
    monkeypatch.setattr(cuda_cache, "_build", build)

    @cuda_cache.builds_in_parallel("decode")
    def step(flags_values):
        for flag in flags_values:
            cuda_cache.ensure(PROBE, [Inputs(mx.float32, 1)] * 2, [mx.float32], TEMPLATE[:2] + [("FLAG", flag)])
        assert joined == []                      # nothing joined while the step asks
        return "logits"

    with flags.override(kernel_cache="auto"):
        assert step([False, True]) == "logits"
        assert [n for n, _ in joined] == started and all(count == 2 for _, count in joined)
        assert cuda_cache.builds.pending == [] and cuda_cache.builds.built == 2
        monkeypatch.setattr(cuda_cache, "_seen", set())
        joined.clear()
        with cuda_cache.progress("warm-up"):
            step([False])
            assert joined == [] and len(cuda_cache.builds.pending) == 1   # the outer block's to join
        assert len(joined) == 1


def test_a_build_that_fails_warns_once_and_leaves_it_to_mlx(tmp_path, monkeypatch):
    broken = Kernel(name="dsv4_cache_broken", input_names=("a",), output_names=("out",), body="out[0] = nope;\n")
    monkeypatch.setattr(cuda_cache, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(cuda_cache, "_seen", set())
    monkeypatch.setattr(cuda_cache, "builds", cuda_cache.Builds())
    monkeypatch.setattr(cuda_cache, "build_in_child", lambda *a, **k: (_ for _ in ()).throw(nvrtc.BuildError("nope")))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    with flags.override(kernel_cache="auto"), pytest.warns(RuntimeWarning, match="MLX builds the CUDA kernels"):
        cuda_cache.ensure(broken, [Inputs(mx.float32, 1)], [mx.float32], [])
    cuda_cache.ensure(PROBE, [Inputs(mx.float32, 1)] * 2, [mx.float32], TEMPLATE)   # no second warning
    assert [p for p in tmp_path.iterdir() if p.name != "sources"] == []   # no build


GPU_SCRIPT = textwrap.dedent("""
    import mlx.core as mx
    from dsv4.kernels import cuda_cache, nvrtc
    from dsv4.kernels.dialect import Kernel
    probe = Kernel(name="dsv4_cache_gpu_probe", input_names=("a",), output_names=("out",),
                   body="out[tid] = a[tid] + (float)ADD;\\n")
    impostor = Kernel(name="dsv4_cache_gpu_probe", input_names=("a",), output_names=("out",),
                      body="out[tid] = a[tid] - (float)ADD;\\n")
    template = [("ADD", 5)]
    name, text = cuda_cache.mlx_source(probe, [(mx.float32, 1)], [mx.float32], template)
    path = cuda_cache.module_path(cuda_cache.directory(), name, text)
    if {impostor}:   # the impostor's build under the probe's name: MLX runs what it finds
        _, other = cuda_cache.mlx_source(impostor, [(mx.float32, 1)], [mx.float32], template)
        cubin, lowered = nvrtc.build(other, name, cuda_cache.device_arch(), cuda_cache.nvrtc_library(),
                                     cuda_cache.include_dirs())
        cuda_cache.write_build(path, name, lowered, cubin)
    a = mx.arange(32, dtype=mx.float32)
    (out,) = probe(inputs=[a], output_shapes=[(32,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                   threadgroup=(32, 1, 1), template=template)
    print(float(out[3]), path.exists())
""")


@pytest.mark.gpu
def test_mlx_loads_the_build_dsv4_wrote(tmp_path):
    env = dict(os.environ, DSV4_KERNEL_CACHE=str(tmp_path))
    env.pop("MLX_PTX_CACHE_DIR", None)
    run = lambda impostor: subprocess.run([sys.executable, "-c", GPU_SCRIPT.format(impostor=impostor)], env=env,
                                          capture_output=True, text=True, check=True).stdout.split()
    assert run(True) == ["-2.0", "True"]    # 3 - 5: MLX took dsv4's file instead of compiling
    for p in tmp_path.iterdir():
        if p.is_file():   # the builds (sources/ holds the includes, named by their content)
            p.unlink()
    assert run(False) == ["8.0", "True"]    # dsv4's own build, written before MLX's first launch
