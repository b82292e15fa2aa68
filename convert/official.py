"""Official DeepSeek V4.1 Flash checkpoint (FP8/FP4 safetensors) -> dsv4 model directory.

The tensor mapping and the lossless packing are `dsv4.layout.plan`'s (fp8 32x32 blocks ->
mxfp8, fp4 experts -> stacked mxfp4, BF16/F32 as they are), so a converted directory loads
bit-identically to the official directory. Optionally the routed experts and, separately, the
dense fp8 projections are requantized to MLX affine 2/3/4/8 bits: the packed weight is
dequantized exactly (bf16 holds every e4m3/e2m1 value times a power of two) and quantized with
`mx.quantize`; the relative error this adds, sqrt(sum |W' - W|^2 / sum |W|^2), is printed per
tensor kind and recorded in `config.json` (`dsv4.requantization`).

A dequantised upload of the official checkpoint (BF16/F32 weights, no `.scale` tensors, see
`dsv4.layout`) converts the same way: its float weights are written as they are (dense
projections as float Linears, experts stacked [E, out, in]), and the requantization options
quantize them from their values (an F32 weight rounded to bf16 first; the error counts that).
BF16/F32 Engram tables are referenced in place, or copied as they are stored.

MTP tensors (`mtp.*`) go verbatim (official names and packing) to `mtp.safetensors`, vision
tensors (`vision.*`, `aligner.*`, `image_*`, and the image routing bias `*.gate.bias_vl`) to
`vision.safetensors`. Engram tables are referenced where they lie in the source shards, or
copied to `engram-LL.bin` with `copy_engram`. The directory format is described in `writer.py`.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from dsv4.config import ModelArgs
from dsv4.engram_store import copy_reference, copy_table, open_table, stored_rows
from dsv4.layout import MXFP4, MXFP8, Item, engram_table_refs, plan
from dsv4.safetensors_file import Checkpoint, to_mx, view

from .writer import (FORMAT_VERSION, MAX_SHARD_BYTES, ConversionError, ModelDirWriter, Unit,
                     pick_rows)

AFFINE_BITS = (2, 3, 4, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
# Files next to the weights that a dsv4 directory keeps (tokenizer and generation defaults).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "*.model", "*.tiktoken")
_NEEDED = ("config.json", "model.safetensors.index.json", "*.safetensors")
MTP = re.compile(r"^mtp\.")
VISION = re.compile(r"^(vision\.|aligner\.|image_)|\.gate\.bias_vl$")
_HF_SNAPSHOT = re.compile(r"models--([^/]+)--([^/]+)/snapshots/([0-9a-f]{40})$")
# Rows dequantized and requantized at once (bounds the float copies to ~64 MB).
_REQUANT_ELEMENTS = 1 << 24
ERROR_KEY = "dsv4.requant_error."


@dataclass(frozen=True)
class Requant:
    """MLX affine quantization for a kind of weight."""
    bits: int
    group_size: int = 64

    def __post_init__(self):
        if self.bits not in AFFINE_BITS:
            raise ConversionError(f"requantization bits must be one of {AFFINE_BITS}, "
                                  f"got {self.bits}")
        if self.group_size not in AFFINE_GROUP_SIZES:
            raise ConversionError(f"requantization group size must be one of {AFFINE_GROUP_SIZES}, "
                                  f"got {self.group_size}")

    @property
    def quantization(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}


@dataclass(frozen=True)
class Source:
    path: Path
    repo: Optional[str]
    revision: Optional[str]


@dataclass
class Result:
    dst: Path
    shards: int                        # model-*.safetensors files
    bytes_written: int                 # all weight files
    requant_errors: dict[str, float]   # tensor kind -> relative error added
    verified_tensors: int


# --- the source ------------------------------------------------------------------------------

def resolve_source(src: str, revision: Optional[str] = None) -> Source:
    """A local directory, or a Hugging Face repo id fetched with only the files needed."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConversionError(f"{path}: the source must be a checkpoint directory")
        path = path.resolve()
        found = _HF_SNAPSHOT.search(path.as_posix())
        if found:
            return Source(path, f"{found[1]}/{found[2]}", found[3])
        return Source(path, None, revision)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", src):
        raise ConversionError(f"{src}: no such directory, and not a Hugging Face repo id")
    return download(src, revision)


def download(repo: str, revision: Optional[str]) -> Source:
    """Fetch the weights, config, index and tokenizer files (not the code, docs or images).
    Every shard is fetched, MTP/vision ones too: `Checkpoint` needs all that the index lists."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo, revision=revision,
                                      allow_patterns=[*_NEEDED, *TOKENIZER_FILES]))
    except Exception as e:  # offline, unknown repo, gated, bad revision: the hub says which
        raise ConversionError(f"{repo}: not a local directory, and fetching it from the Hugging "
                              f"Face Hub failed: {type(e).__name__}: {e}") from e
    found = _HF_SNAPSHOT.search(path.as_posix())
    return Source(path, repo, found[3] if found else revision)


def source_paths(source: Source) -> list[Path]:
    """What a conversion must leave alone: the checkpoint directory and every file in it (a
    Hugging Face snapshot's files are links into the cache's blobs; the writer resolves them)."""
    return [source.path, *source.path.iterdir()]


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path}: not found (an official checkpoint has a config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None


# --- units -----------------------------------------------------------------------------------

def tensor_kind(module: str) -> str:
    """`layers.7.ffn.experts.w1` -> `ffn.experts.w1` (what an error report groups by)."""
    return re.sub(r"^layers\.\d+\.", "", module)


def _weight_elements(item: Item) -> int:
    """Values of a quantized item's weight, from its sources (q.bits per value as stored)."""
    stored = sum(s.nbytes for s in item.sources if s.name.endswith(".weight"))
    return stored * 8 // item.quantization["bits"]


def lossless_unit(item: Item) -> Unit:
    q = item.quantization
    if q is None:
        return Unit(item.name, item.nbytes, item.produce)
    elements = _weight_elements(item)
    # mx packing keeps the weight bytes and adds one uint8 scale per group
    return Unit(item.name, elements * q["bits"] // 8 + elements // q["group_size"], item.produce)


def requantized_unit(item: Item, spec: Requant) -> Unit:
    """The item's weight (mxfp8/mxfp4 dequantized exactly, or float as stored) quantized to
    `spec`; the squared error and squared norm go to the shard metadata under
    `dsv4.requant_error.<module>`."""
    module = item.name.removesuffix(".weight")  # a float item is named by its tensor
    if item.quantization is None:
        elements = sum(int(np.prod(s.shape)) for s in item.sources)
        in_dim = item.sources[0].shape[-1]
    else:
        elements = _weight_elements(item)
        in_dim = item.sources[0].shape[-1] * 8 // item.quantization["bits"]
    if in_dim % spec.group_size:
        raise ConversionError(f"{item.sources[0].file.name}: tensor {item.sources[0].name} has "
                              f"{in_dim} inputs, not a multiple of the group size "
                              f"{spec.group_size}")
    # packed weight, then bf16 scales and biases (2 bytes each per group)
    nbytes = elements * spec.bits // 8 + 2 * 2 * (elements // spec.group_size)
    stats = {}

    def produce():
        lead, rows, exact = _weight_rows(item, item.produce())
        out, err2, ref2 = _requantize(rows, in_dim, exact, spec)
        stats["value"] = f"{err2!r},{ref2!r}"
        return {f"{module}.{k}": (dtype, a.reshape(*lead, a.shape[-1]))
                for k, (dtype, a) in out.items()}

    def metadata():
        return {ERROR_KEY + module: stats["value"]}

    def sample(rows, rng):
        # affine groups lie along a row, so requantizing some rows gives exactly their output
        lead, count, exact = _weight_rows(item, item.produce())
        picks = pick_rows(count, rows, rng)
        out, _, _ = _requantize(len(picks), in_dim, lambda some: exact(picks[some]), spec)
        return {f"{module}.{k}": (dtype, (*lead, a.shape[-1]), picks, a)
                for k, (dtype, a) in out.items()}
    return Unit(module, nbytes, produce, metadata, sample)


def _weight_rows(item: Item, produced: dict):
    """(leading dims, rows, rows -> their exact fp32 values) of an item's produced weight."""
    module = item.name.removesuffix(".weight")
    dtype, weight = produced[f"{module}.weight"]
    w_rows = weight.reshape(-1, weight.shape[-1])
    q = item.quantization
    if q is None:
        def exact(rows):
            return to_mx(np.ascontiguousarray(w_rows[rows]), dtype).astype(mx.float32)
    else:
        scales = produced[f"{module}.scales"][1]
        s_rows = scales.reshape(-1, scales.shape[-1])

        def exact(rows):
            return mx.dequantize(mx.array(np.ascontiguousarray(w_rows[rows])),
                                 mx.array(np.ascontiguousarray(s_rows[rows])),
                                 group_size=q["group_size"], bits=q["bits"], mode=q["mode"],
                                 dtype=mx.float32)
    return weight.shape[:-1], w_rows.shape[0], exact


def _requantize(n: int, in_dim: int, exact, spec: Requant):
    """Rows 0..n-1 of `exact(rows)` (fp32 [rows, in_dim]) -> affine (weight, scales, biases)
    [n, ...] and the squared error and norm, chunked by rows. Quantized from bf16, which holds
    every mxfp8/mxfp4 value (an F32 weight is rounded to it first; the error counts that)."""
    q_weight = np.empty((n, in_dim * spec.bits // 32), np.uint32)
    q_scales = np.empty((n, in_dim // spec.group_size), np.uint16)
    q_biases = np.empty_like(q_scales)
    err2 = ref2 = 0.0
    step = max(1, _REQUANT_ELEMENTS // in_dim)
    for first in range(0, n, step):
        rows = slice(first, min(first + step, n))
        ref = exact(rows)
        qw, qs, qb = mx.quantize(ref.astype(mx.bfloat16), group_size=spec.group_size,
                                 bits=spec.bits, mode="affine")
        # fp32 scales: with bf16 ones MLX would round every dequantized value to bf16
        back = mx.dequantize(qw, qs.astype(mx.float32), qb.astype(mx.float32),
                             group_size=spec.group_size, bits=spec.bits, mode="affine")
        e2, r2 = mx.sum(mx.square(back - ref)), mx.sum(mx.square(ref))
        mx.eval(qw, qs, qb, e2, r2)
        q_weight[rows] = np.array(qw)
        q_scales[rows] = np.array(qs.view(mx.uint16))
        q_biases[rows] = np.array(qb.view(mx.uint16))
        err2 += float(e2)
        ref2 += float(r2)
    return ({"weight": ("U32", q_weight), "scales": ("BF16", q_scales),
             "biases": ("BF16", q_biases)}, err2, ref2)


def side_units(ckpt: Checkpoint, pattern: re.Pattern) -> list[Unit]:
    """Tensors copied verbatim, one unit each, in name order."""
    return [Unit(name, ckpt[name].nbytes,
                 lambda info=ckpt[name]: {info.name: (info.dtype, view(info))})
            for name in sorted(ckpt.names()) if pattern.search(name)]


def quantization_block(modules: dict[str, dict]) -> dict:
    """mlx-lm's `quantization`: the most common quantization as the default, others listed."""
    if not modules:
        return {}
    counts = Counter(json.dumps(q, sort_keys=True) for q in modules.values())
    default = json.loads(counts.most_common(1)[0][0])
    block = dict(default)
    block.update({m: q for m, q in sorted(modules.items()) if q != default})
    return block


def requant_errors(metadata: dict[str, str]) -> dict[str, float]:
    """Relative error per tensor kind from the units' recorded squared error and norm."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for key, value in metadata.items():
        if key.startswith(ERROR_KEY):
            err2, ref2 = (float(v) for v in value.split(","))
            kind = sums[tensor_kind(key[len(ERROR_KEY):])]
            kind[0] += err2
            kind[1] += ref2
    return {k: (e / r) ** 0.5 if r > 0 else 0.0 for k, (e, r) in sorted(sums.items())}


def output_config(config: dict, source: Source, quantization: dict, engram: dict,
                  requant: dict, drop_vision: bool) -> dict:
    """The source config with `text_config` flattened, the quantization and dsv4 blocks."""
    out = {k: v for k, v in config.items() if k not in ("text_config", "quantization_config")}
    out.update(config.get("text_config", {}))
    if drop_vision:
        out.pop("vision_config", None)
    out["model_type"] = config.get("model_type", out.get("model_type", "deepseek_v41"))
    if quantization:
        out["quantization"] = quantization
    out["dsv4"] = {"format_version": FORMAT_VERSION,
                   "source": {"kind": "official", "repo": source.repo,
                              "revision": source.revision, "path": str(source.path)},
                   "engram": engram}
    if requant:
        out["dsv4"]["requantization"] = requant
    return out


# --- the conversion --------------------------------------------------------------------------

def convert(src: str | Path, dst: str | Path, *, revision: Optional[str] = None,
            experts: Optional[Requant] = None, dense: Optional[Requant] = None,
            drop_mtp: bool = False, drop_vision: bool = False, copy_engram: bool = False,
            overwrite: bool = False, resume: bool = False, verify: bool = False,
            verify_rows: int = 8, max_shard_bytes: int = MAX_SHARD_BYTES,
            progress: bool = True, log=print) -> Result:
    """Convert an official checkpoint (directory or HF repo id) into the dsv4 directory `dst`.
    Every input check runs before anything is written."""
    source = resolve_source(str(src), revision)
    config = read_config(source.path)
    args = ModelArgs.from_dict(config, source=str(source.path / "config.json"))
    ckpt = Checkpoint(source.path)
    items = plan(ckpt, args)
    engram = engram_table_refs(ckpt, args)

    units, modules = [], {}
    for item in items:
        spec = {MXFP4["mode"]: experts, MXFP8["mode"]: dense}.get(
            (item.official or {}).get("mode"))
        if spec is not None:
            units.append(requantized_unit(item, spec))
            modules[item.name.removesuffix(".weight")] = spec.quantization
        else:
            units.append(lossless_unit(item))
            if item.quantization is not None:
                modules[item.name] = dict(item.quantization)
    groups = {"model": units}
    if not drop_mtp and (mtp := side_units(ckpt, MTP)):
        groups["mtp"] = mtp
    if not drop_vision and (vision := side_units(ckpt, VISION)):
        groups["vision"] = vision

    fingerprint = {
        "source": str(source.path),
        "source_files": {p.name: p.stat().st_size
                         for p in sorted(source.path.glob("*.safetensors"))},
        "options": {"experts": experts and experts.quantization,
                    "dense": dense and dense.quantization,
                    "drop_mtp": drop_mtp, "drop_vision": drop_vision, "copy_engram": copy_engram},
    }
    verified = 0
    with ModelDirWriter(dst, fingerprint, overwrite=overwrite, resume=resume,
                        max_shard_bytes=max_shard_bytes, progress=progress,
                        sources=source_paths(source)) as out:
        engram_bytes = sum(r["rows"] * stored_rows(r, args.engram_head_dim).row_bytes
                           for r in engram.values()) if copy_engram else 0
        shards = out.write_weights(groups, other_bytes=engram_bytes)
        errors = requant_errors(out.metadata("model"))
        if verify:
            verified = out.verify(groups, rows=verify_rows)
        if copy_engram:
            engram = _copy_engram(engram, args.engram_head_dim, source.path, out, progress)
        requant = {}
        for kind, spec in (("experts", experts), ("dense", dense)):
            if spec is not None:
                requant[kind] = {**spec.quantization, "relative_error": {
                    k: e for k, e in errors.items() if _is_kind(k, kind)}}
        out.write_json("config.json", output_config(
            config, source, quantization_block(modules), engram, requant, drop_vision))
        for pattern in TOKENIZER_FILES:
            for path in sorted(source.path.glob(pattern)):
                out.copy_file(path)
        written = sum(s.nbytes for s in shards)
    for kind, error in errors.items():
        log(f"requantization error of {kind}: {error:.4%}")
    return Result(Path(dst), sum(s.group == "model" for s in shards), written, errors, verified)


def _is_kind(kind: str, what: str) -> bool:
    return (".experts." in f".{kind}.") == (what == "experts")


def _copy_engram(refs: dict, head_dim: int, src_dir: Path, out: ModelDirWriter,
                 progress: bool) -> dict:
    """Each table to `engram-LL.bin` in the model directory (skipped when a resumed run has it)."""
    copied = {}
    for layer, ref in refs.items():
        name = f"engram-{int(layer):02d}.bin"
        if out.exists(name):
            copied[layer] = copy_reference(stored_rows(ref, head_dim), out.path(name),
                                           ref["rows"], out.tmp)
            continue
        table = open_table(ref, src_dir, name=f"layer {layer} engram table", head_dim=head_dim)
        try:
            copied[layer] = copy_table(table, out.path(name), base_dir=out.tmp, progress=progress)
        finally:
            table.close()
    return copied
