"""`python -m dsv4.chat --parallel` under mlx.launch (2 ranks, ring on loopback): rank 0 reads
the piped chat and the other rank follows (dsv4/distributed/follow.py); the answers are one
process's, /quit ends every rank (mlx.launch returns), /save is refused under --parallel."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from dsv4.distributed.ranks import free_ports

TALK = "hello\nhow are you\n/reset\nhi there\n"


def _chat(tiny_dir, talk: str, tmp_path: Path, parallel: str = "") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dsv4.chat", "--model", str(tiny_dir), "--max-tokens", "12"]
    if parallel:
        cmd = [str(Path(sys.executable).with_name("mlx.launch")), "-n", "2", "--backend", "ring",
               "--starting-port", str(free_ports(2)), "--"] + cmd + ["--parallel", parallel]
    (tmp_path / f"talk{parallel}").write_text(talk)
    with open(tmp_path / f"talk{parallel}") as stdin:
        return subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}, cwd=tmp_path)


def _answers(stdout: str) -> str:
    """The chat without the rates and memory of its turn lines (they are timings)."""
    return re.sub(r" at [\d.]+ tok/s|; peak memory .*\]", "", stdout)


def test_chat_under_two_ranks_answers_as_one_process(tiny_dir, tmp_path):
    procs = {"single": _chat(tiny_dir, TALK, tmp_path),
             "expert": _chat(tiny_dir, TALK + "/save x\n/quit\n", tmp_path, parallel="expert"),
             "pipeline": _chat(tiny_dir, TALK + "/quit\n", tmp_path, parallel="pipeline")}
    outs = {name: p.communicate(timeout=300) for name, p in procs.items()}
    one = _answers(outs["single"][0])
    assert one.count("12 generated") == 3          # three answers, of 12 tokens each
    for name in ("expert", "pipeline"):
        out, err = outs[name]
        assert "error" not in err and "Traceback" not in err, err[-2000:]
        got = _answers(out)
        if name == "expert":
            assert "[/save is not available under --parallel" in got
            got = got.replace(">> [/save is not available under --parallel: each rank holds only its share of the cache]\n", "")
        assert got.rstrip() == one.rstrip(), (name, got, one)
