"""The daemon's listeners: a cap on the open connections of each, and the sites that serve
aiohttp through it.

aiohttp's server bounds a request's line and header sizes (`max_line_size`,
`max_field_size`, `max_headers`) and, with `keepalive_timeout`, the time a connection
may wait for a complete request head: the timer starts when the connection opens and
again after each answer, and closes the connection when no whole head arrived within it
(a client that trickles headers — slowloris — is cut off there). moed sets it to
`header_timeout_s`. aiohttp has no bound on the number of connections a listener keeps
open and none on the time a body takes: `ConnectionGate` is the first (this module), the
body deadline is daemon/service/app.py's.

`ConnectionGate` wraps aiohttp's protocol factory for one listener. Up to `limit`
connections are handed to aiohttp; one more is answered at once with a 503 (OpenAI's
error shape, ``Retry-After``, ``Connection: close``), half-closed, drained for at most
`LINGER_S` so the client reads the answer instead of a reset, and closed. Refusals are
counted (`refused`) and logged as ``connection_refused`` — the first one, then at most
one line per `REFUSAL_LOG_EVERY_S` with the count since the last.

A gate also caps the connections of one peer at `per_peer` (max_connections_per_peer, at
most `limit`), so that one client cannot hold the whole listener: a peer is who
compile_slots.client_of says (an IPv4 address, an IPv6 address by its /64; on the Unix
socket the peer's uid, though the daemon gives its Unix socket no per-peer cap: local
clients of one uid, a proxy say, are one peer there, and the socket's mode says who may
connect). The peer is
known only once the connection is made, so the gate counts it then: a connection beyond
its peer's cap gets the same 503 (its message names max_connections_per_peer), holds no
place under `limit` while it lingers, and is counted (`peer_refused`) and logged
(``connection_refused_per_peer``, with the peer) as above.

`GatedSite` is an aiohttp site (registered with its runner like `web.SockSite`, so
`runner.cleanup()` stops it) that listens on a bound socket through a gate. Its
connections are served by `ApiErrorRequestHandler`: aiohttp's own answers to what is not
HTTP/1.1 it can parse (too many or too long headers, a bad Content-Length, TLS or HTTP/2
sent to this listener) are in OpenAI's error shape too, as every other error of moed.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import socket
import time
from collections.abc import Callable, Hashable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from daemon.workers.compile_slots import client_of_transport
from telemetry.logs import get_logger

log = get_logger("server")

LINGER_S = 1.0                  # a refused connection is drained at most this long
REFUSAL_LOG_EVERY_S = 60.0      # at most one connection_refused line per this long
BACKLOG = 1024                  # listen(2) backlog of every listener (the kernel caps it)
OPEN_FILES_SPARE = 1024         # file descriptors besides connections: shards, pipes, ...
ERROR_DETAIL_CHARS = 200        # aiohttp's description of a bad request, cut to this many


def _refusal_bytes(message: str) -> bytes:
    body = json.dumps({"error": {
        "message": message, "type": "service_unavailable", "param": None,
        "code": "too_many_connections"}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _Refusal(asyncio.Protocol):
    """Answer 503, stop writing, discard what the client sends, close within LINGER_S."""

    def __init__(self, answer: bytes):
        self._answer = answer
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self._answer)             # type: ignore[attr-defined]
        if transport.can_write_eof():            # type: ignore[attr-defined]
            transport.write_eof()                # type: ignore[attr-defined]
            self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        else:
            transport.close()
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        pass                                      # the request nobody will serve

    def eof_received(self) -> bool:
        self._transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class _Counted(asyncio.Protocol):
    """One connection counted by its gate until it is lost: aiohttp's protocol, made once
    the gate admits the connection's peer, or a `_Refusal` when the peer is at its cap.

    Forwards every protocol callback the transport makes (and any other attribute)."""

    def __init__(self, gate: ConnectionGate):
        self._gate = gate
        self._inner: asyncio.Protocol | None = None
        self._peer: Hashable | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._peer = self._gate.admit(transport)
        self._inner = self._gate.protocol_for(self._peer)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._gate.release(self._peer)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class _RefusalLog:
    """Count one kind of refusal and say when to log it: the first, then at most once per
    REFUSAL_LOG_EVERY_S with the count since the last line (the caller logs, so that every
    log event stays a literal name)."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self.refused = 0
        self._logged_at: float | None = None
        self._logged_refused = 0

    def refuse(self) -> int | None:
        """Count one refusal; the refusals to log now (since the last line), or None."""
        self.refused += 1
        now = self._clock()
        if self._logged_at is None or now - self._logged_at >= REFUSAL_LOG_EVERY_S:
            count = self.refused - self._logged_refused
            self._logged_at, self._logged_refused = now, self.refused
            return count
        return None


class ConnectionGate:
    """A protocol factory: aiohttp's `factory` for up to `limit` open connections and up
    to `per_peer` of them from one peer (None: `limit`; more than `limit` is cut to it),
    a 503 refusal beyond. `listener` names it in logs and metrics ("socket", "tcp",
    "metrics"). `on_refused(listener, key)` is called for each refusal (a metrics
    counter), `key` the configuration key of the cap: "max_connections" or
    "max_connections_per_peer". `peer_of(transport)` is who a connection's peer is
    (compile_slots.client_of_transport); `clock` is monotonic seconds (injectable).
    Event-loop thread only."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], limit: int, listener: str, *,
                 per_peer: int | None = None,
                 on_refused: Callable[[str, str], None] | None = None,
                 peer_of: Callable[[asyncio.BaseTransport], Hashable] = client_of_transport,
                 clock: Callable[[], float] = time.monotonic):
        if limit < 1 or (per_peer is not None and per_peer < 1):
            raise ValueError(f"limit and per_peer must be >= 1, got {limit}, {per_peer}")
        self._factory = factory
        self.limit = limit
        self.per_peer = limit if per_peer is None else min(per_peer, limit)
        self.listener = listener
        self.open = 0
        self.peers: dict[Hashable, int] = {}     # open connections by peer, none at 0
        self._on_refused = on_refused
        self._peer_of = peer_of
        self._answer = _refusal_bytes(
            f"too many connections: the {listener} listener holds its limit of {limit} open "
            "connections (max_connections); retry shortly")
        self._peer_answer = _refusal_bytes(
            f"too many connections: this client holds its limit of {self.per_peer} open "
            f"connections to the {listener} listener (max_connections_per_peer); close some "
            "or retry shortly")
        self._log = _RefusalLog(clock)
        self._peer_log = _RefusalLog(clock)

    @property
    def refused(self) -> int:
        """Connections refused because the listener held `limit`."""
        return self._log.refused

    @property
    def peer_refused(self) -> int:
        """Connections refused because their peer held `per_peer`."""
        return self._peer_log.refused

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.limit:
            count = self._log.refuse()
            if count is not None:
                log.warning("connection_refused", refused=count, listener=self.listener,
                            limit=self.limit, reason="max_connections open connections")
            if self._on_refused is not None:
                self._on_refused(self.listener, "max_connections")
            return _Refusal(self._answer)
        self.open += 1        # counted now: a burst of accepts cannot overshoot the limit
        return _Counted(self)

    def admit(self, transport: asyncio.BaseTransport) -> Hashable | None:
        """The peer of a connection just made, counted; None when the peer already holds
        `per_peer` connections (the connection is refused and gives back its place)."""
        peer = self._peer_of(transport)
        held = self.peers.get(peer, 0)
        if held >= self.per_peer:
            self.open -= 1
            count = self._peer_log.refuse()
            if count is not None:
                log.warning("connection_refused_per_peer", refused=count, listener=self.listener,
                            limit=self.per_peer, peer=":".join(map(str, peer)),
                            reason="max_connections_per_peer open connections of one peer")
            if self._on_refused is not None:
                self._on_refused(self.listener, "max_connections_per_peer")
            return None
        self.peers[peer] = held + 1
        return peer

    def protocol_for(self, peer: Hashable | None) -> asyncio.Protocol:
        """aiohttp's protocol for an admitted peer, the refusal for None."""
        return self._factory() if peer is not None else _Refusal(self._peer_answer)

    def release(self, peer: Hashable | None) -> None:
        """A connection `admit` returned `peer` for is lost (None: one it refused)."""
        if peer is None:
            return
        self.open -= 1
        held = self.peers[peer] - 1
        if held:
            self.peers[peer] = held
        else:
            del self.peers[peer]


def _detail(message: str | None) -> str:
    """aiohttp's description of a bad request on one line (it spans lines), cut to
    ERROR_DETAIL_CHARS (it may echo the client's bytes)."""
    detail = " ".join((message or "").split())
    if len(detail) > ERROR_DETAIL_CHARS:
        detail = detail[:ERROR_DETAIL_CHARS] + "..."
    return detail


class ApiErrorRequestHandler(RequestHandler):
    """aiohttp's protocol for one connection, answering its own errors in OpenAI's shape.

    aiohttp answers a request it cannot parse (the request never reaches the application
    and its middlewares) and an exception that escapes them with `handle_error`: plain
    text. aiohttp has no public hook for that answer, so this subclass overrides the
    method: aiohttp's own implementation still runs (its log line — one warning without
    traceback for what it could not parse, see `log_exception` — and its refusal when an
    answer was already begun), and its plain-text response is replaced by the same status
    with ``{"error": {...}}`` as JSON and ``Connection: close`` (aiohttp closes the
    connection after it in any case). Checked on aiohttp 3.14.5;
    tests/daemon/service/test_hostile.py pins the source of the two aiohttp methods this
    relies on (`RequestHandler.handle_error`, and `Server.__call__`, which `for_server`
    mirrors) and fails when an aiohttp version changes them.
    """

    __slots__ = ()

    @classmethod
    def for_server(cls, server: Server) -> ApiErrorRequestHandler:
        """What `server()` returns (aiohttp's `Server.__call__`), as this class."""
        return cls(server, loop=asyncio.get_running_loop(), **server._kwargs)

    def log_exception(self, *args, **kw) -> None:
        """aiohttp's error line with its traceback (`handle_error` logs through it) — except
        for a request aiohttp could not parse (an HttpProcessingError: a NUL byte in a
        header, too many headers, a negative Content-Length, ...): the client's fault, not
        the daemon's, so one warning line, `http_request_unreadable`, with the status and
        aiohttp's description, and no traceback."""
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            log.warning("http_request_unreadable", status=exc.code, error=_detail(exc.message))
            return
        super().log_exception(*args, **kw)

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None) -> web.Response:
        super().handle_error(request, status, exc, message)
        detail = _detail(message)
        if status < 500:
            text = "the request is not HTTP/1.1 that moed can read"
            kind, code = "invalid_request_error", "invalid_http_request"
        else:
            text = "internal error"
            kind, code = "server_error", "internal_error"
        body = {"error": {"message": f"{text}: {detail}" if detail else text, "type": kind,
                          "param": None, "code": code}}
        response = web.json_response(body, status=status, headers={"Connection": "close"})
        response.force_close()
        return response


class GatedSite(web.BaseSite):
    """Serve `runner` on the bound socket `sock` (listening or not) through `gate`, which
    wraps the runner's own protocol factory. `name` is what `runner.addresses` reports."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, *, limit: int, listener: str,
                 per_peer: int | None = None,
                 on_refused: Callable[[str, str], None] | None = None, backlog: int = BACKLOG):
        super().__init__(runner, backlog=backlog)
        self._sock = sock
        self._listener = listener
        self.gate = ConnectionGate(lambda: ApiErrorRequestHandler.for_server(runner.server),
                                   limit, listener, per_peer=per_peer, on_refused=on_refused)

    @property
    def name(self) -> str:
        address = self._sock.getsockname()
        if self._sock.family == socket.AF_UNIX:
            return f"http://unix:{address}:"
        host, port = address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self.gate, sock=self._sock, backlog=self._backlog)


def fit_open_files(listeners: int, max_connections: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (as Go's runtime does; epoll has no
    FD_SETSIZE ceiling) and warn when it still cannot hold `listeners` x
    `max_connections` connections plus OPEN_FILES_SPARE for shards, pipes and the rest.
    Returns (soft, needed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    needed = listeners * max_connections + OPEN_FILES_SPARE
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning("open_file_limit_low", rlimit_nofile=soft, needed=needed,
                    effect="connections beyond the limit fail at accept; lower max_connections "
                           "or raise LimitNOFILE=")
    return soft, needed


def tcp_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for `host` (a name, an IPv4 or an IPv6 address) and `port`
    (0: the kernel picks one), with SO_REUSEADDR; OSError as getaddrinfo or bind raise it."""
    last: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            return sock
        except OSError as e:
            sock.close()
            last = e
    raise last if last is not None else OSError(f"{host}:{port}: no address to bind")
