"""`python -m dsv4.server --model PATH`: the HTTP server (dsv4/serve/) for coding agents.

Endpoints: POST /v1/chat/completions and /v1/completions (OpenAI), /v1/responses (OpenAI
Responses, with previous_response_id), /v1/messages and /v1/messages/count_tokens (Anthropic),
each streaming (SSE) or not; GET /v1/models, /health and /v1/stats (the scheduler's, prefix
cache's and replay counters).

Up to --max-sessions requests are decoded together, one token each per forward; more wait their
turn. Every prompt starts from the longest prefix held by the prefix cache (in memory, bounded by
--kv-cache-mb; with --kv-disk-dir also on disk, bounded by --kv-disk-space-mb and kept across
restarts), and a conversation's earlier answers are put back as the token ids the model produced,
so an agent's next turn prefills only what is new. A client that disconnects cancels its
generation.

The port is bound before the model loads (a port in use is reported at once). Ctrl-C or SIGTERM
stops the server (exit status 0): running generations are cancelled between two steps, their
clients and every queued one get a 503 (in the stream if it has begun), and the process exits
once the worker thread is out of MLX. The interpreter must not shut down under a thread that is
inside MLX or ending (its thread-local MLX state is freed then): Python would pthread_exit that
thread, unwinding its C++ frames, and the process would abort ("terminate called without an
active exception").
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

import typer

from . import flags
from .errors import EXIT_INTERRUPTED, InputError, reported
from .sampling import check_max_tokens

SHUTDOWN_WAIT_S = 10.0  # for the worker to leave MLX (a decode step, a prefill chunk) and clients to be told


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (an InputError if it cannot be had)."""
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as error:  # the port is taken, the address is not this machine's...
        raise InputError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def serve(app, sock: socket.socket, scheduler) -> None:
    """Serve until Ctrl-C or SIGTERM. uvicorn handles both signals; first the scheduler stops,
    so that streams in flight end (with their 503) instead of being waited for."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                print("stopping ...", file=sys.stderr, flush=True)
                scheduler.begin_stop()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=int(SHUTDOWN_WAIT_S))
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the signal it caught again once it is done
        pass


def shut_down(scheduler) -> None:
    """Stop the scheduler. If it cannot be stopped in time (still loading, or stuck), leave at
    once without finalizing the interpreter: that would abort the process under the worker
    (see the module docstring)."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_INTERRUPTED))  # a second Ctrl-C: leave now
    if not scheduler.stop(SHUTDOWN_WAIT_S):
        doing = "loading the model" if not scheduler.ready.is_set() else "generating"
        print(f"stopped while {doing}; leaving without waiting for it", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)


def _follow(load, channel) -> None:
    """A rank other than 0: load as rank 0 does, then repeat its engine calls until it stops.
    Ctrl-C is rank 0's to act on (mlx.launch's terminal sends it to every local rank)."""
    from .serve.followed import follow

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    follow(load(), channel)


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
    max_sessions: int = typer.Option(8, help="requests decoded together (>= 1); more wait their turn"),
    prompt_cache: bool = typer.Option(True, help="start each prompt from the longest cached prefix"),
    kv_cache_mb: int = typer.Option(4096, help="memory the prefix cache may hold, in MiB"),
    kv_disk_dir: Optional[Path] = typer.Option(
        None, help="also keep prefix caches in this directory, across restarts"),
    kv_disk_space_mb: int = typer.Option(16384, help="disk space the prefix cache may use, in MiB"),
    model_name: Optional[str] = typer.Option(None, help="the id /v1/models reports; default: the path"),
    expert_cache_gb: Optional[str] = typer.Option(
        None, "--expert-cache-gb", help="stream the routed experts from disk into a cache of N GB (or "
        "auto) instead of loading them; default DSV4_EXPERT_CACHE_GB, empty: all resident"),
    draft: Optional[str] = typer.Option(None, help=flags.OPTION_HELP["draft"] + "; a request decoded "
                                        "alone speculates, requests decoded together do not"),
    draft_k: Optional[int] = typer.Option(None, help=flags.OPTION_HELP["draft_k"]),
    parallel: Optional[str] = typer.Option(
        None, help="run across the processes mlx.launch started (pipeline, expert, tensor or expert+tensor): "
        "rank 0 serves HTTP, the others follow its forwards (a pipeline's last rank sends it the logits); no "
        "prefix cache, no drafting (README: Several machines)"),
):
    """Serve a dsv4 model over the OpenAI and Anthropic HTTP APIs. Ctrl-C or SIGTERM stops it."""
    from .distributed import follow, link, ranks
    from .serve.app import make_app
    from .serve.service import Service
    from .serve.scheduler import CacheOptions, Scheduler

    def load():
        from .generation import warm_up
        from .loader import load as load_model
        from .loader import resolve
        from .serve.disk_cache import model_fingerprint
        from .serve.engine import ModelEngine

        net, tokenizer = load_model(model, expert_cache_gb=expert_cache_gb, group=group, parallel=parallel)
        warm_up(net)
        engine = ModelEngine(net, tokenizer, model_fingerprint(resolve(model)))
        if channel is None or not channel.leader:
            return engine
        from .serve.followed import LeadingEngine

        return LeadingEngine(engine, channel)

    with reported(), contextlib.ExitStack() as scope:
        check_max_tokens(max_tokens, "--max-tokens")
        check_max_tokens(max_sessions, "--max-sessions")
        if max_context is not None:
            check_max_tokens(max_context, "--max-context")
        for name, value in (("--kv-cache-mb", kv_cache_mb), ("--kv-disk-space-mb", kv_disk_space_mb)):
            if value < 0:
                raise InputError(f"{name}={value}: expected a number of MiB >= 0")
        if not 0 <= port <= 65535:
            raise InputError(f"--port={port}: expected a port number 0..65535")
        flags.check_environment()
        scope.enter_context(flags.override(**flags.from_options(draft=draft, draft_k=draft_k)))
        group = ranks.join(parallel)
        scope.enter_context(link.watched(group))   # a peer lost: one line, exit 2
        channel = follow.channel(group)
        if channel is not None:   # the prefix cache and drafting act on caches outside the engine's calls
            prompt_cache, kv_disk_dir = False, None
            scope.enter_context(flags.override(draft="off"))
            if not channel.leader:
                return _follow(load, channel)
        cache = CacheOptions(prompt_cache, kv_cache_mb << 20, str(kv_disk_dir) if kv_disk_dir else None,
                             kv_disk_space_mb << 20)
        # A peer lost mid-request stops the server as SIGTERM does; it exits 2 with the link's line.
        scheduler = Scheduler(load, max_context=max_context, max_sessions=max_sessions, cache=cache,
                              fatal=(link.LinkLost,), on_fatal=lambda: os.kill(os.getpid(), signal.SIGTERM))
        service = Service(scheduler, model_name or model or "dsv4-demo", max_tokens, thinking)
        sock = bind(host, port)  # a taken port is found before minutes of loading
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as Ctrl-C does
        try:
            scheduler.start()
            print(f"loading {model or 'the bundled demo model'} ...", flush=True)
            scheduler.ready.wait()
            if scheduler.load_error is not None:
                raise scheduler.load_error
            print(f"dsv4 server listening on http://{host}:{sock.getsockname()[1]}", flush=True)
            serve(make_app(service), sock, scheduler)
        except KeyboardInterrupt:
            print("stopping ...", file=sys.stderr, flush=True)
        finally:
            sock.close()
            shut_down(scheduler)
            if (channel is not None and scheduler.ready.is_set() and scheduler.load_error is None
                    and scheduler.fatal_error is None):
                scheduler.engine.stop()   # the followers return
        if scheduler.fatal_error is not None:
            raise scheduler.fatal_error


if __name__ == "__main__":
    app()
