"""Tiny checkpoints in the official DeepSeek V4.1 layout, written from a seed.

`write_tiny_checkpoint(path, seed)` writes what `deepseek-ai/DeepSeek-V4.1-Flash`
publishes, at toy widths: the same tensor names and storage dtypes (fp8 e4m3 with
e8m0 32x32 block scales, fp4 experts packed two per byte with e8m0 per 32, BF16,
F32, Engram rows fp8 + e8m0), sharded into several safetensors files with
`model.safetensors.index.json`, an HF `config.json` and a small byte-level BPE
tokenizer. Every layer role is present (see `tiny_config`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from . import safetensors_file
from .config import ModelArgs
from .engram import build_token_map, layer_primes

SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>",
                  "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]

_CORPUS = """The quick brown fox jumps over the lazy dog. Beautiful is better than ugly.
Explicit is better than implicit. Simple is better than complex. Complex is better than
complicated. Flat is better than nested. Sparse is better than dense. Readability counts.
Special cases aren't special enough to break the rules. Although practicality beats purity.
Errors should never pass silently. Unless explicitly silenced. In the face of ambiguity,
refuse the temptation to guess. There should be one-- and preferably only one --obvious way
to do it. Now is better than never. Although never is often better than *right* now.
def main(argv): return sum(int(x) ** 2 for x in argv if x.isdigit())
Café naïve résumé — ÉCOLE école Ecole.  Tabs\tand\nnew lines,   spaces.
数字 1234567890 深度求索 こんにちは 🙂🚀
"""


def tiny_config(vocab_size: int = 512, **overrides) -> dict:
    """An HF-style config with every V4.1 layer role at toy widths:
    layers 0-1 window only (Engram before 1), 2 ratio-2 kv+index source, 3 ratio-2 reuse
    (Engram before 3), 4 ratio-1 kv+index+candidate source, 5 reuse, 6 re-index inside
    the candidate mask, 7 reuse of 6."""
    text = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, q_lora_rank=32, qk_rope_head_dim=16, o_groups=2,
        o_lora_rank=32, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
        swiglu_limit=10.0, rms_norm_eps=1e-20, sliding_window=8,
        compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1], kv_source_layer_ids=[2, 4],
        index_source_layer_ids=[2, 4, 6], candidate_source_layer_id=4,
        candidate_topk_blocks=3, candidate_block_size=4, index_n_heads=4, index_head_dim=32,
        index_topk=6, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 32,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=4096, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        engram_layer_ids=[1, 3], engram_max_ngram_size=4, engram_n_heads=2,
        engram_head_dim=256, engram_vocab_size=500, engram_pad_id=2,
        bos_token_id=0, eos_token_id=1,
    )
    text.update(overrides)
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                "expert_dtype": "fp4"},
        "torch_dtype": "bfloat16",
    }


def train_tokenizer(vocab_size: int, corpus: str = _CORPUS):
    """A byte-level BPE with DeepSeek's special tokens at ids 0.. (bos 0, eos 1, pad 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus.splitlines(), trainer)
    return tok


# --- storage encoders (numpy) --------------------------------------------------------------

def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _pow2_exponent(amax: np.ndarray, qmax: float) -> np.ndarray:
    return np.ceil(np.log2(np.maximum(amax, 1e-30) / qmax)).astype(np.int32)


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3 codes (uint8), through MLX's converter (round to nearest even)."""
    import mlx.core as mx

    return np.array(mx.to_fp8(mx.array(x.astype(np.float32))))


def fp8_block_weight(rng: np.random.Generator, out_dim: int, in_dim: int, std: float):
    """Random fp8 e4m3 weight with e8m0 32x32 block scales, as stored officially."""
    w = rng.normal(0, std, (out_dim, in_dim)).astype(np.float32)
    bo, bi = (out_dim + 31) // 32, in_dim // 32
    padded = np.zeros((bo * 32, in_dim), np.float32)
    padded[:out_dim] = w
    amax = np.abs(padded.reshape(bo, 32, bi, 32)).max(axis=(1, 3))
    exp = _pow2_exponent(amax, 448.0)
    scaled = w / np.repeat(np.repeat(2.0 ** exp, 32, 0), 32, 1)[:out_dim]
    return encode_e4m3(np.clip(scaled, -448, 448)), (exp + 127).astype(np.uint8)


def fp4_weight(rng: np.random.Generator, shape: tuple[int, ...], std: float):
    """Random fp4 e2m1 weight, two codes per byte (low nibble = even index), e8m0 per 32."""
    w = rng.normal(0, std, shape).astype(np.float32)
    g = w.reshape(*shape[:-1], shape[-1] // 32, 32)
    exp = _pow2_exponent(np.abs(g).max(-1), 6.0)
    v = np.clip(g / (2.0 ** exp)[..., None], -6, 6)
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    mag = np.abs(v)
    code = np.argmin(np.abs(mag[..., None] - table), axis=-1).astype(np.uint8)
    code = code | np.where(v < 0, 8, 0).astype(np.uint8)
    code = code.reshape(*shape)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return packed.view(np.int8), (exp + 127).astype(np.uint8)


# The f16 fields of each GGUF block type (byte offset) and a magnitude that keeps its weights
# around 0.05, as a trained model's are.
GGUF_SCALE_FIELDS = {"Q8_0": ((0, 4e-4),), "IQ2_XXS": ((0, 1.5e-4),), "Q4_K": ((0, 1e-4), (2, 1e-4)),
                     "Q2_K": ((80, 2e-3), (82, 2e-3))}


def gguf_block_weight(rng: np.random.Generator, shape: tuple[int, ...], qtype: str) -> np.ndarray:
    """Random valid GGUF blocks of `qtype` for a weight of `shape` [..., out, in]: uint8
    [..., out, row bytes] (random codes, grid indices and signs; finite f16 scales)."""
    from . import gguf_blocks

    *lead, n_in = shape
    per_row = n_in // gguf_blocks.BLOCK_WEIGHTS[qtype]
    size = gguf_blocks.BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, (int(np.prod(lead)) * per_row, size), dtype=np.uint8)
    for at, scale in GGUF_SCALE_FIELDS[qtype]:
        d = (rng.uniform(0.2, 1.0, len(blocks)) * scale).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*lead, per_row * size)


def engram_table(rng: np.random.Generator, rows: int, width: int = 256):
    codes = encode_e4m3(np.clip(rng.normal(0, 1.5, (rows, width)), -448, 448))
    scales = rng.integers(120, 126, (rows, width // 32)).astype(np.uint8)
    return codes, scales


def official_tensors(args: ModelArgs, seed: int = 0) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of the official checkpoint for `args`, {name: (dtype, storage array)}."""
    rng = np.random.default_rng(seed)
    d, hc = args.hidden_size, args.hc_mult
    out: dict[str, tuple[str, np.ndarray]] = {}

    def bf16(name, shape, std, mean=0.0):
        out[name] = ("BF16", to_bf16_bits(rng.normal(mean, std, shape)))

    def f32(name, shape, std, mean=0.0):
        out[name] = ("F32", rng.normal(mean, std, shape).astype(np.float32))

    def fp8(name, out_dim, in_dim):
        w, s = fp8_block_weight(rng, out_dim, in_dim, in_dim ** -0.5)
        out[f"{name}.weight"] = ("F8_E4M3", w)
        out[f"{name}.scale"] = ("F8_E8M0", s)

    bf16("embed.weight", (args.vocab_size, d), 1.0)
    bf16("head.weight", (args.vocab_size, d), d ** -0.5)
    bf16("norm.weight", (d,), 0.1, 1.0)
    mix = (2 + hc) * hc
    primes = layer_primes(args)

    def block(p: str, i: int, experts: int) -> None:
        """Layer i's tensors under prefix p (a backbone layer or a draft stage)."""
        bf16(f"{p}.attn_norm.weight", (d,), 0.1, 1.0)
        bf16(f"{p}.ffn_norm.weight", (d,), 0.1, 1.0)
        for site in ("attn", "ffn"):
            f32(f"{p}.hc_{site}_fn", (mix, hc * d), 0.5 * (hc * d) ** -0.5)
            f32(f"{p}.hc_{site}_base", (mix,), 0.5)
            out[f"{p}.hc_{site}_scale"] = ("F32", rng.uniform(0.5, 1.5, 3).astype(np.float32))
        a = f"{p}.attn"
        f32(f"{a}.attn_sink", (args.num_attention_heads,), 1.0)
        fp8(f"{a}.wq_a", args.q_lora_rank, d)
        bf16(f"{a}.q_norm.weight", (args.q_lora_rank,), 0.1, 1.0)
        fp8(f"{a}.wq_b", args.num_attention_heads * args.head_dim, args.q_lora_rank)
        fp8(f"{a}.wkv", args.head_dim, d)
        bf16(f"{a}.kv_norm.weight", (args.head_dim,), 0.1, 1.0)
        group_in = args.num_attention_heads * args.head_dim // args.o_groups
        fp8(f"{a}.wo_a", args.o_groups * args.o_lora_rank, group_in)
        fp8(f"{a}.wo_b", d, args.o_groups * args.o_lora_rank)
        if i in args.kv_source_layer_ids:
            bf16(f"{a}.compressor.wkv.weight", (args.head_dim, d), d ** -0.5)
            if args.ratio(i) > 1:
                bf16(f"{a}.compressor.wgate.weight", (args.head_dim, d), d ** -0.5)
            bf16(f"{a}.compressor.norm.weight", (args.head_dim,), 0.1, 1.0)
        if i in args.index_source_layer_ids:
            fp8(f"{a}.indexer.wq_b", args.index_n_heads * args.index_head_dim, args.q_lora_rank)
            bf16(f"{a}.indexer.weights_proj.weight", (args.index_n_heads, d), d ** -0.5)
            if i in args.kv_source_layer_ids:
                bf16(f"{a}.indexer.wk.weight", (args.index_head_dim, args.head_dim), args.head_dim ** -0.5)
                bf16(f"{a}.indexer.k_norm.weight", (args.index_head_dim,), 0.1, 1.0)
        f = f"{p}.ffn"
        bf16(f"{f}.gate.weight", (experts, d), d ** -0.5)
        f32(f"{f}.gate.bias", (experts,), 0.05)
        f32(f"{f}.gate.bias_vl", (experts,), 0.05)
        inter = args.moe_intermediate_size
        for e in range(experts):
            for w, shape in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
                codes, scale = fp4_weight(rng, shape, shape[1] ** -0.5)
                out[f"{f}.experts.{e}.{w}.weight"] = ("I8", codes)
                out[f"{f}.experts.{e}.{w}.scale"] = ("F8_E8M0", scale)
        fp8(f"{f}.shared_experts.w1", inter, d)
        fp8(f"{f}.shared_experts.w3", inter, d)
        fp8(f"{f}.shared_experts.w2", d, inter)
        if i in args.engram_layer_ids:
            g = f"{p}.engram"
            codes, scales = engram_table(rng, int(primes[i].sum()), args.engram_head_dim)
            out[f"{g}.embed.weight"] = ("F8_E4M3", codes)
            out[f"{g}.embed.scale"] = ("F8_E8M0", scales)
            fp8(f"{g}.wkv", d * (hc + 1), args.engram_rows_per_token * args.engram_head_dim)
            bf16(f"{g}.q_weight", (hc, d), 1.0)
            bf16(f"{g}.k_weight", (hc, d), 1.0)

    for i in range(args.num_hidden_layers):
        block(f"layers.{i}", i, args.n_routed_experts)
    if not args.has_draft:
        return out
    # The draft stages draw from a generator of their own: the backbone's tensors are those
    # of the same seed without draft stages.
    rng = np.random.default_rng((seed, 1))
    stages, rank = args.num_nextn_predict_layers, args.dspark_markov_rank
    for s in range(stages):
        p = f"mtp.{s}"
        block(p, args.num_hidden_layers + s, args.dspark_n_routed_experts or args.n_routed_experts)
        if s == 0:
            fp8(f"{p}.main_proj", d, d * len(args.dspark_target_layer_ids))
            bf16(f"{p}.main_norm.weight", (d,), 0.1, 1.0)
        if s == stages - 1:
            bf16(f"{p}.norm.weight", (d,), 0.1, 1.0)
            bf16(f"{p}.markov_head.embed.weight", (args.vocab_size, rank), 1.0)
            bf16(f"{p}.markov_head.head.weight", (args.vocab_size, rank), rank ** -0.5)
            bf16(f"{p}.confidence_head.proj.weight", (1, d + rank), (d + rank) ** -0.5)
    return out


def write_sharded(path: Path, tensors: dict[str, tuple[str, np.ndarray]], shards: int) -> None:
    """Spread tensors over `shards` files in name order, with model.safetensors.index.json."""
    names = sorted(tensors)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        safetensors_file.write(path / file, {n: tensors[n] for n in group})
        weight_map.update({n: file for n in group})
    total = sum(a.nbytes for _, a in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def draft_config(num_hidden_layers: int, stages: int = 3) -> dict:
    """Config fields of DSpark draft stages shaped as V4.1's (three stages reading the streams
    entering the last three layers, blocks of 5), at toy widths: 4 routed experts, top-2
    (fewer than the backbone's, as the real stages have 128 of 384), Markov rank 16. The
    noise token is the pad id (the real model uses <｜System｜>, which the toy tokenizer lacks)."""
    n = num_hidden_layers
    return dict(num_nextn_predict_layers=stages, dspark_block_size=5, dspark_noise_token_id=2,
                dspark_target_layer_ids=list(range(n - 3, n)), dspark_markov_rank=16,
                dspark_n_routed_experts=4, dspark_num_experts_per_tok=2)


def write_tiny_checkpoint(path: Path | str, seed: int = 0, shards: int = 3,
                          config_overrides: Optional[dict] = None, draft: bool = False) -> Path:
    """Write a tiny official-layout checkpoint to `path` (created) and return it; with `draft`,
    also DSpark draft stages `mtp.*` (`draft_config`; overrides still win)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(512)
    overrides = dict(config_overrides or {})
    if draft:
        layers = overrides.get("num_hidden_layers", tiny_config()["text_config"]["num_hidden_layers"])
        ratios = overrides.get("compress_ratios", tiny_config()["text_config"]["compress_ratios"])
        fields = draft_config(layers)
        ratios = list(ratios[:layers]) + [0] * fields["num_nextn_predict_layers"]
        overrides = {**fields, "compress_ratios": ratios, **overrides}
    config = tiny_config(vocab_size=tokenizer.get_vocab_size(), **overrides)
    token_map = build_token_map(tokenizer)
    config["text_config"]["engram_compressed_vocab_size"] = int(token_map.max() + 1)
    args = ModelArgs.from_dict(config)
    config["text_config"]["engram_num_embeddings"] = [
        int(p.sum()) for p in layer_primes(args).values()]
    write_sharded(path, official_tensors(args, seed), shards)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": True, "model_max_length": 4096}, indent=1))
    return path
