"""ds4's DSpark support GGUF: V4.1's draft stages beside a ds4 text GGUF.

ds4 leaves V4.1's draft stages (`mtp.0..2`) out of its text GGUFs; `gguf-tools/deepseek41_dspark.py`
writes them to a separate support file from the checkpoint's shards 44-46 (~7.9 GiB), which
`ds4 --dspark --mtp-model FILE` loads beside the text file. `dsv4_convert gguf TEXT.gguf DST
--draft SUPPORT.gguf` converts both into one dsv4 model directory (convert/gguf.py writes it).

The support file:
- general.architecture `deepseek41-dspark` (`deepseek4-dspark` in some ds4 revisions; a V4 Flash
  drafter, with `e_proj`/`h_proj` and no `main_proj`, is refused);
- the stages' tensors under `mtp.<s>.`, named as the text file's `blk.<n>.` ones, plus
  `main_proj` and `main_norm` on the first stage and `norm`, `markov_head.markov_w1` (the Markov
  embedding), `markov_head.markov_w2` (its head) and `confidence_head.proj` on the last; the
  embedding and output head are the text file's (tied);
- in one of ds4's precisions: native (routed experts MXFP4, repacked bit for bit from the
  release; dense F16), bf16, q8, q4 or q2 (Q8_0 dense, K-quant or IQ2_XXS experts);
- DSpark metadata (`dspark.*`, `deepseek4.dspark.*` or `deepseek4.dspark_*`, by ds4 revision):
  it must agree with the text file's config, which takes from it the draft fields it lacks;
- the revision of the checkpoint it was converted from, which must be the text file's: a
  drafter is trained against its own target.
Tensors some writers add that the reference does not read are skipped: the image-routing bias
`exp_probs_b_vl` and `hc_head_*` (ds4's copy of the last stage's hc_ffn pre rows).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Optional

from dsv4.config import ModelArgs
from dsv4.layout import draft_tensors

from . import gguf
from .writer import ConversionError

ARCHITECTURES = ("deepseek41-dspark", "deepseek4-dspark")
_PREFIXES = ("dspark.", "deepseek4.dspark.", "deepseek4.dspark_")
# DSpark metadata names (after a prefix) -> the config field each one states
_FIELDS = {
    "block_size": "dspark_block_size", "markov_rank": "dspark_markov_rank",
    "noise_token_id": "dspark_noise_token_id", "target_layer_ids": "dspark_target_layer_ids",
    "expert_count": "dspark_n_routed_experts", "n_routed_experts": "dspark_n_routed_experts",
    "expert_used_count": "dspark_num_experts_per_tok",
    "num_experts_per_tok": "dspark_num_experts_per_tok",
    "stage_count": "num_nextn_predict_layers", "n_layers": "num_nextn_predict_layers",
    "window_size": "sliding_window", "embedding_length": "hidden_size", "hc_mult": "hc_mult",
    "vocab_size": "vocab_size", "target_block_count": "num_hidden_layers",
}
# what a drafter needs that neither its tensors' shapes nor defaults give
_REQUIRED = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
             "dspark_num_experts_per_tok")
_STAGE = re.compile(r"^mtp\.(\d+)\.(.+)$")
_HEADS = {"main_proj.weight": "main_proj.weight", "main_norm.weight": "main_norm.weight",
          "norm.weight": "norm.weight", "markov_head.markov_w1.weight": "markov_head.embed.weight",
          "markov_head.markov_w2.weight": "markov_head.head.weight",
          "confidence_head.proj.weight": "confidence_head.proj.weight"}
SKIPPED = re.compile(r"^mtp\.\d+\.(exp_probs_b_vl\.bias|hc_head_(fn|base|scale)\.weight)$")


def dsv4_name(gguf_name: str) -> Optional[str]:
    """The dsv4 (official) name of a support file's tensor, None if there is none."""
    m = _STAGE.match(gguf_name)
    if m is None:
        return None
    target = _HEADS.get(m.group(2)) or gguf.LAYER_NAMES.get(m.group(2))
    return f"mtp.{m.group(1)}.{target}" if target else None


def support_files_beside(text_file: Path) -> list[Path]:
    """Support files next to a text GGUF (named *dspark*.gguf, a DSpark architecture inside),
    for a hint when a conversion left them out."""
    found = []
    for path in sorted(Path(text_file).absolute().parent.glob("*.gguf")):
        if "dspark" in path.name.lower():
            try:
                if gguf.GGUFSource(path).get("general.architecture") in ARCHITECTURES:
                    found.append(path)
            except ConversionError:
                pass   # not readable: not one to suggest
    return found


def check_dialect(src: gguf.GGUFSource) -> None:
    arch = src.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise gguf.UnsupportedGGUF(f"{src.path}: not a DSpark support GGUF (general.architecture is "
                                   f"{arch!r}, expected 'deepseek41-dspark': ds4's "
                                   f"gguf-tools/deepseek41_dspark.py writes it)")
    v4 = sorted(n for n in src.tensors if re.search(r"\.(e_proj|h_proj)\.weight$", n))
    if v4 or "mtp.0.main_proj.weight" not in src.tensors:
        why = f"it has {v4[0]}" if v4 else "it has no mtp.0.main_proj.weight"
        raise gguf.UnsupportedGGUF(f"{src.path}: not V4.1's drafter ({why}; a DeepSeek V4 Flash "
                                   f"MTP/DSpark file?); V4.1's comes from its own checkpoint's "
                                   f"mtp.* shards through ds4's deepseek41_dspark.py")


def metadata_fields(src: gguf.GGUFSource) -> dict[str, object]:
    """The config fields the support file's DSpark metadata states; writers that state one
    twice must agree with themselves."""
    found: dict[str, tuple[str, object]] = {}
    for key in src.fields:
        name = next((key.removeprefix(p) for p in _PREFIXES if key.startswith(p)), None)
        field = _FIELDS.get(name) if name else None
        if field is None:
            continue
        value = src.get(key)
        value = [int(v) for v in value] if isinstance(value, list) else value
        if field in found and found[field][1] != value:
            raise ConversionError(f"{src.path}: metadata {found[field][0]} = {found[field][1]!r} but "
                                  f"{key} = {value!r}")
        found[field] = (key, value)
    return {field: value for field, (_, value) in found.items()}


def with_draft(config: dict, src: gguf.GGUFSource, text_src: gguf.GGUFSource) -> tuple[dict, ModelArgs]:
    """The text file's config with the draft fields: each one the support file states must
    equal the config's where the config has it, and is added where it does not."""
    text_rev, rev = text_src.get("general.source.revision"), src.get("general.source.revision")
    if text_rev and rev and text_rev != rev:
        raise ConversionError(f"{src.path}: converted from revision {rev} of the checkpoint, but "
                              f"{text_src.path} from {text_rev}: a drafter pairs only with the "
                              f"target it was trained with")
    config = copy.deepcopy(config)
    text = config.get("text_config", config)
    stated = metadata_fields(src)
    stages = {int(m.group(1)) for n in src.tensors if (m := _STAGE.match(n))}
    stated.setdefault("num_nextn_predict_layers", len(stages))
    problems = [f"{field} = {value!r} but {text_src.path.name}'s deepseek41.config has "
                f"{text[field]!r}" for field, value in stated.items()
                if field in text and not gguf.same_value(value, text[field])]
    if problems:
        raise ConversionError(f"{src.path}: DSpark metadata disagrees with the text file: " +
                              "; ".join(problems))
    for field, value in stated.items():
        text.setdefault(field, value)
    missing = [f for f in _REQUIRED if f not in text]
    if missing:
        raise ConversionError(f"{src.path}: neither its DSpark metadata nor {text_src.path.name}'s "
                              f"deepseek41.config give {', '.join(missing)}")
    return config, ModelArgs.from_dict(config, source=f"{text_src.path} with {src.path}")


def expected(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The draft stages' dsv4 tensors -> logical shapes, routed experts stacked."""
    return gguf.expected_logical(draft_tensors(args), args.dspark_n_routed_experts or args.n_routed_experts)
