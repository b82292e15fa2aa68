"""Reading an EXL3 pack: which Linears are EXL3, their K and codebook, and what is missing.

An EXL3 pack (exllamav3, shared/reference/exl3.md §2, §4) keeps the official checkpoint's
tensor names; a Linear `X` quantised with EXL3 has `X.trellis` (int16 [in/16, out/16, 16K]),
`X.suh` (fp16 [in]), `X.svh` (fp16 [out]) and a codebook marker `X.mcg` / `X.mul1` (none:
3INST) instead of `X.weight` (+ `X.scale`). Everything is decided per tensor from the
headers; the config's `bits`/`codebook` fields are never trusted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from dsv4.safetensors_file import Checkpoint, CheckpointError, TensorInfo, view

from .exl3_reference import MCG_MULTIPLIER, MUL1_MULTIPLIER

# the only multipliers since exllamav3 0f2da5d; earlier experimental packs stored others
LOCKED_MULTIPLIERS = {"mcg": MCG_MULTIPLIER, "mul1": MUL1_MULTIPLIER}
EXL3_PARTS = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")
_PART = re.compile(r"^(.+)\.(trellis|suh|svh|su|sv|mcg|mul1)$")
PAD = 128  # exllamav3 pads both dims of a Linear to a multiple of 128


@dataclass(frozen=True)
class Exl3Linear:
    """One EXL3-coded Linear of the pack (storage is transposed: in x out)."""
    module: str
    trellis: TensorInfo
    input_scales: TensorInfo   # suh fp16 [in], or legacy su int16 packed signs
    output_scales: TensorInfo  # svh fp16 [out], or legacy sv
    codebook: str

    @property
    def k_bits(self) -> int:
        return self.trellis.shape[-1] // 16

    @property
    def padded_in(self) -> int:
        return 16 * self.trellis.shape[0]

    @property
    def padded_out(self) -> int:
        return 16 * self.trellis.shape[1]


def unpack_signs(bits: np.ndarray) -> np.ndarray:
    """Legacy `su`/`sv`: 16 signs per int16, LSB first, bit 1 meaning -1 -> fp16 ±1."""
    words = bits.view(np.uint16).astype(np.uint32)
    expanded = (words[:, None] >> np.arange(16)) & 1
    return (1 - 2 * expanded.reshape(-1)).astype(np.float16)


def scales(info: TensorInfo) -> np.ndarray:
    """suh/svh as fp16, whether stored as fp16 values or as legacy packed signs."""
    return unpack_signs(view(info)) if info.dtype == "I16" else np.asarray(view(info))


def scan(ckpt: Checkpoint) -> dict[str, Exl3Linear]:
    """Every EXL3 Linear of the pack, checked; all problems are raised together."""
    parts: dict[str, dict[str, TensorInfo]] = {}
    for name in ckpt.names():
        m = _PART.match(name)
        if m:
            parts.setdefault(m.group(1), {})[m.group(2)] = ckpt[name]
    linears, problems = {}, []
    for module, found in sorted(parts.items()):
        if "trellis" not in found:
            problems.append(f"{_file(found)}: {module} has {sorted(found)} but no .trellis")
            continue
        try:
            linears[module] = _linear(ckpt, module, found)
        except CheckpointError as e:
            problems.append(str(e))
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointError(f"{ckpt.directory}: " + "; ".join(problems[:10]) + more)
    return linears


def _linear(ckpt: Checkpoint, module: str, found: dict[str, TensorInfo]) -> Exl3Linear:
    trellis = found["trellis"]
    where = f"{trellis.file.name}: {module}"
    if f"{module}.scale" in ckpt:
        raise CheckpointError(f"{where} has a .scale tensor: the oldest EXL3 format, which "
                              f"exllamav3 itself no longer reads; re-quantise the pack")
    shape = trellis.shape
    if trellis.dtype != "I16" or len(shape) != 3 or shape[-1] % 16 or not 1 <= shape[-1] // 16 <= 8:
        raise CheckpointError(f"{where}.trellis is {trellis.dtype}{list(shape)}, expected "
                              f"I16[in/16, out/16, 16*K] with K in 1..8")
    k, n = 16 * shape[0], 16 * shape[1]
    u = _side_scales(found, module, where, "suh", "su", k)
    v = _side_scales(found, module, where, "svh", "sv", n)
    codebook = "3inst"
    for marker in ("mul1", "mcg"):  # both present: MCG wins, as in exllamav3's reconstruct
        info = found.get(marker)
        if info is None:
            continue
        value = np.asarray(view(info)).reshape(-1)
        if value.size != 1 or (int(value[0]) & 0xFFFFFFFF) != LOCKED_MULTIPLIERS[marker]:
            raise CheckpointError(
                f"{info.file.name}: {module}.{marker} is {value.tolist()}, expected the locked "
                f"multiplier {LOCKED_MULTIPLIERS[marker]:#x} (custom multipliers were an "
                f"experimental exllamav3 option and are not supported)")
        codebook = marker
    return Exl3Linear(module, trellis, u, v, codebook)


def _side_scales(found, module, where, name, legacy, size) -> TensorInfo:
    info = found.get(name)
    if info is not None:
        if info.dtype != "F16" or info.shape != (size,):
            raise CheckpointError(f"{where}.{name} is {info.dtype}{list(info.shape)}, expected "
                                  f"F16[{size}] to match the trellis")
        return info
    info = found.get(legacy)
    if info is not None:
        if info.dtype != "I16" or info.shape != (size // 16,):
            raise CheckpointError(f"{where}.{legacy} is {info.dtype}{list(info.shape)}, "
                                  f"expected I16[{size // 16}] packed signs")
        return info
    raise CheckpointError(f"{where} has no .{name} (nor legacy .{legacy})")


def _file(found: dict[str, TensorInfo]) -> str:
    return next(iter(found.values())).file.name


def linear_shape(dtype: str, shape: tuple[int, ...]) -> Optional[tuple[int, int]]:
    """(out, in) of an official Linear weight from its dtype and shape; None if not a Linear."""
    if len(shape) != 2:
        return None
    out, cols = shape
    return (out, 2 * cols) if dtype == "I8" else (out, cols)  # I8 experts: two fp4 per byte


def check_fits(linear: Exl3Linear, out: int, inp: int) -> None:
    """The trellis covers the official Linear, padded at most to the next multiple of 128."""
    def padded(x):
        return -(-x // PAD) * PAD

    if linear.padded_in not in (inp, padded(inp)) or linear.padded_out not in (out, padded(out)):
        raise CheckpointError(
            f"{linear.trellis.file.name}: {linear.module}.trellis is {list(linear.trellis.shape)} "
            f"(in {linear.padded_in}, out {linear.padded_out}), expected in {inp} and out {out} "
            f"(or padded to {padded(inp)} / {padded(out)})")
