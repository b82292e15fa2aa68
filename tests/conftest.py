"""Shared fixtures. TF32 is off for every test: MLX's CUDA backend runs fp32 matmuls in TF32 by
default, and the GPU tests hold kernels to exact fp32 math against fp32 references (with TF32
on, a tiny random model's greedy tokens part within three steps). The CPU ignores it."""

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")   # before any import of MLX: read at its first fp32 matmul

import shutil  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

from dsv4.kernels.dialect import backend, poisoned_outputs  # noqa: E402
from dsv4.testing import write_tiny_checkpoint  # noqa: E402
from tools.cxx import HOST_BUILDS  # noqa: E402


def pytest_configure(config):
    """The session's folder of host-built kernel executables (tests/test_kernels_decode_host.py
    build_host), made by the first process, whose environment xdist's workers inherit."""
    if HOST_BUILDS not in os.environ:
        config.host_builds = tempfile.mkdtemp(prefix="dsv4-host-builds-")
        os.environ[HOST_BUILDS] = config.host_builds


def pytest_unconfigure(config):
    if getattr(config, "host_builds", None):
        shutil.rmtree(config.host_builds, ignore_errors=True)
        del os.environ[HOST_BUILDS]


@pytest.fixture(autouse=True)
def signal_dispositions():
    """Every test ends with SIGINT and SIGTERM handled as it began: a disposition left behind
    would reach the processes later tests start in this worker (an ignored SIGINT is inherited
    across exec, and a chat REPL that inherits it never sees Ctrl-C at its prompt)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Tiny official-layout checkpoint with every layer role and two Engram layers."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_no_engram_dir(tmp_path_factory):
    """The same without Engram, loadable by mlx-lm's deepseek_v41 too."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ne") / "ckpt", seed=1,
                                 config_overrides={"engram_layer_ids": []})


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory):
    """A tiny checkpoint (two Engram layers) with DSpark draft stages `mtp.*`."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "ckpt", seed=4, draft=True)


@pytest.fixture
def kernels_poisoned():
    """GPU kernel tests: skip without a Metal/CUDA backend; every kernel output starts as NaN."""
    if backend() is None:
        pytest.skip("no Metal/CUDA backend on the default device")
    with poisoned_outputs():
        yield
