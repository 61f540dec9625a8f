"""Constrained decoding for `response_format`: JSON objects and JSON schemas, by
llguidance (the grammar library of Guidance, in Rust, CPU-only, no Python dependencies).

`Grammars` is built once per tokenizer (llguidance's view of the vocabulary takes a
moment for a large one) and turns an OpenAI `response_format` into a factory of
per-choice `JsonConstraint`s; the engine asks each one for the mask of allowed tokens
before it samples and tells it the token it sampled (daemon.engine.engine.Constraint).
The mask depends only on the tokens accepted so far, so a constrained request's tokens
are the same alone or batched, like any other.

{"type": "json_object"} is any JSON object ({"type": "object"} as a schema);
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}} follows the
schema. llguidance's JSON grammar allows no whitespace between tokens beyond what the
schema needs ("whitespace_flexible": false), as OpenAI's structured outputs do.

Compiling is bounded. llguidance's compile of some small schemas is not: an allOf of
string patterns intersects their regexes, and the cost doubles with each pattern (14:
0.8 s; 30: more than 10 GB and no end), and its own limits (lexer fuel, grammar size)
do not stop it. So a schema is first compiled in a worker process
(daemon/workers/grammar_worker.py, the process handling of the chat templates,
daemon/workers/process.py) whose address space is capped at `memory_bytes`
(grammar_compile_memory_bytes) and which is killed at `timeout_s`
(grammar_compile_timeout_s): beyond either the request is a 400 naming the key. A
worker killed otherwise (SIGKILL before its deadline: the OOM killer, which takes a
worker first, daemon/workers/process.py) is a 400 saying so, not cached. The
worker answers only a verdict, because llguidance has no way to hand a compiled grammar
to another process (a matcher is not picklable and its Python API serializes nothing
compiled; the grammar text `grammar_from_json_schema` returns is the schema itself,
uncompiled). Once a worker has compiled a grammar within the limits, the daemon compiles
it once more in-process (`build_matcher`, deterministic: the same library, tokenizer,
limits and input, so it ends as the worker's did, in about the time the worker reported;
that time is < timeout_s by construction) and keeps the matcher, by the grammar's hash,
in a bounded cache (CACHE_ENTRIES, and CACHE_BYTES of memory, least recently used out
first);
every choice of every request with that schema is a deep copy of it, on the engine
thread (measured: about 1 us for a small schema and 10-25 us with its JsonConstraint for
a 300-property one, where a compile of even the small one takes 1 ms). Refusals are
cached too, except timeouts (they depend on the load), and a compile already running for
the same schema is awaited, not repeated. The worker also computes the first mask: a
schema no value satisfies ({"$ref": "#"}) is refused there, not at the first token.
And it consumes the tokens the grammar forces and a few more of one path
(grammar_worker.first_steps_error): llguidance checks its row limit (max_items_in_row,
2000) only when a token is consumed, so an anyOf of 4000 objects is refused there with
llguidance's message, not at the first token of its request.
Each later mask is bounded by llguidance's per-step limits (lexer fuel, Earley items).

The address-space cap of a worker (`memory_bytes`, `effective_memory_bytes`) is the
smaller of grammar_compile_memory_bytes and its share of the memory left free for the
compiles (`memory_room_bytes`, split between the `workers` slots; loading.py takes it
from the memory plan: what the plan reserves for the workers in its runtime,
`compile_reserve_bytes` — each one's start, `worker_floor_bytes`, measured, plus
COMPILE_HEADROOM_BYTES — and the margin it keeps free under the cgroup's or the host's
limit). In a 400 MiB cgroup, two workers of 1 GiB each would take memory the daemon was
planned to have; a cap below a worker's start would make every response_format a 400.
Errors name the cap in force, and the configured one it lowered; a cap below the start
is a warning (`grammar_unavailable`) when it is set.

A cache entry is charged what its matcher holds: the worker measures the C heap before
the compile and while the matcher is alive (daemon/workers/grammar_worker.py), and the
same compile holds the same in the daemon. Not the daemon's resident growth around its
own compile: other threads allocate meanwhile, and memory freed by an evicted matcher is
reused without growth. The charge is at least TEXT_BYTES_FACTOR bytes per byte of the
grammar text (measured: 31 for a large enum, 114 for an anyOf of small objects), a floor
for a C library without mallinfo2. Measured in one process holding the cache: 40
distinct enum schemas of 45000 strings (630 KB of JSON, ~14.5 MB of matcher each) took
it from 63 to 647 MiB when each was charged the worker's resident growth after the
matcher was freed (~0: 4096, all 40 kept; 256 would have taken 3.7 GB); charged what
they hold, 17 are kept (247 MiB charged) and it stays at ~475 MiB after 40 or 80 (the
rest: the allocator's free memory and compile transients). A matcher larger than
CACHE_BYTES / CACHE_ENTRY_FRACTION serves the requests that asked for it and is dropped;
one larger than memory_bytes / COMPILED_FRACTION is refused (a 400 naming
grammar_compile_memory_bytes) before the daemon compiles it, so one schema never holds
more than that in the daemon.

Compiles wait on the event loop (no thread held while waiting) for one of `workers`
compile slots, each with its own thread of a pool only compiles use; a request that gets
no slot within timeout_s is a 429 (GrammarBusyError). So clients sending costly schemas
wait for each other and nothing else: the default thread pool (templates, tokenizing)
and the engine are not theirs to fill. The slots are shared fairly
(daemon/workers/compile_slots.py): a client holds one at a time, its other compiles wait
(a few; beyond, a 429 at once) while other clients take the free ones, so one client
sending bombs does not make every other client's compile a 429. A schema whose compile
ran out of time within TIMED_OUT_S is refused at once with the same 400 (a bounded
record, TIMED_OUT_ENTRIES keys), not compiled for another timeout_s. `close()`
(shutdown) kills the workers: a waiting compile ends at once with GrammarClosedError.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np

from daemon.workers.compile_slots import CompileSlots, SlotRefused
from daemon.workers.grammar_worker import build_matcher
from daemon.workers.process import WorkerProcess
from ext.json_schema import closed_objects
from ext.tokenizer import Tokenizer
from telemetry.logs import get_logger

log = get_logger("server")

JSON_OPTIONS = {"whitespace_flexible": False}
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 1 << 30
DEFAULT_WORKERS = 2
STARTUP_S = 60.0                # a new worker's start: interpreter, llguidance, the tokenizer
CACHE_ENTRIES = 256             # compiled grammars (and refusals) kept
CACHE_BYTES = 256 << 20         # their memory: what each matcher holds, measured by the worker
CACHE_ENTRY_FRACTION = 8        # a matcher above CACHE_BYTES / 8 is used once, not cached
COMPILED_FRACTION = 16          # a matcher above memory_bytes / 16 (64 MiB of 1 GiB): a 400
TEXT_BYTES_FACTOR = 16          # the least a matcher is charged: 16 bytes a grammar text byte
TIMED_OUT_S = 60.0              # a schema whose compile timed out is refused at once this long
TIMED_OUT_ENTRIES = 1024        # timed-out schemas remembered (the oldest out first)
WORKER_COMMAND = (sys.executable, "-m", "daemon.workers.grammar_worker")


# What a compile worker needs to start (interpreter, llguidance, the model's tokenizer):
# the least RLIMIT_AS under which `python -m daemon.workers.grammar_worker` says ready,
# found by bisection to 1 MiB on make-model tokenizers (CPython 3, llguidance as pinned):
# 29.8 MiB at 512 tokens, 46.7 MiB at 32000, 106.2 MiB at 151936 (530-560 B a token);
# 23.8 MiB more for each 8 MiB of tokenizer JSON (about 3 B a byte: the init line, its
# parsed string, llguidance's parse). A {"type": "object"} compile adds ~1 MiB.
WORKER_BASE_BYTES = 32 << 20
WORKER_BYTES_PER_VOCAB_TOKEN = 576
WORKER_BYTES_PER_TOKENIZER_BYTE = 3
COMPILE_HEADROOM_BYTES = 16 << 20   # per worker above its start: the compiles themselves


def worker_floor_bytes(vocab_size: int, tokenizer_bytes: int) -> int:
    """The address space a compile worker needs to start, in bytes, for a vocabulary of
    `vocab_size` tokens whose tokenizer JSON is `tokenizer_bytes` long (the constants
    above, measured)."""
    return (WORKER_BASE_BYTES + WORKER_BYTES_PER_VOCAB_TOKEN * vocab_size
            + WORKER_BYTES_PER_TOKENIZER_BYTE * tokenizer_bytes)


def compile_reserve_bytes(configured: int, vocab_size: int, tokenizer_bytes: int,
                          workers: int = DEFAULT_WORKERS) -> int:
    """What the memory plan reserves for the compile workers, all `workers` slots
    together, in bytes: each its start (`worker_floor_bytes`) plus COMPILE_HEADROOM_BYTES,
    at most `configured` (grammar_compile_memory_bytes)."""
    return workers * min(configured, worker_floor_bytes(vocab_size, tokenizer_bytes)
                         + COMPILE_HEADROOM_BYTES)


def effective_memory_bytes(configured: int, room_bytes: int | None, workers: int) -> int:
    """The address-space cap of one compile worker: `configured` (grammar_compile_memory_bytes)
    or, when less, `room_bytes` (the memory free for all the compile workers; None =
    unknown) split between the `workers` slots that may compile at once."""
    if room_bytes is None:
        return configured
    return max(0, min(configured, room_bytes // workers))


class GrammarError(ValueError):
    """A response_format that cannot be compiled; the message says why."""


class GrammarLimitError(GrammarError):
    """The compile passed grammar_compile_timeout_s or grammar_compile_memory_bytes."""


class GrammarTimeoutError(GrammarLimitError):
    """The compile passed grammar_compile_timeout_s (its worker was killed at the deadline)."""


class GrammarKilledError(GrammarLimitError):
    """The compile process was killed by a signal (SIGKILL): not a verdict on the schema
    (the machine's or cgroup's memory ran short), so it is not cached."""


class GrammarBusyError(GrammarError):
    """No compile slot came free within the timeout (other compiles hold them all)."""


class GrammarClosedError(GrammarError):
    """The daemon is shutting down."""


@dataclass(frozen=True)
class GrammarSpec:
    """A response_format to compile: llguidance's grammar text and its hash (the cache key)."""

    grammar: str
    key: str


@dataclass
class _Entry:
    matcher: object | None       # llguidance.LLMatcher at the start (never used: deep copied)
    error: GrammarError | None
    cost: int                    # bytes, estimated


class JsonConstraint:
    """One choice's matcher (see daemon.engine.engine.Constraint); `matcher` is its own
    (a deep copy of the cached one)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size

    def mask(self) -> np.ndarray:
        """[V] bool: the tokens the grammar allows next."""
        words = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
        bits = np.unpackbits(words, bitorder="little").astype(bool)
        out = np.zeros(self._vocab_size, bool)
        n = min(self._vocab_size, bits.size)
        out[:n] = bits[:n]
        if self._matcher.is_error():
            raise ValueError(f"grammar: {self._matcher.get_error()}")
        return out

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise ValueError(f"grammar: token {token} refused: {self._matcher.get_error()}")

    def done(self) -> bool:
        """The output is complete: nothing but the end may follow."""
        return self._matcher.is_stopped()


class Grammars:
    """Compiles response formats against one tokenizer, in bounded worker processes.

    tokenizer: the model's. vocab_size: the model's (masks have this length; ids the
    tokenizer does not know are never allowed). eos_ids: the ids that end an answer
    (the grammar allows them once the JSON is complete). timeout_s, memory_bytes: the
    bounds of one compile (grammar_compile_timeout_s, grammar_compile_memory_bytes;
    `set_limits` changes them). memory_room_bytes: the memory free for all the compile
    workers together, or None (unknown: memory_bytes stands); the cap of each worker is
    `effective_memory_bytes` (the attribute `memory_bytes`; the configured one is
    `configured_memory_bytes`). workers: compiles at once (processes, started on first
    use and again after one is killed). clock: monotonic seconds (of the timed-out record).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: frozenset[int], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 workers: int = DEFAULT_WORKERS, memory_room_bytes: int | None = None,
                 clock=time.monotonic):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        eos = sorted(eos_ids) or None
        text = tokenizer.to_json()
        self._tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        self._init = {"tokenizer": text, "vocab_size": vocab_size, "eos": eos or []}
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.memory_room_bytes = memory_room_bytes
        self._workers = workers
        self.configured_memory_bytes = memory_bytes
        self.memory_bytes = effective_memory_bytes(memory_bytes, memory_room_bytes, workers)
        self.floor_bytes = worker_floor_bytes(vocab_size, len(text))
        log.info("grammar_compile_memory", memory_bytes=self.memory_bytes,
                 configured_memory_bytes=memory_bytes, room_bytes=memory_room_bytes,
                 workers=workers, worker_floor_bytes=self.floor_bytes)
        self._warn_below_floor()
        self._slots = CompileSlots(workers)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._idle: list[WorkerProcess] = []
        self._all: set[WorkerProcess] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._closing = asyncio.Event()     # set by close(): compiles waiting for a slot end
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._cache_bytes = 0
        self._pending: dict[str, asyncio.Future] = {}
        self._timed_out: OrderedDict[str, tuple[float, GrammarLimitError]] = OrderedDict()
        self._clock = clock
        self.hits = self.misses = self.killed = 0

    def set_limits(self, timeout_s: float, memory_bytes: int) -> None:
        """New bounds (SIGHUP; memory_bytes: grammar_compile_memory_bytes, capped as at the
        start); the refusals cached under the old ones are forgotten."""
        effective = effective_memory_bytes(memory_bytes, self.memory_room_bytes, self._workers)
        self.configured_memory_bytes = memory_bytes
        if (timeout_s, effective) != (self.timeout_s, self.memory_bytes):
            self.timeout_s, self.memory_bytes = timeout_s, effective
            log.info("grammar_compile_memory", memory_bytes=effective,
                     configured_memory_bytes=memory_bytes, room_bytes=self.memory_room_bytes,
                     workers=self._workers, worker_floor_bytes=self.floor_bytes)
            self._warn_below_floor()
            self._cache.clear()
            self._cache_bytes = 0
            self._timed_out.clear()

    def reserve_bytes(self) -> int:
        """What the compile workers may take together under their cap in force, bounded
        by what the plan reserves for them (`compile_reserve_bytes`), in bytes."""
        return self._workers * min(self.memory_bytes, self.floor_bytes + COMPILE_HEADROOM_BYTES)

    def _warn_below_floor(self) -> None:
        """A warning when a worker cannot start under the cap in force: structured
        output is unavailable until the cap (or the memory) grows."""
        if self.memory_bytes < self.floor_bytes:
            log.warning("grammar_unavailable", memory_bytes=self.memory_bytes,
                        worker_floor_bytes=self.floor_bytes,
                        reason=f"a grammar compile process needs about {self.floor_bytes} "
                               f"bytes of address space to start with this tokenizer "
                               f"({self.vocab_size} tokens); its cap is {self.memory_bytes} "
                               f"bytes ({self._memory_key(self.memory_bytes)}): "
                               "response_format other than text is refused")

    def spec(self, response_format: dict,
             frame: Callable[[dict], str] | None = None) -> GrammarSpec | None:
        """What to compile for `response_format` (OpenAI's shape), or None for {"type":
        "text"}; cheap (no compile). frame: None (the answer is the JSON), or a function
        of the JSON schema (with llguidance's JSON layout options, JSON_OPTIONS, as its
        "x-guidance") giving a Lark grammar in which the JSON is framed (harmony's final
        message: daemon/api/harmony.py). Raises GrammarError naming what is wrong."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema: dict | bool = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict):
                raise GrammarError("'response_format.json_schema' must be an object with a "
                                   "'schema'")
            schema = spec.get("schema", {})
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("'response_format.json_schema.schema' must be a JSON schema "
                                   "(an object)")
        else:
            raise GrammarError(f"'response_format.type' must be 'text', 'json_object' or "
                               f"'json_schema', got {kind!r}")
        schema = closed_objects(schema)          # objects without unlisted keys (ext/json_schema.py)
        if frame is not None:
            # a boolean schema as the object it stands for (true: anything; false: nothing)
            typed = schema if isinstance(schema, dict) else {} if schema else {"not": {}}
            return self.spec_lark(frame({**typed, "x-guidance": JSON_OPTIONS}),
                                  "the JSON schema cannot be used")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=JSON_OPTIONS)
        except (ValueError, TypeError, RecursionError) as e:
            raise GrammarError(f"the JSON schema cannot be used: {e}") from None
        return GrammarSpec(grammar, hashlib.sha256(grammar.encode("utf-8", "surrogatepass"))
                           .hexdigest())

    def spec_lark(self, lark: str, what: str = "the grammar cannot be used") -> GrammarSpec:
        """What to compile for a grammar in llguidance's Lark dialect (tool calls:
        daemon/api/tools.py); cheap (no compile). Raises GrammarError (its message
        `what`: llguidance's reason) when the text is not a grammar llguidance reads."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError, RecursionError) as e:
            raise GrammarError(f"{what}: {e}") from None
        return GrammarSpec(grammar, hashlib.sha256(grammar.encode("utf-8", "surrogatepass"))
                           .hexdigest())

    async def compile(self, spec: GrammarSpec, client: Hashable = ("unknown",)):
        """A factory of JsonConstraint for `spec` (call on the event loop). client: who
        asks (compile_slots.client_of), for the fair share of the slots. Raises
        GrammarError (the schema cannot be used), GrammarLimitError (a bound stopped its
        compile, or did within TIMED_OUT_S), GrammarBusyError (no compile slot in time, or
        too many of the client's compiles wait), GrammarClosedError."""
        if self._closed:
            raise GrammarClosedError("moed is shutting down")
        timed_out = self._timed_out.get(spec.key)
        if timed_out is not None:
            ago = self._clock() - timed_out[0]
            if ago < TIMED_OUT_S:
                self.hits += 1
                raise GrammarTimeoutError(f"{timed_out[1]} {ago:.0f} s ago, and is not tried "
                                          f"again within {TIMED_OUT_S:g} s")
            del self._timed_out[spec.key]
        entry = self._cache.get(spec.key)
        if entry is not None:
            self.hits += 1
            self._cache.move_to_end(spec.key)
        else:
            pending = self._pending.get(spec.key)
            if pending is None:
                self.misses += 1
                pending = self._pending[spec.key] = asyncio.ensure_future(
                    self._compile(spec, client))
                pending.add_done_callback(lambda _: self._pending.pop(spec.key, None))
            entry = await asyncio.shield(pending)
        if entry.error is not None:         # a fresh one: a cached error keeps no traceback
            raise type(entry.error)(str(entry.error))
        template, vocab = entry.matcher, self.vocab_size
        return lambda: JsonConstraint(template.deep_copy(), vocab)

    async def _compile(self, spec: GrammarSpec, client: Hashable) -> _Entry:
        timeout_s = self.timeout_s
        acquire = asyncio.ensure_future(self._slots.acquire(client))
        closing = asyncio.ensure_future(self._closing.wait())
        await asyncio.wait({acquire, closing}, timeout=timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
        closing.cancel()
        if acquire.done() and not acquire.cancelled() and isinstance(acquire.exception(),
                                                                       SlotRefused):
            return _Entry(None, GrammarBusyError(
                f"this client's grammar compiles hold their share of the compile slots and "
                f"{acquire.exception()}: try again later"), 0)
        if not acquire.done() or self._closed:
            acquire.cancel()
            try:
                await acquire          # it may have got the slot as it was cancelled
            except asyncio.CancelledError:
                pass
            else:
                self._slots.release(client)
            if self._closed:
                return _Entry(None, GrammarClosedError("moed is shutting down"), 0)
            return _Entry(None, GrammarBusyError(
                f"every grammar compile slot stayed busy for {timeout_s:g} s "
                "(grammar_compile_timeout_s): try again later"), 0)
        try:
            entry = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._compile_blocking, spec.grammar, timeout_s, self.memory_bytes)
        except RuntimeError:           # the executor was shut down: closing
            entry = _Entry(None, GrammarClosedError("moed is shutting down"), 0)
        finally:
            self._slots.release(client)
        if isinstance(entry.error, GrammarTimeoutError):     # refused at once for a while
            self._timed_out[spec.key] = (self._clock(), entry.error)
            self._timed_out.move_to_end(spec.key)
            while len(self._timed_out) > TIMED_OUT_ENTRIES:
                self._timed_out.popitem(last=False)
        if self._cacheable(entry):
            self._cache[spec.key] = entry
            self._cache_bytes += entry.cost
            while len(self._cache) > CACHE_ENTRIES or self._cache_bytes > CACHE_BYTES:
                self._cache_bytes -= self._cache.popitem(last=False)[1].cost
        return entry

    def _memory_key(self, memory_bytes: int) -> str:
        """The key that set `memory_bytes`, for messages: the configured value, and why it
        was lowered when it was."""
        if memory_bytes >= self.configured_memory_bytes:
            return "grammar_compile_memory_bytes"
        return (f"grammar_compile_memory_bytes {self.configured_memory_bytes}, lowered to "
                f"{memory_bytes} by the memory free for {self._workers} compile workers "
                "under the machine's or cgroup's limit")

    @staticmethod
    def _cacheable(entry: _Entry) -> bool:
        if entry.cost > CACHE_BYTES // CACHE_ENTRY_FRACTION:
            return False
        error = entry.error
        return not isinstance(error, (GrammarBusyError, GrammarClosedError,
                                      GrammarKilledError, GrammarTimeoutError))

    def _compile_blocking(self, grammar: str, timeout_s: float, memory_bytes: int) -> _Entry:
        """On a compile thread: the worker's verdict, then the in-process compile."""
        try:
            worker = self._take(memory_bytes)
        except GrammarError as e:
            return _Entry(None, e, 0)
        log.debug("grammar_compile_started", pid=worker.proc.pid, timeout_s=timeout_s,
                  memory_bytes=memory_bytes)
        started = time.monotonic()
        answer = worker.ask({"grammar": grammar}, timeout_s)
        waited = time.monotonic() - started
        if answer is None:
            ended = self._discard(worker)
            if self._closed:
                return _Entry(None, GrammarClosedError("moed is shutting down"), 0)
            self.killed += 1
            log.warning("grammar_compile_killed", ended=ended, seconds=round(waited, 3),
                        timeout_s=timeout_s, memory_bytes=memory_bytes,
                        effect="the request gets a 400; a new worker starts")
            if waited >= timeout_s:
                return _Entry(None, GrammarTimeoutError(
                    f"the JSON schema did not compile within {timeout_s:g} s "
                    "(grammar_compile_timeout_s)"), 0)
            if ended == "signal 9":
                # Not this daemon (it kills only at the deadline) nor RLIMIT_AS (a failed
                # allocation aborts): the kernel's OOM killer, which picks workers first.
                return _Entry(None, GrammarKilledError(
                    "the JSON schema's compile process was killed (signal 9) before it "
                    "finished, probably by the memory limit of the machine or its cgroup: "
                    "try a smaller schema, or again later"), 0)
            return _Entry(None, GrammarLimitError(
                f"the JSON schema needed more than {memory_bytes} bytes to compile "
                f"({self._memory_key(memory_bytes)}; its compile process ended with "
                f"{ended})"), 0)
        with self._lock:
            if self._closed:
                worker.kill()
            else:
                self._idle.append(worker)
        if not answer.get("ok"):
            error = answer.get("error", "unknown error")
            if answer.get("limit"):
                return _Entry(None, GrammarLimitError(
                    f"the JSON schema needed more than {memory_bytes} bytes to compile "
                    f"({self._memory_key(memory_bytes)})"), 64)
            return _Entry(None, GrammarError(f"the JSON schema cannot be used: {error}"),
                          64 + len(error))
        # The worker compiled it within the limits: the same compile here ends as it did,
        # and holds what the worker measured.
        cost = max(int(answer.get("bytes", 0)), TEXT_BYTES_FACTOR * len(grammar), 4096)
        most = memory_bytes // COMPILED_FRACTION
        if cost > most:
            log.info("grammar_compile_refused", bytes=cost, max_bytes=most)
            return _Entry(None, GrammarLimitError(
                f"the compiled JSON schema would hold {cost} bytes, more than {most} "
                f"(1/{COMPILED_FRACTION} of {memory_bytes}, {self._memory_key(memory_bytes)})"),
                64)
        started = time.monotonic()
        matcher, error = build_matcher(self._tokenizer, grammar)
        if error is not None:          # not expected: the worker said it compiles
            return _Entry(None, GrammarError(f"the JSON schema cannot be used: {error}"), 0)
        log.info("grammar_compiled", worker_seconds=round(float(answer.get("seconds", 0)), 6),
                 seconds=round(time.monotonic() - started, 6), bytes=cost,
                 cached=cost <= CACHE_BYTES // CACHE_ENTRY_FRACTION)
        return _Entry(matcher, None, cost)

    def _take(self, memory_bytes: int) -> WorkerProcess:
        with self._lock:
            if self._closed:
                raise GrammarClosedError("moed is shutting down")
            while self._idle:
                worker = self._idle.pop()
                if worker.proc.poll() is None and worker.memory_bytes == memory_bytes:
                    return worker
                self._all.discard(worker)
                worker.kill()
        try:
            worker = WorkerProcess([*WORKER_COMMAND, str(memory_bytes)], memory_bytes,
                                   init=self._init)
        except OSError as e:
            raise GrammarError(f"cannot start a grammar compile process: {e}") from None
        with self._lock:
            self._all.add(worker)
        started = time.monotonic()
        if not worker.wait_ready(STARTUP_S):
            waited = time.monotonic() - started
            ended = self._discard(worker)
            if self._closed:
                raise GrammarClosedError("moed is shutting down")
            cap = (f"under an address-space cap of {memory_bytes} bytes "
                   f"({self._memory_key(memory_bytes)}; it needs about {self.floor_bytes} "
                   f"bytes to start with this tokenizer)")
            if waited < STARTUP_S:
                raise GrammarLimitError(
                    f"a grammar compile process ended as it started ({ended}, after "
                    f"{waited:.1f} s) {cap}")
            raise GrammarLimitError(
                f"a grammar compile process did not start within {STARTUP_S:g} s ({ended}) "
                f"{cap}")
        return worker

    def _discard(self, worker: WorkerProcess) -> str:
        ended = worker.kill()
        with self._lock:
            self._all.discard(worker)
        return ended

    def start(self) -> None:
        """Start one worker now (call from a thread), so that the first compile does not
        wait for it."""
        try:
            worker = self._take(self.memory_bytes)
        except GrammarError as e:
            log.warning("grammar_worker_unavailable", error=str(e))
            return
        with self._lock:
            if self._closed:
                worker.kill()
            else:
                self._idle.append(worker)

    def close(self) -> None:
        """Kill every worker (idempotent): running compiles and those waiting for a slot
        end now with GrammarClosedError, later ones are refused. Call it on the event
        loop's thread (as shutdown does) while compiles may be waiting."""
        with self._lock:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
            self._idle.clear()
        self._closing.set()
        for w in workers:
            w.kill()
        self._executor.shutdown(wait=False, cancel_futures=True)
