"""One rank of tests/test_distributed.py, started by mlx.launch (or alone for the reference):
load each checkpoint (sharded with each mode), feed the tokens teacher forced (a prefill chunk,
then one token a step), write this rank's fp32 logits, its load log and its exchange count to
OUT/<label>.<mode>.rank<r>.npy + .json (with --greedy N, N greedy tokens from the prefill too),
all in one launch. mlx.launch exits 0 when a rank fails,
so the test reads every rank's files, which are written only after the rank finished."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

import dsv4
from dsv4 import distributed, flags
from dsv4.generation import stream_generate


def run(model_dir: str, out_dir: Path, label: str, name: str, ids: list[int], prefill: int,
        greedy: int = 0) -> None:
    """`name`: the --parallel mode ('' for one process), '@bf16' after it for the weights as
    stored and the official roundings on (else fp32, roundings off)."""
    parallel, _, as_stored = name.partition("@")
    group = distributed.init("ring") if parallel else None
    rank = 0 if group is None else group.rank()
    exact = {} if as_stored else dict(act_quant=False, kv_qdq=False)
    with flags.override(**exact):
        model, tokenizer = dsv4.load(model_dir, dtype=None if as_stored else mx.float32, group=group,
                             parallel=parallel or None)
        cache = model.make_cache()
        distributed.stats.reset()
        logits = [model(np.array([ids[:prefill]]), cache)[0]]
        per_prefill = distributed.stats.exchanges
        for t in ids[prefill:]:
            logits.append(model(np.array([[t]]), cache)[0])
        out = np.array(mx.concatenate(logits))
        exchanges = distributed.stats.exchanges
        tokens = [r.token for r in stream_generate(model, tokenizer, ids[:prefill], max_tokens=greedy,
                                                   ignore_eos=True)] if greedy else []
    log = model.load_log
    report = {"rank": rank, "size": 1 if group is None else group.size(),
              "exchanges_prefill": per_prefill,
              "exchanges": exchanges, "tokens": tokens, "kept_bytes": log.kept_bytes,
              "read_bytes": log.read_bytes,
              "tensors": {n: [s.axis, s.start, s.stop, b] for n, (s, b) in log.tensors.items()},
              "resident_bytes": dsv4.loader.resident_bytes(model)}
    name = f"{label}.{name if parallel else 'single' + name}"
    np.save(out_dir / f"{name}.rank{rank}.npy", out)
    (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps(report))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--run", action="append", required=True, metavar="LABEL=DIR=MODES",
                   help="load DIR with each of the comma-separated MODES in turn ('' one process)")
    p.add_argument("--tokens", default="5,17,42,99,7,3,250,11,64,128,31,200")
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--greedy", type=int, default=0, help="then this many greedy tokens from the prefill")
    a = p.parse_args()
    ids = [int(t) for t in a.tokens.split(",")]
    for spec in a.run:
        label, model_dir, modes = spec.split("=")
        for name in modes.split(","):
            run(model_dir, Path(a.out), label, name, ids, a.prefill, a.greedy)


if __name__ == "__main__":
    main()
