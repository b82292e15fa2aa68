"""`load(path_or_repo)`: a model directory -> (Model, Tokenizer).

Two layouts are accepted:
  * the official checkpoint (`config.json` with fp8 `quantization_config`, official
    tensor names, fp8/fp4 with e8m0 scales): packed losslessly to MLX mxfp8/mxfp4 on
    the fly through dsv4.layout, Engram tables read in place from the shards;
  * a dsv4 model directory (`config.json` with a `dsv4` block and mlx-lm's
    `quantization` block), as the converters write it.
Weights are loaded module by module and evaluated as they arrive, so loading never
holds more than the weights plus one module's source tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from . import distributed, expert_store, flags, gguf_blocks, tensor_refs
from .config import ModelArgs, read_json
from .distributed import planning
from .distributed.reading import Reader
from .engram import NgramHasher, build_token_map
from .linear import ExpertLinear, GGUFExpertLinear, GGUFLinear, QuantizedLinear, make_dense_copies
from .model import Model
from .safetensors_file import Checkpoint, CheckpointError, to_mx
from .tokenizer import Tokenizer

DEMO_DIR = Path(__file__).parent / "demo"
FORMAT_VERSION = 1


def looks_local(text: str) -> bool:
    """A path, not a Hugging Face repo id: it starts with '.', '/' or '~', is not of the form
    owner/name, or its first part exists here (models/q2 with a models/ folder)."""
    parts = text.replace("\\", "/").split("/")
    return text.startswith((".", "/", "~")) or len(parts) != 2 or not all(parts) or \
        Path(parts[0]).expanduser().exists()


def resolve(path_or_repo: Optional[str | Path]) -> Path:
    """A local directory as is; None -> the bundled demo; else a Hugging Face repo id."""
    if path_or_repo is None:
        if not (DEMO_DIR / "config.json").is_file():
            raise CheckpointError(f"the bundled demo checkpoint is missing from {DEMO_DIR}")
        return DEMO_DIR
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: no config.json (not a model directory)")
        return path
    if path.exists():
        raise CheckpointError(f"{path}: a file, not a model directory")
    if isinstance(path_or_repo, Path) or looks_local(str(path_or_repo)):
        raise CheckpointError(f"{path_or_repo}: no such directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path_or_repo), allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.bin"]))
    except Exception as e:  # the hub's errors: offline, unknown repo, gated, bad name
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path_or_repo}: no such directory here, and not found on the "
                              f"Hugging Face hub ({reason})") from None


def read_config(path: Path) -> tuple[dict, ModelArgs]:
    file = path / "config.json"
    config = read_json(file)
    return config, ModelArgs.from_dict(config, source=str(file))


def _quantize(model: Model, quant: dict[str, dict]) -> None:
    """Turn the named modules into their quantized forms (before weights arrive)."""
    if quant:
        nn.quantize(model, class_predicate=lambda p, m: quant.get(p, False) if hasattr(m, "to_quantized") else False)


def _keep_gguf_blocks(model: Model, types: dict[str, str], where: Path) -> None:
    """Turn the named modules into GGUF-block modules of their types (before weights arrive)."""
    def convert(path, module):
        qtype = types.get(path)
        if qtype is None:
            return module
        gguf_blocks.check_type(qtype)
        if isinstance(module, ExpertLinear):
            e, out, n_in = module.weight.shape
            return GGUFExpertLinear(n_in, out, e, qtype)
        if isinstance(module, nn.Linear) and "bias" not in module:
            out, n_in = module.weight.shape
            return GGUFLinear(n_in, out, qtype)
        raise CheckpointError(f"{where}: quantization of {path} is GGUF {qtype}, but {path} is not a "
                              f"projection without bias")
    leaves = tree_map_with_path(convert, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    found = {p for p, _ in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)}
    unknown = sorted(set(types) - found)
    if unknown:
        raise CheckpointError(f"{where}: quantization names modules the model does not have: {unknown[:5]}")


def resident_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (the weights a forward reads; not the CPU's dense copies)."""
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def _load_arrays(model: Model, arrays: dict[str, mx.array], where: str, expected: dict, seen: set) -> None:
    arrays = {n: a for n, a in arrays.items() if a is not None}   # None: another rank's
    for name, a in arrays.items():
        want = expected.get(name)
        if want is None:
            raise CheckpointError(f"{where}: tensor {name} is not a parameter of the model")
        if tuple(want.shape) != tuple(a.shape):
            raise CheckpointError(f"{where}: tensor {name} has shape {list(a.shape)}, "
                                  f"expected {list(want.shape)}")
        if (want.dtype in (mx.uint32, mx.uint8)) != (a.dtype in (mx.uint32, mx.uint8)):
            kind = "packed quantized codes (uint32/uint8)" if want.dtype in (mx.uint32, mx.uint8) else "floats"
            raise CheckpointError(f"{where}: tensor {name} is {str(a.dtype).removeprefix('mlx.core.')}, expected {kind}")
    model.load_weights(list(arrays.items()), strict=False)
    mx.eval(list(arrays.values()))
    seen.update(arrays)


def _check_complete(model: Model, seen: set, where: Path) -> None:
    missing = [n for n, _ in tree_flatten(model.parameters()) if n not in seen]
    if missing:
        more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
        raise CheckpointError(f"{where}: missing tensor(s) {missing[:10]}{more}")


def _load_official(path: Path, args: ModelArgs, reader: Reader, stream=None) -> tuple[Model, dict]:
    """`stream` (an expert_store.Streaming): the routed experts are recorded, not loaded;
    `reader` reads this rank's share of each tensor."""
    from . import layout

    ckpt = Checkpoint(path, "model*.safetensors")
    items = layout.plan(ckpt, args)
    reader.check((i.name, i.shape) for it in items for i in it.sources)
    model = Model(args, reader.plan)
    _quantize(model, {it.name: it.quantization for it in items if it.quantization})
    reader.plan.prepare(model)
    if stream is not None:
        stream.detach(model)
    expected = dict(tree_flatten(model.parameters()))
    seen: set = set()
    for item in items:
        if stream is not None and stream.takes(*map(expert_store.StoredTensor.of, item.sources)):
            continue
        arrays = {n: to_mx(a, dtype) for n, (dtype, a) in item.produce(reader.tensor).items()}
        _load_arrays(model, arrays, str(item.sources[0].file), expected, seen)
    _check_complete(model, seen, path)
    return model, layout.engram_table_refs(ckpt, args)


def _load_dsv4(path: Path, config: dict, args: ModelArgs, reader: Reader, stream=None) -> tuple[Model, dict]:
    """`stream` (an expert_store.Streaming): the routed experts are recorded, not loaded;
    `reader` reads this rank's share of each tensor."""
    from . import layout

    block = config["dsv4"]
    if block.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path / 'config.json'}: dsv4 format_version "
                              f"{block.get('format_version')}, this dsv4 reads {FORMAT_VERSION}")
    ckpt = Checkpoint(path, "model*.safetensors")
    refs = _references(block, path, "dsv4.tensors")
    reader.check([(n, i.shape) for n, i in ckpt.tensors.items()]
                 + [(n, r.get("shape", ())) for n, r in refs.items() if isinstance(r, dict)])
    model = Model(args, reader.plan)
    _stored_forms(model, ckpt, refs, config.get("quantization") or {}, path)
    reader.plan.prepare(model)
    if stream is not None:
        stream.detach(model)
    _read_stored(model, ckpt, refs, path, reader, stream)
    _official_dtypes(model, lambda: layout.expected_tensors(args))
    return model, block.get("engram", {})


def _references(block: dict, path: Path, where: str) -> dict:
    refs = block.get("tensors") or {}
    if not isinstance(refs, dict):
        raise CheckpointError(f"{path / 'config.json'}: {where} must map tensor names to references")
    return refs


def _stored_forms(model: nn.Module, ckpt: Checkpoint, refs: dict, quant: dict, path: Path) -> None:
    """Turn `model`'s modules into the forms a dsv4 directory stores them in, from the shards'
    and references' tensors and mlx-lm's quantization block `quant`: MLX quantized (a weight
    with .scales) or GGUF blocks (a uint8 weight without scales, "gguf" in the block)."""
    default = {k: quant[k] for k in ("group_size", "bits", "mode", "type") if k in quant}
    setting = lambda module: quant.get(module, default)
    modules = {n.removesuffix(".scales") for n in ckpt.names() if n.endswith(".scales")}
    dtypes = {**{n: ckpt[n].dtype for n in ckpt.names()}, **{n: r.get("dtype") for n, r in refs.items()
                                                             if isinstance(r, dict)}}
    blocks = {n.removesuffix(".weight") for n, d in dtypes.items()
              if n.endswith(".weight") and d == "U8" and n.removesuffix(".weight") not in modules}
    types = {}
    for module in sorted(blocks):
        q = setting(module)
        if not isinstance(q, dict) or q.get("mode") != "gguf" or "type" not in q:
            raise CheckpointError(f"{path / 'config.json'}: {module}.weight holds bytes, but the "
                                  f"quantization block gives {module} no GGUF type ({q!r})")
        types[module] = q["type"]
    _keep_gguf_blocks(model, types, path)
    _quantize(model, {m: setting(m) for m in modules})


def _official_dtypes(model: nn.Module, official: Callable[[], dict]) -> None:
    """F16 float weights back in the official checkpoint's dtype, so that the model computes in
    bf16 as the official one does (fp16's range is 65504; the fused experts kernels take bf16).
    ds4's GGUFs store the official BF16 tensors, float copies of its fp8 ones and its F32 mHC
    projections as F16: to BF16 (exact for values that came from BF16 or fp8) or F32 (exact).
    `official()`: dsv4.layout's tensor table (name -> (dtype, shape)), built only where some
    weight is F16 (~90k entries at V4.1's size)."""
    halves = [(name, a) for name, a in tree_flatten(model.parameters()) if a.dtype == mx.float16]
    table = official() if halves else {}
    restored = [(name, a.astype(mx.float32 if table[name][0] == "F32" else mx.bfloat16))
                for name, a in halves if name in table]
    if restored:
        model.load_weights(restored, strict=False)
        mx.eval([a for _, a in restored])


def _read_stored(model: nn.Module, ckpt: Checkpoint, refs: dict, path: Path, reader: Reader,
                 stream=None) -> None:
    """Load the shards' and references' tensors into `model` (in its stored forms), each file
    then each reference evaluated as it arrives; the routed experts `stream` takes are only
    recorded."""
    expected = dict(tree_flatten(model.parameters()))
    seen: set = set()
    by_file: dict[Path, list[str]] = {}
    for name, info in ckpt.tensors.items():
        if stream is None or not stream.takes(expert_store.StoredTensor.of(info)):
            by_file.setdefault(info.file, []).append(name)
    for file, names in sorted(by_file.items()):
        arrays = {n: None if (a := reader.tensor(ckpt[n])) is None else to_mx(a, ckpt[n].dtype)
                  for n in names}
        _load_arrays(model, arrays, str(file), expected, seen)
    for name, ref in sorted(refs.items()):   # one at a time: a stacked expert tensor is GBs
        if stream is not None and expert_store.is_routed(name):
            stream.takes(expert_store.StoredTensor(name, *tensor_refs.locate(name, ref, path)))
            continue
        a = reader.reference(name, ref, path)
        _load_arrays(model, {name: None if a is None else to_mx(a, ref["dtype"])},
                     str(path / "config.json"), expected, seen)
    _check_complete(model, seen, path)


def load_model(path: Path, tokenizer: Tokenizer, dtype: Optional[mx.Dtype] = None,
               expert_cache_gb: Optional[str] = None, group=None, parallel: Optional[str] = None) -> Model:
    """`expert_cache_gb` (N or 'auto'; default DSV4_EXPERT_CACHE_GB, empty = resident):
    stream the routed experts from disk into a cache of that size (dsv4/expert_store.py).
    `group` (mx.distributed) and `parallel` ('expert', 'tensor', 'pipeline' or a '+'
    combination): this rank's shard only (dsv4/distributed); `model.load_log` says what it read."""
    config, args = read_config(path)
    plan = planning.build(args, config, group, parallel)
    budget = flags.get("expert_cache_gb") if expert_cache_gb is None else expert_cache_gb
    stream = expert_store.Streaming(budget) if expert_store.parse_budget(budget) else None
    if stream is not None and plan is not distributed.SINGLE:
        raise distributed.ParallelError(f"--parallel {parallel} with streamed experts "
                                        f"(--expert-cache-gb {budget}): not supported yet")
    reader = Reader(plan)
    if "dsv4" in config:
        model, refs = _load_dsv4(path, config, args, reader, stream)
    else:
        model, refs = _load_official(path, args, reader, stream)
    model.load_log = reader.log
    if args.engram_layer_ids:
        from . import engram_store

        hasher = NgramHasher(args, build_token_map(tokenizer.backend))
        tables = {}
        held = tuple(l for l in args.engram_layer_ids if "engram" in model.layers[l])  # a pipeline stage's
        for layer in held:
            ref = refs.get(str(layer))
            if ref is None:
                raise CheckpointError(f"{path}: no Engram table reference for layer {layer}")
            tables[layer] = engram_store.open_table(ref, path, name=f"layers.{layer}.engram",
                                                    head_dim=args.engram_head_dim)
        model.set_engram(hasher, tables, held)
    pipelined = "pipeline" in plan.modes
    model.draft = None if pipelined else load_draft(path, config, args)   # not run in a pipeline
    if dtype is not None:
        model.set_dtype(dtype)
    if "head" in model:   # a pipeline's stages but the last hold none
        quantize_head(model, flags.get("head_quant"))
    if pipelined:
        from .distributed.pipeline import Pipelined

        net = Pipelined(model, plan)
        make_dense_copies(model, net.activation_dtype)
        model.eval()
        return net
    make_dense_copies(model, model.embed.weight.dtype)
    if stream is not None:   # last: an auto-sized cache takes what the rest left
        stream.attach(model, dtype)
    model.eval()
    return model


def load_draft(path: Path, config: dict, args: ModelArgs):
    """The DSpark draft stages (dsv4.draft.Draft) where DSV4_DRAFT asks for them, or None: from
    the official shards, or from a dsv4 directory's mtp*.safetensors: as the official converter
    copies them (official packing, packed as the backbone's tensors by dsv4.layout.draft_plan),
    or stored as the backbone's are where config.json's `dsv4.draft` says so (the GGUF
    converter's, from ds4's DSpark support file). Under 'auto' a checkpoint without them simply
    has none; 'on' requires them."""
    from . import layout
    from .draft import Draft

    wanted = flags.get("draft")
    if wanted == "off":
        return None

    def absent(why: str):
        if wanted == "on":
            raise CheckpointError(f"{path}: DSV4_DRAFT=on, but {why}")
        return None

    if not args.has_draft:
        return absent("its config has no DSpark draft stages (num_nextn_predict_layers, dspark_block_size)")
    if "dsv4" in config:
        if not any(path.glob("mtp*.safetensors")):
            return absent("the directory has no mtp*.safetensors (converted with --drop-mtp, or from "
                          "a ds4 GGUF without --draft: ds4 keeps the draft stages in a separate "
                          "DSpark support GGUF)")
        ckpt = Checkpoint(path, "mtp*.safetensors", index="mtp.safetensors.index.json")
        stored = config["dsv4"].get("draft")
        if stored is not None:
            return _load_stored_draft(path, ckpt, stored, args)
    else:
        ckpt = Checkpoint(path, "model*.safetensors")
        if not any(n.startswith("mtp.") for n in ckpt.names()):
            return absent("the checkpoint has no mtp.* tensors")
    items = layout.draft_plan(ckpt, args)
    draft = Draft(args)
    _quantize(draft, {it.name: it.quantization for it in items if it.quantization})
    expected = dict(tree_flatten(draft.parameters()))
    seen: set = set()
    for item in items:
        arrays = {n: to_mx(a, dtype) for n, (dtype, a) in item.produce().items()}
        _load_arrays(draft, arrays, str(item.sources[0].file), expected, seen)
    _check_complete(draft, seen, path)
    return draft


def _load_stored_draft(path: Path, ckpt: Checkpoint, block: dict, args: ModelArgs):
    """Draft stages stored as the backbone's are (`dsv4.draft` with layout dsv4)."""
    from . import layout
    from .draft import Draft

    if not isinstance(block, dict) or block.get("layout") != "dsv4":
        raise CheckpointError(f"{path / 'config.json'}: dsv4.draft must be an object with layout "
                              f"'dsv4', got {block!r:.80}")
    refs = _references(block, path, "dsv4.draft.tensors")
    draft = Draft(args)
    _stored_forms(draft, ckpt, refs, block.get("quantization") or {}, path)
    _read_stored(draft, ckpt, refs, path, Reader(distributed.SINGLE))
    _official_dtypes(draft, lambda: layout.draft_tensors(args))
    return draft


def quantize_head(model: Model, mode: str) -> None:
    """Keep the bf16 head quantized (DSV4_HEAD_QUANT): it is the largest single read of a
    decode step. 'mxfp8' or 'affine8' (group 32); 'off' keeps it as loaded."""
    if mode == "off" or isinstance(model.head, nn.QuantizedLinear):
        return
    if mode not in ("mxfp8", "affine8"):
        raise ValueError(f"DSV4_HEAD_QUANT={mode!r}: expected off, mxfp8 or affine8")
    model.head = QuantizedLinear.from_linear(model.head, 32, 8, "mxfp8" if mode == "mxfp8" else "affine")
    mx.eval(model.head.parameters())


def load(path_or_repo: Optional[str | Path] = None, *, dtype: Optional[mx.Dtype] = None,
         expert_cache_gb: Optional[str] = None, group=None, parallel: Optional[str] = None):
    """-> (model, tokenizer). `dtype` (e.g. mx.float32) casts the float parameters;
    `expert_cache_gb` streams the routed experts; `group` and `parallel` load this rank's
    shard of a model run across processes (see load_model)."""
    path = resolve(path_or_repo)
    tokenizer = Tokenizer(path)
    return load_model(path, tokenizer, dtype, expert_cache_gb, group, parallel), tokenizer
