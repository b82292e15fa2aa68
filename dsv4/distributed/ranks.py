"""The command lines under mlx.launch: every rank runs the same program on the same tokens
(greedy or seeded sampling picks the same token everywhere, the logits being the same after
the exchanges); rank 0 talks to the user, the others print nothing on stdout."""

from __future__ import annotations

import os
import sys
from typing import Optional

from . import ParallelError, init, parse_modes, stats


def join(parallel: Optional[str]):
    """The group of every process mlx.launch started, for `--parallel` (None without it)."""
    if not parallel:
        return None
    parse_modes(parallel)
    group = init()
    if group.size() < 2:
        raise ParallelError(f"--parallel {parallel}: this is a single process; start one per rank "
                            f"with mlx.launch (README, 'Several machines')")
    if group.rank() != 0:
        sys.stdout = open(os.devnull, "w")
    return group


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports free now (mlx.launch --starting-port: the
    ring backend's ranks listen on it and the next ones; two launches on one machine at the same
    default ports would connect across)."""
    import random
    import socket

    for _ in range(100):
        first = random.randrange(20000, 60000)
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise OSError(f"no {count} consecutive free ports on 127.0.0.1")


def count(forward) -> tuple[int, int]:
    """(exchanges, bytes) that one call of `forward` puts into its graph (one decode step
    through the model: the exchanges per token)."""
    stats.reset()
    forward()
    return stats.exchanges, stats.bytes


def line(parallel: str, group, exchanges: int, nbytes: int) -> str:
    return (f"Distributed: --parallel {parallel} over {group.size()} ranks, {exchanges} exchanges "
            f"per token ({nbytes / max(exchanges, 1) / 1024:.1f} KiB each)")
