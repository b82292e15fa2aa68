"""Pipeline parallel: each rank runs one contiguous range of layers (a stage), in rank order.

The ranges are chosen by memory (`split_layers`): each rank's share of the weight bytes, the
embedding with the first stage and the norm and head with the last, weighted by a per-rank
memory size where the ranks differ (DSV4_PIPELINE_MEMORY). A rank loads only its stage's
tensors (the plan answers None for the others, and `prepare` drops their modules from the
skeleton before anything is loaded), so no rank holds the whole model, even while loading.

What crosses from stage k to stage k+1, in one send per forward (`Wire`):
  * the streams [B*S, hc, D] and the last site's pre [B*S, hc] fp32: all a block reads of
    the layers before it, except what follows;
  * for each layer of an earlier stage that a later stage *replays*, its attention input
    x [B, S, D], and the q-LoRA latent qr [B, S, q_lora_rank] when its selection is replayed.
Why replay rather than send the layers' shared state (model-spec 1.2): a layer with a compress
ratio reads, besides the streams,
  * the compressed KV rows and index keys of its kv source, for the whole context, held in
    that layer's cache. A stage after the source keeps its own copy of those cache rows by
    running the source's compressor (and its indexer's key projection) on x: the same ops on
    the same input give the same bits, and the copy is trimmed and saved as the owner's is.
    Per forward only x crosses (one row at decode), never the context;
  * the top-k of the latest index source and the candidate mask of the candidate source,
    [B, S, k] and [B, S, N] (N: the whole context at decode), whose presence and shape follow
    from the position and the switches. Replaying the source's selection from its x and qr
    gives them with traffic of a fixed shape: no header exchange, no second send.
A replayed layer's weights (its compressor, its indexer) are loaded by both stages: a few
MB at V4.1's widths. Engram rows are read on the host of the rank that holds the Engram layer,
from the token ids every rank has (the prompt; each sampled token is shared), so none cross.

Decode: the last stage samples and passes the token round the ring to every rank
(`Pipelined.shared_sampler`). Per token: N - 1 sends of the streams, N - 1 of the token.
Caches stay with their layers: each rank's Cache holds its own layers and its replayed
layers' rows (the others stay empty), and trims and saves as one process's does.
The reference's shared-key quirk (DSV4_INDEX_KEY_QUIRK) reads whichever kv source published
last, possibly a later stage's: refused under a pipeline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import ParallelError, Plan, stats
from .. import flags
from ..attention import ForwardState

_LAYER = re.compile(r"^layers\.(\d+)\.")

# --- which layers where ---------------------------------------------------------------------

def layer_of(name: str) -> Optional[int]:
    """The layer a tensor name belongs to (layers.<i>.*), or None (embed, norm, head, mtp)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def split_layers(layer_bytes: Sequence[int], first_bytes: int, last_bytes: int,
                 capacity: Sequence[float]) -> list[range]:
    """Contiguous layer ranges, one per rank and none empty, that make the largest of each
    rank's bytes / capacity least; `first_bytes` go with the first range, `last_bytes` with
    the last. Exact (dynamic programming over the cut points)."""
    n, ranks = len(layer_bytes), len(capacity)
    if ranks > n:
        raise ParallelError(f"--parallel pipeline: {ranks} ranks for {n} layers (at most one rank per layer)")
    prefix = np.concatenate([[0], np.cumsum(layer_bytes, dtype=np.float64)])

    def load(r: int, lo: int, hi: int) -> float:
        extra = (first_bytes if r == 0 else 0) + (last_bytes if r == ranks - 1 else 0)
        return (prefix[hi] - prefix[lo] + extra) / capacity[r]

    # best[r][i]: the least largest load of ranks 0..r holding layers 0..i-1; cut[r][i] its last cut
    best = np.full((ranks, n + 1), np.inf)
    cut = np.zeros((ranks, n + 1), np.int64)
    for i in range(1, n + 1):
        best[0][i] = load(0, 0, i)
    for r in range(1, ranks):
        for i in range(r + 1, n + 1):
            for j in range(r, i):
                worst = max(best[r - 1][j], load(r, j, i))
                if worst < best[r][i]:
                    best[r][i], cut[r][i] = worst, j
    edges, i = [n], n
    for r in range(ranks - 1, 0, -1):
        i = int(cut[r][i])
        edges.append(i)
    edges.append(0)
    edges.reverse()
    return [range(edges[r], edges[r + 1]) for r in range(ranks)]


@dataclass(frozen=True)
class Stage:
    """One rank's part: its layers, and the earlier layers it replays — `compress`: their
    compressor (the rows of its kv source), `select`: their indexer's selection (top-k,
    candidate mask)."""
    rank: int
    layers: range
    compress: frozenset = frozenset()
    select: frozenset = frozenset()

    @property
    def replayed(self) -> tuple[int, ...]:
        return tuple(sorted(self.compress | self.select))


def replays(args, layers: range) -> tuple[frozenset, frozenset]:
    """What a stage of `layers` needs of the layers before them (see the module's notes):
    (kv sources whose compressor it replays, index sources whose selection it replays)."""
    first = layers.start
    compress, select = set(), set()
    for layer in layers:
        if not args.ratio(layer):
            continue
        compress.add(args.kv_source(layer))
        if layer not in args.index_source_layer_ids:
            select.add(args.index_source(layer))       # reuses the latest index source's top-k
        elif args.uses_candidates(layer) and not args.is_candidate_source(layer):
            select.add(args.candidate_source_layer_id)
    # A replayed selection reads its kv source's keys, and a re-index layer the candidate mask.
    todo = [s for s in select if s < first]
    while todo:
        s = todo.pop()
        compress.add(args.kv_source(s))
        if args.uses_candidates(s) and not args.is_candidate_source(s):
            c = args.candidate_source_layer_id
            if c < first and c not in select:
                select.add(c)
                todo.append(c)
    return (frozenset(l for l in compress if l is not None and l < first),
            frozenset(l for l in select if l is not None and l < first))


def stages(args, ranges: Sequence[range]) -> list[Stage]:
    return [Stage(r, layers, *replays(args, layers)) for r, layers in enumerate(ranges)]


def forwarded(stages_: Sequence[Stage], k: int) -> tuple[tuple[int, bool], ...]:
    """What the send from stage k to k+1 carries besides streams and pre: (layer, with qr)
    for every layer before stage k+1 that stage k+1 or a later one replays, in layer order."""
    end = stages_[k + 1].layers.start
    out = {}
    for s in stages_[k + 1:]:
        for layer in s.replayed:
            if layer < end:
                out[layer] = out.get(layer, False) or layer in s.select
    return tuple(sorted(out.items()))


# --- the plan the loader asks ---------------------------------------------------------------

_COMPRESS_PARTS = ("attn.compressor.", "attn.indexer.wk.", "attn.indexer.k_norm.")


class PipelinePlan(Plan):
    """This rank's stage: tensors of its layers (and of the layers it replays) as `inner`
    splits them, the embedding on the first stage, norm and head on the last, None else.
    The stages are chosen in `prepare`, from the sizes of the skeleton as it will be loaded."""
    modes = ("pipeline",)

    def __init__(self, args, group, inner: Plan):
        self.args, self.group, self.inner = args, group, inner
        self.stages: list[Stage] = []

    def tensor(self, name, shape):
        if not self.stages:   # asked before the stages are chosen: the share in whichever holds it
            return self.inner.tensor(name, shape)
        layer = layer_of(name)
        if layer is None:
            if name.startswith("mtp."):
                return None      # draft stages do not run under a pipeline
            keep = self.first if name.startswith("embed.") else self.last
            return self.inner.tensor(name, shape) if keep else None
        if layer in self.stage.layers:
            return self.inner.tensor(name, shape)
        part = name[len(f"layers.{layer}."):]
        if (layer in self.stage.select and part.startswith(("attn.indexer.", *_COMPRESS_PARTS))) or \
                (layer in self.stage.compress and part.startswith(_COMPRESS_PARTS)):
            return self.inner.tensor(name, shape)
        return None

    def prepare(self, model) -> None:
        """Choose the stages by the skeleton's bytes, then drop from it every
        module this rank does not load: other stages' blocks become empty modules, a replayed
        layer keeps the parts of its attention that replay it; embed, norm and head stay
        where their stage is. Nothing of the skeleton is allocated (lazy arrays)."""
        from mlx.utils import tree_flatten

        sizes = {n: a.nbytes for n, a in tree_flatten(model.parameters())}
        capacity = capacities(self.group, flags.get("pipeline_memory"))
        self.stages = stages(self.args, split_by_bytes(self.args, sizes, capacity))
        self.stage = stage = self.stages[self.group.rank()]
        self.first = stage.rank == 0
        self.last = stage.rank == len(self.stages) - 1
        for i, block in enumerate(model.layers):
            if i in stage.layers:
                continue
            if i not in stage.replayed:
                model.layers[i] = nn.Module()
                continue
            attn = block.attn
            for key in list(attn.keys()):
                if key not in ("compressor", "indexer") and not key.startswith("_"):
                    del attn[key]
            if "indexer" in attn and i not in stage.select:
                for key in list(attn.indexer.keys()):
                    if key not in ("wk", "k_norm") and not key.startswith("_"):
                        del attn.indexer[key]
            model.layers[i] = _Replayed(attn)
        if not self.first:
            del model["embed"]
        if not self.last:
            del model["norm"], model["head"]

    # a stage splits nothing further: every rank of it computes its layers whole
    def attention_groups(self, args):
        return self.inner.attention_groups(args)

    def experts(self, args):
        return self.inner.experts(args)

    def expert_columns(self, args):
        return self.inner.expert_columns(args)

    def combine(self, x):
        return self.inner.combine(x)


class _Replayed(nn.Module):
    """A layer of an earlier stage as a later stage holds it: the parts of its attention that
    rebuild its cache rows and its selection."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn


def capacities(group, setting: str) -> list[float]:
    """Each rank's relative memory size, from DSV4_PIPELINE_MEMORY (see its flag)."""
    n = group.size()
    if not setting:
        return [1.0] * n
    if setting == "auto":
        import os

        mine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
        every = mx.distributed.all_gather(mx.array([mine], mx.float32), group=group)
        return [float(v) for v in np.array(every)]
    try:
        sizes = [float(v) for v in setting.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != n or min(sizes) <= 0:
        raise ParallelError(f"DSV4_PIPELINE_MEMORY={setting!r}: expected 'auto' or {n} positive "
                            f"sizes joined with ',' (one per rank)")
    return sizes


def split_by_bytes(args, sizes: dict[str, int], capacity: Sequence[float]) -> list[range]:
    """`split_layers` of the layers' bytes (`sizes`: bytes by parameter name), the embedding
    with the first stage and everything else outside the layers (norm, head) with the last."""
    per_layer = [0] * args.num_hidden_layers
    first = last = 0
    for name, b in sizes.items():
        layer = layer_of(name)
        if layer is not None:
            per_layer[layer] += b
        elif name.startswith("embed."):
            first += b
        else:
            last += b
    return split_layers(per_layer, first, last, capacity)


def plan(args, group, inner: Plan) -> PipelinePlan:
    """The pipeline plan of this rank of `group` (its stage chosen in `prepare`)."""
    if inner.modes:
        raise ParallelError(f"--parallel pipeline+{'+'.join(inner.modes)}: a pipeline does not "
                            f"combine with other modes yet (each stage would need its own group)")
    if flags.get("index_key_quirk"):
        raise ParallelError("--parallel pipeline with DSV4_INDEX_KEY_QUIRK=on: the quirk reads the "
                            "keys of whichever layer published last, which may sit on a later stage")
    return PipelinePlan(args, group, inner)


# --- what crosses -----------------------------------------------------------------------------

_DTYPES = [mx.bfloat16, mx.float16, mx.float32]


class Wire:
    """The parts of one send from stage k to k+1, for a forward of B x S tokens: names,
    shapes and dtypes fixed by (B, S), packed into one byte buffer."""

    def __init__(self, args, carried: tuple[tuple[int, bool], ...], dtype: mx.Dtype):
        self.args, self.carried, self.dtype = args, carried, dtype

    def parts(self, b: int, s: int) -> list[tuple[str, tuple, mx.Dtype]]:
        a = self.args
        out = [("streams", (b * s, a.hc_mult, a.hidden_size), self.dtype),
               ("pre", (b * s, a.hc_mult), mx.float32)]
        for layer, with_qr in self.carried:
            out.append((f"{layer}.x", (b, s, a.hidden_size), self.dtype))
            if with_qr:
                out.append((f"{layer}.qr", (b, s, a.q_lora_rank), self.dtype))
        return out

    def pack(self, arrays: dict[str, mx.array], b: int, s: int) -> mx.array:
        flat = []
        for name, shape, dtype in self.parts(b, s):
            a = arrays[name]
            if tuple(a.shape) != shape or a.dtype != dtype:
                raise RuntimeError(f"pipeline send: {name} is {a.dtype} {list(a.shape)}, the wire "
                                   f"expects {dtype} {list(shape)}")
            flat.append(mx.view(mx.contiguous(a), mx.uint8).reshape(-1))
        return mx.concatenate(flat)

    def nbytes(self, b: int, s: int) -> int:
        return sum(int(np.prod(shape)) * dtype.size for _, shape, dtype in self.parts(b, s))

    def unpack(self, buf: mx.array, b: int, s: int) -> dict[str, mx.array]:
        out, at = {}, 0
        for name, shape, dtype in self.parts(b, s):
            n = int(np.prod(shape)) * dtype.size
            out[name] = mx.view(buf[at:at + n], dtype).reshape(shape)
            at += n
        return out


class _Recording:
    """The forward's state as this stage's layers see it, noting the inputs (x at compress,
    x and qr at select) of the layers a later stage replays; all else goes to the state."""

    def __init__(self, state, layers: set):
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_layers", layers)
        object.__setattr__(self, "noted", {})

    def __getattr__(self, name):
        return getattr(self._state, name)

    def __setattr__(self, name, value):
        setattr(self._state, name, value)

    def compress(self, attn, x):
        if attn.layer in self._layers:
            self.noted[f"{attn.layer}.x"] = x
        return self._state.compress(attn, x)

    def select(self, attn, x, qr):
        if attn.layer in self._layers:
            self.noted[f"{attn.layer}.x"], self.noted[f"{attn.layer}.qr"] = x, qr
        return self._state.select(attn, x, qr)


# --- the model of one stage ---------------------------------------------------------------------

class Pipelined:
    """A Model of which this rank holds one stage (PipelinePlan.prepare), with the Model's
    interface: `model(ids, cache)` runs the stage, receiving from the stage before and sending
    to the one after; the logits are the last stage's (the others return a placeholder of the
    logits' shape that only orders the exchanges), so sample through `shared_sampler`.
    Everything else (args, make_cache, parameters) is the Model's."""

    def __init__(self, model, plan: PipelinePlan):
        self.model, self.plan = model, plan
        self.stage = plan.stage
        self.group = plan.group
        self.blocks = [model.layers[i] for i in self.stage.layers]
        self.draft = None
        k = self.stage.rank
        # The activations' dtype, the first stage's (embedding output), told once to all.
        code = _DTYPES.index(model.embed(mx.array([[0]])).dtype) if plan.first else 0
        code = int(mx.distributed.all_sum(mx.array([code], mx.int32), group=self.group).item())
        self.activation_dtype = dtype = _DTYPES[code]   # (the Model's is its embedding's)
        self.incoming = None if plan.first else Wire(model.args, forwarded(plan.stages, k - 1), dtype)
        self.outgoing = None if plan.last else Wire(model.args, forwarded(plan.stages, k), dtype)
        self._pending = None   # this rank's latest exchange, see _in_order

    def _in_order(self, exchange: Optional[mx.array] = None) -> None:
        """Run this rank's previous exchange before a new one is put in a graph, and note the
        new one. A recv has no input to hang an order on: were two forwards evaluated at once,
        the second's recv could take the first's message. (Generation evaluates every forward
        before the next, so this waits for nothing there.)"""
        if exchange is None and self._pending is not None:
            mx.eval(self._pending)
        self._pending = exchange

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, input_ids, cache=None, hidden: Optional[list] = None, last: bool = False) -> mx.array:
        if hidden is not None:
            raise ParallelError("--parallel pipeline: the DSpark draft stages do not run in a pipeline")
        return self.model.feed(input_ids, cache, lambda ids, state, rows: self.forward(ids, state, rows, last))

    def forward(self, ids: mx.array, state, engram_rows, last: bool = False) -> mx.array:
        """This stage's part of Model.forward (same arguments, no draft inputs)."""
        m, lead = self.model, ids.shape
        b, s = lead
        # The fixed-shape step (dsv4.step) is traced once, and no eval may sit inside it: its
        # steps keep their order by being evaluated (or async_eval'd) one by one, as generation does.
        ordered = isinstance(state, ForwardState)
        if ordered:
            self._in_order()
        if self.incoming is None:
            streams, pre = m.embed_streams(ids)
            carried = {}
        else:
            stats.exchanges += 1
            stats.bytes += self.incoming.nbytes(b, s)
            buf = mx.distributed.recv((self.incoming.nbytes(b, s),), mx.uint8, self.stage.rank - 1,
                                      group=self.group)
            if ordered:
                self._in_order(buf)
            carried = self.incoming.unpack(buf, b, s)
            streams, pre = carried["streams"], carried["pre"]
            self._replay(state, carried)
        noting = set() if self.outgoing is None else {l for l, _ in self.outgoing.carried}
        record = _Recording(state, noting & set(self.stage.layers))
        streams, pre = m.run_layers(self.blocks, streams, pre, record, lead, engram_rows)
        if self.outgoing is None:
            return m.finish(streams, pre, lead, last)
        parts = {**carried, **record.noted, "streams": streams, "pre": pre}
        stats.exchanges += 1
        stats.bytes += self.outgoing.nbytes(b, s)
        sent = mx.distributed.send(self.outgoing.pack(parts, b, s), self.stage.rank + 1, group=self.group)
        if ordered:
            # Sent now: the receiver may go on without evaluating this forward (a decoder that
            # takes the cache over), and a later send must not overtake it.
            mx.eval(sent)
        # A stand-in of the logits' shape (a broadcast: nothing allocated) that depends on the
        # send, so that evaluating it runs this stage.
        shape = (b, 1 if last else s, m.args.vocab_size)
        return mx.depends(mx.broadcast_to(mx.zeros((1, 1, 1), mx.float32), shape), sent)

    def _replay(self, state, carried: dict) -> None:
        """The earlier layers' cache rows and selection this stage reads, rebuilt from their
        inputs in layer order (as the owner computed them, so bit for bit the same)."""
        for layer in self.stage.replayed:
            attn = self.model.layers[layer].attn
            x = carried[f"{layer}.x"]
            if layer in self.stage.compress:
                state.compress(attn, x)
            if layer in self.stage.select:
                state.topk = state.select(attn, x, carried[f"{layer}.qr"])

    def first_rank_logits(self, logits: mx.array) -> mx.array:
        """The last stage's logits [.., V] on the first rank (the server samples there): the
        last rank sends them, the first receives them in place of its placeholder, after its
        own stage has run (a recv has no input to wait on); the others keep theirs. One send
        of B x V fp32 per step (0.5 MB a session at V4.1's vocabulary)."""
        n = self.group.size()
        if self.plan.last:
            stats.exchanges += 1
            stats.bytes += logits.nbytes
            logits = mx.depends(logits, mx.distributed.send(logits, 0, group=self.group))
            mx.eval(logits)
            return logits
        if not self.plan.first:
            return logits
        mx.eval(logits)
        stats.exchanges += 1
        stats.bytes += logits.size * 4
        received = mx.distributed.recv(logits.shape, mx.float32, n - 1, group=self.group)
        mx.eval(received)
        return received

    def shared_sampler(self, sampler):
        """`sampler` as every rank runs it: the last stage samples its logits and the token [B]
        goes round the ring, last -> 0 -> 1 -> ... -> N-2, one send per rank (N - 1 in all).
        Not an all_sum: on the ring backend a 4-byte all_sum took 24 ms where a send took
        0.17 ms (benchmarks/results/*-distributed-pipeline.md)."""
        n, rank = self.group.size(), self.stage.rank

        def sample(logits: mx.array) -> mx.array:
            if self.plan.last:
                token = sampler(logits).astype(mx.int32)
            else:
                mx.eval(logits)   # this stage's send first: the token's recv has no input to wait on
                stats.exchanges += 1
                stats.bytes += 4 * logits.shape[0]
                token = mx.distributed.recv(logits.shape[:1], mx.int32, (rank - 1) % n, group=self.group)
            if rank != n - 2:
                stats.exchanges += 1
                stats.bytes += token.nbytes
                token = mx.depends(token, mx.distributed.send(token, (rank + 1) % n, group=self.group))
            self._in_order(token)
            return token

        return sample
