"""Pipeline-parallel decode and prefill (dsv4 --parallel pipeline) against one process.

    python benchmarks/distributed_pipeline.py [--model DIR] [--wide] [--n 2] [--rounds 2]
                                              [--prompt 256] [--steps 32] [--micro 1,2,4,8]

The driver runs every variant in fresh processes, interleaved (single, pipeline, pipeline,
single, ...): one process, and `mlx.launch -n N --backend ring` on this machine's loopback.
Each loads the model (the bundled demo, `--model DIR`, or with `--wide` a tiny checkpoint of
wider layers written once to a temporary directory), then measures
  * decode: greedy tokens through stream_generate after a `--prompt`-token prefill, ms/token
    (tokens compared with the one process's: a pipeline is exact);
  * exchanges per token and bytes, counted where the graph is built, per rank (a decode step
    with the token's all_sum);
  * prefill of the prompt fed as m chunks for each m of `--micro` (a chunk split into m
    micro-batches: stage k works on micro-batch i while stage k+1 works on i-1), tokens/s,
    against the one process fed the same chunks;
  * the link: a 4-byte all_sum and a send of one decode message, round trip.
The report goes to benchmarks/results/<date>-distributed-pipeline.md.

`--v41` runs nothing: for V4.1 Flash's shapes it prints the stages the code chooses for 2-4
ranks, what each boundary's decode send carries (counted by the code's own Wire), and, labelled
as a model, what two M3 Ultras would decode over each link of benchmarks/distributed.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

import dsv4                                     # noqa: E402
from dsv4 import distributed                    # noqa: E402
from dsv4.generation import prefill, stream_generate  # noqa: E402
from dsv4.loader import DEMO_DIR                       # noqa: E402
from dsv4.distributed.ranks import free_ports                # noqa: E402

RESULT = "DSV4_PIPELINE "
WIDE = dict(hidden_size=512, moe_intermediate_size=512, n_routed_experts=16, num_hidden_layers=8,
            q_lora_rank=128, o_lora_rank=64, head_dim=128, qk_rope_head_dim=32, index_head_dim=64)


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(a) -> None:
    group = distributed.init("ring") if a.worker == "pipeline" else None
    model, tokenizer = dsv4.load(a.model, group=group, parallel="pipeline" if group else None)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, model.args.vocab_size, (1, a.prompt))
    report = {"variant": a.worker, "ranks": 1 if group is None else group.size()}
    if group is not None:
        report["layers"] = [list(s.layers) for s in model.plan.stages]
    # decode, as generate runs it; this process's CPU time against the wall clock says whether
    # a rank waiting for the other spins (on a machine of 2 cores the ranks share them)
    cpu, wall = time.process_time(), time.perf_counter()
    responses = list(stream_generate(model, tokenizer, ids[0].tolist(), max_tokens=a.steps, ignore_eos=True))
    report["decode_ms"] = 1000 / responses[-1].generation_tps
    report["decode_cpu_per_wall"] = (time.process_time() - cpu) / (time.perf_counter() - wall)
    report["tokens"] = [r.token for r in responses]
    # one decode step's exchanges: the forward's sends and the token's all_sum
    cache = model.make_cache()
    sample = model.shared_sampler(lambda logits: mx.argmax(logits, axis=-1))
    token = sample(prefill(model, ids, cache))
    mx.eval(token)
    distributed.stats.reset()
    mx.eval(sample(model(np.array(token).reshape(1, 1), cache)[:, -1]))
    report["exchanges_per_token"] = distributed.stats.exchanges
    report["bytes_per_token"] = distributed.stats.bytes
    # prefill in m micro-batches
    report["prefill_tps"] = {}
    for m in a.micro:
        chunk = -(-a.prompt // m)
        s = timed(lambda: mx.eval(prefill(model, ids, model.make_cache(), chunk=chunk)), a.repeats)
        report["prefill_tps"][m] = a.prompt / s
    if group is not None:
        x4 = mx.array([1.0])
        report["all_sum_4B_us"] = timed(lambda: mx.eval(mx.distributed.all_sum(x4, group=group)), 50) * 1e6
        message = model.outgoing or model.incoming
        n = message.nbytes(1, 1)
        buf = mx.zeros((n,), mx.uint8)
        peer = 1 if group.rank() == 0 else 0

        def ping():   # rank 0 and 1 only; the others wait at the barrier below
            if group.rank() == 0:
                mx.eval(mx.distributed.send(buf, peer, group=group))
                mx.eval(mx.distributed.recv_like(buf, peer, group=group))
            elif group.rank() == 1:
                mx.eval(mx.distributed.recv_like(buf, peer, group=group))
                mx.eval(mx.distributed.send(buf, peer, group=group))

        report["send_round_trip_us"] = timed(ping, 50) * 1e6
        report["decode_message_bytes"] = n
        mx.eval(mx.distributed.all_sum(x4, group=group))
    report["rank"] = 0 if group is None else group.rank()
    print(RESULT + json.dumps(report), flush=True)


def run(a, variant: str) -> dict:
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--model", a.model,
          "--prompt", str(a.prompt), "--steps", str(a.steps), "--repeats", str(a.repeats),
          "--micro", ",".join(map(str, a.micro))]
    argv = me if variant == "single" else \
        [str(Path(sys.executable).with_name("mlx.launch")), "-n", str(a.n), "--backend", "ring",
         "--starting-port", str(free_ports(a.n)), "--"] + me
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout, env=env)
    ranks = sorted((json.loads(l[len(RESULT):]) for l in done.stdout.splitlines() if l.startswith(RESULT)),
                   key=lambda r: r["rank"])
    if len(ranks) != (1 if variant == "single" else a.n):   # mlx.launch exits 0 when a rank fails
        raise SystemExit(f"{variant}: {len(ranks)} ranks finished (exit {done.returncode})\n{done.stderr[-3000:]}")
    return {**ranks[-1], "per_rank": [{k: r[k] for k in ("exchanges_per_token", "bytes_per_token",
                                                       "decode_cpu_per_wall")} for r in ranks]}


def report(a, results: dict[str, list[dict]], label: str) -> Path:
    med = lambda v, f: statistics.median(f(r) for r in results[v])
    one, pipe = results["single"], results["pipeline"]
    same = all(r["tokens"] == one[0]["tokens"] for v in results.values() for r in v)
    p = pipe[0]
    lines = [f"# Pipeline parallel on CPU loopback: {label}", "",
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. `python benchmarks/distributed_pipeline.py "
             f"{' '.join(sys.argv[1:])}`. Machine: {_machine()}, shared with other work (load average "
             f"{os.getloadavg()[1]:.1f} over the last 5 minutes at the end; medians). "
             f"{a.n} ranks of `mlx.launch --backend ring` on loopback against one process; "
             f"{len(one)} fresh processes per variant, interleaved. Stages: {p['layers']}.", "",
             "## Decode", "",
             "| variant | ms/token | exchanges/token, per rank | bytes/token, per rank | CPU s / wall s while decoding, per rank |",
             "|---|---|---|---|---|",
             f"| one process | {med('single', lambda r: r['decode_ms']):.2f} | 0 | 0 | "
             f"{med('single', lambda r: r['decode_cpu_per_wall']):.2f} |",
             f"| pipeline x{a.n} | {med('pipeline', lambda r: r['decode_ms']):.2f} | "
             f"{', '.join(str(r['exchanges_per_token']) for r in p['per_rank'])} | "
             f"{', '.join(str(r['bytes_per_token']) for r in p['per_rank'])} | "
             + ", ".join(f"{statistics.median(x['per_rank'][k]['decode_cpu_per_wall'] for x in pipe):.2f}"
                         for k in range(a.n)) + " |", "",
             f"Greedy tokens ({a.steps} after a {a.prompt}-token prompt) identical in every run: {same}. "
             f"Per token the pipeline makes {a.n - 1} send(s) of the streams (one decode message: "
             f"{p['decode_message_bytes']} B) and passes the token (4 B) from the last rank round the "
             f"ring ({a.n - 1} send(s)); each rank counts the exchanges it takes part in. The link: a "
             f"4-byte all_sum (not used: for comparison) takes "
             f"{med('pipeline', lambda r: r['all_sum_4B_us']):.0f} us, a send + send back of one decode "
             f"message {med('pipeline', lambda r: r['send_round_trip_us']):.0f} us.", "",
             "## Prefill in micro-batches", "",
             f"The {a.prompt}-token prompt fed as m chunks (the pipeline overlaps stage k on chunk i with "
             f"stage k+1 on chunk i-1); the one process is fed the same chunks.", "",
             "| m | one process tok/s | pipeline tok/s | ratio |", "|---|---|---|---|"]
    for m in a.micro:
        s = med("single", lambda r: r["prefill_tps"][str(m)])
        q = med("pipeline", lambda r: r["prefill_tps"][str(m)])
        lines.append(f"| {m} | {s:.0f} | {q:.0f} | {q / s:.2f} |")
    out = Path(__file__).parent / "results" / \
        f"{datetime.now(timezone.utc):%Y-%m-%d-%H%M}-distributed-pipeline{'-wide' if a.wide else ''}.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _machine() -> str:
    import platform

    return f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, MLX {mx.__version__} on {mx.default_device()}"


def v41_model() -> str:
    """The --v41 section: stages, exchanges and bytes per decode token at V4.1 Flash's shapes
    (the split by the parameters of the unquantized skeleton: nothing is allocated; the loader
    splits by the quantized sizes, which move the embedding's and head's share), and the model."""
    from mlx.utils import tree_flatten

    from benchmarks import cache_bytes, slice_decode
    from benchmarks.distributed import LINKS, ONE_MAC_MS
    from dsv4.config import ModelArgs
    from dsv4.distributed import pipeline
    from dsv4.model import Model
    from dsv4.testing import tiny_config

    args = ModelArgs.from_dict(tiny_config(**{**slice_decode.REAL, **cache_bytes.V41_FLASH,
                                              "engram_layer_ids": [1, 14]}))
    sizes = {n: a.nbytes for n, a in tree_flatten(Model(args).parameters())}
    lines = ["| ranks | stages | replayed by later stages | bytes per stage send (decode) | exchanges/token (all ranks) | "
             + " | ".join(f"model: {name}" for name in LINKS) + " |", "|---|---|---|---|---|" + "---|" * len(LINKS)]
    for n in (2, 3, 4):
        stages = pipeline.stages(args, pipeline.split_by_bytes(args, sizes, [1.0] * n))
        sends = [pipeline.Wire(args, pipeline.forwarded(stages, k), mx.bfloat16).nbytes(1, 1) for k in range(n - 1)]
        replayed = sorted({l for st in stages for l in st.replayed})
        model = []
        for latency, bandwidth in LINKS.values():
            ms = ONE_MAC_MS + sum(latency + b / bandwidth for b in sends) * 1e3 + (n - 1) * (latency + 4 / bandwidth) * 1e3
            model.append(f"{1000 / ms:.1f} tok/s")
        lines.append(f"| {n} | {', '.join(f'{s.layers.start}-{s.layers.stop - 1}' for s in stages)} | "
                     f"{replayed or '-'} | {', '.join(map(str, sends))} | {2 * (n - 1)} | " + " | ".join(model) + " |")
    lines += ["", f"A model, not a measurement: the stages run in turn, so a token costs one machine's step "
              f"({ONE_MAC_MS:.1f} ms: ds4's 25.6 tok/s for V4.1 Q4 on one M3 Ultra, issue 24) plus each "
              f"stage send (latency + bytes / bandwidth) and the token's N - 1 hops of 4 B. Links: "
              + ", ".join(f"{k} {lat * 1e6:.0f} us, {bw / 1e9:.1f} GB/s" for k, (lat, bw) in LINKS.items()) + "."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the bundled demo)")
    p.add_argument("--wide", action="store_true", help="a tiny checkpoint of wider layers (written once)")
    p.add_argument("--n", type=int, default=2, help="ranks")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per variant")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="prefills timed per micro-batch count")
    p.add_argument("--micro", default="1,2,4,8", type=lambda t: [int(v) for v in t.split(",")])
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--v41", action="store_true", help="V4.1 Flash's stages, exchanges and bytes (no run), and a model")
    p.add_argument("--worker", choices=("single", "pipeline"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    if a.v41:
        out = Path(__file__).parent / "results" / f"{datetime.now(timezone.utc):%Y-%m-%d-%H%M}-distributed-pipeline-v41.md"
        out.write_text(f"# Pipeline parallel at V4.1 Flash's shapes: stages, decode traffic, a model\n\n"
                       f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. `python benchmarks/distributed_pipeline.py "
                       f"--v41` (counted by the code, nothing run). Each boundary's send: the streams "
                       f"[1, 4, 5120] bf16 and pre [1, 4] fp32 (40976 B), plus x [1, 1, 5120] bf16 (and qr "
                       f"[1, 1, 1280] for a selection) of each layer a later stage replays. The toy runs' counts "
                       f"(benchmarks/results/*-distributed-pipeline.md) are the same formula at their widths: "
                       f"720 B (demo), 4112 B (wide).\n\n{v41_model()}\n")
        return print(out)
    with tempfile.TemporaryDirectory() as tmp:
        label = "the bundled demo checkpoint" if a.model is None else a.model
        a.model = a.model or str(DEMO_DIR)
        if a.wide:
            from dsv4.testing import write_tiny_checkpoint

            a.model = str(write_tiny_checkpoint(Path(tmp) / "wide", seed=0, config_overrides=WIDE))
            label = f"a tiny checkpoint of wider layers ({WIDE})"
        results: dict[str, list[dict]] = {"single": [], "pipeline": []}
        for r in range(a.rounds):
            for variant in (("single", "pipeline") if r % 2 == 0 else ("pipeline", "single")):
                results[variant].append(run(a, variant))
                print(variant, {k: v for k, v in results[variant][-1].items() if k != "tokens"}, flush=True)
        print(report(a, results, label))


if __name__ == "__main__":
    main()
