"""The launches of a fixed-shape step of several positions (a DSpark verify) as a GPU makes
them, counted on the CPU (benchmarks/step_launches.py): a verify is encoded launch by launch,
so its tails and pools must run as a one-position step's do."""

import pytest

from benchmarks import step_launches
from benchmarks.slice_decode import ROLES, SMALL, build
from benchmarks.speculative_steps import DRAFT_SMALL, with_draft
from dsv4 import flags


@pytest.fixture(scope="module")
def slice_model():
    config = {**SMALL, **ROLES}
    model, _, _ = build(config)
    with_draft(model, {**config, **DRAFT_SMALL})
    return model


def total(counted):
    prims, calls = counted
    return prims + sum(calls.values())


def test_a_verify_runs_its_tails_as_kernels_with_each_positions_angles(slice_model):
    """DSV4_KERNEL_ROWS_POSITIONS on: a 4-position verify launches no plain RoPE (the tails
    and the attention take each position's angles) and at most 1.25x a plain step's launches;
    off, its tails run as plain ops (RoPE launches of their own) and it launches ~2x."""
    with flags.override(kernel_rows_positions=True):
        on = step_launches.count(slice_model, [1, 4])
    with flags.override(kernel_rows_positions=False):
        off = step_launches.count(slice_model, [1, 4])
    assert on[1] == off[1]                                   # the one-position step is unchanged
    assert on[4][1]["mx.fast.rope"] == 0 and on[4][1]["dsv4_rope_angles"] >= 1
    assert total(on[4]) <= 1.25 * total(on[1]), (total(on[4]), total(on[1]))
    assert off[4][1]["mx.fast.rope"] > 0 and total(off[4]) > 1.8 * total(off[1])
