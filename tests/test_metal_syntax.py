"""CI gates for the kernel sources: every kernel body, wrapped as mx.fast.metal_kernel wraps it,
must compile with clang against tools/metal_shim (no Mac needed), and wrapped as
mx.fast.cuda_kernel wraps it must compile with NVRTC (no GPU needed). Needs the test extra
(the ziglang wheel's clang, tools/cxx.py, and on Linux x86-64 NVIDIA's NVRTC wheels): without
them the tests fail, they do not skip."""

import dataclasses
import platform
import sys

import pytest

from tools import metal_syntax_check as gate


@pytest.mark.parametrize("kernel", [k for k in gate.all_kernels() if "metal" in k.dialects], ids=lambda k: k.name)
def test_metal_source_compiles(kernel):
    assert kernel.checks, f"{kernel.name} lists no instantiations to check"
    errors = gate.check_metal(kernel)
    assert not errors, "\n".join(errors)


def test_gate_rejects_a_type_error_and_an_unknown_function():
    kernel = next(k for k in gate.all_kernels() if "metal" in k.dialects)   # the Metal gate
    first = kernel.checks[:1]
    bad_type = dataclasses.replace(kernel, body=kernel.body + "\n  float oops = tid; uint3 v = oops;\n",
                                   checks=first)
    bad_call = dataclasses.replace(kernel, body=kernel.body + "\n  simd_shuffle_down_f(1.0f);\n",
                                   checks=first)
    assert gate.check_metal(bad_type) and gate.check_metal(bad_call)


def require_nvrtc():
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("NVIDIA publishes NVRTC wheels for Linux x86-64 only")
    paths = gate.nvrtc_paths()
    if paths is None:
        pytest.fail("NVRTC is not installed: pip install -e '.[test]' installs it (nvidia-cuda-nvrtc-cu12)")
    return paths


@pytest.mark.parametrize("kernel", gate.all_kernels(), ids=lambda k: k.name)
def test_cuda_source_compiles_with_nvrtc(kernel):
    """The CUDA build of every kernel body, as mx.fast.cuda_kernel wraps it, compiles with the
    compiler MLX's CUDA backend uses (NVRTC, sm_90): what the H200 would otherwise find first."""
    errors = gate.check_cuda_nvrtc(kernel, require_nvrtc())
    assert not errors, "\n".join(errors)


def test_nvrtc_gate_rejects_a_type_error():
    paths = require_nvrtc()
    kernel = next(k for k in gate.all_kernels() if "metal" in k.dialects)   # the Metal gate
    bad = dataclasses.replace(kernel, body=kernel.body + "\n  float oops = tid; uint3 v = oops;\n",
                              checks=kernel.checks[:1])
    assert gate.check_cuda_nvrtc(bad, paths)


def test_nvrtc_gate_names_the_one_instantiation_that_fails():
    """The instantiations compile as one program; when it fails, the errors name only the
    instantiation that fails on its own (here row_tail's D = 1280, refused by a static_assert)."""
    paths = require_nvrtc()
    kernel = next(k for k in gate.all_kernels() if k.name == "dsv4_row_tail")
    bad = dataclasses.replace(kernel, body=kernel.body + "\n  static_assert(D != 1280, \"refused\");\n")
    errors = gate.check_cuda_nvrtc(bad, paths)
    assert len(errors) == 1 and "('D', 1280)" in errors[0] and "refused" in errors[0], errors


def test_nvrtc_programs_keep_overloads_of_one_name_apart():
    """hc_collapse_norm's first two instantiations differ only in a parameter's type: one name,
    two overloads, which NVRTC cannot look up in one program."""
    kernel = next(k for k in gate.all_kernels() if k.name == "dsv4_hc_collapse_norm")
    sources = [gate.cuda_source(kernel, check) for check in kernel.checks]
    assert sources[0][0] == sources[1][0] != sources[2][0]
    assert gate.programs(sources) == [[0, 2], [1]]


def test_wrapper_matches_mlx_signature_rules():
    kernel = next(k for k in gate.all_kernels() if "metal" in k.dialects)   # the Metal gate
    src = gate.metal_source(kernel, kernel.checks[0])
    assert f"[[kernel]] void custom_kernel_{kernel.name}(" in src
    assert "[[buffer(0)]]" in src and "thread_position_in_threadgroup [[thread_position_in_threadgroup]]" in src
    assert "thread_position_in_grid [[" not in src    # only attributes the body names


@pytest.mark.parametrize("kernel", gate.all_kernels(), ids=lambda k: k.name)
def test_template_values_can_name_a_cuda_kernel(kernel):
    """MLX's CUDA backend names each instantiation after its template values (a C identifier):
    a negative integer compiles on Metal but not there."""
    for _, _, template in kernel.checks:
        assert all(not isinstance(v, int) or v >= 0 for _, v in template), (kernel.name, template)
