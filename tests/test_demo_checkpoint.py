"""The bundled demo checkpoint (dsv4/demo/, made by training/train_demo.py) is the default
model and has learned English: on a text it never saw, its loss is far below that of
the same architecture with dsv4.testing's random weights."""

import json
import math
import shutil

import numpy as np
import pytest

import dsv4
from dsv4 import engram_store
from dsv4.config import ModelArgs
from dsv4.loader import DEMO_DIR
from dsv4.testing import official_tensors, write_sharded

# Written for this test: not in the training corpus (CPython's pydoc topics).
HELD_OUT_TEXT = (
    "A list is a mutable sequence of objects. You can add an item to the end of a list "
    "with the append method, and remove the last item again with the pop method. When a "
    "function is called, the arguments are evaluated from left to right and bound to the "
    "names of its parameters, and the value of the return statement is the result of the call.")

# The trained model must predict the text at least this many times better (perplexity
# ratio) than the random model does.
MIN_PERPLEXITY_RATIO = 8.0

pytestmark = pytest.mark.skipif(not (DEMO_DIR / "config.json").is_file(),
                                reason="the demo checkpoint is not bundled")


def held_out_loss(model, tokenizer) -> float:
    """Mean next-token cross-entropy (nats) of HELD_OUT_TEXT, log-softmax in float64 numpy."""
    ids = tokenizer.encode(HELD_OUT_TEXT, add_special_tokens=True)
    logits = np.array(model(np.array([ids[:-1]], np.int64))[0], np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return float(np.mean(log_z - logits[np.arange(len(ids) - 1), ids[1:]]))


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
