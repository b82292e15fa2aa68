"""EXL3 pack (exllamav3) of DeepSeek V4.1 Flash -> dsv4 model directory.

    python -m dsv4_convert exl3 SRC DST [--bits B] [--group-size G] [--workers N]

Published packs code only some Linears with EXL3 (usually the routed experts) and keep every
other tensor in the official format. The official tensors go through the official packing
(`dsv4.layout`), unchanged. Each EXL3 Linear is decoded (`exl3_decode`, trellis -> float32
weight), trimmed of exllamav3's 128-padding, and requantised to MLX affine at a width chosen
from its K (`--bits` overrides); the error this adds is measured per module, printed and
recorded in the output config. Experts of one layer and projection are stacked [E, out, in]
as dsv4 stores them; they are decoded in parallel worker processes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Optional

import numpy as np

from dsv4.config import ModelArgs
from dsv4 import layout
from dsv4.safetensors_file import Checkpoint, CheckpointError, TensorInfo

from . import exl3_pack
from .exl3_pack import Exl3Linear
from .writer import ConversionError, ModelDirWriter, Unit

# Affine width per K: about two bits above the trellis, so the requantisation adds a few
# percent to EXL3's own error (relative RMS ~0.38 at K=2, ~0.17 at K=3, ~0.09 at K=4).
BITS_FOR_K = {1: 3, 2: 4, 3: 5, 4: 6, 5: 8, 6: 8, 7: 8, 8: 8}
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
_EXPERT_MODULE = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])$")
ERRORS_FILE = "exl3_requantization_errors.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True)
class Target:
    """One dsv4 module made from EXL3 Linears: a stack of experts, or a single Linear."""
    name: str
    linears: tuple[Exl3Linear, ...]
    out: int
    inp: int
    stacked: bool

    @property
    def k_bits(self) -> int:
        return max(lin.k_bits for lin in self.linears)


# -- reading the pack ----------------------------------------------------------------------------

def read_config(src: Path) -> dict:
    path = src / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConversionError(f"{path}: missing (an EXL3 pack keeps the model's config.json)") \
            from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None
    return restore_virtual_heads(config, path)


def restore_virtual_heads(config: dict, path: Path) -> dict:
    """Undo the TP3 'virtual heads' rewrite (72 heads / 9 o_groups declared over unchanged
    64 / 8 weights, real counts in `virtual_heads_from`): dsv4 needs the real geometry."""
    config = json.loads(json.dumps(config))
    for block in (config, config.get("text_config")):
        if not isinstance(block, dict) or "virtual_heads_from" not in block:
            continue
        real = block.pop("virtual_heads_from")
        if not isinstance(real, dict) or not {"num_attention_heads", "o_groups"} <= set(real):
            raise ConversionError(f"{path}: virtual_heads_from is {real!r}, expected "
                                  f"{{'num_attention_heads': H, 'o_groups': G}}")
        block["num_attention_heads"] = int(real["num_attention_heads"])
        block["o_groups"] = int(real["o_groups"])
    return config


def is_exl3_pack(config: dict, ckpt: Checkpoint) -> bool:
    method = (config.get("quantization_config") or {}).get("quant_method")
    return method == "exl3" or any(name.endswith(".trellis") for name in ckpt.names())


class _OfficialView:
    """The pack as `dsv4.layout` expects an official checkpoint: EXL3 parts hidden, and each
    official tensor an EXL3 Linear replaces stood in by a header-only placeholder of the
    official dtype and shape. Placeholders are never read: their plan items are replaced."""

    def __init__(self, ckpt: Checkpoint, stand_ins: dict[str, tuple[str, tuple[int, ...]]],
                 hidden: set[str]):
        self.directory = ckpt.directory
        self.tensors = {n: i for n, i in ckpt.tensors.items() if n not in hidden}
        for name, (dtype, shape) in stand_ins.items():
            self.tensors[name] = TensorInfo(name, dtype, shape, Path("<exl3 stand-in>"), 0, 0)

    def __contains__(self, name):
        return name in self.tensors

    def __getitem__(self, name):
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: tensor {name} is missing") from None

    def names(self):
        return self.tensors.keys()


def plan_pack(ckpt: Checkpoint, args: ModelArgs,
              linears: dict[str, Exl3Linear]) -> tuple[list[layout.Item], list[Target]]:
    """Official items for the official tensors, and the EXL3 targets; refuses a pack with
    missing tensors (listing them), wrong shapes, or EXL3 Linears dsv4 has no place for."""
    expected = layout.expected_tensors(args)
    stand_ins, hidden = {}, set()
    singles, experts = [], {}
    for module, lin in linears.items():
        weight = expected.get(f"{module}.weight")
        shape = weight and exl3_pack.linear_shape(*weight)
        if shape is None:
            raise ConversionError(
                f"{lin.trellis.file.name}: {module} is EXL3 but dsv4 has no Linear of that name "
                f"(expected e.g. layers.N.ffn.experts.E.w1; split layouts such as wo_a.slice.G "
                f"are not supported)")
        exl3_pack.check_fits(lin, *shape)
        stand_ins[f"{module}.weight"] = weight
        if f"{module}.scale" in expected:
            stand_ins[f"{module}.scale"] = expected[f"{module}.scale"]
        hidden.update(f"{module}.{part}" for part in exl3_pack.EXL3_PARTS)
        m = _EXPERT_MODULE.match(module)
        if m:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = lin
        else:
            singles.append(Target(module, (lin,), *shape, stacked=False))
    _check_no_placeholder_clash(ckpt, stand_ins)
    view = _OfficialView(ckpt, stand_ins, hidden)
    try:
        layout.check(view, args)
    except CheckpointError as e:
        raise ConversionError(f"{e}\n(this is an EXL3 pack: a tensor listed as missing is neither "
                              f"in the official format nor EXL3-coded; some published packs "
                              f"lack all non-expert tensors and cannot be converted)") from None
    targets = list(singles)
    for name, by_index in sorted(experts.items()):
        if len(by_index) != args.n_routed_experts:
            official = sorted(set(range(args.n_routed_experts)) - set(by_index))
            raise ConversionError(f"{name}: experts {sorted(by_index)[:8]}... are EXL3 but "
                                  f"{official[:8]}... are not; a mixed stack is not supported")
        first = by_index[0].module
        out, inp = exl3_pack.linear_shape(*expected[f"{first}.weight"])
        targets.append(Target(name, tuple(by_index[e] for e in sorted(by_index)), out, inp, True))
    replaced = {t.name for t in targets}
    items = [it for it in layout.plan(view, args) if it.name not in replaced]
    return items, targets


def _check_no_placeholder_clash(ckpt: Checkpoint, stand_ins: dict) -> None:
    both = sorted(n for n in stand_ins if n in ckpt)
    if both:
        raise ConversionError(f"{ckpt.directory}: {both[0]} is present both as an official "
                              f"tensor and as EXL3 ({len(both)} such tensors)")


# -- decoding and requantising --------------------------------------------------------------------

def choose_bits(k_bits: int, override: Optional[int]) -> int:
    return override if override is not None else BITS_FOR_K[k_bits]


def decode_requantize(lin: Exl3Linear, out: int, inp: int, bits: int, group_size: int):
    """One EXL3 Linear -> MLX affine (weight uint32, scales/biases bf16 bits) + error sums."""
    import mlx.core as mx

    from dsv4.safetensors_file import view

    from .exl3_decode import linear_weight

    weight = linear_weight(np.asarray(view(lin.trellis)), exl3_pack.scales(lin.input_scales),
                           exl3_pack.scales(lin.output_scales), lin.codebook)[:out, :inp]
    q, s, b = mx.quantize(weight.astype(mx.bfloat16), group_size=group_size, bits=bits)
    error = mx.dequantize(q, s, b, group_size=group_size, bits=bits).astype(mx.float32) - weight
    err2, ref2 = mx.sum(error * error), mx.sum(weight * weight)
    mx.eval(q, s, b, err2, ref2)
    return (np.array(q), np.array(s.view(mx.uint16)), np.array(b.view(mx.uint16)),
            float(err2), float(ref2))


def _decode_job(job):
    return decode_requantize(*job)


class Decoder:
    """Decodes targets, in worker processes when `workers` > 1, and keeps the added errors."""

    def __init__(self, bits: Optional[int], group_size: int, workers: int, progress: bool = True):
        self.bits, self.group_size, self.workers, self.progress = bits, group_size, workers, progress
        self.errors: dict[str, float] = {}
        self.on_error = lambda errors: None  # called after each module, e.g. to save them
        self._pool = None

    def __enter__(self):
        if self.workers > 1:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=get_context("spawn"))
        return self

    def __exit__(self, *exc):
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def quantization(self, target: Target) -> dict:
        return {"group_size": self.group_size, "bits": choose_bits(target.k_bits, self.bits),
                "mode": "affine"}

    def nbytes(self, target: Target) -> int:
        bits = choose_bits(target.k_bits, self.bits)
        rows = len(target.linears) * target.out
        return rows * target.inp * bits // 8 + 2 * 2 * rows * (target.inp // self.group_size)

    def unit(self, target: Target) -> Unit:
        return Unit(target.name, self.nbytes(target), lambda: self.produce(target))

    def produce(self, target: Target) -> dict[str, tuple[str, np.ndarray]]:
        bits = choose_bits(target.k_bits, self.bits)
        jobs = [(lin, target.out, target.inp, bits, self.group_size) for lin in target.linears]
        results, shown = [], 0.0
        for result in (self._pool.map(_decode_job, jobs) if self._pool else map(_decode_job, jobs)):
            results.append(result)
            if self.progress and time.monotonic() - shown > 0.5:  # a stack takes minutes
                shown = time.monotonic()
                print(f"\rdecoding {target.name}: {len(results)}/{len(jobs)} ", end="",
                      file=sys.stderr, flush=True)
        parts = [np.stack(arrays) if target.stacked else arrays[0]
                 for arrays in zip(*(r[:3] for r in results))]
        err2, ref2 = sum(r[3] for r in results), sum(r[4] for r in results)
        self.errors[target.name] = float(np.sqrt(err2 / ref2)) if ref2 > 0 else 0.0
        self.on_error(self.errors)
        return {f"{target.name}.weight": ("U32", parts[0]),
                f"{target.name}.scales": ("BF16", parts[1]),
                f"{target.name}.biases": ("BF16", parts[2])}


# -- the conversion -------------------------------------------------------------------------------

def official_unit(item: layout.Item) -> Unit:
    """A writer unit for an official item; its byte count from the packing it gets."""
    if item.quantization == layout.MXFP8:  # codes unchanged, scales one per row and 32 inputs
        weight = item.sources[0]
        nbytes = weight.nbytes + weight.shape[0] * weight.shape[1] // 32
    else:  # plain tensors and mxfp4 experts keep their bytes
        nbytes = item.nbytes
    return Unit(item.name, nbytes, item.produce)


def output_config(config: dict, items, targets, decoder: Decoder, src: Path,
                  engram: dict) -> dict:
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    quantization: dict = dict(layout.MXFP8)
    for item in items:
        if item.quantization and item.quantization != layout.MXFP8:
            quantization[item.name] = dict(item.quantization)
    for target in targets:
        quantization[target.name] = decoder.quantization(target)
    out["quantization"] = quantization
    ks = sorted({lin.k_bits for t in targets for lin in t.linears})
    out["dsv4"] = {
        "format_version": 1,
        "source": {"kind": "exl3", "path": str(src),
                   "quantization_config": config.get("quantization_config")},
        "engram": engram,
        "exl3": {"bits_for_K": {str(k): choose_bits(k, decoder.bits) for k in ks},
                 "group_size": decoder.group_size,
                 "codebooks": sorted({lin.codebook for t in targets for lin in t.linears}),
                 "added_relative_rms": decoder.errors},
    }
    return out


def convert(src: Path | str, dst: Path | str, bits: Optional[int] = None, group_size: int = 64,
            workers: Optional[int] = None, overwrite: bool = False, resume: bool = False,
            verify: bool = False, progress: bool = True) -> dict[str, float]:
    """Convert the EXL3 pack at `src` into a dsv4 model directory `dst`; returns the added
    relative RMS error of each requantised module."""
    src = Path(src)
    if bits is not None and bits not in AFFINE_BITS:
        raise ConversionError(f"--bits {bits}: MLX affine widths are {AFFINE_BITS}")
    if group_size not in GROUP_SIZES:
        raise ConversionError(f"--group-size {group_size}: expected one of {GROUP_SIZES}")
    config = read_config(src)
    ckpt = Checkpoint(src)
    if not is_exl3_pack(config, ckpt):
        raise ConversionError(f"{src}: not an EXL3 pack (no .trellis tensors, quant_method "
                              f"{(config.get('quantization_config') or {}).get('quant_method')!r}); "
                              f"use the official converter")
    args = ModelArgs.from_dict(config)
    linears = exl3_pack.scan(ckpt)
    items, targets = plan_pack(ckpt, args, linears)
    for target in targets:
        if target.inp % group_size:
            raise ConversionError(f"{target.name}: input size {target.inp} is not a multiple of "
                                  f"--group-size {group_size}")
    engram = layout.engram_table_refs(ckpt, args)
    workers = workers if workers is not None else min(4, os.cpu_count() or 1)
    fingerprint = {"source": str(src.resolve()), "kind": "exl3",
                   "options": {"bits": bits, "group_size": group_size},
                   "files": sorted((i.file.name, i.file.stat().st_size)
                                   for i in {t.file: t for t in ckpt.tensors.values()}.values())}
    with Decoder(bits, group_size, workers, progress) as decoder, \
            ModelDirWriter(dst, fingerprint, overwrite=overwrite, resume=resume,
                           progress=progress) as out:
        if out.exists(ERRORS_FILE):  # resuming: modules decoded by the earlier run
            decoder.errors.update(json.loads(out.path(ERRORS_FILE).read_text()))
        decoder.on_error = lambda errors: out.write_json(ERRORS_FILE, errors)
        units = [official_unit(it) for it in items] + [decoder.unit(t) for t in targets]
        units.sort(key=lambda u: u.key)
        out.write_weights({"model": units})
        if verify:
            out.verify({"model": [official_unit(it) for it in items]})
        out.write_json("config.json", output_config(config, items, targets, decoder,
                                                    src.resolve(), engram))
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                out.copy_file(src / name)
    report_errors(decoder.errors, targets, decoder, progress)
    return decoder.errors


def report_errors(errors: dict[str, float], targets: list[Target], decoder: Decoder,
                  enabled: bool) -> None:
    if not enabled or not errors:
        return
    by_k: dict[int, list[float]] = {}
    for target in targets:
        if target.name in errors:
            by_k.setdefault(target.k_bits, []).append(errors[target.name])
    for k, values in sorted(by_k.items()):
        print(f"EXL3 K={k} -> affine {choose_bits(k, decoder.bits)}-bit/{decoder.group_size}: "
              f"added relative RMS error mean {np.mean(values):.4f}, max {np.max(values):.4f} "
              f"over {len(values)} modules", file=sys.stderr)


def exl3_command(
    src: Path,
    dst: Path,
    bits: Optional[int] = None,
    group_size: int = 64,
    workers: Optional[int] = None,
    overwrite: bool = False,
    resume: bool = False,
    verify: bool = False,
) -> None:
    """Convert an EXL3 (exllamav3) pack of DeepSeek V4.1 Flash into a dsv4 model directory.

    EXL3 Linears are decoded and requantised to MLX affine (BITS: width for all of them,
    default from each module's K: K1->3, K2->4, K3->5, K4->6, K5+->8); official tensors are
    packed as the official converter does. WORKERS decode in parallel (default min(4, cores)).
    """
    try:
        convert(src, dst, bits=bits, group_size=group_size, workers=workers,
                overwrite=overwrite, resume=resume, verify=verify)
    except (ConversionError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
