"""Routed experts streamed from the model's files into a fixed cache of slots (--expert-cache-gb).

The routed experts are ~95% of V4.1 Flash's weights (279 GB official, ~145 GB in ds4's Q2). With
streaming on, the loader does not load them: it records where each expert tensor lies (a dsv4
model directory's shards, a GGUF referenced in place through config.json's dsv4.tensors, or
an official checkpoint's per-expert tensors) and `Streaming.attach` gives the model an
`ExpertStore`. The store keeps a pool of preallocated slots, each holding one (layer, expert):
its gate, up and down weights in the module's own format (mxfp4, mxfp8, affine, GGUF blocks,
or floats), byte for byte as the resident model would hold them. A layer's MoE routes first,
then asks the store for the experts it selected:

    store.sync([ids, weights])                       # the one host sync of the layer
    slots = store.lookup(layer, experts, tokens)     # misses read into slots; their slot ids
    y = pool_experts(x, slot_ids, ...)               # the resident code path over the pool
    store.fence(layer, slots, y)                     # those slots wait for y before reuse

The pool's arrays are an expert stack like the resident one, [slots, out, ...] for each of the
module's parameters, so the kernels and gather_qmm see the same operands with slot ids for
expert ids: the logits are bit-identical to the resident model's (tests/test_expert_streaming.py).

Reads: the misses of a lookup are split into pieces of at most `expert_read_chunk_kb` and read
by the native reader's C++ threads (dsv4/native/reads.cpp, `expert_native_reads`: no GIL until
a layer waits), else by the shared Python pread pool (dsv4/pread_pool.py), straight into the
slots' memory: MLX arrays are host-addressable (unified memory on Apple silicon, managed memory
on CUDA, plain memory on the CPU), so there is no copy after the read (with `expert_io_direct`
on Linux, one copy from the worker's aligned O_DIRECT buffer). A lookup joins every
read before it returns or raises. A short read (a file truncated since loading) or an I/O
error is an `ExpertReadError` naming the tensor, the expert and the byte; the slot is left
empty, never half-written into use. With `expert_io_hints` the files are read around the OS
cache (F_NOCACHE on macOS; on Linux each piece is dropped from the cache once read), so that
150 GB of experts do not push the resident weights out of memory.

Slots are overwritten only when nothing queued may still read them. `sync` evaluates a layer's
routing together with all work fenced since the previous sync (the previous layer's experts:
what the routing depends on anyway), after which every slot is free; between syncs (the token
parts of one prefill chunk) a slot's fence is evaluated before the slot is reused. `prefetch`
starts reads for experts a layer is likely to need (the MoE guesses layer L+1's experts by
applying its router to layer L's input) without waiting, into slots free at that moment; a
lookup that finds one waits for its read only.

Which slot to overwrite: dsv4/expert_policy.py (`expert_cache_policy`). Layers whose experts
have the same shapes and format share one pool; a model whose layers differ (a GGUF recipe
with other types in some layers) has one pool per kind, the budget split by their bytes.

Residency on Metal (what MLX does, read in MLX 0.32.2's metal/allocator.cpp and resident.cpp):
every buffer MLX allocates outside its small-allocation heap is added to an MTLResidencySet
attached to every command queue, up to the wired limit (`mx.set_wired_limit`, 0 by default:
then nothing is in a residency set, and the driver makes each command buffer's buffers resident
at submission, which is what cost seed 004 ~250 ms per submission with a 104 GiB pool). Buffers
join the sets in allocation order while the wired total stays under the limit; raising the limit
later adds the others. Sets are capped at MLX_RESIDENCY_SET_MAX_PCT (5%) of the recommended
working set each, a larger buffer gets a set of its own. MLX buffers use untracked hazards:
Metal does not order the host's writes against the GPU's reads, which is why the store fences
slots itself. So the store allocates its pool as one buffer per parameter kind (six for mxfp4:
a few large buffers; one larger than Metal's max_buffer_length is refused with the size that
fits) and `attach` sets the wired limit to max_recommended_working_set_size, so that the
resident weights and the pool, allocated before anything else, are all in residency sets (a
warning says when they do not fit). This cannot be tested without a Mac; on CUDA the first host write
moves a pool buffer to managed memory (MLX's Buffer::raw_ptr), which the GPU then reads
through page migration.
"""

from __future__ import annotations

import copy
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from . import flags, profiler
from .errors import InputError
from .expert_policy import Policy
from .pread_pool import NativeRead, OpenFiles, PartedFile, Reads, executor, native_reader
from .safetensors_file import STORAGE

# A routed expert tensor: stacked `layers.3.ffn.experts.w1.weight` (dsv4, GGUF references) or
# one expert's `layers.3.ffn.experts.17.w1.scale` (official checkpoints).
ROUTED = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(?:(\d+)\.)?(w[123])\.(weight|scales|biases|scale)$")
GB = 1e9
FLOATS = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}


class ExpertStoreError(InputError):
    """A cache size, or an expert tensor, that streaming cannot use."""


class ExpertReadError(OSError):
    """An expert could not be read (I/O error, or a short read of a truncated file)."""


def is_routed(name: str) -> bool:
    return ROUTED.match(name) is not None


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies: a file (or the parts of a byte-split file), its first byte, and its
    safetensors dtype and shape."""
    name: str
    paths: tuple[Path, ...]
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(STORAGE[self.dtype]).itemsize

    @classmethod
    def of(cls, info) -> "StoredTensor":
        """From a safetensors_file.TensorInfo."""
        return cls(info.name, (Path(info.file),), int(info.offset), info.dtype, tuple(info.shape))


def parse_budget(text: Optional[str]) -> Optional[str]:
    """The option's value checked: None or '' (streaming off), 'auto', or a positive number of GB."""
    if text is None or str(text).strip() == "":
        return None
    text = str(text).strip().lower()
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise ExpertStoreError(f"expert cache size {text!r}: expected a number of GB > 0, or auto")
    return text


# --- where each layer's experts lie ------------------------------------------------------------

class _Param:
    """One parameter of a layer's routed experts (e.g. `w1.scales`): its shape and dtype in the
    pool, and for each expert the file and byte offset of its bytes there."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: mx.Dtype, experts: int):
        self.name, self.shape = name, tuple(shape)
        self.dtype = dtype                    # the module's; a float's comes from the files
        self.floats_stored: Optional[str] = None   # the files' float dtype
        self.stored: Optional[str] = None          # the same, where the pool's differs
        self.files: list[Optional[PartedFile]] = [None] * experts
        self.offsets = np.zeros(experts, np.int64)
        self.tensors: list[str] = [""] * experts
        self.stacked = True

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's parameter in the pool."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.size

    def stored_bytes(self) -> int:
        """Bytes of one expert's parameter in the files."""
        return self.nbytes if self.stored is None else self.nbytes // self.dtype.size * FLOATS[self.stored].size

    def where(self, expert: int) -> str:
        """What an error calls this parameter of `expert`."""
        name = self.tensors[expert]
        return f"{name}, expert {expert}" if self.stacked else f"{name} (expert {expert})"

    def take_dtype(self, stored: str, cast: Optional[mx.Dtype], tensor: str) -> None:
        """The pool holds what the resident model would: packed codes as the module declares
        them (fp4 codes stored as I8 are mxfp4's uint32 words, e8m0 scales uint8), floats as
        loaded (their stored dtype), cast to the loader's `dtype` as set_dtype casts them."""
        if (stored in FLOATS) != (self.dtype in FLOATS.values()):
            raise ExpertStoreError(f"{tensor}: stored as {stored}, but the model holds "
                                   f"{self.name} as {self.dtype}")
        if stored not in FLOATS:
            return
        if self.floats_stored is not None and self.floats_stored != stored:
            raise ExpertStoreError(f"{tensor}: stored as {stored}, other experts' {self.name} "
                                   f"as {self.floats_stored}")
        self.floats_stored = stored
        self.dtype = cast or FLOATS[stored]
        self.stored = stored if FLOATS[stored] != self.dtype else None


class _LayerExperts:
    """A layer's routed experts on disk: the module that computes them (`template`, whose
    parameters were never loaded) and the placement of each of its parameters."""

    def __init__(self, layer: int, template: nn.Module, cast: Optional[mx.Dtype]):
        self.layer = layer
        self.template = template
        self.cast = cast
        params = tree_flatten(template.parameters())
        self.experts = params[0][1].shape[0]
        self.params = {name: _Param(name, a.shape[1:], a.dtype, self.experts) for name, a in params}

    @property
    def expert_bytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())

    def signature(self) -> tuple:
        """What decides whether two layers can share a pool: the parameters and the modules' kinds."""
        kinds = tuple((name, type(m).__name__, getattr(m, "mode", None), getattr(m, "bits", None),
                       getattr(m, "group_size", None), getattr(m, "qtype", None))
                      for name, m in sorted(self.template.children().items()) if isinstance(m, nn.Module))
        return kinds, tuple((p.name, p.shape, p.dtype) for p in self.params.values())

    def place(self, tensor: StoredTensor, expert: Optional[int], param: str, files: OpenFiles) -> None:
        """Record a stored tensor: a stack [E, ...] (expert None) or one expert's tensor."""
        p = self.params.get(param)
        if p is None:
            raise ExpertStoreError(f"{tensor.name}: the model's routed experts have no parameter "
                                   f"{param} (they hold {', '.join(self.params)})")
        p.take_dtype(tensor.dtype, self.cast, tensor.name)
        per_expert = p.stored_bytes()
        count = self.experts if expert is None else 1
        if tensor.nbytes != per_expert * count:
            expect = f"{count} experts of {per_expert} bytes" if expert is None else f"{per_expert} bytes"
            raise ExpertStoreError(f"{tensor.name}: {tensor.dtype}{list(tensor.shape)} is "
                                   f"{tensor.nbytes} bytes; the model's {p.name} needs {expect}")
        file = files.file(tensor.paths)   # present and long enough: the loader checked both
        first, stop = (0, self.experts) if expert is None else (expert, expert + 1)
        for e in range(first, stop):
            p.files[e] = file
            p.offsets[e] = tensor.offset + (e - first) * per_expert
            p.tensors[e] = tensor.name
        p.stacked = expert is None

    def check_complete(self) -> None:
        for p in self.params.values():
            absent = [e for e, f in enumerate(p.files) if f is None]
            if absent:
                raise ExpertStoreError(f"layers.{self.layer}.ffn.experts: no tensor holds {p.name} "
                                       f"of expert {absent[0]}" + (f" (and {len(absent) - 1} more)"
                                                                   if len(absent) > 1 else ""))


# --- the slab pool -----------------------------------------------------------------------------

def _with_weights(module: nn.Module, arrays: dict[str, mx.array]) -> nn.Module:
    """A copy of an expert module whose parameters are `arrays` ({'w1': {'weight': ...}, ...}),
    marked single-use: nothing derived from them is kept (constants.kept), since a slot's
    weights are replaced in place by reads."""
    out = copy.copy(module)
    for child, params in arrays.items():
        linear = copy.copy(module[child])
        linear.update(params)
        linear.single_use = True
        out[child] = linear
    return out


class SlabPool:
    """`slots` slots for the experts of layers that share one signature: one MLX array per
    parameter, [slots, *shape], and its bytes as a writable host view [slots, nbytes]."""

    def __init__(self, layers: list[_LayerExperts], slots: int, policy: str):
        self.layers = {l.layer: l for l in layers}
        first = layers[0]
        self.slots = slots
        self.expert_bytes = first.expert_bytes
        self.arrays: dict[str, mx.array] = {}
        self.views: dict[str, np.ndarray] = {}
        largest = mx.device_info().get("max_buffer_length") if mx.metal.is_available() else None
        for name, p in first.params.items():
            if largest is not None and slots * p.nbytes > largest:
                raise ExpertStoreError(
                    f"an expert cache of {slots} slots makes {name} one buffer of "
                    f"{slots * p.nbytes / GB:.4g} GB, more than Metal's largest "
                    f"({largest / GB:.4g} GB): at most {largest // p.nbytes} slots, about "
                    f"{largest // p.nbytes * self.expert_bytes / GB:.4g} GB")
            array = mx.zeros((slots, *p.shape), p.dtype)
            mx.eval(array)
            self.arrays[name] = array
            self.views[name] = np.frombuffer(memoryview(array), np.uint8).reshape(slots, p.nbytes)
        self.template = first.template
        self.owner_layer = np.full(slots, -1, np.int64)
        self.owner_expert = np.full(slots, -1, np.int64)
        self.slot_of = {l.layer: np.full(l.experts, -1, np.int64) for l in layers}
        self.loading: dict[int, Reads] = {}          # slot -> the prefetch read filling it
        self.prefetched = np.zeros(slots, bool)      # filled by a prefetch, not yet used
        self.fences: dict[int, mx.array] = {}        # slot -> work queued since the last sync
        self.policy = Policy(policy, slots, len(self.layers))

    @property
    def nbytes(self) -> int:
        return self.slots * self.expert_bytes

    def modules(self, arrays: Optional[dict[str, mx.array]] = None,
                gather: Optional[mx.array] = None) -> nn.Module:
        """The layers' own expert modules over the pool's arrays, or over `arrays` standing in for
        them (a compiled segment's inputs, dsv4/step_segments.py). With `gather` (slot ids [n],
        int32), over copies of just those slots (experts 0..n-1, in order): for the CPU's dense
        path (DSV4_DEQUANT_MATMUL), which multiplies by a dense copy of a module's whole stack."""
        nested: dict[str, dict[str, mx.array]] = {}
        for name, array in (self.arrays if arrays is None else arrays).items():
            child, leaf = name.rsplit(".", 1)
            nested.setdefault(child, {})[leaf] = array if gather is None else array[gather]
        return _with_weights(self.template, nested)

    def busy(self, keep: np.ndarray, fenced: bool) -> np.ndarray:
        """The mask of slots that may not be overwritten now: `keep`, those a prefetch is
        filling, and with `fenced` those that queued work may still read."""
        mask = np.zeros(self.slots, bool)
        mask[np.asarray(keep, np.int64)] = True
        mask[list(self.loading)] = True
        if fenced:
            mask[list(self.fences)] = True
        return mask

    def empty(self, slots) -> None:
        slots = np.asarray(slots, np.int64)
        for slot in slots.tolist():
            owner = self.owner_layer[slot]
            if owner >= 0:
                self.slot_of[owner][self.owner_expert[slot]] = -1
        self.owner_layer[slots] = -1
        self.owner_expert[slots] = -1
        self.prefetched[slots] = False
        self.policy.forget(slots)

    def own(self, layer: int, experts: np.ndarray, slots: np.ndarray) -> None:
        self.owner_layer[slots] = layer
        self.owner_expert[slots] = experts
        self.slot_of[layer][experts] = slots


@dataclass
class LayerStats:
    """What one layer's lookups did: counts of experts and bytes, and the time spent waiting."""
    tokens: int = 0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0        # waiting in lookups for this layer's misses
    prefetched: int = 0              # experts whose reads a prefetch started
    prefetch_hits: int = 0           # lookups served by a prefetched expert
    guessed: int = 0                 # experts a guess named for this layer
    guessed_right: int = 0           # of those, selected when the layer ran

    def add(self, other: "LayerStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class ExpertStore:
    """The cache of routed experts: syncs, lookups, prefetches, fences, and their statistics.
    Called from the thread that runs the model only (MLX graphs are built on one thread)."""

    def __init__(self, layers: Sequence[_LayerExperts], budget_bytes: float, files: OpenFiles,
                 top_k: int, policy: Optional[str] = None):
        self._files = files
        self.top_k = top_k
        groups: dict[tuple, list[_LayerExperts]] = {}
        for l in layers:
            groups.setdefault(l.signature(), []).append(l)
        # The least cache holds one token's top-k in every layer.
        self.least_bytes = least = sum(l.expert_bytes * top_k for l in layers)
        everything = sum(l.expert_bytes * l.experts for l in layers)
        if budget_bytes < least:
            raise ExpertStoreError(
                f"an expert cache of {budget_bytes / GB:.4g} GB is too small: one token's {top_k} "
                f"experts in every layer take {least / GB:.4g} GB (the least --expert-cache-gb)")
        share = min(1.0, budget_bytes / everything)
        self.pools: list[SlabPool] = []
        self._pool_of: dict[int, SlabPool] = {}
        policy = policy or str(flags.get("expert_cache_policy"))
        for group in groups.values():
            total = sum(l.experts for l in group)
            slots = max(top_k * len(group), min(total, int(share * total)))
            pool = SlabPool(group, slots, policy)
            self.pools.append(pool)
            self._pool_of.update({l.layer: pool for l in group})
        self.stats = {l.layer: LayerStats() for l in layers}
        self._guesses: dict[int, np.ndarray] = {}
        # layer -> the next streamed layer and its router (the MoE guesses that layer's experts)
        self.next_layer: dict[int, int] = {}
        self.next_gate: dict[int, nn.Module] = {}

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def capacity(self, layer: int) -> int:
        """The most distinct experts of `layer` that one lookup can hold."""
        return self._pool_of[layer].slots

    def pool(self, layer: int) -> SlabPool:
        return self._pool_of[layer]

    # --- the MoE's calls, in order ------------------------------------------------------------

    def sync(self, arrays: Sequence[mx.array]) -> None:
        """Evaluate `arrays` (a layer's routing) together with every piece of work that read
        slots since the last sync: afterwards no queued work reads any slot, and the host may
        overwrite all of them. The fenced work is, but for the sub-batches of one layer, what
        the routing depends on anyway (the previous layer's output), so this costs no extra
        wait."""
        pending = {id(a): a for pool in self.pools for a in pool.fences.values()}
        mx.eval(*arrays, *pending.values())
        for pool in self.pools:
            pool.fences.clear()

    def lookup(self, layer: int, experts: np.ndarray, tokens: int) -> np.ndarray:
        """Slot ids [n] holding `experts` [n] (distinct ids) of `layer`, for `tokens` tokens;
        the misses are read first. Raises ExpertReadError (naming tensor and expert) once every
        read has joined; the slots it was filling are empty again."""
        pool = self._pool_of[layer]
        experts = np.asarray(experts, np.int64)
        stats = self.stats[layer]
        stats.tokens += tokens
        stats.lookups += 1
        pool.policy.tick()
        self._land_prefetches(pool, wait=False)
        slots = pool.slot_of[layer][experts]
        for slot in slots[slots >= 0].tolist():
            if slot in pool.loading:          # a prefetch is still reading this expert
                self._land(pool, slot, raise_error=True)
        guess = self._guesses.pop(layer, None)
        if guess is not None:
            stats.guessed += len(guess)
            stats.guessed_right += int(np.isin(guess, experts).sum())
        slots = pool.slot_of[layer][experts]
        hit = slots >= 0
        stats.hits += int(hit.sum())
        stats.prefetch_hits += int(pool.prefetched[slots[hit]].sum())
        miss = np.flatnonzero(~hit)
        if len(miss):
            victims = self._victims(pool, len(miss), slots[hit], layer)
            slots[miss] = victims
            started = time.perf_counter()
            reads = self._start_reads(pool, layer, experts[miss], victims)
            try:
                reads.wait()
            except OSError:
                pool.empty(victims)
                raise
            finally:
                stats.read_seconds += time.perf_counter() - started
            stats.misses += len(miss)
            stats.bytes_read += len(miss) * pool.expert_bytes
        pool.prefetched[slots] = False
        pool.policy.use(slots, layer)
        if profiler.enabled():
            profiler.count(f"experts L{layer} hits", int(hit.sum()))
            profiler.count(f"experts L{layer} misses", len(miss))
            profiler.count(f"experts L{layer} MB read", len(miss) * pool.expert_bytes / 1e6)
        return slots

    def prefetch(self, layer: int, experts: np.ndarray) -> None:
        """Start reading those of `experts` of `layer` that are not cached, into slots free to
        overwrite now, and return at once; the guess is scored when `layer` is looked up."""
        pool = self._pool_of[layer]
        experts = np.unique(np.asarray(experts, np.int64))
        self._guesses[layer] = experts
        todo = experts[pool.slot_of[layer][experts] < 0]
        if not len(todo):
            return
        free = np.flatnonzero(~pool.busy(np.zeros(0, np.int64), fenced=True))
        victims = pool.policy.victims(free, len(todo), layer)
        todo = todo[:len(victims)]
        if not len(todo):
            return
        pool.empty(victims)
        reads = self._start_reads(pool, layer, todo, victims)
        for slot in victims.tolist():
            pool.loading[slot] = reads
        pool.prefetched[victims] = True
        pool.policy.use(victims, layer)
        self.stats[layer].prefetched += len(todo)

    def fence(self, layer: int, slots: np.ndarray, result: mx.array) -> None:
        """`result` is computed from `slots` (queued, maybe not run yet): they are not
        overwritten before it is, nor before the next `sync`."""
        pool = self._pool_of[layer]
        for slot in np.asarray(slots).tolist():
            pool.fences[slot] = result

    # --- slots ---------------------------------------------------------------------------------

    def _victims(self, pool: SlabPool, n: int, keep: np.ndarray, layer: int) -> np.ndarray:
        """`n` slots to overwrite, emptied; what queued work still reads is waited for."""
        free = np.flatnonzero(~pool.busy(keep, fenced=False))
        if len(free) < n and pool.loading:
            self._land_prefetches(pool, wait=True)
            free = np.flatnonzero(~pool.busy(keep, fenced=False))
        if len(free) < n:
            raise ExpertStoreError(f"layer {layer}: {n} experts to read, but only {len(free)} of "
                                   f"the cache's {pool.slots} slots are free")
        victims = pool.policy.victims(free, n, layer)
        fenced = [pool.fences.pop(s) for s in victims.tolist() if s in pool.fences]
        if fenced:
            mx.eval(*fenced)
        pool.empty(victims)
        return victims

    def _land_prefetches(self, pool: SlabPool, wait: bool) -> None:
        """Prefetches that are done (all, with `wait`) become ordinary cached experts, or empty
        slots if they failed: an expert nobody has asked for raises only when asked for."""
        for slot in [s for s, reads in pool.loading.items() if wait or reads.done()]:
            if slot in pool.loading:
                self._land(pool, slot, raise_error=False)

    def _land(self, pool: SlabPool, slot: int, raise_error: bool) -> None:
        reads = pool.loading[slot]
        together = [s for s, r in pool.loading.items() if r is reads]
        try:
            reads.wait()
        except OSError:
            pool.empty(together)
            if raise_error:
                raise
        finally:
            for s in together:
                del pool.loading[s]

    def _start_reads(self, pool: SlabPool, layer: int, experts: np.ndarray, slots: np.ndarray) -> Reads:
        """Submit the reads of `experts` of `layer` into `slots` (which own them from now on);
        Reads.wait() joins them and converts stored floats of another width."""
        placement = pool.layers[layer]
        chunk = int(flags.get("expert_read_chunk_kb")) << 10
        # Buffered reads on Linux leave the pieces in the page cache unless dropped (macOS:
        # F_NOCACHE; O_DIRECT reads do not go through the cache).
        drop = bool(flags.get("expert_io_hints")) and sys.platform != "darwin" and not flags.get("expert_io_direct")
        pool.own(layer, experts, slots)
        pieces, conversions = [], []   # pieces: (file, view, offset, param, expert)
        for expert, slot in zip(experts.tolist(), slots.tolist()):
            for name, p in placement.params.items():
                target = pool.views[name][slot] if p.stored is None else np.empty(p.stored_bytes(), np.uint8)
                file, base = p.files[expert], int(p.offsets[expert])
                pieces += [(file, target[lo:lo + chunk], base + lo, p, expert) for lo in range(0, len(target), chunk)]
                if p.stored is not None:
                    conversions.append((target, pool.views[name][slot], p))
        workers = int(flags.get("expert_read_workers"))
        reader = native_reader() if flags.get("expert_native_reads") and not flags.get("expert_io_direct") else None
        if reader is not None and pieces:   # C++ threads: no GIL to wait for while layers encode
            read = reader.start_ranges([view for _, view, *_ in pieces],
                                       [[offset, *file.native_parts()] for file, _, offset, *_ in pieces], drop, workers)
            futures = [NativeRead(read, lambda i, error: _piece_failure(pieces[i], error))]
        else:
            futures = [executor(workers).submit(_read_piece, *piece, drop) for piece in pieces]

        def convert():
            for stored, view, p in conversions:   # here, not on a worker: MLX ops are single-threaded
                values = mx.array(stored).view(FLOATS[p.stored]).astype(p.dtype)
                view[:] = np.frombuffer(memoryview(values), np.uint8)

        return Reads(futures, convert)

    # --- statistics and the end ----------------------------------------------------------------

    def totals(self) -> LayerStats:
        total = LayerStats()
        for s in self.stats.values():
            total.add(s)
        return total

    def summary(self) -> str:
        """One line for the end of a run: hit rate, bytes read per token, the miss path's rate
        and how often the prefetch guessed right."""
        t = self.totals()
        tokens = max((s.tokens for s in self.stats.values()), default=0)   # each passes every layer
        looked = t.hits + t.misses
        line = (f"Experts: a {self.nbytes / GB:.3g} GB cache ({sum(p.slots for p in self.pools)} slots), "
                f"{100 * t.hits / max(1, looked):.1f}% hits, "
                f"{t.bytes_read / max(1, tokens) / 1e6:.1f} MB read per token")
        if t.read_seconds > 0:
            line += f", misses read at {t.bytes_read / t.read_seconds / GB:.2f} GB/s"
        if t.guessed:
            line += f"; prefetch guessed {100 * t.guessed_right / t.guessed:.1f}% right"
        return line

    def reset_stats(self) -> None:
        self.stats = {layer: LayerStats() for layer in self.stats}

    def close(self) -> None:
        """Join every read still in flight (prefetches), then close the files."""
        for pool in self.pools:
            self._land_prefetches(pool, wait=True)
        self._files.close()


def _read_piece(file: PartedFile, view: np.ndarray, offset: int, p: _Param, expert: int,
                drop: bool) -> None:
    """Read `view` from `offset`; runs on a pread worker and writes nothing else."""
    try:
        got = file.pread(memoryview(view), offset)
    except OSError as e:
        raise ExpertReadError(e.errno, f"{p.where(expert)}: reading {len(view)} bytes at "
                                       f"{file.where(offset)} failed: {e.strerror or e}") from e
    if got < len(view):
        raise ExpertReadError(f"{p.where(expert)}: short read at {file.where(offset + got)}: got "
                              f"{got} of {len(view)} bytes (file truncated?)")
    if drop:
        file.dont_need(offset, len(view))


def _piece_failure(piece: tuple, error: int) -> Exception:
    """The error of the Python reads for a piece the native reader found bad (errno `error`, or
    0 for a short read): the piece read again here, so that the message names what is wrong."""
    file, view, offset, p, expert = piece
    try:
        _read_piece(file, np.empty_like(view), offset, p, expert, False)
    except ExpertReadError as e:
        return e
    message = f"{p.where(expert)}: reading {len(view)} bytes at {file.where(offset)} failed"
    return ExpertReadError(error, f"{message}: {os.strerror(error)}") if error else ExpertReadError(message)


# --- the loader's side -------------------------------------------------------------------------

class LayerStream:
    """What a streamed MoE layer holds: the store and its own layer id (a plain object, so the
    store's pool is never one of the model's modules: no dense copy, no set_dtype, no save)."""

    def __init__(self, store: ExpertStore, layer: int):
        self.store, self.layer = store, layer


class Streaming:
    """Routed experts streamed instead of loaded: the loader `detach`es them before any weight
    arrives, records each routed tensor it meets (`takes`) instead of loading it, and finally
    `attach`es an ExpertStore to the model.

        stream = Streaming("auto")          # or a size in GB
        stream.detach(model)
        for each tensor: if not stream.takes(StoredTensor.of(info)): load it
        store = stream.attach(model, dtype)
    """

    def __init__(self, budget: str):
        self.budget = parse_budget(budget)
        if self.budget is None:
            raise ExpertStoreError("streaming needs an expert cache size (N GB or auto)")
        self.templates: dict[int, nn.Module] = {}
        self.tensors: list[StoredTensor] = []

    def detach(self, model) -> None:
        """Take each layer's routed experts out of `model` (after their modules got their
        quantized kinds, before weights are loaded): kept as templates, never evaluated."""
        for block in model.layers:
            self.templates[block.layer] = block.ffn.experts
            del block.ffn["experts"]

    def takes(self, *tensors: StoredTensor) -> bool:
        """Whether `tensors` (the sources of one module) are a routed expert's: then they are
        recorded, and not to be loaded."""
        routed = [is_routed(t.name) for t in tensors]
        if not any(routed):
            return False
        if not all(routed):
            raise ExpertStoreError(f"{tensors[routed.index(False)].name} is made together with "
                                   f"the routed expert tensor {tensors[routed.index(True)].name}")
        self.tensors.extend(tensors)
        return True

    def attach(self, model, dtype: Optional[mx.Dtype] = None, progress: bool = True) -> ExpertStore:
        """Build the store over the recorded tensors (floats cast to `dtype` as the loader casts
        the resident weights), wire it on Metal, and point each MoE at it."""
        files = OpenFiles(bool(flags.get("expert_io_hints")), direct=bool(flags.get("expert_io_direct")))
        try:
            layers = {}
            cast = dtype if dtype is not None and mx.issubdtype(dtype, mx.floating) else None
            for layer, template in sorted(self.templates.items()):
                layers[layer] = _LayerExperts(layer, template, cast)
            for tensor in self.tensors:
                layer, expert, w, kind = ROUTED.match(tensor.name).groups()
                placement = layers.get(int(layer))
                if placement is None:
                    raise ExpertStoreError(f"{tensor.name}: the model has no layer {layer}")
                placement.place(tensor, None if expert is None else int(expert),
                                f"{w}.{'scales' if kind == 'scale' else kind}", files)
            for placement in layers.values():
                placement.check_complete()
            everything = sum(l.expert_bytes * l.experts for l in layers.values())
            budget = auto_budget(everything) if self.budget == "auto" else round(float(self.budget) * GB)
            store = ExpertStore(list(layers.values()), min(budget, everything), files,
                                model.args.num_experts_per_tok)
        except BaseException:
            files.close()
            raise
        order = sorted(layers)
        for layer, after in zip(order, order[1:]):
            store.next_layer[layer] = after
            store.next_gate[layer] = model.layers[after].ffn.gate
        for block in model.layers:
            block.ffn.streamed = LayerStream(store, block.layer)
        model.expert_store = store
        wire(store)
        if progress:
            print(f"experts: streamed from disk into a cache of {store.nbytes / GB:.4g} GB "
                  f"({sum(p.slots for p in store.pools)} of {sum(l.experts for l in layers.values())} "
                  f"experts, {flags.get('expert_cache_policy')} eviction)", file=sys.stderr, flush=True)
        return store


def auto_budget(everything: float) -> float:
    """`--expert-cache-gb auto`: the memory left after the resident weights (loaded by now),
    less headroom for the KV cache, activations and the system (a tenth of it, at least 4 GB),
    and no more than all experts. ds4 users found an oversized cache slower (ds4#810: it
    pushes resident weights out), hence the headroom."""
    if mx.metal.is_available():
        limit = float(mx.device_info()["max_recommended_working_set_size"])
        left = limit - mx.get_active_memory()
    else:
        limit, left = _system_memory()
    return max(0.0, min(everything, left - max(4 * GB, 0.1 * limit)))


def _system_memory() -> tuple[float, float]:
    """(total, available) bytes of memory on Linux and macOS."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: float(line.split()[1]) * 1024 for line in f}
        return info["MemTotal"], info["MemAvailable"]
    except OSError:
        total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        return total, total - float(mx.get_active_memory())


def wire(store: ExpertStore) -> None:
    """Metal: keep the pool (and the resident weights) in MLX's residency sets, so the driver
    does not make them resident again at each command buffer (see the module's notes)."""
    if not mx.metal.is_available():
        return
    limit = int(mx.device_info()["max_recommended_working_set_size"])
    mx.set_wired_limit(limit)
    if mx.get_active_memory() > limit:
        print(f"warning: the resident weights and the expert cache take "
              f"{mx.get_active_memory() / GB:.1f} GB, more than the {limit / GB:.1f} GB Metal "
              f"keeps wired; a smaller --expert-cache-gb avoids stalls", file=sys.stderr, flush=True)
