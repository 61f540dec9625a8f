"""A client of the moed daemon: HTTP over its Unix socket (aiohttp), for `moed generate`,
`moed chat`, `moed stats`, `moed pins` and `moed demo`.

Conventions. The socket path is given by the caller (`default_socket` reads
``$MOED_SOCKET`` from an environment mapping passed in, else the daemon's default
``/run/moed/moed.sock``). Request bodies follow the OpenAI API (`completion_request`);
answers are read as Server-Sent Events (``data: <json>`` events separated by a blank
line, ending with ``data: [DONE]``), and each piece of text is handed to a callback as it
arrives. Failures raise `DaemonError` (the daemon answered with an OpenAI-shaped error,
or the answer was cut off) or its subclass `DaemonUnavailableError` (nothing answers on
the socket); both messages are one line meant for a person, naming the socket.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from daemon.service.config import ServeConfig

SOCKET_ENV = "MOED_SOCKET"
CONNECT_TIMEOUT_S = 10.0
BASE_URL = "http://localhost"      # the host is ignored on a Unix socket; HTTP/1.1 wants one


def default_socket(environ: Mapping[str, str]) -> str:
    """The socket to talk to: ``$MOED_SOCKET`` when set and not empty, else the daemon's default."""
    return environ.get(SOCKET_ENV) or ServeConfig.socket


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
    """No daemon answers on the socket (missing, refused, or not allowed)."""


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


def _unavailable(socket_path: str, error: BaseException) -> DaemonUnavailableError:
    os_error = getattr(error, "os_error", None) or error
    if isinstance(os_error, FileNotFoundError):
        reason = "the socket does not exist"
    elif isinstance(os_error, ConnectionRefusedError):
        reason = "nothing is listening on it"
    elif isinstance(os_error, PermissionError):
        reason = "permission denied (is your user in the socket's group?)"
    else:
        reason = getattr(os_error, "strerror", None) or str(os_error)
    return DaemonUnavailableError(
        f"cannot connect to the moed daemon at {socket_path}: {reason}; is moed serve running? "
        f"(choose another socket with --socket PATH or ${SOCKET_ENV})")


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
    """One connection pool to the daemon's socket; use as ``async with Client(path) as c``.

    Not thread-safe; every method runs on the event loop that created the client.
    """

    def __init__(self, socket_path: str, *, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.socket_path = socket_path
        # Answers may take minutes: only connecting has a time limit.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket_path),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s))

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def _request(self, method: str, path: str, body: dict | None) -> aiohttp.ClientResponse:
        try:
            response = await self._session.request(method, BASE_URL + path, json=body)
        except aiohttp.ClientConnectorError as e:
            raise _unavailable(self.socket_path, e) from None
        except aiohttp.ClientConnectionError as e:
            raise DaemonError(f"the moed daemon at {self.socket_path} closed the connection: "
                              f"{e}") from None
        if response.status >= 400:
            try:
                raise await _error_from(response)
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
                raise DaemonError(f"the moed daemon at {self.socket_path} cut the answer off: "
                                  f"{e}") from None
            except json.JSONDecodeError as e:
                raise DaemonError(f"the daemon sent an event that is not JSON: {e}") from None
        if not done:
            raise DaemonError(f"the moed daemon at {self.socket_path} closed the stream before "
                              "the end of the answer")
        return StreamResult(text="".join(parts), finish_reason=finish_reason, usage=usage,
                            time_to_first_text_s=first, duration_s=time.perf_counter() - t0)
