"""The engine thread: continuous batching of generation requests over one Model.

The asyncio side calls `Engine.submit` (never blocks) and reads `TokenEvent`s from the
returned handle's asyncio queue; everything that touches the model runs on the engine's
own thread, one step at a time:

    1. finish requests that were cancelled (client gone) or ran past their deadline;
    2. admit waiting requests, in arrival order, up to max_concurrent_sequences, and run
       each one's prefill (the prompt, chunked by the model) and first token;
    3. one batched decode step (`Model.forward_batch`) for every running sequence: the
       union of their experts is acquired once per MoE layer;
    4. sample each row with the request's own seeded sampler, detokenize, emit.

A row's logits do not depend on what else shares its step (the kernels are row-wise
with a fixed reduction order), and each request has its own sampler, so a request's
tokens are the same alone or in company. A cancelled request stops before the next
step it would have taken part in. Work that must not race the forward pass (usage
flushes, stats snapshots, provider swaps) runs between steps through `call`.

Time is `clock()` seconds (monotonic). finish_reason values: "stop" (EOS or a stop
string), "length" (max_tokens or the context), "timeout", "cancelled", "error".
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from ext.models.model import PREFILL_CHUNK, Model, Sequence
from ext.sampling import Sampler, SamplingParams
from ext.tokenizer import StreamDecoder, Tokenizer
from scheduler.cache import PHASE_DECODE, PHASE_PREFILL
from telemetry.logs import get_logger

log = get_logger("engine")

RATE_WINDOW_S = 10.0   # tokens_per_second averages the decode steps of this many seconds


class QueueFullError(RuntimeError):
    """max_queue requests are already waiting."""


class EngineClosedError(RuntimeError):
    """The engine is draining or stopped and accepts no new requests."""


@dataclass(frozen=True)
class EngineRequest:
    """One generation to run.

    prompt_ids: the prompt, ids in [0, vocab_size), at least one, leaving room for one
    new token in the context. max_tokens: >= 1 (capped by the context). stop_ids: token
    ids that end generation (not emitted); empty with ignore_eos. stop_strings: texts
    that end generation (not emitted). deadline: clock() time after which the request
    ends with finish_reason "timeout" (None: no limit).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    deadline: float | None = None


@dataclass
class RequestStats:
    """What one request cost, for its response's usage and its log line.

    Times in seconds (clock): queue_s from submit to admission (to the end for a request
    that never left the queue), time_to_first_token_s from submit to the first token,
    duration_s from submit to the end. Expert figures
    are those of the steps the request took part in (a step shared by several requests
    counts for each). steps_after_cancel: steps it took part in after `cancel`.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float = 0.0
    time_to_first_token_s: float | None = None
    duration_s: float = 0.0
    decode_steps: int = 0
    steps_after_cancel: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    expert_bytes_read: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """Output of one step for one request: `text` is new text ("" possible).

    The last event of a request has finish_reason set (and error for "error") and
    carries the final stats.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    stats: RequestStats | None = None


class RequestHandle:
    """The asyncio side of a submitted request: read `events`, call `cancel` to stop it.

    events: an asyncio.Queue of TokenEvent, filled from the engine thread through the
    loop given to `submit`; it ends with an event whose finish_reason is set.
    """

    def __init__(self, request: EngineRequest, loop: asyncio.AbstractEventLoop, submitted: float):
        self.request = request
        self.events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._loop = loop
        self._cancel = threading.Event()
        self.submitted = submitted
        self.stats = RequestStats(prompt_tokens=len(request.prompt_ids))
        self.finished = False
        self.finish_reason: str | None = None
        self.endpoint = "other"          # set by the server: the route's name

    def cancel(self) -> None:
        """Ask the engine to stop this request before its next step (thread-safe)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _emit(self, event: TokenEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass
class _Running:
    handle: RequestHandle
    seq: Sequence
    sampler: Sampler
    decoder: StreamDecoder
    max_tokens: int
    last_token: int = 0
    held: str = ""                  # text withheld: it may be the start of a stop string
    pending_ids: list[int] = field(default_factory=list)   # tokens whose text is not out yet
    generated: int = 0
    last_token_at: float | None = None   # clock() when the previous token was sampled


@dataclass
class EngineStats:
    """A snapshot for /v1/moed/stats, /metrics and the STATUS line (counts and rates).

    generated_tokens: rows of decode steps; completion_tokens: tokens returned to
    clients (prefill's first tokens included); prompt_tokens: prompt tokens of admitted
    requests. decode_io_wait_seconds: time of decode steps spent waiting for expert
    reads (the provider's io_wait_s); decode_compute_seconds: the rest of their time.
    """

    running: int
    waiting: int
    requests_total: int
    decode_steps: int
    generated_tokens: int
    tokens_per_second: float
    max_concurrent_sequences: int
    max_queue: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_io_wait_seconds: float = 0.0
    decode_compute_seconds: float = 0.0


@dataclass
class _Rate:
    """Tokens per second over the last RATE_WINDOW_S seconds of decode steps."""

    window: collections.deque = field(default_factory=collections.deque)

    def add(self, now: float, tokens: int) -> None:
        self.window.append((now, tokens))
        while self.window and now - self.window[0][0] > RATE_WINDOW_S:
            self.window.popleft()

    def value(self, now: float) -> float:
        recent = [(t, n) for t, n in self.window if now - t <= RATE_WINDOW_S]
        if len(recent) < 2:
            return 0.0
        span = recent[-1][0] - recent[0][0]
        return sum(n for _, n in recent[1:]) / span if span > 0 else 0.0


class Engine:
    """Runs generation requests on `model` from one thread, batching their decode steps.

    model: a loaded Model (owned by the engine thread once `start` is called).
    tokenizer: for the incremental detokenization of each request.
    max_concurrent_sequences: 1..PREFILL_CHUNK sequences decoded together.
    max_queue: requests that may wait for a place (>= 0).
    on_finish: called as on_finish(handle) on the engine thread when a request ends
        (its stats and finish_reason are final): the canonical log line.
    on_decode_step: called with each decode step's duration (seconds); on_token_gap:
        with the time between two consecutive tokens of one request (engine thread).
    Raises ValueError for limits out of range.
    """

    def __init__(self, model: Model, tokenizer: Tokenizer, *, max_concurrent_sequences: int = 4,
                 max_queue: int = 64, clock: Callable[[], float] = time.monotonic,
                 on_finish: Callable[[RequestHandle], None] | None = None,
                 on_decode_step: Callable[[float], None] | None = None,
                 on_token_gap: Callable[[float], None] | None = None):
        self.model = model
        self.on_finish = on_finish
        self.on_decode_step = on_decode_step
        self.on_token_gap = on_token_gap
        # Called as observer(seconds, batch_size) after each decode step (engine thread):
        # the live tuner's measurements.
        self.step_observers: list[Callable[[float, int], None]] = []
        self.tokenizer = tokenizer
        self.clock = clock
        self._cond = threading.Condition()
        self.set_limits(max_concurrent_sequences, max_queue)
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._running: list[_Running] = []
        self._calls: collections.deque[tuple[Callable[[], object], Future]] = collections.deque()
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self.requests_total = 0
        self.decode_steps = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.decode_io_wait_seconds = 0.0
        self.decode_compute_seconds = 0.0
        self._rate = _Rate()

    # ------------------------------------------------------------ the asyncio side

    def set_limits(self, max_concurrent_sequences: int, max_queue: int) -> None:
        """Change the limits (live; a lower limit lets running requests finish)."""
        if not 1 <= max_concurrent_sequences <= PREFILL_CHUNK:
            raise ValueError(f"max_concurrent_sequences must be in [1, {PREFILL_CHUNK}], "
                             f"got {max_concurrent_sequences}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        with self._cond:
            self.max_concurrent_sequences = max_concurrent_sequences
            self.max_queue = max_queue
            self._cond.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="moed-engine", daemon=True)
        self._thread.start()

    def submit(self, request: EngineRequest, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        """Queue `request`; its events arrive on the returned handle through `loop`.

        Raises QueueFullError (max_queue waiting and no free place), EngineClosedError
        (draining or stopped), ValueError (empty prompt, max_tokens < 1, prompt that
        leaves no room in the context, an id out of range).
        """
        context = self.model.config.max_position_embeddings
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if len(request.prompt_ids) >= context:
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens leaves no room in the "
                             f"context of {context} tokens")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        handle = RequestHandle(request, loop, self.clock())
        with self._cond:
            if not self._accepting:
                raise EngineClosedError("moed is shutting down")
            free = self.max_concurrent_sequences - len(self._running)
            if len(self._waiting) >= self.max_queue + max(0, free):
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (max_queue "
                                     f"{self.max_queue})")
            self._waiting.append(handle)
            self.requests_total += 1
            self._idle.clear()
            self._cond.notify()
        return handle

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn() on the engine thread between two steps; a Future of its result."""
        future: Future = Future()
        with self._cond:
            if self._stopping and self._thread is None:
                future.set_exception(EngineClosedError("engine stopped"))
                return future
            self._calls.append((fn, future))
            self._cond.notify()
        if self._thread is None:      # not started: nothing races the model
            self._run_calls()
        return future

    def stop_accepting(self) -> None:
        """Draining: new submits get EngineClosedError; queued and running ones go on."""
        with self._cond:
            self._accepting = False

    def cancel_all(self) -> None:
        """Cancel every waiting and running request (they end with "cancelled")."""
        with self._cond:
            for h in list(self._waiting) + [r.handle for r in self._running]:
                h.cancel()
            self._cond.notify()

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until nothing waits or runs (True) or `timeout` seconds pass (False)."""
        return self._idle.wait(timeout)

    def stop(self) -> None:
        """Stop the thread after the current step (run cancel_all first to end requests)."""
        with self._cond:
            self._stopping = True
            self._accepting = False
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._run_calls()

    def stats(self) -> EngineStats:
        with self._cond:
            return EngineStats(running=len(self._running), waiting=len(self._waiting),
                               requests_total=self.requests_total, decode_steps=self.decode_steps,
                               generated_tokens=self.generated_tokens,
                               tokens_per_second=self._rate.value(self.clock()),
                               max_concurrent_sequences=self.max_concurrent_sequences,
                               max_queue=self.max_queue, prompt_tokens=self.prompt_tokens,
                               completion_tokens=self.completion_tokens,
                               decode_io_wait_seconds=self.decode_io_wait_seconds,
                               decode_compute_seconds=self.decode_compute_seconds)

    # ------------------------------------------------------------ the engine thread

    def _main(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._running or self._calls):
                    self._idle.set()
                    self._cond.wait()
                if self._stopping:
                    break
            self._run_calls()
            try:
                self._reap()
                self._admit()
                if self._running:
                    self._decode_step()
            except Exception as e:  # a bug: fail what was running, keep serving the rest
                log.exception("engine_step_crashed")
                self._fail(list(self._running), e)
            with self._cond:
                if not self._running and not self._waiting:
                    self._idle.set()

    def _run_calls(self) -> None:
        while True:
            with self._cond:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # handed to the caller
                    future.set_exception(e)

    def _reap(self) -> None:
        """End requests that were cancelled or passed their deadline, waiting or running."""
        now = self.clock()
        with self._cond:
            for h in [h for h in self._waiting if h.cancelled or _late(h, now)]:
                self._waiting.remove(h)
                h.stats.queue_s = now - h.submitted
                self._finish_handle(h, "cancelled" if h.cancelled else "timeout", now)
        for r in [r for r in self._running if r.handle.cancelled or _late(r.handle, now)]:
            self._finish(r, "cancelled" if r.handle.cancelled else "timeout")

    def _admit(self) -> None:
        while True:
            with self._cond:
                if not self._waiting or len(self._running) >= self.max_concurrent_sequences:
                    return
                handle = self._waiting.popleft()
            now = self.clock()
            handle.stats.queue_s = now - handle.submitted
            if handle.cancelled or _late(handle, now):   # gone while it waited: no prefill
                self._finish_handle(handle, "cancelled" if handle.cancelled else "timeout", now)
                continue
            self._prefill(handle)

    def _prefill(self, handle: RequestHandle) -> None:
        req = handle.request
        context = self.model.config.max_position_embeddings
        max_tokens = min(req.max_tokens, context - len(req.prompt_ids))
        seq = self.model.new_sequence(capacity=len(req.prompt_ids) + min(max_tokens, 1024))
        r = _Running(handle, seq, Sampler(req.sampling), self.tokenizer.stream_decoder(), max_tokens)
        before = self._expert_counters()
        ids = np.asarray(req.prompt_ids, np.int64)
        self.prompt_tokens += ids.size
        self._set_phase(PHASE_PREFILL)
        try:
            # Chunk by chunk (the logits do not depend on the chunking), so that a client
            # that leaves during a long prompt stops it within one chunk.
            for start in range(0, ids.size, PREFILL_CHUNK):
                if handle.cancelled:
                    handle.stats.steps_after_cancel += 1
                    self._charge([r], before)
                    self._finish_handle(handle, "cancelled", self.clock())
                    return
                logits = self.model.forward(seq, ids[start:start + PREFILL_CHUNK])
        except (OSError, ValueError) as e:
            self._fail([r], e)
            return
        self._charge([r], before)
        with self._cond:
            self._running.append(r)
        self._sample(r, logits[-1])

    def _decode_step(self) -> None:
        rows = list(self._running)
        try:
            self._step(rows)
        except (OSError, ValueError) as e:
            if len(rows) == 1:
                self._fail(rows, e)
                return
            # A read error (or NaN weights) of one row's experts must not fail its step
            # mates: run each row alone. Nothing was committed — a KV cache only grows at
            # the end of a step — and a row's logits do not depend on its company.
            log.warning("engine_batch_failed_retrying_alone", rows=len(rows), error=str(e))
            for r in rows:
                try:
                    self._step([r])
                except (OSError, ValueError) as e_row:
                    self._fail([r], e_row)

    def _step(self, rows: list[_Running]) -> None:
        """One forward over `rows` (their last tokens), then sample each row."""
        before = self._expert_counters()
        self._set_phase(PHASE_DECODE)
        start, wait_before = self.clock(), self._io_wait_s()
        logits = self.model.forward_batch([r.seq for r in rows], [r.last_token for r in rows])
        now = self.clock()
        self._charge(rows, before)
        wait = max(0.0, self._io_wait_s() - wait_before)
        self.decode_steps += 1
        self.generated_tokens += len(rows)
        self.decode_io_wait_seconds += wait
        self.decode_compute_seconds += max(0.0, now - start - wait)
        self._rate.add(now, len(rows))
        if self.on_decode_step is not None:
            self.on_decode_step(now - start)
        for r, row in zip(rows, logits):
            r.handle.stats.decode_steps += 1
            if r.handle.cancelled:            # the client left while this step ran
                r.handle.stats.steps_after_cancel += 1
                self._finish(r, "cancelled")
                continue
            self._sample(r, row)
        # After the step is committed and sampled: an observer (the live tuner) may run the
        # model itself, and its failure must never fail or repeat the step it measured.
        for observe in self.step_observers:
            try:
                observe(now - start, len(rows))
            except Exception:
                log.exception("step_observer_failed")

    def _sample(self, r: _Running, logits: np.ndarray) -> None:
        """`_take_token`, failing only this request when its logits are unusable."""
        try:
            self._take_token(r, logits)
        except ValueError as e:                    # NaN / inf logits: corrupt weights
            self._fail([r], ValueError(f"request {r.handle.request.request_id}: {e}"))

    def _take_token(self, r: _Running, logits: np.ndarray) -> None:
        """Sample the next token of `r` from its logits; emit text or finish."""
        token = r.sampler.sample(logits)
        stats = r.handle.stats
        now, previous = self.clock(), r.last_token_at
        r.last_token_at = now
        if stats.time_to_first_token_s is None:
            stats.time_to_first_token_s = now - r.handle.submitted
        if token in r.handle.request.stop_ids:
            self._finish(r, "stop", flush=True)
            return
        if previous is not None and self.on_token_gap is not None:
            self.on_token_gap(now - previous)
        r.generated += 1
        stats.completion_tokens += 1
        self.completion_tokens += 1
        r.last_token = token
        r.pending_ids.append(token)
        text, stopped = self._stop_strings(r, r.held + r.decoder.step(token))
        if stopped:
            r.handle._emit(TokenEvent(text, tuple(r.pending_ids)))
            r.held, r.pending_ids = "", []
            self._finish(r, "stop", flush=False)   # what follows a stop string is not output
            return
        if text:
            r.handle._emit(TokenEvent(text, tuple(r.pending_ids)))
            r.pending_ids = []
        if r.generated >= r.max_tokens:
            self._finish(r, "length")

    def _stop_strings(self, r: _Running, text: str) -> tuple[str, bool]:
        """Split pending text at a stop string: (text to emit, stopped?); keeps back a
        tail that could still become a stop string in r.held."""
        stops = r.handle.request.stop_strings
        if not stops:
            return text, False
        hits = [text.find(s) for s in stops if s and s in text]
        if hits:
            return text[: min(hits)], True
        keep = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        r.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def _finish(self, r: _Running, reason: str, flush: bool | None = None) -> None:
        """End a running request; flush: emit the text still held back (default: unless
        it was cancelled or failed)."""
        with self._cond:
            if r in self._running:
                self._running.remove(r)
        if flush is None:
            flush = reason not in ("cancelled", "error")
        tail = r.held + r.decoder.finish() if flush else ""
        self._finish_handle(r.handle, reason, self.clock(), tail, token_ids=tuple(r.pending_ids))

    def _finish_handle(self, handle: RequestHandle, reason: str, now: float, text: str = "",
                       error: str | None = None, token_ids: tuple[int, ...] = ()) -> None:
        if handle.finished:
            return
        handle.finished = True
        handle.finish_reason = reason
        handle.stats.duration_s = now - handle.submitted
        handle._emit(TokenEvent(text, token_ids, finish_reason=reason, error=error, stats=handle.stats))
        if self.on_finish is not None:
            try:
                self.on_finish(handle)
            except Exception:  # a logging hook must never stop the engine
                log.exception("on_finish_hook_failed")

    def _fail(self, rows: list[_Running], e: BaseException) -> None:
        """A step failed (a read error, a bad input): its requests end, the engine goes on."""
        log.error("engine_step_failed", requests=[r.handle.request.request_id for r in rows], error=str(e))
        now = self.clock()
        for r in rows:
            with self._cond:
                if r in self._running:
                    self._running.remove(r)
            self._finish_handle(r.handle, "error", now, error=str(e))

    def _set_phase(self, phase: str) -> None:
        """Tell the expert provider (when it counts per phase) what the next forward is."""
        if hasattr(self.model.experts, "phase"):
            self.model.experts.phase = phase

    def _io_wait_s(self) -> float:
        return getattr(self.model.experts, "io_wait_s", 0.0)

    def _expert_counters(self) -> tuple[int, int, int]:
        counters = getattr(self.model.experts, "counters", None)
        return counters() if counters is not None else (0, 0, 0)

    def _charge(self, rows: list[_Running], before: tuple[int, int, int]) -> None:
        hits, misses, nbytes = (a - b for a, b in zip(self._expert_counters(), before))
        for r in rows:
            s = r.handle.stats
            s.expert_hits += hits
            s.expert_misses += misses
            s.expert_bytes_read += nbytes


def _late(handle: RequestHandle, now: float) -> bool:
    deadline = handle.request.deadline
    return deadline is not None and now > deadline
