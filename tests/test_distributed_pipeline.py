"""Pipeline-parallel dsv4 (dsv4/distributed/pipeline.py) on 2 and 3 ranks of mlx.launch (ring
backend on loopback) against one process: teacher-forced logits (fp32, roundings off, a
prefill chunk, decode steps, a trim and steps again) bit for bit, greedy tokens of prefill +
32 decode steps identical on every rank, each rank loaded only its stage's tensors; the
split by bytes and what each stage replays, worked by hand on the tiny config.

Run as a script, this file is one rank's worker (mlx.launch starts it); it writes its
results to OUT/<name>.rank<r>.npz only once it finished (mlx.launch exits 0 when a rank
fails, so the test checks every rank's file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64]          # 9: a ratio-2 group left open
STEPS = [128, 31, 200, 77, 12, 301]
AGAIN = [9, 400, 33, 81]                             # after trimming the last 3
GREEDY = 32


def worker(model_dir: str, out: str, runs: str, parallel: bool) -> None:
    """`runs`: name:memory:fixed;... - each loaded and run in turn in this one launch, with
    DSV4_PIPELINE_MEMORY=memory and DSV4_FIXED_DECODE=fixed."""
    from dsv4 import distributed, flags

    group = distributed.init("ring") if parallel else None
    for run in runs.split(";"):
        name, memory, fixed = run.split(":")
        with flags.override(act_quant=False, kv_qdq=False, pipeline_memory=memory, fixed_decode=fixed):
            results = one_run(model_dir, group)
        rank = 0 if group is None else group.rank()
        np.save(Path(out) / f"{name}.rank{rank}.npy", results.pop("forward"))
        np.save(Path(out) / f"{name}.rank{rank}.step.npy", results.pop("step"))
        (Path(out) / f"{name}.rank{rank}.json").write_text(json.dumps(results))


def one_run(model_dir: str, group) -> dict:
    import mlx.core as mx

    import dsv4
    from dsv4 import distributed
    from dsv4.generation import stream_generate
    from dsv4.step import decoder

    model, tokenizer = dsv4.load(model_dir, dtype=mx.float32, group=group,
                                 parallel="pipeline" if group is not None else None)
    cache = model.make_cache()
    logits = [model(np.array([PROMPT]), cache)[0]]
    mx.eval(logits)
    distributed.stats.reset()
    for t in STEPS:
        logits.append(model(np.array([[t]]), cache)[0])
        mx.eval(logits)
    per_step = distributed.stats.exchanges / len(STEPS)
    cache.trim(3)
    for t in AGAIN:
        logits.append(model(np.array([[t]]), cache)[0])
        mx.eval(logits)
    # the decoder the switches pick (DSV4_FIXED_DECODE: the fixed-shape step), teacher forced
    cache = model.make_cache()
    model(np.array([PROMPT]), cache)
    step = decoder(model, cache)
    stepped = []
    for t in STEPS:   # each step evaluated before the next is built, as generation does
        stepped.append(step(mx.array([t])))
        mx.async_eval(stepped[-1])
    stepped = np.array(mx.stack(stepped))
    step.close(len(PROMPT) + len(STEPS))
    tokens = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=GREEDY, ignore_eos=True)]
    stage = getattr(getattr(model, "plan", None), "stage", None)
    return {"forward": np.array(mx.concatenate(logits)), "step": stepped,
            "tokens": tokens, "exchanges_per_step": per_step,
            "loaded": sorted(model.load_log.tensors) if group is not None else [],
            "layers": [] if stage is None else list(stage.layers),
            "compress": [] if stage is None else sorted(stage.compress),
            "select": [] if stage is None else sorted(stage.select),
            "last": stage is None or stage.rank == group.size() - 1}


# --- the tests ---------------------------------------------------------------------------------

def _env(**extra):
    return {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), **extra}


def _launch(tiny_dir, out: Path, runs: dict, ranks: int) -> dict:
    """{name: (memory, fixed)} run in turn by one launch of `ranks` ranks -> {name: per rank}."""
    launch = Path(sys.executable).with_name("mlx.launch")
    from dsv4.distributed.ranks import free_ports

    spec = ";".join(f"{name}:{memory}:{fixed}" for name, (memory, fixed) in runs.items())
    argv = [sys.executable, __file__, str(tiny_dir), str(out), spec]
    if ranks > 1:
        argv = [str(launch), "-n", str(ranks), "--backend", "ring", "--starting-port",
                str(free_ports(ranks)), "--"] + argv + ["pipeline"]
    else:
        argv += [""]
    done = subprocess.run(argv, env=_env(), timeout=300, capture_output=True, text=True)
    results = {}
    for name in runs:
        results[name] = []
        for r in range(ranks):
            file = out / f"{name}.rank{r}.json"
            assert file.is_file(), f"rank {r} of {name} failed:\n{done.stderr[-3000:]}"
            results[name].append((_logits(out, name, r), json.loads(file.read_text())))
    return results


def _logits(out: Path, name: str, rank: int) -> dict:
    return {"forward": np.load(out / f"{name}.rank{rank}.npy"), "step": np.load(out / f"{name}.rank{rank}.step.npy")}


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory):
    """One process's results (decoding on the reference path, and with the fixed-shape step),
    and those of four pipelines: 2 ranks of equal memory, 2 ranks of memory 3:1 (the cut moves
    into the ratio-1 layers: replays the candidate source), the same with the fixed-shape step,
    3 ranks. Three processes or launches in all (each loads a model per run)."""
    out = tmp_path_factory.mktemp("pipeline")
    one = {name: ranks[0] for name, ranks in _launch(
        tiny_dir, out, {"single": ("", "off"), "single_fixed": ("", "on")}, 1).items()}
    two = _launch(tiny_dir, out, {"2 even": ("", "off"), "2 at 3,1": ("3,1", "off"),
                                  "2 at 3,1 fixed step": ("3,1", "on")}, 2)
    return one, {**two, **_launch(tiny_dir, out, {"3 even": ("", "off")}, 3)}


CASES = ("2 even", "2 at 3,1", "2 at 3,1 fixed step", "3 even")


def _single(runs, case):
    return runs[0]["single_fixed" if "fixed" in case else "single"]


@pytest.mark.parametrize("case", CASES)
def test_logits_bit_identical(runs, case):
    one, _ = _single(runs, case)
    last = [logits for logits, report in runs[1][case] if report["last"]]
    assert len(last) == 1
    # The same ops on the same inputs, only on different ranks: exact, not within a bound;
    # a forward's chunks, and the steps of the decoder the switches pick.
    np.testing.assert_array_equal(last[0]["forward"], one["forward"])
    np.testing.assert_array_equal(last[0]["step"], one["step"])


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_identical_on_every_rank(runs, case):
    _, single = _single(runs, case)
    assert len(single["tokens"]) == GREEDY
    for _, report in runs[1][case]:
        assert report["tokens"] == single["tokens"]


@pytest.mark.parametrize("case", CASES)
def test_stages_cover_the_layers_and_replay_what_they_read(runs, tiny_dir, case):
    from dsv4.config import ModelArgs, read_json
    from dsv4.distributed import pipeline

    args = ModelArgs.from_dict(read_json(tiny_dir / "config.json"))
    reports = [report for _, report in runs[1][case]]
    layers = [l for report in reports for l in report["layers"]]
    assert layers == list(range(args.num_hidden_layers))
    for report in reports:
        compress, select = pipeline.replays(args, range(report["layers"][0], report["layers"][-1] + 1))
        assert (report["compress"], report["select"]) == (sorted(compress), sorted(select))
    # A teacher-forced step: one exchange at each stage boundary the rank touches (generation
    # adds the token's pass round the ring; the greedy test's agreement shows it).
    for r, report in enumerate(reports):
        assert report["exchanges_per_step"] == (r > 0) + (r < len(reports) - 1)


@pytest.mark.parametrize("case", CASES)
def test_each_rank_loaded_only_its_stage(runs, tiny_dir, case):
    from dsv4 import layout
    from dsv4.config import ModelArgs, read_json
    from dsv4.distributed.pipeline import layer_of
    from dsv4.safetensors_file import Checkpoint

    args = ModelArgs.from_dict(read_json(tiny_dir / "config.json"))
    read = {s.name for it in layout.plan(Checkpoint(tiny_dir, "model*.safetensors"), args) for s in it.sources}
    reports = [report for _, report in runs[1][case]]
    for r, report in enumerate(reports):
        mine = set(report["layers"])
        replayed = set(report["compress"]) | set(report["select"])
        loaded = set(report["loaded"])
        assert {n for n in read if layer_of(n) in mine} <= loaded     # the whole stage
        for name in loaded:
            layer = layer_of(name)
            if layer is None:     # the embedding with the first stage, norm and head with the last
                last = r == len(reports) - 1
                assert (name.startswith("embed.") and r == 0) or (name.startswith(("head.", "norm.")) and last), name
            elif layer not in mine:   # and of another stage's layers, only what it replays
                assert layer in replayed and (".attn.compressor." in name or ".attn.indexer." in name), name


def test_split_by_bytes_is_the_best_contiguous_split():
    from dsv4.distributed.pipeline import split_layers

    # by hand: 1+1 | 4 | 1+1+1 is the least largest share (4) of 3 ranks of equal memory
    assert split_layers([1, 1, 4, 1, 1, 1], 0, 0, [1, 1, 1]) == [range(0, 2), range(2, 3), range(3, 6)]
    # the embedding's 3 go with the first rank, the head's 3 with the last
    assert split_layers([2, 2, 2, 2], 3, 3, [1, 1]) == [range(0, 2), range(2, 4)]
    assert split_layers([2, 2, 2, 2], 3, 0, [1, 1]) == [range(0, 1), range(1, 4)]
    # a rank of three times the memory takes three times the bytes
    assert split_layers([1] * 8, 0, 0, [3, 1]) == [range(0, 6), range(6, 8)]


def test_replays_by_hand():
    """Tiny config roles: 2 kv+index source (ratio 2), 3 reuses 2; 4 kv+index+candidate source
    (ratio 1), 5 reuses 4, 6 re-indexes inside 4's mask, 7 reuses 6."""
    from dsv4.config import ModelArgs
    from dsv4.distributed.pipeline import replays
    from dsv4.testing import tiny_config

    args = ModelArgs.from_dict(tiny_config())
    assert replays(args, range(0, 8)) == (frozenset(), frozenset())
    assert replays(args, range(4, 8)) == (frozenset(), frozenset())       # a clean cut
    assert replays(args, range(3, 8)) == ({2}, {2})                       # 3 reads 2's rows and top-k
    assert replays(args, range(5, 8)) == ({4}, {4})                       # 5 reads 4's, 6 its mask
    assert replays(args, range(6, 8)) == ({4}, {4})                       # 6: 4's keys and mask
    assert replays(args, range(7, 8)) == ({4}, {4, 6})                    # 7: 6's top-k, which needs 4's


def test_memory_sizes_are_checked():
    from dsv4.distributed import ParallelError
    from dsv4.distributed.pipeline import capacities

    class Two:
        size = lambda self: 2

    assert capacities(Two(), "") == [1.0, 1.0]
    assert capacities(Two(), "512,256") == [512.0, 256.0]
    for bad in ("512", "512,0", "a,b", "1,2,3"):
        with pytest.raises(ParallelError, match="DSV4_PIPELINE_MEMORY"):
            capacities(Two(), bad)


def test_combined_with_another_mode_is_refused(tiny_dir):
    done = subprocess.run([sys.executable, "-c", (
        "import dsv4, sys\nfrom dsv4.errors import reported\n"
        "class G:\n    rank = lambda self: 0\n    size = lambda self: 2\n"
        f"with reported():\n    dsv4.load({str(tiny_dir)!r}, group=G(), parallel='pipeline+expert')")],
        env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "pipeline+expert" in done.stderr and "Traceback" not in done.stderr


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "pipeline")
