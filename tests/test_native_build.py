"""The native extensions' build command (dsv4/native/__init__.py): where MLX runs on CUDA and
CUDA's headers are found, the CUDA part is compiled in and keyed apart; elsewhere the command is
the CPU one. Oracle: the header trees the tests lay out, and the command the CPU build runs."""

import os
import subprocess
import sys

import pytest

from dsv4 import native

HEADERS = ("cuda.h", "cuda_runtime.h", "crt/host_config.h")


def lay_out(root, headers):
    for h in headers:
        (root / h).parent.mkdir(parents=True, exist_ok=True)
        (root / h).write_text("")
    return root


@pytest.fixture
def no_system_cuda(monkeypatch, tmp_path):
    """No CUDA on the search path but what a test lays out."""
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    monkeypatch.setattr(native, "SYSTEM_CUDA", tmp_path / "none")
    monkeypatch.setattr(native, "_nvidia_packages", lambda: [])


def test_headers_from_cuda_home(no_system_cuda, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    lay_out(tmp_path / "include", HEADERS)
    assert native.cuda_headers() == [tmp_path / "include"]


def test_headers_spread_over_the_pip_packages(no_system_cuda, monkeypatch, tmp_path):
    """cu12's wheels: the runtime's headers in one package, crt in another."""
    lay_out(tmp_path / "nvidia" / "cuda_runtime" / "include", HEADERS[:2])
    lay_out(tmp_path / "nvidia" / "cuda_nvcc" / "include", HEADERS[2:])
    monkeypatch.setattr(native, "_nvidia_packages", lambda: [str(tmp_path / "nvidia")])
    assert native.cuda_headers() == [tmp_path / "nvidia" / "cuda_runtime" / "include",
                                     tmp_path / "nvidia" / "cuda_nvcc" / "include"]


@pytest.mark.parametrize("missing", HEADERS)
def test_a_missing_header_finds_none(no_system_cuda, monkeypatch, tmp_path, missing):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    lay_out(tmp_path / "include", [h for h in HEADERS if h != missing])
    assert native.cuda_headers() is None


@pytest.mark.parametrize("on_cuda, headers", [(False, True), (True, False), (True, True)])
def test_the_cuda_part_only_on_cuda_with_its_headers(no_system_cuda, monkeypatch, tmp_path, on_cuda, headers):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    if headers:
        lay_out(tmp_path / "include", HEADERS)
    cpu_command, cpu_key = native._command("reads", tmp_path / "out.so"), native._key("reads")
    monkeypatch.setattr(native, "_on_cuda", lambda: on_cuda)
    command = native._command("reads", tmp_path / "out.so")
    if not (on_cuda and headers):
        assert command == cpu_command and native._key("reads") == cpu_key
        return
    extra = [f for f in command if f not in cpu_command]
    assert extra == ["-DDSV4_CUDA", f"-I{tmp_path / 'include'}", "-idirafter",
                     str(native.SOURCES / "shim"), "-ldl"]
    assert command.index("-DDSV4_CUDA") < command.index(str(native.SOURCES / "reads.cpp"))
    assert command.index("-ldl") > command.index(str(native.SOURCES / "reads.cpp"))
    assert command[-2:] == ["-o", str(tmp_path / "out.so")]
    assert native._key("reads") != cpu_key   # the two builds never share a cache entry


def test_a_cuda_part_that_does_not_build_is_left_out(tmp_path):
    """CUDA's headers found but the build of the CUDA part fails (here: this MLX has no CUDA
    backend headers): one line says so, and the extension is built without it, in its own entry.
    In a process of its own: a second copy of an extension in this one would take over its
    nanobind types."""
    lay_out(tmp_path / "include", HEADERS)
    script = ("from dsv4 import native\n"
              "native._on_cuda = lambda: True\n"
              "module = native.load('reads')\n"
              "print(module.gpu_reads, native.load('reads') is module, native._key('reads', cuda=False))\n")
    env = {**os.environ, "CUDA_HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    gpu_reads, same, cpu_key = done.stdout.split()
    assert (gpu_reads, same) == ("False", "True")
    assert done.stderr.count("the reads extension is built without its CUDA part (building reads failed") == 1
    built = sorted(p.parent.name for p in (tmp_path / "cache").rglob("_reads*"))
    assert built == [cpu_key]   # the failed build left nothing
