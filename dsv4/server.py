"""An OpenAI-compatible HTTP server: `python -m dsv4.server --model PATH`.

Endpoints: POST /v1/chat/completions and /v1/completions (streaming SSE or not), GET
/v1/models, /health and /v1/stats (prefix-cache and cancellation counters).

One worker thread owns the model: it loads it and runs every generation, one request at
a time, in arrival order (MLX arrays must be evaluated in the thread that built them).
HTTP threads parse and validate requests, hand a job to the worker and turn the tokens it
streams back into OpenAI responses. The worker keeps the cache of the previous request:
a request that repeats an earlier conversation prefills only what is new, and
`usage.prompt_tokens_details.cached_tokens` says how many prompt tokens were reused. A
client that disconnects cancels its generation.

Sampling parameters: temperature, top_p, seed, presence_penalty, frequency_penalty and
logit_bias (token ids as strings, values in [-100, 100]), checked as dsv4.sampling checks
them. Parameters it does not implement get a 400 naming them instead of being ignored: n,
best_of, echo, suffix, logprobs, top_logprobs, functions, function_call, audio and
non-text modalities.

Ctrl-C or SIGTERM stops the server (exit status 0): the running generation is cancelled
(between two tokens or two prefill chunks), its client and every queued one get a 503
error (in the stream if it has begun), and the process exits once the worker is out of
MLX. The interpreter must not shut down under a thread that is inside MLX or ending (its
thread-local MLX state is freed then): Python would pthread_exit that thread, unwinding
its C++ frames, and the process would abort ("terminate called without an active
exception").
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator, Optional

import typer

from .encoding import REASONING_EFFORTS, Delta, StreamParser, encode_messages, longest_marker_prefix
from .errors import EXIT_INTERRUPTED, InputError, reported
from .prompt_cache import PromptCache
from .sampling import Sampling, check_max_tokens, check_seed

MAX_BODY_BYTES = 32 * 1024 * 1024
SHUTDOWN_WAIT_S = 10.0  # for the worker to leave MLX (a decode step, a prefill chunk) and clients to be told


class RequestError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI error fields."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def shutting_down() -> RequestError:
    return RequestError("the server is shutting down; the generation was stopped", status=503,
                        kind="server_error")


class Cancelled(Exception):
    """Raised from stream_generate's prefill callback: the job was cancelled mid-prefill."""


# --- the worker ------------------------------------------------------------------------------


@dataclass
class Job:
    """One generation. `tokens` is the whole prompt; events arrive on `events`:
    ("start", {"prompt_tokens", "cached_tokens"}) or ("error", RequestError), then
    ("token", text, counts) per generated token (counts is False for the end-of-sentence
    token), then ("end", finish_reason)."""
    tokens: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    seed: Optional[int] = None
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker(threading.Thread):
    """Loads the model, then runs jobs one at a time until stopped."""

    def __init__(self, load: Callable[[], tuple], max_context: Optional[int] = None, prompt_cache: bool = True,
                 generate: Optional[Callable] = None):
        """load() -> (model, tokenizer) runs in this thread; generate defaults to
        dsv4.generation.stream_generate (tests pass a scripted one). max_context defaults
        to the model's context and may not exceed it."""
        super().__init__(name="dsv4-generation", daemon=True)
        self._load = load
        self._generate = generate
        self.max_context = max_context
        self.prompt_cache_enabled = prompt_cache
        self.jobs: queue.Queue = queue.Queue()
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.finished = threading.Event()  # no job runs any more, nor will (see run)
        self._submitting = threading.Lock()  # no job is queued once stop() has begun
        self.load_error: Optional[BaseException] = None
        self.tokenizer = None
        self.vocab_size: Optional[int] = None
        self._stats_lock = threading.Lock()
        self.stats = {"requests": 0, "cancelled": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "completion_tokens": 0, "last": None}

    def run(self) -> None:
        try:
            self._work()
        finally:
            self.finished.set()
            # This thread never ends. Its end would run MLX's thread-local destructors (the
            # compile cache holds Python functions), which take the GIL: if the interpreter
            # is shutting down by then, the thread is unwound inside C++ and the process
            # aborts. A daemon thread blocked here just goes with the process.
            threading.Event().wait()

    def _work(self) -> None:
        try:
            if self._generate is None:
                from .generation import stream_generate
            else:
                stream_generate = self._generate
            model, self.tokenizer = self._load()
            self.max_context = self._context(model.args.max_position_embeddings)
            self.vocab_size = model.args.vocab_size
            cache = PromptCache(model, enabled=self.prompt_cache_enabled)
        except BaseException as error:  # reported by main(); the thread has nothing else to do
            self.load_error = error
            self.ready.set()
            return
        self.ready.set()
        while not self.stopping.is_set():
            job = self.jobs.get()
            if job is None:  # stop() woke us
                continue
            try:
                self._run_job(job, model, cache, stream_generate)
            except InputError as error:  # what the request checks could not know
                job.events.put(("error", RequestError(str(error))))
            except Exception as error:  # one bad job must not take the server down
                cache.reset()
                job.events.put(("error", RequestError(f"generation failed: {error}", status=500,
                                                      kind="server_error")))
        while not self.jobs.empty():
            job = self.jobs.get()
            if job is not None:
                job.events.put(("error", shutting_down()))

    def _context(self, model_context: int) -> int:
        if self.max_context is None:
            return model_context
        if self.max_context > model_context:
            raise InputError(f"--max-context {self.max_context} is more than the model's context "
                             f"({model_context} tokens)")
        return self.max_context

    def submit(self, job: Job) -> Job:
        with self._submitting:
            if self.stopping.is_set():
                raise shutting_down()
            self.jobs.put(job)
        return job

    def stop(self, timeout: float) -> bool:
        """Cancel the running job, refuse the queued ones and wait until no job runs; False
        if the model is still loading or a job did not stop within `timeout`."""
        with self._submitting:
            self.stopping.set()
            self.jobs.put(None)
        if not self.ready.is_set():
            return False
        return self.finished.wait(timeout)

    def snapshot(self) -> dict:
        with self._stats_lock:
            return json.loads(json.dumps(self.stats))

    def _abandoned(self, job: Job) -> bool:
        return job.cancelled.is_set() or self.stopping.is_set()

    def _run_job(self, job: Job, model, cache: PromptCache, stream_generate) -> None:
        if self._abandoned(job):
            if self.stopping.is_set():
                job.events.put(("error", shutting_down()))
            return
        room = self.max_context - len(job.tokens)
        if room <= 0:
            job.events.put(("error", RequestError(
                f"the prompt has {len(job.tokens)} tokens; this server's context is {self.max_context} "
                f"tokens and generation needs at least one more", param="messages",
                code="context_length_exceeded")))
            return
        reuse = cache.prepare(job.tokens)
        job.events.put(("start", {"prompt_tokens": len(job.tokens), "cached_tokens": reuse.cached}))
        produced: list[int] = []
        finish = "length"
        end_tokens = set(self.tokenizer.eos_token_ids)

        def prefilled(done: int, total: int) -> None:
            if self._abandoned(job):
                raise Cancelled

        sampling = job.sampling
        responses = stream_generate(model, self.tokenizer, reuse.new_tokens,
                                    max_tokens=min(job.max_tokens, room), temp=sampling.temp,
                                    top_p=sampling.top_p, presence_penalty=sampling.presence_penalty,
                                    frequency_penalty=sampling.frequency_penalty,
                                    logit_bias=sampling.logit_bias, seed=job.seed, cache=reuse.cache,
                                    on_prefilled=reuse.on_prefilled, prefill_progress=prefilled)
        try:
            for response in responses:
                if self._abandoned(job):
                    finish = "cancelled"
                    break
                produced.append(response.token)
                # The end-of-sentence token is not part of the completion, but its response
                # may still carry text the detokenizer was holding.
                job.events.put(("token", response.text, response.token not in end_tokens))
                if response.finish_reason:
                    finish = response.finish_reason
        except Cancelled:
            finish = "cancelled"
        finally:
            responses.close()
            cache.record(job.tokens + produced)
        with self._stats_lock:
            s = self.stats
            s["requests"] += 1
            s["cancelled"] += finish == "cancelled"
            s["prompt_tokens"] += len(job.tokens)
            s["cached_tokens"] += reuse.cached
            completion = sum(t not in end_tokens for t in produced)
            s["completion_tokens"] += completion
            s["last"] = {"prompt_tokens": len(job.tokens), "cached_tokens": reuse.cached,
                         "prefilled_tokens": len(reuse.new_tokens),
                         "completion_tokens": completion, "finish_reason": finish}
        if finish == "cancelled" and self.stopping.is_set():
            job.events.put(("error", shutting_down()))
        else:
            job.events.put(("end", finish))  # after the stats, so a client that saw the end sees them


# --- request validation ----------------------------------------------------------------------


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
        raise RequestError("'stop' must be a string or a list of at most 16 strings", param="stop")
    return [s for s in stop if s]


def _checked(param: str, check: Callable, *args):
    """check(*args), its InputError turned into a 400 naming `param`."""
    try:
        return check(*args)
    except InputError as error:
        raise RequestError(str(error), param=param) from None


# OpenAI's sampling parameters and their names in dsv4.sampling.Sampling.
_SAMPLING_FIELDS = {"temperature": "temp", "top_p": "top_p", "presence_penalty": "presence_penalty",
                    "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias"}


def _logit_bias(value) -> dict:
    """JSON's logit_bias (its keys are strings) as token id -> bias; the ranges are Sampling's to check."""
    if not isinstance(value, dict):
        raise RequestError("'logit_bias' must be an object mapping token ids to numbers", param="logit_bias")
    bias = {}
    for key, number in value.items():
        try:
            bias[int(key)] = number
        except ValueError:
            raise RequestError(f"logit_bias: {key!r} is not a token id", param="logit_bias") from None
    return bias


def _sampling(body: dict, vocab_size: Optional[int]) -> Sampling:
    given = {name: body[param] for param, name in _SAMPLING_FIELDS.items() if body.get(param) is not None}
    if "logit_bias" in given:
        given["logit_bias"] = _logit_bias(given["logit_bias"])
    spell = {name: param for param, name in _SAMPLING_FIELDS.items()}.get
    for name, value in given.items():  # one at a time, so that the 400 names the parameter
        _checked(spell(name), Sampling(**{name: value}).check, vocab_size, spell)
    return Sampling(**given)


# Parameters this server does not implement, what they may be when a client leaves them
# neutral, and what the refusal says.
_UNSUPPORTED = {
    "n": (lambda v: v in (None, 1), "only n=1 is supported"),
    "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported"),
    "echo": (lambda v: v in (None, False), "echo is not supported"),
    "suffix": (lambda v: v in (None, ""), "suffix is not supported"),
    "logprobs": (lambda v: v is None or v is False, "logprobs are not supported"),
    "top_logprobs": (lambda v: v in (None, 0), "top_logprobs are not supported"),
    "functions": (lambda v: v is None, "'functions' is not supported; use 'tools'"),
    "function_call": (lambda v: v is None, "'function_call' is not supported; use 'tool_choice'"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is supported"),
}


def _refuse_unsupported(body: dict) -> None:
    for param, (neutral, refusal) in _UNSUPPORTED.items():
        if not neutral(body.get(param)):
            raise RequestError(refusal, param=param)


def _common_options(body: dict, default_max_tokens: int, vocab_size: Optional[int]) -> dict:
    _refuse_unsupported(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is not None:
        _checked(name, check_max_tokens, max_tokens, name)
    return {
        "stream": stream,
        "include_usage": bool(options.get("include_usage")),
        "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "sampling": _sampling(body, vocab_size),
        "seed": _checked("seed", check_seed, body.get("seed")),
        "stop": _stop_strings(body),
    }


def _thinking_mode(body: dict, default: bool) -> tuple[str, Any]:
    """thinking on/off from DeepSeek's `thinking: {type}`, vLLM's
    `chat_template_kwargs: {thinking}` or an OpenAI `reasoning_effort`."""
    effort = body.get("reasoning_effort")
    if effort == "none":  # OpenAI's way of asking for no reasoning
        effort, default = None, False
    thinking = default if effort is None else True
    switch = body.get("thinking")
    if switch is not None:
        if not isinstance(switch, dict) or switch.get("type") not in ("enabled", "disabled"):
            raise RequestError("'thinking' must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}",
                               param="thinking")
        thinking = switch["type"] == "enabled"
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if "thinking" in kwargs:
        thinking = bool(kwargs["thinking"])
    if effort == "medium":  # OpenAI's middle level; V4.1's default is "high"
        effort = "high"
    if effort is not None and effort not in REASONING_EFFORTS and not (
            type(effort) is int and 1 <= effort <= 100):
        raise RequestError(f"'reasoning_effort' must be one of none, low, medium, high, max or an integer "
                           f"1..100, got {effort!r}", param="reasoning_effort")
    return ("thinking" if thinking else "chat"), effort


def _check_contents(messages: list) -> None:
    """Messages the encoder would read as empty text (it takes a missing content for ""):
    user and tool messages must say something, a system message must have content, an
    assistant message content or tool calls."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue  # the encoder names what is wrong with it
        role, content, where = message.get("role"), message.get("content"), f"messages[{i}]"
        if role in ("user", "tool") and content in (None, "", []):
            raise RequestError(f"{where}: a {role} message needs a non-empty 'content'", param="messages")
        if role == "system" and content is None:
            raise RequestError(f"{where}: a system message needs 'content'", param="messages")
        if role == "assistant" and content is None and not message.get("tool_calls"):
            raise RequestError(f"{where}: an assistant message needs 'content' or 'tool_calls'", param="messages")


def _chat_prompt(body: dict, default_thinking: bool) -> tuple[str, str]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    _check_contents(messages)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    choice = body.get("tool_choice") or "auto"
    if choice not in ("auto", "none"):
        raise RequestError("only tool_choice 'auto' and 'none' are supported", param="tool_choice")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict)
                                        or response_format.get("type") not in ("text", "json_object", "json_schema")):
        raise RequestError("'response_format' must be an object with type text, json_object or json_schema",
                           param="response_format")
    if response_format and response_format["type"] == "text":
        response_format = None
    mode, effort = _thinking_mode(body, default_thinking)
    try:
        prompt = encode_messages(messages, mode, tools=tools if choice == "auto" else None,
                                 response_format=response_format, reasoning_effort=effort)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise RequestError(f"invalid messages: {error}", param="messages") from None
    return prompt, mode


class StopScanner:
    """Cuts the output at the first stop string, holding back text that may begin one."""

    def __init__(self, stops: list[str]):
        self.stops = tuple(stops)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        self.pending += text
        hits = [self.pending.find(s) for s in self.stops if s in self.pending]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        held = longest_marker_prefix(self.pending, self.stops)
        out, self.pending = self.pending[:len(self.pending) - held], self.pending[len(self.pending) - held:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# --- HTTP --------------------------------------------------------------------------------------


class Service:
    """What the request handlers share."""

    def __init__(self, worker: Worker, model_name: str, default_max_tokens: int, thinking: bool):
        self.worker = worker
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.thinking = thinking
        self.started = int(time.time())
        self._in_flight = 0
        self._idle = threading.Condition()

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Counts a request being answered, so that shutting down can wait for its last bytes."""
        with self._idle:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)


class ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    service: Service  # set on the subclass made by make_server
    server_version = "dsv4"

    # -- plumbing

    def _send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _start_events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

    def _event(self, payload) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        try:
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            raise ClientGone from None

    def _client_gone(self) -> bool:
        """True once the client has closed its end (it sends nothing after its request)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _read_body(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError("a JSON body with a Content-Length header is required", status=411)
        if int(length) > MAX_BODY_BYTES:
            raise RequestError(f"the body is larger than {MAX_BODY_BYTES} bytes", status=413)
        try:
            body = json.loads(self.rfile.read(int(length)) or b"null")
        except (ValueError, UnicodeDecodeError) as error:
            raise RequestError(f"the body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    # -- routes

    def do_GET(self):
        routes = {
            "/health": lambda: {"status": "ok"},
            "/v1/models": lambda: {"object": "list", "data": [{
                "id": self.service.model_name, "object": "model", "created": self.service.started,
                "owned_by": "dsv4"}]},
            "/v1/stats": self.service.worker.snapshot,
        }
        route = routes.get(self.path.split("?")[0].rstrip("/"))
        if route is None:
            return self._send_json(404, RequestError(f"no route GET {self.path}", status=404).body())
        self._send_json(200, route())

    def do_POST(self):
        path = self.path.split("?")[0].rstrip("/")
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return self._send_json(404, RequestError(f"no route POST {self.path}", status=404).body())
        with self.service.request():
            self._complete(path)

    def _complete(self, path: str) -> None:
        try:
            body = self._read_body()
            if path == "/v1/chat/completions":
                prompt, mode = _chat_prompt(body, self.service.thinking)
                kind = "chat"
            else:
                prompt, mode = body.get("prompt"), "chat"
                if not isinstance(prompt, str) or not prompt:
                    raise RequestError("'prompt' must be a non-empty string", param="prompt")
                kind = "text"
            worker = self.service.worker
            options = _common_options(body, self.service.default_max_tokens, worker.vocab_size)
            tokens = worker.tokenizer.encode(prompt, add_special_tokens=False)
            if not tokens:
                raise RequestError("the prompt encodes to no tokens", param="prompt")
            job = worker.submit(Job(tokens, options["max_tokens"], options["sampling"], options["seed"]))
            event = self._wait_for_start(job)
            if event is None:
                return
            if event[0] == "error":
                raise event[1]
        except RequestError as error:
            return self._send_json(error.status, error.body())
        try:
            self._respond(kind, job, event[1], options, mode, body.get("model") or self.service.model_name)
        except ClientGone:
            job.cancelled.set()

    def _wait_for_start(self, job: Job):
        """The job's first event, or None if the client left while it waited its turn."""
        while True:
            try:
                return job.events.get(timeout=0.5)
            except queue.Empty:
                if self._client_gone():
                    job.cancelled.set()
                    return None

    def _respond(self, kind: str, job: Job, usage_start: dict, options: dict, mode: str, model: str) -> None:
        ident = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        stream = options["stream"]
        parser = StreamParser(mode) if kind == "chat" else None
        stops = StopScanner(options["stop"])
        text, reasoning, calls = [], [], []
        completion_tokens, finish = 0, None

        def chunk(choice_delta: dict, finish_reason=None) -> dict:
            if kind == "chat":
                choice = {"index": 0, "delta": choice_delta, "finish_reason": finish_reason}
                return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [choice]}
            choice = {"index": 0, "text": choice_delta.get("content", ""), "logprobs": None,
                      "finish_reason": finish_reason}
            return {"id": ident, "object": "text_completion", "created": created, "model": model,
                    "choices": [choice]}

        def deliver(piece: str, final: bool) -> None:
            if parser is None:  # text completions: no chat structure to read
                deltas = [Delta("content", piece)] if piece else []
            else:
                deltas = parser.feed(piece) + (parser.close() if final else [])
            for delta in deltas:
                if delta.kind == "tool_call":
                    call = {"index": len(calls), "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                            "function": {"name": delta.tool_call.name, "arguments": delta.tool_call.arguments}}
                    calls.append(call)
                    if stream:
                        self._event(chunk({"tool_calls": [call]}))
                    continue
                (reasoning if delta.kind == "reasoning" else text).append(delta.text)
                if stream:
                    key = "reasoning_content" if delta.kind == "reasoning" else "content"
                    self._event(chunk({key: delta.text}))

        if stream:
            self._start_events()
            if kind == "chat":
                self._event(chunk({"role": "assistant", "content": ""}))
        while finish is None:
            try:
                event = job.events.get(timeout=0.5)
            except queue.Empty:
                if self._client_gone():
                    raise ClientGone from None
                continue
            if event[0] == "token":
                completion_tokens += event[2]
                piece, stopped = stops.feed(event[1])
                deliver(piece, final=False)
                if stopped:
                    job.cancelled.set()
                    finish = "stop"
                elif completion_tokens % 8 == 0 and self._client_gone():
                    raise ClientGone
            elif event[0] == "end":
                finish = "length" if event[1] == "length" else "stop"
            else:  # the generation failed after it started
                if stream:
                    self._event(event[1].body())
                    self._event("[DONE]")
                else:
                    self._send_json(event[1].status, event[1].body())
                return
        deliver(stops.flush(), final=True)
        if calls and finish == "stop":
            finish = "tool_calls"
        usage = {"prompt_tokens": usage_start["prompt_tokens"], "completion_tokens": completion_tokens,
                 "total_tokens": usage_start["prompt_tokens"] + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": usage_start["cached_tokens"]}}
        if stream:
            self._event(chunk({}, finish))
            if options["include_usage"]:
                self._event({"id": ident, "object": chunk({})["object"], "created": created, "model": model,
                             "choices": [], "usage": usage})
            self._event("[DONE]")
            return
        if kind == "text":
            payload = chunk({"content": "".join(text)}, finish)
        else:
            content = "".join(text)
            message = {"role": "assistant", "content": content if content or not calls else None}
            if mode == "thinking":
                message["reasoning_content"] = "".join(reasoning)
            if calls:
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
            payload = {"id": ident, "object": "chat.completion", "created": created, "model": model,
                       "choices": [{"index": 0, "message": message, "finish_reason": finish}]}
        payload["usage"] = usage
        self._send_json(200, payload)


def make_server(service: Service, host: str, port: int) -> ThreadingHTTPServer:
    """A server listening on host:port (an InputError if it cannot), not yet serving."""
    handler = type("BoundHandler", (Handler,), {"service": service})
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as error:  # the port is taken, the address is not this machine's...
        raise InputError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    server.daemon_threads = True
    return server


def shut_down(worker: Worker, service: Service) -> None:
    """Stop the worker and let the clients get their last event. If the worker cannot be
    stopped in time (still loading, or stuck), leave at once without finalizing the
    interpreter: that would abort the process under the worker (see the module docstring)."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_INTERRUPTED))  # a second Ctrl-C: leave now
    if not worker.stop(SHUTDOWN_WAIT_S):
        doing = "loading the model" if not worker.ready.is_set() else "generating"
        print(f"stopped while {doing}; leaving without waiting for it", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)
    service.wait_idle(SHUTDOWN_WAIT_S)


app = typer.Typer(add_completion=False)


@app.command()
def main(
    model: Optional[str] = typer.Option(None, help="dsv4 model directory or repo; default: the bundled demo"),
    host: str = typer.Option("127.0.0.1", help="address to bind (loopback by default)"),
    port: int = typer.Option(8080, help="port to listen on (0 picks a free one)"),
    max_context: Optional[int] = typer.Option(
        None, help="prompt + completion tokens allowed per request; default: the model's context"),
    max_tokens: int = typer.Option(512, help="completion tokens when a request does not say (>= 1; a "
                                             "completion also ends where the context does)"),
    thinking: bool = typer.Option(False, help="thinking mode unless a request says otherwise"),
    prompt_cache: bool = typer.Option(True, help="reuse the previous request's cache for a shared prefix"),
    model_name: Optional[str] = typer.Option(None, help="the id /v1/models reports; default: the path"),
):
    """Serve a dsv4 model over an OpenAI-compatible HTTP API. Ctrl-C or SIGTERM stops it."""
    from . import flags

    def load():
        from .generation import warm_up
        from .loader import load as load_model

        loaded = load_model(model)
        warm_up(loaded[0])
        return loaded

    with reported():
        check_max_tokens(max_tokens, "--max-tokens")
        if max_context is not None:
            check_max_tokens(max_context, "--max-context")
        if not 0 <= port <= 65535:
            raise InputError(f"--port={port}: expected a port number 0..65535")
        flags.check_environment()
        worker = Worker(load, max_context, prompt_cache)
        service = Service(worker, model_name or model or "dsv4-demo", max_tokens, thinking)
        server = make_server(service, host, port)  # a taken port is found before minutes of loading
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as Ctrl-C does
        try:
            worker.start()
            print(f"loading {model or 'the bundled demo model'} ...", flush=True)
            worker.ready.wait()
            if worker.load_error is not None:
                raise worker.load_error
            print(f"dsv4 server listening on http://{host}:{server.server_address[1]}", flush=True)
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                print("stopping ...", file=sys.stderr, flush=True)
        finally:
            server.server_close()
            shut_down(worker, service)


if __name__ == "__main__":
    app()
