"""Wall time per stage of each decode step, behind the switch DSV4_STAGE_PROFILE=1.

The forward pass ends each stage with `x = profiler.mark("attention", x)`; the decode loop brackets
each step with `profiler.step_begin()` and `profiler.step_end()`, and prints `profiler.report()`
at the end of the run. With the switch on, `mark` evaluates `x` (`mx.eval`) and charges the wall
time since the previous mark (or since `step_begin`) to the stage it names; a name used several
times per step (one per layer) adds up. `step_end` synchronizes and charges what no mark covered
(sampling, host work, arrays never passed to a mark) to "unmarked". So the stage totals add up to
the measured time of the steps. Marks outside a step (prefill) are ignored.

Perturbation: with the switch on, every mark is a host synchronisation, so the device idles while
the host builds the next stage's graph, and work the production schedule overlaps (the next step's
graph built while this one runs, async_eval) is serialized. Totals are therefore larger than an
unprofiled step; use the table for where the time goes, and `benchmarks/ab.py` without the switch
for how much time there is. Measured cost of the switch: see benchmarks/README.md ("Stage
profiler"). Do not mark inside an `mx.compile`d function when profiling (eval is not allowed there).

Counters: `count(name, amount)` adds to a named count inside a step (the expert cache counts
each layer's hits, misses and MB read); `report()` lists them per step after the stages, and
`per_step_counts()` gives them.

With the switch off, `mark` is one test of a cached module-level boolean and returns `x` as is.
The switch is read at import and again by `reset()` (tests use `flags.override` then `reset()`).
"""

from __future__ import annotations

import time

import mlx.core as mx

from dsv4 import flags

UNMARKED = "unmarked"

_enabled = False   # the switch, cached
_in_step = False   # between step_begin and step_end with the switch on: the one test mark makes
_last = 0.0        # perf_counter of the previous boundary inside the step
_totals: dict[str, float] = {}   # stage -> seconds, in first-seen order
_calls: dict[str, int] = {}
_counts: dict[str, float] = {}   # counter -> total over the profiled steps, in first-seen order
_steps = 0
_step_seconds = 0.0
_step_start = 0.0


def enabled() -> bool:
    return _enabled


def reset() -> None:
    """Forget all timings and re-read DSV4_STAGE_PROFILE."""
    global _enabled, _in_step, _steps, _step_seconds
    _enabled = bool(flags.get("stage_profile"))
    _in_step = False
    _totals.clear()
    _calls.clear()
    _counts.clear()
    _steps = 0
    _step_seconds = 0.0


def _charge(name: str) -> None:
    global _last
    now = time.perf_counter()
    _totals[name] = _totals.get(name, 0.0) + (now - _last)
    _calls[name] = _calls.get(name, 0) + 1
    _last = now


def step_begin() -> None:
    """Start timing one decode step; work queued before it is finished first and not charged."""
    global _in_step, _last, _step_start
    if not _enabled:
        return
    mx.synchronize()
    _in_step = True
    _step_start = _last = time.perf_counter()


def mark(name: str, x):
    """End of stage `name`: returns x; when profiling, evaluates x and charges the time to `name`."""
    if not _in_step:
        return x
    mx.eval(x)
    _charge(name)
    return x


def count(name: str, amount: float) -> None:
    """Add `amount` to counter `name` (inside a profiled step; ignored elsewhere)."""
    if _in_step:
        _counts[name] = _counts.get(name, 0) + amount


def step_end() -> None:
    """Finish the step: wait for all queued work, charge what no mark covered to "unmarked"."""
    global _in_step, _steps, _step_seconds
    if not _in_step:
        return
    mx.synchronize()
    _charge(UNMARKED)
    _in_step = False
    _steps += 1
    _step_seconds += _last - _step_start


def per_step_ms() -> dict[str, float]:
    """stage -> milliseconds per profiled step (the `stage_profile_ms` of a DSV4_RESULT line)."""
    return {name: 1e3 * seconds / _steps for name, seconds in _totals.items()} if _steps else {}


def per_step_counts() -> dict[str, float]:
    """counter -> its mean per profiled step."""
    return {name: total / _steps for name, total in _counts.items()} if _steps else {}


def report() -> str:
    """A table: per stage its calls per step, total ms, ms per step and share of the step time."""
    if not _enabled:
        return "stage profile: off (set DSV4_STAGE_PROFILE=1)"
    if not _steps:
        return "stage profile: no decode step was profiled"
    step_seconds = _step_seconds or 1e-12   # a share of zero time is 0, not a ZeroDivisionError
    lines = [f"stage profile: {_steps} decode steps, {1e3 * _step_seconds / _steps:.3f} ms per step "
             "(every stage boundary syncs, so steps run slower than unprofiled)",
             f"{'stage':<20} {'calls/step':>10} {'total ms':>10} {'ms/step':>9} {'share':>7}"]
    for name, seconds in _totals.items():
        lines.append(f"{name:<20} {_calls[name] / _steps:>10.1f} {1e3 * seconds:>10.2f} "
                     f"{1e3 * seconds / _steps:>9.3f} {100 * seconds / step_seconds:>6.1f}%")
    lines.append(f"{'total':<20} {'':>10} {1e3 * _step_seconds:>10.2f} "
                 f"{1e3 * _step_seconds / _steps:>9.3f} {100.0:>6.1f}%")
    if _counts:
        lines.append(f"{'counter':<28} {'per step':>10}")
        lines += [f"{name:<28} {value:>10.3f}" for name, value in per_step_counts().items()]
    return "\n".join(lines)


reset()
