"""Loading the DSpark draft stages (dsv4/draft.py) and what their window holds; their numbers
against the official reference are in test_official_reference.py."""

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from convert.official import convert
from dsv4 import flags
from dsv4.safetensors_file import CheckpointError


def block_logits(model, prompt: np.ndarray, chunks: list[int]) -> np.ndarray:
    """The draft block's logits after feeding `prompt` [1, S] in chunks of these lengths,
    seeding the draft window after each, first row the prompt's greedy continuation."""
    draft = model.draft
    cache, dc = model.make_cache(), draft.make_cache()
    pos = 0
    for n in chunks:
        hidden = []
        logits = model(prompt[:, pos:pos + n], cache, hidden=hidden)
        draft.seed(dc, hidden, 1)
        pos += n
    x = draft.hidden(model, dc, mx.argmax(logits[:, -1], axis=-1))
    return np.array(draft.logits(model, x))


def test_draft_stages_load_only_when_asked(draft_dir):
    with flags.override(draft="off"):
        plain, _ = dsv4.load(draft_dir)
    assert plain.draft is None
    with flags.override(draft="auto"):
        model, _ = dsv4.load(draft_dir)
    args = model.args
    assert len(model.draft.mtp) == args.num_nextn_predict_layers == 3
    # The stages' own expert count and top-k, not the backbone's.
    moe = model.draft.mtp[0].ffn
    assert moe.experts.w1["weight"].shape[0] == args.dspark_n_routed_experts == 4
    assert moe.gate.routing()[0] == args.dspark_num_experts_per_tok
    assert "markov_head" in model.draft.mtp[-1] and "main_proj" in model.draft.mtp[0]


def test_a_checkpoint_without_draft_stages(tiny_dir):
    with flags.override(draft="auto"):
        model, _ = dsv4.load(tiny_dir)
    assert model.draft is None
    with flags.override(draft="on"), pytest.raises(CheckpointError, match="DSV4_DRAFT=on.*no DSpark draft stages"):
        dsv4.load(tiny_dir)


def test_converted_directory_keeps_the_draft_stages(draft_dir, tmp_path):
    """The official converter copies mtp.* as they are; the dsv4 directory's stages give the
    official directory's draft logits bit for bit. Without them (--drop-mtp) 'on' says why."""
    prompt = np.random.default_rng(0).integers(7, 500, (1, 21))
    with flags.override(draft="on"):
        want = block_logits(dsv4.load(draft_dir)[0], prompt, [21])
        convert(draft_dir, tmp_path / "out", progress=False)
        got = block_logits(dsv4.load(tmp_path / "out")[0], prompt, [21])
        np.testing.assert_array_equal(got, want)
        convert(draft_dir, tmp_path / "dropped", drop_mtp=True, progress=False)
        with pytest.raises(CheckpointError, match="no mtp.*safetensors.*--drop-mtp"):
            dsv4.load(tmp_path / "dropped")


def test_window_is_the_same_however_the_prompt_was_fed(draft_dir):
    """The window keeps the main KV of the last `sliding_window` positions whatever the chunks
    (here 8 rows; chunks shorter and longer than that, and single tokens)."""
    prompt = np.random.default_rng(1).integers(7, 500, (1, 23))
    with flags.override(draft="on"):
        model, _ = dsv4.load(draft_dir)
    once = block_logits(model, prompt, [23])
    hidden, dc = [], model.draft.make_cache()
    model(prompt, model.make_cache(), hidden=hidden)
    model.draft.seed(dc, hidden, 1)
    assert dc.end == 23 and all(rows.shape[1] == model.args.sliding_window for rows in dc.rows)
    for chunks in ([5, 11, 7], [20, 1, 1, 1], [1] * 23):
        np.testing.assert_array_equal(block_logits(model, prompt, chunks), once)
