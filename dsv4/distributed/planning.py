"""A rank's plan for the modes asked (dsv4.distributed.parse_modes). Apart from the package's
interface because a pipeline plan knows the layers' forward state: the layers import the
interface, this module imports the pipeline."""

from __future__ import annotations

from typing import Optional

from . import SINGLE, ParallelError, Plan, parse_modes
from .pipeline import plan as pipeline_plan
from .sharding import Sharding


def build(args, config: dict, group, parallel: Optional[str]) -> Plan:
    """The plan of this rank of `group` for the modes of `parallel` (see parse_modes)."""
    modes = parse_modes(parallel)
    if group is None or not modes:
        if modes:
            raise ParallelError(f"--parallel {parallel}: needs a group (run under mlx.launch)")
        return SINGLE
    inner = Sharding(args, config, group, tuple(m for m in modes if m != "pipeline"))
    return pipeline_plan(args, group, inner) if "pipeline" in modes else inner
