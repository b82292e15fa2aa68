import pytest

from dsv4.kernels.dialect import backend, poisoned_outputs
from dsv4.testing import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Tiny official-layout checkpoint with every layer role and two Engram layers."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_no_engram_dir(tmp_path_factory):
    """The same without Engram, loadable by mlx-lm's deepseek_v41 too."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ne") / "ckpt", seed=1,
                                 config_overrides={"engram_layer_ids": []})


@pytest.fixture
def kernels_poisoned():
    """GPU kernel tests: skip without a Metal/CUDA backend; every kernel output starts as NaN."""
    if backend() is None:
        pytest.skip("no Metal/CUDA backend on the default device")
    with poisoned_outputs():
        yield
