"""The decode cache: per layer window rows, compressed rows, index keys, compressor inputs.

Positions are absolute, so prefill may come in any number of chunks of any length.
Window rows and compressor inputs are kept for `window + reserve` positions (not only
the 128 the model attends to) so that `trim(n)` for n <= reserve restores exactly the
state before the last n tokens: the rows of a trimmed-away position are dropped and
the pending partial compression group is rebuilt from the kept inputs. Compressed
rows and index keys are kept for the whole context (they are what long context is).

`save(path)` / `load_cache(path, model)` store everything in one safetensors file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO, Optional

import mlx.core as mx
import numpy as np


def _append(old: Optional[mx.array], new: mx.array) -> mx.array:
    return new if old is None else mx.concatenate([old, new], axis=1)


class LayerCache:
    """One layer's state. Arrays are [B, rows, width]; `*_start` is the absolute
    position of row 0 of the windowed buffers."""

    FIELDS = ("window", "compressed", "index_keys", "comp_kv", "comp_gate")

    def __init__(self):
        self.window: Optional[mx.array] = None      # window KV rows (post RoPE and QDQ)
        self.window_start = 0
        self.compressed: Optional[mx.array] = None  # compressed KV rows, one per group
        self.index_keys: Optional[mx.array] = None  # indexer keys, one per group
        self.comp_kv: Optional[mx.array] = None     # compressor inputs (fp32) per token
        self.comp_gate: Optional[mx.array] = None
        self.comp_start = 0


class Cache:
    """All layers' state plus the token ids seen so far (for Engram and prefix reuse)."""

    def __init__(self, ratios: list[int], window: int, reserve: int = 256):
        self.ratios = [int(r) for r in ratios]
        self.layers = [LayerCache() for _ in self.ratios]
        self.window = window
        self.reserve = reserve
        self.tokens = np.zeros((1, 0), np.int64)
        # The layer whose index keys the reference's shared slot holds (model-spec 3.9).
        self.key_publisher: Optional[int] = None
        # Set while a fixed-shape decoder (dsv4.step) holds the state in its own buffers.
        self.checked_out = False

    def require_state(self) -> None:
        if self.checked_out:
            raise RuntimeError("this cache's state is out with a fixed-shape decoder (a generation "
                               "in progress): finish or close that generation first")

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def offset(self) -> int:
        return self.tokens.shape[1]

    def keep_limit(self) -> int:
        return self.window + self.reserve

    def append_window(self, layer: LayerCache, rows: mx.array) -> mx.array:
        """Add this chunk's window rows; return all rows held (older first)."""
        held = _append(layer.window, rows)
        start = layer.window_start
        # Drop in batches so decode does not slice every step.
        if held.shape[1] > self.keep_limit() + self.reserve:
            cut = held.shape[1] - self.keep_limit()
            layer.window, layer.window_start = held[:, cut:], start + cut
        else:
            layer.window = held
        return held

    def append_compressor_inputs(self, layer: LayerCache, kv: mx.array, gate: mx.array) -> None:
        layer.comp_kv = _append(layer.comp_kv, kv)
        layer.comp_gate = _append(layer.comp_gate, gate)

    def evict_compressor_inputs(self, layer: LayerCache) -> None:
        """Drop inputs older than `window + reserve` positions (call after pooling)."""
        if layer.comp_kv.shape[1] > self.keep_limit() + self.reserve:
            cut = layer.comp_kv.shape[1] - self.keep_limit()
            layer.comp_kv, layer.comp_gate = layer.comp_kv[:, cut:], layer.comp_gate[:, cut:]
            layer.comp_start += cut

    def max_trim(self) -> int:
        """The largest n for which trim(n) is exact."""
        limit = self.offset
        for layer in self.layers:
            # After trimming to `end`, the window rows of [end - window, end) must be held,
            # and the compressor inputs of the open group (at most one token before end).
            if layer.window_start > 0:
                limit = min(limit, self.offset - layer.window_start - self.window)
            if layer.comp_start > 0:
                limit = min(limit, self.offset - layer.comp_start - 1)
        return max(limit, 0)

    def trim(self, n: int) -> int:
        """Remove the last n tokens exactly; returns n. Raises if n > max_trim()."""
        self.require_state()
        if n <= 0:
            return 0
        if n > self.offset:
            raise ValueError(f"cannot trim {n} tokens from a cache of {self.offset}")
        if n > self.max_trim():
            raise ValueError(f"cannot trim {n} tokens exactly: only the last {self.max_trim()} "
                             f"positions keep their evicted state (reserve={self.reserve})")
        end = self.offset - n
        for i, layer in enumerate(self.layers):
            if layer.window is not None:
                layer.window = layer.window[:, : max(end - layer.window_start, 0)]
            r = self.ratios[i]
            if r and layer.compressed is not None:
                layer.compressed = layer.compressed[:, : end // r]
                if layer.index_keys is not None:
                    layer.index_keys = layer.index_keys[:, : end // r]
            if layer.comp_kv is not None:
                keep = max(end - layer.comp_start, 0)
                layer.comp_kv, layer.comp_gate = layer.comp_kv[:, :keep], layer.comp_gate[:, :keep]
        self.tokens = self.tokens[:, :end]
        return n

    def copy(self) -> "Cache":
        """A snapshot: later updates of either cache leave the other as it was (MLX arrays
        are immutable, so this copies references only)."""
        self.require_state()
        new = Cache(self.ratios, self.window, self.reserve)
        new.tokens, new.key_publisher = self.tokens.copy(), self.key_publisher
        for mine, theirs in zip(self.layers, new.layers):
            theirs.__dict__.update(mine.__dict__)
        return new

    # --- persistence -----------------------------------------------------------------

    def state(self) -> dict[str, mx.array]:
        out = {"tokens": mx.array(self.tokens)}
        for i, layer in enumerate(self.layers):
            for name in LayerCache.FIELDS:
                a = getattr(layer, name)
                if a is not None:
                    out[f"layers.{i}.{name}"] = a
        return out

    def meta(self) -> dict:
        return {"ratios": self.ratios, "window": self.window, "reserve": self.reserve,
                "key_publisher": self.key_publisher,
                "window_start": [l.window_start for l in self.layers],
                "comp_start": [l.comp_start for l in self.layers]}

    def nbytes(self) -> int:
        """Bytes of the arrays the cache holds (what keeping it in memory costs)."""
        self.require_state()
        return sum(a.nbytes for a in self.state().values())

    def save(self, path: Path | str | BinaryIO, metadata: Optional[dict] = None) -> None:
        """Write the cache to a safetensors file (bit-exact round trip); `path` may also be
        a file open for binary writing (an atomic_file)."""
        self.require_state()
        meta = {"dsv4_cache": json.dumps(self.meta())}
        if metadata:
            meta.update({k: str(v) for k, v in metadata.items()})
        mx.save_safetensors(path if hasattr(path, "write") else str(path), self.state(), metadata=meta)


def load_cache(path: Path | str, model=None):
    """Read a cache written by `Cache.save`; returns (cache, metadata)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    if "dsv4_cache" not in meta:
        raise ValueError(f"{path}: not a dsv4 cache file (no dsv4_cache metadata)")
    info = json.loads(meta["dsv4_cache"])
    ratios = info["ratios"]
    if model is not None and ratios != list(model.args.compress_ratios[:model.args.num_hidden_layers]):
        raise ValueError(f"{path}: the cache's layers (compress ratios {ratios}) are not this model's")
    cache = Cache(info["ratios"], info["window"], info["reserve"])
    cache.key_publisher = info["key_publisher"]
    cache.tokens = np.array(arrays["tokens"]).astype(np.int64)
    for i, layer in enumerate(cache.layers):
        layer.window_start = info["window_start"][i]
        layer.comp_start = info["comp_start"][i]
        for name in LayerCache.FIELDS:
            key = f"layers.{i}.{name}"
            if key in arrays:
                setattr(layer, name, arrays[key])
    extra = {k: v for k, v in meta.items() if k != "dsv4_cache"}
    return cache, extra
