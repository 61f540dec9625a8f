"""max_connections_per_peer: one peer cannot take all of a listener's connections.

A `GatedSite` serving a one-route aiohttp app on a loopback TCP port, in this process: one
peer (127.0.0.1) holds its cap of idle connections, its next one is answered 503 at once
in OpenAI's error shape, and another peer (127.0.0.2, the same loopback interface) is
still served; once the first peer closes one, it is served again. Then end to end: a
`moed serve` with an api_key on tcp_address, where one peer's idle connections beyond
max_connections_per_peer are refused and counted while a client with the key at
127.0.0.2 gets its completion. No sleeps: each wait is for the server's answer or its
close, bounded by a deadline.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import socket

from aiohttp import web
from daemon_proc import Daemon, short_dir

from daemon.workers.compile_slots import client_of
from daemon.service.config import ServeConfig
from daemon.service.connections import ConnectionGate, GatedSite, tcp_socket
from ext.makemodel import make_model

LIMIT = 8
PER_PEER = 3
DEADLINE_S = 10.0


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _connect(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), DEADLINE_S)


async def _get(port: int, source: str) -> bytes:
    """Everything the server answers to one GET / from `source` until it closes."""
    reader, writer = await _connect(port, source)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), DEADLINE_S)
    writer.close()
    return answer


async def _serve_and_attack() -> dict:
    app = web.Application()
    app.router.add_get("/", _ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    refusals: list[tuple[str, str]] = []
    site = GatedSite(runner, tcp_socket("127.0.0.1", 0), limit=LIMIT, listener="tcp",
                     per_peer=PER_PEER, on_refused=lambda *a: refusals.append(a))
    await site.start()
    port = site._sock.getsockname()[1]
    gate = site.gate
    out: dict = {}
    try:
        held = [await _connect(port, "127.0.0.1") for _ in range(PER_PEER)]
        # each connection_made has run once the server answers one request after them
        out["other_peer"] = await _get(port, "127.0.0.2")
        out["held_by_first"] = gate.peers.get(client_of(None, "127.0.0.1"))
        out["over_cap"] = await _get(port, "127.0.0.1")
        out["refusals"] = list(refusals)
        out["open_after_refusal"] = gate.open
        # one held connection asks and is answered; the server's close reaches us after
        # the gate counted the connection lost (asyncio: connection_lost, then close)
        reader, writer = held.pop(0)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        out["held_answered"] = await asyncio.wait_for(reader.read(), DEADLINE_S)
        writer.close()
        out["after_one_closed"] = await _get(port, "127.0.0.1")
        for _, writer in held:
            writer.close()
    finally:
        await runner.cleanup()
    return out


def test_a_peer_beyond_its_cap_is_refused_and_another_peer_is_served():
    out = asyncio.run(_serve_and_attack())
    assert out["other_peer"].startswith(b"HTTP/1.1 200 "), out["other_peer"][:200]
    assert out["held_by_first"] == PER_PEER

    head, _, payload = out["over_cap"].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), out["over_cap"][:300]
    assert b"Retry-After: 1" in head and b"Connection: close" in head
    error = json.loads(payload)["error"]
    assert error["code"] == "too_many_connections" and error["type"] == "service_unavailable"
    assert "max_connections_per_peer" in error["message"] and f" {PER_PEER} " in error["message"]
    assert out["refusals"] == [("tcp", "max_connections_per_peer")]
    assert out["open_after_refusal"] == PER_PEER        # the refusal holds no place under LIMIT

    assert out["held_answered"].startswith(b"HTTP/1.1 200 ")
    assert out["after_one_closed"].startswith(b"HTTP/1.1 200 "), out["after_one_closed"][:200]


def test_the_per_peer_cap_is_at_most_the_listener_cap_and_64_by_default():
    assert ServeConfig().max_connections_per_peer == 64
    assert ConnectionGate(lambda: asyncio.Protocol(), 4, "tcp", per_peer=64).per_peer == 4
    assert ConnectionGate(lambda: asyncio.Protocol(), 512, "tcp", per_peer=64).per_peer == 64
    assert ConnectionGate(lambda: asyncio.Protocol(), 512, "tcp").per_peer == 512


def test_over_tcp_one_peers_idle_connections_leave_the_daemon_to_another_peer(tmp_path):
    model = make_model(tmp_path / "model", arch="qwen3_moe", layers=2, experts=8, top_k=2,
                       hidden=64, intermediate=32, dtype="bf16", seed=0)
    d = Daemon(model, short_dir(), "--threads", "1", "--tcp-address", "127.0.0.1:0",
               "--max-connections", "16", "--max-connections-per-peer", str(PER_PEER),
               env={"MOED_API_KEY": "k"})
    held: list[socket.socket] = []
    try:
        host, port = d.wait_event("tcp_listening")["address"].rsplit(":", 1)
        held = [socket.create_connection((host, int(port)), DEADLINE_S,
                                         source_address=("127.0.0.1", 0))
                for _ in range(PER_PEER + 1)]
        extra = held.pop()                          # accepted last: beyond the cap
        answer = b""
        while chunk := extra.recv(65536):
            answer += chunk
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:300]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == \
            "too_many_connections"
        refused = d.wait_event("connection_refused_per_peer", listener="tcp")
        assert (refused["limit"], refused["peer"]) == (PER_PEER, "ip:127.0.0.1")

        conn = http.client.HTTPConnection(host, int(port), timeout=DEADLINE_S,
                                          source_address=("127.0.0.2", 0))
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "hi", "max_tokens": 2, "temperature": 0}),
            headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
        response = conn.getresponse()
        body = json.loads(response.read())
        conn.close()
        assert response.status == 200 and body["usage"]["completion_tokens"] >= 1, body

        status, _, scrape = d.request("GET", "/metrics")
        assert status == 200
        assert 'moed_connections_refused_per_peer_total{listener="tcp"} 1.0' in scrape.decode()

        # The Unix socket has no per-peer cap: one uid holds more than PER_PEER connections
        # and is still served on another.
        for _ in range(PER_PEER + 1):
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.connect(d.socket)
            held.append(unix)
        status, _, _ = d.request("GET", "/v1/models")
        assert status == 200
        assert not [e for e in d.events if e.get("event") == "connection_refused_per_peer"
                    and e.get("listener") == "socket"]
    finally:
        for sock in held:
            sock.close()
        assert d.stop() == 0
        d.cleanup()
