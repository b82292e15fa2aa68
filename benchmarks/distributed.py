"""Decode across ranks (dsv4 --parallel) on the shape-true V4.1 slice of benchmarks/slice_decode.py.

    python benchmarks/distributed.py [--small] [--modes expert,tensor,expert+tensor] [--n 2]
                                     [--backend ring] [--context 64] [--steps 16] [--repeats 2]
    mlx.launch --hosts a,b --backend ring -- python benchmarks/distributed.py --link

The driver runs every variant in fresh processes, interleaved (forward, then backward): one
process for the unsharded model, `mlx.launch -n N --backend B` for each mode. Each rank builds
its own shard of the slice at random (the same seed everywhere, so the replicated weights agree;
the shards are not the one model's, so tokens are not compared here: tests/test_distributed.py
checks exactness), prefills `--context` tokens and decodes `--steps` greedy ones, then decodes
again with its exchanges taken out (each rank alone, the same compute): the difference is the
time in collectives, waits for the slower rank included. Reported: decode ms/token, exchanges
per token (counted where the graph is built) and bytes per exchange, the time in collectives,
the all_sum round trip at the decode exchange's size; and, labelled as a model, what two M3
Ultras would decode from the bytes each rank reads per token and a link's latency and bandwidth.

`--link` (under mlx.launch): all_sum round trip and bandwidth of the group's link by size.
`--small` runs toy widths (the CPU); without it the real widths (a GPU per rank: NCCL on one
host, `--backend nccl`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks import slice_decode   # noqa: E402
from dsv4 import distributed          # noqa: E402
from dsv4.distributed import planning, ranks, reading    # noqa: E402

RESULT = "DSV4_DISTRIBUTED "
# A model, not a measurement: V4.1 Flash has 40 layers (the slice 7); ds4 decodes V4.1 Q4 at
# 25.6 tok/s on one M3 Ultra (issue 24); links as the issue gives them.
LAYERS = 40
ONE_MAC_MS = 1000 / 25.6
LINKS = {"TCP over Thunderbolt": (1e-3, 2.5e9), "RDMA over Thunderbolt": (30e-6, 8e9)}


def slice_args(small: bool):
    from dsv4.config import ModelArgs

    return ModelArgs.from_dict({**(slice_decode.SMALL if small else slice_decode.REAL), **slice_decode.ROLES})


def built(args, plan):
    """This rank's share of the slice, random (seed 0 on every rank), its step bytes."""
    from dsv4.model import Model

    mx.random.seed(0)
    model = Model(args, plan)
    params = slice_decode.quantize_randomly(model)
    model.eval()
    return model, slice_decode.step_bytes(params, args)


def round_trip(group, shape, dtype, repeats: int = 30) -> float:
    """Seconds per all_sum of an array of `shape` (evaluated one at a time, as a step waits)."""
    x = mx.ones(shape, dtype)
    mx.eval(mx.distributed.all_sum(x, group=group))
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(mx.distributed.all_sum(x, group=group))
    return (time.perf_counter() - start) / repeats


def worker(a) -> None:
    args = slice_args(a.small)
    group = distributed.init(a.backend) if a.worker != "single" else None
    # one process: a plan of its own (the exchanges are switched off below by replacing its combine)
    plan = distributed.Plan() if group is None else planning.build(args, {}, group, a.worker)
    model, step_bytes = built(args, plan)
    exchanges, nbytes = ranks.count(lambda: mx.eval(model(np.zeros((1, 1), np.int64),
                                                                      model.make_cache())))
    combine = plan.combine
    times = {"with": [], "without": []}
    for r in range(a.repeats):
        for variant in (("with", "without") if r % 2 == 0 else ("without", "with")):
            if group is None and variant == "without":
                continue
            plan.combine = combine if variant == "with" else (lambda x: x)
            ms, _ = slice_decode.decode_dsv4(model, a.context, a.steps)
            times[variant].append(ms)
    plan.combine = combine
    report = {"mode": a.worker, "ranks": 1 if group is None else group.size(),
              "ms_per_token": statistics.median(times["with"]),
              "ms_without_exchanges": statistics.median(times["without"] or times["with"]),
              "exchanges_per_token": exchanges, "bytes_per_exchange": nbytes / max(exchanges, 1),
              "step_bytes": step_bytes}
    if group is not None:
        report["all_sum_s"] = round_trip(group, (1, max(1, int(report["bytes_per_exchange"]) // 2)),
                                         mx.bfloat16)
        report["all_sum_4B_s"] = round_trip(group, (1,), mx.float32)
    if group is None or group.rank() == 0:
        print(RESULT + json.dumps(report), flush=True)


def link(a) -> None:
    group = distributed.init(a.backend)
    for size in (4, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 24):
        t = round_trip(group, (size // 4,), mx.float32, repeats=20 if size < 1 << 20 else 5)
        if group.rank() == 0:
            print(f"all_sum of {size:>9} B over {group.size()} ranks: {t * 1e6:9.1f} us, "
                  f"{size / t / 1e9:6.3f} GB/s", flush=True)


def run_variant(a, mode: str) -> dict:
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--context", str(a.context),
          "--steps", str(a.steps), "--repeats", str(a.repeats), "--backend", a.backend] + \
        (["--small"] if a.small else [])
    argv = me if mode == "single" else \
        [str(Path(sys.executable).with_name("mlx.launch")), "-n", str(a.n), "--backend", a.backend,
         *(["--starting-port", str(ranks.free_ports(a.n))] if a.backend == "ring" else []), "--"] + me
    done = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout)
    lines = [l for l in done.stdout.splitlines() if l.startswith(RESULT)]
    if not lines:   # mlx.launch exits 0 when a rank fails: the result line says it finished
        raise SystemExit(f"{mode}: no result (exit {done.returncode})\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def weight_bytes(mode: str, n: int, per_token: bool = True) -> float:
    """Bytes of weights rank 0 holds (or, `per_token`, reads per decode token: the routed
    experts k of E, the embedding not at all) at V4.1's widths and 40 layers, as stored
    officially (fp8 projections, fp4 experts), its shares from the plan: the slice's layers
    averaged, times 40, plus the embedding and head."""
    from dsv4.distributed.sharding import Place, Sharding
    from dsv4 import layout
    from dsv4.safetensors_file import STORAGE

    args = slice_args(small=False)
    plan = Sharding(args, {}, Place(0, n), tuple(mode.split("+"))) if mode != "single" else distributed.Plan()
    layers = head = 0.0
    for name, (dtype, shape) in layout.expected_tensors(args).items():
        if name.startswith("embed.") and per_token:
            continue
        shard = plan.tensor(name, shape)
        if shard is None:
            continue
        size = np.prod(reading.shard_shape(shape, shard)) * np.dtype(STORAGE[dtype]).itemsize
        if per_token and re.search(r"\.experts\.\d+\.", name):   # a token picks k of the E experts
            size *= args.num_experts_per_tok / args.n_routed_experts
        if name.startswith("layers."):
            layers += size
        else:
            head += size
    return layers / args.num_hidden_layers * LAYERS + head


def modeled(r: dict, mode: str, n: int, scale: float) -> dict:
    """Two M3 Ultras, a model: the one-Mac step scaled by the weight bytes rank 0 reads per
    token against one process's (weight_bytes), plus each exchange's latency and bytes over
    the link; exchanges from the slice's layers to V4.1's 40, their bytes (counted on this run)
    by V4.1's hidden size over this run's (`scale`: every exchange is [tokens, slots, hidden])."""
    share = weight_bytes(mode, n) / weight_bytes("single", 1)
    exchanges = r["exchanges_per_token"] * LAYERS / slice_decode.ROLES["num_hidden_layers"]
    nbytes = r["bytes_per_exchange"] * scale
    out = {"share": share, "bytes": nbytes, "held": weight_bytes(mode, n, per_token=False)}
    for name, (latency, bandwidth) in LINKS.items():
        out[name] = 1000 / (ONE_MAC_MS * share + exchanges * (latency + nbytes / bandwidth) * 1e3)
    return out


def write_report(a, results: dict[str, list[dict]]) -> Path:
    med = lambda mode, key: statistics.median(x[key] for x in results[mode])
    layers = slice_decode.ROLES["num_hidden_layers"]
    lines = [f"# Decode across ranks (dsv4 --parallel), {'toy widths' if a.small else 'V4.1 widths'}",
             "", f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. `python benchmarks/distributed.py "
             f"{' '.join(sys.argv[1:])}`. {a.n} ranks, `mlx.launch --backend {a.backend}` "
             f"({'loopback, this machine' if a.backend == 'ring' else a.backend}); machine: "
             f"{_machine()}. The slice of benchmarks/slice_decode.py ({layers} layers, every role), "
             f"context {a.context}, {a.steps} greedy steps, medians of {a.repeats} decodes x "
             f"{len(results['single'])} fresh processes per variant, interleaved.", "",
             "| variant | ms/token | ms without exchanges | time in collectives | exchanges/token | "
             "KiB/exchange | all_sum at that size | weight bytes/step/rank |", "|---|---|---|---|---|---|---|---|"]
    for mode in results:
        ms, without = med(mode, "ms_per_token"), med(mode, "ms_without_exchanges")
        r = results[mode][0]
        coll = f"{ms - without:.1f} ms" if mode != "single" else "-"
        rt = f"{med(mode, 'all_sum_s') * 1e3:.2f} ms" if mode != "single" else "-"
        lines.append(f"| {mode} | {ms:.1f} | {without:.1f} | {coll} | {r['exchanges_per_token']} | "
                     f"{r['bytes_per_exchange'] / 1024:.1f} | {rt} | {r['step_bytes'] / 1e6:.1f} MB |")
    scale = slice_decode.REAL["hidden_size"] / slice_args(a.small).hidden_size
    lines += ["", "## Model: two M3 Ultras (not a measurement)", "",
              f"tokens/s = 1000 / (one Mac's step ({ONE_MAC_MS:.1f} ms: ds4's 25.6 tok/s for V4.1 Q4, "
              f"issue 24) x rank 0's weight bytes per token / one process's (V4.1's widths and "
              f"{LAYERS} layers, official storage, from the plan) + exchanges x (latency + bytes / "
              f"bandwidth)); exchanges per layer and bytes per exchange as counted on this run, the "
              f"bytes scaled to V4.1's hidden size. Links: "
              + ", ".join(f"{n} {lat * 1e6:.0f} us, {bw / 1e9:.1f} GB/s" for n, (lat, bw) in LINKS.items())
              + ". Weights held per rank: all of V4.1's 40 layers (no Engram tables, which stay "
              "on disk), as officially stored.", "",
              "| mode | weights held/rank | weight bytes read/token/rank | exchanges/token | KiB/exchange | "
              + " | ".join(LINKS) + " |", "|---|---|---|---|---|" + "---|" * len(LINKS)]
    for mode in results:
        if mode == "single":
            continue
        r = results[mode][0]
        m = modeled(r, mode, a.n, scale)
        lines.append(f"| {mode} | {m['held'] / 1e9:.0f} GB | {m['share'] * 100:.0f}% | "
                     f"{r['exchanges_per_token'] * LAYERS // layers} | "
                     f"{m['bytes'] / 1024:.1f} | " + " | ".join(f"{m[n]:.1f} tok/s" for n in LINKS) + " |")
    lines.append(f"| one Mac | {weight_bytes('single', 1, per_token=False) / 1e9:.0f} GB | 100% | 0 | - | "
                 f"{1000 / ONE_MAC_MS:.1f} tok/s | {1000 / ONE_MAC_MS:.1f} tok/s |")
    lines += ["", "Each process's result line (rank 0):", "", "```json"] + \
        [json.dumps(x) for mode in results for x in results[mode]] + ["```"]
    out = a.out / f"{datetime.now(timezone.utc):%Y-%m-%d-%H%M}-distributed{'-small' if a.small else ''}.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _machine() -> str:
    import os
    import platform

    return f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, MLX {mx.__version__} on {mx.default_device()}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="expert,tensor,expert+tensor")
    p.add_argument("--n", type=int, default=2, help="ranks")
    p.add_argument("--backend", default="ring", choices=distributed.BACKENDS)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="decodes per process (with and without exchanges)")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per variant")
    p.add_argument("--small", action="store_true", help="toy widths (CPU)")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--link", action="store_true", help="(under mlx.launch) the link's all_sum by size")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    if a.link:
        link(a)
        return 0
    if a.worker:
        worker(a)
        return 0
    from dsv4.distributed import parse_modes

    modes = ["single"] + [m for m in a.modes.split(",") if parse_modes(m)]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            results[mode].append(run_variant(a, mode))
            print(f"{mode}: {results[mode][-1]['ms_per_token']:.1f} ms/token", flush=True)
    print(f"wrote {write_report(a, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
