"""The server under --parallel: rank 0's scheduler drives a `LeadingEngine`, which tells every
other rank each engine call (a new cache, a prefill chunk's tokens, a decode step's sessions and
tokens, a settle, a forget) before making it; the other ranks (`follow`) make the same calls on
their own ModelEngine, so every rank runs the same forwards and the exchanges inside them line
up. Sampling, grammars and HTTP stay on rank 0, which needs the whole logits: expert and tensor
modes give them to every rank, a pipeline's last rank sends them to rank 0 (ModelEngine asks
`first_rank_logits` after every call). The
prefix cache and drafting copy, trim and step caches outside these calls, so they are off.
Each call costs two small all_sums (dsv4/distributed/follow.py)."""

from __future__ import annotations

import json

import mlx.core as mx

from .. import flags
from ..distributed import link
from .engine import ModelEngine


class LeadingEngine:
    """Rank 0's engine: a ModelEngine whose calls the other ranks repeat."""

    runs_ahead = False   # the followers are told each token, so it must be on the host first

    def __init__(self, engine: ModelEngine, channel):
        self.engine, self.channel = engine, channel
        self._numbers: dict[int, int] = {}   # id(cache) -> the number the followers know it by
        self._held: dict[int, object] = {}   # those caches, alive while numbered (ids stay unique)
        self._next = 0

    def __getattr__(self, name):   # tokenizer, context, draft_window (None: drafting off), ...
        return getattr(self.engine, name)

    # A peer lost in any call surfaces in the scheduler's thread as link.LinkLost (which stops
    # the server): the forwards are evaluated here, inside the watch, for their exchanges.

    def _tell(self, *call) -> None:
        with link.watched(self.channel.group), link.answered(self.channel.group, flags.get("answer_timeout")):
            self.channel.share(json.dumps(call))

    def _run(self, forward):
        with link.watched(self.channel.group):
            logits = forward()
            mx.eval(logits)
        return logits

    def new_cache(self):
        cache = self.engine.new_cache()
        self._numbers[id(cache)], self._held[id(cache)] = self._next, cache
        self._tell("new", self._next)
        self._next += 1
        return cache

    def prefill(self, cache, tokens, window=None):
        self._tell("prefill", self._numbers[id(cache)], [int(t) for t in tokens])
        return self._run(lambda: self.engine.prefill(cache, tokens, window))

    def decode(self, caches, tokens):
        self._tell("decode", [self._numbers[id(c)] for c in caches], [int(t) for t in tokens])
        return self._run(lambda: self.engine.decode(caches, tokens))

    def settle(self, cache=None) -> None:
        number = None if cache is None else self._numbers.pop(id(cache), None)
        self._held.pop(id(cache), None)
        self._tell("settle", number)
        self.engine.settle(cache)

    def forget(self) -> None:
        self._tell("forget")
        self.engine.forget()

    def stop(self) -> None:
        """The followers return from `follow` (the server is shutting down)."""
        self._tell("stop")


def follow(engine: ModelEngine, channel) -> None:
    """A follower rank: repeat rank 0's engine calls until it stops."""
    caches = {}
    while True:
        op, *args = json.loads(channel.share())
        if op == "stop":
            return
        if op == "new":
            caches[args[0]] = engine.new_cache()
        elif op == "prefill":
            mx.eval(engine.prefill(caches[args[0]], args[1]))
        elif op == "decode":
            mx.eval(engine.decode([caches[n] for n in args[0]], args[1]))
        elif op == "settle":
            engine.settle(None if args[0] is None else caches.pop(args[0]))
        elif op == "forget":
            engine.forget()
