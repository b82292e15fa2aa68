"""Official checkpoint tensors -> dsv4 tensors: the one place that owns this mapping.

dsv4 keeps the official tensor names (`layers.3.attn.wq_a`, `layers.3.ffn.experts.w1`,
...) and changes only the packing, losslessly:
  * fp8 `<m>.weight` + `<m>.scale` (32x32 blocks) -> MLX mxfp8 `<m>.weight` (uint32) +
    `<m>.scales` (uint8, one per row and 32 inputs);
  * fp4 experts `experts.<e>.w1.weight` + `.scale` -> stacked mxfp4
    `experts.w1.weight` [E, out, in/8] + `experts.w1.scales` [E, out, in/32];
  * BF16 / F32 tensors as they are.
A dequantised upload (the same names, an fp8 or fp4 module's `.weight` stored as BF16 or F32
[out, in] with no `.scale`; its other float tensors BF16 or F32) loads as it is stored: such a
module is a float Linear (experts stacked [E, out, in]), never requantized; the fp8/fp4
roundings of activations and KV stay the runtime switches' business.
Engram tables (`engram.embed.*`) are not weights: they stay where they lie and are
referenced (see `engram_table_refs`; fp8 + scale, or BF16/F32 in an upload). MTP, vision
tensors and `gate.bias_vl` (image routing) are not used by the text model and are left out;
the DSpark draft stages (`mtp.*`, `draft_tensors`) are packed the same way by `draft_plan`,
for dsv4.draft.

Both `dsv4.load` (official directory loaded directly) and the official converter use
`plan()`, so a converted directory is bit-identical to loading the source.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np

from .config import ModelArgs
from .quant import pack_fp4, pack_fp8_block32
from .safetensors_file import Checkpoint, CheckpointError, TensorInfo, view

MXFP8 = {"group_size": 32, "bits": 8, "mode": "mxfp8"}
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
FLOAT = ("BF16", "F32")  # a float tensor of the official layout may be stored as either

_UNUSED = re.compile(r"^(mtp\.|vision\.|aligner\.|image_)|\.gate\.bias_vl$|\.engram\.embed\.")


def is_unused(name: str) -> bool:
    """A tensor the text model does not load (MTP, vision, image routing, Engram rows)."""
    return bool(_UNUSED.search(name))


_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")


@dataclass
class Item:
    """One dsv4 module's tensors, produced on demand from the source tensors."""
    name: str                      # dsv4 name of the module or tensor
    sources: list[TensorInfo]
    quantization: Optional[dict]   # MLX quantization of a module, None for plain tensors
    # produce(read=view): read(TensorInfo) gives a source tensor (a sharded load gives its
    # shard, or None where this rank holds none of it: the item then leaves it out)
    produce: Callable[..., dict[str, tuple[str, np.ndarray]]]
    # the module's quantization in the official checkpoint (MXFP8 / MXFP4), also when this
    # checkpoint stores it as float; None for the tensors the official stores as float
    official: Optional[dict] = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sources)


def expected_tensors(args: ModelArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every official tensor the text model needs: {name: (dtype, shape)}."""
    d = args.hidden_size
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    out["embed.weight"] = ("BF16", (args.vocab_size, d))
    out["head.weight"] = ("BF16", (args.vocab_size, d))
    out["norm.weight"] = ("BF16", (d,))
    for i in range(args.num_hidden_layers):
        _block_tensors(out, args, f"layers.{i}", i, args.n_routed_experts)
    return out


def _fp8(out: dict, name: str, o: int, i: int) -> None:
    out[f"{name}.weight"] = ("F8_E4M3", (o, i))
    out[f"{name}.scale"] = ("F8_E8M0", ((o + 31) // 32, i // 32))


def _block_tensors(out: dict, args: ModelArgs, p: str, i: int, experts: int) -> None:
    """The tensors of layer i (a backbone layer or a draft stage) under prefix p."""
    d, hc = args.hidden_size, args.hc_mult
    mix = (2 + hc) * hc
    out[f"{p}.attn_norm.weight"] = ("BF16", (d,))
    out[f"{p}.ffn_norm.weight"] = ("BF16", (d,))
    for site in ("attn", "ffn"):
        out[f"{p}.hc_{site}_fn"] = ("F32", (mix, hc * d))
        out[f"{p}.hc_{site}_base"] = ("F32", (mix,))
        out[f"{p}.hc_{site}_scale"] = ("F32", (3,))
    a = f"{p}.attn"
    out[f"{a}.attn_sink"] = ("F32", (args.num_attention_heads,))
    _fp8(out, f"{a}.wq_a", args.q_lora_rank, d)
    out[f"{a}.q_norm.weight"] = ("BF16", (args.q_lora_rank,))
    _fp8(out, f"{a}.wq_b", args.num_attention_heads * args.head_dim, args.q_lora_rank)
    _fp8(out, f"{a}.wkv", args.head_dim, d)
    out[f"{a}.kv_norm.weight"] = ("BF16", (args.head_dim,))
    _fp8(out, f"{a}.wo_a", args.o_groups * args.o_lora_rank,
         args.num_attention_heads * args.head_dim // args.o_groups)
    _fp8(out, f"{a}.wo_b", d, args.o_groups * args.o_lora_rank)
    if i in args.kv_source_layer_ids and args.ratio(i):
        out[f"{a}.compressor.wkv.weight"] = ("BF16", (args.head_dim, d))
        if args.ratio(i) > 1:
            out[f"{a}.compressor.wgate.weight"] = ("BF16", (args.head_dim, d))
        out[f"{a}.compressor.norm.weight"] = ("BF16", (args.head_dim,))
    if i in args.index_source_layer_ids and args.ratio(i):
        _fp8(out, f"{a}.indexer.wq_b", args.index_n_heads * args.index_head_dim, args.q_lora_rank)
        out[f"{a}.indexer.weights_proj.weight"] = ("BF16", (args.index_n_heads, d))
        if i in args.kv_source_layer_ids:
            out[f"{a}.indexer.wk.weight"] = ("BF16", (args.index_head_dim, args.head_dim))
            out[f"{a}.indexer.k_norm.weight"] = ("BF16", (args.index_head_dim,))
    f = f"{p}.ffn"
    out[f"{f}.gate.weight"] = ("BF16", (experts, d))
    out[f"{f}.gate.bias"] = ("F32", (experts,))
    inter = args.moe_intermediate_size
    for e in range(experts):
        for w, (o, n) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
            out[f"{f}.experts.{e}.{w}.weight"] = ("I8", (o, n // 2))
            out[f"{f}.experts.{e}.{w}.scale"] = ("F8_E8M0", (o, n // 32))
    _fp8(out, f"{f}.shared_experts.w1", inter, d)
    _fp8(out, f"{f}.shared_experts.w3", inter, d)
    _fp8(out, f"{f}.shared_experts.w2", d, inter)
    if i in args.engram_layer_ids:
        g = f"{p}.engram"
        _fp8(out, f"{g}.wkv", d * (hc + 1), args.engram_rows_per_token * args.engram_head_dim)
        out[f"{g}.q_weight"] = ("BF16", (hc, d))
        out[f"{g}.k_weight"] = ("BF16", (hc, d))


def draft_tensors(args: ModelArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every official tensor of the DSpark draft stages `mtp.*` (model-spec §9): each stage a
    window-only block with the draft expert count, `main_proj`/`main_norm` on the first, the
    final norm, Markov head and confidence head on the last (embed and head are the backbone's)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    if not args.has_draft:
        return out
    d, rank, stages = args.hidden_size, args.dspark_markov_rank, args.num_nextn_predict_layers
    for s in range(stages):
        p = f"mtp.{s}"
        _block_tensors(out, args, p, args.num_hidden_layers + s,
                       args.dspark_n_routed_experts or args.n_routed_experts)
        if s == 0:
            _fp8(out, f"{p}.main_proj", d, d * len(args.dspark_target_layer_ids))
            out[f"{p}.main_norm.weight"] = ("BF16", (d,))
        if s == stages - 1:
            out[f"{p}.norm.weight"] = ("BF16", (d,))
            out[f"{p}.markov_head.embed.weight"] = ("BF16", (args.vocab_size, rank))
            out[f"{p}.markov_head.head.weight"] = ("BF16", (args.vocab_size, rank))
            out[f"{p}.confidence_head.proj.weight"] = ("BF16", (1, d + rank))
    return out


def _scale_of(name: str) -> str:
    return f"{name.removesuffix('.weight')}.scale"


def _float_shape(dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The [out, in] of an fp8 weight, or of an fp4 one packed two values a byte."""
    return (*shape[:-1], 2 * shape[-1]) if dtype == "I8" else shape


def stored_tensors(ckpt: Checkpoint, args: ModelArgs,
                   official: Optional[dict] = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`expected_tensors(args)` in the form this checkpoint stores them: an fp8 or fp4 module
    whose `.weight` is BF16/F32 [out, in] and which has no `.scale` is stored as float, and a
    float tensor may be BF16 or F32: the entry is then the dtype found. `official` defaults to
    `expected_tensors(args)`."""
    official = expected_tensors(args) if official is None else official
    out = {}
    for name, (dtype, shape) in official.items():
        if name.endswith(".scale"):
            continue  # goes with its weight
        info = ckpt.tensors.get(name)
        found = info is not None and info.dtype in FLOAT
        if _scale_of(name) in official:
            if found and info.shape == _float_shape(dtype, shape) and _scale_of(name) not in ckpt:
                out[name] = (info.dtype, info.shape)
            else:
                out[name], out[_scale_of(name)] = (dtype, shape), official[_scale_of(name)]
        else:
            out[name] = (info.dtype if found and dtype in FLOAT else dtype, shape)
    return out


def _expectation(name: str, dtype: str, shape: tuple[int, ...], official: dict) -> str:
    """What `name` must be, with the float forms a dequantised upload may use."""
    if _scale_of(name) in official and not name.endswith(".scale"):
        return (f"{dtype}{list(shape)} with its .scale, or BF16/F32"
                f"{list(_float_shape(dtype, shape))} without one")
    if dtype in FLOAT:
        return f"{dtype}{list(shape)} (or {'/'.join(f for f in FLOAT if f != dtype)})"
    return f"{dtype}{list(shape)}"


def check(ckpt: Checkpoint, args: ModelArgs,
          official: Optional[dict] = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every needed tensor present with the right dtype and shape; nothing unknown. Returns
    `stored_tensors`."""
    official = expected_tensors(args) if official is None else official
    expected = stored_tensors(ckpt, args, official)
    problems = []
    for name, (dtype, shape) in expected.items():
        info = ckpt.tensors.get(name)
        want = _expectation(name, *official[name], official)
        if info is None:
            problems.append(f"tensor {name} is missing (expected {want})")
        elif info.dtype != dtype or info.shape != shape:
            problems.append(f"{info.file.name}: tensor {name} is {info.dtype}{list(info.shape)}, "
                            f"expected {want}")
    extra = [n for n in ckpt.names() if n not in official and not is_unused(n)]
    problems += [f"{ckpt[n].file.name}: unexpected tensor {n}" for n in sorted(extra)[:20]]
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointError(f"{ckpt.directory}: " + "; ".join(problems[:10]) + more)
    return expected


def plan(ckpt: Checkpoint, args: ModelArgs, official: Optional[dict] = None) -> list[Item]:
    """The dsv4 tensors of an official checkpoint, in a stable order, each produced lazily
    (of the tensors `official`, default `expected_tensors(args)`)."""
    official = expected_tensors(args) if official is None else official
    stored = check(ckpt, args, official)
    items: list[Item] = []
    experts: dict[tuple[str, str], dict[int, dict[str, TensorInfo]]] = {}
    for name in sorted(stored):
        info = ckpt[name]
        m = _EXPERT.match(name)
        if m:
            base, e, w, kind = m.groups()
            experts.setdefault((base, w), {}).setdefault(int(e), {})[kind] = info
            continue
        if name.endswith(".scale"):
            continue
        if info.dtype == "F8_E4M3":
            module = name.removesuffix(".weight")
            items.append(_fp8_item(module, info, ckpt[f"{module}.scale"]))
        else:
            items.append(Item(name, [info], None,
                              lambda read=view, info=info: _present({info.name: (info.dtype, read(info))}),
                              MXFP8 if _scale_of(name) in official else None))
    for (base, w), by_index in sorted(experts.items()):
        parts = [by_index[e] for e in sorted(by_index)]
        if all("scale" in p for p in parts):
            items.append(_experts_item(f"{base}.{w}", parts))
        else:
            items.append(_float_experts_item(f"{base}.{w}", [p["weight"] for p in parts]))
    items.sort(key=lambda it: it.name)
    return items


def draft_plan(ckpt: Checkpoint, args: ModelArgs) -> list[Item]:
    """The draft stages' tensors (`mtp.*`) of an official-layout checkpoint, packed as the
    backbone's are; the checkpoint's other tensors are not looked at."""
    stages = copy.copy(ckpt)
    stages.tensors = {n: t for n, t in ckpt.tensors.items() if n.startswith("mtp.")}
    return plan(stages, args, draft_tensors(args))


def _present(arrays: dict[str, tuple[str, Optional[np.ndarray]]]) -> dict[str, tuple[str, np.ndarray]]:
    return {n: (dtype, a) for n, (dtype, a) in arrays.items() if a is not None}


def _fp8_item(module: str, weight: TensorInfo, scale: TensorInfo) -> Item:
    def produce(read=view):
        w, s = read(weight), read(scale)
        if w is None:
            return {}
        w, s = pack_fp8_block32(w, s)
        return {f"{module}.weight": ("U32", w), f"{module}.scales": ("U8", s)}
    return Item(module, [weight, scale], MXFP8, produce, MXFP8)


def _experts_item(module: str, parts: list[dict[str, TensorInfo]]) -> Item:
    def produce(read=view):
        held = [(w, read(p["scale"])) for p in parts if (w := read(p["weight"])) is not None]
        if not held:
            return {}
        w = np.stack([w for w, _ in held]).view(np.uint8)
        s = np.stack([s for _, s in held])
        w, s = pack_fp4(w, s)
        return {f"{module}.weight": ("U32", w), f"{module}.scales": ("U8", s)}
    sources = [t for p in parts for t in (p["weight"], p["scale"])]
    return Item(module, sources, MXFP4, produce, MXFP4)


def _float_experts_item(module: str, weights: list[TensorInfo]) -> Item:
    """Float experts stacked [E, out, in], in their one storage dtype."""
    kinds = {}  # dtype -> the first expert stored so
    for info in weights:
        kinds.setdefault(info.dtype, info)
    if len(kinds) > 1:  # check() let each through: fp4 with its scale, or float without
        found = ", ".join(f"{info.name} is {dtype}" for dtype, info in sorted(kinds.items()))
        raise CheckpointError(f"{module}: the experts of one stack must all be fp4 with their "
                              f".scale or all BF16, or all F32; {found}")

    def produce(read=view):
        held = [a for w in weights if (a := read(w)) is not None]
        return {f"{module}.weight": (weights[0].dtype, np.stack(held))} if held else {}
    return Item(f"{module}.weight", weights, None, produce, MXFP4)


def engram_table_refs(ckpt: Checkpoint, args: ModelArgs) -> dict[str, dict]:
    """Where each Engram table lies in the official shards, by layer id: fp8 weight and scale
    tensors (split layout), or one BF16/F32 tensor (a dequantised upload)."""
    from .engram_store import float_reference, split_reference

    refs = {}
    for layer, rows in zip(args.engram_layer_ids, _engram_rows(ckpt, args)):
        w = ckpt[f"layers.{layer}.engram.embed.weight"]
        width = args.engram_head_dim
        if w.dtype in FLOAT and w.shape == (rows, width) and _scale_of(w.name) not in ckpt:
            refs[str(layer)] = float_reference(w)
            continue
        if w.dtype != "F8_E4M3" or w.shape != (rows, width):
            raise CheckpointError(f"{w.file.name}: tensor {w.name} is {w.dtype}{list(w.shape)}, "
                                  f"expected F8_E4M3[{rows}, {width}] with its .scale, or "
                                  f"BF16/F32[{rows}, {width}] without one")
        s = ckpt[_scale_of(w.name)]
        if s.dtype != "F8_E8M0" or s.shape != (rows, width // 32):
            raise CheckpointError(f"{s.file.name}: tensor {s.name} is {s.dtype}{list(s.shape)}, "
                                  f"expected F8_E8M0[{rows}, {width // 32}]")
        refs[str(layer)] = split_reference(w, s)
    return refs


def _engram_rows(ckpt: Checkpoint, args: ModelArgs) -> Iterator[int]:
    from .engram import table_sizes

    sizes = table_sizes(args)
    if args.engram_num_embeddings and tuple(sizes) != tuple(args.engram_num_embeddings):
        raise CheckpointError(f"{ckpt.directory}: config engram_num_embeddings "
                              f"{list(args.engram_num_embeddings)} disagree with the hashing's "
                              f"table sizes {sizes}")
    yield from sizes
