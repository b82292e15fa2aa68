"""dsv4 against DeepSeek's own V4.1 inference code (numbers in tests/fixtures/official_reference,
made by make_fixtures.py there): the DSpark draft stages against the reference's
`forward_spec` (draft logits with the Markov bias, confidence, the greedy draft chain), the
draft stages' input (the target layers' hidden means) and the backbone's logits.

Same tiny checkpoint with draft stages in both (no Engram: the reference runner leaves it
out; index top-k and candidate blocks wide enough that no exact score tie can be broken
differently — ReLU'd index scores of a random tiny model are often exactly 0, and the
reference's top-k leaves ties to torch). Teacher forced: prefill PROMPT tokens, then one token
per decode step, the draft block after each.
"""

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import flags
from dsv4.config import ModelArgs
from dsv4.testing import official_tensors, write_tiny_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "official_reference" / "reference.npz"
SEED = 3
OVERRIDES = {"engram_layer_ids": [], "index_topk": 64, "candidate_topk_blocks": 64}
PROMPT = 13


def write_checkpoint(path) -> Path:
    return write_tiny_checkpoint(path, seed=SEED, draft=True, config_overrides=OVERRIDES)


@pytest.fixture(scope="module")
def fx():
    return np.load(FIXTURE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("oracle") / "ckpt")


def rel(out, ref) -> np.ndarray:
    """max |out - ref| / max |ref| over the last axis."""
    return np.abs(out - ref).max(-1) / np.abs(ref).max(-1)


def split(hidden: np.ndarray, parts: int, dtype) -> list:
    """[S, parts*D] -> what Model(..., hidden=[]) hands out: [S, D] per target layer."""
    return [mx.array(h).astype(dtype) for h in np.split(hidden, parts, axis=-1)]


def draft_rows(model, draft, cache, token: int, chain: np.ndarray):
    """Logits (Markov bias of `chain`'s tokens added) [block, V] and confidence [block] of the
    block after what `cache` holds, first row `token`."""
    x = draft.hidden(model, cache, mx.array([token]))
    bias, embed = draft.markov(mx.array(chain))
    return np.array(draft.logits(model, x)[0] + bias), np.array(draft.confidence(x, embed[None])[0])


def greedy_chain(model, draft, cache, token: int) -> list:
    """The draft tokens picked one after another, each by the argmax of its row's logits plus
    the Markov bias of the token before it (the reference's temperature-0 forward_head)."""
    x = draft.hidden(model, cache, mx.array([token]))
    base = draft.logits(model, x)[0]
    chain = [token]
    for row in range(draft.block_size):
        bias, _ = draft.markov(mx.array(chain[-1:]))
        chain.append(int(mx.argmax(base[row] + bias[0]).item()))
    return chain


def test_fixture_was_made_from_this_checkpoint(checkpoint, fx):
    """The tensors the fixture's numbers came from: dsv4.testing must still write them."""
    args = ModelArgs.from_dict(json.loads((checkpoint / "config.json").read_text()))
    h = hashlib.sha256()
    for name, (dtype, a) in sorted(official_tensors(args, SEED).items()):
        h.update(name.encode() + dtype.encode() + a.tobytes())
    assert str(fx["checkpoint_sha256"]) == h.hexdigest(), "regenerate the fixture (make_fixtures.py)"


def test_draft_stages_match_forward_spec_in_fp32(checkpoint, fx):
    """Roundings off, fp32: the whole path through dsv4 (backbone, hidden means, seeding,
    draft block, heads) within 1e-5 of the reference at every decode position."""
    ids = fx["ids"]
    with flags.override(draft="on", kv_qdq=False, act_quant=False, index_key_quirk=True):
        model, _ = dsv4.load(checkpoint, dtype=mx.float32)
        draft = model.draft
        cache, dc = model.make_cache(), draft.make_cache()
        hidden = []
        model(ids[None, :PROMPT], cache, hidden=hidden)
        draft.seed(dc, hidden, 1)
        for i, t in enumerate(range(PROMPT, PROMPT + fx["exact.logits"].shape[0])):
            hidden = []
            logits = np.array(model(ids[None, t:t + 1], cache, hidden=hidden)[0, -1])
            draft.seed(dc, hidden, 1)
            assert rel(logits, fx["exact.logits"][i]) < 1e-5, t
            got = np.array(mx.concatenate(hidden, axis=-1)[0])
            assert rel(got, fx["exact.hidden"][i]) < 1e-5, t
            chain = fx["exact.draft_ids"][i]
            draft_logits, confidence = draft_rows(model, draft, dc, int(ids[t + 1]), chain[:-1])
            assert rel(draft_logits, fx["exact.draft_logits"][i]).max() < 1e-5, t
            ref_conf = fx["exact.confidence"][i]
            assert np.abs(confidence - ref_conf).max() < 1e-5 * np.abs(ref_conf).max(), t
            assert greedy_chain(model, draft, dc, int(ids[t + 1])) == list(chain), t


def test_draft_stages_match_forward_spec_in_bf16_with_every_rounding(checkpoint, fx):
    """As shipped (bf16, fp8/fp4 weights, activation and KV roundings on), the draft stages
    fed the reference's own hidden means: the same arithmetic up to the order of fp32 sums,
    which now and then flips one rounding (a random tiny model amplifies it), so most rows
    agree to 1e-3 and their argmax almost always."""
    ids = fx["ids"]
    with flags.override(draft="on"):
        model, _ = dsv4.load(checkpoint)
        draft, dtype = model.draft, model.embed.weight.dtype
        parts = len(model.args.dspark_target_layer_ids)
        dc = draft.make_cache()
        draft.seed(dc, split(fx["official.prompt_hidden"], parts, dtype), 1)
        errors, agree = [], []
        for i, t in enumerate(range(PROMPT, PROMPT + fx["official.hidden"].shape[0])):
            draft.seed(dc, split(fx["official.hidden"][i:i + 1], parts, dtype), 1)
            got, _ = draft_rows(model, draft, dc, int(ids[t + 1]), fx["official.draft_ids"][i][:-1])
            want = fx["official.draft_logits"][i]
            errors += list(rel(got, want))
            agree += list(got.argmax(-1) == want.argmax(-1))
    errors = np.array(errors)
    assert np.mean(errors < 1e-3) >= 0.9, np.round(errors, 4)
    assert np.mean(agree) >= 0.95


def test_backbone_prefill_matches_the_reference_in_bf16_with_every_rounding(checkpoint, fx):
    """Prefills of 1..10 tokens as shipped: bit-level agreement of the last logits (RoPE
    rotated in fp32 and rounded once, as the reference does; with MLX's bf16 rotation the
    second token was already 30% off). Longer prompts meet the first flipped rounding."""
    ids = fx["ids"]
    model, _ = dsv4.load(checkpoint)
    for n, want in enumerate(fx["prefill.logits"], 1):
        got = np.array(model(ids[None, :n], model.make_cache())[0, -1])
        assert rel(got, want) < 1e-5, n
