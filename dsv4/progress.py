"""A one-line progress bar on stderr for long work: byte streams (converting, copying, loading
tables) and token streams (prefilling a long prompt).

    shown = Progress("copying layers.1.engram", total_bytes, enabled=not quiet)
    for chunk in chunks:
        ...
        shown.advance(len(chunk))
    shown.finish()

The line reads `copying layers.1.engram: 1.20 GB of 4.80 GB ( 25%), 310 MB/s, 00:00:11 left`: it
is redrawn in place (`\\r`) at most twice a second, and `finish()` draws the last one and ends it.
With `unit="tokens"` it counts tokens: `prefill: 1024 of 3000 tokens ( 34%), 120 tok/s, ...`.

A wait with nothing to count (a fresh process's first steps, while MLX builds its kernels) gets
`Waiting`: silent if it ends soon, else `first tokens: 14 s (why)` redrawn each second.
"""

from __future__ import annotations

import sys
import threading
import time

REDRAW_S = 0.5


class Progress:
    """Bytes (or tokens) done of `total`, rate and time left; `done` is where a resumed job starts."""

    def __init__(self, what: str, total: int, enabled: bool = True, done: int = 0, unit: str = "bytes"):
        if unit not in ("bytes", "tokens"):
            raise ValueError(f"unit {unit!r}: expected bytes or tokens")
        self.what, self.total, self.enabled, self.unit = what, total, enabled, unit
        self.done = self.start_done = done
        self.start = time.monotonic()
        self.last = 0.0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        self.show()

    def show(self, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < REDRAW_S):
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        rate = (self.done - self.start_done) / elapsed   # this run's bytes, not a resumed job's
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = "--:--" if left == float("inf") else time.strftime("%H:%M:%S", time.gmtime(left))
        pct = 100 * self.done / max(self.total, 1)
        if self.unit == "bytes":
            done, total, speed = format_bytes(self.done), format_bytes(self.total), f"{rate / 1e6:.0f} MB/s"
        else:
            done, total, speed = str(self.done), f"{self.total} tokens", f"{rate:.0f} tok/s"
        print(f"\r{self.what}: {done} of {total} ({pct:3.0f}%), "
              f"{speed}, {eta} left ", end="\n" if final else "",
              file=sys.stderr, flush=True)

    def finish(self) -> None:
        self.show(final=True)


class Waiting:
    """A line for a wait with no count of its own: nothing if `stop()` comes within `after_s`
    of `start()`; after that `what: 12 s (why)` redrawn each second by a thread (MLX lets go of
    the GIL while it evaluates), and `what: done in 41 s` at the stop. Both may be called more
    than once; only the first of each counts. As a context manager it spans the block."""

    def __init__(self, what: str, why: str, after_s: float = 10.0, enabled: bool = True):
        self.what, self.why, self.after_s, self.enabled = what, why, after_s, enabled
        self.shown = 0   # the length of the last line drawn
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None   # set by the first start

    def __enter__(self) -> "Waiting":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if not self.enabled or self.thread is not None:
            return
        self.start_time = time.monotonic()
        self.thread = threading.Thread(target=self._beat, name="waiting", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        wait = self.after_s
        while not self.stopping.wait(wait):
            line = f"{self.what}: {time.monotonic() - self.start_time:.0f} s ({self.why})"
            print("\r" + line, end="", file=sys.stderr, flush=True)
            self.shown, wait = len(line), 1.0

    def stop(self) -> None:
        if self.thread is None or self.stopping.is_set():
            return
        self.stopping.set()
        self.thread.join()
        if self.shown:
            line = f"{self.what}: done in {time.monotonic() - self.start_time:.0f} s"
            print("\r" + line.ljust(self.shown), file=sys.stderr, flush=True)


def format_bytes(nbytes: float) -> str:
    """1.5 MB / 2.31 GB (powers of ten, as disk sizes are sold)."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
