"""Server throughput for 1, 2, 4 and 8 sessions decoded together, and 8 served in turn.

    python -m benchmarks.serve_sessions [--model PATH] [--tokens 64] [--rounds 3]

Each run is a fresh `python -m dsv4.server` (with --max-sessions 8; the "8 in turn" variant runs
with --max-sessions 1, as the server used to). A run sends N chat requests with different
prompts at once; each asks for exactly --tokens tokens (end of sentence is suppressed with
logit_bias, so every session decodes as long). Throughput is N x tokens over the wall time from
the first request sent to the last answer; latency is each request's own. Runs go in rounds,
forward then backward, and the report gives medians. Every session's greedy answer must equal
the one it gets in turn: batching must not change what is generated.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.hardware import describe, to_markdown  # noqa: E402

VARIANTS = {"1": (1, 8), "2": (2, 8), "4": (4, 8), "8": (8, 8), "8 in turn": (8, 1)}   # sessions, max-sessions
TOPICS = ["sorting a list", "reading a file", "a class with properties", "a generator", "a context manager",
          "string formatting", "a dictionary comprehension", "raising an exception"]


def start(model, max_sessions: int):
    args = [sys.executable, "-m", "dsv4.server", "--port", "0", "--max-sessions", str(max_sessions),
            "--no-prompt-cache"] + (["--model", model] if model else [])
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        found = re.search(r"listening on http://([\d.]+):(\d+)", line)
        if found:
            threading.Thread(target=process.stdout.read, daemon=True).start()
            return process, found.group(1), int(found.group(2))
    raise RuntimeError("the server did not start")


def ask(host, port, topic: str, tokens: int, eos: int) -> tuple[float, str]:
    body = json.dumps({"messages": [{"role": "user", "content": f"Show me Python code for {topic}."}],
                       "max_tokens": tokens, "logit_bias": {str(eos): -100}}).encode()
    begin = time.perf_counter()
    connection = http.client.HTTPConnection(host, port, timeout=600)
    connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    reply = json.loads(connection.getresponse().read())
    assert reply["usage"]["completion_tokens"] == tokens, reply["usage"]
    return time.perf_counter() - begin, reply["choices"][0]["message"]["content"]


def run(model, variant: str, tokens: int, eos: int) -> dict:
    sessions, max_sessions = VARIANTS[variant]
    process, host, port = start(model, max_sessions)
    try:
        ask(host, port, "warming up", 4, eos)
        results: list = [None] * sessions
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, ask(host, port, TOPICS[i], tokens, eos)))
                   for i in range(sessions)]
        begin = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - begin
        stats = json.loads(urlopen(host, port, "/v1/stats"))
    finally:
        process.terminate()
        process.wait(timeout=60)
    return {"variant": variant, "wall_s": wall, "tokens_per_s": sessions * tokens / wall,
            "latency_s": [r[0] for r in results], "answers": [r[1] for r in results],
            "largest_batch": stats["largest_batch"]}


def urlopen(host, port, path) -> bytes:
    connection = http.client.HTTPConnection(host, port, timeout=60)
    connection.request("GET", path)
    return connection.getresponse().read()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the bundled demo)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each session generates")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each runs every variant once)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    options = parser.parse_args(argv)
    from dsv4.loader import resolve
    from dsv4.tokenizer import Tokenizer

    eos = Tokenizer(resolve(options.model)).eos_token_id
    names = list(VARIANTS)
    runs = []
    for round_ in range(options.rounds):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            result = run(options.model, name, options.tokens, eos)
            print(f"{name:>10}: {result['tokens_per_s']:7.1f} tok/s, wall {result['wall_s']:.2f} s, "
                  f"largest batch {result['largest_batch']}", file=sys.stderr, flush=True)
            runs.append(result)
    in_turn = next(r for r in runs if r["variant"] == "8 in turn")["answers"]
    exact = all(r["answers"] == in_turn[:len(r["answers"])] for r in runs)
    median = lambda name, key: statistics.median(r[key] for r in runs if r["variant"] == name)
    in_turn_rate = median("8 in turn", "tokens_per_s")   # one session's rate, over 8 requests
    stamp = datetime.now().strftime("%Y-%m-%d-%H%M")
    lines = [f"# Server throughput by sessions decoded together ({stamp})", "",
             to_markdown(describe()), "",
             f"`python -m benchmarks.serve_sessions --tokens {options.tokens} --rounds {options.rounds}`"
             f"{' --model ' + options.model if options.model else ''} (model: {options.model or 'the bundled demo'}; "
             f"greedy, {options.tokens} tokens per session, prompt cache off, a fresh server per run, rounds "
             "forward then backward, medians).", "",
             "**Exact:** every session's answer equals its answer in turn." if exact else
             "**EXACTNESS CHECK FAILED:** a batched answer differs from the same request in turn.", "",
             "| sessions | max-sessions | total tok/s | x in turn | per-session tok/s | mean latency s | "
             "last answer s | largest batch |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        sessions, max_sessions = VARIANTS[name]
        total = median(name, "tokens_per_s")
        latencies = [r["latency_s"] for r in runs if r["variant"] == name]
        mean = statistics.median(statistics.mean(l) for l in latencies)
        last = statistics.median(max(l) for l in latencies)
        batch = max(r["largest_batch"] for r in runs if r["variant"] == name)
        lines.append(f"| {name} | {max_sessions} | {total:.1f} | {total / in_turn_rate:.2f} | {total / sessions:.1f} | "
                     f"{mean:.2f} | {last:.2f} | {batch} |")
    lines += ["", "x in turn: total tokens/s over that of the same 8 requests served one at a time (the "
              "server before batching), which is one session's rate measured over 8 requests.", "", "Raw runs: " + json.dumps([{k: v for k, v in r.items() if k != "answers"} for r in runs])]
    options.out_dir.mkdir(parents=True, exist_ok=True)
    out = options.out_dir / f"{stamp}-serve-sessions.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
