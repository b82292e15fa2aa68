"""Text generation: `stream_generate` / `generate` (mlx-lm style) and the CLI behind
`python -m dsv4.generate`."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from . import encode_thread, flags, memory, profiler
from .cache import Cache
from .errors import InputError, reported
from .kernels.dialect import backend
from .progress import Progress, Waiting
from .sampling import Sampling, check_max_tokens, check_seed, make_sampler, option_name
from .step import decoder

PREFILL_CHUNK = 512   # tokens per prefill chunk unless flag prefill_chunk says otherwise
CUDA_PREFILL_CHUNK = 4096   # under CUDA, each chunk evaluated layer by layer (see the flag)
# Why a fresh process's warm-up or first token can take minutes (MLX compiles kernels at their
# first evaluation; on CUDA dsv4's own come from the kernel cache after the first start).
KERNELS_WHY = "a process's first steps build their kernels; later ones reuse them"


@dataclass
class GenerationResponse:
    text: str                     # the text completed by this token
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float         # decode steps per second; 0 until a step was timed (n >= 2)
    peak_memory: float            # GB, as memory.peak() measures it
    finish_reason: Optional[str]  # None, "length" or "stop"
    speculative: Optional[object] = None   # dsv4.speculative.Stats while drafting (DSV4_DRAFT)


def prefill_chunk() -> int:
    """Tokens per prefill chunk: flag `prefill_chunk`, or CUDA_PREFILL_CHUNK under CUDA,
    PREFILL_CHUNK elsewhere."""
    return flags.get("prefill_chunk") or (CUDA_PREFILL_CHUNK if backend() == "cuda" else PREFILL_CHUNK)


def prefill(model, ids: np.ndarray, cache: Cache, chunk: Optional[int] = None,
            progress: Optional[Callable[[int, int], None]] = None, draft_cache=None) -> mx.array:
    """Feed ids [1, S] in chunks (of `prefill_chunk()` tokens unless given); returns the logits
    of the last position [1, V].
    `progress(done, total)` is called after each chunk; a `draft_cache` (dsv4.draft) gets the
    main KV of the positions fed."""
    logits = None
    total = ids.shape[1]
    chunk = chunk or prefill_chunk()
    for lo in range(0, total, chunk):
        hidden = None if draft_cache is None else []
        logits = model(ids[:, lo:lo + chunk], cache, hidden=hidden, last=True)[:, -1]
        if draft_cache is not None:
            model.draft.seed(draft_cache, hidden, ids.shape[0])
        mx.eval(logits)
        if progress is not None:
            progress(min(lo + chunk, total), total)
    return logits


def check_context(model, prompt_tokens: int, cached: int = 0) -> int:
    """Room left for generated tokens after the prompt, or an InputError if the prompt does
    not fit the model's context."""
    context = model.args.max_position_embeddings
    used = cached + prompt_tokens
    if used >= context:
        raise InputError(f"the prompt has {used} tokens; the model's context is {context} tokens "
                         f"(room is needed for at least one generated token)")
    return context - used


def stream_generate(model, tokenizer, prompt: Union[str, Sequence[int]], *, max_tokens: int = 256,
                    temp: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    logit_bias: Optional[Mapping[int, float]] = None,
                    cache: Optional[Cache] = None, ignore_eos: bool = False,
                    on_prefilled: Optional[Callable[[Cache], None]] = None,
                    prefill_progress: Optional[Callable[[int, int], None]] = None,
                    draft: Optional[str] = None) -> Iterator[GenerationResponse]:
    """Yield one response per generated token. A str prompt is encoded as is (no chat
    template); with `cache`, the prompt continues what the cache already holds.
    `ignore_eos` generates exactly max_tokens (benchmarks); `on_prefilled(cache)` is called
    once the prompt is in the cache, before the first generated token is fed back;
    `prefill_progress(done, total)` after each prefilled chunk. Generation also stops
    ("length") where the model's context ends. `draft` (off / on / auto, default DSV4_DRAFT)
    decodes speculatively with the model's DSpark draft stages (dsv4/speculative.py): the same
    tokens greedy, the same distribution sampled. Bad options raise an InputError before any
    work is done."""
    check_max_tokens(max_tokens)
    check_seed(seed)
    sampling = Sampling(temp, top_p, presence_penalty, frequency_penalty, logit_bias or {}).check(
        model.args.vocab_size)
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise InputError("the prompt is empty")
    cache = cache if cache is not None else model.make_cache()
    limit = min(max_tokens, check_context(model, len(ids), cache.offset))
    mode = flags.get("draft") if draft is None else draft
    if mode not in ("off", "on", "auto"):
        raise InputError(f"draft={mode!r}: expected off, on or auto")
    if mode == "on" and model.draft is None:
        raise InputError("draft=on, but the model was loaded without draft stages (load it with "
                         "DSV4_DRAFT=on or auto, from a checkpoint that has them)")
    # The draft window holds only this prompt's positions (a cache continued from an earlier
    # turn brings none): drafts may be worse for a while, the output is the same.
    window = model.draft.make_cache(cache.offset) if mode != "off" and model.draft is not None else None
    if seed is not None:
        mx.random.seed(seed)
    sampler = model.shared_sampler(make_sampler(sampling))
    detok = tokenizer.detokenizer
    # A fresh process's first prefill and step build their kernels (MLX compiles them as it
    # first evaluates them: minutes for a first start on a CUDA machine). A long prompt's
    # prefill has its own line, so the wait is shown from its end; the decode loop queues the
    # first step before it hands out the first token.
    waiting = Waiting("first token", KERNELS_WHY)
    try:
        if prefill_progress is None:
            waiting.start()
        start = time.perf_counter()
        logits = prefill(model, np.array([ids], np.int64), cache, progress=prefill_progress, draft_cache=window)
        waiting.start()
        if on_prefilled is not None:
            on_prefilled(cache)
        prompt_time = time.perf_counter() - start
        prompt_tps = len(ids) / prompt_time
        stats = None
        if window is not None:
            from .speculative import Adaptive, Policy, Stats, speculative_tokens

            most = min(flags.get("draft_k"), model.args.dspark_block_size)
            stats = Stats()
            policy = Adaptive(most) if mode == "auto" else Policy(most)
            tokens = speculative_tokens(model, cache, window, logits, sampling, limit, policy, stats)
        else:
            tokens = decode_tokens(model, cache, sampler(logits), sampler, limit)
    except BaseException:
        waiting.stop()
        raise
    try:
        for n, token in enumerate(tokens, 1):
            if n == 1:
                gen_start = time.perf_counter()
                waiting.stop()   # before the token is printed; the first step is queued by now
            stop = token in tokenizer.eos_token_ids and not ignore_eos
            if not stop:
                detok.add_token(token)
            finish = "stop" if stop else ("length" if n == limit else None)
            if finish:
                detok.finalize()
            elapsed = time.perf_counter() - gen_start
            yield GenerationResponse(detok.last_segment, token, len(ids), prompt_tps, n,
                                     (n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
                                     memory.peak()[0], finish, stats)
            if finish:
                return
    finally:
        waiting.stop()
        tokens.close()


def decode_tokens(model, cache: Cache, first: mx.array, sampler,
                  limit: Optional[int] = None) -> Iterator[int]:
    """Tokens from `first` ([1], sampled from the prompt's last logits) on, each fed back
    through the decoder the switches pick (dsv4.step); runs until closed or `limit` tokens
    are out (the last is not fed). Once closed or done, the cache holds everything but the
    last token handed out, as after a plain loop.

    With DSV4_ASYNC_DECODE the step that feeds a token is queued before the token reaches
    the host, so the GPU never waits for Python; a step queued for a token the caller
    stops at is dropped (the decoder's close keeps only the positions handed out). With
    DSV4_ENCODE_THREAD, MLX encodes that step on a thread of its own (dsv4/encode_thread.py)
    while this loop builds the one after."""
    run_ahead = flags.get("async_decode") and not profiler.enabled()
    step = decoder(model, cache)
    encoder = encode_thread.shared() if run_ahead and flags.get("encode_thread") and step.lazy_steps else None
    fed = cache.offset
    y, encoding = first, None   # encoding: y's step on the encoder thread, until it has encoded
    if encoder is not None:   # arrays of this thread's streams, which the encoder cannot encode
        mx.eval(y, list(mx.random.state))
    try:
        for n in range(1, (limit or sys.maxsize) + 1):
            ahead = queued = None
            if run_ahead and n != limit:
                with encode_thread.building(encoder):
                    ahead = sampler(step(y))
                if encoder is not None:
                    # With it, what this thread reads later: the step's writes (close() reads the last
                    # step's) and the sampler's key.
                    queued = encoder.queue([ahead, step.state(), list(mx.random.state)])
                else:
                    mx.async_eval(ahead)
            if encoding is not None:
                encoding.wait()
            yield int(y.item())
            if n == limit:
                return
            fed += 1
            if ahead is None:
                profiler.step_begin()
                ahead = profiler.mark("sampling", sampler(step(y)))
                profiler.step_end()
            y, encoding = ahead, queued
    finally:
        if encoder is not None:
            encoder.drain()   # the step queued ahead, dropped, is encoded before the cache is read back
        step.close(fed)


def generate(model, tokenizer, prompt: Union[str, Sequence[int]], *, verbose: bool = False,
             **kwargs) -> str:
    """The whole completion as text; `verbose` streams it and prints the stats line."""
    text, last = [], None
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        text.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print()
        print_stats(last)
    return "".join(text)


def print_stats(r: GenerationResponse, file=None, load_s: Optional[float] = None,
                weight_bytes: Optional[int] = None) -> None:
    file = file or sys.stdout
    print("=" * 10, file=file)
    if load_s is not None:
        weights = f", {weight_bytes / 1e9:.3f} GB of weights resident" if weight_bytes is not None else ""
        print(f"Load: {load_s:.3f} s (weights and a one-token warm-up, before the clock starts){weights}",
              file=file)
    print(f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec", file=file)
    if r.generation_tokens > 1:
        print(f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec", file=file)
    else:  # the one token came from the prompt's logits: no decode step was timed
        print(f"Generation: {r.generation_tokens} token (from the prompt's logits; no decode step timed)", file=file)
    print(f"Peak memory: {r.peak_memory:.3f} GB ({memory.peak()[1]})", file=file)
    if r.speculative is not None:
        print(r.speculative.line(), file=file)


def warm_up(model) -> None:
    """One token through a throwaway cache: the weights' first-use work (the CPU's dense
    copies, kernel builds) happens here, not in the first prompt's timing. CUDA kernels that
    the kernel cache builds (DSV4_KERNEL_CACHE) build in parallel before the evaluation and
    redraw a progress line."""
    from .kernels import cuda_cache

    with cuda_cache.progress("warm-up"):
        logits = model(np.zeros((1, 1), np.int64), model.make_cache())
        cuda_cache.wait()
        with Waiting("warm-up", KERNELS_WHY):   # MLX's own builds (dsv4's have their line)
            mx.eval(logits)
    # and its token shared as generation shares it: the exchanges of a decode step, all of them
    # (a pipeline's ranks pass the token on; dsv4.distributed.ranks counts them here)
    mx.eval(model.shared_sampler(lambda x: mx.argmax(x, axis=-1))(logits[:, -1]))


def prefill_progress(total: int, enabled: bool = True) -> Optional[Callable[[int, int], None]]:
    """A progress line on stderr for prompts longer than one prefill chunk."""
    if not enabled or total <= prefill_chunk():
        return None
    shown = Progress("prefill", total, unit="tokens")

    def advance(done: int, _total: int) -> None:
        shown.advance(done - shown.done)
        if done == total:
            shown.finish()

    return advance


def chat_prompt(prompt: str, system: Optional[str] = None, think: bool = False) -> str:
    from .encoding import encode_messages

    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": prompt}]
    return encode_messages(messages, "thinking" if think else "chat")


def bench_line(prompt_tokens: int, responses: list[GenerationResponse], ttft: float,
               load_s: Optional[float] = None) -> str:
    tokens = [r.token for r in responses]
    last = responses[-1]
    return "DSV4_RESULT " + json.dumps({
        "prompt_tokens": prompt_tokens, "prompt_tps": last.prompt_tps, "ttft_s": ttft, "load_s": load_s,
        "generation_tokens": len(tokens), "generation_tps": last.generation_tps,
        "peak_memory_gb": last.peak_memory, "tokens": tokens,
        **({} if last.speculative is None else last.speculative.numbers()),
        "tokens_md5": hashlib.md5(",".join(map(str, tokens)).encode()).hexdigest()})


def main(argv: Optional[list[str]] = None) -> None:
    import typer

    app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)
    switches = "\n\n".join(f"{f.env} (default {f.default}): {f.doc}" for f in flags.FLAGS.values())

    @app.command(help="Generate text with DeepSeek V4.1 Flash.",
                 epilog="Runtime switches (environment variables):\n\n" + switches)
    def run(model: Optional[str] = typer.Option(None, help="model directory or Hugging Face repo id "
                                                     "(default: the bundled demo checkpoint)"),
            prompt: str = typer.Option("Once upon a time", "--prompt", "-p", help="the prompt ('-' reads stdin)"),
            max_tokens: int = typer.Option(100, "--max-tokens", "-m", help="tokens to generate (>= 1)"),
            temp: float = typer.Option(0.0, help="sampling temperature (0: greedy)"),
            top_p: float = typer.Option(1.0, help="nucleus sampling mass, in (0, 1]"),
            seed: Optional[int] = typer.Option(None, help="random seed for sampling"),
            raw: bool = typer.Option(False, help="feed the prompt as is, without the chat encoding"),
            system: Optional[str] = typer.Option(None, help="system prompt (chat encoding only)"),
            think: bool = typer.Option(False, help="thinking mode of the chat encoding"),
            bench_json: bool = typer.Option(False, help="print a DSV4_RESULT line for benchmarks/ab.py"),
            expert_cache_gb: Optional[str] = typer.Option(
                None, "--expert-cache-gb", help="stream the routed experts from disk into a cache of N "
                "GB (or auto: what memory the rest leaves) instead of loading them; default "
                "DSV4_EXPERT_CACHE_GB, empty: all resident"),
            draft: Optional[str] = typer.Option(None, help=flags.OPTION_HELP["draft"]),
            draft_k: Optional[int] = typer.Option(None, help=flags.OPTION_HELP["draft_k"]),
            parallel: Optional[str] = typer.Option(
                None, help="run across the processes mlx.launch started, each holding its shard: "
                "expert, tensor, expert+tensor or pipeline (README: Several machines)")):
        from .distributed import link, ranks
        from .loader import load, resident_bytes

        with reported(), contextlib.ExitStack() as scope:
            check_max_tokens(max_tokens, "--max-tokens")
            check_seed(seed, "--seed")
            Sampling(temp, top_p).check(spell=option_name)
            flags.check_environment()
            scope.enter_context(flags.override(**flags.from_options(draft=draft, draft_k=draft_k)))
            group = ranks.join(parallel)
            scope.enter_context(link.watched(group))   # a peer lost: one line, exit 2
            if prompt == "-":
                if group is not None:
                    raise InputError("--prompt - with --parallel: only rank 0 has the input; give the prompt as text")
                prompt = sys.stdin.read()
            if not prompt:
                raise InputError("the prompt is empty (--prompt)")
            start = time.perf_counter()
            net, tokenizer = load(model, expert_cache_gb=expert_cache_gb, group=group, parallel=parallel)
            exchanges = ranks.count(lambda: warm_up(net))
            load_s = time.perf_counter() - start
            text = prompt if raw else chat_prompt(prompt, system, think)
            ids = tokenizer.encode(text)
            if not ids:
                raise InputError(f"the prompt {prompt!r} encodes to no tokens")
            responses = []
            start = time.perf_counter()
            ttft = None
            for r in stream_generate(net, tokenizer, ids, max_tokens=max_tokens, temp=temp, top_p=top_p,
                                     seed=seed, prefill_progress=prefill_progress(len(ids))):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                responses.append(r)
                print(r.text, end="", flush=True)
            print()
            print_stats(responses[-1], load_s=load_s, weight_bytes=resident_bytes(net))
            if group is not None:
                print(ranks.line(parallel, group, *exchanges))
            if getattr(net, "expert_store", None) is not None:
                print(net.expert_store.summary())
            if profiler.enabled():
                print(profiler.report())
            if bench_json:
                print(bench_line(len(ids), responses, ttft, load_s))

    app(argv)
