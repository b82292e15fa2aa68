"""benchmarks/gpu_path.py: the fixed decode step counted as a GPU backend builds it, on the CPU."""

import pytest

from benchmarks import gpu_path
from benchmarks.graph_ops import launches
from benchmarks.slice_decode import ROLES, SMALL, build
from dsv4 import flags


@pytest.fixture(scope="module")
def model():
    return build({**SMALL, **ROLES})[0]


def test_kernels_stand_in_and_replace_mlx_launches(model):
    with_kernels = gpu_path.count(model, 64)
    with flags.override(**{n: False for n in flags.FLAGS if n.startswith("kernel_")}):
        without = gpu_path.count(model, 64)
    assert without[gpu_path.STAND_IN] == 0                 # no custom kernel: nothing stood in
    kernels = with_kernels[gpu_path.STAND_IN]
    assert kernels >= 4 * model.args.num_hidden_layers     # attention (2) and experts (2) per layer at least
    on = kernels + sum(launches(with_kernels).values())
    off = sum(launches(without).values())
    assert on < off                                        # each kernel replaces several MLX launches
    lines = gpu_path.summary(with_kernels, model.args.num_hidden_layers)
    assert lines[0].startswith(f"launches per step: {on} ")
