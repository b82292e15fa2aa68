"""The expert cache's eviction policies (dsv4/expert_policy.py): which slots go first.

Oracle: the orders each policy's definition gives for small hand-made states, worked out here."""

import numpy as np
import pytest

from dsv4.expert_policy import Policy


def filled(kind, uses, layers=4, slots=6, half_life_tokens=1.0):
    """A policy after `uses`: (tick, slot, layer) in order."""
    p = Policy(kind, slots, layers, half_life_tokens)
    for tick, slot, layer in uses:
        while p.now < tick:
            p.tick()
        p.use(np.array([slot]), layer)
    return p


def test_empty_slots_go_first_under_every_policy():
    for kind in ("lru", "frequency", "layer"):
        p = filled(kind, [(1, 0, 0), (2, 1, 1), (3, 3, 2)])
        got = p.victims(np.arange(6), 3, layer=0).tolist()
        assert sorted(got) == [2, 4, 5], kind


def test_lru_evicts_the_least_recently_used():
    p = filled("lru", [(1, 0, 0), (2, 1, 0), (3, 2, 1), (4, 0, 2), (5, 3, 3), (6, 4, 0), (7, 5, 1)])
    assert p.victims(np.arange(6), 6, layer=2).tolist() == [1, 2, 0, 3, 4, 5]
    assert p.victims(np.array([0, 5, 3]), 2, layer=2).tolist() == [0, 3]   # only candidates


def test_frequency_keeps_the_often_used_and_forgets_with_the_half_life():
    # Half-life 1 token of 4 layers: a count halves every 4 ticks.
    uses = [(1, 0, 0), (1, 0, 0), (1, 0, 0), (2, 1, 0), (9, 2, 0), (9, 3, 0), (9, 3, 0)]
    p = filled("frequency", uses + [(9, 4, 0), (9, 5, 0)])
    # At tick 9: slot 0 was used 3 times at tick 1 -> counts 1, then 1*1+1 ... = 3 at tick 1,
    # decayed by 2**-(8/4) = 0.75; slot 1 once at tick 2 -> 2**-(7/4) = 0.30; slots 2, 4, 5
    # once now -> 1; slot 3 twice now -> 2.
    counts = p._counts_now(np.arange(6))
    np.testing.assert_allclose(counts, [0.75, 2 ** -1.75, 1, 2, 1, 1], rtol=1e-12)
    assert p.victims(np.arange(6), 6, layer=0).tolist() == [1, 0, 2, 4, 5, 3]


def test_layer_evicts_the_layers_just_passed_first():
    # Slots of layers 0..3; a lookup of layer 1: layer 1's next use is furthest (a token away),
    # then layer 0's, then 3's, and layer 2 (the next one) goes last; ties by recency.
    p = filled("layer", [(1, 0, 2), (2, 1, 3), (3, 2, 0), (4, 3, 1), (5, 4, 1), (6, 5, 2)])
    assert p.victims(np.arange(6), 6, layer=1).tolist() == [3, 4, 2, 1, 0, 5]


def test_forgotten_slots_are_empty_again():
    p = filled("lru", [(1, 0, 0), (2, 1, 0), (3, 2, 0)], slots=3)
    p.forget(np.array([2]))
    assert p.victims(np.arange(3), 1, layer=0).tolist() == [2]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="lru, frequency, layer"):
        Policy("random", 4, 2)
