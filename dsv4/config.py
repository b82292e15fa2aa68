"""ModelArgs: the model's configuration, read from Hugging Face or official config files.

Field names follow the Hugging Face `config.json` of DeepSeek V4.1 Flash (the names
mlx-lm uses too); `from_dict` also accepts the flat names of the official
`inference/config.json`. Layer roles (who compresses KV, who owns an indexer, who
reuses whose top-k) are derived here by small pure functions, never from layer
numbers written in code.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .errors import InputError

# official inference/config.json name -> our (HF) name
_OFFICIAL_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "rope_head_dim": "qk_rope_head_dim",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "engram_pad_token_id": "engram_pad_id",
    "n_mtp_layers": "num_nextn_predict_layers",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
_OFFICIAL_YARN = {"original_seq_len": "original_max_position_embeddings",
                  "rope_factor": "factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow"}


class ConfigError(InputError):
    """The configuration is missing a field or is inconsistent; the message names it."""


def read_json(file: Path) -> dict:
    """A JSON object from `file` (config.json, an index, tokenizer_config.json), or a
    ConfigError naming the file and what is wrong with it."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: not a text file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return data


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    model_type: str = "deepseek_v41"
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 1048576
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    num_nextn_predict_layers: int = 0
    # DSpark draft stages mtp.0.. (model-spec §7); 0 experts / top-k: the backbone's
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1

    @classmethod
    def from_dict(cls, config: dict[str, Any], source: str = "config") -> "ModelArgs":
        """Build from an HF config (flat or with `text_config`) or the official flat config."""
        params = dict(config)
        if "text_config" in params:
            params = {**params, **params["text_config"]}
        for old, new in _OFFICIAL_NAMES.items():
            if old in params and new not in params:
                params[new] = params[old]
        if "original_seq_len" in params and not params.get("rope_scaling"):
            params["rope_scaling"] = {"type": "yarn", **{
                new: params[old] for old, new in _OFFICIAL_YARN.items() if old in params}}
        names = {f.name: f for f in dataclasses.fields(cls)}
        missing = [n for n, f in names.items()
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and n not in params]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {missing}")
        kwargs = {n: params[n] for n in names if n in params}
        for n in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                  "engram_layer_ids", "engram_num_embeddings", "dspark_target_layer_ids"):
            if n in kwargs:
                kwargs[n] = tuple(int(v) for v in (kwargs[n] or ()))
        args = cls(**kwargs)
        args.validate(source)
        return args

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, tuple):
                out[k] = list(v)
        return out

    def validate(self, source: str = "config") -> None:
        def fail(msg: str) -> None:
            raise ConfigError(f"{source}: {msg}")

        n = self.num_hidden_layers
        if len(self.compress_ratios) < n:
            fail(f"compress_ratios has {len(self.compress_ratios)} entries, "
                 f"num_hidden_layers is {n}")
        for r in self.compress_ratios[:n]:
            if r not in (0, 1, 2):
                fail(f"compress ratio {r} is not supported by V4.1 (expected 0, 1 or 2)")
        if self.qk_rope_head_dim > self.head_dim or self.qk_rope_head_dim % 2:
            fail(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and <= head_dim")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            fail(f"o_groups {self.o_groups} must divide heads*head_dim")
        for layer in range(n):
            if self.ratio(layer) == 0:
                continue
            if self.kv_source(layer) is None:
                fail(f"layer {layer} compresses (ratio {self.ratio(layer)}) but no "
                     f"kv_source_layer_ids entry <= {layer} has a ratio > 0")
            if self.index_source(layer) is None:
                fail(f"layer {layer} compresses but no index_source_layer_ids entry <= {layer}")
        for layer in self.index_source_layer_ids:
            if layer < n and self.ratio(layer) == 0:
                fail(f"index source layer {layer} has ratio 0")
        for layer in self.engram_layer_ids:
            if not 0 <= layer < n:
                fail(f"engram layer {layer} is outside 0..{n - 1}")
        if self.engram_layer_ids and self.engram_num_embeddings and \
                len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            fail(f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
                 f"{len(self.engram_layer_ids)} engram layers")
        if self.has_draft:
            if not self.dspark_target_layer_ids or not all(0 <= l < n for l in self.dspark_target_layer_ids):
                fail(f"dspark_target_layer_ids {list(self.dspark_target_layer_ids)} must name layers 0..{n - 1}")
            stages = [self.ratio(n + s) for s in range(self.num_nextn_predict_layers)]
            if any(stages):
                fail(f"compress_ratios of the draft stages are {stages}: DSpark stages attend to a window only (0)")
            if not 0 <= self.dspark_noise_token_id < self.vocab_size:
                fail(f"dspark_noise_token_id {self.dspark_noise_token_id} is outside the vocabulary")

    # --- layer roles -------------------------------------------------------------------

    def ratio(self, layer: int) -> int:
        # Draft stages past the list have none (V4.1 lists its three as 0).
        return int(self.compress_ratios[layer]) if layer < len(self.compress_ratios) else 0

    def _latest(self, layers, layer: int) -> Optional[int]:
        found = [s for s in layers if s <= layer and s < self.num_hidden_layers and self.ratio(s)]
        return max(found) if found else None

    def kv_source(self, layer: int) -> Optional[int]:
        """The layer whose compressed KV (and index keys) `layer` reads."""
        return self._latest(self.kv_source_layer_ids, layer) if self.ratio(layer) else None

    def index_source(self, layer: int) -> Optional[int]:
        """The layer whose top-k indices `layer` attends with (itself if it owns an indexer)."""
        return self._latest(self.index_source_layer_ids, layer) if self.ratio(layer) else None

    def uses_candidates(self, layer: int) -> bool:
        """A re-index layer: its indexer scores inside the candidate source's mask."""
        c = self.candidate_source_layer_id
        return (layer in self.index_source_layer_ids and 0 <= c < layer
                and self.candidate_topk_blocks > 0)

    def is_candidate_source(self, layer: int) -> bool:
        return layer == self.candidate_source_layer_id and self.candidate_topk_blocks > 0

    @property
    def has_draft(self) -> bool:
        """The config describes DSpark draft stages (mtp.0..)."""
        return self.num_nextn_predict_layers > 0 and self.dspark_block_size > 0

    @property
    def engram_rows_per_token(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads
