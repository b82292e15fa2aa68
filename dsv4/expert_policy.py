"""Which cached expert to evict: the expert cache's replacement policies.

The expert cache (dsv4/expert_store.py) keeps routed experts in a fixed number of slots. When a
layer needs experts that are not there, `Policy.victims` picks the slots to overwrite among
those the caller may evict. Empty slots always go first. The policies differ in what they keep:

- `lru`: the most recently used experts (a clock tick per lookup).
- `frequency`: the most used experts, each use counted with a weight that halves every
  `half_life` tokens (an LFU that forgets), ties to the least recently used. Popular experts
  stay through a burst of rare ones.
- `layer`: the experts whose layer comes soonest. Decode visits the layers in a cycle; at
  layer i an expert of layer i + 1 may be needed at the very next lookup, one of layer i only a
  whole token later, so the slots of the layers just passed go first (ties to the least
  recently used). Plain LRU does the opposite on a cycle: its oldest entries belong to the next
  layer.

Which one is the default is decided by benchmarks/expert_stream.py (see flags.py).
"""

from __future__ import annotations

import numpy as np

POLICIES = ("lru", "frequency", "layer")


class Policy:
    """Use times, decayed use counts and owning layers of `slots` slots; one tick per lookup."""

    def __init__(self, kind: str, slots: int, layers: int, half_life_tokens: float = 64.0):
        if kind not in POLICIES:
            raise ValueError(f"expert cache policy {kind!r}: expected one of {', '.join(POLICIES)}")
        self.kind = kind
        self.layers = max(1, layers)
        self.now = 0
        self.last = np.zeros(slots, np.int64)
        self.count = np.zeros(slots, np.float64)
        self.layer = np.full(slots, -1, np.int64)       # -1: empty
        self._decay = np.log(2.0) / (half_life_tokens * self.layers)  # per tick

    def tick(self) -> None:
        self.now += 1

    def _counts_now(self, slots: np.ndarray) -> np.ndarray:
        return self.count[slots] * np.exp(-self._decay * (self.now - self.last[slots]))

    def use(self, slots: np.ndarray, layer: int) -> None:
        """`slots` (now holding experts of `layer`) were used or filled at this tick."""
        slots = np.asarray(slots, np.int64)
        if self.kind == "frequency":
            self.count[slots] = self._counts_now(slots) + 1.0
        self.last[slots] = self.now
        self.layer[slots] = layer

    def forget(self, slots: np.ndarray) -> None:
        """`slots` are empty again (evicted, or their read failed)."""
        slots = np.asarray(slots, np.int64)
        self.layer[slots] = -1
        self.count[slots] = 0.0

    def victims(self, candidates: np.ndarray, n: int, layer: int) -> np.ndarray:
        """The `n` candidates to evict first, for a lookup of `layer`, best victim first. One
        key per candidate and a partial sort: a lookup runs per layer and token over pools of
        ~10^4 slots, where a full sort would cost a millisecond."""
        candidates = np.asarray(candidates, np.int64)
        n = min(n, len(candidates))
        if n <= 0:
            return candidates[:0]
        last = self.last[candidates].astype(np.float64)
        if self.kind == "lru":
            key = last
        elif self.kind == "frequency":
            key = self._counts_now(candidates) + last * TIE   # equal counts: the older goes
        else:
            # Lookups until the slot's layer comes again: 1 for the next layer, `layers` for this
            # one; the largest goes first, then the least recently used.
            until = ((self.layer[candidates] - layer - 1) % self.layers) + 1
            key = -until * LAYER_STEP + last
        key[self.layer[candidates] < 0] = -np.inf                # empty slots first
        first = np.argpartition(key, n - 1)[:n] if n < len(key) else np.arange(len(key))
        return candidates[first[np.argsort(key[first], kind="stable")]]


# Tie-breaks folded into one key: a tick is < 2**40 (a year of lookups at 10^4/s), so
# LAYER_STEP keeps the layer order above recency, and TIE keeps recency (< 2**-20) below a
# count's change.
LAYER_STEP = float(2 ** 40)
TIE = 2.0 ** -60
