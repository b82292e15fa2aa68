"""Chat with a dsv4 model in the terminal: `python -m dsv4.chat [--model PATH]`.

Tokens stream as they are generated. Each turn re-encodes the conversation in DeepSeek's
chat format and prefills only what the cache does not already hold (the previous turn's
prompt and answer are reused). Commands:

    /reset            start a new conversation (keeps the system prompt)
    /think on|off     thinking mode (the model reasons before answering)
    /save NAME        save the conversation and its cache to NAME.safetensors (~ is your home)
    /load NAME        continue a conversation saved with /save NAME (or a file's full name)
    /help             this list
    /quit             leave (so does Ctrl-D, or Ctrl-C twice at the prompt)

Input: a line is one message. For several lines, end a line with \\ to continue it on the
next, or put \"\"\" alone on a line before and after them; a multi-line paste is one message
(with GNU readline: arrow keys edit, up and down recall earlier lines).
Ctrl-C while the model answers stops the answer: the conversation keeps it as far as it
got (an answer stopped before its first token drops the question too). A second Ctrl-C
before the answer stopped leaves. At the prompt, Ctrl-C clears the line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TextIO

import mlx.core as mx
import typer

from . import flags, memory
from .atomic_file import atomic_file
from .encoding import AssistantMessage, Delta, StreamParser, encode_messages
from .errors import InputError, message, reported
from .prompt_cache import PromptCache

_METADATA_KEY = "dsv4_chat"
SAVE_SUFFIX = ".safetensors"
BLOCK = '"""'


@dataclass
class TurnStats:
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    prompt_tps: float       # prefilled tokens per second (the cached ones cost nothing)
    generation_tps: float   # decode steps per second; 0 until a step was timed
    peak_memory: float      # GB, as memory.peak() measures it
    generated: list[int]    # every token id produced, the end of sentence included
    stopped: bool = False   # Ctrl-C ended the answer
    speculative: Optional[object] = None   # dsv4.speculative.Stats while drafting (--draft)

    def line(self) -> str:
        speed = f" at {self.generation_tps:.1f} tok/s" if self.generation_tps else ""
        drafting = f"\n[{self.speculative.line()}]" if self.speculative is not None else ""
        return (f"[{self.prompt_tokens} prompt tokens ({self.cached_tokens} from cache, "
                f"{self.prompt_tokens - self.cached_tokens} prefilled) at {self.prompt_tps:.1f} tok/s; "
                f"{self.generation_tokens} generated{speed}; "
                f"peak memory {self.peak_memory:.2f} GB ({memory.peak()[1]})]{drafting}")


class _Stopped(Exception):
    """Raised from the prefill progress callback to abandon a prompt mid-prefill."""


def _architecture(model) -> dict:
    """The model's shape as JSON would store it: a save's cache fits only a model of this shape."""
    return json.loads(json.dumps(dataclasses.asdict(model.args), default=str))


def is_chat_save(path: Path) -> bool:
    from .safetensors_file import read_header

    try:
        return _METADATA_KEY in read_header(path)[1]
    except (InputError, OSError):
        return False


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

    def ask(self, text: str, on_delta: Callable[[Delta], None] = lambda delta: None,
            stop: Callable[[], bool] = lambda: False) -> tuple[AssistantMessage, TurnStats]:
        """Add a user message, generate the answer (streamed to on_delta), add it too.
        `stop()` is asked after each prefilled chunk and each token: once it says True the
        answer ends there. An answer stopped before its first token, or a generation that
        fails, leaves the conversation as it was; the cache always matches what it holds."""
        from .generation import prefill_progress, stream_generate

        self.messages.append({"role": "user", "content": text})
        tokens = self.tokenizer.encode(encode_messages(self.messages, self.mode), add_special_tokens=False)
        reuse = self.prompt_cache.prepare(tokens)
        parser, produced, last, stopped = StreamParser(self.mode), [], None, False
        message = AssistantMessage()
        draw = prefill_progress(len(reuse.new_tokens))

        def progress(done: int, total: int) -> None:
            if draw is not None:
                draw(done, total)
            if stop():
                raise _Stopped

        def take(deltas):
            for delta in deltas:
                message.add(delta)
                on_delta(delta)

        responses = stream_generate(self.model, self.tokenizer, reuse.new_tokens, cache=reuse.cache,
                                    on_prefilled=reuse.on_prefilled, prefill_progress=progress,
                                    **self.sampling)
        try:
            for last in responses:
                produced.append(last.token)
                take(parser.feed(last.text))
                if stop():
                    stopped = True
                    break
            take(parser.close())
        except _Stopped:
            stopped = True
        except BaseException:
            self.messages.pop()
            raise
        finally:
            responses.close()  # hands the cache's state back from the decoder
            self.prompt_cache.record(tokens + produced)
        if produced:
            self.messages.append({
                "role": "assistant", "content": message.content, "reasoning_content": message.reasoning,
                "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in message.tool_calls]})
        else:
            self.messages.pop()
        end = set(self.tokenizer.eos_token_ids)
        stats = TurnStats(len(tokens), reuse.cached, sum(t not in end for t in produced),
                          last.prompt_tps if last else 0.0, last.generation_tps if last else 0.0,
                          last.peak_memory if last else 0.0, produced, stopped,
                          last.speculative if last else None)
        return message, stats

    def save(self, path: Path) -> None:
        """Write the conversation and its cache to `path`, whole or not at all. Refuses to
        replace a file that is not an earlier save."""
        cache = self.prompt_cache.cache
        if cache is None:
            raise InputError("nothing to save yet: no turn has been generated")
        if path.is_dir():
            raise InputError(f"{path}: a directory")
        if path.exists() and not is_chat_save(path):
            raise InputError(f"{path}: exists and is not a saved conversation; left as it is")
        state = {"messages": self.messages, "thinking": self.thinking, "system": self.system,
                 "tokens": self.prompt_cache.tokens, "model": _architecture(self.model)}
        cache.require_state()
        # As Cache.save writes it, but into the atomic file (Cache.save takes a path only).
        metadata = {"dsv4_cache": json.dumps(cache.meta()), _METADATA_KEY: json.dumps(state, ensure_ascii=False)}
        try:
            with atomic_file(path) as f:
                mx.save_safetensors(f, cache.state(), metadata=metadata)
        except OSError as error:  # named by the file it means, not by its partial twin
            raise InputError(f"{path}: cannot write it ({error.strerror or error})") from None

    def load(self, path: Path) -> None:
        """Continue the conversation saved in `path`; an InputError (and nothing changed)
        for a file that is not one, is damaged or was saved with a model of another shape."""
        from .cache import load_cache
        from .safetensors_file import read_header

        if path.is_dir():
            raise InputError(f"{path}: a directory, not a saved conversation")
        if _METADATA_KEY not in read_header(path)[1]:  # also refuses truncated files
            raise InputError(f"{path}: not a conversation saved by /save")
        try:
            cache, metadata = load_cache(path, self.model)
            state = json.loads(metadata[_METADATA_KEY])
            messages, thinking, system, tokens = (state[k] for k in ("messages", "thinking", "system", "tokens"))
            architecture = state["model"]
        except KeyError as error:
            raise InputError(f"{path}: an incomplete save (no {error} in it)") from None
        except Exception as error:  # a damaged file fails in MLX's reader or in its JSON, any way
            raise InputError(f"{path}: a damaged save ({message(error)})") from None
        if architecture != _architecture(self.model):
            raise InputError(f"{path}: saved with a model of another shape; its cache does not fit this one")
        self.prompt_cache.adopt(cache, tokens)
        self.messages, self.thinking, self.system = messages, thinking, system


def save_path(name: str) -> Path:
    """The file `/save NAME` writes: NAME (~ expanded) with .safetensors added unless it has it."""
    path = Path(name).expanduser()
    return path if path.suffix == SAVE_SUFFIX else path.with_name(path.name + SAVE_SUFFIX)


def load_path(name: str) -> Path:
    """The file `/load NAME` reads: what `/save NAME` wrote, or NAME itself."""
    written, given = save_path(name), Path(name).expanduser()
    if written.exists() or not given.exists():
        return written
    return given


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


class StopOnInterrupt:
    """While an answer is generated: the first Ctrl-C asks it to stop, a second one (the
    answer still running) raises KeyboardInterrupt as usual."""

    def __init__(self):
        self.requested = False

    def __call__(self) -> bool:
        return self.requested

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "StopOnInterrupt":
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


class MessageReader:
    """Reads one message: a line, lines joined by a trailing backslash, a \"\"\" block, or
    a paste. On a terminal input() goes through GNU readline where Python has it, which
    gives line editing, history and bracketed paste (a paste arrives as one text)."""

    def __init__(self, stdin: TextIO, out: TextIO):
        self.stdin, self.out = stdin, out
        self.terminal = stdin is sys.stdin and out is sys.stdout and stdin.isatty() and out.isatty()
        if self.terminal:
            try:
                import readline
            except ImportError:  # Python built without it: plain lines
                return
            if "libedit" not in (readline.__doc__ or ""):  # editline reads GNU settings wrongly
                readline.parse_and_bind("set enable-bracketed-paste on")

    def _line(self, prompt: str) -> str:
        if self.terminal:
            return input(prompt)
        self.out.write(prompt)
        self.out.flush()
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    def read(self) -> str:
        """The next message (EOFError at the end of input, KeyboardInterrupt on Ctrl-C)."""
        text = self._line(">> ")
        if text.strip() == BLOCK:
            lines = []
            while (line := self._line(".. ")).strip() != BLOCK:
                lines.append(line)
            return "\n".join(lines)
        while text.endswith("\\"):
            text = text[:-1] + "\n" + self._line(".. ")
        return text.rstrip("\n")


class FollowedReader:
    """Under --parallel: rank 0 reads each message and every rank gets it (its end of input and
    its Ctrl-C at the prompt too), so every rank takes the same turns (dsv4/distributed/follow.py)."""

    def __init__(self, channel, reader: Optional[MessageReader]):
        self.channel, self.reader = channel, reader

    def read(self) -> str:
        from .distributed.follow import END, INTERRUPT

        if self.channel.leader:
            try:
                text = self.reader.read()
            except EOFError:
                self.channel.share(END)
                raise
            except KeyboardInterrupt:
                self.channel.share(INTERRUPT)
                raise
            return self.channel.share(text)
        got = self.channel.share()
        if got == END:
            raise EOFError
        if got == INTERRUPT:
            raise KeyboardInterrupt
        return got


def run_repl(session: ChatSession, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout,
             channel=None) -> None:
    """The chat loop; with `channel` (--parallel) rank 0 reads and the other ranks follow."""
    reader = MessageReader(stdin, out) if channel is None or channel.leader else None
    reader = reader if channel is None else FollowedReader(channel, reader)
    out.write("dsv4 chat. /help for commands.\n")
    interrupted = False  # the previous read ended in Ctrl-C
    while True:
        try:
            text = reader.read()
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:
            out.write("\n")
            if interrupted:
                return
            out.write("(Ctrl-C again, Ctrl-D or /quit to leave)\n")
            interrupted = True
            continue
        interrupted = False
        command, _, argument = text.strip().partition(" ")
        argument = argument.strip()
        if "\n" in text.strip() or not command.startswith("/"):
            if text.strip():
                _answer(session, text, out, channel)
        elif command in ("/quit", "/exit"):
            return
        elif command == "/help":
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
        elif command in ("/save", "/load") and channel is not None:
            out.write(f"[{command} is not available under --parallel: each rank holds only its share of the cache]\n")
        elif command in ("/save", "/load"):
            _save_or_load(session, command, argument, out)
        else:
            out.write(f"unknown command {command}; /help lists them\n")


def _answer(session: ChatSession, text: str, out: TextIO, channel=None) -> None:
    try:
        with StopOnInterrupt() as interrupted:
            # under --parallel every rank asks at the same points: any rank's Ctrl-C stops all
            stop = interrupted if channel is None else (lambda: channel.any(interrupted()))
            _, stats = session.ask(text, _printer(out), stop)
    except InputError as error:  # e.g. the conversation outgrew the model's context
        out.write(f"\n[not answered: {message(error)}]\n")
        return
    if stats.stopped:
        out.write("\n[stopped]" if stats.generated else "\n[stopped before the answer began; message dropped]")
    out.write("\n" + stats.line() + "\n")


def _save_or_load(session: ChatSession, command: str, name: str, out: TextIO) -> None:
    if not name:
        out.write(f"usage: {command} NAME\n")
        return
    try:
        if command == "/save":
            path = save_path(name)
            session.save(path)
        else:
            path = load_path(name)
            session.load(path)
    except (ValueError, OSError) as error:  # InputError is a ValueError
        out.write(f"[{command} failed: {message(error)}]\n")
        return
    except KeyboardInterrupt:
        out.write(f"\n[{command} interrupted; nothing changed]\n")
        return
    out.write(f"[{'saved to' if command == '/save' else 'loaded'} {path}: "
              f"{len(session.messages)} messages, {len(session.prompt_cache.tokens)} cached tokens]\n")


def main(
    model: Optional[str] = typer.Option(None, help="dsv4 model directory or repo; default: the bundled demo"),
    max_tokens: int = typer.Option(256, help="most tokens per answer (>= 1)"),
    temp: float = typer.Option(0.0, help="sampling temperature (0 = greedy)"),
    top_p: float = typer.Option(1.0, help="nucleus sampling threshold, in (0, 1]"),
    seed: Optional[int] = typer.Option(None, help="random seed for sampling"),
    system: Optional[str] = typer.Option(None, help="system prompt"),
    think: bool = typer.Option(False, help="start in thinking mode"),
    prompt_cache: bool = typer.Option(True, help="reuse the cache across turns (off: prefill everything)"),
    expert_cache_gb: Optional[str] = typer.Option(
        None, "--expert-cache-gb", help="stream the routed experts from disk into a cache of N GB (or "
        "auto) instead of loading them; default DSV4_EXPERT_CACHE_GB, empty: all resident"),
    draft: Optional[str] = typer.Option(None, help=flags.OPTION_HELP["draft"]),
    draft_k: Optional[int] = typer.Option(None, help=flags.OPTION_HELP["draft_k"]),
    parallel: Optional[str] = typer.Option(
        None, help="run across the processes mlx.launch started (expert, tensor, expert+tensor or "
        "pipeline): rank 0 reads the chat, the others follow (README: Several machines)"),
):
    """Chat with a dsv4 model. In the chat, /help lists the commands, how to enter several
    lines and what Ctrl-C does."""
    from .distributed import follow, link, ranks
    from .generation import warm_up
    from .loader import load
    from .sampling import Sampling, check_max_tokens, check_seed, option_name

    with reported(), contextlib.ExitStack() as scope:
        check_max_tokens(max_tokens, "--max-tokens")
        check_seed(seed, "--seed")
        Sampling(temp, top_p).check(spell=option_name)
        flags.check_environment()
        scope.enter_context(flags.override(**flags.from_options(draft=draft, draft_k=draft_k)))
        group = ranks.join(parallel)
        scope.enter_context(link.watched(group))   # a peer lost: one line, exit 2
        print(f"loading {model or 'the bundled demo model'} ...", flush=True)
        loaded_model, tokenizer = load(model, expert_cache_gb=expert_cache_gb, group=group, parallel=parallel)
        warm_up(loaded_model)
        session = ChatSession(loaded_model, tokenizer, system=system, thinking=think, max_tokens=max_tokens,
                              temp=temp, top_p=top_p, seed=seed, prompt_cache=prompt_cache)
        # sys.stdout as it is now: a follower's is os.devnull (ranks.join)
        run_repl(session, sys.stdin, sys.stdout, channel=follow.channel(group))


if __name__ == "__main__":
    typer.run(main)
