"""Sharded, atomic, resumable output of a dsv4 model directory; shared by every converter.

A dsv4 model directory (format version 1)
-----------------------------------------
- `config.json`: the source's Hugging Face config (`text_config` may be flattened to the top
  level; `model_type: deepseek_v41`) without `quantization_config`, plus
  * mlx-lm's `quantization` block: `{"group_size": 32, "bits": 8, "mode": "mxfp8", ...}` where the
    top-level triple is the default for quantized modules and every module whose quantization
    differs is listed by its dsv4 module name, e.g.
    `"layers.0.ffn.experts.w1": {"group_size": 32, "bits": 4, "mode": "mxfp4"}`. A module is
    quantized iff `<module>.scales` is among the weights (affine modes add `<module>.biases`);
  * a `dsv4` block: `{"format_version": 1, "source": {"kind": "official"|"gguf"|"exl3", "repo":
    ..., "revision": ..., "path": ...}, "engram": {"<layer id>": <table reference>}}`. Table
    references are described in `dsv4/engram_store.py`: absolute paths when they point into the
    source checkpoint, relative to the model directory when the converter wrote the table there
    (`engram-LL.bin`, LL = the layer id on two digits).
- weights: `model-00001-of-0000N.safetensors` (at most `max_shard_bytes` each, 5 GB by default)
  and `model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {tensor:
  file}}`), tensors in dsv4 names and MLX packing.
- side tensors (MTP, vision) in files that are never named `model*.safetensors` (mlx-lm loads
  every such file): `<group>.safetensors`, or `<group>-0000i-of-0000N.safetensors` with
  `<group>.safetensors.index.json` when one file would exceed the shard size.
- tokenizer files (`tokenizer.json`, `tokenizer_config.json`, `*.model`, ...) copied.

Writing one
-----------
A converter describes its output as named groups of `Unit`s. A unit is one module's tensors,
produced on demand (`produce()` -> `{tensor name: (safetensors dtype, storage array)}`, as
`dsv4.safetensors_file.write` takes them) with the number of bytes it will produce:

    with ModelDirWriter(dst, fingerprint={"source": ..., "options": ...},
                        overwrite=False, resume=False) as out:
        out.write_weights({"model": units, "mtp": mtp_units})   # streams, shows progress
        stats = out.metadata("model")                           # units' metadata, all shards
        out.verify({"model": units})                            # optional; a unit's `sample`
                                                                # spares producing it again
        out.write_json("config.json", config)
        out.copy_file(src_dir / "tokenizer.json")
        if not out.exists("engram-01.bin"):
            copy_table(table, out.path("engram-01.bin"))        # its own atomic write
    # the block ended without error: the temporary directory has become `dst`

Guarantees:
- Atomic: everything goes to `.<dst name>.partial/` next to `dst`, renamed to `dst` when the
  block ends without error (`overwrite` replaces an existing `dst` only then).
- Safe: `dst` (symlinks resolved) may not be, contain or lie inside any of `sources` (what the
  conversion reads and the result references: the checkpoint, its files, GGUF parts), and
  `overwrite` deletes only what a converter wrote: an empty directory, a dsv4 model directory
  (only files, a config.json with a `dsv4` block naming its format version) or the writer's own
  unfinished `.partial` directory. Anything else is refused before anything is written.
- Resumable: units are assigned to shards greedily, in the order given, by their declared
  `nbytes`; the assignment and the caller's `fingerprint` are recorded in `plan.json` in the
  temporary directory. Each shard is written as `<file>.partial`, fsynced and renamed, so a file
  with its final name is finished. `resume=True` checks that the plan and the fingerprint are
  the same as recorded and writes only the shards that are not finished.
- Streaming: a shard is written unit by unit (the header space is reserved first and the header
  written last), so memory holds one unit's arrays, not a shard.
- Errors: bad input (`ValueError`, which includes `ConversionError` and `CheckpointError`)
  removes the temporary directory unless it belongs to an earlier run being resumed; any other
  failure (interrupt, disk full) keeps finished shards for `--resume` and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from dsv4.errors import InputError
from dsv4.progress import Progress, format_bytes
from dsv4.safetensors_file import dtype_name, read_header, view

FORMAT_VERSION = 1
MAX_SHARD_BYTES = 5 * 10**9
MODEL_GROUP = "model"
PLAN_FILE = "plan.json"
PARTIAL = ".partial"

Tensors = dict[str, tuple[str, np.ndarray]]


class ConversionError(InputError):
    """Bad input or a broken invariant; the message names the file, tensor and what was expected."""


@dataclass
class Unit:
    """One module's output tensors, produced on demand. `metadata`, when given, is called after
    `produce()` and its entries go into the shard's `__metadata__` (a converter keeps per-unit
    statistics there, e.g. a requantization error, so a resumed run still has them)."""
    key: str                          # unique within its group, e.g. the dsv4 module name
    nbytes: int                       # bytes `produce()` returns (decides the shard)
    produce: Callable[[], Tensors]
    metadata: Optional[Callable[[], dict[str, str]]] = None
    # For a costly `produce()`: `sample(rows, rng)` -> {tensor name: (dtype, full shape, row
    # indices, those rows)}, rows of the tensor flattened to [rows, last dim] and picked with
    # `pick_rows`; `verify` then uses it instead of producing the whole unit again.
    sample: Optional[Callable[[int, np.random.Generator],
                              dict[str, tuple[str, tuple, np.ndarray, np.ndarray]]]] = None


@dataclass(frozen=True)
class Shard:
    group: str
    file: str
    keys: tuple[str, ...]
    nbytes: int


def shard_name(group: str, index: int, count: int) -> str:
    """`model-00001-of-00003.safetensors`; a side group with one file is `<group>.safetensors`."""
    if count == 1 and group != MODEL_GROUP:
        return f"{group}.safetensors"
    return f"{group}-{index + 1:05d}-of-{count:05d}.safetensors"


def index_name(group: str) -> str:
    return f"{group}.safetensors.index.json"


def assign_shards(groups: Mapping[str, Sequence[Unit]], max_shard_bytes: int) -> list[Shard]:
    """Greedy, in the order given: a shard takes units until the next would pass the limit."""
    if any(g.startswith("model") and g != MODEL_GROUP for g in groups):
        raise ConversionError(f"side group names must not start with 'model': {list(groups)}")
    shards = []
    for group, units in groups.items():
        seen = set()
        bins: list[list[Unit]] = []
        size = 0
        for unit in units:
            if unit.key in seen:
                raise ConversionError(f"group {group}: unit {unit.key} is given twice")
            seen.add(unit.key)
            if not bins or (size + unit.nbytes > max_shard_bytes and bins[-1]):
                bins.append([])
                size = 0
            bins[-1].append(unit)
            size += unit.nbytes
        for i, members in enumerate(bins):
            shards.append(Shard(group, shard_name(group, i, len(bins)),
                                tuple(u.key for u in members), sum(u.nbytes for u in members)))
    return shards


def _header_reserve(units: Sequence[Unit]) -> int:
    """Bytes reserved for a shard's header: ample for 4 tensors per unit (a unit that produces
    more makes the shard be written again with the exact size)."""
    return _round8(1024 + sum(4 * (len(u.key.encode()) + 160) + 256 * (u.metadata is not None)
                              for u in units))


def _round8(n: int) -> int:
    return n + (-n % 8)


def _write_shard(path: Path, units: Sequence[Unit], progress: Progress, reserve: int) -> None:
    """Stream `units` into a safetensors file: data first (after `reserve` header bytes), then
    the header padded with spaces to exactly `reserve`. A header that does not fit raises
    _HeaderTooSmall with the size it needs."""
    header: dict = {"__metadata__": {"format": "mlx"}}
    offset = 0
    with open(path, "wb") as f:
        f.seek(8 + reserve)
        for unit in units:
            produced = unit.produce()
            written = 0
            for name in sorted(produced):
                dtype, array = produced[name]
                if name in header:
                    raise ConversionError(f"unit {unit.key}: tensor {name} is produced twice")
                dtype_name(array, dtype)
                data = np.ascontiguousarray(array)
                header[name] = {"dtype": dtype, "shape": list(data.shape),
                                "data_offsets": [offset, offset + data.nbytes]}
                f.write(memoryview(data.reshape(-1).view(np.uint8)))
                offset += data.nbytes
                written += data.nbytes
            del produced
            if unit.metadata is not None:
                header["__metadata__"].update(unit.metadata())
            if written != unit.nbytes:
                raise ConversionError(f"unit {unit.key} declared {unit.nbytes} bytes but produced "
                                      f"{written}")
            progress.advance(written)
        blob = json.dumps(header, separators=(",", ":")).encode()
        if len(blob) > reserve:
            raise _HeaderTooSmall(_round8(len(blob)))
        f.seek(0)
        f.write(struct.pack("<Q", reserve))
        f.write(blob + b" " * (reserve - len(blob)))
        f.flush()
        os.fsync(f.fileno())


class _HeaderTooSmall(Exception):
    def __init__(self, needed: int):
        self.needed = needed


class ModelDirWriter:
    """The temporary directory of one conversion; see the module docstring."""

    def __init__(self, dst: Path | str, fingerprint: Mapping, overwrite: bool = False,
                 resume: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES,
                 progress: bool = True, sources: Sequence[Path | str] = ()):
        # resolved: the checks compare real paths, and the temporary directory lies on the
        # destination's file system (where a symlinked destination really is)
        self.dst = _real(dst)
        self.tmp = self.dst.with_name(f".{self.dst.name}{PARTIAL}")
        self.old = self.dst.with_name(f".{self.dst.name}.old")  # the replaced dst, while swapping
        self.sources = [_real(s) for s in sources]
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back from plan.json
        self.overwrite, self.resume = overwrite, resume
        self.max_shard_bytes = int(max_shard_bytes)
        self.progress = progress
        self._resumed = False
        self._shards: list[Shard] = []
        if self.max_shard_bytes <= 0:
            raise ConversionError(f"the shard size must be positive, got {max_shard_bytes}")

    # -- lifetime ---------------------------------------------------------------------------

    def __enter__(self) -> "ModelDirWriter":
        self._check_sources()
        self._check_destination()
        if self.tmp.exists() or self.tmp.is_symlink():
            reason = _not_written_by_dsv4(self.tmp, unfinished=True)
            if reason:
                raise ConversionError(f"{self.tmp} is in the way and is not an unfinished dsv4 "
                                      f"conversion ({reason}): move it away")
            if self.resume:
                self._resumed = True
                self._check_fingerprint()
            elif self.overwrite:
                shutil.rmtree(self.tmp)
            else:
                raise ConversionError(
                    f"{self.tmp} holds an unfinished conversion: use --resume to continue it "
                    f"or --overwrite to start again")
        if not self._resumed:
            try:
                self.tmp.mkdir()
            except OSError as e:
                raise ConversionError(f"{self.dst.parent}: cannot create the destination there "
                                      f"({e.strerror or e})") from None
            self._write_plan()
        return self

    def _check_sources(self) -> None:
        for source in self.sources:
            for target in (self.dst, self.tmp, self.old):
                if target == source:
                    where = "is a path"
                elif source.is_relative_to(target):
                    where = f"contains {source}, a path"
                elif target.is_relative_to(source):
                    where = f"lies inside {source}, a path"
                else:
                    continue
                raise ConversionError(f"{target} {where} the conversion reads or its result "
                                      f"references: choose a destination outside it")

    def _check_destination(self) -> None:
        """dst is absent, or (with overwrite) a directory that may be replaced."""
        parent = self.dst.parent
        if not parent.is_dir():
            state = "is not a directory" if parent.exists() else "does not exist"
            raise ConversionError(f"{parent}: the destination's parent directory {state}")
        if not (self.dst.exists() or self.dst.is_symlink()):
            return
        if not self.dst.is_dir():
            raise ConversionError(f"{self.dst} is a file, not a model directory: choose another "
                                  f"destination")
        if not self.overwrite:
            raise ConversionError(f"{self.dst} already exists (use --overwrite to replace it)")
        reason = _not_written_by_dsv4(self.dst)
        if reason:
            raise ConversionError(f"{self.dst} is not a dsv4 model directory ({reason}); "
                                  f"--overwrite replaces only those: choose another destination")
        if self.old.exists() or self.old.is_symlink():
            reason = _not_written_by_dsv4(self.old)
            if reason:
                raise ConversionError(f"{self.old} is in the way ({reason}): dsv4 moves the "
                                      f"replaced directory there; move it away")

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self._commit()
            return
        finished = self._finished_files()
        if self._resumed or (finished and not issubclass(kind, ValueError)):
            print(f"\nconversion stopped; {len(finished)} finished file(s) kept in {self.tmp}: "
                  f"run again with --resume to continue, or --overwrite to start again",
                  file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _commit(self) -> None:
        try:  # again: the destination may have changed while the conversion ran
            self._check_destination()
        except ConversionError as e:
            raise ConversionError(f"{e} (the finished conversion is kept in {self.tmp}: "
                                  f"--resume completes it)") from None
        (self.tmp / PLAN_FILE).unlink(missing_ok=True)
        replaced = self.dst.exists()
        if replaced:
            if self.old.exists():
                shutil.rmtree(self.old)
            os.rename(self.dst, self.old)
        os.rename(self.tmp, self.dst)
        if replaced:
            shutil.rmtree(self.old)

    # -- plan -------------------------------------------------------------------------------

    def _write_plan(self, shards: Sequence[Shard] = ()) -> None:
        plan = {"format_version": FORMAT_VERSION, "fingerprint": self.fingerprint,
                "max_shard_bytes": self.max_shard_bytes,
                "shards": [{"group": s.group, "file": s.file, "nbytes": s.nbytes,
                            "units": list(s.keys)} for s in shards]}
        partial = self.tmp / (PLAN_FILE + PARTIAL)
        partial.write_text(json.dumps(plan, indent=1))
        os.replace(partial, self.tmp / PLAN_FILE)

    def _read_plan(self) -> dict:
        path = self.tmp / PLAN_FILE
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConversionError(f"{path}: cannot resume, the plan is unreadable ({e}); "
                                  f"use --overwrite to start again") from None

    def _check_fingerprint(self) -> None:
        plan = self._read_plan()
        recorded = plan.get("fingerprint", {})
        if plan.get("max_shard_bytes") != self.max_shard_bytes:
            raise ConversionError(f"{self.tmp}: cannot resume, the partial conversion used shards "
                                  f"of {plan.get('max_shard_bytes')} bytes, this run "
                                  f"{self.max_shard_bytes}")
        differ = sorted(k for k in set(recorded) | set(self.fingerprint)
                        if recorded.get(k) != self.fingerprint.get(k))
        if differ:
            details = "; ".join(f"{k}: was {recorded.get(k)!r}, now {self.fingerprint.get(k)!r}"
                                for k in differ)
            raise ConversionError(f"{self.tmp}: cannot resume a conversion made with other "
                                  f"inputs or options ({details}); use --overwrite")

    # -- files ------------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        """Where a file named `name` of the model directory is written now."""
        return self.tmp / name

    def exists(self, name: str) -> bool:
        """A file with its final name is finished (written under another name and renamed)."""
        return (self.tmp / name).is_file()

    def write_json(self, name: str, obj) -> None:
        partial = self.tmp / (name + PARTIAL)
        partial.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
        os.replace(partial, self.tmp / name)

    def copy_file(self, src: Path | str, name: Optional[str] = None) -> None:
        src = Path(src)
        partial = self.tmp / ((name or src.name) + PARTIAL)
        shutil.copyfile(src, partial)
        os.replace(partial, self.tmp / (name or src.name))

    def _finished_files(self) -> list[str]:
        if not self.tmp.is_dir():
            return []
        return sorted(p.name for p in self.tmp.iterdir()
                      if p.is_file() and not p.name.endswith(PARTIAL) and p.name != PLAN_FILE)

    # -- weights ----------------------------------------------------------------------------

    def write_weights(self, groups: Mapping[str, Sequence[Unit]],
                      other_bytes: int = 0) -> list[Shard]:
        """Write every group's shards that are not finished yet, then each group's index.
        First checks that the disk has room for them plus `other_bytes` (files the caller
        writes after the weights, e.g. copied Engram tables)."""
        shards = assign_shards(groups, self.max_shard_bytes)
        if self._resumed:
            recorded = self._read_plan()["shards"]
            if recorded and recorded != [{"group": s.group, "file": s.file, "nbytes": s.nbytes,
                                          "units": list(s.keys)} for s in shards]:
                raise ConversionError(f"{self.tmp}: cannot resume, the shards of the partial "
                                      f"conversion differ from this run's; use --overwrite")
        self._write_plan(shards)
        self._shards = shards
        units = {(g, u.key): u for g, us in groups.items() for u in us}
        todo = [s for s in shards if not self._shard_finished(s)]
        needed = sum(s.nbytes for s in todo) + other_bytes
        free = shutil.disk_usage(self.tmp).free
        if needed > free:
            raise ConversionError(f"{self.tmp}: the conversion needs {format_bytes(needed)} more, "
                                  f"the disk has {format_bytes(free)} free")
        total = sum(s.nbytes for s in shards)
        progress = Progress("writing weights", total, self.progress,
                            done=total - sum(s.nbytes for s in todo))
        for shard in todo:
            members = [units[(shard.group, k)] for k in shard.keys]
            final = self.tmp / shard.file
            partial = self.tmp / (shard.file + PARTIAL)
            reserve = _header_reserve(members)
            done_before = progress.done
            while True:
                try:
                    _write_shard(partial, members, progress, reserve)
                    break
                except _HeaderTooSmall as e:
                    reserve, progress.done = e.needed, done_before
                except BaseException:
                    partial.unlink(missing_ok=True)
                    raise
            os.replace(partial, final)
        progress.finish()
        for group in groups:
            self._write_index(group, [s for s in shards if s.group == group])
        return shards

    def _shard_finished(self, shard: Shard) -> bool:
        path = self.tmp / shard.file
        (self.tmp / (shard.file + PARTIAL)).unlink(missing_ok=True)
        if not path.is_file():
            return False
        read_header(path)  # a finished shard that is damaged now is an error, not silently redone
        return True

    def _write_index(self, group: str, shards: Sequence[Shard]) -> None:
        if group != MODEL_GROUP and len(shards) == 1:
            return
        weight_map, total = {}, 0
        for shard in shards:
            tensors, _ = read_header(self.tmp / shard.file)
            for name, info in tensors.items():
                weight_map[name] = shard.file
                total += info.nbytes
        self.write_json(index_name(group), {"metadata": {"total_size": total},
                                            "weight_map": dict(sorted(weight_map.items()))})

    def metadata(self, group: str = MODEL_GROUP) -> dict[str, str]:
        """The `__metadata__` of every written shard of `group`, merged."""
        merged: dict[str, str] = {}
        for shard in self._shards:
            if shard.group == group:
                merged.update(read_header(self.tmp / shard.file)[1])
        return merged

    # -- verification -----------------------------------------------------------------------

    def verify(self, groups: Mapping[str, Sequence[Unit]], rows: int = 8, seed: int = 0) -> int:
        """Re-read `rows` sampled rows (first, last and random ones) of every written tensor and
        compare them bit for bit with the same rows produced again from the source. Returns the
        number of tensors checked; raises ConversionError naming file, tensor and row."""
        written = {}
        for shard in self._shards:
            tensors, _ = read_header(self.tmp / shard.file)
            written.update({(shard.group, n): info for n, info in tensors.items()})
        rng = np.random.default_rng(seed)
        total = sum(u.nbytes for us in groups.values() for u in us)
        progress = Progress("verifying", total, self.progress)
        checked = 0
        for group, units in groups.items():
            for unit in units:
                if unit.sample is not None:
                    for name, (dtype, shape, picks, data) in unit.sample(rows, rng).items():
                        info = _written(written, group, name, dtype, tuple(shape))
                        _compare_rows(info, picks, data)
                        checked += 1
                else:
                    for name, (dtype, array) in unit.produce().items():
                        info = _written(written, group, name, dtype, array.shape)
                        expected = _as_rows(np.asarray(array))
                        picks = pick_rows(expected.shape[0], rows, rng)
                        _compare_rows(info, picks, expected[picks])
                        checked += 1
                progress.advance(unit.nbytes)
        progress.finish()
        return checked


def _real(path: Path | str) -> Path:
    try:
        return Path(path).resolve()
    except RuntimeError:  # Python < 3.13 (later ones raise OSError ELOOP)
        raise ConversionError(f"{path}: a symlink loop") from None


def _not_written_by_dsv4(path: Path, unfinished: bool = False) -> Optional[str]:
    """Why `path` is not a directory a dsv4 converter wrote, or None when it is one (or is
    empty): a model directory holds only files, among them a config.json with a `dsv4` block
    naming its format version; an `unfinished` conversion may instead hold the writer's plan."""
    if path.is_symlink() or not path.is_dir():
        return "not a directory"
    entries = list(path.iterdir())
    folders = sorted(p.name for p in entries if p.is_dir() and not p.is_symlink())
    if folders:
        return f"it holds the folder {folders[0]}, and dsv4 writes no folders"
    if not entries:
        return None
    if unfinished and _read_json(path / PLAN_FILE).get("format_version") == FORMAT_VERSION:
        return None
    block = _read_json(path / "config.json").get("dsv4")
    if not (isinstance(block, dict) and isinstance(block.get("format_version"), int)):
        return "no config.json with a dsv4 block"
    return None


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, or {} when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def pick_rows(n: int, rows: int, rng: np.random.Generator) -> np.ndarray:
    """About `rows` distinct row indices out of n, always the first and the last, sorted."""
    if n == 0:
        return np.zeros(0, np.int64)
    return np.unique(np.concatenate([[0, n - 1], rng.integers(0, n, max(rows - 2, 0))]))


def _written(written: dict, group: str, name: str, dtype: str, shape: tuple):
    info = written.get((group, name))
    if info is None:
        raise ConversionError(f"{group}: tensor {name} is missing from the output")
    if info.dtype != dtype or info.shape != tuple(shape):
        raise ConversionError(f"{info.file.name}: tensor {name} is {info.dtype}{list(info.shape)}, "
                              f"expected {dtype}{list(shape)}")
    return info


def _compare_rows(info, picks: np.ndarray, expected: np.ndarray) -> None:
    """Rows `picks` of the tensor in the file (flattened to [rows, last dim]) against `expected`."""
    got = _as_rows(view(info))
    expected = _as_rows(np.asarray(expected))
    for i, r in enumerate(picks):
        if not np.array_equal(got[r], expected[i]):  # bytes: a NaN equals itself
            col = int(np.flatnonzero(got[r] != expected[i])[0])
            raise ConversionError(f"{info.file}: tensor {info.name} row {r} differs from the "
                                  f"source at column {col} (verification failed)")


def _as_rows(array: np.ndarray) -> np.ndarray:
    """The tensor as bytes, one row per index of its leading dimensions."""
    rows = array.reshape(1, -1) if array.ndim < 2 else array.reshape(-1, array.shape[-1])
    return np.ascontiguousarray(rows).view(np.uint8)
