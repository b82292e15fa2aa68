"""Several processes as one model, through mx.distributed (launched by mlx.launch).

A `Plan` says what this rank holds and how its layers combine with the other ranks':
  * the loader asks `plan.tensor(name, stored_shape)` for every stored tensor: None (this rank
    does not load it at all), WHOLE, or a `Shard` (axis, start, stop) of the stored tensor,
    and reads only those bytes (dsv4/distributed/reading.py);
  * the layers ask it their share (`attention_groups`, `experts`, `expert_columns`) and call
    its collectives (`combine`), so they never branch on rank: the single-process plan
    answers "everything" and its collectives are the identity.

Modes (`parse_modes`; `planning.build` makes a rank's plan): "expert" and "tensor"
(dsv4/distributed/sharding.py) and "pipeline"
(dsv4/distributed/pipeline.py: `pipeline.plan(args, group, inner) -> Plan`, the layers of
this rank's stage, each asked of `inner` for its own split), joined with '+'.

Exchanges are counted where the graph is built (`stats`): one decode step's count is the
exchanges per token whatever the backend (ring over TCP, JACCL, MPI, NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..errors import InputError

MODES = ("expert", "tensor", "pipeline")
BACKENDS = ("any", "ring", "jaccl", "mpi", "nccl")


class ParallelError(InputError):
    """A --parallel mode, a group or a split that cannot be: the message names which and why."""


@dataclass(frozen=True)
class Shard:
    """The part of a stored tensor a rank reads: [start, stop) along `axis` (None: all of it)."""
    axis: Optional[int] = None
    start: int = 0
    stop: int = 0


WHOLE = Shard()


def parse_modes(text: Optional[str]) -> tuple[str, ...]:
    """'expert', 'tensor', 'pipeline' or a '+'-joined combination -> the modes, sorted;
    None or '' -> ()."""
    if not text:
        return ()
    modes = [m.strip().lower() for m in text.split("+")]
    bad = [m for m in modes if m not in MODES]
    if bad or len(set(modes)) != len(modes):
        raise ParallelError(f"--parallel {text!r}: expected {', '.join(MODES)} or a combination "
                            f"joined with '+' (e.g. expert+tensor), each once")
    return tuple(sorted(modes))


def init(backend: str = "any"):
    """The group of every process mlx.launch started (a lone process started without
    mlx.launch gets a group of one); a peer that does not join within DSV4_JOIN_TIMEOUT
    seconds is a ParallelError (dsv4/distributed/link.py)."""
    from .. import flags
    from . import link

    if backend not in BACKENDS:
        raise ParallelError(f"--backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    return link.join(backend, flags.get("join_timeout"))


@dataclass
class Stats:
    """Exchanges put into graphs since the last reset, and their bytes (per rank)."""
    exchanges: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.exchanges = self.bytes = 0


stats = Stats()


class Plan:
    """One process: every tensor whole, every layer whole, no exchange."""
    group = None
    modes: tuple[str, ...] = ()

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size()

    def tensor(self, name: str, shape: tuple[int, ...]) -> Optional[Shard]:
        return WHOLE

    def prepare(self, model) -> None:
        """Called by the loader with the model's skeleton as it will be loaded (quantized,
        nothing allocated yet), before any tensor is asked for: a plan may split by its sizes
        and drop the modules this rank holds none of (a pipeline's other stages). Here: none."""

    def attention_groups(self, args) -> range:
        """The output-projection groups (and so the heads) of every attention this rank computes."""
        return range(args.o_groups)

    def experts(self, args) -> range:
        """The routed expert ids this rank holds."""
        return range(args.n_routed_experts)

    def routed_columns(self, args) -> range:
        """The part of every routed expert's intermediate dimension this rank holds."""
        return range(args.moe_intermediate_size)

    def shared_columns(self, args) -> range:
        """The part of the shared expert's intermediate dimension this rank holds."""
        return range(args.moe_intermediate_size)

    def combine(self, x: mx.array) -> mx.array:
        """The sum of every rank's x (partial sums of a split product): x itself here."""
        return x


SINGLE = Plan()


def all_sum(x: mx.array, group) -> mx.array:
    """mx.distributed.all_sum over `group`, counted in `stats`."""
    stats.exchanges += 1
    stats.bytes += x.nbytes
    return mx.distributed.all_sum(x, group=group)
