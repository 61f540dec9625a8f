"""The engine thread: continuous batching of generation requests over one Model.

The asyncio side calls `Engine.submit` (never blocks) and reads `TokenEvent`s from the
returned handle's asyncio queue; everything that touches the model runs on the engine's
own thread, one step at a time:

    1. finish requests that were cancelled (client gone) or ran past their deadline;
    2. admit waiting requests, in arrival order, while places are free (a request of n
       choices takes n places); an admitted prompt starts from the KV blocks the prefix
       cache holds for its first tokens;
    3. one step (`Model.forward_step`): a row for every decoding sequence, and beside
       them the next chunk of each prompt still being prefilled, within a token budget
       (daemon/engine/steps.py); the union of the rows' experts is acquired once per MoE layer;
    4. sample each decode row, and each prompt whose last chunk ran, with the choice's
       own seeded sampler (its logit bias, penalties and grammar), detokenize, emit.

Which rows go into a step, and how large a prompt's chunk is beside decodes, is the step
scheduler's (daemon/engine/steps.py: chunked prefill within a budget measured from step
times).

A row's logits do not depend on what else shares its step (the kernels are row-wise
with a fixed reduction order), and each choice has its own sampler, so a request's
tokens are the same alone or in company, prefilled at once or in chunks, with or without
reused prefix blocks. A cancelled request stops before the next step it would have taken
part in. Work that must not race the forward pass (usage flushes, stats snapshots,
provider swaps) runs between steps through `call`.

Time is `clock()` seconds (monotonic). finish_reason values: "stop" (EOS, a stop string,
or a grammar that is complete), "length" (max_tokens or the context), "timeout",
"cancelled", "error".
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from daemon.engine.prefix_cache import PrefixCache, PrefixCacheStats
from daemon.engine.steps import PREFILL_STEP_RATIO, StepScheduler
from ext.models.model import PREFILL_CHUNK, Model, Sequence
from ext.sampling import Sampler, SamplingParams, logprobs
from ext.tokenizer import StreamDecoder, Tokenizer
from scheduler.cache import PHASE_DECODE, PHASE_PREFILL
from telemetry.logs import get_logger

log = get_logger("engine")

RATE_WINDOW_S = 10.0   # tokens_per_second averages the decode steps of this many seconds


class QueueFullError(RuntimeError):
    """max_queue requests are already waiting."""


class EngineClosedError(RuntimeError):
    """The engine is draining or stopped and accepts no new requests."""


class Constraint(Protocol):
    """A grammar over one choice's output tokens (ext.grammar builds them).

    mask(): a [V] bool array of the tokens allowed next (V the model's vocab_size).
    accept(token): the token sampled; done(): the grammar is complete (the answer
    ends, finish_reason "stop"). Errors are ValueError.
    """

    def mask(self) -> np.ndarray: ...

    def accept(self, token: int) -> None: ...

    def done(self) -> bool: ...


@dataclass(frozen=True)
class EngineRequest:
    """One generation to run.

    prompt_ids: the prompt, ids in [0, vocab_size), at least one, leaving room for one
    new token in the context. max_tokens: >= 1 per choice (capped by the context).
    stop_ids: token ids that end generation (not emitted); empty with ignore_eos.
    stop_strings: texts that end generation (not emitted). deadline: clock() time after
    which the request ends with finish_reason "timeout" (None: no limit). n: choices,
    sampled from one prefill; choice i samples with seed + i (when a seed is given).
    logprobs: None, or how many alternatives (>= 0) to report beside each token's own
    log-probability. constraint: None, or a factory of one `Constraint` per choice.
    cache_salt: None, or a hashable (the request's cache_salt, with its client's identity
    under prefix_cache_scope "client"): only requests of the same cache_salt share prefix
    cache blocks (daemon/engine/prefix_cache.py). special_tokens: the text holds the
    special tokens generated (stop ids excepted), as their text: the markup of GPT-OSS's
    harmony, which the answer's parser reads (daemon/api/harmony.py); else they are
    skipped.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    deadline: float | None = None
    n: int = 1
    logprobs: int | None = None
    constraint: Callable[[], Constraint] | None = None
    cache_salt: Hashable | None = None
    special_tokens: bool = False


@dataclass
class RequestStats:
    """What one request cost, for its response's usage and its log line.

    Times in seconds (clock): queue_s from submit to admission (to the end for a request
    that never left the queue), time_to_first_token_s from submit to the first token,
    duration_s from submit to the end. cached_tokens: prompt tokens whose KV came from
    the prefix cache; prefill_tokens: prompt tokens computed. Expert figures are those of
    the steps the request took part in (a step shared by several requests counts for
    each). steps_after_cancel: steps it took part in after `cancel`.
    completion_tokens adds up every choice's.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    queue_s: float = 0.0
    time_to_first_token_s: float | None = None
    duration_s: float = 0.0
    decode_steps: int = 0
    steps_after_cancel: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    expert_bytes_read: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """Output of one step for one choice (`index`): `text` is new text ("" possible).

    token_ids are the tokens whose text this is, and logprobs (when asked) theirs. The
    last event of a choice has finish_reason set (and error for "error"); the last event
    of the request (`last`) carries the final stats.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    stats: RequestStats | None = None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    last: bool = False
    stop_string: str | None = None      # on the last event of a choice a stop string ended


class RequestHandle:
    """The asyncio side of a submitted request: read `events`, call `cancel` to stop it.

    events: an asyncio.Queue of TokenEvent, filled from the engine thread through the
    loop given to `submit`; every choice ends with an event whose finish_reason is set,
    and the request with one whose `last` is set.
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
        self.open_choices = request.n
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
    """One choice of an admitted request: prefilling while prefilled < len(prompt)."""

    handle: RequestHandle
    seq: Sequence
    sampler: Sampler
    decoder: StreamDecoder
    max_tokens: int
    prompt: np.ndarray                 # [P] int64
    index: int = 0
    prefilled: int = 0                 # prompt positions in the KV cache
    constraint: Constraint | None = None
    fed: list[int] = field(default_factory=list)   # generated tokens in the KV cache
    last_token: int = 0
    held: str = ""                  # text withheld: it may be the start of a stop string
    stop_string: str | None = None  # the stop string that ended it, if one did
    pending_ids: list[int] = field(default_factory=list)   # tokens whose text is not out yet
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    generated: int = 0
    last_token_at: float | None = None   # clock() when the previous token was sampled

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt.size


@dataclass
class EngineStats:
    """A snapshot for /v1/moed/stats, /metrics and the STATUS line (counts and rates).

    generated_tokens: decode rows of steps; completion_tokens: tokens returned to
    clients (prefill's first tokens included); prompt_tokens: prompt tokens of admitted
    requests, of which prefill_tokens were computed (the rest came from the prefix
    cache). decode_io_wait_seconds: time of steps with decode rows spent waiting for
    expert reads (the provider's io_wait_s); decode_compute_seconds: the rest of it.
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
    prefill_tokens: int = 0
    decode_io_wait_seconds: float = 0.0
    decode_compute_seconds: float = 0.0
    prefix_cache: PrefixCacheStats = PrefixCacheStats()


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
    """Runs generation requests on `model` from one thread, batching their steps.

    model: a loaded Model (owned by the engine thread once `start` is called).
    tokenizer: for the incremental detokenization of each request.
    max_concurrent_sequences: 1..PREFILL_CHUNK sequences (choices) run together.
    max_queue: requests that may wait for a place (>= 0).
    prefix_cache_bytes: bytes of KV blocks kept for reuse by requests that share a
        prefix (0: no prefix caching). context_tokens: the most tokens (prompt and
        completion) one sequence holds, at most the model's (None: the model's); a
        sequence's KV cache never grows past it. prefill_step_ratio: > 1; a step with prefill rows
        beside decode rows aims at this multiple of a decode step's time (inf: prompts
        first, such a step takes the whole prefill chunk).
    on_finish: called as on_finish(handle) on the engine thread when a request ends
        (its stats and finish_reason are final): the canonical log line.
    on_decode_step: called with the duration (seconds) of each step with decode rows;
        on_token_gap: with the time between two consecutive tokens of one choice.
    Raises ValueError for limits out of range.
    """

    def __init__(self, model: Model, tokenizer: Tokenizer, *, max_concurrent_sequences: int = 4,
                 max_queue: int = 64, prefix_cache_bytes: int = 0,
                 context_tokens: int | None = None,
                 prefill_step_ratio: float = PREFILL_STEP_RATIO,
                 clock: Callable[[], float] = time.monotonic,
                 on_finish: Callable[[RequestHandle], None] | None = None,
                 on_decode_step: Callable[[float], None] | None = None,
                 on_token_gap: Callable[[float], None] | None = None):
        self.scheduler = StepScheduler(getattr(model, "prefill_chunk", PREFILL_CHUNK), prefill_step_ratio)
        self.model = model
        model_context = model.config.max_position_embeddings
        if context_tokens is not None and not 1 <= context_tokens <= model_context:
            raise ValueError(f"context_tokens must be in [1, {model_context}], got {context_tokens}")
        self.context_tokens = context_tokens or model_context
        self.on_finish = on_finish
        self.on_decode_step = on_decode_step
        self.on_token_gap = on_token_gap
        # Called as observer(seconds, batch_size) after each step of decode rows only
        # (engine thread): the live tuner's measurements.
        self.step_observers: list[Callable[[float, int], None]] = []
        self.tokenizer = tokenizer
        self.clock = clock
        self.prefix_cache = PrefixCache(model.attention.kv_bytes_per_token(model.config),
                                        prefix_cache_bytes)
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
        self.prefill_tokens = 0
        self.completion_tokens = 0
        self.decode_io_wait_seconds = 0.0
        self.decode_compute_seconds = 0.0
        self._rate = _Rate()

    @property
    def prefill_step_ratio(self) -> float:
        """The step scheduler's ratio (settable live; ValueError unless > 1; inf: prompts first)."""
        return self.scheduler.ratio

    @prefill_step_ratio.setter
    def prefill_step_ratio(self, value: float) -> None:
        self.scheduler.ratio = value

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
        leaves no room in the context, an id out of range, n outside
        [1, max_concurrent_sequences]).
        """
        context = self.context_tokens
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
            if not 1 <= request.n <= self.max_concurrent_sequences:
                raise ValueError(f"n must be in [1, {self.max_concurrent_sequences}] (the "
                                 f"sequences decoded together), got {request.n}")
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
            return EngineStats(running=len({id(r.handle) for r in self._running}),
                               waiting=len(self._waiting),
                               requests_total=self.requests_total, decode_steps=self.decode_steps,
                               generated_tokens=self.generated_tokens,
                               tokens_per_second=self._rate.value(self.clock()),
                               max_concurrent_sequences=self.max_concurrent_sequences,
                               max_queue=self.max_queue, prompt_tokens=self.prompt_tokens,
                               completion_tokens=self.completion_tokens,
                               prefill_tokens=self.prefill_tokens,
                               decode_io_wait_seconds=self.decode_io_wait_seconds,
                               decode_compute_seconds=self.decode_compute_seconds,
                               prefix_cache=self.prefix_cache.stats())

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
                    self._step_all()
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
                self._finish_unstarted(h, "cancelled" if h.cancelled else "timeout", now)
        for r in [r for r in self._running if r.handle.cancelled or _late(r.handle, now)]:
            self._finish(r, "cancelled" if r.handle.cancelled else "timeout")

    def _admit(self) -> None:
        """Waiting requests become running sequences, in arrival order, while their
        choices fit; the prefix cache fills the start of each prompt's KV."""
        while True:
            with self._cond:
                if not self._waiting:
                    return
                handle = self._waiting[0]
                too_many = handle.request.n > self.max_concurrent_sequences   # lowered live
                if not too_many and len(self._running) + handle.request.n > self.max_concurrent_sequences:
                    return
                self._waiting.popleft()
            if too_many:
                self._finish_unstarted(handle, "error", self.clock(), error=(
                    f"n={handle.request.n} is over max_concurrent_sequences="
                    f"{self.max_concurrent_sequences}"))
                continue
            now = self.clock()
            handle.stats.queue_s = now - handle.submitted
            if handle.cancelled or _late(handle, now):   # gone while it waited: no prefill
                self._finish_unstarted(handle, "cancelled" if handle.cancelled else "timeout", now)
                continue
            req = handle.request
            context = self.context_tokens
            max_tokens = min(req.max_tokens, context - len(req.prompt_ids))
            seq = self.model.new_sequence(capacity=len(req.prompt_ids) + min(max_tokens, 1024),
                                      max_capacity=context)
            r = _Running(handle, seq, Sampler(req.sampling),
                         self.tokenizer.stream_decoder(req.special_tokens), max_tokens,
                         np.asarray(req.prompt_ids, np.int64))
            try:
                r.constraint = req.constraint() if req.constraint is not None else None
                r.prefilled = self.prefix_cache.load(req.prompt_ids, seq.kv, req.cache_salt)
            except ValueError as e:
                self._fail([r], e)
                continue
            handle.stats.cached_tokens = r.prefilled
            self.prompt_tokens += r.prompt.size
            with self._cond:
                self._running.append(r)

    def _step_all(self) -> None:
        """Plan one step (the step scheduler: decode rows, then prompt chunks within the
        budget) and run it; a failed step of several sequences is retried one sequence at
        a time."""
        rows = self.scheduler.plan(self._running)
        try:
            self._step(rows)
        except (OSError, ValueError) as e:
            if len(rows) == 1:
                self._fail([rows[0][0]], e)
                return
            # A read error (or NaN weights) of one row's experts must not fail its step
            # mates: run each row alone. Nothing was committed — a KV cache only grows at
            # the end of a step — and a row's logits do not depend on its company.
            log.warning("engine_batch_failed_retrying_alone", rows=len(rows), error=str(e))
            for row in rows:
                try:
                    self._step([row])
                except (OSError, ValueError) as e_row:
                    self._fail([row[0]], e_row)

    def _step(self, rows: list[tuple[_Running, np.ndarray]]) -> None:
        """One forward over `rows` (each a sequence and the tokens it continues with),
        then sample every decode row and every prompt whose last chunk ran."""
        before = self._expert_counters()
        prefill_rows = sum(t.size for r, t in rows if r.prefilling)
        decode_rows = sum(1 for r, _ in rows if not r.prefilling)
        self._set_phase(PHASE_PREFILL if prefill_rows else PHASE_DECODE)
        start, wait_before = self.clock(), self._io_wait_s()
        logits = self.model.forward_step([r.seq for r, _ in rows], [t for _, t in rows])
        now = self.clock()
        self._charge([r for r, _ in rows], before)
        seconds = now - start
        self.scheduler.observe(seconds, prefill_rows, decode_rows)
        if decode_rows:
            wait = max(0.0, self._io_wait_s() - wait_before)
            self.decode_steps += 1
            self.generated_tokens += decode_rows
            self.decode_io_wait_seconds += wait
            self.decode_compute_seconds += max(0.0, seconds - wait)
            self._rate.add(now, decode_rows)
            if self.on_decode_step is not None:
                self.on_decode_step(seconds)
        self.prefill_tokens += prefill_rows
        for (r, tokens), row in zip(rows, logits):
            prefill = r.prefilling
            if prefill:
                r.prefilled += tokens.size
                r.handle.stats.prefill_tokens += tokens.size
            else:
                r.fed.append(int(tokens[0]))
                r.handle.stats.decode_steps += 1
            if r.handle.cancelled:            # the client left while this step ran
                r.handle.stats.steps_after_cancel += 1
                self._finish(r, "cancelled")
            elif not prefill:
                self._sample(r, row)
            elif not r.prefilling:            # the prompt's last chunk ran
                self._prompt_done(r, row)
        # After the step is committed and sampled: an observer (the live tuner) may run the
        # model itself, and its failure must never fail or repeat the step it measured.
        if prefill_rows == 0:
            for observe in self.step_observers:
                try:
                    observe(seconds, decode_rows)
                except Exception:
                    log.exception("step_observer_failed")

    def _prompt_done(self, r: _Running, logits: np.ndarray) -> None:
        """The prompt's last chunk ran: keep its blocks, fork the other choices from its
        KV, sample every choice's first token from the same logits."""
        req = r.handle.request
        self.prefix_cache.store(req.prompt_ids, r.seq.kv, req.cache_salt)
        choices = [r]
        for i in range(1, req.n):
            seed = None if req.sampling.seed is None else req.sampling.seed + i
            fork = _Running(r.handle, Sequence(r.seq.kv.copy()), Sampler(req.sampling.with_seed(seed)),
                            self.tokenizer.stream_decoder(req.special_tokens), r.max_tokens,
                            r.prompt, index=i, prefilled=r.prefilled)
            try:
                fork.constraint = req.constraint() if req.constraint is not None else None
            except ValueError as e:
                self._fail([r], e)
                return
            choices.append(fork)
            with self._cond:
                self._running.append(fork)
        for c in choices:
            self._sample(c, logits)

    def _sample(self, r: _Running, logits: np.ndarray) -> None:
        """`_take_token`, failing only this request when its logits are unusable."""
        try:
            self._take_token(r, logits)
        except ValueError as e:                    # NaN / inf logits, a grammar's error
            self._fail([r], ValueError(f"request {r.handle.request.request_id}: {e}"))

    def _take_token(self, r: _Running, logits: np.ndarray) -> None:
        """Sample the next token of `r` from its logits; emit text or finish."""
        req = r.handle.request
        allowed = r.constraint.mask() if r.constraint is not None else None
        token = r.sampler.sample(logits, allowed)
        stats = r.handle.stats
        now, previous = self.clock(), r.last_token_at
        r.last_token_at = now
        if stats.time_to_first_token_s is None:
            stats.time_to_first_token_s = now - r.handle.submitted
        if token in req.stop_ids:
            self._finish(r, "stop", flush=True)
            return
        if previous is not None and self.on_token_gap is not None:
            self.on_token_gap(now - previous)
        r.sampler.accept(token)
        if r.constraint is not None:
            r.constraint.accept(token)
        r.generated += 1
        stats.completion_tokens += 1
        self.completion_tokens += 1
        r.last_token = token
        r.pending_ids.append(token)
        if req.logprobs is not None:
            own, top = logprobs(logits, token, req.logprobs)
            r.pending_logprobs.append(TokenLogprob(token, own, tuple(top)))
        text, stopped = self._stop_strings(r, r.held + r.decoder.step(token))
        if stopped:
            self._emit(r, text)
            r.held = ""
            self._finish(r, "stop", flush=False)   # what follows a stop string is not output
            return
        # every token is an event, its text "" while it is held back (a stop string's
        # possible start, an incomplete UTF-8 character, a token of no text): a client
        # sees each token as llama-server sends it
        self._emit(r, text)
        if r.constraint is not None and r.constraint.done():
            self._finish(r, "stop")
        elif r.generated >= r.max_tokens:
            self._finish(r, "length")

    def _emit(self, r: _Running, text: str, **final) -> None:
        """Send `text` with the tokens (and log-probabilities) not sent yet."""
        r.handle._emit(TokenEvent(text, tuple(r.pending_ids), index=r.index,
                                  logprobs=tuple(r.pending_logprobs), **final))
        r.pending_ids, r.pending_logprobs = [], []

    def _stop_strings(self, r: _Running, text: str) -> tuple[str, bool]:
        """Split pending text at a stop string: (text to emit, stopped?); keeps back a
        tail that could still become a stop string in r.held."""
        stops = r.handle.request.stop_strings
        if not stops:
            return text, False
        hits = [(text.find(s), i) for i, s in enumerate(stops) if s and s in text]
        if hits:
            at, i = min(hits)
            r.stop_string = stops[i]
            return text[:at], True
        keep = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        r.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def _finish(self, r: _Running, reason: str, flush: bool | None = None,
                error: str | None = None) -> None:
        """End one running choice; flush: emit the text still held back (default:
        unless it was cancelled or failed). Its KV's whole blocks go to the prefix cache
        (unless it failed); the request ends with its last choice."""
        with self._cond:
            if r not in self._running:
                return
            self._running.remove(r)
        if flush is None:
            flush = reason not in ("cancelled", "error")
        if reason != "error" and not r.prefilling:
            req = r.handle.request
            self.prefix_cache.store(req.prompt_ids + tuple(r.fed), r.seq.kv, req.cache_salt)
        tail = r.held + r.decoder.finish() if flush else ""
        handle = r.handle
        handle.open_choices -= 1
        if handle.finish_reason != "error" and (handle.finish_reason is None or r.index == 0
                                                or reason == "error"):
            handle.finish_reason = reason      # choice 0's, unless a choice failed
        last = handle.open_choices == 0
        if last:
            self._close(handle, self.clock())
        if not flush:
            r.pending_logprobs = []
        self._emit(r, tail, finish_reason=reason, error=error,
                   stats=handle.stats if last else None, last=last, stop_string=r.stop_string)
        if last:
            self._finished_hook(handle)

    def _finish_unstarted(self, handle: RequestHandle, reason: str, now: float,
                          error: str | None = None) -> None:
        """End a request none of whose choices runs (left the queue, failed to start)."""
        if handle.finished:
            return
        handle.finish_reason = reason
        self._close(handle, now)
        for i in range(handle.request.n):
            handle._emit(TokenEvent("", finish_reason=reason, error=error, stats=handle.stats,
                                    index=i, last=i == handle.request.n - 1))
        self._finished_hook(handle)

    def _close(self, handle: RequestHandle, now: float) -> None:
        handle.finished = True
        handle.open_choices = 0
        handle.stats.duration_s = now - handle.submitted

    def _finished_hook(self, handle: RequestHandle) -> None:
        if self.on_finish is not None:
            try:
                self.on_finish(handle)
            except Exception:  # a logging hook must never stop the engine
                log.exception("on_finish_hook_failed")

    def _fail(self, rows: list[_Running], e: BaseException) -> None:
        """A step failed (a read error, a bad input): its requests end (every choice of
        them), the engine goes on."""
        handles = list({id(r.handle): r.handle for r in rows}.values())
        log.error("engine_step_failed", requests=[h.request.request_id for h in handles], error=str(e))
        for handle in handles:
            choices = [r for r in list(self._running) if r.handle is handle]
            if not choices:
                self._finish_unstarted(handle, "error", self.clock(), error=str(e))
            for r in choices:
                self._finish(r, "error", error=str(e))

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
        for handle in {id(r.handle): r.handle for r in rows}.values():
            s = handle.stats
            s.expert_hits += hits
            s.expert_misses += misses
            s.expert_bytes_read += nbytes


def _late(handle: RequestHandle, now: float) -> bool:
    deadline = handle.request.deadline
    return deadline is not None and now > deadline
