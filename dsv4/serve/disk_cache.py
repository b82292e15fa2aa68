"""The prefix cache's tier on disk: entries that survive a restart, restored without prefill.

Each entry is one safetensors file named by the SHA-256 of the token ids it holds, written by
the cache's own `save` (window rows, compressed rows, index keys, compressor inputs, token ids)
into an atomic file: it appears whole under its name or not at all, so a server killed while
writing leaves only a `.partial` file, removed at the next start. Its metadata records the
model fingerprint (weights and numerics switches: another model's cache would load fine and
answer wrong), how far it can be trimmed, and the replay records of the generation that made
it (replay.py), so a restarted server also puts back the ids the model produced.

Files live in a directory per model fingerprint under the one given, written by a thread of
their own; the tier is bounded in bytes and drops its least recently used entries first (a
file's mtime is its last use, so the order survives restarts). At start every file's header and token ids are read (no arrays);
a file that does not read back as what its name says is removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from .. import flags
from ..atomic_file import atomic_file
from ..safetensors_file import read_header, view
from .prefix_cache import as_ids, covers, reusable
from .replay import Record, Replay

FORMAT = 1
METADATA_KEY = "dsv4_prefix"
SUFFIX = ".safetensors"


def model_fingerprint(model_dir: Path) -> str:
    """What a cache depends on: the model's config, its tensor index and weight files (name,
    size, mtime: a re-converted model is another model), and every runtime switch (the KV and
    activation roundings change what a prefill writes)."""
    digest = hashlib.sha256(f"dsv4 prefix cache {FORMAT}".encode())
    for name in ("config.json", "model.safetensors.index.json"):
        path = model_dir / name
        if path.is_file():
            digest.update(name.encode() + path.read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    digest.update(repr(flags.snapshot()).encode())
    return digest.hexdigest()


def key_of(ids: np.ndarray) -> str:
    return hashlib.sha256(ids.astype(np.int64).tobytes()).hexdigest()


@dataclass
class DiskEntry:
    tokens: np.ndarray
    max_trim: int
    nbytes: int
    used: float   # last use (the file's mtime)


class DiskTier:
    def __init__(self, directory: Path | str, max_bytes: int, fingerprint: str,
                 load: Callable[[Path], tuple], replay: Optional[Replay] = None):
        """load(path) -> (cache, metadata) reads a file a cache's save() wrote (the engine's
        load_cache); replay gets the records found in the files."""
        self.directory = Path(directory) / fingerprint[:16]
        self.max_bytes, self.fingerprint, self._load, self.replay = max_bytes, fingerprint, load, replay
        self.directory.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, DiskEntry] = {}
        self.nbytes = 0
        self.counts = {"written": 0, "loaded": 0, "dropped_unreadable": 0, "write_errors": 0}
        self._scan()
        # Files are written by a thread of their own, so a session's end does not stall the
        # sessions decoded with it while hundreds of MB go to disk; entries appear once whole.
        self._lock = threading.Lock()
        self._writes: queue.Queue = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        threading.Thread(target=self._writer, name="dsv4-prefix-cache-writer", daemon=True).start()

    def path(self, key: str) -> Path:
        return self.directory / (key + SUFFIX)

    def _scan(self) -> None:
        for leftover in self.directory.glob("*.partial"):   # a write that never finished
            leftover.unlink(missing_ok=True)
        # Oldest first, so the replay records of the most recent entries are remembered last.
        for path in sorted(self.directory.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime):
            key = path.name[:-len(SUFFIX)]
            try:
                tensors, metadata = read_header(path)
                info = json.loads(metadata[METADATA_KEY])
                tokens = np.array(view(tensors["tokens"]), np.int64).reshape(-1)
                if info["fingerprint"] != self.fingerprint or key_of(tokens) != key:
                    raise ValueError("not what its name says")
                records = [(text, list(ids)) for text, ids in info.get("replay", [])]
            except Exception:   # any damage: the file cannot be trusted
                path.unlink(missing_ok=True)
                self.counts["dropped_unreadable"] += 1
                continue
            stat = path.stat()
            self.entries[key] = DiskEntry(tokens, int(info["max_trim"]), stat.st_size, stat.st_mtime)
            self.nbytes += stat.st_size
            if self.replay is not None:
                self.replay.remember(records)

    def best(self, prompt: np.ndarray) -> Optional[tuple[str, int]]:
        """(key, tokens it gives) of the entry that gives the most of `prompt`, or None."""
        best, keep = None, 0
        with self._lock:
            for key, entry in self.entries.items():
                n = reusable(entry.tokens, entry.max_trim, prompt)
                if n > keep:
                    best, keep = key, n
        return None if best is None else (best, keep)

    def load(self, key: str) -> Optional[tuple[np.ndarray, object]]:
        """(token ids, cache) of an entry, or None (and the file removed) if it does not read back."""
        with self._lock:
            entry = self.entries.get(key)
        if entry is None:   # replaced meanwhile by an entry that covers it
            return None
        path = self.path(key)
        try:
            cache, _ = self._load(path)
            if cache.offset != len(entry.tokens):
                raise ValueError(f"holds {cache.offset} tokens, its header {len(entry.tokens)}")
        except Exception as error:
            print(f"prefix cache: dropping {path.name}: {error}", file=sys.stderr, flush=True)
            with self._lock:
                self._remove(key)
                self.counts["dropped_unreadable"] += 1
            return None
        with self._lock:
            self._touch(key)
            self.counts["loaded"] += 1
        return entry.tokens, cache

    def put(self, tokens: Sequence[int], cache, replay: Sequence[Record] = ()) -> None:
        """Write an entry for `cache` (holding `tokens`; its arrays evaluated, as the prefix
        cache's snapshots are) unless one holds or covers it; in the background."""
        ids = as_ids(tokens)
        with self._lock:
            self._pending += 1
        self._writes.put((ids, cache, [[text, list(map(int, produced))] for text, produced in replay]))

    def flush(self) -> None:
        """Wait until every put() is on disk (or failed)."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def _writer(self) -> None:
        while True:   # never ends: a thread that ends runs MLX's thread-local destructors (see dsv4/server.py)
            ids, cache, replay = self._writes.get()
            try:
                self._write(ids, cache, replay)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _write(self, ids: np.ndarray, cache, replay: list) -> None:
        key = key_of(ids)
        with self._lock:
            for other, entry in self.entries.items():
                if other == key or covers(entry.tokens, entry.max_trim, ids):   # its records cover these ids too
                    self._touch(other)
                    return
        info = {"fingerprint": self.fingerprint, "format": FORMAT, "max_trim": cache.max_trim(), "replay": replay}
        try:
            with atomic_file(self.path(key)) as f:
                cache.save(f, {METADATA_KEY: json.dumps(info, ensure_ascii=False)})
        except OSError as error:
            with self._lock:
                self.counts["write_errors"] += 1
            print(f"prefix cache: cannot write {self.path(key)}: {error}", file=sys.stderr, flush=True)
            return
        entry = DiskEntry(ids, info["max_trim"], self.path(key).stat().st_size, time.time())
        with self._lock:
            self.counts["written"] += 1
            for other in [k for k, e in self.entries.items() if covers(ids, entry.max_trim, e.tokens)]:
                self._remove(other)
            self.entries[key] = entry
            self.nbytes += entry.nbytes
            for oldest in sorted(self.entries, key=lambda k: self.entries[k].used):
                if self.nbytes <= self.max_bytes:
                    break
                self._remove(oldest)

    # The helpers below run under the lock.

    def _touch(self, key: str) -> None:
        now = time.time()
        self.entries[key].used = now
        try:
            os.utime(self.path(key), (now, now))
        except OSError:
            pass

    def _remove(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        self.path(key).unlink(missing_ok=True)

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self.entries), "bytes": self.nbytes, "limit_bytes": self.max_bytes,
                    "pending_writes": self._pending, "directory": str(self.directory), **self.counts}
