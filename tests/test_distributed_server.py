"""`python -m dsv4.server --parallel expert|pipeline` on 2 ranks (started as mlx.launch starts them,
ring on loopback): rank 0 serves HTTP, rank 1 repeats its engine calls (dsv4/serve/followed.py;
a pipeline's last rank sends rank 0 the logits); a chat/completions request is answered as one
process answers it, and Ctrl-C on rank 0 ends both ranks with status 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsv4.distributed.ranks import free_ports
from tests.test_distributed_failures import _hostfile

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 10,
           "temperature": 0}


def _server(tiny_dir, port: int, rank: int = 0, hostfile: Path = None, mode: str = "expert",
            **env) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dsv4.server", "--model", str(tiny_dir), "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), **env}
    if hostfile is not None:
        cmd += ["--parallel", mode]
        env.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _answer(port: int, proc: subprocess.Popen, text: str = "Hello there", timeout: float = 120) -> str:
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.5)
    body = {**REQUEST, "messages": [{"role": "user", "content": text}]}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


@pytest.mark.parametrize("mode", ["expert", "pipeline"])
def test_server_under_two_ranks_answers_as_one_process(tiny_dir, tmp_path, mode):
    hostfile, _ = _hostfile(tmp_path, 2)
    ports = [free_ports(1) for _ in range(2)]
    one = _server(tiny_dir, ports[0])
    ranks = [_server(tiny_dir, ports[1], r, hostfile, mode) for r in range(2)]
    try:
        want = _answer(ports[0], one)
        got = _answer(ports[1], ranks[0])
        assert want and got == want
        # Two requests at once: the scheduler decodes them together once both are admitted.
        texts = ["Tell me a story", "What is two and two"]
        want = [_answer(ports[0], one, t) for t in texts]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda t: _answer(ports[1], ranks[0], t), texts))
        assert got == want
        for proc in (one, ranks[0]):
            proc.send_signal(signal.SIGINT)
        for proc in [one] + ranks:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0 and "Traceback" not in err and "error" not in err, err[-2000:]
    finally:
        for proc in [one] + ranks:
            if proc.poll() is None:
                proc.kill()



def test_a_lost_peer_stops_the_server_in_one_line(tiny_dir, tmp_path):
    """Rank 1 killed between requests: rank 0's next request fails (503 or no answer) and rank 0
    stops by itself with one `error:` line naming the peer, status 2: the ring's error where it
    reports one, else DSV4_ANSWER_TIMEOUT's watchdog (MLX's ring, having noticed the lost peer
    while idle, waits forever at the next exchange)."""
    hostfile, _ = _hostfile(tmp_path, 2)
    port = free_ports(1)
    ranks = [_server(tiny_dir, port, r, hostfile, DSV4_ANSWER_TIMEOUT="5") for r in range(2)]
    try:
        assert _answer(port, ranks[0])
        ranks[1].kill()
        ranks[1].wait(timeout=30)
        with pytest.raises(OSError):   # the connection closes unanswered
            _answer(port, ranks[0], "Are you there", timeout=60)
        _, err = ranks[0].communicate(timeout=90)
        assert ranks[0].returncode == 2, err[-2000:]
        last = err.strip().splitlines()[-1]
        # Either the ring reports the lost peer at rank 0's next exchange, or (having noticed it
        # while idle) it waits forever and the watchdog gives up after 5 s.
        assert last.startswith("error: rank 0 of 2") and "lost the link to the other ranks" in last, err[-2000:]
        assert ("rank 1 (127.0.0.1:" in last and "stopped or became unreachable" in last
                or "did not answer within 5 s" in last), last
        assert "Traceback" not in err, err[-2000:]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
