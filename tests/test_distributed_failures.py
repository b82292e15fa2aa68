"""A --parallel run whose link fails: a peer that never connects, a rank that dies mid-generation.
Each rank is started here as mlx.launch starts it (MLX_RANK and a ring MLX_HOSTFILE on free
loopback ports), so each rank's own exit status and stderr are read: mlx.launch merges them and
exits 0 when a rank fails. Every surviving rank must stop with one `error:` line naming itself
and the peer, exit 2, within a bounded time, and no traceback.

Run as a script, this file is dsv4.generate with one rank made to die after some tokens (as a
killed process: os._exit, no cleanup)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4.distributed.ranks import free_ports


def _start(tiny_dir, rank: int, hostfile: Path, parallel: str, die: str = "", **env) -> subprocess.Popen:
    argv = ["--model", str(tiny_dir), "--parallel", parallel, "--max-tokens", "24", "--prompt", "hello"]
    cmd = [sys.executable, __file__, die] + argv if die else [sys.executable, "-m", "dsv4.generate"] + argv
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={
        **os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "MLX_RANK": str(rank),
        "MLX_HOSTFILE": str(hostfile), **env})


def _hostfile(tmp_path, ranks: int) -> tuple[Path, list[str]]:
    first = free_ports(ranks)
    hosts = [f"127.0.0.1:{first + r}" for r in range(ranks)]
    path = tmp_path / f"hosts-{first}.json"
    path.write_text(json.dumps([[h] for h in hosts]))
    return path, hosts


def _error(stderr: str) -> list[str]:
    """Python's lines on stderr (MLX's own '[ring] ...' lines set apart)."""
    return [l for l in stderr.splitlines() if l.strip() and not l.startswith("[ring]")]


def test_a_peer_that_never_connects(tiny_dir, tmp_path):
    """Rank 0 alone waits in MLX's accept (forever without DSV4_JOIN_TIMEOUT); rank 1 alone
    gives up after MLX's own connect attempts (~31 s). Both started at once."""
    alone0, hosts0 = _hostfile(tmp_path, 2)
    alone1, hosts1 = _hostfile(tmp_path, 2)
    start = time.monotonic()
    procs = [_start(tiny_dir, 0, alone0, "expert", DSV4_JOIN_TIMEOUT="3"),
             _start(tiny_dir, 1, alone1, "expert", DSV4_JOIN_TIMEOUT="3")]
    outs = [p.communicate(timeout=90) for p in procs]
    assert time.monotonic() - start < 80
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2, err
        assert "Traceback" not in err
        assert len(_error(err)) == 1 and _error(err)[0].startswith("error: "), err
    assert _error(outs[0][1])[0] == (
        f"error: rank 0 of 2 ({hosts0[0]}): rank 1 ({hosts0[1]}) did not connect within 3 s "
        f"(DSV4_JOIN_TIMEOUT); start every rank (mlx.launch) and check the hostfile's addresses")
    assert _error(outs[1][1])[0].startswith(
        f"error: rank 1 of 2 ({hosts1[1]}): could not connect to rank 0 ({hosts1[0]}) ([ring] Couldn't connect")


@pytest.mark.parametrize("parallel,dies", [("expert", 1), ("pipeline", 0)])
def test_a_rank_that_dies_mid_generation(tiny_dir, tmp_path, parallel, dies):
    hostfile, hosts = _hostfile(tmp_path, 2)
    procs = [_start(tiny_dir, r, hostfile, parallel, die=f"{dies}:4") for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert procs[dies].returncode == 17     # the hook's exit, after 4 tokens
    survivor = 1 - dies
    err = outs[survivor][1]
    assert procs[survivor].returncode == 2, err
    assert "Traceback" not in err and len(_error(err)) == 1, err
    assert _error(err)[0] == (
        f"error: rank {survivor} of 2 ({hosts[survivor]}): lost the link to the other ranks "
        f"([ring] connection to a peer was lost): rank {dies} ({hosts[dies]}) stopped or became unreachable")
    if survivor == 0:   # rank 0 printed the tokens it had before the peer went
        assert outs[0][0].strip()


if __name__ == "__main__":
    from dsv4 import generation

    rank, after = map(int, sys.argv.pop(1).split(":"))
    decode = generation.stream_generate

    def dying(*args, **kwargs):
        for n, response in enumerate(decode(*args, **kwargs)):
            if n == after and int(os.environ["MLX_RANK"]) == rank:
                os._exit(17)
            yield response

    generation.stream_generate = dying
    generation.main(sys.argv[1:])
