"""MLX's encoding of the queued decode step on a thread of its own (DSV4_ENCODE_THREAD), so that the
host builds the next step's graph meanwhile.

A run-ahead decode step costs the host two things, one after the other: building its graph
(dsv4's Python and the compiled step's replay, ~0.6 ms on the H100's host) and MLX's encoding of
it in `mx.async_eval` (~10 µs a primitive, ~1.7 ms: benchmarks/results/2026-12-06-0845-host-encode.md).
Where the device is faster than that, the step is the host's. MLX releases the GIL while it
encodes, so the encoding can run on another thread while the loop builds the step after: the
host's time a step becomes the longer of the two instead of their sum.

MLX's streams belong to threads: a thread encodes only arrays of its own streams. So the thread
here owns a stream (`stream`), the loop builds each step on it (`with mx.stream(...)`; the
compiled step is traced for it: dsv4/step.py keys its graphs by stream), and what the loop feeds
the first step is evaluated before. Arrays of the thread's stream may be read and waited for
anywhere once encoded; the loop touches a step's arrays only after `Queued.wait`. Building a graph
on top of arrays whose encoding is in flight reads only their shapes and types.

What is evaluated while a step is built (a weight's derived constant at the first trace, the
tokens Engram hashes on the host) is of the thread's stream too: `evaluate` hands it to the
thread and waits; a step built in pieces queues each through `async_eval`.

One thread for the process (`shared()`), idle between loops, so that its stream, and the graphs
traced for it, last.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Optional

import mlx.core as mx


class Queued:
    """One step's arrays handed to the encoder; `wait()` returns once MLX has encoded them (and
    raises what the encoding raised)."""

    def __init__(self, arrays):
        self.arrays = arrays
        self.error: Optional[BaseException] = None
        self.done = threading.Event()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class EncodeThread:
    """A thread with a stream of its own (on the default device) that `mx.async_eval`s what is
    queued, in order: a step's encoding starts after the one before it has returned."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        started: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(started,), name="dsv4-encode", daemon=True)
        self._thread.start()
        self.stream = started.get()

    def queue(self, arrays) -> Queued:
        job = Queued(arrays)
        self._jobs.put(job)
        return job

    def drain(self) -> None:
        """Return once everything queued so far has been encoded."""
        self.queue([]).wait()

    def _run(self, started: queue.SimpleQueue) -> None:
        started.put(mx.new_stream(mx.default_device()))
        while True:
            job = self._jobs.get()
            try:
                mx.async_eval(job.arrays)
            except BaseException as e:   # handed to the waiter, whose thread reports it
                job.error = e
            finally:
                job.arrays = None
                job.done.set()


_shared: dict = {}
_lock = threading.Lock()


def shared() -> EncodeThread:
    """The process's encoder thread, started at the first call."""
    with _lock:
        if "thread" not in _shared:
            _shared["thread"] = EncodeThread()
        return _shared["thread"]


_local = threading.local()   # .encoder: the EncodeThread this thread builds for, inside building()


@contextlib.contextmanager
def building(encoder: Optional[EncodeThread]):
    """Build on the encoder's stream: what is made here is the encoder thread's to encode (with
    None, on this thread's streams as ever)."""
    if encoder is None:
        yield
        return
    saved, _local.encoder = getattr(_local, "encoder", None), encoder
    try:
        with mx.stream(encoder.stream):
            yield
    finally:
        _local.encoder = saved


def evaluate(*arrays) -> None:
    """mx.eval, also inside `building`, where new arrays are of a stream only the encoder's thread
    encodes: there they are queued to it first (and waited for)."""
    encoder = getattr(_local, "encoder", None)
    if encoder is not None:
        encoder.queue(list(arrays)).wait()
    mx.eval(*arrays)


def async_eval(*arrays) -> None:
    """mx.async_eval, or inside `building`, queued to the encoder's thread (which encodes what it is
    given in order): a step built in pieces queues each piece as it is built."""
    encoder = getattr(_local, "encoder", None)
    if encoder is None:
        mx.async_eval(*arrays)
    else:
        encoder.queue(list(arrays))
