"""Standard workloads: prefill and decode speed of a model directory, one DSV4_RESULT line out.

    python -m benchmarks.workloads --model PATH --workload decode-2k
    python -m benchmarks.workloads --workload prefill-2k                # the bundled demo checkpoint
    python -m benchmarks.workloads --model synthetic --workload decode-512   # no checkpoint needed
    python -m benchmarks.workloads --list

A run feeds a synthetic prompt (token ids drawn from a seeded generator, so every variant and
every run sees the same prompt), generates greedily exactly the tokens asked for (end-of-sequence ignored), and prints one result line for
`benchmarks/ab.py`: prompt_tps (prompt tokens / time to first token), ttft_s, generation_tps
(tokens after the first / time from the first to the last), peak_memory_gb, the generated ids and
their tokens_md5, and the CPU time of those phases (all threads; on a shared machine it moves less
than wall time when other jobs compete for the cores). With DSV4_STAGE_PROFILE=1 it adds the per-stage decode profile and prints the
profiler's table to stderr. `--model synthetic` is a stand-in decoder of plain MLX matmuls whose
stages are marked like the real forward pass: it measures the harness and the profiler itself.
`--prompt TEXT` feeds that text (encoded as is) instead of the synthetic ids, `--temp` / `--top-p`
sample (seeded by `--seed`); with DSV4_DRAFT the line adds the drafting's numbers (acceptance,
tokens per verify, verifies and plain steps, seconds of propose / verify / plain steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # python benchmarks/X.py runs too

from benchmarks.ab import RESULT_PREFIX, STAGE_KEY, tokens_md5  # noqa: E402
from dsv4 import memory, profiler  # noqa: E402


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    generation_tokens: int
    doc: str


WORKLOADS = {
    "decode-512": Workload(512, 64, "decode tokens/s after a 512-token prompt"),
    "decode-2k": Workload(2048, 64, "decode tokens/s after a 2K prompt"),
    "decode-8k": Workload(8192, 64, "decode tokens/s after an 8K prompt"),
    "prefill-2k": Workload(2048, 1, "prefill tokens/s and time to first token, 2K prompt"),
    "prefill-8k": Workload(8192, 1, "prefill tokens/s and time to first token, 8K prompt"),
}


def synthetic_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    """`length` token ids, uniform over the vocabulary, the same for the same seed everywhere."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=length).tolist()


class SyntheticDecoder:
    """Embedding, `layers` x (an attention-like and an MoE-like residual matmul stage), head.

    Widths make a decode step memory-bound like a real one; each stage ends with a profiler mark,
    so it shows what the profiler costs where no model is at hand. No attention over the context:
    decode cost does not grow with the prompt.
    """

    def __init__(self, vocab_size: int = 4096, width: int = 512, layers: int = 8, seed: int = 0):
        keys = iter(mx.random.split(mx.random.key(seed), 2 + 3 * layers))
        scale = width ** -0.5
        self.vocab_size = vocab_size
        self.embed = mx.random.normal((vocab_size, width), key=next(keys))
        self.layers = [(mx.random.normal((width, width), key=next(keys)) * scale,
                        mx.random.normal((width, 4 * width), key=next(keys)) * scale,
                        mx.random.normal((4 * width, width), key=next(keys)) * scale / 2)
                       for _ in range(layers)]
        self.head = mx.random.normal((width, vocab_size), key=next(keys)) * scale
        mx.eval(self.embed, self.layers, self.head)

    def __call__(self, ids: mx.array) -> mx.array:
        """ids [S] -> logits [S, vocab]."""
        x = profiler.mark("embed", self.embed[ids])
        for mix, up, down in self.layers:
            x = profiler.mark("attention", x + mx.tanh(x @ mix))
            x = profiler.mark("moe", x + mx.tanh(x @ up) @ down)
        return profiler.mark("head", x @ self.head)


def synthetic_tokens(model: SyntheticDecoder, prompt: list[int], max_tokens: int):
    """Greedy generation with the synthetic decoder; yields token ids as mlx-lm's loop would."""
    token = mx.argmax(model(mx.array(prompt))[-1])
    yield token.item()
    for _ in range(max_tokens - 1):
        profiler.step_begin()
        token = profiler.mark("sampling", mx.argmax(model(token[None])[-1]))
        mx.eval(token)
        profiler.step_end()
        yield token.item()


def model_tokens(model, tokenizer, prompt: list[int], max_tokens: int, sampling: Optional[dict] = None,
                 seen: Optional[dict] = None):
    """Token ids from dsv4's own generate loop, exactly `max_tokens` of them: greedy, or as
    `sampling` (stream_generate's temp, top_p, seed) says; `seen["speculative"]` keeps the
    drafting's Stats (None without DSV4_DRAFT)."""
    from dsv4.generation import stream_generate

    for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, ignore_eos=True,
                                    **(sampling or {})):
        if seen is not None:
            seen["speculative"] = response.speculative
        yield response.token


def measure(tokens, prompt_tokens: int) -> dict:
    """Time a stream of generated ids (the prompt is processed before the first one arrives)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    ids, first, last = [], None, None
    for token in tokens:
        last, last_cpu = time.perf_counter(), time.process_time()
        ids.append(int(token))
        if first is None:
            first, first_cpu = last, last_cpu
    if first is None:
        raise RuntimeError("the model generated no token")
    result = {
        "prompt_tokens": prompt_tokens,
        "generation_tokens": len(ids),
        "prompt_tps": prompt_tokens / (first - start),
        "ttft_s": first - start,
        "prompt_cpu_s": first_cpu - start_cpu,
        "peak_memory_gb": memory.peak()[0],
        "tokens": ids,
        "tokens_md5": tokens_md5(ids),
    }
    if len(ids) > 1:
        result["generation_tps"] = (len(ids) - 1) / (last - first)
        result["generation_cpu_ms_per_token"] = 1e3 * (last_cpu - first_cpu) / (len(ids) - 1)
    if profiler.enabled():
        result[STAGE_KEY] = profiler.per_step_ms()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.workloads", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory or repo id (default: the bundled demo "
                        "checkpoint), or 'synthetic'")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="decode-512")
    parser.add_argument("--prompt-tokens", type=int, help="override the workload's prompt length")
    parser.add_argument("--generation-tokens", type=int, help="override the tokens generated")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompt and of sampling")
    parser.add_argument("--prompt", help="a text prompt (encoded as is) instead of the synthetic one")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--list", action="store_true", help="list the standard workloads")
    args = parser.parse_args(argv)
    if args.list:
        for name, w in WORKLOADS.items():
            print(f"{name:<12} prompt {w.prompt_tokens:>5}, generate {w.generation_tokens:>3}: {w.doc}")
        return 0
    workload = WORKLOADS[args.workload]
    prompt_tokens = args.prompt_tokens or workload.prompt_tokens
    max_tokens = args.generation_tokens or workload.generation_tokens
    if prompt_tokens < 1 or max_tokens < 1:
        parser.error("--prompt-tokens and --generation-tokens must be at least 1")

    profiler.reset()
    seen: dict = {}
    if args.model == "synthetic":
        model = SyntheticDecoder()
        prompt = synthetic_prompt(prompt_tokens, model.vocab_size, args.seed)
        tokens = synthetic_tokens(model, prompt, max_tokens)
    else:
        from dsv4 import load
        from dsv4.generation import warm_up

        loading = time.perf_counter()
        model, tokenizer = load(args.model)
        warm_up(model)   # the weights' first-use work is load time, not prefill time
        load_s = time.perf_counter() - loading
        prompt = (tokenizer.encode(args.prompt) if args.prompt else
                  synthetic_prompt(prompt_tokens, model.args.vocab_size, args.seed))
        sampling = dict(temp=args.temp, top_p=args.top_p, seed=args.seed) if args.temp else None
        tokens = model_tokens(model, tokenizer, prompt, max_tokens, sampling, seen)
    name = args.workload if (len(prompt), max_tokens, args.temp) == (
        workload.prompt_tokens, workload.generation_tokens, 0.0) else "custom"
    result = {"workload": name, "model": args.model or "demo", **measure(tokens, len(prompt))}
    if args.model != "synthetic":
        result["load_s"] = load_s
    if seen.get("speculative") is not None:
        result.update(seen["speculative"].numbers())
    if profiler.enabled():
        print(profiler.report(), file=sys.stderr)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
