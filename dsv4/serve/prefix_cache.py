"""Caches of earlier requests, found by the longest prefix they share with a new prompt.

An entry is a snapshot of a model cache (`engine.snapshot`, a copy: MLX arrays are immutable,
so the snapshot shares them with the session that made it, which goes on) and the token ids it holds. A prompt
continues from the entry that keeps the most of it: the common prefix of the two, if the entry
can be trimmed back to it exactly (`max_trim()`: a cache keeps the state of only its last
`reserve` positions). Entries live in an LRU bounded in bytes, so sessions that take turns
(agents, several users) each find theirs; the disk tier (disk_cache.py), if configured, keeps
every entry written to it across restarts and is searched the same way.

An entry that another one covers (a prefix of it, within the other's trim reach) is dropped:
an agent's turn k+1 prompt covers turn k's answer, so a session holds about one entry per turn
boundary, not one per turn.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .replay import Record


def as_ids(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, np.int64).reshape(-1)


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids a and b share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def reusable(tokens: np.ndarray, max_trim: int, prompt: np.ndarray) -> int:
    """Prompt tokens an entry holding `tokens` can give (0 if it cannot be trimmed back to them)."""
    keep = shared_prefix(tokens, prompt)
    return keep if len(tokens) - keep <= max_trim else 0


def covers(longer: np.ndarray, longer_max_trim: int, shorter: np.ndarray) -> bool:
    """Whether an entry holding `longer` can stand for one holding `shorter`."""
    return (len(shorter) <= len(longer) and len(longer) - len(shorter) <= longer_max_trim
            and np.array_equal(longer[:len(shorter)], shorter))


@dataclass
class Entry:
    tokens: np.ndarray   # int64 ids the cache holds
    cache: Any
    nbytes: int
    max_trim: int


class PrefixCache:
    def __init__(self, engine, memory_bytes: int, disk=None):
        """engine: makes empty caches and snapshots (engine.py); memory_bytes bounds the entries
        in memory (0: none are kept); disk: a DiskTier or None."""
        self.engine, self.memory_bytes, self.disk = engine, memory_bytes, disk
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()   # least recently used first
        self.nbytes = self.tokens = 0
        self.counts = {"lookups": 0, "memory_hits": 0, "disk_hits": 0, "reused_tokens": 0}

    def lookup(self, prompt: Sequence[int]) -> tuple[Any, int]:
        """A cache of this caller's own holding prompt[:cached], and cached. At least the last
        prompt token is left out: generation needs its logits."""
        self.counts["lookups"] += 1
        want = as_ids(prompt)[:-1]
        best, keep = None, 0
        for key, entry in self.entries.items():
            n = reusable(entry.tokens, entry.max_trim, want)
            if n > keep:
                best, keep = key, n
        on_disk = self.disk.best(want) if self.disk is not None else None
        cache = None
        if on_disk is not None and on_disk[1] > keep:
            cache = self._from_disk(on_disk[0])
            if cache is not None:
                keep = on_disk[1]
                self.counts["disk_hits"] += 1
        if cache is None and best is not None:
            self.entries.move_to_end(best)
            cache = self.entries[best].cache.copy()
            self.counts["memory_hits"] += 1
        if cache is None:
            return self.engine.new_cache(), 0
        cache.trim(cache.offset - keep)
        self.counts["reused_tokens"] += keep
        return cache, keep

    def _from_disk(self, key: str):
        loaded = self.disk.load(key)
        if loaded is None:
            return None
        tokens, cache = loaded
        self._remember(tokens, self.engine.snapshot(cache))   # the next turn finds it in memory
        return cache

    def insert(self, tokens: Sequence[int], cache, replay: Sequence[Record] = (), persist: bool = True) -> None:
        """Keep a snapshot of `cache`, which holds exactly `tokens`, and with `persist` write it
        to disk too, with the replay records of the model outputs among those tokens."""
        ids = as_ids(tokens)
        if len(ids) == 0:
            return
        if cache.offset != len(ids):
            raise ValueError(f"the cache holds {cache.offset} tokens, {len(ids)} token ids were given")
        snapshot = self.engine.snapshot(cache)
        self._remember(ids, snapshot)
        if persist and self.disk is not None:
            self.disk.put(ids, snapshot, replay)

    def persist(self, tokens: Sequence[int], replay: Sequence[Record] = ()) -> None:
        """Write the memory entry holding exactly `tokens` to disk (if it is still kept): a prompt
        snapshot is worth a file only when the answer's entry cannot be trimmed back to it."""
        entry = self.entries.get(as_ids(tokens).tobytes())
        if entry is not None and self.disk is not None:
            self.disk.put(entry.tokens, entry.cache, replay)

    def _remember(self, ids: np.ndarray, cache) -> None:
        key = ids.tobytes()
        for other, entry in self.entries.items():
            if other == key or covers(entry.tokens, entry.max_trim, ids):   # it stands for this one
                self.entries.move_to_end(other)
                return
        entry = Entry(ids, cache, cache.nbytes(), cache.max_trim())
        for other in [k for k, e in self.entries.items() if covers(ids, entry.max_trim, e.tokens)]:
            self._drop(other)
        self.entries[key] = entry
        self.nbytes += entry.nbytes
        self.tokens += len(ids)
        while self.nbytes > self.memory_bytes and self.entries:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: bytes) -> None:
        entry = self.entries.pop(key)
        self.nbytes -= entry.nbytes
        self.tokens -= len(entry.tokens)

    def stats(self) -> dict:
        """Counters only (another thread asks while the scheduler changes the entries)."""
        out = {"entries": len(self.entries), "bytes": self.nbytes, "limit_bytes": self.memory_bytes,
               "tokens": self.tokens, **self.counts}
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out
