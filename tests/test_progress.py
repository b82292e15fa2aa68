"""progress.Waiting: the line for a wait with nothing to count (a fresh process's first token,
while MLX builds its kernels), alone and in stream_generate."""

import re
import threading
import time
from functools import partial

import mlx.core as mx
import pytest

import dsv4
from dsv4 import generation
from dsv4.generation import stream_generate
from dsv4.progress import Waiting


def waiting_threads() -> int:
    return sum(t.name == "waiting" for t in threading.enumerate())


def test_a_short_wait_prints_nothing(capsys):
    w = Waiting("first token", "why", after_s=5.0)
    w.start()
    w.stop()
    w.stop()
    assert capsys.readouterr().err == "" and waiting_threads() == 0


def test_a_long_wait_redraws_through_an_evaluation_and_ends_its_line(capsys):
    """The line is drawn by a thread while the main thread is inside mx.eval (MLX lets go of
    the GIL), and the stop ends it with the time taken, padded over the longer line."""
    w = Waiting("first token", "building kernels", after_s=0.05)
    w.start()
    a = mx.random.normal((600, 600)) / 25
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        b = a
        for _ in range(6):
            b = b @ a
        mx.eval(b)
    w.stop()
    err = capsys.readouterr().err
    draws = err.split("\r")[1:]
    assert re.match(r"first token: \d+ s \(building kernels\)$", draws[0])
    assert re.match(r"first token: done in \d+ s +\n$", draws[-1])
    assert len(draws[-1].rstrip("\n")) >= len(draws[0])
    assert waiting_threads() == 0


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return dsv4.load(tiny_dir)


def test_stream_generate_shows_a_slow_first_token_and_ends_the_line_before_it(tiny, monkeypatch, capsys):
    model, tok = tiny
    monkeypatch.setattr(generation, "Waiting", partial(Waiting, after_s=0.05))
    prefill = generation.prefill
    monkeypatch.setattr(generation, "prefill", lambda *a, **k: (time.sleep(0.3), prefill(*a, **k))[1])
    tokens = stream_generate(model, tok, [5, 6, 7], max_tokens=3, ignore_eos=True)
    next(tokens)
    err = capsys.readouterr().err   # before the first token is handed out, the line is ended
    assert "\rfirst token: 0 s (a process's first steps build their kernels; later ones reuse them)" in err
    assert re.search(r"\rfirst token: done in \d+ s +\n$", err)
    assert len(list(tokens)) == 2 and capsys.readouterr().err == ""
    assert waiting_threads() == 0


def test_a_failing_prefill_stops_the_line(tiny, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(generation, "Waiting", partial(Waiting, after_s=0.05))

    def broken(*a, **k):
        time.sleep(0.1)
        raise RuntimeError("prefill failed")

    monkeypatch.setattr(generation, "prefill", broken)
    with pytest.raises(RuntimeError, match="prefill failed"):
        next(stream_generate(model, tok, [5, 6, 7], max_tokens=3))
    assert waiting_threads() == 0


def test_a_slow_warm_up_shows_the_line(tiny, monkeypatch, capsys):
    model, _ = tiny
    monkeypatch.setattr(generation, "Waiting", partial(Waiting, after_s=0.05))
    evaluate = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (time.sleep(0.3), evaluate(*a))[1])
    generation.warm_up(model)
    err = capsys.readouterr().err
    assert f"\rwarm-up: 0 s ({generation.KERNELS_WHY})" in err
    assert re.search(r"\rwarm-up: done in \d+ s +\n", err)
    assert waiting_threads() == 0
