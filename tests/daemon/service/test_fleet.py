"""Several daemons behind HAProxy (haproxy/moed.cfg, docs/fleet.md), with the real HAProxy.

- `haproxy -c` accepts the shipped configuration.
- Two `moed serve` on loopback TCP (with an API key) behind HAProxy running that
  configuration (servers, bind addresses and stats socket replaced; the process lines of
  `global` left out):
  - a conversation that names itself (X-Session-Id, set by the official `openai` client)
    has its second turn answered by the replica of its first, which reuses its prefix
    (`cached_tokens` > 0), where the other replica would have reused nothing; a wrong key
    is refused by the daemon behind the balancer;
  - concurrent streams on both replicas, then one replica stopped with SIGTERM (it drains:
    its streams finish) or killed with kill -9 (its streams end in an error, never with
    `[DONE]`, and never hang); the other replica's streams finish; new requests, with and
    without a session, keep succeeding from the moment of the stop; the stopped replica
    leaves the pool and, restarted, comes back into it and serves again.

No sleeps: HAProxy's view of its servers is polled from its stats page against a
deadline; a stream's progress is an event set by its reader thread.
"""
from __future__ import annotations

import concurrent.futures
import csv
import io
import json
import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import tools
from daemon_proc import Daemon, free_port, short_dir, wait_until

from ext.makemodel import make_model

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "haproxy" / "moed.cfg"
API_KEY = "fleet-test-key"
NAMES = ("moed1", "moed2")        # the servers of the shipped configuration, in order
DEADLINE_S = 60.0
STREAM_TOKENS = 2000              # seconds of decoding: in flight when a replica goes away

pytestmark = pytest.mark.tools("haproxy")


def test_haproxy_accepts_the_shipped_configuration():
    out = subprocess.run([tools.path("haproxy"), "-c", "-f", str(CONFIG)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Configuration file is valid" in out.stdout + out.stderr


def test_a_broken_configuration_is_refused(tmp_path):
    """The check above can fail: a server tracking one that does not exist."""
    broken = CONFIG.read_text().replace("track moed/moed2", "track moed/moed9")
    (tmp_path / "broken.cfg").write_text(broken)
    out = subprocess.run([tools.path("haproxy"), "-c", "-f", str(tmp_path / "broken.cfg")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "moed9" in out.stdout + out.stderr


def local_config(text: str, servers: dict[str, str], api: str, stats: str, stats_socket: str) -> str:
    """The shipped configuration for this machine: each `server NAME ADDRESS` of a name in
    `servers` at its address, the frontends' `bind`s at `api` and `stats` (in order), the
    stats socket at `stats_socket`, without the lines of `global` that need root
    (log, chroot, user, group). AssertionError when the file no longer has those lines."""
    out, binds = [], iter((api, stats))
    for line in text.splitlines():
        words = line.split()
        if words[:1] in (["chroot"], ["user"], ["group"]) or words[:2] == ["log", "/dev/log"]:
            continue
        if words[:2] == ["stats", "socket"]:
            line = line.replace(words[2], stats_socket)
        elif words[:1] == ["bind"]:
            line = line.replace(words[1], next(binds))
        elif words[:1] == ["server"]:
            line = line.replace(words[2], servers[words[1]])
        out.append(line)
    assert next(binds, None) is None, "the configuration lost a frontend's bind"
    return "\n".join(out) + "\n"


class HAProxy:
    """HAProxy in the foreground on `config`; `status()` reads its stats page."""

    def __init__(self, workdir: Path, config: str, stats_url: str):
        (workdir / "haproxy.cfg").write_text(config)
        self.stats_url = stats_url
        self.log = open(workdir / "haproxy.log", "w+")
        self.proc = subprocess.Popen([tools.path("haproxy"), "-db", "-f", str(workdir / "haproxy.cfg")],
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={k: v for k, v in os.environ.items() if k != "MOED_API_KEY"})
        self.http = httpx.Client(trust_env=False, timeout=10)

    def status(self) -> dict[tuple[str, str], str]:
        """(backend, server) -> status ("UP", "DOWN", "UP 1/2", ...); {} while not answering."""
        assert self.proc.poll() is None, "HAProxy exited:\n" + self.output()
        try:
            text = self.http.get(self.stats_url + ";csv").text
        except httpx.TransportError:
            return {}
        rows = csv.DictReader(io.StringIO(text.removeprefix("# ")))
        return {(r["pxname"], r["svname"]): r["status"] for r in rows
                if r["svname"] not in ("FRONTEND", "BACKEND")}

    def wait_status(self, name: str, status: str) -> None:
        """Until server `name` of backend moed has `status` (UP or DOWN, not in transition)."""
        wait_until(lambda: self.status().get(("moed", name)) == status,
                   f"HAProxy to see {name} {status}", lambda: f"{self.status()}\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-3000:]

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.log.close()


class Fleet:
    """Two daemons on loopback TCP behind HAProxy; `daemons[name]` is the one running now."""

    def __init__(self, model_dir: Path, workdir: Path):
        self.model_dir = model_dir
        self.ports = {name: free_port() for name in NAMES}
        self.state_dirs = {name: str(workdir / f"state-{name}") for name in NAMES}
        self.daemons: dict[str, Daemon] = {}
        for name in NAMES:               # both load at once
            self.daemons[name] = self._daemon(name, wait_ready=False)
        for d in self.daemons.values():
            d.wait_event("ready")
        self.url = f"http://127.0.0.1:{free_port()}"
        stats = f"127.0.0.1:{free_port()}"
        config = local_config(CONFIG.read_text(), {n: f"127.0.0.1:{p}" for n, p in self.ports.items()},
                              self.url.removeprefix("http://"), stats, str(workdir / "admin.sock"))
        self.haproxy = HAProxy(workdir, config, f"http://{stats}/stats")
        for name in NAMES:
            self.haproxy.wait_status(name, "UP")
        self.http = httpx.Client(trust_env=False, timeout=httpx.Timeout(120.0),
                                 headers={"Authorization": f"Bearer {API_KEY}"},
                                 limits=httpx.Limits(max_connections=32))

    def _daemon(self, name: str, wait_ready: bool = True) -> Daemon:
        return Daemon(self.model_dir, short_dir(), "--threads", "1",
                      "--tcp-address", f"127.0.0.1:{self.ports[name]}", "--api-key", API_KEY,
                      state_dir=self.state_dirs[name], wait_ready=wait_ready)

    def restart(self, name: str) -> None:
        """Start `name` again (its port, its state) once the previous process is gone."""
        assert self.daemons[name].proc.poll() is not None
        self.daemons[name].cleanup()
        self.daemons[name] = self._daemon(name)

    def direct(self, name: str) -> str:
        """The URL of replica `name`, bypassing HAProxy."""
        return f"http://127.0.0.1:{self.ports[name]}"

    def complete(self, session: str | None = None) -> tuple[int, str | None]:
        """One short completion through HAProxy: (status, the replica that answered)."""
        headers = {"X-Session-Id": session} if session else {}
        r = self.http.post(self.url + "/v1/completions", headers=headers, json={
            "prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        return r.status_code, r.headers.get("x-moed-server")

    def close(self) -> None:
        self.http.close()
        self.haproxy.stop()
        for d in self.daemons.values():
            if d.proc.poll() is None:
                assert d.stop() == 0
            d.cleanup()
        for path in self.state_dirs.values():
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    # a chat model (its template) big enough that a stream of STREAM_TOKENS takes seconds
    model = make_model(root / "model", arch="qwen3_moe", layers=8, experts=8, top_k=2, hidden=256,
                       intermediate=128, dtype="bf16", seed=39)
    f = Fleet(model, root)
    try:
        yield f
    finally:
        f.close()


# ---------------------------------------------------------------------- affinity


def chat_client(fleet: Fleet, session: str) -> openai.OpenAI:
    """The official client through HAProxy, naming its conversation in X-Session-Id."""
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key=API_KEY, max_retries=0,
                         default_headers={"X-Session-Id": session},
                         http_client=httpx.Client(trust_env=False, timeout=httpx.Timeout(120.0)))


def turn(client: openai.OpenAI, messages: list[dict]) -> tuple[str, str, int]:
    """(the replica that answered, the answer, cached_tokens) of one chat turn."""
    raw = client.chat.completions.with_raw_response.create(
        model="model", messages=messages, max_tokens=8, temperature=0)
    answer = raw.parse()
    return (raw.headers["x-moed-server"], answer.choices[0].message.content or "",
            answer.usage.prompt_tokens_details.cached_tokens)


FIRST = ("Here is a long question about mixture of experts models served from disk on "
         "ordinary machines, with the experts read on demand into a cache that learns "
         "which of them are hot, and the dense weights resident: why does it work?")


def test_a_conversations_second_turn_lands_on_its_replica_and_reuses_its_prefix(fleet):
    sessions = [f"conversation-{i}" for i in range(4)]
    clients = {s: chat_client(fleet, s) for s in sessions}
    try:
        firsts = {s: turn(clients[s], [{"role": "user", "content": f"{s}: {FIRST}"}])
                  for s in sessions}                    # all first turns, then all second ones
        for s in sessions:
            replica, answer, cached = firsts[s]
            assert cached == 0                          # each conversation starts its own prefix
            history = [{"role": "user", "content": f"{s}: {FIRST}"},
                       {"role": "assistant", "content": answer},
                       {"role": "user", "content": "And the second turn?"}]
            again, _, cached = turn(clients[s], history)
            assert again == replica, s
            assert cached > 0, s
            # the other replica never saw it: there the same turn reuses nothing
            other = next(n for n in NAMES if n != replica)
            r = fleet.http.post(fleet.direct(other) + "/v1/chat/completions", json={
                "model": "model", "messages": history, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, s
    finally:
        for c in clients.values():
            c.close()


def test_the_api_key_is_checked_by_the_daemons_behind_the_balancer(fleet):
    r = httpx.post(fleet.url + "/v1/completions", trust_env=False, timeout=60,
                   headers={"Authorization": "Bearer wrong"}, json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["x-moed-server"] in NAMES


# ---------------------------------------------------------------------- a replica goes away


@dataclass
class Stream:
    """One streamed completion through HAProxy, read on a thread."""

    replica: str | None = None
    chunks: int = 0
    completion_tokens: int | None = None    # the usage chunk's
    done: bool = False                      # `data: [DONE]` arrived
    finish_reason: str | None = None
    error: str | None = None                # the exception that ended the read
    started: threading.Event = field(default_factory=threading.Event)


def read_stream(fleet: Fleet, stream: Stream) -> Stream:
    body = {"prompt": "def fibonacci(n):", "max_tokens": STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with fleet.http.stream("POST", fleet.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            stream.replica = r.headers.get("x-moed-server")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    stream.done = True
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                stream.chunks += 1
                if chunk.get("usage"):
                    stream.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    stream.finish_reason = choice["finish_reason"] or stream.finish_reason
                stream.started.set()
    except httpx.HTTPError as e:
        stream.error = f"{type(e).__name__}: {e}"
    finally:
        stream.started.set()
    return stream


@pytest.mark.parametrize("how", ["sigterm", "kill -9"])
def test_a_replica_leaves_and_comes_back(fleet, how):
    victim, survivor = NAMES
    streams = [Stream() for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(read_stream, fleet, s) for s in streams]
        for s in streams:
            assert s.started.wait(DEADLINE_S)
        assert {s.replica for s in streams} == set(NAMES), streams      # leastconn: both
        assert all(not s.done and s.error is None for s in streams), streams

        daemon = fleet.daemons[victim]
        if how == "sigterm":
            daemon.signal(signal.SIGTERM)
        else:
            daemon.proc.kill()
        # from the moment it is stopped, new requests keep succeeding, on the survivor,
        # sessions included: a draining daemon's 503 and a dead one's refusal are retried
        sessions = [f"user-{i}" for i in range(4)]
        answers = [fleet.complete(session) for session in [None, None, *sessions]]
        assert answers == [(200, survivor)] * len(answers)
        ended = [f.result(DEADLINE_S * 2) for f in futures]

    for s in ended:
        if s.replica == survivor or how == "sigterm":     # a draining daemon finishes its streams
            assert s.done and s.error is None, s
            assert (s.completion_tokens, s.finish_reason) == (STREAM_TOKENS, "length"), s
        else:                                             # a killed one's end in an error
            assert not s.done and s.error is not None, s
            assert s.completion_tokens is None and s.finish_reason is None, s
    if how == "sigterm":
        assert daemon.wait_exit() == 0
        assert daemon.wait_event("stopped")["exit_code"] == 0
    else:
        daemon.kill()                                     # reaped
    fleet.haproxy.wait_status(victim, "DOWN")
    assert [fleet.complete() for _ in range(3)] == [(200, survivor)] * 3

    fleet.restart(victim)
    fleet.haproxy.wait_status(victim, "UP")
    replicas = {fleet.complete()[1] for _ in range(4)}   # leastconn alternates when both idle
    assert replicas == set(NAMES)
