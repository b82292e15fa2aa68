"""The link between ranks failing, told in one line: a peer that never joins, a rank that dies.

MLX 0.32's ring backend (mlx/distributed/ring/ring.cpp, utils.cpp) connects to the next rank
in 5 attempts 1, 2, 4, 8 and 16 s apart and then raises "[ring] Couldn't connect" (~31 s), but
takes the previous rank's connection with a plain accept() that waits forever, holding the GIL
(no Python thread can watch it). A SIGALRM interrupts that accept (EINTR: MLX raises "[ring]
Accept failed"), which is how `join` bounds the wait by DSV4_JOIN_TIMEOUT. Once joined, a
peer that exits closes its sockets and the next exchange raises "[ring] connection to a peer
was lost" where the graph is evaluated; `watched` names this rank and its neighbours instead.
(MLX itself also prints "[ring] Socket N was closed by the peer" lines on stderr.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from typing import Iterator, Optional

import mlx.core as mx

from . import ParallelError

BACKENDS_SAY = ("[ring]", "[jaccl]", "[mpi]", "[nccl]")


def addresses() -> list[str]:
    """Each rank's first address from the ring hostfile mlx.launch wrote (MLX_HOSTFILE), or []."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            hosts = json.load(f)
        return [h[0] if isinstance(h, list) else str(h) for h in hosts]
    except (KeyError, OSError, ValueError, IndexError, TypeError):
        return []


def rank_name(rank: int, size: Optional[int] = None) -> str:
    """'rank 1 of 2 (127.0.0.1:5001)': the address where the hostfile gives one."""
    hosts = addresses()
    where = f" ({hosts[rank]})" if rank < len(hosts) else ""
    return f"rank {rank}" + (f" of {size}" if size else "") + where


def join(backend: str, timeout: float):
    """mx.distributed.init(backend) that gives up after `timeout` seconds of waiting for a peer
    (ParallelError naming this rank and the one it waited for) instead of waiting forever."""
    hosts = addresses()
    rank = int(os.environ.get("MLX_RANK", "0") or 0)
    size = len(hosts) or None
    fired = []
    try:
        previous, armed = signal.signal(signal.SIGALRM, lambda *_: fired.append(True)), True
        signal.setitimer(signal.ITIMER_REAL, timeout)
    except ValueError:   # not the main thread: no alarm, MLX's own waits
        previous, armed = None, False
    try:
        return mx.distributed.init(strict=False, backend=backend)
    except RuntimeError as error:
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        me = rank_name(rank, size)
        if "couldn't connect" in text.lower() and size:   # MLX's ~31 s of attempts ran out
            raise ParallelError(f"{me}: could not connect to {rank_name((rank + 1) % size)} ({text}); "
                                f"is it started and reachable?") from None
        if fired:   # the alarm broke the accept
            left = rank_name((rank - 1) % size) if size else "a peer"
            raise ParallelError(f"{me}: {left} did not connect within {timeout:g} s (DSV4_JOIN_TIMEOUT); "
                                f"start every rank (mlx.launch) and check the hostfile's addresses") from None
        raise ParallelError(f"{me}: joining the group failed: {text}") from None
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


def neighbours(rank: int, size: int) -> str:
    """'rank 0 (addr) or rank 2 (addr)': the ring neighbours whose link this rank depends on."""
    return " or ".join(rank_name(p) for p in sorted({(rank - 1) % size, (rank + 1) % size} - {rank}))


@contextlib.contextmanager
def answered(group, timeout: float) -> Iterator[None]:
    """An exchange that the other ranks, waiting for it, complete at once: if it has not within
    `timeout`, the link is gone (a backend that noticed a lost peer while this rank was idle
    fails that peer's pending work, and later exchanges wait forever), so this rank stops with
    one line and status 2 from a watchdog thread (it cannot unblock the wait)."""
    rank, size = group.rank(), group.size()

    def give_up():
        sys.stdout.flush()
        print(f"error: {rank_name(rank, size)}: lost the link to the other ranks: "
              f"{neighbours(rank, size)} did not answer within {timeout:g} s", file=sys.stderr, flush=True)
        os._exit(2)

    timer = threading.Timer(timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class LinkLost(ParallelError):
    """A peer of the group went away mid-run: nothing more can run across the group."""


@contextlib.contextmanager
def watched(group) -> Iterator[None]:
    """Run a command line's work across `group`: the backend's error when a peer goes away (it
    stopped, or its machine or link did) becomes one ParallelError line naming this rank and
    the neighbours whose link it lost, so every surviving rank exits 2 instead of a traceback."""
    try:
        yield
    except RuntimeError as error:
        text = str(error).splitlines()[0] if str(error) else ""
        if group is None or not text.startswith(BACKENDS_SAY):
            raise
        rank, size = group.rank(), group.size()
        raise LinkLost(f"{rank_name(rank, size)}: lost the link to the other ranks ({text}): "
                       f"{neighbours(rank, size)} stopped or became unreachable") from None
