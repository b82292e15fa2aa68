"""ds4 GGUF files of DeepSeek V4.1 Flash -> a dsv4 model directory.

    python -m dsv4_convert gguf DeepSeek-V4.1-Flash-Q2.gguf ~/models/v41-q2

Reads antirez's ds4 dialect (`general.architecture = "deepseek41"`, the HF config as the
JSON string `deepseek41.config`, Engram tables as I8 [264, rows] at the end of the file).
A file published as raw byte splits (`X.gguf.part1`, `X.gguf.part2`, ...) is read as given:
name the `.part1` and the others are found next to it. So are gguf-split shards
(`X-00001-of-00004.gguf`, llama.cpp's and gguf-py's way under 50 GB files): name any of them.

- Config: `deepseek41.config`, cross-checked against the typed `deepseek41.*` copies.
- Tokenizer: tokenizer.json rebuilt from `tokenizer.ggml.*` (convert/gguf_tokenizer.py).
- Engram: the hashing metadata (token map, primes, multipliers) must equal dsv4's; the tables
  stay in the GGUF and are referenced in place (264-byte rows at their absolute offset), or
  copied with --copy-engram. A table that straddles two parts of a byte-split file is
  referenced by all the parts (the store reads across them).
- Weights (types read per tensor): F16/F32/BF16 copied. Q8_0, Q4_K, Q2_K and IQ2_XXS blocks
  are kept as they are (quantization `{"mode": "gguf", "type": ...}`, the weight uint8
  [..., out, row bytes] in the GGUF's byte layout) and, like the Engram tables, referenced
  where they lie in the GGUF (`dsv4.tensors`: file or parts, offset, dtype, shape), so the
  conversion writes only the float tensors; --copy-weights writes the blocks into the shards
  instead (a self-contained directory). --affine maps them into MLX affine instead (Q8_0 and
  Q4_K exact, IQ2_XXS and Q2_K lossily, convert/gguf_quants.py, the added error reported per
  tensor kind); --dequantize bf16|f32 writes them as plain floats (dsv4.gguf_blocks' exact
  decoding: the full-precision reference of the same model). MXFP4 (ds4's native DSpark
  experts) becomes MLX mxfp4, bit for bit, unless dequantized. Mapping and dequantizing run in
  worker processes, in row tasks a few steps ahead of the writer.
- Draft stages (--draft): ds4 keeps V4.1's DSpark stages in a separate support GGUF; given
  it, they are converted as the text file's tensors are (convert/gguf_draft.py) into
  `mtp*.safetensors` and config.json's `dsv4.draft` (their quantization and references).
- Output through convert/writer.py: atomic, resumable, sharded. The report (config.json,
  `dsv4.conversion`) counts the errors of the modules converted by the run that finished;
  after --resume, those of shards written earlier are not in it.

Other dialects are recognised and refused: llama.cpp's `deepseek41` (different names, Engram
re-quantized) and `deepseek4` (V4 Flash) files.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Optional

import numpy as np
import typer
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES

from dsv4.atomic_file import atomic_file
from dsv4.config import ModelArgs
from dsv4.engram import build_token_map, layer_multipliers, layer_primes, table_sizes
from dsv4.errors import reported
from dsv4.layout import expected_tensors
from dsv4.progress import Progress
from dsv4.tensor_refs import recorded_path

from . import gguf_quants, gguf_tokenizer
from .writer import MAX_SHARD_BYTES, ConversionError, ModelDirWriter, Unit, pick_rows

ENGRAM_ENCODING = "e4m3_e8m0_32_row264"
ENGRAM_ROW_BYTES = 264
FLOAT_TYPES = {T.F32: ("F32", np.float32), T.F16: ("F16", np.float16), T.BF16: ("BF16", np.uint16),
               T.I32: ("I32", np.int32)}
DEQUANTIZED = {"bf16": 2, "f32": 4}  # --dequantize targets: bytes per weight
VIEWS = ("copy", "blocks")  # job modes whose output is a view of the mapped file: one task
IN_PLACE = "GGUF, in place"  # the report's target of referenced blocks
# Tensors ds4 writes that the text model does not use (image-token routing bias).
UNUSED = re.compile(r"^blk\.\d+\.exp_probs_b_vl\.bias$")
_TOP = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
        "output.weight": "head.weight"}
# blk.N.<suffix> -> layers.N.<dsv4 suffix>
LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    **{f"hc_{s}_{p}.weight": f"hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "attn_sinks.weight": "attn.attn_sink", "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight", "attn_q_b.weight": "attn.wq_b.weight",
    "attn_kv.weight": "attn.wkv.weight", "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight", "attn_output_b.weight": "attn.wo_b.weight",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_k.weight": "attn.indexer.wk.weight",
    "indexer.k_norm.weight": "attn.indexer.k_norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight", "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_gate_exps.weight": "ffn.experts.w1.weight", "ffn_up_exps.weight": "ffn.experts.w3.weight",
    "ffn_down_exps.weight": "ffn.experts.w2.weight",
    "engram_q_norm.weight": "engram.q_weight", "engram_k_norm.weight": "engram.k_weight",
    "engram_kv.weight": "engram.wkv.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_ENGRAM_TABLE = re.compile(r"^blk\.(\d+)\.engram_embd\.weight$")


class UnsupportedGGUF(ConversionError):
    """A GGUF of another model or another dialect; the message says which."""


def dsv4_name(gguf_name: str) -> Optional[str]:
    """The dsv4 tensor name of a GGUF tensor, None if there is none."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLK.match(gguf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    return None


# --- reading -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: T
    dims: tuple[int, ...]   # GGUF order, innermost (input) first
    offset: int             # absolute, in the concatenation of the parts
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (numpy) shape."""
        return tuple(reversed(self.dims))

    @property
    def byte_shape(self) -> tuple[int, ...]:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block * size)


def _read_header(path: Path, file: str) -> "_HeaderReader":
    try:
        return _HeaderReader(file)
    except (ValueError, IndexError, OSError) as e:
        raise ConversionError(f"{path}: not a readable GGUF file ({e})") from None


class _HeaderReader(GGUFReader):
    """gguf's reader, keeping tensor positions only: in a split file the data of later
    tensors lies in other parts, which the parts reader maps itself."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        self.tensor_infos = []
        for f in fields:
            _, name, _, dims, raw_dtype, offset = f.parts
            qtype = T(int(raw_dtype[0]))
            block, size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims.astype(np.int64)))
            self.tensor_infos.append(GGUFTensor(bytes(name).decode(), qtype,
                                                tuple(int(d) for d in dims),
                                                int(start_offs + offset[0]), n // block * size))
        self.tensors = []


_SHARD = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")   # gguf-split's shards (llama.cpp, gguf-py)


def _shards_of(path: Path) -> list[Path]:
    """Every shard of the gguf-split set `path` names (any of them), in order; [] if it names none."""
    m = _SHARD.match(path.name)
    if m is None:
        return []
    count = int(m.group(3))
    shards = [path.with_name(f"{m.group(1)}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise ConversionError(f"{path}: shard {missing[0]} of the {count} is missing")
    return shards


def _parts_of(path: Path) -> list[Path]:
    if not path.name.endswith(".part1"):
        return [path]
    stem = path.name[: -len("1")]
    parts, k = [], 1
    while (path.parent / f"{stem}{k}").is_file():
        parts.append(path.parent / f"{stem}{k}")
        k += 1
    return parts


_MAPS: dict[tuple, np.memmap] = {}  # per process: (path, size, mtime) -> the mapped file


def _mapped(path: str) -> np.memmap:
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)  # a file written again is mapped again
    if key not in _MAPS:
        _MAPS[key] = np.memmap(path, np.uint8, mode="r")
    return _MAPS[key]


def read_bytes(parts: tuple[tuple[str, int], ...], offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` at `offset` of the parts' concatenation: a zero-copy view when they lie in
    one part (they nearly always do), else a copy."""
    pieces, start = [], 0
    for path, size in parts:
        lo, hi = max(offset, start), min(offset + nbytes, start + size)
        if lo < hi:
            pieces.append(_mapped(path)[lo - start: hi - start])
        start += size
    got = sum(len(p) for p in pieces)
    if got != nbytes:
        raise ConversionError(f"{parts[-1][0]}: bytes {offset}..{offset + nbytes} are past the "
                              f"end of the file (truncated download?)")
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class GGUFSource:
    """A GGUF file, its raw byte splits (X.gguf.part1, ...: one GGUF cut into pieces) or its
    gguf-split shards (X-00001-of-0000N.gguf: each a GGUF with its own tensors, the metadata in
    the first): metadata fields and tensor positions in the concatenation of the files."""

    def __init__(self, path: Path | str):
        path = Path(path).absolute()
        if not path.is_file():
            raise ConversionError(f"{path}: file not found")
        self.path = path
        shards = _shards_of(path)
        self.parts = tuple((str(p), p.stat().st_size) for p in shards or _parts_of(path))
        if shards:
            self._read_shards()
        else:
            reader = _read_header(path, self.parts[0][0])
            self.fields = reader.fields
            self.tensors = {t.name: t for t in reader.tensor_infos}
        size = sum(n for _, n in self.parts)
        for t in self.tensors.values():
            if t.offset + t.nbytes > size:
                raise ConversionError(
                    f"{path}: tensor {t.name} ends at byte {t.offset + t.nbytes}, but the file"
                    f"{' parts have' if len(self.parts) > 1 else ' has'} {size} bytes (truncated "
                    f"download{', or a missing part' if path.name.endswith('.part1') else ''}?)")

    def _read_shards(self) -> None:
        """Fields from the first shard, tensors from each, at their shard's place in the
        concatenation; every shard says which of how many it is."""
        self.fields, self.tensors, start = {}, {}, 0
        for k, (file, size) in enumerate(self.parts):
            reader = _read_header(self.path, file)
            no, count = (reader.fields.get(f"split.{key}") for key in ("no", "count"))
            if no is None or count is None or (no.contents(), count.contents()) != (k, len(self.parts)):
                said = "no split.no / split.count" if no is None or count is None else \
                    f"split.no {no.contents()} of split.count {count.contents()}"
                raise ConversionError(f"{file}: a gguf-split shard with {said}, expected shard {k} "
                                      f"of {len(self.parts)} (0-based)")
            if k == 0:
                self.fields = reader.fields
            for t in reader.tensor_infos:
                if t.name in self.tensors:
                    raise ConversionError(f"{file}: tensor {t.name} is in an earlier shard too")
                if t.offset + t.nbytes > size:
                    raise ConversionError(f"{file}: tensor {t.name} ends at byte {t.offset + t.nbytes}, "
                                          f"but the shard has {size} bytes (truncated download?)")
                self.tensors[t.name] = dataclasses.replace(t, offset=start + t.offset)
            start += size
        declared = self.get("split.tensors.count")
        if declared is not None and declared != len(self.tensors):
            raise ConversionError(f"{self.parts[0][0]}: split.tensors.count is {declared}, but the "
                                  f"{len(self.parts)} shards hold {len(self.tensors)} tensors")

    def has(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default=None):
        f = self.fields.get(key)
        return default if f is None else f.contents()

    def need(self, key: str):
        if key not in self.fields:
            raise ConversionError(f"{self.path}: metadata key {key} is missing")
        return self.fields[key].contents()

    def raw(self, t: GGUFTensor) -> np.ndarray:
        return read_bytes(self.parts, t.offset, t.nbytes)

    def locate(self, offset: int, nbytes: int) -> Optional[tuple[str, int]]:
        """(part file, offset in it) when the byte range lies within one part, else None."""
        start = 0
        for path, size in self.parts:
            if start <= offset and offset + nbytes <= start + size:
                return path, offset - start
            start += size
        return None


def check_dialect(src: GGUFSource) -> None:
    arch = src.get("general.architecture")
    names = set(src.tensors)
    if arch == "deepseek4":
        raise UnsupportedGGUF(f"{src.path}: a DeepSeek V4 Flash GGUF (general.architecture "
                              f"'deepseek4', ds4 or llama.cpp); dsv4 converts V4.1 Flash files "
                              f"only for now")
    if arch != "deepseek41":
        raise UnsupportedGGUF(f"{src.path}: not a DeepSeek V4.1 Flash GGUF "
                              f"(general.architecture is {arch!r}, expected 'deepseek41')")
    ds4 = src.has("deepseek41.config") and any(_ENGRAM_TABLE.match(n) for n in names)
    if not ds4:
        llama_cpp = any(re.search(r"\.engram_(wkv|q|k)\.", n) for n in names) or \
            src.has("deepseek41.engram.head_count")
        what = ("a llama.cpp-dialect V4.1 GGUF (llama.cpp PR #28696 names, Engram tables "
                "re-quantized, lossy)" if llama_cpp else
                "a deepseek41 GGUF without ds4's `deepseek41.config` key and Engram tables")
        raise UnsupportedGGUF(f"{src.path}: {what}; dsv4 reads antirez's ds4 files "
                              f"(antirez/deepseek-v4.1-flash-gguf) or the official checkpoint")


# --- configuration ---------------------------------------------------------------------------

def read_config(src: GGUFSource) -> tuple[dict, ModelArgs]:
    """The HF config from `deepseek41.config`, every typed `deepseek41.*` copy checked."""
    try:
        config = json.loads(src.need("deepseek41.config"))
    except json.JSONDecodeError as e:
        raise ConversionError(f"{src.path}: deepseek41.config is not JSON ({e})") from None
    text = config.get("text_config", config)
    problems = []
    for key in src.fields:
        if not key.startswith("deepseek41.") or key.startswith(("deepseek41.engram.",)) or \
                key in ("deepseek41.config", "deepseek41.quantization", "deepseek41.calibration"):
            continue
        name = key.removeprefix("deepseek41.")
        if name.startswith("rope_scaling."):
            expected = (text.get("rope_scaling") or {}).get(name.removeprefix("rope_scaling."))
        else:
            expected = text.get(name)
        if expected is None:
            continue  # a key ds4 adds that the config does not spell out: nothing to compare
        got = src.get(key)
        if name == "compress_ratios":
            expected = expected[: text["num_hidden_layers"]]
        if not same_value(got, expected):
            problems.append(f"{key} = {got!r} but deepseek41.config has {name} = {expected!r}")
    if problems:
        raise ConversionError(f"{src.path}: metadata disagrees with deepseek41.config: " +
                              "; ".join(problems))
    return config, ModelArgs.from_dict(config, source=f"{src.path}: deepseek41.config")


def same_value(got, expected) -> bool:
    """A GGUF metadata value equals a config value (f32 floats compared in f32)."""
    if isinstance(expected, (list, tuple)):
        return isinstance(got, list) and len(got) == len(expected) and \
            all(same_value(g, e) for g, e in zip(got, expected))
    if isinstance(expected, bool) or isinstance(got, (str, bool)):
        return got == expected
    if isinstance(got, float):  # stored as f32
        return np.float32(got) == np.float32(expected)
    return got == expected


def read_tokenizer(src: GGUFSource):
    model = src.need("tokenizer.ggml.model")
    if model != "gpt2":
        raise ConversionError(f"{src.path}: tokenizer.ggml.model is {model!r}, expected 'gpt2' "
                              f"(byte-level BPE)")
    return gguf_tokenizer.build(
        src.need("tokenizer.ggml.tokens"), src.need("tokenizer.ggml.token_type"),
        src.need("tokenizer.ggml.merges"), src.need("tokenizer.ggml.pre"),
        src.need("tokenizer.ggml.bos_token_id"), src.need("tokenizer.ggml.eos_token_id"),
        src.get("tokenizer.ggml.add_bos_token", True), src.get("tokenizer.ggml.add_eos_token", False),
        source=str(src.path))


def check_engram(src: GGUFSource, args: ModelArgs, tokenizer) -> dict[int, GGUFTensor]:
    """The Engram metadata equals dsv4's hashing; the tables, by layer."""
    where = f"{src.path}: deepseek41.engram"
    layers = list(args.engram_layer_ids)
    encoding = src.need("deepseek41.engram.encoding")
    if encoding != ENGRAM_ENCODING:
        raise ConversionError(f"{where}.encoding is {encoding!r}, expected {ENGRAM_ENCODING!r}")

    def expect(key, got, want):
        if not np.array_equal(np.asarray(got, np.int64), np.asarray(want, np.int64)):
            g, w = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
            at = int(np.flatnonzero(g[: len(w)] != w[: len(g)])[0]) if len(g) == len(w) else None
            detail = (f"first difference at index {at}: {g[at]} vs {w[at]}" if at is not None
                      else f"{len(g)} entries, expected {len(w)}")
            raise ConversionError(f"{where}.{key} disagrees with dsv4's Engram hashing ({detail})")

    expect("layer_ids", src.need("deepseek41.engram.layer_ids"), layers)
    rows = table_sizes(args)
    expect("rows", src.need("deepseek41.engram.rows"), rows)
    if args.engram_num_embeddings and list(args.engram_num_embeddings) != list(rows):
        raise ConversionError(f"{src.path}: deepseek41.config engram_num_embeddings "
                              f"{list(args.engram_num_embeddings)} disagree with the table sizes "
                              f"of dsv4's Engram hashing {list(rows)}")
    primes = layer_primes(args)
    expect("primes", src.need("deepseek41.engram.primes"),
           np.concatenate([primes[l].reshape(-1) for l in layers]))
    expect("multipliers", src.need("deepseek41.engram.multipliers"),
           np.concatenate([layer_multipliers(args, l) for l in layers]))
    token_map = build_token_map(tokenizer)
    expect("token_map", src.need("deepseek41.engram.token_map"), token_map)
    expect("compressed_vocab_size", [src.need("deepseek41.engram.compressed_vocab_size")],
           [args.engram_compressed_vocab_size or token_map.max() + 1])
    expect("pad_id", [src.need("deepseek41.engram.pad_id")], [token_map[args.engram_pad_id]])
    tables = {}
    for layer, n in zip(layers, rows):
        t = src.tensors.get(f"blk.{layer}.engram_embd.weight")
        if t is None:
            raise ConversionError(f"{src.path}: tensor blk.{layer}.engram_embd.weight (Engram "
                                  f"table of layer {layer}) is missing")
        if t.qtype != T.I8 or t.dims != (ENGRAM_ROW_BYTES, n):
            raise ConversionError(f"{src.path}: tensor {t.name} is {t.qtype.name}{list(t.dims)}, "
                                  f"expected I8[{ENGRAM_ROW_BYTES}, {n}]")
        tables[layer] = t
    return tables


def engram_references(src: GGUFSource, tables: dict[int, GGUFTensor]) -> dict[str, dict]:
    from dsv4.engram_store import interleaved_reference

    refs = {}
    for layer, t in tables.items():
        place = src.locate(t.offset, t.nbytes)
        if place is None:  # it straddles parts: the store reads the concatenation
            refs[str(layer)] = interleaved_reference([p for p, _ in src.parts], t.offset, t.dims[1])
        else:
            refs[str(layer)] = interleaved_reference(place[0], place[1], t.dims[1])
    return refs


# --- tensors -----------------------------------------------------------------------------------

def expected_logical(tensors: dict, experts: int) -> dict[str, tuple[int, ...]]:
    """Official tensors (dsv4.layout.expected_tensors, draft_tensors) -> dsv4 name -> logical
    shape (before packing), the `experts` routed experts of a layer stacked."""
    out = {}
    expert = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.\d+\.(w[123])\.weight$")
    for name, (dtype, shape) in tensors.items():
        if name.endswith(".scale"):
            continue
        m = expert.match(name)
        if m:
            out[f"{m.group(1)}.{m.group(2)}.weight"] = (experts, shape[0], shape[1] * 2)
        else:
            out[name] = tuple(shape)
    return out


@dataclass
class Options:
    """What becomes of the quantized tensors: GGUF blocks kept (referenced in the GGUF, or
    copied), mapped into MLX affine, or dequantized."""
    iq2_xxs_bits: int = 3
    q2_k_bits: int = 4
    dequantize: Optional[str] = None   # "bf16" or "f32": quantized tensors as plain floats
    affine: bool = False               # MLX affine (the bits above) instead of GGUF blocks
    copy_weights: bool = False         # kept blocks written into the shards, not referenced

    def __post_init__(self):
        if self.dequantize is not None and self.dequantize not in DEQUANTIZED:
            raise ConversionError(f"dequantize to {self.dequantize!r}: expected one of "
                                  f"{list(DEQUANTIZED)}")
        if self.affine and self.dequantize:
            raise ConversionError("--affine and --dequantize exclude each other")
        if self.copy_weights and (self.affine or self.dequantize):
            raise ConversionError("--copy-weights applies to GGUF blocks kept as they are; "
                                  "--affine and --dequantize write their weights anyway")

    @property
    def mode(self) -> str:
        """The job mode of a quantized tensor."""
        return self.dequantize or ("affine" if self.affine else "blocks")

    def bits(self, qtype: T) -> int:
        return {T.IQ2_XXS: self.iq2_xxs_bits, T.Q2_K: self.q2_k_bits}.get(
            qtype, gguf_quants.DEFAULT_BITS.get(qtype, 0))


@dataclass
class _Job:
    """What a worker needs to produce rows [first, last) of one module (picklable)."""
    parts: tuple
    tensor: GGUFTensor
    name: str            # dsv4 tensor name
    mode: str            # "copy" (floats), "blocks" (GGUF bytes), "affine", "bf16" or "f32"
    bits: int = 0
    first: int = 0       # rows of the tensor flattened to [rows, inputs]
    last: int = 0


CHUNK_WEIGHTS = 1 << 25  # weights per worker task: ~16-64 MB of output


def run_job(job: _Job) -> tuple[dict, float, float]:
    """(tensors of rows first..last as [rows, ...], squared error added, squared norm of the
    source) for one task; copies return the whole tensor in its shape."""
    t = job.tensor
    if job.mode in VIEWS:
        raw = read_bytes(job.parts, t.offset, t.nbytes)
        if job.mode == "blocks":
            return {job.name: ("U8", raw.reshape(t.byte_shape))}, 0.0, 0.0
        dtype, storage = FLOAT_TYPES[t.qtype]
        return {job.name: (dtype, raw.view(storage).reshape(t.shape))}, 0.0, 0.0
    row_bytes = t.byte_shape[-1]
    raw = read_bytes(job.parts, t.offset + job.first * row_bytes, (job.last - job.first) * row_bytes)
    raw = raw.reshape(job.last - job.first, row_bytes)
    if t.qtype == T.MXFP4:
        weight, scales = gguf_quants.mxfp4(raw)
        if job.mode not in DEQUANTIZED:
            module = job.name.removesuffix(".weight")
            return {f"{module}.weight": ("U32", weight), f"{module}.scales": ("U8", scales)}, 0.0, 0.0
    if job.mode in DEQUANTIZED:
        import mlx.core as mx

        from dsv4 import gguf_blocks

        if t.qtype == T.MXFP4:
            values = mx.dequantize(mx.array(weight), mx.array(scales), group_size=32, bits=4,
                                   mode="mxfp4", dtype=mx.float32)
        else:
            values = gguf_blocks.dequantize(mx.array(raw), t.qtype.name)  # the runtime's decoder
        if job.mode == "f32":
            return {job.name: ("F32", np.array(values))}, 0.0, 0.0
        return {job.name: ("BF16", np.array(values.astype(mx.bfloat16).view(mx.uint16)))}, 0.0, 0.0
    try:
        a = gguf_quants.to_affine(raw, t.qtype, job.bits)
    except gguf_quants.QuantError as e:
        raise ConversionError(f"tensor {t.name} rows {job.first}..{job.last}: {e}") from None
    module = job.name.removesuffix(".weight")
    dtype = "F16" if a.scales.dtype == np.float16 else "F32"
    return ({f"{module}.weight": ("U32", a.weight), f"{module}.scales": (dtype, a.scales),
             f"{module}.biases": (dtype, a.biases)}, a.err_sq, a.ref_sq)


def _tasks(job: _Job) -> list[_Job]:
    """A module's rows cut into worker tasks of at most CHUNK_WEIGHTS weights."""
    if job.mode in VIEWS:
        return [job]
    rows = int(np.prod(job.tensor.shape[:-1]))
    step = max(1, CHUNK_WEIGHTS // job.tensor.shape[-1])
    return [_Job(job.parts, job.tensor, job.name, job.mode, job.bits, r, min(r + step, rows))
            for r in range(0, rows, step)]


class _Ahead:
    """Produces modules in plan order; their tasks run on worker processes, at most
    `window` tasks ahead of the module being written, so memory holds one module and a
    few tasks whatever the sizes (a stacked expert tensor can be a GB)."""

    def __init__(self, jobs: dict[str, _Job], workers: int):
        self.tasks = {name: _tasks(job) for name, job in jobs.items()}
        self.queue = [(name, k) for name, ts in self.tasks.items() for k in range(len(ts))]
        self.pos = {key: i for i, key in enumerate(self.queue)}
        # spawned, not forked: MLX (the decoders) hangs in a child forked after it started
        self.pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1 else None
        self.window = workers + 1
        self.pending: dict[tuple[str, int], concurrent.futures.Future] = {}

    def _result(self, key: tuple[str, int]):
        name, k = key
        if self.pool is None or self.tasks[name][k].mode in VIEWS:
            return run_job(self.tasks[name][k])
        first = self.pos[key]
        for ahead in self.queue[first: first + self.window]:
            if ahead not in self.pending and self.tasks[ahead[0]][ahead[1]].mode not in VIEWS:
                self.pending[ahead] = self.pool.submit(run_job, self.tasks[ahead[0]][ahead[1]])
        return self.pending.pop(key).result()

    def get(self, name: str) -> tuple[dict, float, float]:
        """The module's tensors in their final shapes, with its summed error terms."""
        tasks = self.tasks[name]
        tensors, err_sq, ref_sq = self._result((name, 0))
        if tasks[0].mode in VIEWS:
            return tensors, err_sq, ref_sq
        rows, lead = tasks[-1].last, tasks[0].tensor.shape[:-1]
        out = {}
        for n, (dtype, a) in tensors.items():
            out[n] = (dtype, np.empty((rows, a.shape[-1]), a.dtype))
            out[n][1][: tasks[0].last] = a
        del tensors
        for k in range(1, len(tasks)):
            part, e, r = self._result((name, k))
            for n, (_, a) in part.items():
                out[n][1][tasks[k].first: tasks[k].last] = a
            err_sq, ref_sq = err_sq + e, ref_sq + r
        return {n: (d, a.reshape(*lead, a.shape[-1])) for n, (d, a) in out.items()}, err_sq, ref_sq

    def close(self) -> None:
        if self.pool is not None:
            for f in self.pending.values():
                f.cancel()
            self.pool.shutdown(wait=True)


def _kind(name: str) -> str:
    return re.sub(r"^(layers|mtp)\.\d+\.", r"\1.*.", name.removesuffix(".weight"))


@dataclass
class KindStats:
    source: str
    target: str
    tensors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    err_sq: float = 0.0
    ref_sq: float = 0.0

    def summary(self) -> dict:
        out = {"from": self.source, "to": self.target, "tensors": self.tensors,
               "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}
        if self.ref_sq:
            out["added_relative_rms_error"] = float(np.sqrt(self.err_sq / self.ref_sq))
        return out


def _not_weights(gguf_name: str) -> bool:
    """A text file's tensor that is no model weight: an Engram table, the image-routing bias."""
    return bool(_ENGRAM_TABLE.match(gguf_name) or UNUSED.match(gguf_name))


def plan(src: GGUFSource, expected: dict[str, tuple[int, ...]], options: Options,
         name_of: Callable[[str], Optional[str]] = dsv4_name, skipped: Callable[[str], bool] = _not_weights):
    """(jobs by dsv4 name in order, their output bytes, stats by kind, quantization by module,
    references by tensor name); every tensor of `expected` (dsv4 name -> logical shape, as
    `expected_logical` gives) present with its shape, every GGUF tensor but the `skipped`
    accounted for (`name_of` names it), each either a job or (kept blocks, not copied) a
    reference. MXFP4 becomes MLX mxfp4 (exact) unless dequantized."""
    jobs: dict[str, _Job] = {}
    problems, unknown = [], []
    for t in src.tensors.values():
        if skipped(t.name):
            continue
        name = name_of(t.name)
        if name is None or name not in expected:
            unknown.append(t.name)
            continue
        if t.shape != expected[name]:
            problems.append(f"tensor {t.name} ({name}) has shape {list(t.shape)}, expected "
                            f"{list(expected[name])}")
            continue
        if t.qtype in FLOAT_TYPES:
            jobs[name] = _Job(src.parts, t, name, "copy")
        elif t.qtype in gguf_quants.MAPPERS:
            if t.shape[-1] % gguf_quants.BLOCK_WEIGHTS[t.qtype]:
                problems.append(f"tensor {t.name}: {t.qtype.name} needs inputs in multiples of "
                                f"{gguf_quants.BLOCK_WEIGHTS[t.qtype]}, has {t.shape[-1]}")
                continue
            jobs[name] = _Job(src.parts, t, name, options.mode, options.bits(t.qtype))
        elif t.qtype == T.MXFP4 and t.shape[-1] % 32 == 0:
            jobs[name] = _Job(src.parts, t, name, options.dequantize or "mxfp4")
        else:
            problems.append(f"tensor {t.name} has type {t.qtype.name}{list(t.shape)}, which ds4 files "
                            f"do not use (expected F16, F32, BF16, Q8_0, Q4_K, Q2_K, IQ2_XXS, or "
                            f"MXFP4 of whole 32-value blocks)")
    missing = sorted(set(expected) - set(jobs))
    problems += [f"tensor for {n} is missing" for n in missing[:10]]
    problems += [f"unexpected tensor {n}" for n in sorted(unknown)[:10]]
    if problems:
        raise ConversionError(f"{src.path}: " + "; ".join(problems[:12]) +
                              (f" (and {len(problems) - 12} more)" if len(problems) > 12 else ""))
    stats: dict[str, KindStats] = {}
    quantization: dict[str, dict] = {}
    sizes: dict[str, int] = {}
    references: dict[str, dict] = {}
    for name in sorted(jobs):
        job = jobs[name]
        t = job.tensor
        rows = int(np.prod(t.shape[:-1]))
        module = name.removesuffix(".weight")
        if job.mode == "copy":
            target, nbytes = t.qtype.name, t.nbytes
        elif job.mode == "blocks":  # resident at their GGUF size, wherever they are stored
            target, nbytes = "GGUF blocks" if options.copy_weights else IN_PLACE, t.nbytes
            quantization[module] = {"mode": "gguf", "type": t.qtype.name}
            if not options.copy_weights:
                references[name] = tensor_reference(src, t)
        elif job.mode in DEQUANTIZED:
            target, nbytes = job.mode.upper(), DEQUANTIZED[job.mode] * rows * t.shape[-1]
        elif job.mode == "mxfp4":   # the same 17 bytes a block, moved into MLX's arrays
            target, nbytes = "MLX mxfp4", t.nbytes
            quantization[module] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        else:
            target = f"affine {job.bits}-bit g32"
            nbytes = gguf_quants.affine_nbytes(t.qtype, job.bits, rows, t.shape[-1])
            quantization[module] = {"group_size": gguf_quants.GROUP, "bits": job.bits,
                                    "mode": "affine"}
        s = stats.setdefault(f"{_kind(name)} ({t.qtype.name})", KindStats(t.qtype.name, target))
        s.tensors += 1
        s.bytes_in += t.nbytes
        s.bytes_out += nbytes
        sizes[name] = nbytes
    written = {n: jobs[n] for n in sorted(jobs) if n not in references}
    return written, sizes, stats, quantization, references


def tensor_reference(src: GGUFSource, t: GGUFTensor) -> dict:
    """Where the runtime reads a tensor's blocks: uint8 `shape` = [..., out, row bytes] at
    `offset` of `file`, or of the concatenation of `parts` when the bytes straddle two parts
    of a byte-split file (paths recorded as the Engram tables' are)."""
    place = src.locate(t.offset, t.nbytes)
    if place is None:
        where = {"parts": [recorded_path(p, None) for p, _ in src.parts], "offset": t.offset}
    else:
        where = {"file": recorded_path(place[0], None), "offset": place[1]}
    return {**where, "dtype": "U8", "shape": list(t.byte_shape)}


def verify_references(src: GGUFSource, references: dict[str, dict], model_dir: Path,
                      rows: int = 8, seed: int = 0, name_of: Callable[[str], Optional[str]] = dsv4_name) -> int:
    """Read each referenced tensor as the runtime does (dsv4.tensor_refs) and compare sampled
    rows (first, last, random) with the GGUF tensor's rows where the header places them;
    returns the number of tensors checked."""
    from dsv4 import tensor_refs

    rng = np.random.default_rng(seed)
    by_name = {name_of(t.name): t for t in src.tensors.values()}
    for name, ref in references.items():
        t = by_name[name]
        if ref["dtype"] != "U8" or tuple(ref["shape"]) != t.byte_shape:
            raise ConversionError(f"reference of {name} is {ref['dtype']}{ref['shape']}, expected "
                                  f"U8{list(t.byte_shape)} (verification failed)")
        row_bytes = t.byte_shape[-1]
        got = tensor_refs.read(name, ref, model_dir).reshape(-1, row_bytes)
        for r in pick_rows(len(got), rows, rng):
            want = read_bytes(src.parts, t.offset + int(r) * row_bytes, row_bytes)
            if not np.array_equal(got[r], want):
                raise ConversionError(f"{ref.get('file') or ref['parts'][0]}: the reference of "
                                      f"{name} reads row {r} wrong (verification failed)")
    return len(references)


def quantization_block(per_module: dict[str, dict]) -> Optional[dict]:
    """mlx-lm's block: the most common setting as default, the other modules listed."""
    if not per_module:
        return None
    counts = Counter(json.dumps(q, sort_keys=True) for q in per_module.values())
    default = json.loads(counts.most_common(1)[0][0])
    block = dict(default)
    for module, q in sorted(per_module.items()):
        if q != default:
            block[module] = q
    return block


# --- the conversion --------------------------------------------------------------------------

def convert(source: Path | str, dst: Path | str, options: Optional[Options] = None, workers: int = 0,
            copy_engram: bool = False, overwrite: bool = False, resume: bool = False,
            verify: bool = False, progress: bool = True,
            max_shard_bytes: int = MAX_SHARD_BYTES, draft: Optional[Path | str] = None) -> dict:
    """Convert a ds4 GGUF into the dsv4 model directory `dst`; returns the per-kind report.
    `draft`: ds4's DSpark support GGUF of the same checkpoint (convert/gguf_draft.py), whose
    draft stages go to `mtp*.safetensors` and `dsv4.draft`, treated as the text file's tensors."""
    from . import gguf_draft

    options = options or Options()
    src = GGUFSource(source)
    check_dialect(src)
    config, args = read_config(src)
    draft_src = None if draft is None else GGUFSource(draft)
    if draft_src is not None:
        gguf_draft.check_dialect(draft_src)
        config, args = gguf_draft.with_draft(config, draft_src, src)
    tokenizer = read_tokenizer(src)
    tables = check_engram(src, args, tokenizer)
    refs = {} if copy_engram else engram_references(src, tables)
    expected = expected_logical(expected_tensors(args), args.n_routed_experts)
    jobs, sizes, stats, per_module, references = plan(src, expected, options)
    draft_jobs, draft_per_module, draft_references = {}, {}, {}
    if draft_src is not None:
        draft_jobs, draft_sizes, draft_stats, draft_per_module, draft_references = plan(
            draft_src, gguf_draft.expected(args), options, gguf_draft.dsv4_name, gguf_draft.SKIPPED.match)
        jobs, sizes, stats = {**jobs, **draft_jobs}, {**sizes, **draft_sizes}, {**stats, **draft_stats}
    # the main process assembles and writes: leave it a core (on 2 cores, in-process was faster)
    workers = workers or max(1, (os.cpu_count() or 2) - 1)
    order = list(jobs)
    ahead = _Ahead(jobs, workers)
    recorded: set[str] = set()

    def unit(name: str) -> Unit:
        def produce():
            tensors, err_sq, ref_sq = ahead.get(name)
            if name not in recorded:  # verify() produces again; count once
                recorded.add(name)
                s = stats[f"{_kind(name)} ({jobs[name].tensor.qtype.name})"]
                s.err_sq += err_sq
                s.ref_sq += ref_sq
            return tensors
        return Unit(name.removesuffix(".weight") if jobs[name].mode in ("affine", "mxfp4") else name,
                    sizes[name], produce)

    parts = src.parts + (() if draft_src is None else draft_src.parts)
    fingerprint = {"source": [[p, size, os.stat(p).st_mtime_ns] for p, size in parts],
                   "options": vars(options) | {"copy_engram": copy_engram}}
    try:
        with ModelDirWriter(dst, fingerprint, overwrite=overwrite, resume=resume,
                            max_shard_bytes=max_shard_bytes, progress=progress,
                            sources=[path for path, _ in parts]) as out:
            groups = {"model": [unit(n) for n in order if n not in draft_jobs]}
            if draft_jobs:
                groups["mtp"] = [unit(n) for n in order if n in draft_jobs]
            out.write_weights(groups)
            if verify:
                out.verify(groups)
                verify_references(src, references, out.tmp)
                if draft_src is not None:
                    verify_references(draft_src, draft_references, out.tmp, name_of=gguf_draft.dsv4_name)
            if copy_engram:
                refs = _copy_tables(src, tables, out, progress)
            report = {k: s.summary() for k, s in sorted(stats.items())}
            stored_draft = None if draft_src is None else \
                _draft_block(draft_src, draft_per_module, draft_references)
            out.write_json("config.json", _output_config(src, config, per_module, refs,
                                                         references, report, stored_draft))
            out.write_json("tokenizer.json", json.loads(tokenizer.to_str()))
            out.write_json("tokenizer_config.json", gguf_tokenizer.tokenizer_config(
                src.need("tokenizer.ggml.tokens"), src.need("tokenizer.ggml.bos_token_id"),
                src.need("tokenizer.ggml.eos_token_id"), src.get("tokenizer.ggml.add_bos_token", True),
                src.get("tokenizer.ggml.add_eos_token", False), args.engram_pad_id,
                args.max_position_embeddings))
    finally:
        ahead.close()
    return report


def _copy_tables(src: GGUFSource, tables: dict[int, GGUFTensor], out: ModelDirWriter,
                 progress: bool) -> dict[str, dict]:
    from dsv4.engram_store import InterleavedTable, copy_table

    refs = {}
    for layer, t in tables.items():
        name = f"engram-{layer:02d}.bin"
        if not out.exists(name):
            place = src.locate(t.offset, t.nbytes)
            if place is None:  # the store reads one file: copy the bytes of both parts
                _copy_span(src, t, out.path(name), progress)
            else:
                with InterleavedTable(place[0], place[1], t.dims[1], f"layer {layer} table") as table:
                    copy_table(table, out.path(name), progress=progress)
        refs[str(layer)] = {"layout": "interleaved264", "file": name, "offset": 0, "rows": t.dims[1]}
    return refs


def _copy_span(src: GGUFSource, t: GGUFTensor, dst: Path, progress: bool,
               chunk: int = ENGRAM_ROW_BYTES << 18) -> None:
    """A tensor's bytes across the parts of a split file into `dst` (atomically)."""
    shown = Progress(f"copying {t.name}", t.nbytes, progress)
    with atomic_file(dst) as f:
        for start in range(0, t.nbytes, chunk):
            data = read_bytes(src.parts, t.offset + start, min(chunk, t.nbytes - start))
            f.write(memoryview(np.ascontiguousarray(data)))
            shown.advance(len(data))
    shown.finish()


def _draft_block(src: GGUFSource, per_module: dict, references: dict) -> dict:
    """config.json's `dsv4.draft`: draft stages stored as the backbone's are (`layout` dsv4:
    mtp*.safetensors, their own quantization block and references), not in official packing."""
    block = {"layout": "dsv4",
             "source": {"kind": "gguf", "path": [p for p, _ in src.parts],
                        "architecture": src.get("general.architecture"),
                        "revision": src.get("general.source.revision"),
                        "recipe": src.get("dspark.precision") or src.get("dspark.quantization")}}
    quantization = quantization_block(per_module)
    if quantization is not None:
        block["quantization"] = quantization
    if references:
        block["tensors"] = references
    return block


def _output_config(src: GGUFSource, config: dict, per_module: dict, refs: dict,
                   references: dict, report: dict, draft: Optional[dict] = None) -> dict:
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    block = quantization_block(per_module)
    if block is not None:
        out["quantization"] = block
    out["dsv4"] = {
        "format_version": 1,
        "source": {"kind": "gguf", "path": [p for p, _ in src.parts],
                   "architecture": src.get("general.architecture"),
                   "repo": src.get("general.source.url"), "revision": src.get("general.source.revision"),
                   "recipe": src.get("deepseek41.quantization")},
        "engram": refs,
        **({"tensors": references} if references else {}),
        **({"draft": draft} if draft else {}),
        "conversion": report,
    }
    return out


def print_report(report: dict, file=None) -> None:
    file = file or sys.stderr
    print(f"{'tensor kind':<44} {'from':>8} {'to':>18} {'MB in':>9} {'MB out':>9} {'added err':>10}",
          file=file)
    for kind, r in report.items():
        err = r.get("added_relative_rms_error")
        print(f"{kind:<44} {r['from']:>8} {r['to']:>18} {r['bytes_in'] / 1e6:>9.1f} "
              f"{r['bytes_out'] / 1e6:>9.1f} {'exact' if err is None else f'{err:.4f}':>10}", file=file)
    total_in = sum(r["bytes_in"] for r in report.values())
    total_out = sum(r["bytes_out"] for r in report.values())
    print(f"{'total':<44} {'':>8} {'':>18} {total_in / 1e6:>9.1f} {total_out / 1e6:>9.1f}", file=file)
    in_place = sum(r["bytes_out"] for r in report.values() if r["to"] == IN_PLACE)
    if in_place:
        print(f"MB out is what the model holds; {in_place / 1e6:.1f} MB of it stay in the GGUF "
              f"(referenced, not copied)", file=file)


def gguf_command(
    source: Annotated[Path, typer.Argument(help="the ds4 .gguf file (for a split file, its .part1)")],
    dst: Annotated[Path, typer.Argument(help="the dsv4 model directory to write")],
    copy_weights: Annotated[bool, typer.Option(
        help="write the GGUF blocks into DST instead of reading them in the GGUF")] = False,
    affine: Annotated[bool, typer.Option(
        help="map the blocks into MLX affine (Q8_0, Q4_K exact; IQ2_XXS, Q2_K lossy) instead of "
             "keeping them")] = False,
    iq2_xxs_bits: Annotated[Optional[int], typer.Option(
        help="with --affine: IQ2_XXS -> 3-bit (level map, ~2% added error, the default) or "
             "8-bit (exact)")] = None,
    q2_k_bits: Annotated[Optional[int], typer.Option(
        help="with --affine: Q2_K -> 2, 3, 4 (the default), 5, 6 or 8 bits (lossy fit; "
             "~3-5% added error at 4)")] = None,
    dequantize: Annotated[Optional[str], typer.Option(
        help="bf16 or f32: write quantized tensors as plain floats (their exact decoding)")] = None,
    workers: Annotated[int, typer.Option(
        help="worker processes; 0 = one per core but one (1 = no pool, all in this process)")] = 0,
    copy_engram: Annotated[bool, typer.Option(
        help="copy the Engram tables into DST instead of reading them in the GGUF")] = False,
    overwrite: Annotated[bool, typer.Option(help="replace DST or an unfinished conversion")] = False,
    resume: Annotated[bool, typer.Option(help="continue an interrupted conversion")] = False,
    verify: Annotated[bool, typer.Option(help="re-read sampled rows of every tensor")] = False,
    draft: Annotated[Optional[Path], typer.Option(
        help="ds4's DSpark support GGUF of the same checkpoint (deepseek41_dspark.py): the draft "
             "stages for speculative decoding (--draft on generate, chat, serve)")] = None,
) -> None:
    """Convert a ds4 GGUF of DeepSeek V4.1 Flash into a dsv4 model directory."""
    with reported():
        bits = {"iq2_xxs_bits": iq2_xxs_bits, "q2_k_bits": q2_k_bits}
        given = {k: v for k, v in bits.items() if v is not None}
        if given and not affine:
            raise ConversionError(f"--{next(iter(given)).replace('_', '-')} applies to --affine")
        options = Options(**given, dequantize=dequantize, affine=affine, copy_weights=copy_weights)
        report = convert(source, dst, options, workers, copy_engram, overwrite, resume, verify,
                         draft=draft)
    print_report(report)
    print(f"wrote {dst}", file=sys.stderr)
    if draft is None:
        from .gguf_draft import support_files_beside

        for found in support_files_beside(source):
            print(f"note: {found} is ds4's DSpark support file; convert with --draft {found} to "
                  f"speculate with its draft stages", file=sys.stderr)
