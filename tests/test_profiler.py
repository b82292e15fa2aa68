"""The stage profiler: time charged to the right stage, totals that add up, nothing when off.

Oracles: time.sleep of known length (a lower bound on what a stage must be charged), the test's
own clock around the steps (an upper bound on the sum), and arithmetic of the printed table.
"""

import time

import mlx.core as mx
import pytest

from dsv4 import flags, profiler


@pytest.fixture
def profiling():
    with flags.override(stage_profile=True):
        profiler.reset()
        yield
    profiler.reset()


def _table_rows(report: str) -> dict[str, list[float]]:
    """stage -> [calls/step, total ms, ms/step, share %] parsed from report()."""
    rows = {}
    for line in report.splitlines()[2:]:
        name, *numbers = line.split()
        rows[name] = [float(n.rstrip("%")) for n in numbers]
    return rows


def test_off_mark_returns_input_and_records_nothing():
    with flags.override(stage_profile=False):
        profiler.reset()
        x = mx.ones((4,))
        profiler.step_begin()
        assert profiler.mark("attention", x) is x
        profiler.step_end()
        assert not profiler.enabled()
        assert profiler.per_step_ms() == {}
        assert "off" in profiler.report()
    profiler.reset()


def test_sleeps_are_charged_to_their_stage_and_totals_add_up(profiling):
    steps = 3
    start = time.perf_counter()
    for _ in range(steps):
        profiler.step_begin()
        time.sleep(0.030)
        profiler.mark("embed", mx.zeros((2,)))
        for _layer in range(2):
            time.sleep(0.010)
            profiler.mark("attention", mx.zeros((2,)))
        time.sleep(0.005)   # not covered by a mark: "unmarked"
        profiler.step_end()
    outer_ms = 1e3 * (time.perf_counter() - start) / steps

    per_step = profiler.per_step_ms()
    assert list(per_step) == ["embed", "attention", profiler.UNMARKED]
    assert per_step["embed"] >= 30.0
    assert per_step["attention"] >= 20.0
    assert per_step[profiler.UNMARKED] >= 5.0
    assert sum(per_step.values()) <= outer_ms

    rows = _table_rows(profiler.report())
    assert rows["attention"][0] == 2.0 and rows["embed"][0] == 1.0   # calls per step
    # The table prints totals to 0.01 ms and per-step values to 0.001 ms: a printed total / steps
    # and the printed per-step value differ by up to 0.005 / steps + 0.0005 from rounding alone.
    rounding = 0.005 / steps + 0.0005 + 1e-9
    for name, ms in per_step.items():
        calls, total_ms, ms_per_step, share = rows[name]
        assert total_ms == pytest.approx(ms * steps, abs=0.01)
        assert ms_per_step == pytest.approx(total_ms / steps, abs=rounding)
    total_ms, total_ms_per_step, total_share = rows.pop("total")   # no calls column
    assert total_ms == pytest.approx(sum(r[1] for r in rows.values()), abs=0.05)
    assert total_ms_per_step == pytest.approx(sum(per_step.values()), abs=0.002)
    assert sum(r[3] for r in rows.values()) == pytest.approx(100.0, abs=0.3)
    assert total_share == 100.0


def test_lazy_work_is_charged_to_the_stage_that_marks_it(profiling):
    a = mx.random.normal((256, 256), key=mx.random.key(0))
    mx.eval(a)
    profiler.step_begin()
    heavy = a
    for _ in range(40):          # still lazy: only mark's eval runs it
        heavy = (heavy @ a) * 0.05
    profiler.mark("heavy", heavy)
    profiler.mark("light", mx.zeros((1,)))
    profiler.step_end()
    per_step = profiler.per_step_ms()
    assert per_step["heavy"] > 10 * per_step["light"]
    assert per_step["heavy"] > per_step[profiler.UNMARKED]


def test_marks_outside_a_step_are_ignored(profiling):
    profiler.mark("prefill", mx.zeros((2,)))
    profiler.step_begin()
    profiler.mark("attention", mx.zeros((2,)))
    profiler.step_end()
    profiler.mark("after", mx.zeros((2,)))
    assert set(profiler.per_step_ms()) == {"attention", profiler.UNMARKED}


def test_reset_clears_timings_and_rereads_the_switch(profiling):
    profiler.step_begin()
    profiler.mark("attention", mx.zeros((2,)))
    profiler.step_end()
    assert profiler.enabled() and profiler.per_step_ms()
    profiler.reset()
    assert profiler.per_step_ms() == {}
    assert "no decode step" in profiler.report()
    with flags.override(stage_profile=False):
        profiler.reset()
        assert not profiler.enabled()
