"""The bundled demo checkpoint (dsv4/demo/, made by training/train_demo.py) is the default
model and has learned English: on a text it never saw, its loss is far below that of
the same architecture with dsv4.testing's random weights. And the training script's
export writes the trained float values in the official storage formats (checked against
decoders written here from the formats' definitions)."""

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from mlx.utils import tree_flatten

import dsv4
import dsv4.tokenizer
from benchmarks.exactness import HELD_OUT_TEXT, mean_cross_entropy
from dsv4 import engram_store
from dsv4.config import ModelArgs
from dsv4.loader import DEMO_DIR
from dsv4.safetensors_file import Checkpoint, view
from dsv4.testing import official_tensors, write_sharded
from tests.formats import e2m1_packed_value, e4m3_value, e8m0_scale

# The trained model must predict the text at least this many times better (perplexity
# ratio) than the random model does.
MIN_PERPLEXITY_RATIO = 8.0

pytestmark = pytest.mark.skipif(not (DEMO_DIR / "config.json").is_file(),
                                reason="the demo checkpoint is not bundled")


def held_out_loss(model, tokenizer) -> float:
    """Mean next-token cross-entropy (nats) of HELD_OUT_TEXT."""
    ids = tokenizer.encode(HELD_OUT_TEXT, add_special_tokens=True)
    return mean_cross_entropy(model(np.array([ids[:-1]], np.int64))[0], ids[1:])


@pytest.fixture(scope="module")
def demo():
    return dsv4.load()  # no path: the bundled default


def test_demo_is_far_better_than_the_random_model(demo, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / name, tmp_path / name)
    args = ModelArgs.from_dict(json.loads((DEMO_DIR / "config.json").read_text()))
    write_sharded(tmp_path, official_tensors(args, seed=0), shards=3)
    random_loss = held_out_loss(*dsv4.load(tmp_path))
    demo_loss = held_out_loss(*demo)
    assert random_loss > math.log(args.vocab_size) - 1.0  # random weights really know nothing
    assert demo_loss < random_loss - math.log(MIN_PERPLEXITY_RATIO), (demo_loss, random_loss)


def test_demo_reads_its_engram_tables_from_its_shards(demo):
    model, _ = demo
    config = json.loads((DEMO_DIR / "config.json").read_text())["text_config"]
    assert sorted(model._engram_tables) == config["engram_layer_ids"]
    for layer, rows in zip(config["engram_layer_ids"], config["engram_num_embeddings"]):
        table = model._engram_tables[layer]
        assert isinstance(table, engram_store.SplitTable)
        assert table.rows == rows


def test_demo_is_small():
    total = sum(f.stat().st_size for f in DEMO_DIR.rglob("*") if f.is_file())
    assert total < 8 * 2**20, f"the bundled demo is {total / 2**20:.1f} MiB"


# --- the training script's export: trained float values -> official storage -------------------

def _train_demo_module():
    spec = importlib.util.spec_from_file_location(
        "train_demo", Path(__file__).resolve().parents[1] / "training" / "train_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_export_stores_the_trained_values(tmp_path):
    train_demo = _train_demo_module()
    tokenizer = dsv4.tokenizer.Tokenizer(DEMO_DIR).backend
    config = json.loads((DEMO_DIR / "config.json").read_text())
    args = ModelArgs.from_dict(config)
    trainee = train_demo.Trainee(args, tokenizer, seed=1)
    train_demo.write_checkpoint(tmp_path / "m", train_demo.official_storage(trainee, args),
                                config, tokenizer)
    dsv4.load(tmp_path / "m")  # every tensor present, with the official dtypes and shapes
    stored = Checkpoint(tmp_path / "m", "model*.safetensors")
    params = {n: np.array(v, np.float64) for n, v in tree_flatten(trainee.model.parameters())}
    e4m3_step = 2.0 ** -4  # 3 mantissa bits: rounding error <= |x| / 16 (normals)
    for name, info in stored.tensors.items():
        if name.endswith(".scale") or ".engram.embed." in name or name.endswith("bias_vl"):
            continue
        data = view(info)
        expert = re.match(r"(.*\.experts)\.(\d+)\.(w\d)\.weight$", name)
        if expert:
            base, e, w = expert.groups()
            want = params[f"{base}.{w}.weight"][int(e)]
            scale = np.repeat(e8m0_scale(view(stored[name.replace(".weight", ".scale")])), 32, axis=-1)
            got = e2m1_packed_value(data) * scale
            # e2m1 steps are 0.5 up to 2, 1 up to 4, 2 up to 6 (in units of the scale)
            bound = np.maximum(0.25, np.abs(want) / scale / 4) * scale
        elif info.dtype == "F8_E4M3":
            want = params[name]
            blocks = e8m0_scale(view(stored[name.replace(".weight", ".scale")]))
            scale = np.repeat(np.repeat(blocks, 32, 0), 32, 1)[:want.shape[0]]
            got = e4m3_value(data) * scale
            bound = e4m3_step * np.abs(want) + 2.0 ** -10 * scale  # subnormal step 2**-9
        elif info.dtype == "BF16":
            want = params[name]
            got = (data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            bound = 2.0 ** -8 * np.abs(want)
        else:
            want, got, bound = params[name], data.astype(np.float64), 0.0
        assert np.all(np.abs(got - want) <= bound * (1 + 1e-6)), name
    for layer in args.engram_layer_ids:
        want = np.array(trainee.tables[str(layer)], np.float64)
        codes = view(stored[f"layers.{layer}.engram.embed.weight"])
        scale = np.repeat(e8m0_scale(view(stored[f"layers.{layer}.engram.embed.scale"])), 32, axis=-1)
        got = e4m3_value(codes) * scale
        assert np.all(np.abs(got - want) <= e4m3_step * np.abs(want) + 2.0 ** -10 * scale), layer
