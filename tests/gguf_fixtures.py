"""Tiny GGUF files in antirez's ds4 dialect for DeepSeek V4.1 Flash (`deepseek41`), for tests.

The layout follows ds4's `gguf-tools/deepseek41_quantize.py` (tensor names, types, order:
Engram tables last) and `deepseek41_metadata.py` (keys): the whole HF config as a JSON string
plus typed copies, Engram hashing metadata, a GPT-2 style tokenizer, 16 KiB alignment. The
weights come from `dsv4.testing.official_tensors` (dequantized, then Q8_0 through gguf's own
quantiser, F16, F32); routed experts are random valid blocks (every byte pattern of Q4_K,
Q2_K and IQ2_XXS decodes; only the f16 scales are set, to keep values finite and small).

The Engram metadata is derived here the way ds4 derives it (HF normalizers for the token
map; primes restarting from engram_vocab_size for every order, skipping those taken), not
with dsv4.engram, so the converter's check against dsv4's hashing is a real comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, GGUFWriter
from gguf.quants import quantize

from convert.gguf_quants import BLOCK_BYTES, BLOCK_WEIGHTS
from dsv4.config import ModelArgs
from dsv4.quant import pack_fp4, pack_fp8_block32
from dsv4.testing import draft_config, official_tensors, tiny_config, train_tokenizer

ALIGNMENT = 16384
RECIPES = {"q2": (T.IQ2_XXS, T.IQ2_XXS, T.Q2_K), "q4": (T.Q4_K, T.Q4_K, T.Q4_K)}

# DeepSeek V3's pre-tokenizer (deepseek-ai/DeepSeek-V3 tokenizer.json; llama.cpp's
# "deepseek-v3" / "joyai-llm" pre-type), applied in sequence, each split Isolated.
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
NON_SPECIAL_ADDED = "<tool_call>"


def source_tokenizer(vocab_size: int = 512):
    """dsv4.testing's byte-level BPE, with DeepSeek V3's pre-tokenisation and one added token
    that is not special (as DeepSeek's tokenizer has)."""
    from tokenizers import Regex, pre_tokenizers

    tok = train_tokenizer(vocab_size)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in DEEPSEEK_V3_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.add_tokens([NON_SPECIAL_ADDED])
    return tok


def fixture_config(tokenizer, **overrides) -> dict:
    """tiny_config at widths K-quants accept (inputs a multiple of 256), with ds4's extra keys."""
    config = tiny_config(vocab_size=tokenizer.get_vocab_size(),
                         **{"hidden_size": 256, "moe_intermediate_size": 256, **overrides})
    text = config["text_config"]
    text.update(hidden_act="silu", topk_method="noaux_tc", norm_topk_prob=True)
    token_map, count = ds4_token_map(tokenizer)
    text["engram_compressed_vocab_size"] = count
    primes = ds4_primes(text)
    text["engram_num_embeddings"] = [sum(p) for p in primes]
    return config


# --- Engram metadata the way ds4 computes it ----------------------------------------------

def ds4_token_map(tokenizer) -> tuple[list[int], int]:
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    keys: dict[str, int] = {}
    out = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([i], skip_special_tokens=False)
        key = tokenizer.id_to_token(i) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(keys.setdefault(key, len(keys)))
    return out, len(keys)


def _next_prime(n: int) -> int:
    n += 1
    while n < 2 or any(n % f == 0 for f in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n


def ds4_primes(text: dict) -> list[list[int]]:
    seen, out = set(), []
    for _layer in text["engram_layer_ids"]:
        row = []
        for _order in range(text["engram_max_ngram_size"] - 1):
            current = text["engram_vocab_size"] - 1
            for _head in range(text["engram_n_heads"]):
                current = _next_prime(current)
                while current in seen:
                    current = _next_prime(current)
                seen.add(current)
                row.append(current)
        out.append(row)
    return out


def ds4_multipliers(text: dict, compressed_vocab: int) -> list[list[int]]:
    bound = (np.iinfo(np.int64).max // compressed_vocab) // 2
    return [(np.random.default_rng(10007 * layer).integers(0, bound, size=4, dtype=np.int64) * 2 + 1)
            .tolist() for layer in text["engram_layer_ids"]]


# --- blocks --------------------------------------------------------------------------------

def random_blocks(rng: np.random.Generator, qtype: T, shape: tuple[int, ...], d: float) -> np.ndarray:
    """Random valid blocks for a logical shape [..., in]; scale fields near `d`."""
    *lead, n_in = shape
    if qtype == T.MXFP4:   # e8m0 scales near d (any code is valid)
        blocks = rng.integers(0, 256, (*lead, n_in // 32, 17), dtype=np.uint8)
        blocks[..., 0] = np.round(127 + np.log2(d) + rng.uniform(-0.5, 0.5, blocks.shape[:-1])).astype(np.uint8)
        return blocks.reshape(*lead, n_in // 32 * 17)
    nb = n_in // BLOCK_WEIGHTS[qtype]
    blocks = rng.integers(0, 256, (*lead, nb, BLOCK_BYTES[qtype]), dtype=np.uint8)

    def put(at: int, mean: float):
        v = rng.uniform(0.5 * mean, 1.5 * mean, (*lead, nb)).astype(np.float16)
        blocks[..., at:at + 2] = v.view(np.uint8).reshape(*lead, nb, 2)

    if qtype == T.Q4_K:
        put(0, d), put(2, d)
    elif qtype == T.Q2_K:
        put(80, d), put(82, d)
    elif qtype == T.IQ2_XXS:
        put(0, d)
    else:
        raise ValueError(qtype)
    return blocks.reshape(*lead, nb * BLOCK_BYTES[qtype])


def _float(dtype: str, array: np.ndarray, scale: np.ndarray = None) -> np.ndarray:
    """An official tensor as f32."""
    if dtype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    if dtype == "F8_E4M3":
        w, s = pack_fp8_block32(array, scale)
        return np.array(mx.dequantize(mx.array(w), mx.array(s), group_size=32, bits=8,
                                      mode="mxfp8", dtype=mx.float32))
    if dtype == "I8":   # fp4 pairs, first value in the low nibble
        w, s = pack_fp4(array.view(np.uint8), scale)
        return np.array(mx.dequantize(mx.array(w), mx.array(s), group_size=32, bits=4,
                                      mode="mxfp4", dtype=mx.float32))
    return array.astype(np.float32)


# --- the file --------------------------------------------------------------------------------

def write_ds4_gguf(path: Path | str, recipe: str = "q2", seed: int = 0, tokenizer=None,
                   config: dict = None, expert_types: dict = None, typed_overrides: dict = None,
                   engram_overrides: dict = None, skip: tuple = (), split_max_size: int = 0,
                   alignment: int = ALIGNMENT) -> dict:
    """Write a ds4-dialect GGUF to `path`; returns {"config", "tokenizer", "official", "tables"}.
    `expert_types` maps a layer to its (gate, up, down) types, overriding `recipe` (ds4's
    mixed files). For tests of bad input: `typed_overrides` changes typed `deepseek41.*`
    copies (not the JSON config), `engram_overrides` Engram metadata values, and tensors
    named in `skip` are left out. `split_max_size`: gguf-py writes gguf-split shards
    (`path`'s stem-0000k-of-0000n.gguf) of at most that many tensor bytes, each aligned to
    `alignment` (None: GGUF's default 32, which is what a shard without the metadata is read at)."""
    path = Path(path)
    tokenizer = tokenizer or source_tokenizer()
    config = config or fixture_config(tokenizer)
    text = config["text_config"]
    args = ModelArgs.from_dict(config)
    official = official_tensors(args, seed)
    rng = np.random.default_rng(seed + 1)

    def get(name):
        dtype, array = official[name]
        scale = official.get(name.removesuffix(".weight") + ".scale")
        return _float(dtype, array, None if scale is None else scale[1])

    w = GGUFWriter(str(path), "deepseek41", split_max_size=split_max_size)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_name("DeepSeek V4.1 Flash (tiny test model)")
    w.add_string("general.source.url", "https://huggingface.co/deepseek-ai/DeepSeek-V4.1-Flash")
    w.add_string("general.source.revision", "0" * 40)
    w.add_string("deepseek41.config", json.dumps(config, sort_keys=True, separators=(",", ":")))
    w.add_string("deepseek41.quantization", recipe)
    _engram_metadata(w, text, tokenizer, engram_overrides or {})
    _tokenizer_metadata(w, tokenizer, text)
    _typed_config(w, {**text, **(typed_overrides or {})})

    def tensor(name, array, qtype):
        if name in skip:
            return
        if qtype == T.F16:
            w.add_tensor(name, array.astype(np.float16))
        elif qtype == T.F32:
            w.add_tensor(name, array.astype(np.float32))
        elif qtype == T.Q8_0:
            w.add_tensor(name, quantize(array.astype(np.float32), T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(name, array, raw_dtype=qtype)

    tensor("token_embd.weight", get("embed.weight"), T.F16)
    tensor("output_norm.weight", get("norm.weight"), T.F32)
    tensor("output.weight", get("head.weight"), T.Q8_0)
    d = args.hidden_size
    tables = []
    for layer in range(args.num_hidden_layers):
        src, dst = f"layers.{layer}", f"blk.{layer}"
        for site in ("attn", "ffn"):
            tensor(f"{dst}.hc_{site}_fn.weight", get(f"{src}.hc_{site}_fn"), T.F16)
            tensor(f"{dst}.hc_{site}_base.weight", get(f"{src}.hc_{site}_base"), T.F32)
            tensor(f"{dst}.hc_{site}_scale.weight", get(f"{src}.hc_{site}_scale"), T.F32)
            tensor(f"{dst}.{site}_norm.weight", get(f"{src}.{site}_norm.weight"), T.F32)
        a = f"{src}.attn"
        for target, source, qtype in (
                ("attn_sinks", "attn_sink", T.F32), ("attn_q_a", "wq_a.weight", T.Q8_0),
                ("attn_q_b", "wq_b.weight", T.Q8_0), ("attn_q_a_norm", "q_norm.weight", T.F32),
                ("attn_kv", "wkv.weight", T.Q8_0), ("attn_kv_a_norm", "kv_norm.weight", T.F32),
                ("attn_output_a", "wo_a.weight", T.Q8_0), ("attn_output_b", "wo_b.weight", T.Q8_0)):
            tensor(f"{dst}.{target}.weight", get(f"{a}.{source}"), qtype)
        if layer in args.kv_source_layer_ids:
            tensor(f"{dst}.attn_compressor_kv.weight", get(f"{a}.compressor.wkv.weight"), T.F16)
            tensor(f"{dst}.attn_compressor_norm.weight", get(f"{a}.compressor.norm.weight"), T.F32)
            tensor(f"{dst}.indexer.attn_k.weight", get(f"{a}.indexer.wk.weight"), T.F16)
            tensor(f"{dst}.indexer.k_norm.weight", get(f"{a}.indexer.k_norm.weight"), T.F32)
            if args.ratio(layer) > 1:
                tensor(f"{dst}.attn_compressor_gate.weight", get(f"{a}.compressor.wgate.weight"), T.F16)
        if layer in args.index_source_layer_ids:
            tensor(f"{dst}.indexer.attn_q_b.weight", get(f"{a}.indexer.wq_b.weight"), T.F16)
            tensor(f"{dst}.indexer.proj.weight", get(f"{a}.indexer.weights_proj.weight"), T.F16)
        f = f"{src}.ffn"
        tensor(f"{dst}.ffn_gate_inp.weight", get(f"{f}.gate.weight"), T.F32)
        tensor(f"{dst}.exp_probs_b.bias", get(f"{f}.gate.bias"), T.F32)
        tensor(f"{dst}.exp_probs_b_vl.bias", get(f"{f}.gate.bias_vl"), T.F32)
        types = (expert_types or {}).get(layer, RECIPES[recipe])
        inter, e = args.moe_intermediate_size, args.n_routed_experts
        for part, source, shape, qtype in (("gate", "w1", (e, inter, d), types[0]),
                                           ("up", "w3", (e, inter, d), types[1]),
                                           ("down", "w2", (e, d, inter), types[2])):
            tensor(f"{dst}.ffn_{part}_shexp.weight", get(f"{f}.shared_experts.{source}.weight"), T.Q8_0)
            # scale so that values have roughly the official experts' std (in ** -0.5)
            level = {T.IQ2_XXS: 25 * 2.0, T.Q2_K: 1.5 * 8, T.Q4_K: 7.5 * 32, T.MXFP4: 2.5}[qtype]
            tensor(f"{dst}.ffn_{part}_exps.weight",
                   random_blocks(rng, qtype, shape, shape[-1] ** -0.5 / level), qtype)
        if layer in args.engram_layer_ids:
            g = f"{src}.engram"
            tensor(f"{dst}.engram_q_norm.weight", get(f"{g}.q_weight"), T.F32)
            tensor(f"{dst}.engram_k_norm.weight", get(f"{g}.k_weight"), T.F32)
            tensor(f"{dst}.engram_kv.weight", get(f"{g}.wkv.weight"), T.F16)
            codes, scales = official[f"{g}.embed.weight"][1], official[f"{g}.embed.scale"][1]
            tables.append((f"{dst}.engram_embd.weight", np.concatenate([codes, scales], 1)))
    for name, rows in tables:  # after every resident tensor, as ds4 places them
        w.add_tensor(name, rows.view(np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"config": config, "tokenizer": tokenizer, "official": official, "tables": dict(tables)}


def _u32s(w: GGUFWriter, key: str, values) -> None:
    w.add_key_value(key, [int(v) for v in values], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT32)


def _engram_metadata(w: GGUFWriter, text: dict, tokenizer, overrides: dict) -> None:
    token_map, count = ds4_token_map(tokenizer)
    primes = ds4_primes(text)
    values = {"layer_ids": text["engram_layer_ids"], "rows": [sum(p) for p in primes],
              "compressed_vocab_size": count, "pad_id": token_map[text["engram_pad_id"]],
              "token_map": token_map, "primes": sum(primes, []),
              "multipliers": sum(ds4_multipliers(text, count), [])}
    values.update(overrides)
    w.add_string("deepseek41.engram.encoding", "e4m3_e8m0_32_row264")
    for key in ("layer_ids", "rows", "token_map", "primes"):
        _u32s(w, f"deepseek41.engram.{key}", values[key])
    for key in ("compressed_vocab_size", "pad_id"):
        w.add_uint32(f"deepseek41.engram.{key}", values[key])
    w.add_key_value("deepseek41.engram.multipliers", values["multipliers"],
                    GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT64)


def _tokenizer_metadata(w: GGUFWriter, tokenizer, text: dict) -> None:
    data = json.loads(tokenizer.to_str())
    special = {t["id"] for t in data["added_tokens"] if t["special"]}
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "joyai-llm")
    w.add_token_list([tokenizer.id_to_token(i) for i in range(n)])
    w.add_token_types([3 if i in special else 1 for i in range(n)])
    w.add_token_merges(merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", text["bos_token_id"])
    w.add_uint32("tokenizer.ggml.eos_token_id", text["eos_token_id"])
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)


U32_KEYS = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "qk_rope_head_dim",
            "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts", "n_shared_experts",
            "num_experts_per_tok", "max_position_embeddings", "sliding_window", "index_n_heads",
            "index_head_dim", "index_topk", "candidate_source_layer_id", "candidate_topk_blocks",
            "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "rope_theta",
            "compress_rope_theta")


def _typed_config(w: GGUFWriter, text: dict) -> None:
    for key in U32_KEYS:
        w.add_uint32(f"deepseek41.{key}", int(text[key]))
    for key in ("rms_norm_eps", "hc_eps", "swiglu_limit", "routed_scaling_factor"):
        w.add_float32(f"deepseek41.{key}", float(text[key]))
    for key in ("scoring_func", "hidden_act", "topk_method"):
        w.add_string(f"deepseek41.{key}", text[key])
    w.add_bool("deepseek41.norm_topk_prob", bool(text["norm_topk_prob"]))
    _u32s(w, "deepseek41.compress_ratios", text["compress_ratios"][:text["num_hidden_layers"]])
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        _u32s(w, f"deepseek41.{key}", text[key])
    for key in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings"):
        w.add_float32(f"deepseek41.rope_scaling.{key}", float(text["rope_scaling"][key]))


# --- ds4's DSpark support file ------------------------------------------------------------------

def draft_fixture_config(tokenizer) -> dict:
    """fixture_config with V4.1-shaped draft stages (dsv4.testing.draft_config: three stages,
    blocks of 5, their own 4 experts with top-2)."""
    layers = tiny_config()["text_config"]["num_hidden_layers"]
    fields = draft_config(layers)
    ratios = tiny_config()["text_config"]["compress_ratios"] + [0] * fields["num_nextn_predict_layers"]
    return fixture_config(tokenizer, **fields, compress_ratios=ratios)


# ds4's precisions for the support file (gguf-tools/deepseek41_dspark.py): attention and main_proj,
# shared expert, routed gate/up/down, Markov embedding and head, the mHC projections; "q4 first" is
# the script's first revision (the only precision then; the Markov head F32).
DSPARK_RECIPES = {
    "native": dict(att=T.F16, shared=T.F16, experts=(T.MXFP4,) * 3, heads=(T.F32, T.F32), hc_fn=T.F32),
    "bf16": dict(att=T.BF16, shared=T.BF16, experts=(T.BF16,) * 3, heads=(T.BF16, T.BF16), hc_fn=T.F32),
    "q8": dict(att=T.Q8_0, shared=T.Q8_0, experts=(T.Q8_0,) * 3, heads=(T.F16, T.F16), hc_fn=T.F16),
    "q4": dict(att=T.Q8_0, shared=T.Q8_0, experts=(T.Q4_K,) * 3, heads=(T.F16, T.F16), hc_fn=T.F16),
    "q4 first": dict(att=T.Q8_0, shared=T.Q8_0, experts=(T.Q4_K,) * 3, heads=(T.F16, T.F32), hc_fn=T.F16),
    "q2": dict(att=T.Q8_0, shared=T.Q8_0, experts=(T.IQ2_XXS, T.IQ2_XXS, T.Q2_K), heads=(T.F16, T.F16),
               hc_fn=T.F16),
}


def mxfp4_blocks(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Official fp4 pairs [..., in/2] (value 2i in the low nibble) + e8m0 [..., in/32] -> GGUF
    MXFP4 rows [..., in/32 * 17]: each block its scale byte, then byte j = value j | value j+16 << 4."""
    pairs = codes.view(np.uint8)
    values = np.stack([pairs & 0x0F, pairs >> 4], axis=-1).reshape(*pairs.shape[:-1], -1, 32)
    qs = values[..., :16] | (values[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*pairs.shape[:-1], -1)


def write_dspark_gguf(path: Path | str, config: dict, recipe: str = "native", seed: int = 0,
                      architecture: str = "deepseek41-dspark", prefix: str = "dspark.",
                      metadata: dict = None, revision: str = "0" * 40, hc_head: bool = False,
                      skip: tuple = ()) -> dict:
    """Write ds4's DSpark support GGUF of the draft stages of `config` (with dsv4.testing's
    official tensors of `seed`, as write_ds4_gguf's text file has them) to `path`; returns the
    official tensors. `prefix` picks the metadata keys' spelling ("dspark." as ds4 writes them
    now, "deepseek4.dspark." or "deepseek4.dspark_" as earlier revisions did); `metadata`
    overrides values (None leaves a key out); `hc_head` adds ds4's derived hc_head_* copies;
    tensors in `skip` are left out (tests of bad input)."""
    text = config["text_config"]
    args = ModelArgs.from_dict(config)
    official = official_tensors(args, seed)
    rng = np.random.default_rng(seed + 2)
    types = DSPARK_RECIPES[recipe]

    def get(name):
        dtype, array = official[name]
        scale = official.get(name.removesuffix(".weight") + ".scale")
        return _float(dtype, array, None if scale is None else scale[1])

    w = GGUFWriter(str(path), architecture)
    w.add_custom_alignment(32)
    w.add_name("DeepSeek V4.1 Flash DSpark (tiny test model)")
    if revision is not None:
        w.add_string("general.source.revision", revision)
    w.add_string("dspark.precision", recipe)
    values = {"block_size": text["dspark_block_size"], "markov_rank": text["dspark_markov_rank"],
              "noise_token_id": text["dspark_noise_token_id"],
              "target_layer_ids": text["dspark_target_layer_ids"],
              "stage_count": text["num_nextn_predict_layers"],
              "expert_count": text["dspark_n_routed_experts"],
              "expert_used_count": text["dspark_num_experts_per_tok"],
              "window_size": text["sliding_window"], "embedding_length": text["hidden_size"],
              **(metadata or {})}
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, list):
            _u32s(w, prefix + key, value)
        else:
            w.add_uint32(prefix + key, int(value))

    def tensor(name, array, qtype):
        if name in skip:
            return
        if qtype in (T.F16, T.F32):
            w.add_tensor(name, array.astype(np.float16 if qtype == T.F16 else np.float32))
        elif qtype == T.BF16:
            bits = np.array(mx.array(array, mx.float32).astype(mx.bfloat16).view(mx.uint16))
            w.add_tensor(name, bits.view(np.uint8), raw_dtype=T.BF16)
        elif qtype == T.Q8_0:
            w.add_tensor(name, quantize(array.astype(np.float32), T.Q8_0), raw_dtype=T.Q8_0)
        else:
            w.add_tensor(name, array, raw_dtype=qtype)

    d, inter, e = args.hidden_size, args.moe_intermediate_size, args.dspark_n_routed_experts
    stages = args.num_nextn_predict_layers
    for stage in range(stages):
        p = f"mtp.{stage}"
        for site in ("attn", "ffn"):
            tensor(f"{p}.hc_{site}_fn.weight", get(f"{p}.hc_{site}_fn"), types["hc_fn"])
            tensor(f"{p}.hc_{site}_base.weight", get(f"{p}.hc_{site}_base"), T.F32)
            tensor(f"{p}.hc_{site}_scale.weight", get(f"{p}.hc_{site}_scale"), T.F32)
            tensor(f"{p}.{site}_norm.weight", get(f"{p}.{site}_norm.weight"), T.F32)
        for target, source, qtype in (
                ("attn_sinks", "attn_sink", T.F32), ("attn_q_a", "wq_a.weight", types["att"]),
                ("attn_q_a_norm", "q_norm.weight", T.F32), ("attn_q_b", "wq_b.weight", types["att"]),
                ("attn_kv", "wkv.weight", types["att"]), ("attn_kv_a_norm", "kv_norm.weight", T.F32),
                ("attn_output_a", "wo_a.weight", types["att"]), ("attn_output_b", "wo_b.weight", types["att"])):
            tensor(f"{p}.{target}.weight", get(f"{p}.attn.{source}"), qtype)
        f = f"{p}.ffn"
        tensor(f"{p}.ffn_gate_inp.weight", get(f"{f}.gate.weight"), T.F32)
        tensor(f"{p}.exp_probs_b.bias", get(f"{f}.gate.bias"), T.F32)
        tensor(f"{p}.exp_probs_b_vl.bias", get(f"{f}.gate.bias_vl"), T.F32)
        for part, source, shape, qtype in (("gate", "w1", (e, inter, d), types["experts"][0]),
                                           ("up", "w3", (e, inter, d), types["experts"][1]),
                                           ("down", "w2", (e, d, inter), types["experts"][2])):
            tensor(f"{p}.ffn_{part}_shexp.weight", get(f"{f}.shared_experts.{source}.weight"), types["shared"])
            names = [f"{f}.experts.{k}.{source}" for k in range(e)]
            if qtype == T.MXFP4:
                array = np.stack([mxfp4_blocks(official[f"{n}.weight"][1], official[f"{n}.scale"][1])
                                  for n in names])
            elif qtype in (T.BF16, T.Q8_0):
                array = np.stack([get(f"{n}.weight") for n in names])
            else:
                level = {T.IQ2_XXS: 25 * 2.0, T.Q2_K: 1.5 * 8, T.Q4_K: 7.5 * 32}[qtype]
                array = random_blocks(rng, qtype, shape, shape[-1] ** -0.5 / level)
            tensor(f"{p}.ffn_{part}_exps.weight", array, qtype)
        if stage == 0:
            tensor(f"{p}.main_proj.weight", get(f"{p}.main_proj.weight"), types["att"])
            tensor(f"{p}.main_norm.weight", get(f"{p}.main_norm.weight"), T.F32)
        if stage == stages - 1:
            tensor(f"{p}.norm.weight", get(f"{p}.norm.weight"), T.F32)
            tensor(f"{p}.markov_head.markov_w1.weight", get(f"{p}.markov_head.embed.weight"), types["heads"][0])
            tensor(f"{p}.markov_head.markov_w2.weight", get(f"{p}.markov_head.head.weight"), types["heads"][1])
            tensor(f"{p}.confidence_head.proj.weight", get(f"{p}.confidence_head.proj.weight"), T.F32)
            if hc_head:
                hc = args.hc_mult
                tensor(f"{p}.hc_head_fn.weight", get(f"{p}.hc_ffn_fn")[:hc], T.F16)
                tensor(f"{p}.hc_head_base.weight", get(f"{p}.hc_ffn_base")[:hc], T.F32)
                tensor(f"{p}.hc_head_scale.weight", get(f"{p}.hc_ffn_scale")[:1], T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return official
