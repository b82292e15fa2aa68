"""The second turn of a chat, with and without reusing the first turn's cache.

    python -m benchmarks.ab --runs 5 --warmup 1 --exact cache,fresh \\
        --variant "cache: --prompt-cache" --variant "fresh: --no-prompt-cache" \\
        -- python -m benchmarks.chat_turns --model PATH

One process: load the model, ask a first question under a long system prompt (untimed),
then a second one, and print the second turn's numbers as a DSV4_RESULT line
(benchmarks/README.md). With the cache, the second turn prefills only its new tokens; both
variants must generate the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Optional

import typer

SYSTEM = ("You are a careful assistant. Answer briefly, cite what you rely on, and say when you "
          "are unsure. ")


def main(
    model: Optional[str] = typer.Option(None, help="dsv4 model directory; default: the bundled demo"),
    system_repeats: int = typer.Option(8, help="how many times the system sentence is repeated"),
    max_tokens: int = typer.Option(8, help="tokens generated per turn"),
    prompt_cache: bool = typer.Option(True, help="reuse the first turn's cache"),
):
    import dsv4
    from dsv4.chat import ChatSession

    loaded, tokenizer = dsv4.load(model) if model else dsv4.load()
    session = ChatSession(loaded, tokenizer, system=SYSTEM * system_repeats, max_tokens=max_tokens,
                          prompt_cache=prompt_cache)
    session.ask("What is the capital of France?")
    _, turn = session.ask("And of Italy?")
    prefilled = turn.prompt_tokens - turn.cached_tokens
    print(f"second turn: {turn.prompt_tokens} prompt tokens, {turn.cached_tokens} from the cache",
          file=sys.stderr)
    print("DSV4_RESULT " + json.dumps({
        "prompt_tokens": turn.prompt_tokens, "cached_tokens": turn.cached_tokens,
        "prefilled_tokens": prefilled, "prompt_tps": turn.prompt_tps,
        "ttft_s": prefilled / turn.prompt_tps if turn.prompt_tps else 0.0,
        "generation_tokens": turn.generation_tokens, "generation_tps": turn.generation_tps,
        "peak_memory_gb": turn.peak_memory, "tokens": turn.generated,
        "tokens_md5": hashlib.md5(",".join(map(str, turn.generated)).encode()).hexdigest()}))


if __name__ == "__main__":
    typer.run(main)
