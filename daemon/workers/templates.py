"""Chat templates rendered in worker processes, bounded in output, time and memory.

A chat template is code from the model directory, and Jinja's sandbox bounds what it may
reach, not what it costs: one template rendered 300 M characters and grew the daemon to
24 GB before the OOM killer ended it. Here each render runs in one of a few small worker
processes (daemon/workers/template_worker.py: the interpreter, jinja2, nothing of the
model) whose address space is capped at `worker_memory_bytes(max_chars)`; the worker
stops a render that passes `max_chars` characters or `timeout_s` seconds; and the caller
kills a worker that has not answered `timeout_s` + KILL_GRACE_S after it was asked (a
single Jinja expression can run long in C), then starts a new one. Every way a render
can end badly is a `ChatTemplateLimitError` or `ChatTemplateError` for that request
alone (a 400 from the API); the daemon's own memory and other requests are untouched.

`TemplateWorkers.render(source, variables)` is the `Renderer` that ext.tokenizer's
`Tokenizer` takes. It blocks (call it from a worker thread, as the API does) and is
thread-safe: up to `workers` renders run at once, others wait for a free worker.
Measured cost on this machine: see bench/template_render.py.
"""
from __future__ import annotations

import json
import queue
import sys
import threading
import time
from typing import Any

from daemon.workers.process import WorkerProcess
from ext.chat_template import ChatTemplateError, ChatTemplateLimitError
from telemetry.logs import get_logger

log = get_logger("server")

KILL_GRACE_S = 1.0              # past timeout_s, the wait before a silent worker is killed
STARTUP_S = 30.0                # a new worker's interpreter start and imports (a loaded machine)
BASE_MEMORY_BYTES = 256 << 20   # a worker's interpreter and jinja2, with room to spare
BYTES_PER_CHAR = 16             # the text as str (up to 4 bytes a character), its pieces, JSON
DEFAULT_WORKERS = 2
WORKER_COMMAND = (sys.executable, "-m", "daemon.workers.template_worker")


def worker_memory_bytes(max_chars: int) -> int:
    """The address-space limit (RLIMIT_AS) of a worker allowed `max_chars` characters."""
    return BASE_MEMORY_BYTES + BYTES_PER_CHAR * max_chars


def _Worker(memory_bytes: int) -> WorkerProcess:
    """A new render process whose address space is capped at `memory_bytes`."""
    return WorkerProcess([*WORKER_COMMAND, str(memory_bytes)], memory_bytes)


class TemplateWorkers:
    """A pool of chat-template render processes with the bounds of one `ServeConfig`.

    max_chars: characters one render may produce (chat_template_max_chars). timeout_s:
    seconds one render may take (chat_template_timeout_s). workers: processes, started
    on first use and again after one is killed. `set_limits` changes the bounds (SIGHUP).
    `close()` ends every worker.
    """

    def __init__(self, max_chars: int, timeout_s: float, workers: int = DEFAULT_WORKERS):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self._idle: queue.SimpleQueue[WorkerProcess | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(None)          # a free place; its process starts when needed
        self._lock = threading.Lock()
        self._all: set[WorkerProcess] = set()
        self._closed = False
        self.killed = 0

    def start(self) -> None:
        """Start one worker now, so that the first chat request does not wait for it."""
        self._idle.put(self._take())

    def set_limits(self, max_chars: int, timeout_s: float) -> None:
        self.max_chars, self.timeout_s = max_chars, timeout_s

    def render(self, source: str, variables: dict[str, Any]) -> str:
        """The template's text for `variables` (JSON-able: messages, special tokens, flags).

        Raises ChatTemplateLimitError when the render passes max_chars, timeout_s or the
        worker's memory, ChatTemplateError when the template fails, or its process dies.
        """
        try:
            payload = {"source": source, "variables": variables, "max_chars": self.max_chars,
                       "timeout_s": self.timeout_s}
            json.dumps(payload)
        except (TypeError, ValueError) as e:
            raise ChatTemplateError(f"the chat template's variables are not JSON: {e}") from None
        worker = self._take()
        answer = None
        try:
            started = time.monotonic()
            answer = worker.ask(payload, self.timeout_s + KILL_GRACE_S)
            waited = time.monotonic() - started
        finally:
            if answer is None:
                ended = self._discard(worker)
            else:
                self._idle.put(worker)
        if answer is None:
            if waited >= self.timeout_s:
                raise ChatTemplateLimitError(
                    f"the chat template took longer than {self.timeout_s:g} s to render "
                    "(chat_template_timeout_s)")
            raise ChatTemplateError(f"the chat template's render process died ({ended})")
        if "text" in answer:
            return answer["text"]
        error = answer.get("error", "unknown error")
        raise (ChatTemplateLimitError if answer.get("limit") else ChatTemplateError)(error)

    def _take(self) -> WorkerProcess:
        worker = self._idle.get()
        if worker is None or worker.proc.poll() is not None or \
                worker.memory_bytes != worker_memory_bytes(self.max_chars):
            if worker is not None:
                self._discard(worker, count=False)
            try:
                worker = _Worker(worker_memory_bytes(self.max_chars))
            except OSError as e:
                self._idle.put(None)
                raise ChatTemplateError(f"cannot start a chat-template render process: {e}") from None
            if not worker.wait_ready(STARTUP_S):
                ended = worker.kill()
                self._idle.put(None)
                raise ChatTemplateError(f"a chat-template render process did not start within "
                                        f"{STARTUP_S:g} s ({ended})")
            with self._lock:
                if self._closed:
                    worker.kill()
                    self._idle.put(None)
                    raise ChatTemplateError("moed is shutting down")
                self._all.add(worker)
        return worker

    def _discard(self, worker: WorkerProcess, count: bool = True) -> str:
        ended = worker.kill()
        with self._lock:
            self._all.discard(worker)
        if count:
            self.killed += 1
            log.warning("chat_template_worker_killed", ended=ended, timeout_s=self.timeout_s,
                        effect="the request gets a 400; a new worker starts")
        self._idle.put(None)
        return ended

    def close(self) -> None:
        """End every worker (idempotent); later renders raise ChatTemplateError."""
        with self._lock:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        for w in workers:
            w.kill()
