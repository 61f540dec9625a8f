"""`moed serve` over its life, end to end: real subprocesses, real signals, real sockets.

Drain on SIGTERM (with and without grace), learned pins carried across a restart,
SIGHUP reloads, stale and live sockets, socket activation, sd_notify, admin calls by
peer uid, the mlock fallback, configuration precedence.

No sleeps: every wait is on a daemon log line (stderr JSON), an sd_notify datagram, a
streamed chunk or a process exit. The model is generated (ext.makemodel) with skewed
routing, so that pins learned in one session change the next one's expert misses (the
counts are deterministic: same request, same seed, same cache policy).

Some tests run a client, or the daemon itself, as uid 65534: they need root.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

import tools
from daemon_proc import MOED, Daemon, UnixHTTPConnection, short_dir
from ext.makemodel import make_model

NOBODY = 65534
CACHE_BYTES = 1536 * 1024            # 29 slots of 53248 bytes for 64 experts: ~45 % of them
TOP_K, MOE_LAYERS = 4, 4             # the cache's minimum is top_k slots per MoE layer
PROMPT = "the quick brown fox jumps over the lazy dog"
DRAINED_TOKENS = 300                 # ~2 s of decoding here: long enough to look at the drain
WAIT_S = 120.0
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)   # also its SCM_ type (Linux)


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir():
    """A qwen3_moe checkpoint with Zipf-skewed routing, readable by every user."""
    root = short_dir("moedmodel")
    os.chmod(root, 0o755)                  # the daemon may run as NOBODY
    path = make_model(os.path.join(root, "model"), arch="qwen3_moe", layers=MOE_LAYERS,
                      experts=16, top_k=TOP_K, hidden=128, intermediate=64, dtype="bf16",
                      seed=0, routing_skew=1.0)
    for p in [path, *path.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    yield path
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def workdir():
    d = short_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@contextmanager
def serving(model, workdir, *args, wait_ready=True, **kw):
    """A `moed serve` that is killed (if still running) when the block ends."""
    d = Daemon(model, workdir, *args, wait_ready=False, **kw)
    try:
        if wait_ready:
            d.wait_event("ready", WAIT_S)
        yield d
    finally:
        if d.proc.poll() is None:
            d.kill()
        d.wait_exit(WAIT_S)              # its stderr read to the end, the pipes closed
    tracebacks = [line for line in d.stderr_lines if "Traceback" in line]
    assert tracebacks == [], "".join(d.stderr_lines[-60:])


# ---------------------------------------------------------------------------- clients


def completion_body(max_tokens: int, *, stream: bool = True, seed: int = 7) -> dict:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "seed": seed,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class Stream(threading.Thread):
    """One streamed /v1/completions request, read on its own thread.

    `first` is set when the first chunk (or an error) has arrived; after `join`,
    `chunks` holds every SSE payload before [DONE] and `done` whether [DONE] came.
    """

    def __init__(self, socket_path: str, body: dict):
        super().__init__(daemon=True)
        self.socket_path, self.body = socket_path, body
        self.first = threading.Event()
        self.chunks: list[dict] = []
        self.status: int | None = None
        self.done = False
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            conn = UnixHTTPConnection(self.socket_path, timeout=WAIT_S)
            conn.request("POST", "/v1/completions", body=json.dumps(self.body).encode(),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):].strip()
                if data == b"[DONE]":
                    self.done = True
                    break
                self.chunks.append(json.loads(data))
                self.first.set()
            conn.close()
        except BaseException as e:  # reported by result()
            self.error = e
        finally:
            self.first.set()

    def result(self) -> tuple[str, str | None, dict | None]:
        """(text, finish_reason, usage) once the stream has ended."""
        self.join(WAIT_S)
        assert not self.is_alive(), "the stream did not end"
        assert self.error is None, f"stream failed: {self.error!r}"
        assert self.status == 200 and self.done, (self.status, self.chunks[-2:])
        text = "".join(c["choices"][0]["text"] for c in self.chunks if c["choices"])
        reasons = [c["choices"][0]["finish_reason"] for c in self.chunks
                   if c["choices"] and c["choices"][0]["finish_reason"] is not None]
        usage = [c["usage"] for c in self.chunks if not c["choices"]]
        assert len(reasons) == 1 and len(usage) <= 1, self.chunks[-3:]
        return text, reasons[0], usage[0] if usage else None


def finished(d: Daemon) -> list[dict]:
    return [e for e in d.events if e.get("event") == "request_finished"]


def events_named(d: Daemon, event: str) -> list[dict]:
    return [e for e in d.events if e.get("event") == event]


def usage_files(state_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(state_dir, "usage-*.json")))


def run_as(uid: int, socket_path: str, method: str, path: str, body=None) -> tuple[int, dict]:
    """One HTTP request over the Unix socket from a process running as `uid` (curl: any
    user may execute it, unlike a virtual environment under a private home)."""
    cmd = [tools.path("curl"), "-sS", "--max-time", str(WAIT_S), "--unix-socket", socket_path,
           "-X", method,
           "-H", "Content-Type: application/json", "-w", "\n%{http_code}",
           f"http://localhost{path}"]
    if body is not None:
        cmd += ["--data-binary", json.dumps(body)]
    out = subprocess.run(cmd, user=uid, capture_output=True, text=True, timeout=WAIT_S, cwd="/")
    assert out.returncode == 0, out.stderr
    text, _, status = out.stdout.rpartition("\n")
    return int(status), json.loads(text)


def as_nobody() -> tuple[str, ...]:
    """A launcher that runs the rest as NOBODY holding one capability, CAP_DAC_READ_SEARCH,
    so that it reads this checkout, its venv and its interpreter wherever they live (a
    clone under /root, mode 0700, is where a new user has it) — and none other: no
    CAP_IPC_LOCK (RLIMIT_MEMLOCK binds), no CAP_DAC_OVERRIDE (it writes only what NOBODY
    owns)."""
    return (tools.path("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            "--inh-caps=-all,+dac_read_search", "--ambient-caps=+dac_read_search",
            "--bounding-set=-all,+dac_read_search")


class NotifyListener:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET.

    `messages` are (sender pid from SCM_CREDENTIALS, datagram text) in arrival order;
    `arrived` the kernel's receive time of each (SO_TIMESTAMPNS, seconds): a Unix datagram
    is queued by the sender's sendto itself, so this is when the daemon sent it.
    """

    def __init__(self):
        self.dir = short_dir("sdn")
        self.path = os.path.join(self.dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.messages: list[tuple[int, str]] = []
        self.arrived: list[float] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        ucred, timespec = struct.calcsize("3i"), struct.calcsize("2q")
        while True:
            data, ancillary, _flags, _addr = self.sock.recvmsg(
                4096, socket.CMSG_SPACE(ucred) + socket.CMSG_SPACE(timespec))
            if self._closing:
                return
            found = {kind: cdata for level, kind, cdata in ancillary if level == socket.SOL_SOCKET}
            pid = struct.unpack("3i", found[socket.SCM_CREDENTIALS][:ucred])[0]
            sec, nsec = struct.unpack("2q", found[SO_TIMESTAMPNS][:timespec])
            with self._cond:
                self.messages.append((pid, data.decode()))
                self.arrived.append(sec + nsec / 1e9)
                self._cond.notify_all()

    def wait_for(self, text: str, count: int = 1, timeout: float = WAIT_S) -> list[str]:
        """Block until `count` datagrams starting with `text` arrived; all texts so far."""
        def enough():
            return sum(m.startswith(text) for _, m in self.messages) >= count
        with self._cond:
            assert self._cond.wait_for(enough, timeout), (text, self.messages)
            return [m for _, m in self.messages]

    def close(self) -> None:
        self._closing = True
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"", self.path)          # wakes the reader
        self._thread.join(WAIT_S)
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def notify():
    listener = NotifyListener()
    yield listener
    listener.close()


def hit_rate(line: dict) -> float:
    return line["expert_hits"] / (line["expert_hits"] + line["expert_misses"])


# ---------------------------------------------------------------------------- 1. drain


def test_sigterm_drains_a_running_request_flushes_state_and_pins_it_next_time(
        model_dir, workdir, notify):
    # Prefetch off: the second session's misses then show what the learned pins alone
    # change (on a model this small, prefetch into idle io workers fills the same slots).
    args = ("--expert-cache-bytes", str(CACHE_BYTES), "--shutdown-grace-s", "120", "--no-prefetch")
    with serving(model_dir, workdir, *args, env={"NOTIFY_SOCKET": notify.path}) as d:
        status, pins = d.json("GET", "/v1/moed/pins")
        assert status == 200 and pins["pins"] == []          # nothing learned yet
        fingerprint = pins["model_fingerprint"]
        assert usage_files(d.state_dir) == []
        assert events_named(d, "slot_arena_mlock_refused") == []  # root may mlock

        stream = Stream(d.socket, completion_body(DRAINED_TOKENS))
        assert stream.first.wait(WAIT_S) and stream.chunks, stream.error
        d.signal(signal.SIGTERM)
        notify.wait_for("STOPPING=1")
        # draining: the running request goes on, new ones are turned away
        assert d.json("GET", "/health") == (503, {"status": "draining", "reason": "shutting down"})
        status, body = d.json("POST", "/v1/completions", completion_body(4, stream=False))
        assert (status, body["error"]["code"]) == (503, "shutting_down")
        assert stream.is_alive()

        assert d.wait_exit(WAIT_S) == 0
        text1, reason, usage = stream.result()
        assert (reason, usage["completion_tokens"]) == ("length", DRAINED_TOKENS)
        (line1,) = finished(d)
        assert (line1["finish_reason"], line1["completion_tokens"], line1["decode_steps"]) == (
            "length", DRAINED_TOKENS, DRAINED_TOKENS - 1)
        assert [e for e in d.events if e.get("event") == "shutdown_grace_expired"] == []
        assert d.events[-1]["event"] == "stopped" and d.events[-1]["exit_code"] == 0
        assert not os.path.lexists(d.socket) and not os.path.lexists(d.socket + ".lock")

    (state_file,) = usage_files(d.state_dir)
    state = json.loads(Path(state_file).read_text())
    assert state["fingerprint"] == fingerprint
    # every routed token counted once: the prompt, then each fed-back token but the last
    routed = usage["prompt_tokens"] + DRAINED_TOKENS - 1
    assert (state["tokens"], state["payload"]["tokens_observed"]) == (routed, routed)
    assert sum(map(sum, state["payload"]["counts"])) > 0

    # what the pin learner and the referee settled on is saved beside the counts
    learned = state["payload"]["learned"]
    assert 0.0 <= learned["pin_share"] <= 0.5 and learned["pin_source"] in ("long", "recent")
    with serving(model_dir, workdir, *args) as d2:
        status, pins = d2.json("GET", "/v1/moed/pins")
        assert status == 200 and pins["model_fingerprint"] == fingerprint
        stats2 = d2.json("GET", "/v1/moed/stats")[1]
        total_slots = CACHE_BYTES // stats2["cache"]["slot_bytes"]
        # the next start pins the share the first session validated, from what it learned
        assert len(pins["pins"]) == int((total_slots - TOP_K * MOE_LAYERS) * learned["pin_share"])
        assert stats2["adaptation"]["pin_learning"]["share"] == learned["pin_share"]
        counts = state["payload"]["counts"]
        for pin in pins["pins"]:      # the hottest experts of what was learned
            row = counts[pin["layer"]]
            assert pin["score"] > 0 and row[pin["expert"]] >= sorted(row)[len(row) // 2]
        text2, reason, _ = Stream(d2.socket, completion_body(DRAINED_TOKENS)).result()
        assert (text2, reason) == (text1, "length")     # placement never changes output
        line2 = d2.wait_event("request_finished")   # logged just after the last chunk went
        assert len(finished(d2)) == 1
        assert hit_rate(line2) > 0
        assert d2.stop() == 0


# ------------------------------------------------------------------ 1b. read-only state


def read_only_launcher(directory: str) -> tuple[str, ...]:
    """Run the daemon in a mount namespace where `directory` is a read-only bind mount
    (skips where this process may not make one)."""
    unshare, mount = tools.path("unshare"), tools.path("mount")
    probe = subprocess.run([unshare, "-m", mount, "--bind", "-o", "ro", directory, directory],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {probe.stderr.strip()}")
    return (unshare, "-m", "sh", "-c",
            f'{mount} --bind -o ro "$0" "$0" && exec "$@"', directory)


@pytest.mark.slow     # ~10 s: two daemons, one in a read-only mount namespace
@pytest.mark.tools("unshare", "mount")
def test_a_read_only_state_directory_is_read_and_used_and_warned_about_once(model_dir, workdir):
    args = ("--expert-cache-bytes", str(CACHE_BYTES), "--no-prefetch")
    with serving(model_dir, workdir, *args) as d:          # learn, and save on SIGTERM
        status, _ = d.json("POST", "/v1/completions", completion_body(64, stream=False))
        assert status == 200
        assert d.stop() == 0
    (state_file,) = usage_files(d.state_dir)
    saved = Path(state_file).read_bytes()
    with serving(model_dir, workdir, *args, launcher=read_only_launcher(d.state_dir)) as ro:
        # the learned usage is in use: the empty cache was warm-started from it (pins
        # come only with a share the learner validated, which 64 tokens may not give)
        status, stats = ro.json("GET", "/v1/moed/stats")
        assert status == 200 and stats["experts"]["bytes_read_by_reason"]["pin_load"] > 0
        assert stats["experts"]["bytes_read_by_reason"]["demand"] == 0
        status, _ = ro.json("POST", "/v1/completions", completion_body(64, stream=False))
        assert status == 200
        status, body = ro.json("POST", "/v1/moed/pins/reset")
        assert status == 200 and body["reset"] is True      # in memory; the file stays
        assert ro.stop() == 0
        warnings = [e for e in ro.events if e["level"] in ("warning", "error")]
        assert [e["event"] for e in warnings] == ["state_dir_read_only"], warnings
        assert warnings[0]["learned_usage_loaded"] is True
        assert warnings[0]["state_dir"] == d.state_dir
    assert Path(state_file).read_bytes() == saved            # nothing written
    assert usage_files(d.state_dir) == [state_file]


def test_a_state_file_whose_transitions_do_not_fit_is_set_aside_and_the_daemon_serves(
        model_dir, workdir):
    """Next-step statistics hand-edited out of range (totals an integer no float holds,
    which JSON allows): the daemon starts, sets the file aside naming the field, serves,
    and saves what it learns in a new file."""
    from ext.formats.checkpoint import Checkpoint
    from ext.models.config import load_config
    from scheduler.usage import UsageStats

    config = load_config(model_dir)
    moe = [l for l, m in enumerate(config.moe_layers) if m]
    fingerprint = Checkpoint(model_dir).fingerprint()
    stats = UsageStats(moe, config.num_experts, 2048.0)
    stats.observe(moe[0], [0, 1])
    payload = stats.to_dict(fingerprint)
    bad = {"totals": [10 ** 400] * config.num_experts, "next": "A" * (4 * -(-config.num_experts ** 2 // 3))}
    payload["learned"] = {"transitions": {"encoding": "u8-rows-base64", "layers": [bad] + [None] * (len(moe) - 1)}}
    state_dir = os.path.join(workdir, "state")
    os.makedirs(state_dir, mode=0o700)
    state_file = os.path.join(state_dir, f"usage-{fingerprint[:16]}.json")
    Path(state_file).write_text(json.dumps({"version": 1, "fingerprint": fingerprint, "written_unix": 1.0,
                                            "tokens": 2, "payload": payload}))
    with serving(model_dir, workdir, "--expert-cache-bytes", str(CACHE_BYTES), "--no-prefetch") as d:
        status, body = d.json("POST", "/v1/completions", completion_body(16, stream=False))
        assert status == 200 and body["usage"]["completion_tokens"] == 16
        assert d.stop() == 0
    warnings = [e for e in d.events if e["level"] in ("warning", "error")]
    assert [e["event"] for e in warnings] == ["state_file_set_aside"], warnings
    assert "learned.transitions.layers[0].totals" in warnings[0]["reason"]
    assert len(glob.glob(state_file + ".corrupt-*")) == 1
    saved = json.loads(Path(state_file).read_text())["payload"]
    assert saved["tokens_observed"] > 0 and saved["learned"]["transitions"]["layers"][0] is not None


# ---------------------------------------------------------------------------- 2. no grace


def test_sigterm_without_grace_cancels_the_running_request_and_exits_0(model_dir, workdir):
    args = ("--expert-cache-bytes", str(CACHE_BYTES), "--shutdown-grace-s", "0")
    with serving(model_dir, workdir, *args) as d:
        stream = Stream(d.socket, completion_body(4000))
        assert stream.first.wait(WAIT_S) and stream.chunks, stream.error
        signalled = time.monotonic()
        d.signal(signal.SIGTERM)
        assert d.wait_exit(WAIT_S) == 0
        took = time.monotonic() - signalled
        _text, reason, usage = stream.result()
        assert reason == "cancelled" and 1 <= usage["completion_tokens"] < 4000
        (line,) = finished(d)
        assert line["finish_reason"] == "cancelled"
        assert line["completion_tokens"] == usage["completion_tokens"]
        assert line["decode_steps_after_cancel"] <= 1
        d.wait_event("shutdown_grace_expired", grace_s=0.0)
        assert len(usage_files(d.state_dir)) == 1          # flushed even so
        assert not os.path.lexists(d.socket)
        # 4000 tokens take minutes here; stopping took a decode step plus the exit
        assert took < 15, took


# ---------------------------------------------------------------------------- 3. SIGHUP


def _stats(d: Daemon) -> tuple[int, int, int]:
    """(max_concurrent_sequences, cache budget bytes, cache slots) from /v1/moed/stats."""
    status, s = d.json("GET", "/v1/moed/stats")
    assert status == 200
    cache = s["cache"]
    return (s["requests"]["max_concurrent_sequences"], s["memory"]["budget_bytes"],
            cache["pinned"]["slots"] + cache["dynamic"]["slots"] + cache["staging"]["slots"])


def _reload(d: Daemon, config: Path, text: str, event: str) -> dict:
    config.write_text(text)
    start = d.mark()
    d.signal(signal.SIGHUP)
    return d.wait_event(event, from_index=start)


def test_sighup_reloads_limits_and_cache_and_keeps_the_old_config_when_the_new_is_bad(
        model_dir, workdir):
    config = Path(workdir, "moed.toml")
    config.write_text('max_concurrent_sequences = 2\nexpert_cache_bytes = "1M"\n')
    with serving(model_dir, workdir, "--config", str(config)) as d:
        slot = d.json("GET", "/v1/moed/stats")[1]["cache"]["slot_bytes"]
        assert _stats(d) == (2, 2**20, 2**20 // slot)

        line = _reload(d, config, 'max_concurrent_sequences = 3\nexpert_cache_bytes = "1536K"\n',
                       "reloaded")
        assert line["changed"] == ["expert_cache_bytes", "max_concurrent_sequences"]
        assert line["applied"] == line["changed"] and line["needs_restart"] == []
        new = (3, CACHE_BYTES, CACHE_BYTES // slot)
        assert _stats(d) == new

        line = _reload(d, config, "max_concurrent_sequences = [\n", "reload_failed")
        assert "is not valid TOML" in line["error"] and str(config) in line["error"]
        assert _stats(d) == new

        line = _reload(d, config, "max_concurrent_sequences = 1\nbogus_key = 1\n", "reload_failed")
        assert line["error"].startswith(f"bogus_key (config file {config}): unknown key")
        assert _stats(d) == new

        # valid as configuration, refused when applied: nothing of it may stay applied
        line = _reload(d, config, 'max_concurrent_sequences = 1\nexpert_cache_bytes = "64K"\n',
                       "reload_failed")
        assert "minimum" in line["error"]
        assert _stats(d) == new

        status, body = d.json("POST", "/v1/completions", completion_body(5, stream=False))
        assert status == 200 and body["usage"]["completion_tokens"] == 5
        assert d.stop() == 0


def test_a_naive_cache_stays_naive_across_a_reload(model_dir, workdir):
    """expert_cache_mode = "naive" is the baseline moed demo measures against: a reload may
    change its budget, but neither the mode nor pins nor prefetch without a restart (nor
    the numerics, which the kernels are built with at load)."""
    config = Path(workdir, "moed.toml")
    config.write_text(f'expert_cache_mode = "naive"\nexpert_cache_bytes = {CACHE_BYTES}\n'
                      "prefetch = false\n")
    with serving(model_dir, workdir, "--config", str(config)) as d:
        assert d.json("GET", "/v1/moed/stats")[1]["cache"]["pinned"]["slots"] == 0
        start = d.mark()
        line = _reload(d, config, f'expert_cache_mode = "moed"\nexpert_cache_bytes = {CACHE_BYTES}\n'
                                  "pin_fraction = 1.0\nprefetch = true\nnumerics = \"exact\"\n",
                       "reloaded")
        restart = d.wait_event("reload_needs_restart", from_index=start)
        assert restart["keys"] == ["expert_cache_mode", "numerics", "pin_fraction", "prefetch"]
        assert line["applied"] == []
        assert line["needs_restart"] == restart["keys"] == line["changed"]
        assert d.json("GET", "/v1/moed/stats")[1]["cache"]["pinned"]["slots"] == 0
        assert d.stop() == 0


# ---------------------------------------------------------------------------- 4. sockets


@pytest.mark.slow     # ~13 s: a daemon per socket case
def test_stale_socket_is_replaced_and_a_live_one_or_a_file_is_refused(model_dir, workdir):
    args = ("--expert-cache-bytes", str(CACHE_BYTES))
    with serving(model_dir, workdir, *args) as first:
        first.kill()
    assert stat.S_ISSOCK(os.lstat(first.socket).st_mode)   # left behind by kill -9

    with serving(model_dir, workdir, *args) as d:
        d.wait_event("stale_socket_replaced", socket=d.socket, reason="nothing answered on it")
        assert d.json("GET", "/health") == (200, {"status": "ok"})
        bound = os.lstat(d.socket).st_ino

        with serving(model_dir, workdir, *args, wait_ready=False) as second:
            assert second.wait_exit(WAIT_S) == 1
        assert f"moed serve: error: another moed serves {d.socket}" in "".join(second.stderr_lines)
        assert events_named(second, "expert_cache_built") == []       # the model was not loaded
        assert [e for e in second.events if e.get("event") in ("socket_listening", "ready")] == []
        assert os.lstat(d.socket).st_ino == bound
        assert d.json("GET", "/health") == (200, {"status": "ok"})

        # a server that is not moed (no lock file) answering on the path
        foreign = os.path.join(workdir, "foreign.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(foreign)
            server.listen()
            with serving(model_dir, workdir, *args, socket_path=foreign, wait_ready=False) as other:
                assert other.wait_exit(WAIT_S) == 1
            assert f"another moed serves {foreign}" in "".join(other.stderr_lines)
            assert stat.S_ISSOCK(os.lstat(foreign).st_mode)

        regular = os.path.join(workdir, "regular.sock")
        Path(regular).write_text("not a socket")
        with serving(model_dir, workdir, *args, socket_path=regular, wait_ready=False) as other:
            assert other.wait_exit(WAIT_S) == 1
        assert f"{regular} exists and is not a socket" in "".join(other.stderr_lines)
        assert Path(regular).read_text() == "not a socket"
        assert d.stop() == 0


# ---------------------------------------------------------------------------- 5. activation


@pytest.mark.tools("systemd-socket-activate")
def test_socket_activation_serves_the_inherited_socket_and_leaves_its_file_alone(
        model_dir, workdir):
    path = os.path.join(workdir, "activated.sock")
    none = os.path.join(workdir, "none.toml")
    launcher = (tools.path("systemd-socket-activate"), "-l", path)
    # --socket-mode 0600 would be applied if moed bound the path itself
    with serving(model_dir, workdir, "--config", none, "--socket-mode", "0600",
                 "--expert-cache-bytes", str(CACHE_BYTES), socket_path=path,
                 launcher=launcher, wait_ready=False) as d:
        d.wait_line(f"Listening on {path} as 3.")
        before = os.lstat(path)
        # the first connection makes systemd-socket-activate exec moed with LISTEN_FDS=1
        status, body = d.json("GET", "/health")
        assert (status, body) in ((200, {"status": "ok"}),
                                  (503, {"status": "loading", "reason": "loading the model"}))
        ready = d.wait_event("ready", WAIT_S)
        assert ready["socket"] == path
        status, body = d.json("POST", "/v1/completions", completion_body(6, stream=False))
        assert status == 200 and body["usage"]["completion_tokens"] == 6
        after = os.lstat(path)
        assert (after.st_ino, stat.S_IMODE(after.st_mode), after.st_uid, after.st_gid) == (
            before.st_ino, stat.S_IMODE(before.st_mode), before.st_uid, before.st_gid)
        assert stat.S_IMODE(after.st_mode) != 0o600
        assert d.stop() == 0
    assert stat.S_ISSOCK(os.lstat(path).st_mode)     # the service manager's file stays
    assert not os.path.lexists(path + ".lock")


# ---------------------------------------------------------------------------- 6. sd_notify


@pytest.mark.parametrize("watchdog_pid", ["unset", "own", "other"])
def test_sd_notify_lifecycle(model_dir, workdir, notify, watchdog_pid):
    env = {"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "500000"}
    launcher: tuple[str, ...] = ()
    if watchdog_pid == "own":      # as systemd does: the pid of the process it execs
        launcher = ("/bin/sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh")
    elif watchdog_pid == "other":
        env["WATCHDOG_PID"] = "1"
    with serving(model_dir, workdir, "--expert-cache-bytes", str(CACHE_BYTES), env=env,
                 launcher=launcher) as d:
        notify.wait_for("READY=1")
        notify.wait_for("STATUS=")
        if watchdog_pid != "other":
            notify.wait_for("WATCHDOG=1", count=2)
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        d.signal(signal.SIGHUP)
        notify.wait_for("READY=1", count=2)
        after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        d.wait_event("reloaded", changed=[])
        d.signal(signal.SIGTERM)
        notify.wait_for("STOPPING=1")
        assert d.wait_exit(WAIT_S) == 0

    messages = notify.messages
    assert {pid for pid, _ in messages} == {d.proc.pid}
    texts = [m for _, m in messages]
    lifecycle = [m for m in texts if not m.startswith(("STATUS=", "WATCHDOG=1"))]
    reloading = next(m for m in lifecycle if m.startswith("RELOADING=1"))
    assert lifecycle == ["EXTEND_TIMEOUT_USEC=60000000", "READY=1", reloading, "READY=1",
                         "STOPPING=1"]
    first, second = reloading.split("\n")
    key, value = second.split("=")
    assert first == "RELOADING=1" and key == "MONOTONIC_USEC" and before <= int(value) <= after
    ready = texts.index("READY=1")
    status = [m for m in texts if m.startswith("STATUS=")]
    assert status and texts.index(status[0]) > ready
    assert all(m.startswith("STATUS=") and " tokens/s, hit rate " in m for m in status)
    pings = [i for i, m in enumerate(texts) if m == "WATCHDOG=1"]
    if watchdog_pid == "other":
        assert pings == []            # the watchdog is another process's
    else:
        assert len(pings) >= 2 and pings[0] > ready and pings[-1] < texts.index("STOPPING=1")
        gaps = [notify.arrived[j] - notify.arrived[i] for i, j in zip(pings, pings[1:])]
        assert min(gaps) >= 0.249, gaps          # every 250 ms: half of WATCHDOG_USEC


# ---------------------------------------------------------------------------- 7. admin, mlock


@pytest.mark.tools("curl")
def test_admin_calls_are_refused_to_other_users(model_dir, workdir):
    os.chmod(workdir, 0o755)
    args = ("--expert-cache-bytes", str(CACHE_BYTES), "--socket-mode", "0666")
    with serving(model_dir, workdir, *args) as d:
        assert stat.S_IMODE(os.lstat(d.socket).st_mode) == 0o666
        status, body = d.json("POST", "/v1/completions", completion_body(8, stream=False))
        assert status == 200
        assert run_as(NOBODY, d.socket, "GET", "/health") == (200, {"status": "ok"})
        status, body = run_as(NOBODY, d.socket, "POST", "/v1/moed/pins/reset")
        assert status == 403
        assert (body["error"]["type"], body["error"]["code"]) == ("permission_error",
                                                                  "permission_denied")
        assert usage_files(d.state_dir) == []            # refused before anything was done

        status, body = d.json("POST", "/v1/moed/pins/reset")
        assert status == 200 and body == {"reset": True, "pins_dropped": 0}
        (state_file,) = usage_files(d.state_dir)
        state = json.loads(Path(state_file).read_text())
        assert state["tokens"] == 0
        assert all(c == 0 for row in state["payload"]["counts"] for c in row)
        assert events_named(d, "slot_arena_mlock_refused") == []
        assert d.stop() == 0


@pytest.mark.tools("curl", "prlimit", "setpriv")
def test_mlock_refused_falls_back_and_the_daemons_own_user_is_admin(model_dir, workdir):
    os.chmod(workdir, 0o755)
    os.chown(workdir, NOBODY, NOBODY)               # its state dir and socket go here
    memlock = 64 * 1024                              # below the 1.5 MiB slot arena
    with serving(model_dir, workdir, "--expert-cache-bytes", str(CACHE_BYTES),
                 "--socket-mode", "0666",
                 launcher=(tools.path("prlimit"), f"--memlock={memlock}:{memlock}", *as_nobody())
                 ) as d:
        slot = d.json("GET", "/v1/moed/stats")[1]["cache"]["slot_bytes"]
        (refused,) = events_named(d, "slot_arena_mlock_refused")
        assert refused["level"] == "warning" and refused["logger"] == "moed.io"
        assert refused["bytes"] == CACHE_BYTES // slot * slot and refused["error"]
        assert refused["rlimit_memlock"] == f"{memlock}/{memlock}"
        assert refused["effect"] == "slots stay pageable"
        status, body = d.json("POST", "/v1/completions", completion_body(8, stream=False))
        assert status == 200 and body["usage"]["completion_tokens"] == 8   # serves pageable

        status, body = run_as(NOBODY, d.socket, "POST", "/v1/moed/pins/reset")
        assert status == 200 and body["reset"] is True          # the daemon's own uid
        assert os.stat(usage_files(d.state_dir)[0]).st_uid == NOBODY
        assert d.json("POST", "/v1/moed/pins/reset")[0] == 200  # root
        assert run_as(NOBODY - 1, d.socket, "POST", "/v1/moed/pins/reset")[0] == 403
        assert d.stop() == 0


# ---------------------------------------------------------------------------- 8. config


def _cap(d: Daemon) -> int:
    """The max_tokens cap in force: what a request asking for more gets."""
    status, body = d.json("POST", "/v1/completions", completion_body(50, stream=False))
    assert status == 200
    return body["usage"]["completion_tokens"]


def test_config_precedence_flag_over_environment_over_file(model_dir, workdir):
    config = Path(workdir, "moed.toml")
    config.write_text('max_tokens = 9\nexpert_cache_bytes = "1536K"\n')
    with serving(model_dir, workdir, "--config", str(config)) as d:
        assert _cap(d) == 9
        assert d.stop() == 0
    with serving(model_dir, workdir, "--config", str(config),
                 env={"MOED_MAX_TOKENS": "7", "MOED_FOO": "1"}) as d:
        assert _cap(d) == 7
        (warning,) = events_named(d, "config_warning")
        assert warning["level"] == "warning"
        assert warning["warning"].startswith("unknown environment variable MOED_FOO")
        assert d.stop() == 0
    with serving(model_dir, workdir, "--config", str(config), "--max-tokens", "5",
                 env={"MOED_MAX_TOKENS": "7"}) as d:
        assert _cap(d) == 5
        assert d.stop() == 0


def test_unknown_key_in_the_config_file_is_a_startup_error(model_dir, workdir):
    config = Path(workdir, "moed.toml")
    config.write_text("max_tokens = 9\nmax_tokenz = 10\n")
    with serving(model_dir, workdir, "--config", str(config), wait_ready=False) as d:
        assert d.wait_exit(WAIT_S) == 1
    stderr = "".join(d.stderr_lines)
    assert (f"moed serve: error: max_tokenz (config file {config}): unknown key "
            "(did you mean max_tokens?)") in stderr
    assert not os.path.lexists(d.socket)
