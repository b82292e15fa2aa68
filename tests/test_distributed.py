"""Expert- and tensor-parallel dsv4 on 2 ranks (mlx.launch, ring backend on loopback) against
one process: teacher-forced fp32 logits with the roundings off, prefill and decode; what each
rank loaded against its plan; the errors of bad modes and of splits that cut a block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv4 import distributed, layout
from dsv4.distributed import planning
from dsv4.config import ModelArgs, read_json
from dsv4.distributed import ranks, reading
from dsv4.distributed.sharding import Place, Sharding
from dsv4.safetensors_file import Checkpoint

WORKER = Path(__file__).with_name("distributed_ranks.py")
MODES = ("expert", "tensor", "expert+tensor")
FORWARDS = 5          # the worker's 8-token prefill, then 4 decode steps


# What each checkpoint runs on 2 ranks: the official layout (fp8/fp4 with block scales) in every
# mode; converted to a dsv4 directory (stacked mxfp4 experts, mxfp8 codes + per-32 scales); a
# converted ds4 GGUF (Q2_K / IQ2_XXS expert blocks of 256: its 64 columns do not split, so no
# tensor mode; Q8_0 elsewhere).
RUNS = {"official": MODES + ("expert@bf16",), "converted": MODES, "gguf": ("expert", "expert+tensor")}


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    from convert import gguf, official
    from tests.gguf_fixtures import write_ds4_gguf

    root = tmp_path_factory.mktemp("parallel-models")
    official.convert(tiny_dir, root / "converted", progress=False, log=lambda *a, **k: None)
    write_ds4_gguf(root / "q2.gguf", "q2", seed=1)
    gguf.convert(root / "q2.gguf", root / "gguf", progress=False)
    return {"official": tiny_dir, "converted": root / "converted", "gguf": root / "gguf"}


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """Every checkpoint's modes from one 2-rank launch, and one process's."""
    out = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    spec = lambda modes: [a for label, d in models.items() for a in ("--run", f"{label}={d}={modes(label)}")]
    subprocess.run([sys.executable, str(WORKER), str(out)] + spec(lambda label: ",@bf16"),
                   check=True, env=env, timeout=120)
    launch = Path(sys.executable).with_name("mlx.launch")
    done = subprocess.run([str(launch), "-n", "2", "--backend", "ring", "--starting-port",
                           str(ranks.free_ports(2)), "--", sys.executable, str(WORKER), str(out)]
                          + spec(lambda label: ",".join(RUNS[label])),
                          env=env, timeout=300, capture_output=True, text=True)
    # mlx.launch exits 0 even when a rank fails: each rank's own files say it finished.
    for label, modes in RUNS.items():
        for mode in modes:
            for r in range(2):
                assert (out / f"{label}.{mode}.rank{r}.json").is_file(), \
                    f"rank {r} of {label} {mode} failed:\n{done.stderr[-3000:]}"
    return out


def result(out: Path, mode: str, rank: int = 0, label: str = "official"):
    name = f"{label}.{mode}.rank{rank}"
    return np.load(out / f"{name}.npy"), json.loads((out / f"{name}.json").read_text())


@pytest.mark.parametrize("label,mode", [(label, m) for label, modes in RUNS.items() for m in modes if "@" not in m])
def test_logits_equal_one_process(runs, label, mode):
    one, _ = result(runs, "single", label=label)
    for r in range(2):
        logits, _ = result(runs, mode, r, label)
        if mode == "expert":
            # Each slot's output comes whole from one rank and is summed in one process's order.
            np.testing.assert_array_equal(logits, one)
        else:
            # Partial sums of split products added across ranks: fp32 reordering, ~1e-6 of the
            # logits measured; a lost or doubled share moves them by O(1).
            np.testing.assert_allclose(logits, one, rtol=0, atol=1e-5 * np.abs(one).max())
    np.testing.assert_array_equal(result(runs, mode, 0, label)[0], result(runs, mode, 1, label)[0])


def test_expert_parallel_is_bit_identical_as_stored(runs):
    """bf16 activations, the official fp8/fp4 roundings on: still one process's logits."""
    one, _ = result(runs, "single@bf16")
    for r in range(2):
        np.testing.assert_array_equal(result(runs, "expert@bf16", r)[0], one)


@pytest.mark.parametrize("mode,per_layer", [("expert", 1), ("tensor", 2), ("expert+tensor", 2)])
def test_exchanges_per_layer(runs, tiny_dir, mode, per_layer):
    layers = ModelArgs.from_dict(read_json(tiny_dir / "config.json")).num_hidden_layers
    _, report = result(runs, mode)
    assert report["exchanges_prefill"] == per_layer * layers
    assert report["exchanges"] == per_layer * layers * FORWARDS


@pytest.mark.parametrize("mode", MODES)
def test_each_rank_loads_its_plan_and_nothing_else(runs, tiny_dir, mode):
    config = read_json(tiny_dir / "config.json")
    args = ModelArgs.from_dict(config)
    ckpt = Checkpoint(tiny_dir, "model*.safetensors")
    logs = [result(runs, mode, r)[1]["tensors"] for r in range(2)]
    split_whole = split_kept = 0
    for r, log in enumerate(logs):
        plan = Sharding(args, config, Place(r, 2), tuple(mode.split("+")))
        for name, info in ckpt.tensors.items():
            if name not in log:   # not loaded: the plan holds none of it, or the model never needs it
                assert plan.tensor(name, info.shape) is None or layout.is_unused(name), name
                continue
            shard = plan.tensor(name, info.shape)
            assert shard is not None, f"rank {r} loaded {name}, which its plan does not hold"
            axis, start, stop, kept = log[name]
            assert (axis, start, stop) == (shard.axis, shard.start, shard.stop), name
            assert kept == np.prod(reading.shard_shape(info.shape, shard)) * info.storage.itemsize
            if shard.axis is not None or plan.tensor(name, info.shape) is None:
                split_whole += info.nbytes
                split_kept += kept
    # Official experts: one file tensor per expert, each on one rank (None on the other).
    for name, info in ckpt.tensors.items():
        held = [r for r in range(2) if name in logs[r]]
        if "experts." in name and "shared" not in name and "expert" in mode:
            assert len(held) == 1, name
        elif name in logs[0] and logs[0][name][0] is not None:   # split: the two halves tile it
            (a0, s0, e0, _), (a1, s1, e1, _) = logs[0][name], logs[1][name]
            assert a0 == a1 and s0 == 0 and e0 == s1 and e1 == info.shape[a0], name
    assert split_kept * 2 == split_whole   # each rank keeps exactly half of what is split


def test_plan_shares_are_this_ranks_part():
    from dsv4.testing import tiny_config

    args = ModelArgs.from_dict(tiny_config())
    plans = [Sharding(args, {}, Place(r, 2), ("expert", "tensor")) for r in range(2)]
    assert [p.experts(args) for p in plans] == [range(0, 4), range(4, 8)]
    assert [p.attention_groups(args) for p in plans] == [range(0, 1), range(1, 2)]
    assert [p.shared_columns(args) for p in plans] == [range(0, 32), range(32, 64)]
    assert plans[1].routed_columns(args) == range(64)   # experts by id: each one whole
    # wq_b [H*Dh, q_lora] fp8 with 32x32 block scales: rows of rank 1's heads, scales in step
    assert plans[1].tensor("layers.3.attn.wq_b.weight", (256, 32)) == distributed.Shard(0, 128, 256)
    assert plans[1].tensor("layers.3.attn.wq_b.scale", (8, 1)) == distributed.Shard(0, 4, 8)
    # wo_b [D, G*L] as mxfp8 codes (4 a uint32) and per-32 scales: columns of rank 1's group
    assert plans[1].tensor("layers.3.attn.wo_b.weight", (64, 16)) == distributed.Shard(1, 8, 16)
    assert plans[1].tensor("layers.3.attn.wo_b.scales", (64, 2)) == distributed.Shard(1, 1, 2)
    assert plans[0].tensor("layers.3.ffn.experts.5.w1.weight", (64, 32)) is None
    assert plans[1].tensor("layers.3.ffn.experts.w2.weight", (8, 64, 8)) == distributed.Shard(0, 4, 8)
    assert plans[0].tensor("layers.3.ffn.gate.weight", (8, 64)) == distributed.WHOLE
    assert plans[0].tensor("embed.weight", (512, 64)) == distributed.WHOLE


def test_a_split_that_cuts_a_block_is_refused(tmp_path):
    import dsv4
    from dsv4.testing import tiny_config, write_tiny_checkpoint

    four_groups = write_tiny_checkpoint(tmp_path / "g4", config_overrides={"o_groups": 4})
    config = read_json(four_groups / "config.json")
    plan = Sharding(ModelArgs.from_dict(config), config, Place(1, 4), ("tensor",))
    # 64 intermediate columns over 4 ranks: 16 each, inside the fp4 experts' scale blocks of 32
    with pytest.raises(distributed.ParallelError, match=r"layers\.0\.ffn\.experts\.0\.w2\.scale.*cuts a block"):
        plan.tensor("layers.0.ffn.experts.0.w2.scale", (64, 2))
    with pytest.raises(distributed.ParallelError, match="cuts a block"):
        dsv4.load(four_groups, group=Place(1, 4), parallel="tensor")
    # a GGUF module's rows hold blocks of 256 weights: half of 384 columns is no whole block
    gguf = {"quantization": {"layers.0.ffn.shared_experts.w2": {"mode": "gguf", "type": "Q4_K"}}}
    wide = ModelArgs.from_dict(tiny_config(moe_intermediate_size=384))
    with pytest.raises(distributed.ParallelError, match="blocks of 256"):
        Sharding(wide, gguf, Place(0, 2), ("tensor",)).tensor(
            "layers.0.ffn.shared_experts.w2.weight", (64, 216))
    # the tiny model's 2 output groups cannot go to 4 ranks
    with pytest.raises(distributed.ParallelError, match=r"o_groups\) \(2\) do not split evenly over 4"):
        Sharding(ModelArgs.from_dict(tiny_config()), {}, Place(0, 4), ("tensor",))


@pytest.mark.parametrize("text", ["bogus", "expert+expert", "tensor+", "Expert+pipeline+x"])
def test_bad_modes(text):
    with pytest.raises(distributed.ParallelError, match="--parallel"):
        distributed.parse_modes(text)


def test_modes_parse():
    assert distributed.parse_modes("tensor+Expert") == ("expert", "tensor")
    assert distributed.parse_modes(None) == ()
    with pytest.raises(distributed.ParallelError, match="mlx.launch"):
        planning.build(None, {}, None, "expert")


@pytest.mark.parametrize("shape,axis,start,stop", [
    ((6, 40000), 0, 2, 5), ((6, 40000), 1, 100, 30000),    # rows; long column runs (pread each)
    ((4, 300, 24), 1, 100, 200), ((4, 300, 24), 2, 8, 16),  # short runs (blocks of whole rows)
    ((5, 7), None, 0, 0)])
def test_reading_a_shard(tmp_path, shape, axis, start, stop, monkeypatch):
    monkeypatch.setattr(reading, "BLOCK_BYTES", 4096)   # several blocks even at these sizes
    rng = np.random.default_rng(0)
    data = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    blob = b"\x07" * 13 + data.tobytes() + b"\x09" * 5
    # the raw byte split of one file into three parts, cut inside the tensor
    cuts = [0, 40, len(blob) // 2 + 3, len(blob)]
    parts = []
    for i in range(3):
        (tmp_path / f"p{i}").write_bytes(blob[cuts[i]:cuts[i + 1]])
        parts.append(tmp_path / f"p{i}")
    shard = distributed.Shard(axis, start, stop)
    log = reading.Log()
    got = reading.read("t", parts, 13, np.uint16, shape, shard, log)
    want = data if axis is None else np.take(data, range(start, stop), axis=axis)
    np.testing.assert_array_equal(got, want)
    assert log.tensors["t"] == (shard, want.nbytes)
    assert reading.read("t", parts, 13, np.uint16, shape, None) is None
    with pytest.raises(distributed.ParallelError.__mro__[1], match="past the end"):
        reading.read("t", parts, 13 + 20, np.uint16, shape, distributed.WHOLE)


@pytest.mark.parametrize("value,says", [("bogus", "expected expert, tensor, pipeline"),
                                        ("expert", "single process; start one per rank with mlx.launch")])
def test_generate_parallel_errors_are_one_line(tiny_dir, value, says):
    out = subprocess.run([sys.executable, "-m", "dsv4.generate", "--model", str(tiny_dir), "--parallel", value],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith("error: --parallel") and says in out.stderr and "Traceback" not in out.stderr
