"""The worker thread: every request's prefill and decode, several sessions decoded together.

MLX arrays must be evaluated in the thread that built them, so one thread owns the model. Each
turn of its loop it takes the new jobs, drops the cancelled ones, admits waiting jobs while
fewer than `max_sessions` are active (each starts from the longest cached prefix of its prompt),
prefills one chunk of one admitted prompt (round robin, so a long prompt does not hold up a
short one behind it), and decodes one token for every session past its prefill in one forward
(dsv4.batch_decode). New requests therefore join between steps, and a session's tokens keep
coming while another prompt is prefilled. With DSV4_DRAFT a session decoded alone speculates
(engine.speculate); once decoded alongside others its draft window misses positions, so it
decodes plainly from then on (sessions decoded together never speculate).

A job's events: ("start", {"prompt_tokens", "cached_tokens"}) or ("error", RequestError); then
("token", text, counts) per generated token (counts is False for end of sentence, whose
response may still carry text the detokenizer held); then ("end", finish_reason) with
finish_reason "stop", "length" or "cancelled".

A finished session's cache goes into the prefix cache (with the replay records of what it
generated), and so does every prompt once prefilled: the next turn of a conversation, or a
retry, starts from whichever keeps more.
"""

from __future__ import annotations

import json
import queue
import threading
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

from ..errors import InputError
from ..generation import PREFILL_CHUNK
from ..sampling import Sampling, make_sampler
from .errors import RequestError, shutting_down
from .prefix_cache import PrefixCache
from .replay import Replay


@dataclass
class Job:
    """One generation. `mode` ("chat"/"thinking") says the output is an assistant message whose
    ids can be replayed (None for plain text completions); `constraint()` makes the structured
    output constraint of this generation (structured.py). `events` is anything with put()."""
    tokens: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    seed: Optional[int] = None
    mode: Optional[str] = None
    constraint: Optional[Callable[[], Any]] = None
    events: Any = field(default_factory=queue.Queue)
    prompt_param: str = "messages"   # the request parameter a prompt too long for the context names
    replayed: list = field(default_factory=list)   # replay records the prompt's ids took
    cancelled: threading.Event = field(default_factory=threading.Event)
    stop_reason: str = "cancelled"

    def cancel(self, reason: str = "cancelled") -> None:
        """End the generation at the next step: "cancelled" (the client left) or "stop" (the
        handler found a stop string; the output up to there is a normal answer)."""
        if not self.cancelled.is_set():
            self.stop_reason = reason
            self.cancelled.set()


class Session:
    """A job being served: its cache and what it produced."""

    def __init__(self, job: Job, cache, cached: int, limit: int, detokenizer):
        self.job, self.cache, self.cached, self.limit = job, cache, cached, limit
        self.todo = list(job.tokens[cached:])   # prompt tokens still to prefill
        self.produced: list[int] = []
        self.detok = detokenizer
        self.sampler = make_sampler(job.sampling)
        # A seeded request draws from its own generator, so sessions decoded alongside it do
        # not change what it samples.
        self.rng = np.random.default_rng(job.seed) if job.seed is not None else None
        self.constraint = job.constraint() if job.constraint is not None else None
        self.window = None   # the draft window while this session may speculate

    @property
    def drafts(self) -> bool:
        return self.window is not None

    def held(self) -> list[int]:
        """The ids the cache holds: the prefilled prompt, then every token produced but the last
        (sampled, not yet fed)."""
        if self.todo:
            return self.job.tokens[:len(self.job.tokens) - len(self.todo)]
        return self.job.tokens + self.produced[:-1]


@dataclass
class CacheOptions:
    enabled: bool = True
    memory_bytes: int = 4 << 30
    disk_dir: Optional[str] = None
    disk_bytes: int = 16 << 30


class Scheduler(threading.Thread):
    """Loads the engine, then serves jobs until stopped."""

    def __init__(self, load: Callable[[], Any], *, max_context: Optional[int] = None, max_sessions: int = 8,
                 prefill_chunk: int = PREFILL_CHUNK, cache: CacheOptions = CacheOptions(),
                 replay_limit: int = 4096, fatal: tuple = (), on_fatal: Callable[[], None] = lambda: None):
        """load() -> an engine (engine.py), run in this thread. max_context defaults to the
        model's context and may not exceed it. An error of a `fatal` type (a lost peer under
        --parallel) fails its requests, is kept in `fatal_error`, and calls on_fatal() once:
        the server stops and reports it."""
        super().__init__(name="dsv4-generation", daemon=True)
        self._load = load
        self.max_context = max_context
        self.max_sessions, self.prefill_chunk, self.cache_options = max_sessions, prefill_chunk, cache
        self.replay_limit = replay_limit
        self.jobs: queue.Queue = queue.Queue()
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.finished = threading.Event()   # no job runs any more, nor will (see run)
        self._submitting = threading.Lock()  # no job is queued once stop() has begun
        self.load_error: Optional[BaseException] = None
        self.fatal, self.on_fatal = fatal, on_fatal
        self.fatal_error: Optional[BaseException] = None
        self.engine = self.tokenizer = self.replay = self.prefix = None
        self._ahead: Optional[tuple] = None   # (session, logits): its next step, queued (engine.runs_ahead)
        self.vocab_size: Optional[int] = None
        self.waiting: deque[Job] = deque()
        self.prefilling: deque[Session] = deque()
        self.decoding: list[Session] = []
        self._stats_lock = threading.Lock()
        self.stats = {"requests": 0, "cancelled": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "completion_tokens": 0, "decode_steps": 0, "decoded_tokens": 0, "largest_batch": 0,
                      "last": None}

    # --- lifecycle -----------------------------------------------------------------------

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
            self.engine = self._load()
            self.tokenizer = self.engine.tokenizer
            self.max_context = self._context(self.engine.context)
            self.vocab_size = self.engine.vocab_size
            self.eos = set(self.tokenizer.eos_token_ids)
            self.replay = Replay(self.tokenizer, self.replay_limit)
            self.prefix = self._prefix_cache()
        except BaseException as error:  # reported by main(); the thread has nothing else to do
            self.load_error = error
            self.ready.set()
            return
        self.ready.set()
        while True:
            self._take(block=not (self.waiting or self.prefilling or self.decoding))
            if self.stopping.is_set():
                break
            self._drop_cancelled()
            self._admit()
            if self.prefilling:
                self._prefill_chunk()
            if self.decoding:
                self._decode_step()
        self._refuse_everything()
        if self.prefix is not None and self.prefix.disk is not None:
            self.prefix.disk.flush()   # no file is left half written when the process exits

    def _prefix_cache(self) -> Optional[PrefixCache]:
        options = self.cache_options
        if not options.enabled:
            return None
        disk = None
        if options.disk_dir:
            from .disk_cache import DiskTier

            disk = DiskTier(options.disk_dir, options.disk_bytes, self.engine.fingerprint,
                            self.engine.load_cache, self.replay)
        return PrefixCache(self.engine, options.memory_bytes, disk)

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
        """Cancel the running jobs, refuse the queued ones and wait until none runs; False if
        the model is still loading or a step did not end within `timeout`."""
        self.begin_stop()
        if not self.ready.is_set():
            return False
        return self.finished.wait(timeout)

    def begin_stop(self) -> None:
        """stop() without waiting (from a signal handler)."""
        with self._submitting:
            self.stopping.set()
            self.jobs.put(None)

    def snapshot(self) -> dict:
        with self._stats_lock:
            out = json.loads(json.dumps(self.stats))
        out["active"] = len(self.prefilling) + len(self.decoding)
        out["waiting"] = len(self.waiting)
        if self.prefix is not None:
            out["prefix_cache"] = self.prefix.stats()
        if self.replay is not None:
            out["replay_records"] = len(self.replay)
        drafted = getattr(self.engine, "draft_stats", None)   # speculation of lone sessions (--draft)
        if drafted is not None:
            out["draft"] = drafted.numbers()
        return out

    # --- one turn of the loop --------------------------------------------------------------

    def _take(self, block: bool) -> None:
        while True:
            try:
                job = self.jobs.get(block=block)
            except queue.Empty:
                return
            if job is not None:
                self.waiting.append(job)
            block = False

    def _drop_cancelled(self) -> None:
        for job in [j for j in self.waiting if j.cancelled.is_set()]:
            self.waiting.remove(job)   # never started: nothing to record
        for session in [s for s in (*self.prefilling, *self.decoding) if s.job.cancelled.is_set()]:
            self._finish(session, session.job.stop_reason)

    def _admit(self) -> None:
        while self.waiting and len(self.prefilling) + len(self.decoding) < self.max_sessions:
            job = self.waiting.popleft()
            room = self.max_context - len(job.tokens)
            if room <= 0:
                job.events.put(("error", RequestError(
                    f"the prompt has {len(job.tokens)} tokens; this server's context is {self.max_context} "
                    f"tokens and generation needs at least one more", param=job.prompt_param,
                    code="context_length_exceeded")))
                continue
            try:
                cache, cached = (self.prefix.lookup(job.tokens) if self.prefix is not None
                                 else (self.engine.new_cache(), 0))
            except Exception as error:
                self._fail(job, error)
                continue
            session = Session(job, cache, cached, min(job.max_tokens, room), self.tokenizer.detokenizer)
            if session.constraint is None and not job.sampling.penalized:
                # speculation samples by itself: no grammar mask, no penalty counts to hand back
                session.window = self.engine.draft_window(cache)
            job.events.put(("start", {"prompt_tokens": len(job.tokens), "cached_tokens": cached}))
            self.prefilling.append(session)

    def _prefill_chunk(self) -> None:
        session = self.prefilling[0]
        chunk, session.todo = session.todo[:self.prefill_chunk], session.todo[self.prefill_chunk:]
        try:
            logits = self.engine.prefill(session.cache, chunk, session.window)
            if session.todo:
                self.prefilling.rotate(-1)   # round robin: the next prompt's turn
                return
            if self.prefix is not None:   # on disk only if the answer's entry cannot stand for it
                self.prefix.insert(session.job.tokens, session.cache, session.job.replayed, persist=False)
            token = self._sample([session], logits[None])[0]
        except Exception as error:
            self.prefilling.remove(session)
            self._fail(session.job, error)
            return
        self.prefilling.remove(session)
        self.decoding.append(session)
        self._emit(session, token)

    def _decode_step(self) -> None:
        sessions = list(self.decoding)
        try:
            if len(sessions) == 1 and sessions[0].drafts:
                tokens = [self._speculate(sessions[0])]
            else:
                for session in sessions:
                    session.window = None
                logits = self._queued(sessions)
                if logits is None:
                    logits = self.engine.decode([s.cache for s in sessions], [s.produced[-1] for s in sessions])
                picks = self._picks(sessions, logits)
                self._run_ahead(sessions, picks)
                tokens = self._tokens(sessions, picks)
        except Exception as error:   # a failed step leaves every cache in it in doubt
            self._ahead = None
            self.engine.forget()
            for session in sessions:
                self.decoding.remove(session)
                self._fail(session.job, error)
            return
        with self._stats_lock:
            self.stats["decode_steps"] += 1
            self.stats["decoded_tokens"] += len(sessions)
            self.stats["largest_batch"] = max(self.stats["largest_batch"], len(sessions))
        for session, token in zip(sessions, tokens):
            self._emit(session, token)

    def _speculate(self, session: Session) -> int:
        if session.rng is not None:
            mx.random.seed(int(session.rng.integers(1 << 63)))
        return self.engine.speculate(session.cache, session.window, session.produced[-1], session.job.sampling,
                                     session.limit - len(session.produced) + 1)

    def _queued(self, sessions: list[Session]) -> Optional[mx.array]:
        """The logits of the step queued for this lone session, if one was (else None; a step
        queued for a session that is no longer alone is dropped)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if len(sessions) == 1 and ahead[0] is sessions[0]:
            return ahead[1]
        self.engine.drop_ahead(ahead[0].cache)
        return None

    def _run_ahead(self, sessions: list[Session], picks: list[mx.array]) -> None:
        """Queue a lone session's next step on its token still on the device, so that the GPU
        runs it while this thread samples, detokenizes and streams (not for a grammar, which
        needs the token on the host first, nor past the last token)."""
        session = sessions[0]
        if (len(sessions) == 1 and session.constraint is None and self.engine.runs_ahead
                and len(session.produced) + 1 < session.limit):
            self._ahead = (session, self.engine.decode([session.cache], picks[0].reshape(1)))
            mx.async_eval(self._ahead[1])

    def _sample(self, sessions: list[Session], logits: mx.array) -> list[int]:
        """One token per session from its row of logits [B, V], each by its own sampler."""
        return self._tokens(sessions, self._picks(sessions, logits))

    def _picks(self, sessions: list[Session], logits: mx.array) -> list[mx.array]:
        """Each session's token [1], sampled on the device, not yet evaluated."""
        picks = []
        for i, session in enumerate(sessions):
            row = logits[i:i + 1]
            if session.constraint is not None:
                row = session.constraint.mask(row)
            if session.rng is not None:
                mx.random.seed(int(session.rng.integers(1 << 63)))
            picks.append(session.sampler(row))
        return picks

    def _tokens(self, sessions: list[Session], picks: list[mx.array]) -> list[int]:
        mx.eval(picks)
        tokens = [int(p.item()) for p in picks]
        for session, token in zip(sessions, tokens):
            if session.constraint is not None:
                session.constraint.advance(token)
        return tokens

    def _emit(self, session: Session, token: int) -> None:
        session.produced.append(token)
        end = token in self.eos
        if not end:
            session.detok.add_token(token)
        finish = "stop" if end else ("length" if len(session.produced) == session.limit else None)
        if finish:
            session.detok.finalize()
        session.job.events.put(("token", session.detok.last_segment, not end))
        if finish:
            self._finish(session, finish)

    # --- the end of a session ----------------------------------------------------------------

    def _finish(self, session: Session, finish: str) -> None:
        job = session.job
        if session in self.decoding:
            self.decoding.remove(session)
        else:
            self.prefilling.remove(session)
        if self._ahead is not None and self._ahead[0] is session:   # its last token is not fed
            self._ahead = None
            self.engine.drop_ahead(session.cache)
        self.engine.settle(session.cache)
        replay = []
        if job.mode is not None and finish in ("stop", "length") and not job.cancelled.is_set():
            replay = self.replay.records(session.produced, job.mode)
            self.replay.remember(replay)
        held = session.held()
        if self.prefix is not None and len(held) > session.cached:
            try:
                self.prefix.insert(held, session.cache, job.replayed + replay)
                self.prefix.persist(job.tokens, job.replayed)
            except Exception:   # a cache that cannot be kept is not worth failing the answer for
                traceback.print_exc()
        self._record(session, finish)
        job.events.put(("end", finish))   # after the stats, so a client that saw the end sees them

    def _record(self, session: Session, finish: str) -> None:
        job = session.job
        completion = sum(t not in self.eos for t in session.produced)
        prefilled = len(job.tokens) - session.cached - len(session.todo)
        with self._stats_lock:
            s = self.stats
            s["requests"] += 1
            s["cancelled"] += finish == "cancelled"
            s["prompt_tokens"] += len(job.tokens)
            s["cached_tokens"] += session.cached
            s["completion_tokens"] += completion
            s["last"] = {"prompt_tokens": len(job.tokens), "cached_tokens": session.cached,
                         "prefilled_tokens": prefilled, "completion_tokens": completion,
                         "finish_reason": finish}

    def _fail(self, job: Job, error: Exception) -> None:
        if isinstance(error, self.fatal):
            job.events.put(("error", RequestError(f"the server stopped: {error}", status=503, kind="server_error")))
            if self.fatal_error is None:
                self.fatal_error = error
                self.on_fatal()
            return
        if isinstance(error, InputError):   # what the request checks could not know
            job.events.put(("error", RequestError(str(error))))
            return
        traceback.print_exc()
        job.events.put(("error", RequestError(f"generation failed: {error}", status=500, kind="server_error")))

    def _refuse_everything(self) -> None:
        """Stopping: every session is cancelled (and counted so), every waiting job refused."""
        for session in (*self.prefilling, *self.decoding):
            self._record(session, "cancelled")
            session.job.events.put(("error", shutting_down()))
        self.prefilling.clear()
        self.decoding.clear()
        self._take(block=False)
        for job in self.waiting:
            job.events.put(("error", shutting_down()))
        self.waiting.clear()
