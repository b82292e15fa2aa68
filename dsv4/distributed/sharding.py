"""Expert- and tensor-parallel plans: which part of each tensor a rank holds.

  * expert: the routed experts split by expert id (rank r holds E/N consecutive ids); the
    router, shared expert and backbone whole. Each MoE layer exchanges its per-slot routed
    outputs once (moe.py sums them in the reference's order: bit-identical to one process).
  * tensor: each attention's output groups (and their heads: wq_b rows, attn_sink, wo_a
    rows, wo_b columns) and every expert's intermediate dimension (w1/w3 rows, w2 columns,
    routed and shared) split; one exchange after wo_b and one per MoE layer. The indexer,
    compressors, mHC, router, embedding and head are replicated: they are small and
    replicating them costs no exchange (splitting the indexer's heads would add one per index
    layer; see benchmarks/results for the measurement).
  * expert+tensor: routed experts by id, shared expert and attention as tensor.

Rules name the logical dimension split; a stored tensor's share follows by proportion
(packed codes, per-group scales, GGUF blocks, official 32x32 fp8 blocks alike), and a split
that does not fall on whole blocks is refused, naming the tensor.
"""

from __future__ import annotations

import re
from typing import Optional

from . import WHOLE, ParallelError, Plan, Shard, all_sum
from .. import gguf_blocks

_LAYER = re.compile(r"^layers\.(\d+)\.(.+?)\.?(weight|scales?|biases|attn_sink)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])$")


class Place:
    """A rank's place in a group of `size`, for plans made without one (to size them: tests,
    benchmarks); it makes no exchange."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _even(what: str, total: int, size: int, rank: int) -> range:
    if total % size:
        raise ParallelError(f"--parallel: {what} ({total}) do not split evenly over {size} ranks")
    part = total // size
    return range(rank * part, (rank + 1) * part)


class Sharding(Plan):
    def __init__(self, args, config: dict, group, modes: tuple[str, ...]):
        self.args, self.group, self.modes = args, group, modes
        n, r = group.size(), group.rank()
        self.split_experts = "expert" in modes
        self.split_tensors = "tensor" in modes
        self._groups = _even("attention output groups (o_groups)", args.o_groups, n, r) \
            if self.split_tensors else range(args.o_groups)
        self._experts = _even("routed experts", args.n_routed_experts, n, r) \
            if self.split_experts else range(args.n_routed_experts)
        self._columns = _even("expert intermediate columns (moe_intermediate_size)",
                              args.moe_intermediate_size, n, r) \
            if self.split_tensors else range(args.moe_intermediate_size)
        quant = config.get("quantization") or {}
        self._quant = (quant, {k: quant[k] for k in ("group_size", "bits", "mode", "type") if k in quant})

    def attention_groups(self, args) -> range:
        return self._groups

    def experts(self, args) -> range:
        return self._experts

    def routed_columns(self, args) -> range:
        return range(args.moe_intermediate_size) if self.split_experts else self._columns

    def shared_columns(self, args) -> range:
        return self._columns

    def combine(self, x):
        return all_sum(x, self.group)

    def tensor(self, name: str, shape: tuple[int, ...]) -> Optional[Shard]:
        m = _LAYER.match(name)
        if m is None:
            return WHOLE   # embed, head, norm, draft stages: replicated
        module = m.group(2) if m.group(3) != "attn_sink" else f"{m.group(2)}.attn_sink"
        rule = self._rule(module)
        if rule is None:
            return WHOLE
        if rule == "absent":
            return None
        axis, logical, part = rule
        return self._stored(name, f"layers.{m.group(1)}.{module}", shape, axis, logical, part)

    def _rule(self, module: str):
        """(axis from the end, logical size, this rank's range of it), 'absent' or None (whole)."""
        a = self.args
        per_group = a.num_attention_heads // a.o_groups
        g = self._groups
        if self.split_tensors:
            if module == "attn.wq_b":
                rows = per_group * a.head_dim
                return -2, a.o_groups * rows, range(g.start * rows, g.stop * rows)
            if module == "attn.attn_sink":
                return -1, a.num_attention_heads, range(g.start * per_group, g.stop * per_group)
            if module == "attn.wo_a":
                rank = a.o_lora_rank
                return -2, a.o_groups * rank, range(g.start * rank, g.stop * rank)
            if module == "attn.wo_b":
                rank = a.o_lora_rank
                return -1, a.o_groups * rank, range(g.start * rank, g.stop * rank)
            if module in ("ffn.shared_experts.w1", "ffn.shared_experts.w3"):
                return -2, a.moe_intermediate_size, self._columns
            if module == "ffn.shared_experts.w2":
                return -1, a.moe_intermediate_size, self._columns
        e = _EXPERT.match(module)
        if e is not None:   # the official layout: one tensor per expert
            if int(e.group(1)) not in self._experts:
                return "absent"
            return self._column_rule(e.group(2))
        if module in ("ffn.experts.w1", "ffn.experts.w2", "ffn.experts.w3"):
            if self.split_experts:
                return -3, a.n_routed_experts, self._experts
            return self._column_rule(module[-2:])
        return None

    def _column_rule(self, w: str):
        if self.split_experts or not self.split_tensors:
            return None
        return (-1 if w == "w2" else -2), self.args.moe_intermediate_size, self._columns

    def _stored(self, name: str, module: str, shape: tuple[int, ...], axis: int, logical: int,
                part: range) -> Shard:
        """The share `part` of `logical` along `axis` of the stored tensor: the same proportion
        of its stored size, on whole blocks."""
        if len(shape) < -axis:
            raise ParallelError(f"{name}: stored shape {list(shape)} has no axis {axis} to split")
        axis = len(shape) + axis
        stored = shape[axis]
        # GGUF blocks run along a weight's rows (its other tensors are checked by proportion)
        unit = self._block(module) if axis == len(shape) - 1 and name.endswith(".weight") else 1
        edges = []
        for at in (part.start, part.stop):
            if (at * stored) % logical or at % unit:
                raise ParallelError(
                    f"{name}: splitting its {logical} {'columns' if axis == len(shape) - 1 else 'rows'} "
                    f"over {self.size} ranks at {at} cuts a block (stored {list(shape)}"
                    f"{f', blocks of {unit}' if unit > 1 else ''}); use fewer ranks or another --parallel")
            edges.append(at * stored // logical)
        return Shard(axis, *edges)

    def _block(self, module: str) -> int:
        """Weights per block of a GGUF module's rows (blocks along the input), else 1 (packed
        codes and scales are checked by proportion)."""
        quant, default = self._quant
        setting = quant.get(module, default)
        if isinstance(setting, dict) and setting.get("mode") == "gguf":
            return gguf_blocks.BLOCK_WEIGHTS.get(setting.get("type"), 1)
        return 1
