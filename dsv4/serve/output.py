"""One generation seen from its handler: submitted, started, then its output as parsed deltas.

The scheduler's thread puts the job's events; `Events` hands them to the handler's event loop.
`Generation.deltas()` cuts the text at the first stop string (holding back what may begin one),
parses it into reasoning, content and tool calls (dsv4.encoding.StreamParser: DSML that parses
as a call never reaches a client as text), and afterwards says how it ended and how many tokens
it took. Every dialect renders the same deltas in its own shape.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional

from ..encoding import Delta, StreamParser, longest_marker_prefix
from .options import Limits
from .scheduler import Job


class ClientGone(Exception):
    """The client closed its connection; nobody reads the answer."""


class Events:
    """job.events for a handler on an asyncio loop: put() from any thread."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def get(self):
        return await self.queue.get()


class StopScanner:
    """Cuts the output at the first stop string, holding back text that may begin one."""

    def __init__(self, stops: list[str]):
        self.stops = tuple(stops)
        self.pending = ""
        self.matched: Optional[str] = None

    def feed(self, text: str) -> tuple[str, bool]:
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            at, self.matched = min(hits)
            out, self.pending = self.pending[:at], ""
            return out, True
        held = longest_marker_prefix(self.pending, self.stops)
        out, self.pending = self.pending[:len(self.pending) - held], self.pending[len(self.pending) - held:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Generation:
    def __init__(self, scheduler, prompt: tuple[list[int], list], limits: Limits, mode: Optional[str],
                 constraint=None, prompt_param: str = "messages"):
        """prompt: (ids, replay records they took), as Service.tokenize gives them. mode:
        "chat"/"thinking" parse the output as an assistant message; None passes text through
        (text completions). prompt_param: what a prompt too long for the context names."""
        self.scheduler, self.mode = scheduler, mode
        self.events = Events()
        tokens, replayed = prompt
        self.job = Job(tokens, limits.max_tokens, limits.sampling, limits.seed, mode, constraint, self.events,
                       prompt_param=prompt_param, replayed=replayed)
        self.stops = StopScanner(limits.stops)
        self.parser = StreamParser(mode) if mode is not None else None
        self.prompt_tokens = len(tokens)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.finish: Optional[str] = None      # "stop", "length" or "tool_calls" once done
        self.stop_sequence: Optional[str] = None
        self.tool_calls = 0
        self._watcher: Optional[asyncio.Task] = None

    def watch(self, request) -> None:
        """Cancel the job once the client disconnects (while queued, prefilling or decoding)."""
        async def until_gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.job.cancel()
            self.events.put(("gone",))

        self._watcher = asyncio.ensure_future(until_gone())

    def close(self) -> None:
        """The handler is done with it: a job still running is cancelled."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self.finish is None:
            self.job.cancel()

    async def start(self) -> None:
        """Submit and wait for the scheduler to admit the job; a RequestError if it refuses."""
        self.scheduler.submit(self.job)
        event = await self.events.get()
        if event[0] == "gone":
            raise ClientGone
        if event[0] == "error":
            raise event[1]
        self.cached_tokens = event[1]["cached_tokens"]

    async def deltas(self) -> AsyncIterator[Delta]:
        """The output, parsed; a RequestError if the generation fails on the way."""
        while self.finish is None:
            event = await self.events.get()
            if event[0] == "token":
                self.completion_tokens += event[2]
                if self.parser is not None and self.parser.reasoning:
                    self.reasoning_tokens += 1
                piece, stopped = self.stops.feed(event[1])
                for delta in self._parse(piece, final=False):
                    yield delta
                if stopped:
                    self.job.cancel("stop")
                    self.finish, self.stop_sequence = "stop", self.stops.matched
            elif event[0] == "end":
                self.finish = "length" if event[1] == "length" else "stop"
            elif event[0] == "gone":
                raise ClientGone
            else:   # the generation failed after it started
                raise event[1]
        for delta in self._parse(self.stops.flush(), final=True):
            yield delta
        if self.tool_calls and self.finish == "stop" and self.stop_sequence is None:
            self.finish = "tool_calls"

    def _parse(self, piece: str, final: bool) -> list[Delta]:
        if self.parser is None:
            return [Delta("content", piece)] if piece else []
        deltas = self.parser.feed(piece) + (self.parser.close() if final else [])
        self.tool_calls += sum(d.kind == "tool_call" for d in deltas)
        return deltas
