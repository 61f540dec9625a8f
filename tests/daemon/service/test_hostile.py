"""`moed serve` against hostile clients: each attack is bounded and nothing else suffers.

The real daemon subprocess with short limits: a slowloris connection that trickles its
headers is closed at header_timeout_s; a body shorter than its Content-Length is a 408 at
body_timeout_s; a listener holding max_connections answers the next connection 503 at
once (the Unix socket and the TCP metrics listener alike); what aiohttp cannot parse as
HTTP/1.1 (header bombs, a NUL byte in a header, a negative Content-Length, TLS, HTTP/2) is
a 400 in OpenAI's error shape and at most one warning line, without traceback; a request
that expects 100-continue with a Content-Length over max_body_bytes is a 413 without the
100 (and an unknown expectation a 417); a chat
template bomb in the model directory is a 400; and through all of it the daemon keeps
serving and every line it logs is JSON. A shard whose expert bytes vanish makes /health
say "degraded" until a read succeeds again (restored in place or by a copy renamed over
it), and memory-mapped experts survive shards cut and restored while they are read;
experts whose weights hold NaN degrade /health too, until they compute finite rows, and
do not stop streamed experts from starting when the tuner's check prompt meets them. No
sleeps: each wait is for the daemon's answer or its close, bounded by a deadline.
"""
from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import threading
import time
from pathlib import Path

import pytest
from daemon_proc import Daemon, short_dir

from daemon.service import app as app_module
from daemon.store.streaming import minimum_cache_bytes
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout

TEMPLATE_MAX_CHARS = 100_000
TEMPLATE_TIMEOUT_S = 0.5
# A chat template from a hostile model directory: normal, unless the first message asks
# for one of its bombs (so that normal chat requests show the daemon unaffected).
HOSTILE_TEMPLATE = """\
{%- if messages[0].content == "many" -%}
{%- for i in range(5000) %}{% for j in range(1000) %}xxxxxxxxxx{% endfor %}{% endfor -%}
{%- elif messages[0].content == "one" -%}
{{ "y" * 30000000 }}
{%- elif messages[0].content == "slow" -%}
{%- for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor -%}
{%- else -%}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
{%- endif -%}
"""
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 4
DEADLINE_S = 30.0       # a bound on each wait, far above the timeouts under test


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = make_model(tmp_path_factory.mktemp("hostile") / "model", arch="qwen3_moe", layers=2,
                     experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=0)
    (out / "chat_template.jinja").write_text(HOSTILE_TEMPLATE)   # takes precedence
    return out


@pytest.fixture(scope="module")
def daemon(model_dir):
    d = Daemon(model_dir, short_dir(), "--threads", "1",
               "--header-timeout-s", str(HEADER_TIMEOUT_S),
               "--body-timeout-s", str(BODY_TIMEOUT_S),
               "--max-connections", str(MAX_CONNECTIONS),
               "--chat-template-max-chars", str(TEMPLATE_MAX_CHARS),
               "--chat-template-timeout-s", str(TEMPLATE_TIMEOUT_S))
    try:
        yield d
        assert d.stop() == 0
        not_json = [line for line in d.stderr_lines if not _is_json(line)]
        assert not_json == [], "".join(not_json)
    finally:
        d.cleanup()


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def unix_connection(d: Daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(DEADLINE_S)
    sock.connect(d.socket)
    return sock


def metrics_connection(d: Daemon) -> socket.socket:
    host, port = d.wait_event("metrics_listening")["address"].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=DEADLINE_S)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (bounded by the socket's timeout)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def serving(d: Daemon) -> bool:
    """A normal completion still gets its answer."""
    status, body = d.json("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                       "temperature": 0})
    return status == 200 and body["usage"]["completion_tokens"] >= 1


def test_a_connection_that_trickles_its_headers_is_closed_at_the_header_timeout(daemon):
    sock = unix_connection(daemon)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
    started = time.monotonic()
    closed = False
    # slowloris: one more header byte whenever the server has said nothing for a while
    while time.monotonic() - started < DEADLINE_S:
        readable, _, _ = select.select([sock], [], [], 0.1)
        if readable:
            closed = sock.recv(1024) == b""
            break
        try:
            sock.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
    elapsed = time.monotonic() - started
    sock.close()
    assert closed, f"still open after {elapsed:.1f} s of trickled headers"
    assert elapsed >= HEADER_TIMEOUT_S * 0.9
    assert serving(daemon)


def test_a_body_shorter_than_its_content_length_is_a_408_at_the_body_timeout(daemon):
    body = b'{"prompt": "hi"'
    with unix_connection(daemon) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + body)
        started = time.monotonic()
        answer = read_all(sock)             # the daemon answers and closes
        elapsed = time.monotonic() - started
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert b"Connection: close" in head
    error = json.loads(payload)["error"]
    assert error["code"] == "request_timeout" and "body_timeout_s" in error["message"]
    assert f"{len(body)} of 1000 bytes" in error["message"]
    assert BODY_TIMEOUT_S * 0.9 <= elapsed < DEADLINE_S
    assert serving(daemon)


def _expecting(d: Daemon, length: int, expect: str = "100-continue") -> tuple[socket.socket, bytes]:
    """Send a completion's head with `Expect` and no body; the connection and the first
    thing the daemon answers (up to the end of a head)."""
    sock = unix_connection(d)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\nExpect: %s\r\n\r\n"
                 % (length, expect.encode()))
    first = b""
    while b"\r\n\r\n" not in first and (chunk := sock.recv(65536)):
        first += chunk
    return sock, first


def test_an_expect_100_continue_over_max_body_bytes_is_a_413_without_the_100(daemon):
    limit = 1 << 20                                     # max_body_bytes' default
    sock, first = _expecting(daemon, limit + 1)
    with sock:
        answer = first + read_all(sock)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
    assert b"100 Continue" not in answer
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_too_large" and f"{limit + 1} bytes" in error["message"]

    # within the limit: 100 Continue, then the body, then the answer
    body = json.dumps({"prompt": "hi", "max_tokens": 1, "temperature": 0}).encode()
    sock, first = _expecting(daemon, len(body))
    with sock:
        assert first == b"HTTP/1.1 100 Continue\r\n\r\n", first[:300]
        sock.sendall(body)
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]

    sock, first = _expecting(daemon, len(body), expect="something-else")
    with sock:
        answer = first + read_all(sock)
    assert answer.startswith(b"HTTP/1.1 417 "), answer[:300]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "expectation_failed"
    assert serving(daemon)


@pytest.mark.parametrize("listener", ["socket", "metrics"])
def test_a_listener_at_its_connection_cap_answers_503_and_serves_again_after(daemon, listener):
    connect = unix_connection if listener == "socket" else metrics_connection
    held = [connect(daemon) for _ in range(MAX_CONNECTIONS)]
    try:
        # the kernel queues connections in order: the daemon accepts the held ones first
        extra = connect(daemon)
        try:
            answer = read_all(extra)
        finally:
            extra.close()
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), answer[:300]
        assert b"Retry-After: 1" in head and b"Connection: close" in head
        error = json.loads(payload)["error"]
        assert error["code"] == "too_many_connections"
        assert f"{listener} listener" in error["message"] and "max_connections" in error["message"]
        refused = daemon.wait_event("connection_refused", listener=listener)
        assert refused["limit"] == MAX_CONNECTIONS
    finally:
        for sock in held:
            sock.close()
    # the held ones are gone: the listener serves again
    if listener == "socket":
        assert serving(daemon)
    else:
        sock = metrics_connection(daemon)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = read_all(sock)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 200 ") and b"moed_connections_refused_total" in answer
        assert b'moed_connections_refused_total{listener="metrics"} 1.0' in answer


# What aiohttp refuses before the application sees a request: too many or too long
# headers, a negative Content-Length, a TLS ClientHello and the HTTP/2 preface.
NOT_HTTP11 = {
    "too_many_headers": b"GET /health HTTP/1.1\r\nHost: x\r\n"
                        + b"".join(b"X-%d: y\r\n" % i for i in range(1000)) + b"\r\n",
    "header_too_long": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000
                       + b"\r\n\r\n",
    "negative_content_length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Type: application/json\r\nContent-Length: -1\r\n\r\n{}",
    # a TLS 1.2 ClientHello's record and handshake headers, then a zeroed body
    "tls_client_hello": bytes.fromhex("16030100c4010000c00303") + bytes(193),
    "http2_preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"),
    "nul_in_header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
}


@pytest.mark.parametrize("attack", sorted(NOT_HTTP11))
def test_what_aiohttp_cannot_parse_is_answered_in_openai_error_shape(daemon, attack):
    with unix_connection(daemon) as sock:
        sock.sendall(NOT_HTTP11[attack])
        answer = read_all(sock)             # answered, then closed
    head, _, payload = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].split()[1] == "400", answer[:300]
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert headers["content-type"].startswith("application/json")
    assert headers["connection"] == "close"
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http_request"
    assert error["message"].startswith("the request is not HTTP/1.1 that moed can read: ")
    assert len(error["message"]) < 400      # aiohttp's echo of the client's bytes is cut
    assert serving(daemon)


@pytest.mark.parametrize("attack", sorted(NOT_HTTP11))
def test_what_aiohttp_cannot_parse_is_at_most_one_warning_line_without_traceback(daemon, attack):
    """The client's bytes are at fault, not the daemon: no error line, no traceback."""
    start = daemon.mark()
    with unix_connection(daemon) as sock:
        sock.sendall(NOT_HTTP11[attack])
        read_all(sock)
    assert serving(daemon)
    finished = daemon.wait_event("request_finished", from_index=start)
    lines = daemon.events[start:daemon.events.index(finished)]
    assert [e for e in lines if e["level"] not in ("info", "warning") or "exception" in e] == []
    unreadable = [e for e in lines if e["event"] == "http_request_unreadable"]
    assert len(unreadable) <= 1 and all(e["level"] == "warning" for e in unreadable)
    if attack == "nul_in_header":
        assert unreadable[0]["status"] == 400
        assert unreadable[0]["error"].startswith("Invalid header value char")


def test_the_aiohttp_methods_the_json_error_handler_relies_on_are_unchanged():
    """daemon/service/connections.py's ApiErrorRequestHandler overrides aiohttp's
    `RequestHandler.handle_error` and builds its handlers as `Server.__call__` does: when an
    aiohttp release changes either, this fails, so that the subclass is checked against it
    (then update the digests below and the aiohttp version in its docstring)."""
    import hashlib
    import inspect

    import aiohttp
    from aiohttp.web_protocol import RequestHandler
    from aiohttp.web_server import Server

    from daemon.service.connections import ApiErrorRequestHandler

    checked = {"RequestHandler.handle_error": "94962ffef500c172", "Server.__call__": "c5700549e688b164"}
    now = {f.__qualname__: hashlib.sha256(inspect.getsource(f).encode()).hexdigest()[:16]
           for f in (RequestHandler.handle_error, Server.__call__)}
    assert now == checked, (f"aiohttp {aiohttp.__version__} changed what ApiErrorRequestHandler "
                            "overrides or mirrors: check it against the new source")
    assert (inspect.signature(ApiErrorRequestHandler.handle_error).parameters.keys()
            == inspect.signature(RequestHandler.handle_error).parameters.keys())


def chat(d: Daemon, content: str) -> tuple[int, dict]:
    return d.json("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0})


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("bomb, says", [
    ("many", f"more than {TEMPLATE_MAX_CHARS} characters (chat_template_max_chars)"),
    ("one", f"more than {TEMPLATE_MAX_CHARS} characters (chat_template_max_chars)"),
    ("slow", f"took longer than {TEMPLATE_TIMEOUT_S:g} s to render (chat_template_timeout_s)"),
])
def test_a_chat_template_bomb_is_a_400_and_nothing_else_is_affected(daemon, bomb, says):
    status, body = chat(daemon, "hello")                  # the template works for others
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    before = rss_bytes(daemon.proc.pid)
    status, body = chat(daemon, bomb)
    assert status == 400, body
    assert body["error"]["param"] == "messages" and says in body["error"]["message"]
    # the daemon did not hold the text (tens of MB without the bound; its render ran in
    # a worker process), and it goes on serving chats and completions
    assert rss_bytes(daemon.proc.pid) - before < 16 << 20
    status, body = chat(daemon, "hello again")
    assert status == 200
    assert serving(daemon)
    assert daemon.json("GET", "/health") == (200, {"status": "ok"})


def test_the_api_key_is_compared_in_constant_time(monkeypatch):
    seen = []

    def spy(a, b):
        seen.append((a, b))
        return a == b
    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    assert app_module.api_key_matches("Bearer s3cret", "s3cret")
    assert not app_module.api_key_matches("Bearer s3cre", "s3cret")
    assert not app_module.api_key_matches("Basic s3cret", "s3cret")
    assert not app_module.api_key_matches("", "s3cret")
    assert seen[:2] == [(b"s3cret", b"s3cret"), (b"s3cre", b"s3cret")]


def test_an_api_key_header_that_is_not_utf8_is_a_mismatch_not_an_error():
    """aiohttp hands a header's non-UTF-8 bytes over as lone surrogates (surrogateescape):
    they are compared as the bytes sent, never encoded strictly (a UnicodeEncodeError, a
    500). A key from the environment with the same bytes matches."""
    sent = b"Bearer \xff\xfe".decode("utf-8", "surrogateescape")
    assert not app_module.api_key_matches(sent, "s3cret")
    assert app_module.api_key_matches(sent, "\udcff\udcfe")     # os.environ's decoding
    assert app_module.api_key_matches("Bearer cl\u00e9", "cl\u00e9")


# ------------------------------------------------------------------ a shard that breaks


@pytest.fixture(scope="module")
def sharded_model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("broken") / "model", arch="qwen3_moe", layers=4,
                      experts=16, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=1,
                      shard_size=64 << 10)


@pytest.mark.parametrize("experts", ["streamed", "mapped"])
def test_health_is_degraded_while_expert_reads_fail_and_ok_once_one_succeeds(sharded_model, experts):
    """Streamed (a cache budget) or memory-mapped (no budget: the model fits), a shard cut
    under the daemon fails the requests that need it with a 500 naming the file, /health is
    degraded, the daemon stays up (a mapping touched past its file's end would be SIGBUS),
    and all is well again once the file is whole."""
    checkpoint = Checkpoint(sharded_model)
    config = load_config(sharded_model)
    cache = minimum_cache_bytes(ExpertLayout(checkpoint, config), config)
    checkpoint.close()
    shards = sorted(sharded_model.glob("model-*.safetensors"))
    assert len(shards) >= 2
    budget = ("--expert-cache-bytes", str(cache)) if experts == "streamed" else ()
    d = Daemon(sharded_model, short_dir(), "--threads", "1", *budget, "--no-prefetch")
    try:
        assert d.json("GET", "/health") == (200, {"status": "ok"})
        assert serving(d)                    # the experts' shards are open (mapped) now
        saved = {p: p.read_bytes() for p in shards}
        for p in shards:                     # every expert's bytes gone: only headers stay
            header = 8 + int.from_bytes(saved[p][:8], "little")
            with open(p, "r+b") as f:
                f.truncate(header)
        status, body = d.json("POST", "/v1/completions", {"prompt": "def f(x):", "max_tokens": 16,
                                                           "temperature": 0})
        assert status == 500 and "generation failed" in body["error"]["message"]
        status, health = d.json("GET", "/health")
        assert status == 503 and health["status"] == "degraded"
        assert health["reason"].startswith("expert reads are failing: " + (
            "reading expert (" if experts == "streamed" else str(sharded_model)))
        assert any(str(p) in health["reason"] for p in shards)
        assert d.proc.poll() is None                       # still up
        for p, data in saved.items():        # the disk is back
            p.write_bytes(data)
        assert serving(d)
        assert d.json("GET", "/health") == (200, {"status": "ok"})
        assert d.stop() == 0
    finally:
        d.cleanup()


def test_mapped_experts_recover_once_cut_shards_are_replaced_by_rename(sharded_model):
    """Shards cut under the daemon, then restored as rsync, package managers and `cp` +
    `mv` do (a whole copy renamed over each): the mappings of the old, cut inodes are
    dropped, and the next request after the rename is served and /health is ok."""
    shards = sorted(sharded_model.glob("model-*.safetensors"))
    d = Daemon(sharded_model, short_dir(), "--threads", "1", "--no-prefetch")
    saved = {p: p.read_bytes() for p in shards}
    try:
        assert serving(d)                    # the experts' shards are mapped now
        for p in shards:
            with open(p, "r+b") as f:
                f.truncate(8 + int.from_bytes(saved[p][:8], "little"))
        status, body = d.json("POST", "/v1/completions", {"prompt": "def f(x):", "max_tokens": 16,
                                                           "temperature": 0})
        assert status == 500 and "truncated while served" in body["error"]["message"], body
        assert d.json("GET", "/health")[0] == 503
        for p, data in saved.items():
            p.with_name(p.name + ".new").write_bytes(data)
            os.replace(p.with_name(p.name + ".new"), p)
        assert serving(d)
        assert d.json("GET", "/health") == (200, {"status": "ok"})
        assert d.stop() == 0
    finally:
        for p, data in saved.items():
            p.write_bytes(data)
        d.cleanup()


@pytest.fixture(scope="module")
def wide_sharded_model(tmp_path_factory) -> Path:
    """Experts of 384 KiB: their reads take long enough for a cut to fall inside them."""
    return make_model(tmp_path_factory.mktemp("wide") / "model", arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=256, intermediate=256, dtype="bf16", seed=2,
                      shard_size=256 << 10)


def test_mapped_experts_survive_shards_cut_and_restored_while_they_are_read(wide_sharded_model):
    """A thread cuts every shard to its header and writes its tail back, over and over,
    while memory-mapped experts serve: the cut can fall between the acquire's size check
    and the kernels' reads (SIGBUS for a plain mapping). The daemon stays up, and each
    answer is either the tokens of an undisturbed run or a 500 naming a shard."""
    sharded_model = wide_sharded_model
    shards = sorted(sharded_model.glob("model-*.safetensors"))
    saved = {p: p.read_bytes() for p in shards}
    headers = {p: 8 + int.from_bytes(saved[p][:8], "little") for p in shards}
    request = {"prompt": "def f(x):", "max_tokens": 16, "temperature": 0}
    d = Daemon(sharded_model, short_dir(), "--threads", "1", "--no-prefetch")
    stop = threading.Event()

    def cut_and_restore() -> None:
        fds = {p: os.open(p, os.O_RDWR) for p in shards}
        try:
            while not stop.is_set():
                for p, fd in fds.items():
                    os.ftruncate(fd, headers[p])
                    os.pwrite(fd, saved[p][headers[p]:], headers[p])
        finally:
            for fd in fds.values():
                os.close(fd)

    cutter = threading.Thread(target=cut_and_restore)
    try:
        status, reference = d.json("POST", "/v1/completions", request)
        assert status == 200 and reference["usage"]["completion_tokens"] >= 1
        answers = []
        cutter.start()
        try:
            for _ in range(300):
                status, body = d.json("POST", "/v1/completions", request)
                answers.append(status)
                if status == 200:
                    assert body["choices"][0]["text"] == reference["choices"][0]["text"]
                else:
                    assert status == 500, body
                    message = body["error"]["message"]
                    assert "truncated while served" in message
                    assert any(str(p) in message for p in shards), message
        finally:
            stop.set()
            cutter.join()
        assert d.proc.poll() is None                       # still up
        assert 500 in answers, answers                     # the cuts were seen
        assert serving(d)                                  # the files are whole again
        assert d.json("GET", "/health") == (200, {"status": "ok"})
        assert d.stop() == 0
    finally:
        stop.set()
        if cutter.is_alive():
            cutter.join()
        for p, data in saved.items():
            p.write_bytes(data)
        d.cleanup()


def test_health_is_degraded_while_experts_with_nan_weights_fail_requests(tmp_path):
    """NaN in one layer's routed experts: a request is a 500 naming the layer (not the
    next layer's router), /health is 503 degraded naming the experts while their weights
    stay broken, the daemon stays up, and all is well again once the file is whole."""
    model = make_model(tmp_path / "model", arch="qwen3_moe", layers=3, experts=4, top_k=2,
                       hidden=64, intermediate=32, dtype="bf16", seed=2)
    with Checkpoint(model) as checkpoint:
        infos = [checkpoint.info(f"model.layers.1.mlp.experts.{e}.down_proj.weight")
                 for e in range(4)]
    d = Daemon(model, short_dir(), "--threads", "1", "--no-prefetch")
    try:
        assert serving(d)
        saved = []
        for info in infos:                   # bf16 NaN (0x7fc0) in every weight of layer 1's
            with open(info.path, "r+b") as f:
                f.seek(info.offset)
                saved.append(f.read(info.nbytes))
                f.seek(info.offset)
                f.write(b"\xc0\x7f" * (info.nbytes // 2))
        for prompt in ("def f(x):", "hello"):
            status, body = d.json("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 4,
                                                               "temperature": 0})
            assert status == 500, body
            assert body["error"]["code"] == "engine_error"
            assert "layer 1: routed experts" in body["error"]["message"], body
            assert "NaN or inf" in body["error"]["message"]
            status, health = d.json("GET", "/health")
            assert status == 503 and health["status"] == "degraded", health
            assert health["reason"].startswith(
                "routed experts produce NaN or inf (broken weights): layer 1: expert"), health
        assert d.proc.poll() is None                       # still up
        for info, data in zip(infos, saved):  # the weights are whole again
            with open(info.path, "r+b") as f:
                f.seek(info.offset)
                f.write(data)
        # /health stays degraded until each broken expert has computed finite rows: a
        # prompt long enough to route to all four
        status, body = d.json("POST", "/v1/completions", {
            "prompt": "def f(x):\n    return [x * i + 1 for i in range(10)]\n" * 4,
            "max_tokens": 2, "temperature": 0})
        assert status == 200, body
        assert d.json("GET", "/health") == (200, {"status": "ok"})
        assert serving(d)
        assert d.stop() == 0
    finally:
        d.cleanup()


def _write_nan(info, count: int | None = None) -> bytes:
    """bf16 NaN (0x7fc0) over the first `count` elements of a tensor (all: None); the bytes
    it replaced."""
    with open(info.path, "r+b") as f:
        f.seek(info.offset)
        saved = f.read(info.nbytes)
        f.seek(info.offset)
        f.write(b"\xc0\x7f" * (count or info.nbytes // 2))
    return saved


def test_streamed_experts_start_with_one_nan_expert_the_tuner_check_routes_to(tmp_path):
    """One NaN element in one routed expert, the one the live tuner's check prompt routes
    to in layer 1: with a cache budget (streamed experts) and the tuner on, the daemon
    starts as it does with mapped experts — the tuner stops with a warning, /health is
    degraded naming the expert, and requests not routed to it are served."""
    model = make_model(tmp_path / "model", arch="qwen3_moe", layers=3, experts=8, top_k=2,
                       hidden=64, intermediate=32, dtype="bf16", seed=2)
    config = load_config(model)
    with Checkpoint(model) as checkpoint:
        infos = [checkpoint.info(f"model.layers.1.mlp.experts.{e}.down_proj.weight")
                 for e in range(8)]
        cache = minimum_cache_bytes(ExpertLayout(checkpoint, config), config)
    saved = [_write_nan(info) for info in infos]            # which of them the check meets:
    from daemon.store.session import open_model
    from daemon.tuning.search import check_tokens
    from daemon.tuning.workload import workload_prompts
    m, _ = open_model(model, threads=1, cache_bytes=None)
    with pytest.raises(ValueError, match="NaN or inf"):
        check_tokens(m, workload_prompts(model, config.vocab_size)[0])
    expert = min(e for l, e in m.broken_experts if l == 1)
    m.close()
    for info, data in zip(infos, saved):
        with open(info.path, "r+b") as f:
            f.seek(info.offset)
            f.write(data)
    _write_nan(infos[expert], count=1)                      # one element of that one expert
    d = Daemon(model, short_dir(), "--threads", "1", "--expert-cache-bytes", str(cache),
               env={"MOED_TUNER": "live"})
    try:
        stopped = d.wait_event("tuner_stopped")
        assert "NaN or inf" in stopped["reason"], stopped
        status, health = d.json("GET", "/health")
        assert status == 503 and health["status"] == "degraded", health
        assert health["reason"].startswith(
            f"routed experts produce NaN or inf (broken weights): layer 1: expert {expert}"), health
        answers = [d.json("POST", "/v1/completions", {"prompt": p, "max_tokens": 1,
                                                       "temperature": 0})[0]
                   for p in ("a", "b", "c", "d", "x", "y", "1", "2")]
        assert 200 in answers, answers                      # only the expert's requests fail
        assert set(answers) <= {200, 500}
        assert d.proc.poll() is None
        assert d.stop() == 0
    finally:
        d.cleanup()


def test_a_client_that_leaves_mid_stream_is_a_499_not_a_traceback(monkeypatch):
    """A write to a closing transport ends the answer quietly and counts as 499 (aiohttp
    would log it as an "Error handling request" traceback)."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from daemon.api import chat as chat_api
    from daemon.engine.engine import EngineRequest

    counted = []

    class State:
        class telemetry:                                    # noqa: N801
            @staticmethod
            def response(route, status):
                counted.append(status)

        class loaded:                                       # noqa: N801
            class engine:                                   # noqa: N801
                tokenizer = None

    async def closing(self, data):
        raise ConnectionResetError("Cannot write to closing transport")

    async def prepared(self, request):
        return None
    monkeypatch.setattr(web.StreamResponse, "write", closing)
    monkeypatch.setattr(web.StreamResponse, "prepare", prepared)
    http = app_module.HttpApp(State())
    parsed = chat_api.ParsedRequest(engine=EngineRequest(request_id="cmpl-1", prompt_ids=(1,),
                                                    max_tokens=2),
                               model="m", stream=True, include_usage=False, chat=True)

    async def scenario():
        class Handle:
            events = asyncio.Queue()
        request = make_mocked_request("POST", "/v1/chat/completions")

        async def handler(req):
            return await http._stream(req, parsed, Handle(), {})
        return await http._count(request, handler)
    response = asyncio.run(scenario())
    assert isinstance(response, web.StreamResponse)
    assert counted == [499]


@pytest.mark.parametrize("phase", ["loading", "stopping"])
def test_health_over_tcp_says_why_only_to_a_request_with_the_key(phase):
    """GET /health needs no key (load balancers and probes hold none) but gives the reason
    of a 503 (which may name files) only with it; every other route stays closed."""
    from aiohttp.test_utils import TestClient, TestServer

    class Config:
        api_key = "k3y"

    class State:
        config, telemetry, loaded = Config(), None, None

    State.phase = phase

    async def scenario():
        async with TestClient(TestServer(app_module.HttpApp(State()).application())) as client:
            out = []
            for headers in ({}, {"Authorization": "Bearer k3y"}, {"x-api-key": "wrong"}):
                resp = await client.get("/health", headers=headers)
                out.append((resp.status, await resp.json()))
            models = await client.get("/v1/models")
            return out, models.status
    (bare, keyed, wrong), models = asyncio.run(scenario())
    assert bare == wrong == (503, {"status": phase})
    assert keyed[0] == 503 and keyed[1]["status"] == phase and keyed[1]["reason"]
    assert models == 401
