"""Model behaviour on the tiny checkpoints: ties, decode vs prefill, cache, Engram, errors."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

import dsv4
from dsv4 import flags
from dsv4.kernels.topk import topk_indices
from dsv4.cache import load_cache
from dsv4.config import ConfigError, ModelArgs
from dsv4.engram import Engram, NgramHasher, layer_multipliers, layer_primes, table_sizes
from dsv4.safetensors_file import CheckpointError
from tests.formats import e4m3_value, e8m0_scale


def ids_for(n, seed=0):
    return np.random.default_rng(seed).integers(7, 500, (1, n))


# --- top-k tie breaking -----------------------------------------------------------------------

def test_topk_ties_go_to_lower_index():
    scores = mx.array([[0.0, 3.0, 0.0, 3.0, -mx.inf, 0.0, 3.0, 0.0]])
    assert sorted(np.array(topk_indices(scores, 2))[0].tolist()) == [1, 3]
    assert sorted(np.array(topk_indices(scores, 5))[0].tolist()) == [0, 1, 2, 3, 6]
    zeros = mx.zeros((3, 50))  # ReLU scores are often exactly 0
    for row in np.array(topk_indices(zeros, 7)):
        assert sorted(row.tolist()) == list(range(7))


def test_router_ties_go_to_lower_expert(tiny_dir):
    model, _ = dsv4.load(tiny_dir)
    gate = model.layers[0].ffn.gate
    gate.weight = mx.zeros_like(gate.weight)  # every expert scores sqrt(softplus(0))
    gate.bias = mx.zeros_like(gate.bias)
    ids, _ = gate(mx.random.normal((4, model.args.hidden_size)))
    assert [sorted(r) for r in np.array(ids).tolist()] == [[0, 1]] * 4


# --- decode, chunking, cache -----------------------------------------------------------------

def test_decode_step_equals_fresh_prefill(tiny_dir):
    """With owner index keys and QDQ off, the cache is exactly the state a prefill builds.
    (Both paths use the same matmul kernel, so only the summation order within it differs.)"""
    model, _ = dsv4.load(tiny_dir, dtype=mx.float32)
    ids = ids_for(40, 1)
    with flags.override(kv_qdq=False, act_quant=False, dequant_matmul="on"):
        cache = model.make_cache()
        model(ids[:, :10], cache)
        for t in range(10, 40):
            step = model(ids[:, t:t + 1], cache)[0, -1]
            fresh = model(ids[:, :t + 1], model.make_cache())[0, -1]
            assert float(mx.max(mx.abs(step - fresh)) / mx.max(mx.abs(fresh))) < 2e-6, t


def test_chunked_prefill_equals_one_shot(tiny_dir):
    model, _ = dsv4.load(tiny_dir, dtype=mx.float32)
    ids = ids_for(45, 2)
    with flags.override(kv_qdq=False, act_quant=False):
        one = model(ids, model.make_cache())
        cache = model.make_cache()
        parts = [model(ids[:, a:b], cache) for a, b in ((0, 7), (7, 8), (8, 29), (29, 45))]
    err = float(mx.max(mx.abs(mx.concatenate(parts, 1) - one)) / mx.max(mx.abs(one)))
    assert err < 1e-5


def test_last_position_logits_are_the_last_row_of_all(tiny_dir):
    """`last=True` (a prefill's chunks) runs the head for the last position of each sequence
    only; the logits are that row of the whole chunk's, and the cache is the same."""
    model, _ = dsv4.load(tiny_dir, dtype=mx.float32)
    ids = np.concatenate([ids_for(13, 3), ids_for(13, 4)])
    with flags.override(kv_qdq=False, act_quant=False):
        full_cache, last_cache = model.make_cache(), model.make_cache()
        full = model(ids, full_cache)
        last = model(ids, last_cache, last=True)
        assert last.shape == (2, 1, model.args.vocab_size)
        assert float(mx.max(mx.abs(last - full[:, -1:])) / mx.max(mx.abs(full))) < 1e-6
        nxt = np.array([[5], [6]])
        assert mx.array_equal(model(nxt, full_cache), model(nxt, last_cache))


def test_trim_then_refeed_is_bit_identical(tiny_dir):
    model, _ = dsv4.load(tiny_dir)
    ids = ids_for(50, 3)
    cache = model.make_cache()
    model(ids[:, :30], cache)
    after = [model(ids[:, t:t + 1], cache) for t in range(30, 37)]
    assert cache.trim(5) == 5
    assert cache.offset == 32
    again = [model(ids[:, t:t + 1], cache) for t in range(32, 37)]
    for a, b in zip(after[2:], again):
        assert mx.array_equal(a, b).item()


def test_copy_is_an_independent_snapshot(tiny_dir):
    model, _ = dsv4.load(tiny_dir)
    ids = ids_for(40, 6)
    cache = model.make_cache()
    model(ids[:, :20], cache)
    snap = cache.copy()
    a = model(ids[:, 20:], cache)
    b = model(ids[:, 20:], snap)
    assert snap.offset == cache.offset == 40 and mx.array_equal(a, b).item()


def test_trim_beyond_reserve_is_refused(tiny_dir):
    model, _ = dsv4.load(tiny_dir)
    cache = model.make_cache(reserve=4)
    model(ids_for(60, 4), cache)
    with pytest.raises(ValueError, match="exactly"):
        cache.trim(cache.max_trim() + 1)


def test_cache_save_load_round_trip(tiny_dir, tmp_path):
    model, _ = dsv4.load(tiny_dir)
    ids = ids_for(30, 5)
    cache = model.make_cache()
    model(ids[:, :25], cache)
    cache.save(tmp_path / "c.safetensors", {"note": "x"})
    loaded, meta = load_cache(tmp_path / "c.safetensors", model)
    assert meta["note"] == "x" and loaded.offset == 25
    a = model(ids[:, 25:], cache)
    b = model(ids[:, 25:], loaded)
    assert mx.array_equal(a, b).item()


# --- Engram ------------------------------------------------------------------------------------

REAL = dict(vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64,
            head_dim=512, q_lora_rank=1280, qk_rope_head_dim=64, o_groups=8, o_lora_rank=1024,
            moe_intermediate_size=2304, n_routed_experts=384, num_experts_per_tok=6,
            sliding_window=128, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
            kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
            candidate_source_layer_id=20, engram_layer_ids=[1, 14],
            engram_compressed_vocab_size=99092)


def test_engram_constants_of_the_real_config():
    args = ModelArgs.from_dict(REAL)
    assert layer_multipliers(args, 1).tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert layer_multipliers(args, 14).tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    primes = layer_primes(args)
    allp = np.concatenate([primes[1].ravel(), primes[14].ravel()])
    assert allp[0] == 16000057 and allp[23] == 16000463 and allp[24] == 16000477 and allp[-1] == 16000889
    assert table_sizes(args) == [384006168, 384016682]
    # 48 consecutive primes above 15,999,999: none skipped, none composite
    def is_prime(n):
        return n > 1 and all(n % f for f in range(2, int(n ** 0.5) + 1))
    assert [n for n in range(15_999_999, int(allp[-1]) + 1) if is_prime(n)] == allp.tolist()


def naive_hash(tokens, pos, mult, primes, pad, n=4):
    """Plain-int transcription of model-spec 6.3 for one position."""
    rows, blocked, prods = [], False, []
    for k in range(n):
        src = tokens[pos - k] if pos - k >= 0 else -1
        blocked = blocked or pos < k or src == -1
        prods.append((pad if blocked else src) * int(mult[k]))
    offset, rolling = 0, prods[0]
    flat = [int(p) for p in primes.ravel()]
    for order in range(1, n):
        rolling ^= prods[order]
        for h in range(primes.shape[1]):
            rows.append(rolling % int(primes[order - 1, h]) + offset + sum(flat[: (order - 1) * primes.shape[1] + h]))
    return rows


def test_hashing_matches_plain_ints_across_chunks():
    args = ModelArgs.from_dict(REAL)
    token_map = np.arange(129280) % 99092
    hasher = NgramHasher(args, token_map)
    ids = np.random.default_rng(0).integers(0, 129280, (1, 40))
    comp = token_map[ids]
    first = hasher.hash(comp[:, :17], np.full((1, 3), -1), 0)
    second = hasher.hash(comp[:, 17:], comp[:, 14:17], 17)
    for layer in (1, 14):
        got = np.concatenate([first[layer], second[layer]], axis=1)[0]
        mult = layer_multipliers(args, layer)
        for p in range(40):
            assert got[p].tolist() == naive_hash(comp[0].tolist(), p, mult, hasher.primes[layer],
                                                 int(token_map[2]))


def test_engram_combination_matches_numpy():
    args = ModelArgs.from_dict({**REAL, "hidden_size": 64, "engram_n_heads": 2})
    layer = Engram(args)
    rng = np.random.default_rng(3)
    layer.wkv.weight = mx.array(rng.normal(0, 0.05, layer.wkv.weight.shape).astype(np.float32))
    q, k = rng.normal(0, 1, (2, 4, 64)).astype(np.float32)
    layer.q_weight, layer.k_weight = mx.array(q), mx.array(k)
    x = rng.normal(0, 1, (2, 3, 4, 64)).astype(np.float32)
    rows = rng.normal(0, 1, (2, 3, 6, 256)).astype(np.float32)
    with flags.override(act_quant=False):
        got = np.array(layer(mx.array(x), mx.array(rows)))
    w = np.array(layer.wkv.weight).astype(np.float64)
    kv = rows.reshape(2, 3, -1) @ w.T
    key, val = kv[..., :256].reshape(2, 3, 4, 64), kv[..., 256:]
    xx = x.astype(np.float64)
    rstd = 1 / np.sqrt((xx ** 2).mean(-1) + 1e-20) / np.sqrt((key ** 2).mean(-1) + 1e-20)
    dot = (xx * (q * k) * key).sum(-1) * rstd / 8.0
    gate = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
    want = xx + gate[..., None] * val[:, :, None, :]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_engram_rows_come_from_the_table(tiny_dir):
    """The model's Engram layers read the official split-layout rows through the store."""
    from dsv4.safetensors_file import Checkpoint, view

    model, _ = dsv4.load(tiny_dir)
    ckpt = Checkpoint(tiny_dir)
    layer = model.args.engram_layer_ids[0]
    table = model._engram_tables[layer]
    ids = np.array([[0, 5, table.rows - 1]])
    got = np.array(table.read(ids).astype(mx.float32))[0]
    codes = view(ckpt[f"layers.{layer}.engram.embed.weight"])[ids[0]]
    scales = view(ckpt[f"layers.{layer}.engram.embed.scale"])[ids[0]]
    want = e4m3_value(codes) * np.repeat(e8m0_scale(scales), 32, -1)
    np.testing.assert_array_equal(got, want.astype(np.float32))


# --- bad input ---------------------------------------------------------------------------------

def broken_copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def rewrite_tensor(ckpt, name, replacement=None):
    """Rewrite the shard holding `name` with the tensor replaced by (dtype, array), or removed."""
    from dsv4 import safetensors_file as sf

    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    file = index["weight_map"][name]
    infos, _ = sf.read_header(ckpt / file)
    tensors = {n: (i.dtype, np.array(sf.view(i))) for n, i in infos.items()}
    if replacement is None:
        del tensors[name], index["weight_map"][name]
        index_file.write_text(json.dumps(index))
    else:
        tensors[name] = replacement
    sf.write(ckpt / file, tensors)


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    dst = broken_copy(tiny_dir, tmp_path)
    rewrite_tensor(dst, "layers.3.attn.wq_b.weight")
    with pytest.raises(CheckpointError, match=r"layers\.3\.attn\.wq_b\.weight is missing"):
        dsv4.load(dst)


def test_wrong_shape_is_named(tiny_dir, tmp_path):
    dst = broken_copy(tiny_dir, tmp_path)
    rewrite_tensor(dst, "layers.2.attn_norm.weight", ("F32", np.zeros(7, np.float32)))
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn_norm\.weight is F32\[7\], expected BF16\[64\]"):
        dsv4.load(dst)


def test_truncated_shard_is_named(tiny_dir, tmp_path):
    dst = broken_copy(tiny_dir, tmp_path)
    shard = sorted(dst.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard.name}: truncated"):
        dsv4.load(dst)


def test_config_missing_field_is_named(tiny_dir, tmp_path):
    dst = broken_copy(tiny_dir, tmp_path)
    config = json.loads((dst / "config.json").read_text())
    del config["text_config"]["q_lora_rank"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json: missing field\(s\) \['q_lora_rank'\]"):
        dsv4.load(dst)


def test_token_out_of_range_is_named(tiny_dir):
    model, _ = dsv4.load(tiny_dir)
    with pytest.raises(ValueError, match=r"token id 100000 at position \(0, 2\)"):
        model(np.array([[5, 6, 100000]]))


def test_index_key_quirk_only_changes_steps_without_ratio2_emission(tiny_dir):
    """Reference quirk (model-spec 3.9): on a decode step where a ratio-2 kv source emits no
    latent, its indexer scores against the last published keys (the ratio-1 source's).
    Steps where it emits, and prefill, are unaffected."""
    model, _ = dsv4.load(tiny_dir, dtype=mx.float32)
    ids = ids_for(40, 9)
    outs = {}
    for quirk in (False, True):
        with flags.override(kv_qdq=False, act_quant=False, index_key_quirk=quirk):
            cache = model.make_cache()
            steps = [model(ids[:, :20], cache)]
            steps += [model(ids[:, t:t + 1], cache) for t in range(20, 30)]
            outs[quirk] = steps
    assert mx.array_equal(outs[False][0], outs[True][0]).item()          # prefill
    # t = 20: position 20 is the first of a ratio-2 group, so nothing is emitted at layer 2
    differs = [not mx.allclose(a, b, atol=0, rtol=0).item() for a, b in zip(outs[False][1:], outs[True][1:])]
    assert differs[0], "the quirk must change the first step that emits no ratio-2 latent"


@pytest.mark.parametrize("mode,bound", [("mxfp8", 0.1), ("affine8", 0.02)])
def test_quantized_head_error_is_bounded_by_its_weight_error(tiny_dir, mode, bound):
    """DSV4_HEAD_QUANT: the logits move by about the head weight's own quantization error."""
    with flags.override(head_quant=mode):
        model, _ = dsv4.load(tiny_dir, dtype=mx.float32)
    ref_model, _ = dsv4.load(tiny_dir, dtype=mx.float32)
    from dsv4.linear import QuantizedLinear

    assert isinstance(model.head, QuantizedLinear) and not isinstance(ref_model.head, QuantizedLinear)
    w = ref_model.head.weight
    wq = model.head.dequantized(mx.float32)
    weight_err = float(mx.sqrt(mx.mean((wq - w) ** 2)) / mx.sqrt(mx.mean(w * w)))
    ids = ids_for(20, 10)
    a = ref_model(ids, ref_model.make_cache())
    b = model(ids, model.make_cache())
    logit_err = float(mx.sqrt(mx.mean((a - b) ** 2)) / mx.sqrt(mx.mean(a * a)))
    assert 0 < weight_err < bound
    assert logit_err < 3 * weight_err


def test_batch_rows_equal_single_sequences(tiny_dir):
    """A batch of two sequences gives each row what that sequence gives alone."""
    model, _ = dsv4.load(tiny_dir, dtype=mx.float32)
    ids = np.concatenate([ids_for(30, 11), ids_for(30, 12)])
    with flags.override(kv_qdq=False, act_quant=False):
        cache = model.make_cache()
        batched = mx.concatenate([model(ids[:, :20], cache), model(ids[:, 20:], cache)], axis=1)
        for row in range(2):
            alone = model(ids[row:row + 1], model.make_cache())[0]
            err = float(mx.max(mx.abs(batched[row] - alone)) / mx.max(mx.abs(alone)))
            assert err < 1e-5, (row, err)
