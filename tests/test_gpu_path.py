"""benchmarks/gpu_path.py: the fixed-shape step (one position, or a verify of several) counted as a
GPU backend builds it, on the CPU."""

import pytest

from benchmarks import gpu_path
from benchmarks.graph_ops import launches
from benchmarks.slice_decode import ROLES, SMALL, build
from dsv4 import flags


@pytest.fixture(scope="module")
def model():
    return build({**SMALL, **ROLES})[0]


@pytest.fixture(scope="module")
def default_counts(model):
    """The step's primitives with the switches' defaults."""
    return gpu_path.count(model, 64)


def total(counts) -> int:
    return counts[gpu_path.STAND_IN] + sum(launches(counts).values())


def test_kernels_stand_in_and_replace_mlx_launches(model, default_counts):
    with flags.override(**{n: False for n in flags.FLAGS if n.startswith("kernel_")}):
        without = gpu_path.count(model, 64)
    assert without[gpu_path.STAND_IN] == 0                 # no custom kernel: nothing stood in
    assert default_counts[gpu_path.STAND_IN] >= 4 * model.args.num_hidden_layers   # attention (2), experts (2) a layer at least
    on = total(default_counts)
    off = sum(launches(without).values())
    assert on < off                                        # each kernel replaces several MLX launches
    lines = gpu_path.summary(default_counts, model.args.num_hidden_layers)
    assert lines[0].startswith(f"launches per step: {on} ")


def test_joined_projections_and_the_next_projection_take_a_launch_off_each_layer(model, default_counts):
    """DSV4_KERNEL_MATVEC_JOINED: wq_a and wkv in one launch, a layer's two MLX products gone for
    one kernel; DSV4_KERNEL_MOE_NEXT_PROJECTION: every layer's attention entry but the first (no
    Engram in the slice) without its partials launch, made by the layer before's down launch."""
    layers = model.args.num_hidden_layers
    with flags.override(kernel_matvec_joined=True, kernel_moe_next_projection=True):
        both = gpu_path.count(model, 64)
    assert both["QuantizedMatmul"] == default_counts["QuantizedMatmul"] - 2 * layers   # wq_a's and wkv's
    assert both[gpu_path.STAND_IN] == default_counts[gpu_path.STAND_IN] + layers - (layers - 1)
    assert total(both) == total(default_counts) - layers - (layers - 1)


@pytest.fixture(scope="module")
def draft_model():
    return gpu_path.positions_model(None)


def test_a_verify_runs_its_tails_as_kernels_with_each_positions_angles(draft_model):
    """A verify is encoded launch by launch, so its tails must run as a one-position step's do.
    DSV4_KERNEL_ROWS_POSITIONS on: a 4-position verify launches no plain RoPE (the tails and
    the attention take each position's angles) and at most 1.25x a plain step's launches; off,
    its tails run as plain ops (RoPE launches of their own) and it launches ~2x."""
    with flags.override(kernel_rows_positions=True):
        on = gpu_path.count_positions(draft_model, [1, 4])
    with flags.override(kernel_rows_positions=False):
        off = gpu_path.count_positions(draft_model, [1, 4])
    assert on[1] == off[1]                                   # the one-position step is unchanged
    assert on[4][1]["mx.fast.rope"] == 0 and on[4][1]["dsv4_rope_angles"] >= 1
    assert on[4][0] <= 1.25 * on[1][0], (on[4][0], on[1][0])
    assert off[4][1]["mx.fast.rope"] > 0 and off[4][0] > 1.8 * off[1][0]


def test_a_propose_runs_the_block_through_kernels_and_each_draft_adds_only_its_pick(draft_model):
    """DSpark's compiled propose: every stage's attention, experts and mHC as kernels (no plain
    RoPE), the same kernels whatever k (the block always has its rows), and each further draft only
    the Markov chain's few MLX launches."""
    counted = gpu_path.count_propose(draft_model, [1, 3])
    (one, calls_one), (three, calls_three) = counted[1], counted[3]
    stages = len(draft_model.draft.mtp)
    assert calls_one == calls_three and calls_one["mx.fast.rope"] == 0
    assert calls_one["dsv4_experts_down"] == stages and calls_one["dsv4_sparse_attention_partial"] == stages
    assert one < three <= one + 2 * 12, (one, three)


def test_tailed_projections_take_two_launches_off_each_layer(model, default_counts):
    """DSV4_KERNEL_MATVEC_TAIL: wq_a and wkv each with its tail in one launch, where MLX's product
    and a row-tail kernel ran each: two MLX products and two row tails a layer gone for two kernels."""
    layers = model.args.num_hidden_layers
    with flags.override(kernel_matvec_tail=True):
        tailed = gpu_path.count(model, 64)
    assert tailed["QuantizedMatmul"] == default_counts["QuantizedMatmul"] - 2 * layers
    assert tailed[gpu_path.STAND_IN] == default_counts[gpu_path.STAND_IN]   # two tails out, two tailed launches in
    assert total(tailed) == total(default_counts) - 2 * layers
