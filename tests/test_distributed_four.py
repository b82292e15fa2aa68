"""4 ranks on this machine (mlx.launch, ring backend on loopback) in every mode against one
process: teacher-forced fp32 logits with the roundings off (prefill and decode), 16 greedy
tokens identical, and each rank holding about a quarter of what its mode splits. One launch runs
every mode in turn (tests/distributed_ranks.py is the worker). The tiny model has 4 output
groups and 128 intermediate columns here, so tensor mode's quarters fall on whole fp4/fp8
blocks (32 columns) and whole groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv4.distributed.ranks import free_ports
from dsv4.testing import write_tiny_checkpoint

WORKER = Path(__file__).with_name("distributed_ranks.py")
MODES = ("expert", "tensor", "pipeline")
RANKS = 4
GREEDY = 16


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("four")
    model = write_tiny_checkpoint(root / "ckpt", seed=3,
                                  config_overrides={"o_groups": 4, "moe_intermediate_size": 128})
    out = root / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    worker = [sys.executable, str(WORKER), str(out), "--greedy", str(GREEDY)]
    subprocess.run(worker + ["--run", f"four={model}="], check=True, env=env, timeout=120)
    launch = Path(sys.executable).with_name("mlx.launch")
    done = subprocess.run([str(launch), "-n", str(RANKS), "--backend", "ring", "--starting-port",
                           str(free_ports(RANKS)), "--"] + worker + ["--run", f"four={model}={','.join(MODES)}"],
                          env=env, timeout=400, capture_output=True, text=True)
    # mlx.launch exits 0 even when a rank fails: each rank's own files say it finished.
    results = {}
    for mode in ("single",) + MODES:
        results[mode] = []
        for r in range(1 if mode == "single" else RANKS):
            name = out / f"four.{mode}.rank{r}"
            report = Path(f"{name}.json")
            assert report.is_file(), f"rank {r} of {mode} failed:\n{done.stderr[-3000:]}"
            results[mode].append((np.load(f"{name}.npy"), json.loads(report.read_text())))
    return results


@pytest.mark.parametrize("mode", MODES)
def test_logits_equal_one_process(runs, mode):
    one = runs["single"][0][0]
    ranks = runs[mode]
    if mode == "pipeline":   # only the last stage has logits; the same ops on the same inputs
        np.testing.assert_array_equal(ranks[-1][0], one)
        return
    for logits, _ in ranks:
        if mode == "expert":   # each slot whole from one rank, summed in one process's order
            np.testing.assert_array_equal(logits, one)
        else:   # partial sums over 4 ranks: fp32 reordering; a lost share moves them by O(1)
            np.testing.assert_allclose(logits, one, rtol=0, atol=1e-5 * np.abs(one).max())


@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_identical(runs, mode):
    tokens = runs["single"][0][1]["tokens"]
    assert len(tokens) == GREEDY
    for r, (_, report) in enumerate(runs[mode]):
        assert report["tokens"] == tokens, f"rank {r}"


@pytest.mark.parametrize("mode", MODES)
def test_each_rank_holds_a_quarter_of_what_is_split(runs, mode):
    whole = runs["single"][0][1]["resident_bytes"]
    held = [report["resident_bytes"] for _, report in runs[mode]]
    if mode == "pipeline":   # every byte on exactly one stage, a replayed compressor/indexer aside
        assert whole <= sum(held) <= 1.15 * whole
        assert max(held) < 0.5 * whole
        return
    # Per tensor (the load logs: name -> axis, start, stop, bytes kept): what not every rank
    # holds whole is split, and each rank keeps exactly a quarter of those bytes.
    logs = [report["tensors"] for _, report in runs[mode]]
    whole_everywhere = {n for n in logs[0] if all(n in log and log[n][0] is None for log in logs)}
    kept = [sum(b for n, (_, _, _, b) in log.items() if n not in whole_everywhere) for log in logs]
    replicated = sum(logs[0][n][3] for n in whole_everywhere)
    assert kept == [sum(kept) // RANKS] * RANKS, kept
    assert sum(kept) > 0.25 * (sum(kept) + replicated)   # a real part of the model (tiny: 29-43%)
    assert all(h < whole for h in held)
