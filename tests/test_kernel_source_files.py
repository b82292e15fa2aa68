"""CUDA kernels whose text reaches MLX as #include lines (dsv4/kernels/source_files.py, flag
kernel_source_files): the files hold exactly the text MLX got inline before, MLX sees the same
shape arguments in the short body, and NVRTC builds the same cubin from either."""

import re

import mlx.core as mx
import pytest

from dsv4 import flags
from dsv4.kernels import cuda_cache, nvrtc, source_files
from dsv4.kernels.dialect import Kernel
from tools.metal_syntax_check import all_kernels

INCLUDE = re.compile(r'^#include "(/[^"]+)"\n', re.M)
PROBE = Kernel(name="dsv4_files_probe", input_names=("a", "s", "sa"), output_names=("out",),
               header="KFN float twice(float v) { return 2.0f * v; }\n",
               body="#pragma unroll\nfor (int k = 0; k < 2; ++k)\n"
                    "  out[tid + k] = twice((float)a[tid]) + (float)ADD + (float)s_shape[0] + (float)s_ndim;\n")
TEMPLATE = [("T", mx.bfloat16), ("ADD", 3)]


def expanded(text: str) -> str:
    """The text with each absolute #include line replaced by its file, as the preprocessor reads it."""
    return INCLUDE.sub(lambda m: open(m.group(1)).read(), text)


@pytest.mark.parametrize("kernel", [k for k in all_kernels() if "cuda" in k.dialects], ids=lambda k: k.name)
def test_the_files_hold_the_inline_text_and_mlx_sees_the_same_shape_names(kernel):
    header, body = kernel.launch_source("cuda", True)
    inline_header, inline_body = kernel.launch_source("cuda", False)
    assert (header, body) != (inline_header, inline_body) and len(header) + len(body) < 400
    assert expanded(header) == inline_header
    assert expanded(body).startswith(inline_body)
    for name in kernel.input_names:   # custom_kernel.cpp: a shape/strides/ndim argument iff named
        for suffix in ("_shape", "_strides", "_ndim"):
            assert (name + suffix in body) == (name + suffix in inline_body), name + suffix


def test_files_are_named_by_their_content_and_written_once(tmp_path):
    first = source_files.written(tmp_path, "k", "body", "out[0] = 1;\n")
    assert first.read_text() == "out[0] = 1;\n" and first.parent == tmp_path
    assert source_files.written(tmp_path, "k", "body", "out[0] = 1;\n") == first
    other = source_files.written(tmp_path, "k", "body", "out[0] = 2;\n")
    assert other != first and first.read_text() == "out[0] = 1;\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])   # no temporaries


def test_metal_and_the_switch_off_keep_the_text_inline():
    assert PROBE.launch_source("metal", False) == PROBE.source("metal")
    assert PROBE.launch_source("cuda", False) == PROBE.source("cuda")
    with pytest.raises(ValueError, match="for CUDA, not metal"):
        PROBE.launch_source("metal", True)
    with flags.override(kernel_source_files="off"):
        assert not source_files.in_use()
    with flags.override(kernel_source_files="auto"):
        assert source_files.in_use()


def test_nvrtc_builds_the_same_cubin_from_the_files():
    from tools.metal_syntax_check import nvrtc_paths

    paths = nvrtc_paths()
    if paths is None:
        pytest.fail("NVRTC is not installed: pip install -e '.[test]' installs it (nvidia-cuda-nvrtc-cu12)")
    library, includes = paths
    built = {}
    for files in ("off", "on"):
        with flags.override(kernel_source_files=files):
            name, text = cuda_cache.mlx_source(PROBE, [(mx.bfloat16, 1), (mx.int32, 2), (mx.int32, 1)],
                                               [mx.float32], TEMPLATE)
        built[files] = (text, nvrtc.build(text, name, "sm_90a", str(library), includes))
    (inline, (cubin, lowered)), (short, (cubin_files, lowered_files)) = built["off"], built["on"]
    assert "#include" in short and "twice" not in short and len(short) < len(inline)
    assert "s_shape," in short and "s_ndim," in short and "sa_shape" not in short   # the signature MLX writes
    assert (cubin_files, lowered_files) == (cubin, lowered) and cubin[:4] == b"\x7fELF"
