"""A client of the moed daemon: HTTP over its Unix socket or TCP (aiohttp), for
`moed generate`, `moed chat`, `moed stats`, `moed pins` and `moed demo`.

Conventions. Where the daemon answers is a `Target`: its Unix socket (`Target.unix`), or
an ``http://`` / ``https://`` URL (`Target.http`, for a daemon served with
``--tcp-address``, or a TLS proxy in front of it) with the API key sent as
``Authorization: Bearer``. `target_from` picks it as the commands do: ``--url`` or
``--socket``, else ``$MOED_URL``, else ``$MOED_SOCKET``, else the daemon's default socket
``/run/moed/moed.sock``; the key is ``--api-key``, else ``$MOED_API_KEY`` (read from an
environment mapping passed in). One `Client` serves both: only its connector differs.
Request bodies follow the OpenAI API (`completion_request`); answers are read as
Server-Sent Events (``data: <json>`` events separated by a blank line, ending with
``data: [DONE]``), and each piece of text is handed to a callback as it arrives. Failures
raise `DaemonError` (the daemon answered with an OpenAI-shaped error, or the answer was
cut off) or its subclass `DaemonUnavailableError` (nothing answers there); both messages
are one line meant for a person, naming the socket or the URL.
"""
from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from socket import gaierror
from typing import Any

import aiohttp

from daemon.service.config import ServeConfig

SOCKET_ENV = "MOED_SOCKET"
URL_ENV = "MOED_URL"
API_KEY_ENV = "MOED_API_KEY"
CONNECT_TIMEOUT_S = 10.0
SOCKET_BASE_URL = "http://localhost"   # the host is ignored on a Unix socket; HTTP/1.1 wants one


def default_socket(environ: Mapping[str, str]) -> str:
    """The socket to talk to: ``$MOED_SOCKET`` when set and not empty, else the daemon's default."""
    return environ.get(SOCKET_ENV) or ServeConfig.socket


@dataclass(frozen=True)
class Target:
    """Where the daemon answers: a Unix socket path, or the base URL of its HTTP listener.

    socket: the socket's path (None for a URL). url: ``scheme://host[:port][/prefix]``
    without a trailing slash (None for a socket); request paths are appended to it.
    api_key: sent as ``Authorization: Bearer`` to a URL, never over the socket (there the
    socket file's permissions decide). `str()` is the socket or the URL, for messages.
    """

    socket: str | None = None
    url: str | None = None
    api_key: str | None = field(default=None, repr=False)

    @classmethod
    def unix(cls, path: str) -> Target:
        return cls(socket=path)

    @classmethod
    def http(cls, url: str, api_key: str | None = None, *, source: str = "url") -> Target:
        """The target at `url`, an ``http://HOST[:PORT]`` or ``https://HOST[:PORT]`` URL
        (default ports 80 and 443; a path is kept as a prefix of every request's, for a
        proxy that routes one). ValueError naming `source` (the flag or variable it came
        from) when it is not such a URL."""
        expected = (f"{source}: expected http://HOST:PORT or https://HOST:PORT, got {url!r}")
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port                          # ValueError when out of range or not a number
        except ValueError:
            raise ValueError(expected) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(expected + (" (add http://)" if "://" not in url else ""))
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"{source}: {url!r} holds credentials; give the key with "
                             f"--api-key KEY or ${API_KEY_ENV}")
        if parts.query or parts.fragment:
            raise ValueError(f"{source}: {url!r} has a query or fragment; give the daemon's "
                             "base URL (http://HOST:PORT)")
        return cls(url=url.rstrip("/"), api_key=api_key or None)

    def __str__(self) -> str:
        return self.socket if self.socket is not None else self.url

    @property
    def base_url(self) -> str:
        return SOCKET_BASE_URL if self.socket is not None else self.url

    def connector(self) -> aiohttp.BaseConnector:
        """A new connector to the target (call on the event loop that will use it)."""
        if self.socket is not None:
            return aiohttp.UnixConnector(path=self.socket)
        return aiohttp.TCPConnector()

    def headers(self) -> dict[str, str]:
        if self.url is not None and self.api_key:
            return {"Authorization": f"Bearer {self.api_key}"}
        return {}

    def log_fields(self) -> dict[str, str]:
        """The target as log fields: {"socket": path} or {"url": url}."""
        return {"socket": self.socket} if self.socket is not None else {"url": self.url}

    def choose_another(self) -> str:
        """How to point the commands elsewhere, for the end of an error message."""
        if self.socket is not None:
            return f"choose another socket with --socket PATH or ${SOCKET_ENV}"
        return f"choose another address with --url URL or ${URL_ENV}"


def target_from(*, socket: str | None = None, url: str | None = None,
                api_key: str | None = None, environ: Mapping[str, str]) -> Target:
    """The target the client commands talk to, from their flags and `environ`.

    `url` or `socket` when given (not both), else ``$MOED_URL``, else ``$MOED_SOCKET``,
    else the daemon's default socket; empty variables count as unset. The key is
    `api_key`, else ``$MOED_API_KEY``. ValueError (naming the flag or variable) for both
    flags, both variables, or a URL that is not one (see `Target.http`).
    """
    if socket is not None and url is not None:
        raise ValueError("give --socket or --url, not both")
    key = api_key if api_key is not None else environ.get(API_KEY_ENV)
    if url is not None:
        return Target.http(url, key, source="--url")
    if socket is not None:
        return Target.unix(socket)
    env_url = environ.get(URL_ENV)
    if env_url and environ.get(SOCKET_ENV):
        raise ValueError(f"${URL_ENV} and ${SOCKET_ENV} are both set: unset one, or choose "
                         "with --url or --socket")
    if env_url:
        return Target.http(env_url, key, source=f"${URL_ENV}")
    return Target.unix(default_socket(environ))


class DaemonError(Exception):
    """The daemon refused or failed a request; `str()` is its message.

    status: the HTTP status (0 when the connection broke mid-answer); type and code:
    the OpenAI error fields when the daemon sent them.
    """

    def __init__(self, message: str, *, status: int = 0, type: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.type = type
        self.code = code


class DaemonUnavailableError(DaemonError):
    """No daemon answers at the target (a missing socket, refused, unreachable, TLS failed)."""


@dataclass
class StreamResult:
    """How one streamed answer ended.

    text: the whole answer. finish_reason: "stop", "length", ... as the daemon sent it.
    usage: the OpenAI usage object (prompt_tokens, completion_tokens, total_tokens), or
    None when the daemon did not send one. time_to_first_text_s / duration_s: seconds from
    sending the request to the first piece of text / to the end of the answer.
    """

    text: str
    finish_reason: str | None
    usage: dict | None
    time_to_first_text_s: float | None
    duration_s: float

    @property
    def completion_tokens(self) -> int | None:
        return None if self.usage is None else self.usage.get("completion_tokens")


def completion_request(*, prompt: str | None = None, messages: list[dict] | None = None,
                       max_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
                       seed: int | None = None, stream: bool = True) -> dict:
    """The OpenAI request body for /v1/completions (prompt) or /v1/chat/completions (messages).

    Exactly one of prompt and messages. top_k 0 means off (moed's extension, as vLLM's);
    seed None lets the daemon pick one. Streamed bodies ask for the usage chunk.
    """
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    body: dict[str, Any] = {"prompt": prompt} if prompt is not None else {"messages": messages}
    body.update(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                stream=stream)
    if seed is not None:
        body["seed"] = seed
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _unavailable(target: Target, error: BaseException) -> DaemonUnavailableError:
    os_error = getattr(error, "os_error", None) or error
    if isinstance(error, aiohttp.ClientConnectorCertificateError):
        reason = (f"its TLS certificate is not trusted ({error.certificate_error}); a private "
                  "CA's certificate can be named in $SSL_CERT_FILE")
    elif isinstance(error, aiohttp.ClientSSLError):
        reason = (f"TLS failed ({getattr(os_error, 'reason', None) or os_error}); moed serve "
                  "itself speaks plain HTTP: use http://, or a TLS proxy in front of it")
    elif isinstance(error, aiohttp.ServerTimeoutError):
        reason = "no connection within the time limit (a firewall, or the wrong host?)"
    elif isinstance(os_error, FileNotFoundError):
        reason = "the socket does not exist"
    elif isinstance(os_error, ConnectionRefusedError):
        reason = "nothing is listening on it"
    elif isinstance(os_error, PermissionError) and target.socket is not None:
        reason = "permission denied (is your user in the socket's group?)"
    elif isinstance(os_error, gaierror):
        reason = f"cannot resolve {urllib.parse.urlsplit(target.url).hostname}"
    else:
        reason = getattr(os_error, "strerror", None) or str(os_error)
    running = ("is moed serve running?" if target.socket is not None
               else "is moed serve running with --tcp-address there?")
    return DaemonUnavailableError(f"cannot connect to the moed daemon at {target}: {reason}; "
                                  f"{running} ({target.choose_another()})")


def _explained(target: Target, error: DaemonError) -> DaemonError:
    """`error`, or for a refused API key one that says how to give it."""
    if error.status != 401 or target.url is None:
        return error
    if target.api_key:
        message = (f"the moed daemon at {target} refused the API key (--api-key or "
                   f"${API_KEY_ENV}): give the key it serves with (HTTP 401)")
    else:
        message = (f"the moed daemon at {target} asks for an API key: give it with --api-key "
                   f"KEY or ${API_KEY_ENV} (HTTP 401)")
    return DaemonError(message, status=error.status, type=error.type, code=error.code)


async def _error_from(response: aiohttp.ClientResponse) -> DaemonError:
    """The DaemonError for an HTTP error answer (OpenAI-shaped JSON when the daemon sent it)."""
    raw = await response.read()
    try:
        error = json.loads(raw)["error"]
        message, kind, code = error["message"], error.get("type"), error.get("code")
    except (ValueError, KeyError, TypeError):
        message = raw.decode("utf-8", "replace").strip() or response.reason or "no message"
        kind = code = None
    return DaemonError(f"{message} (HTTP {response.status})", status=response.status,
                       type=kind, code=code)


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The data of each Server-Sent Event on `content`, as text, in order.

    An event is a block of lines ended by a blank line; its data is its ``data:`` lines
    joined by newlines (the WHATWG SSE rules; comments and other fields are skipped).
    """
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


class Client:
    """One connection pool to the daemon at `target` (a `Target`: its Unix socket or its
    URL); use as ``async with Client(target) as c``.

    Not thread-safe; every method runs on the event loop that created the client.
    """

    def __init__(self, target: Target, *, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.target = target
        # Answers may take minutes: only connecting has a time limit.
        self._session = aiohttp.ClientSession(
            connector=target.connector(), headers=target.headers(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s))

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def _request(self, method: str, path: str, body: dict | None) -> aiohttp.ClientResponse:
        try:
            response = await self._session.request(method, self.target.base_url + path,
                                                   json=body)
        except (aiohttp.ClientConnectorError, aiohttp.ServerTimeoutError) as e:
            raise _unavailable(self.target, e) from None
        except aiohttp.ClientConnectionError as e:
            raise DaemonError(f"the moed daemon at {self.target} closed the connection: "
                              f"{e}") from None
        if response.status >= 400:
            try:
                raise _explained(self.target, await _error_from(response))
            finally:
                response.release()
        return response

    async def get(self, path: str) -> Any:
        """GET `path` (e.g. "/v1/moed/stats"); the decoded JSON answer."""
        return await self._json("GET", path, None)

    async def post(self, path: str, body: dict | None = None) -> Any:
        """POST `body` as JSON to `path`; the decoded JSON answer."""
        return await self._json("POST", path, body)

    async def _json(self, method: str, path: str, body: dict | None) -> Any:
        response = await self._request(method, path, body)
        async with response:
            try:
                return await response.json(content_type=None)
            except (ValueError, aiohttp.ClientPayloadError) as e:
                raise DaemonError(f"{method} {path}: the daemon's answer is not JSON: {e}",
                                  status=response.status) from None

    async def stream(self, path: str, body: dict, on_text: Callable[[str], None]) -> StreamResult:
        """POST a streaming completion request; call `on_text(piece)` as text arrives.

        path: "/v1/completions" (pieces are ``choices[0].text``) or "/v1/chat/completions"
        (``choices[0].delta.content``); body: from `completion_request` with stream true.
        Returns how the answer ended. Raises DaemonError for an error answer, an error
        event in the stream, or a stream cut off before ``[DONE]``.
        """
        t0 = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        finish_reason, usage, done = None, None, False
        response = await self._request("POST", path, body)
        async with response:
            try:
                async for data in sse_events(response.content):
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        raise DaemonError(error.get("message", data), status=response.status,
                                          type=error.get("type"), code=error.get("code"))
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or ():
                        piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if piece:
                            if first is None:
                                first = time.perf_counter() - t0
                            parts.append(piece)
                            on_text(piece)
                        finish_reason = choice.get("finish_reason") or finish_reason
            except aiohttp.ClientPayloadError as e:
                raise DaemonError(f"the moed daemon at {self.target} cut the answer off: "
                                  f"{e}") from None
            except json.JSONDecodeError as e:
                raise DaemonError(f"the daemon sent an event that is not JSON: {e}") from None
        if not done:
            raise DaemonError(f"the moed daemon at {self.target} closed the stream before "
                              "the end of the answer")
        return StreamResult(text="".join(parts), finish_reason=finish_reason, usage=usage,
                            time_to_first_text_s=first, duration_s=time.perf_counter() - t0)
