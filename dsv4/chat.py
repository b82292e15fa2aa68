"""Chat with a dsv4 model in the terminal: `python -m dsv4.chat [--model PATH]`.

Tokens stream as they are generated. Each turn re-encodes the conversation in DeepSeek's
chat format and prefills only what the cache does not already hold (the previous turn's
prompt and answer are reused). Commands:

    /reset            start a new conversation (keeps the system prompt)
    /think on|off     thinking mode (the model reasons before answering)
    /save FILE        save the conversation and its cache to FILE (safetensors)
    /load FILE        load a conversation saved with /save and continue it
    /help             this list
    /quit             leave (so does end of input)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TextIO

import typer

from .encoding import AssistantMessage, Delta, StreamParser, encode_messages
from .prompt_cache import PromptCache

_METADATA_KEY = "dsv4_chat"


@dataclass
class TurnStats:
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    prompt_tps: float       # prefilled tokens per second (the cached ones cost nothing)
    generation_tps: float
    peak_memory: float
    generated: list[int]    # every token id produced, the end of sentence included

    def line(self) -> str:
        return (f"[{self.prompt_tokens} prompt tokens ({self.cached_tokens} from cache, "
                f"{self.prompt_tokens - self.cached_tokens} prefilled) at {self.prompt_tps:.1f} tok/s; "
                f"{self.generation_tokens} generated at {self.generation_tps:.1f} tok/s; "
                f"peak memory {self.peak_memory:.2f} GB]")


class ChatSession:
    """A conversation with a model, its cache reused from turn to turn."""

    def __init__(self, model, tokenizer, *, system: Optional[str] = None, thinking: bool = False,
                 max_tokens: int = 256, temp: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None,
                 prompt_cache: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.system = system
        self.thinking = thinking
        self.sampling = dict(max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed)
        self.prompt_cache = PromptCache(model, enabled=prompt_cache)
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.prompt_cache.reset()

    @property
    def mode(self) -> str:
        return "thinking" if self.thinking else "chat"

    def ask(self, text: str, on_delta: Callable[[Delta], None] = lambda delta: None) -> tuple[AssistantMessage, TurnStats]:
        """Add a user message, generate the answer (streamed to on_delta), add it too."""
        from .generation import stream_generate

        self.messages.append({"role": "user", "content": text})
        tokens = self.tokenizer.encode(encode_messages(self.messages, self.mode), add_special_tokens=False)
        reuse = self.prompt_cache.prepare(tokens)
        parser, produced, last = StreamParser(self.mode), [], None
        message = AssistantMessage()

        def take(deltas):
            for delta in deltas:
                message.add(delta)
                on_delta(delta)

        try:
            for last in stream_generate(self.model, self.tokenizer, reuse.new_tokens, cache=reuse.cache,
                                        on_prefilled=reuse.on_prefilled, **self.sampling):
                produced.append(last.token)
                take(parser.feed(last.text))
            take(parser.close())
        finally:
            self.prompt_cache.record(tokens + produced)
        self.messages.append({
            "role": "assistant", "content": message.content, "reasoning_content": message.reasoning,
            "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in message.tool_calls]})
        end = set(self.tokenizer.eos_token_ids)
        stats = TurnStats(len(tokens), reuse.cached, sum(t not in end for t in produced),
                          last.prompt_tps if last else 0.0, last.generation_tps if last else 0.0,
                          last.peak_memory if last else 0.0, produced)
        return message, stats

    def save(self, path: Path) -> None:
        if self.prompt_cache.cache is None:
            raise ValueError("nothing to save yet: no turn has been generated")
        state = {"messages": self.messages, "thinking": self.thinking, "system": self.system,
                 "tokens": self.prompt_cache.tokens}
        self.prompt_cache.cache.save(path, metadata={_METADATA_KEY: json.dumps(state, ensure_ascii=False)})

    def load(self, path: Path) -> None:
        from .cache import load_cache

        cache, metadata = load_cache(path, self.model)
        if _METADATA_KEY not in metadata:
            raise ValueError(f"{path}: a dsv4 cache, but not one saved by /save (no conversation in it)")
        state = json.loads(metadata[_METADATA_KEY])
        self.prompt_cache.adopt(cache, state["tokens"])
        self.messages, self.thinking, self.system = state["messages"], state["thinking"], state["system"]


def _printer(out: TextIO) -> Callable[[Delta], None]:
    """Streams deltas, marking where reasoning starts and ends."""
    state = {"kind": None}

    def show(delta: Delta) -> None:
        if delta.kind == "reasoning" and state["kind"] != "reasoning":
            out.write("[thinking]\n")
        if delta.kind != "reasoning" and state["kind"] == "reasoning":
            out.write("\n[/thinking]\n")
        state["kind"] = delta.kind
        if delta.kind == "tool_call":
            out.write(f"\n[tool call] {delta.tool_call.name}({delta.tool_call.arguments})\n")
        else:
            out.write(delta.text)
        out.flush()

    return show


def run_repl(session: ChatSession, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> None:
    out.write("dsv4 chat. /help for commands.\n")
    while True:
        out.write(">> ")
        out.flush()
        line = stdin.readline()
        if not line:
            out.write("\n")
            return
        line = line.rstrip("\n")
        command, _, argument = line.strip().partition(" ")
        argument = argument.strip()
        if command in ("/quit", "/exit"):
            return
        if command == "/help":
            out.write(__doc__.split("Commands:\n", 1)[1])
        elif command == "/reset":
            session.reset()
            out.write("[conversation reset]\n")
        elif command == "/think":
            if argument not in ("on", "off"):
                out.write("usage: /think on|off\n")
            else:
                session.thinking = argument == "on"
                out.write(f"[thinking {argument}]\n")
        elif command in ("/save", "/load"):
            if not argument:
                out.write(f"usage: {command} FILE\n")
                continue
            try:
                (session.save if command == "/save" else session.load)(Path(argument))
                out.write(f"[{'saved to' if command == '/save' else 'loaded'} {argument}: "
                          f"{len(session.messages)} messages, {len(session.prompt_cache.tokens)} cached tokens]\n")
            except (OSError, ValueError, KeyError) as error:
                out.write(f"[{command} failed: {error}]\n")
        elif command.startswith("/"):
            out.write(f"unknown command {command}; /help lists them\n")
        elif line.strip():
            _, stats = session.ask(line, _printer(out))
            out.write("\n" + stats.line() + "\n")


def main(
    model: Optional[str] = typer.Option(None, help="dsv4 model directory or repo; default: the bundled demo"),
    max_tokens: int = typer.Option(256, help="most tokens per answer"),
    temp: float = typer.Option(0.0, help="sampling temperature (0 = greedy)"),
    top_p: float = typer.Option(1.0, help="nucleus sampling threshold"),
    seed: Optional[int] = typer.Option(None, help="random seed for sampling"),
    system: Optional[str] = typer.Option(None, help="system prompt"),
    think: bool = typer.Option(False, help="start in thinking mode"),
    prompt_cache: bool = typer.Option(True, help="reuse the cache across turns (off: prefill everything)"),
):
    """Chat with a dsv4 model."""
    import dsv4

    print(f"loading {model or 'the bundled demo model'} ...", flush=True)
    loaded_model, tokenizer = dsv4.load(model) if model else dsv4.load()
    session = ChatSession(loaded_model, tokenizer, system=system, thinking=think, max_tokens=max_tokens,
                          temp=temp, top_p=top_p, seed=seed, prompt_cache=prompt_cache)
    run_repl(session)


if __name__ == "__main__":
    typer.run(main)
