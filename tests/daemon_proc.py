"""Start the real `moed serve` as a subprocess and talk to it over its Unix socket.

Used by the daemon's end-to-end tests. No sleeps: readiness is the daemon's own READY
log line (`"event": "ready"`) read from its stderr, and exit is `Popen.wait`. Every
daemon a test stops or sees exit is held to the log contract (tests/log_contract.py).
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import log_contract

MOED = str(Path(sys.executable).with_name("moed"))
READY_TIMEOUT_S = 120.0


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket (the standard library, no extra client)."""

    def __init__(self, path: str, timeout: float = 60.0):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable, what: str, diagnostics: Callable[[], str] = lambda: "",
               timeout: float = 90.0):
    """Poll `condition()` (a query of another process: its API, its stats) until it returns
    something true, returned; AssertionError naming `what`, with `diagnostics()`, after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
    raise AssertionError(f"timed out waiting for {what}\n{diagnostics()}")


def short_dir(prefix: str = "moed") -> str:
    """A short temporary directory: Unix socket paths are limited to 107 bytes."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


class Daemon:
    """A running `moed serve`; `events` are its JSON log lines, parsed, as they arrive."""

    def __init__(self, model: Path | str, workdir: str, *args: str, env: dict | None = None,
                 socket_path: str | None = None, wait_ready: bool = True, user: int | None = None,
                 launcher: Sequence[str] = (), moed: Sequence[str] = (MOED,),
                 state_dir: str | None = None):
        """launcher: a command that execs the rest (e.g. systemd-socket-activate -l PATH,
        prlimit ...). moed: how to run moed (default the venv's entry point). state_dir:
        default WORKDIR/state."""
        self.workdir = workdir
        self._launcher = tuple(launcher)
        self.socket = socket_path or os.path.join(workdir, "moed.sock")
        self.state_dir = state_dir or os.path.join(workdir, "state")
        cmd = [*launcher, *moed, "serve", "--model", str(model), "--socket", self.socket,
               "--state-dir", self.state_dir, "--metrics-address", "127.0.0.1:0", *args]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
        environ["MOED_TUNER"] = "off"          # a test of the tuner turns it on in env
        environ.update(env or {})
        environ.setdefault("MOED_CONFIG", os.path.join(workdir, "none.toml"))
        if not os.path.exists(environ["MOED_CONFIG"]):
            Path(environ["MOED_CONFIG"]).write_text("")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=environ, text=True, user=user)
        self.events: list[dict] = []
        self.stderr_lines: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if wait_ready:
            self.wait_event("ready")

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._cond:
                self.stderr_lines.append(line)
                try:
                    self.events.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def mark(self) -> int:
        """How many log lines have been parsed so far (a `from_index` for `wait_event`)."""
        with self._cond:
            return len(self.events)

    def wait_exit(self, timeout: float = 60.0) -> int:
        """Wait for the process to end by itself (no signal) and its stderr to be read.
        AssertionError when a stderr line broke the log contract (tests/log_contract.py)."""
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        self._close_pipes()
        self.check_logs()
        return code

    def check_logs(self) -> None:
        """AssertionError naming every stderr line so far that is not a JSON event with
        snake_case name and fields (tests/log_contract.py)."""
        if any(os.path.basename(a) == "systemd-socket-activate" for a in self._launcher):
            return                  # it writes its own plain lines to the same stderr
        with self._cond:
            bad = log_contract.problems(self.stderr_lines)
        assert not bad, "moed serve broke the log contract:\n" + "\n".join(bad)

    def wait_line(self, text: str, timeout: float = READY_TIMEOUT_S) -> str:
        """Block until a stderr line containing `text` (JSON or not) appears; returns it."""
        def find():
            return next((line for line in self.stderr_lines if text in line), None)
        with self._cond:
            self._cond.wait_for(lambda: find() is not None or self._closed, timeout)
            found = find()
        if found is None:
            raise AssertionError(f"no stderr line with {text!r}; stderr:\n"
                                 + "".join(self.stderr_lines[-40:]))
        return found

    def wait_event(self, event: str, timeout: float = READY_TIMEOUT_S, from_index: int = 0,
                   **match) -> dict:
        """Block until a log line with this event (and fields) appears; returns it.

        from_index: ignore the log lines before this one (see `mark`)."""
        def find():
            for e in self.events[from_index:]:
                if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                    return e
            return None
        with self._cond:
            ok = self._cond.wait_for(lambda: find() is not None or self._closed,
                                     timeout)
            found = find()
        if not ok or found is None:
            raise AssertionError(f"no {event!r} log line {match or ''}; stderr:\n"
                                 + "".join(self.stderr_lines[-40:]))
        return found

    def request(self, method: str, path: str, body=None, headers: dict | None = None,
                timeout: float = 60.0) -> tuple[int, dict, bytes]:
        """One HTTP request over the socket; (status, headers, body bytes)."""
        conn = UnixHTTPConnection(self.socket, timeout)
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                       **(headers or {})})
        resp = conn.getresponse()
        out = resp.read()
        conn.close()
        return resp.status, dict(resp.getheaders()), out

    def json(self, method: str, path: str, body=None, **kw) -> tuple[int, dict]:
        status, _, data = self.request(method, path, body, **kw)
        return status, json.loads(data)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        self._close_pipes()
        self.check_logs()
        return code

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._reader.join()
        self._close_pipes()

    def _close_pipes(self) -> None:
        """Close our ends of its stdout and stderr once nothing reads them (no ResourceWarning)."""
        if not self._reader.is_alive():
            for pipe in (self.proc.stdout, self.proc.stderr):
                pipe.close()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def small_chat_model(root: Path, seed: int, arch: str = "qwen3_moe") -> Path:
    """A tiny checkpoint with its family's chat template (make-model: 2 layers, 8
    experts of hidden 64) in root/model, for the tests of the chat surfaces."""
    from ext.makemodel import make_model
    return make_model(Path(root) / "model", arch=arch, layers=2, experts=8, top_k=2, hidden=64,
                      intermediate=32, dtype="bf16", seed=seed)


@contextlib.contextmanager
def serving(model_dir: Path, *args: str) -> Iterator[Daemon]:
    """`moed serve` on model_dir with args for the block: stopped with SIGTERM at the end
    (exit 0 asserted, the log contract checked), its files removed whatever happens."""
    d = Daemon(model_dir, short_dir(), *args)
    try:
        yield d
        assert d.stop() == 0
    finally:
        d.cleanup()
        d.proc.stdout.close()
        d.proc.stderr.close()


@contextlib.contextmanager
def openai_client(daemon: Daemon, timeout_s: float = 120.0):
    """The official `openai` client on the daemon's socket (no retries)."""
    import httpx
    import openai
    http = httpx.Client(transport=httpx.HTTPTransport(uds=daemon.socket), base_url="http://localhost",
                        timeout=httpx.Timeout(timeout_s))
    with http:
        yield openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=http,
                            max_retries=0)


def serve_and_complete(model_dir: Path, prompt: list[int], max_tokens: int, *args: str) -> dict:
    """Serve `model_dir` streaming its experts through the smallest cache moed accepts
    (`args`: more `moed serve` flags), ask for one greedy completion of `prompt`, stop. Returns {"ready": the ready log event,
    "models": GET /v1/models, "build_info": moed_build_info's labels, "completion": the
    POST /v1/completions answer}; asserts each answer is a 200 and the exit is clean."""
    from metrics_scrape import parse

    from daemon.store.streaming import minimum_cache_bytes
    from ext.formats.checkpoint import Checkpoint
    from ext.models.config import load_config
    from ext.models.experts import ExpertLayout

    config = load_config(model_dir)
    budget = minimum_cache_bytes(ExpertLayout(Checkpoint(model_dir), config), config)
    workdir = short_dir()
    d = Daemon(model_dir, workdir, "--expert-cache-bytes", str(budget), "--threads", "1", *args)
    try:
        (ready,) = [e for e in d.events if e["event"] == "ready"]
        status, models = d.json("GET", "/v1/models")
        assert status == 200
        _, _, body = d.request("GET", "/metrics")
        _, samples = parse(body.decode())
        build = dict(next(labels for (name, labels) in samples if name == "moed_build_info"))
        status, out = d.json("POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 0})
        assert status == 200
        assert d.stop() == 0
    finally:
        d.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"ready": ready, "models": models, "build_info": build, "completion": out}


def in_process_greedy(model_dir: Path, prompt: list[int], max_tokens: int, *,
                      numerics: str) -> tuple[int, str]:
    """(tokens, text) of the greedy continuation moed generates in this process under
    `numerics` (given always: the daemon's default, auto, is not the library's, exact)."""
    from ext.generate import Generation
    from ext.models.model import Model
    from ext.sampling import SamplingParams
    from ext.tokenizer import Tokenizer

    model = Model.load(model_dir, n_threads=1, numerics=numerics)
    ids = list(Generation(model, prompt, max_tokens=max_tokens,
                          sampling=SamplingParams(temperature=0.0), stop_ids=()))
    model.close()
    return len(ids), Tokenizer.from_model_dir(model_dir).decode(ids)
