"""What the server tests share: a scripted engine (for what a random model cannot be made to do:
emit a tool call, a stop string, think, run long enough to be cancelled), servers in this
process or in a subprocess, and small HTTP helpers."""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
import pytest

from dsv4.serve.app import make_app
from dsv4.serve.service import Service
from dsv4.serve.scheduler import CacheOptions, Scheduler
from dsv4.tokenizer import StreamingDetokenizer

EOS = 256


class ScriptTokenizer:
    """Bytes are ids 0..255 and 256 is end of sentence, as a byte-level tokenizer would have
    them; each distinct piece of the script longer than a byte is one more id, so what the engine
    generates is not what its text re-tokenizes to (as a BPE model's output often is not)."""

    eos_token_id, eos_token_ids = EOS, {EOS}

    def __init__(self, pieces: Sequence[str]):
        self.pieces = [p for p in dict.fromkeys(pieces) if len(p.encode()) > 1]
        self.vocab_size = 257 + len(self.pieces)

    def piece_id(self, piece: Optional[str]) -> int:
        if piece is None:
            return EOS
        return piece.encode()[0] if len(piece.encode()) == 1 else 257 + self.pieces.index(piece)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        data = b"".join(bytes([i]) if i < 256 else b"" if i == EOS else self.pieces[i - 257].encode()
                        for i in ids)
        return data.decode(errors="replace")

    def token_to_id(self, text: str) -> Optional[int]:
        return 257 + self.pieces.index(text) if text in self.pieces else None

    @property
    def detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self)


class ListCache:
    """A cache that holds only token ids (what the prefix cache and the disk tier see of one)."""

    def __init__(self, tokens=()):
        self.tokens = list(tokens)
        self.generated = 0

    @property
    def offset(self) -> int:
        return len(self.tokens)

    def trim(self, n: int) -> int:
        del self.tokens[len(self.tokens) - n:]
        return n

    def copy(self) -> "ListCache":
        return ListCache(self.tokens)

    def max_trim(self) -> int:
        return self.offset

    def nbytes(self) -> int:
        return 8 * len(self.tokens)

    def save(self, file, metadata: dict) -> None:
        mx.save_safetensors(file, {"tokens": mx.array(np.array([self.tokens], np.int64))}, metadata=metadata)


class ScriptedEngine:
    """Generates the pieces of `script` after any prompt, then end of sentence. Each prefill
    call (a chunk) and each decode step sleeps `delay`; it records the text of every cache
    after each prefill call, and the largest batch it decoded."""

    fingerprint = "scripted"
    context = 1 << 20
    runs_ahead = False   # its decode takes host tokens (the model engine's run-ahead: test_server_batch)

    def __init__(self, pieces: Sequence[str], delay: float = 0.0):
        self.script = list(pieces)
        self.tokenizer = ScriptTokenizer(self.script)
        self.vocab_size = self.tokenizer.vocab_size
        self.delay = delay
        self.prefilled: list[str] = []
        self.largest_batch = 0

    def new_cache(self) -> ListCache:
        return ListCache()

    def snapshot(self, cache: ListCache) -> ListCache:
        return cache.copy()

    def _next(self, cache: ListCache) -> mx.array:
        n = cache.generated
        piece = self.script[n] if n < len(self.script) else None
        logits = np.zeros(self.vocab_size, np.float32)
        logits[self.tokenizer.piece_id(piece)] = 100.0
        return mx.array(logits)

    def draft_window(self, cache: ListCache):
        return None   # a script does not speculate

    def prefill(self, cache: ListCache, tokens, window=None) -> mx.array:
        time.sleep(self.delay)
        cache.tokens.extend(tokens)
        cache.generated = 0
        self.prefilled.append(self.tokenizer.decode(cache.tokens))
        return self._next(cache)

    def decode(self, caches, tokens) -> mx.array:
        time.sleep(self.delay)
        self.largest_batch = max(self.largest_batch, len(caches))
        for cache, token in zip(caches, tokens):
            cache.tokens.append(token)
            cache.generated += 1
        return mx.stack([self._next(c) for c in caches])

    def settle(self, cache=None) -> None:
        pass

    def forget(self) -> None:
        pass

    def load_cache(self, path):
        arrays, metadata = mx.load(str(path), return_metadata=True)
        return ListCache(np.array(arrays["tokens"]).reshape(-1).tolist()), metadata

    def constraint_tokenizer(self):
        """The script's vocabulary as llguidance reads it: each id's bytes."""
        from llguidance import LLTokenizer, TokenizerWrapper

        return LLTokenizer(TokenizerWrapper(SpelledVocabulary(self.tokenizer)), n_vocab=self.vocab_size)


class SpelledVocabulary:
    """A ScriptTokenizer as llguidance's TokenizerWrapper takes a tokenizer: the bytes of each id
    and an encoder of bytes."""

    eos_token_id, bos_token_id, special_token_ids = EOS, None, [EOS]

    def __init__(self, tokenizer: ScriptTokenizer):
        self.tokens = [bytes([i]) for i in range(256)] + [b"<eos>"] + [p.encode() for p in tokenizer.pieces]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def serve_in_thread(service: Service):
    """Serve `service` on a free loopback port in this process; -> (host, port, stop())."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(service), log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    def stop():
        server.should_exit = True
        thread.join(timeout=30)

    return "127.0.0.1", sock.getsockname()[1], stop


def inprocess_server(load, *, max_tokens=64, max_sessions=8, prefill_chunk=512, max_context=100_000,
                     cache: Optional[CacheOptions] = None, thinking=False):
    """The server's app and scheduler in this process, load() giving the engine (run in the
    scheduler's thread, as the server runs it) -> namespace of scheduler, service, host, port,
    base (URL) and stop()."""
    scheduler = Scheduler(load, max_context=max_context, max_sessions=max_sessions, prefill_chunk=prefill_chunk,
                          cache=cache or CacheOptions())
    scheduler.start()
    scheduler.ready.wait()
    assert scheduler.load_error is None, scheduler.load_error
    service = Service(scheduler, "in-process", max_tokens, thinking)
    host, port, stop_http = serve_in_thread(service)

    def stop():
        stop_http()
        assert scheduler.stop(timeout=30)

    return SimpleNamespace(scheduler=scheduler, service=service, host=host, port=port,
                           base=f"http://{host}:{port}", stop=stop)


def scripted_server(pieces, *, delay=0.0, **options):
    """inprocess_server in front of a ScriptedEngine of `pieces` (also its `engine`)."""
    engine = ScriptedEngine(pieces, delay)
    served = inprocess_server(lambda: engine, **options)
    served.engine = engine
    return served


def model_server(path, **options):
    """inprocess_server in front of the dsv4 model at `path` (its engine as `engine`)."""
    def load():
        import dsv4
        from dsv4.serve.disk_cache import model_fingerprint
        from dsv4.serve.engine import ModelEngine

        return ModelEngine(*dsv4.load(str(path)), model_fingerprint(Path(path)))

    served = inprocess_server(load, **options)
    served.engine = served.scheduler.engine
    return served


def clients_server(path, **options):
    """model_server for `path` with the real clients on it: `openai` and `anthropic`, no retries."""
    import anthropic
    import openai

    served = model_server(path, **options)
    served.openai = openai.OpenAI(base_url=served.base + "/v1", api_key="x", max_retries=0, timeout=120)
    served.anthropic = anthropic.Anthropic(base_url=served.base, api_key="x", max_retries=0, timeout=120)
    return served


def in_parallel(ask, items, workers: int = 8) -> list:
    """ask(item) for every item, `workers` at a time (requests decoded together), in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(ask, items))


def start_server(args: list[str]):
    """`python -m dsv4.server` in a subprocess -> (process, host, port); process.output collects
    what it prints (stdout and stderr)."""
    process = subprocess.Popen([sys.executable, "-m", "dsv4.server", "--port", "0", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    process.output = []
    for line in process.stdout:
        process.output.append(line)
        found = re.search(r"listening on http://([\d.]+):(\d+)", line)
        if found:
            threading.Thread(target=lambda: process.output.extend(process.stdout), daemon=True).start()
            return process, found.group(1), int(found.group(2))
    process.wait()
    raise RuntimeError("the server did not start:\n" + "".join(process.output))


def get_json(host, port, path):
    connection = http.client.HTTPConnection(host, port, timeout=60)
    connection.request("GET", path)
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def post_raw(host, port, path, body: bytes, headers=None):
    connection = http.client.HTTPConnection(host, port, timeout=60)
    connection.request("POST", path, body=body, headers=headers or {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def send_raw(host, port, path: str, body: dict) -> socket.socket:
    """A request written on a socket of its own (to leave without reading the answer)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, port), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_until(sock, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        piece = sock.recv(4096)
        assert piece, f"the server closed the connection before sending {marker!r}: {received!r}"
        received += piece
    return received


def wait_for(predicate, timeout: float = 20.0, what: str = "the condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# --- the tiny random checkpoint, served in a subprocess and run directly as the oracle ---------

MAX_TOKENS = 6
MAX_CONTEXT = 300


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from dsv4.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def oracle(checkpoint):
    import dsv4
    from dsv4.generation import stream_generate

    model, tokenizer = dsv4.load(str(checkpoint))

    def generate(tokens, max_tokens=MAX_TOKENS, **kwargs):
        """Direct generation from a fresh cache -> (text, token ids)."""
        responses = list(stream_generate(model, tokenizer, tokens, max_tokens=max_tokens, **kwargs))
        return "".join(r.text for r in responses), [r.token for r in responses]

    return SimpleNamespace(model=model, tokenizer=tokenizer, generate=generate,
                           encode=lambda text: tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def live(checkpoint):
    """The checkpoint served by `python -m dsv4.server` -> namespace of host, port, base, client
    (an openai client)."""
    import openai

    process, host, port = start_server(["--model", str(checkpoint), "--max-context", str(MAX_CONTEXT),
                                        "--max-tokens", str(MAX_TOKENS)])
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    yield SimpleNamespace(client=client, host=host, port=port, base=f"http://{host}:{port}")
    process.terminate()
    assert process.wait(timeout=30) == 0  # SIGTERM stops it as Ctrl-C does
