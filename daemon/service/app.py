"""The HTTP side of `moed serve`: routes, middlewares and OpenAI-shaped answers (aiohttp).

Routes: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions, POST /v1/messages (Anthropic's), POST /v1/responses, POST
/tokenize, /detokenize and /apply-template (llama-server's
shapes), GET /metrics, GET /v1/moed/stats, GET /v1/moed/pins, POST /v1/moed/pins/reset (admin:
the daemon's uid or root, from SO_PEERCRED; refused on TCP). Errors are OpenAI-shaped.

`HttpApp` reads the serving state of its `Daemon` (phase, loaded model, configuration)
and never changes the lifecycle. The loop never blocks on the model or the disk: it talks
to the engine through `Engine.submit` / `Engine.call` and awaits futures.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import socket
import time
from dataclasses import replace
from functools import partial

from aiohttp import HttpVersion11, web
from aiohttp.web_protocol import RequestPayloadError

from daemon.api import chat as chat_api
from daemon.api import messages as messages_api
from daemon.api import responses as responses_api
from daemon.api.chat import ApiError
from daemon.api.reasoning import AnswerParser
from daemon.engine.engine import EngineClosedError, QueueFullError, RequestHandle
from daemon.service.loading import Loaded
from daemon.service.serving import ServingState
from daemon.workers.compile_slots import client_of
from daemon.workers.compile_slots import peer_uid as transport_peer_uid
from daemon.workers.grammar import (GrammarBusyError, GrammarClosedError, GrammarError,
                                    GrammarLimitError)
from telemetry.logs import get_logger

log = get_logger("server")

RETRY_AFTER_S = 1
CLIENT_GONE = web.RequestKey("moed_client_gone", bool)  # the client left mid-answer
SCRAPE_WAIT_S = 2.0             # /metrics waits at most this long for a fresh snapshot, else the last one
SNAPSHOT_REUSE_S = 0.5          # a snapshot younger than this serves a scrape (scrape storms cost nothing)


def peer_uid(request: web.Request) -> int | None:
    """The uid of the process at the other end of a Unix-socket connection, else None."""
    return transport_peer_uid(request.transport)


def _is_tcp(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)


def _client(request: web.Request):
    """Who sent `request` (compile_slots.client_of): the peer's uid on the Unix socket,
    its address (an IPv6 one's /64) over TCP. Compile slots are shared fairly between
    clients, and under prefix_cache_scope "client" a client's prefix cache blocks are its own."""
    return client_of(peer_uid(request), request.remote if _is_tcp(request) else None)


def api_key_matches(authorization: str, api_key: str) -> bool:
    """Whether an Authorization header value is ``Bearer <api_key>``, compared in constant
    time (hmac.compare_digest): how long the check takes says nothing about the key.

    Both sides are compared as the bytes that were sent or configured: aiohttp decodes a
    header's bytes that are not UTF-8 to lone surrogates (surrogateescape), as Python does
    an environment variable's, so a strict encode of ``Bearer \\xff\\xfe`` would raise
    (a 500) where a wrong key must be a 401."""
    scheme, _, key = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        key.strip().encode("utf-8", "surrogateescape"),
        api_key.encode("utf-8", "surrogateescape"))


async def _pump(handle: RequestHandle, parser, stream, send):
    """Feed a one-choice answer's events through its parser (daemon/api/reasoning.py)
    and send the events `stream` (messages_api.BlockStream, responses_api.ItemStream)
    makes of the pieces, closing the last item at the end; returns the last event."""
    while True:
        event = await handle.events.get()
        pieces = parser.feed(event.text)
        if event.finish_reason is not None:
            pieces += parser.finish()
        for kind, value in pieces:
            for name, payload in stream.events(kind, value):
                await send(name, payload)
        if event.last:
            break
    for name, payload in stream.close():
        await send(name, payload)
    return event


def error_response(e: ApiError, anthropic: bool = False) -> web.Response:
    """The error in OpenAI's shape, or Anthropic's for /v1/messages."""
    body = messages_api.error_body(e) if anthropic else e.body()
    response = web.json_response(body, status=e.status, headers=e.headers)
    if e.headers.get("Connection") == "close":
        response.force_close()
    return response


class HttpApp:
    """The routes of one daemon. `application()` serves the Unix socket and tcp_address;
    `metrics_application()` serves metrics_address (/metrics only)."""

    def __init__(self, state: ServingState):
        self.state = state

    def application(self) -> web.Application:
        """The app of the Unix socket (and tcp_address): every route."""
        app = web.Application(middlewares=[self._count, self._errors, self._auth])
        app.router.add_get("/health", self.health, name="health")
        app.router.add_get("/v1/models", self.models, name="models")
        app.router.add_get("/v1/models/{model_id:.+}", self.model, name="model")
        post = partial(app.router.add_post, expect_handler=self._expect)
        post("/tokenize", self.tokenize, name="tokenize")
        post("/detokenize", self.detokenize, name="detokenize")
        post("/apply-template", self.apply_template, name="apply_template")
        post("/v1/completions", self.completions, name="completions")
        post("/v1/chat/completions", self.chat_completions, name="chat_completions")
        post("/v1/messages", self.messages, name="messages")
        post("/v1/responses", self.responses, name="responses")
        app.router.add_get("/metrics", self.metrics, name="metrics")
        app.router.add_get("/v1/moed/stats", self.stats, name="stats")
        app.router.add_get("/v1/moed/pins", self.pins, name="pins")
        post("/v1/moed/pins/reset", self.pins_reset, name="pins_reset")
        return app

    def metrics_application(self) -> web.Application:
        """The app of `metrics_address`: /metrics only, counted like the socket's routes."""
        app = web.Application(middlewares=[self._count])
        app.router.add_get("/metrics", self.metrics, name="metrics")
        return app

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """A request's ``Expect`` header, before its handler and the middlewares: with
        ``100-continue`` the client waits for ``100 Continue`` before it sends the body.
        aiohttp's default handler sends it to every request; here a Content-Length over
        max_body_bytes gets none, so the client sends nothing more and the handler's 413
        (`_json`, which reads no body over the limit) comes at once. Any other expectation
        is a 417 in OpenAI's shape (RFC 9110, 10.1.1). None: the request goes on."""
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            return error_response(ApiError(417, f"unknown Expect: {expect[:100]!r} (only "
                                                "100-continue)", code="expectation_failed"))
        limit = self.state.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return None
        if request.version == HttpVersion11:        # as aiohttp's _default_expect_handler
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0        # the response proper starts after it
        return None

    @web.middleware
    async def _count(self, request: web.Request, handler):
        """Count every response by route name and status (499: the client went away)."""
        status = 500
        try:
            response = await handler(request)
            status = 499 if request.get(CLIENT_GONE) else response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except (asyncio.CancelledError, ConnectionError):
            status = 499
            raise
        finally:
            if self.state.telemetry is not None:
                self.state.telemetry.response(request.match_info.route.name, status)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        anthropic = request.path.rstrip("/") == "/v1/messages"      # Anthropic's error shape
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e, anthropic=anthropic)
        except RequestPayloadError as e:    # e.g. a body whose Content-Encoding is broken
            return error_response(ApiError(400, f"the request body cannot be read: {e}"), anthropic)
        except web.HTTPException as e:      # aiohttp's own 404/405/413: OpenAI-shaped
            if e.status < 400:
                raise
            kind = {404: "not_found_error", 405: "invalid_request_error",
                    413: "invalid_request_error"}.get(e.status, "invalid_request_error")
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None  # 405 must say
            return error_response(ApiError(e.status, f"{request.method} {request.path}: {e.reason}",
                                           type=kind, headers=allow), anthropic)
        except (asyncio.CancelledError, ConnectionError):
            raise                            # the client went away: nobody to answer
        except Exception as e:              # a bug: answer in OpenAI's shape, keep serving
            log.exception("request_failed", path=request.path)
            return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                           type="server_error", code="internal_error"), anthropic)

    def _authorized(self, request: web.Request) -> bool:
        """Whether `request` may use the API: it came over the Unix socket (file
        permissions decide), no api_key is set, or it carries the key (Authorization:
        Bearer, or Anthropic's x-api-key)."""
        if not _is_tcp(request) or not self.state.config.api_key:
            return True
        key = request.headers.get("x-api-key")              # Anthropic's clients send this
        return api_key_matches(request.headers.get("Authorization", "") if key is None
                               else "Bearer " + key, self.state.config.api_key)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        # GET /health answers without the key, as llama-server's and vLLM's do, so that
        # load balancers and probes need no secret; without the key it says the status
        # only, not why (a reason may name files)
        if request.path != "/health" and not self._authorized(request):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ..., or "
                                "x-api-key: ...)", code="invalid_api_key")
        return await handler(request)

    def _require_ready(self) -> Loaded:
        if self.state.phase == "loading" or self.state.loaded is None:
            raise ApiError(503, "moed is loading the model", type="service_unavailable",
                           code="loading", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.state.phase == "draining":
            raise ApiError(503, "moed is shutting down", type="service_unavailable",
                           code="shutting_down")
        return self.state.loaded

    def _require_admin(self, request: web.Request) -> None:
        uid = peer_uid(request)
        if uid is None or uid not in (0, os.getuid()):
            raise ApiError(403, "admin calls are allowed only from the daemon's user or root, "
                                "over the Unix socket", type="permission_error",
                           code="permission_denied")

    async def _json(self, request: web.Request):
        limit = self.state.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"request body of {request.content_length} bytes is over the "
                                f"limit of {limit} bytes (max_body_bytes)", code="request_too_large")
        data = bytearray()      # read(n) returns what has arrived: loop until EOF or over
        timeout = self.state.config.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                while len(data) <= limit:
                    part = await request.content.read(limit + 1 - len(data))
                    if not part:
                        break
                    data += part
        except TimeoutError:
            # what is left of the body may never come: the connection cannot be reused
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s "
                                f"(body_timeout_s): {len(data)} of "
                                f"{request.content_length if request.content_length is not None else 'unknown'}"
                                " bytes received", code="request_timeout",
                           headers={"Connection": "close"}) from None
        if len(data) > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes (max_body_bytes)",
                           code="request_too_large")
        try:
            return json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: huge ints too
            raise ApiError(400, f"the request body is not valid JSON: {type(e).__name__}: "
                                f"{str(e)[:200]}") from None

    async def health(self, request: web.Request) -> web.Response:
        """200 ok; 503 while loading or draining, and "degraded" while expert reads fail
        (the latest read to finish failed: answers would fail too) until one succeeds, or
        while routed experts whose output held NaN or inf (broken weights: the requests
        routed to them fail) have not computed finite rows again. Open without the API
        key; the "reason" only to a request that may use the API."""
        body, status = self._health()
        if not self._authorized(request):
            body.pop("reason", None)
        return web.json_response(body, status=status)

    def _health(self) -> tuple[dict, int]:
        if self.state.phase == "ready":
            failing = self.state.read_failure()
            if failing is not None:
                return {"status": "degraded", "reason": f"expert reads are failing: {failing}"}, 503
            broken = self.state.weights_failure()
            if broken is not None:
                return {"status": "degraded", "reason": (
                    f"routed experts produce NaN or inf (broken weights): {broken}")}, 503
            return {"status": "ok"}, 200
        reason = "loading the model" if self.state.phase == "loading" else "shutting down"
        return {"status": self.state.phase, "reason": reason}, 503

    def _model_card(self, loaded: Loaded) -> dict:
        return {"id": loaded.model_names[0], "object": "model",
                "created": int(self.state.started_wall), "owned_by": "moed",
                "max_model_len": loaded.context, "weights": loaded.weight_formats}

    async def models(self, request: web.Request) -> web.Response:
        loaded = self._require_ready()
        return web.json_response({"object": "list", "data": [self._model_card(loaded)]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the official client's models.retrieve()."""
        loaded = self._require_ready()
        model_id = request.match_info["model_id"]
        if model_id not in loaded.model_names:
            raise ApiError(404, f"the model '{chat_api.clip(model_id, 64)}' does not exist; this daemon serves "
                                f"'{loaded.model_names[0]}'", param="model", code="model_not_found")
        return web.json_response(self._model_card(loaded))

    async def tokenize(self, request: web.Request) -> web.Response:
        loaded = self._require_ready()
        body = await self._json(request)
        return web.json_response(await asyncio.to_thread(chat_api.tokenize, body, loaded.engine.tokenizer))

    async def detokenize(self, request: web.Request) -> web.Response:
        loaded = self._require_ready()
        body = await self._json(request)
        return web.json_response(await asyncio.to_thread(chat_api.detokenize, body, loaded.engine.tokenizer))

    async def apply_template(self, request: web.Request) -> web.Response:
        loaded = self._require_ready()
        body = await self._json(request)
        return web.json_response(await asyncio.to_thread(chat_api.apply_template, body,
                                                         loaded.engine.tokenizer))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat_completions")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "messages")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "responses")

    async def _generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """endpoint: "completions", "chat_completions", "messages" (Anthropic's) or
        "responses" (OpenAI's Responses API); the last two are answered through chat
        completions' parsing (daemon/api/messages.py, responses_api.py)."""
        loaded = self._require_ready()
        original = body = await self._json(request)
        chat = endpoint != "completions"
        if endpoint == "messages":
            body = messages_api.chat_body(body)
        elif endpoint == "responses":
            body = responses_api.chat_body(body)
        engine = loaded.engine
        parsed = await asyncio.to_thread(      # templates and tokenization are CPU work
            chat_api.parse_request, body, chat=chat, model_names=loaded.model_names, tokenizer=engine.tokenizer,
            stop_ids=loaded.stop_ids, context=loaded.context, max_tokens_cap=self.state.config.max_tokens,
            request_timeout_s=self.state.config.request_timeout_s, now=engine.clock(),
            grammars=loaded.grammars, max_n=self.state.config.max_concurrent_sequences)
        if self.state.config.prefix_cache_scope == "client":
            parsed = replace(parsed, engine=replace(
                parsed.engine, cache_salt=(_client(request), parsed.engine.cache_salt)))
        if parsed.grammar is not None:
            parsed = await self._compile_grammar(parsed, loaded, request)
        try:
            handle = engine.submit(parsed.engine, asyncio.get_running_loop())
        except QueueFullError as e:
            raise ApiError(429, f"too many requests: {e}", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineClosedError:
            raise ApiError(503, "moed is shutting down", type="service_unavailable",
                           code="shutting_down") from None
        except ValueError as e:
            raise ApiError(400, str(e), param="messages" if chat else "prompt") from None
        handle.endpoint = endpoint
        headers = chat_api.max_tokens_header(parsed, loaded.context, self.state.config.max_tokens)
        try:
            if endpoint == "messages" and parsed.stream:
                return await self._stream_messages(request, parsed, handle, headers)
            if endpoint == "responses" and parsed.stream:
                return await self._stream_responses(request, parsed, handle, headers, original)
            if endpoint == "responses":
                [choice], event = await self._gather(parsed, handle)
                response = web.json_response(responses_api.response(
                    original, "resp_" + parsed.engine.request_id.removeprefix("chatcmpl-"), parsed.model,
                    responses_api.output_items(choice.reasoning, choice.text, choice.tool_calls or []),
                    choice.finish_reason, event.stats))
                response.headers.update(headers)
                return response
            if parsed.stream:
                return await self._stream(request, parsed, handle, headers)
            if endpoint == "messages":
                [choice], event = await self._gather(parsed, handle)
                response = web.json_response(messages_api.message(
                    "msg_" + parsed.engine.request_id.removeprefix("chatcmpl-"), parsed.model,
                    messages_api.content_blocks(choice.reasoning, choice.text, choice.tool_calls or []),
                    messages_api.stop_reason(choice.finish_reason, choice.stop_string),
                    choice.stop_string, event.stats))
            else:
                response = await self._collect(parsed, handle)
            response.headers.update(headers)
            return response
        finally:
            if not handle.finished:
                handle.cancel()      # the client went away (or we failed): free the place

    @staticmethod
    async def _compile_grammar(parsed: chat_api.ParsedRequest, loaded: Loaded,
                               request: web.Request) -> chat_api.ParsedRequest:
        """`parsed` with its constraint: response_format compiled in a bounded worker
        (daemon/workers/grammar.py), awaited here so that no thread waits on it; the
        compile slots are shared fairly between the clients (peers) that ask."""
        client = _client(request)
        try:
            factory = await loaded.grammars.compile(parsed.grammar, client)
        except GrammarClosedError:
            raise ApiError(503, "moed is shutting down", type="service_unavailable",
                           code="shutting_down") from None
        except GrammarBusyError as e:
            raise ApiError(429, str(e), type="rate_limit_error", param=parsed.grammar_param,
                           code="grammar_compile_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except GrammarLimitError as e:
            raise ApiError(400, str(e), param=parsed.grammar_param,
                           code="grammar_compile_limit") from None
        except GrammarError as e:
            raise ApiError(400, str(e), param=parsed.grammar_param) from None
        return replace(parsed, grammar=None, engine=replace(parsed.engine, constraint=factory))

    async def _collect(self, parsed: chat_api.ParsedRequest, handle: RequestHandle) -> web.Response:
        choices, event = await self._gather(parsed, handle)
        return web.json_response(chat_api.full_response(parsed, choices, event.stats))

    async def _gather(self, parsed: chat_api.ParsedRequest, handle: RequestHandle):
        """Every choice of a whole answer (text parsed into reasoning, content and tool
        calls where the request has them) and the request's last event (its stats).
        Raises ApiError (500) when generation failed."""
        n = parsed.engine.n
        parts: list[list[str]] = [[] for _ in range(n)]
        entries: list[list] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        stops: list[str | None] = [None] * n
        while True:
            event = await handle.events.get()
            parts[event.index].append(event.text)
            entries[event.index].extend(event.logprobs)
            if event.finish_reason is not None:
                reasons[event.index] = event.finish_reason
                stops[event.index] = event.stop_string
            if event.last:
                break
        if "error" in reasons:
            raise ApiError(500, f"generation failed: {event.error}", type="server_error",
                           code="engine_error")
        tokenizer = self.state.loaded.engine.tokenizer
        choices = [chat_api.Choice("".join(parts[i]), reasons[i],
                              chat_api.LogprobFormatter(tokenizer, parsed.chat).format(entries[i])
                              if parsed.logprobs else None, stop_string=stops[i]) for i in range(n)]
        if parsed.parses_answer:
            for c in choices:
                c.reasoning, c.text, c.tool_calls = parsed.split_answer(c.text)
                if c.tool_calls and c.finish_reason == "stop":
                    c.finish_reason = "tool_calls"
        return choices, event

    async def _stream(self, request: web.Request, parsed: chat_api.ParsedRequest,
                      handle: RequestHandle, headers: dict[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", **headers})
        await response.prepare(request)
        created = int(time.time())
        tokenizer = self.state.loaded.engine.tokenizer
        formatters = [chat_api.LogprobFormatter(tokenizer, parsed.chat) for _ in range(parsed.engine.n)]

        async def send(payload) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload, separators=(",", ":")).encode()
            await response.write(b"data: " + data + b"\n\n")

        # with tools or a thinking model, each choice's text goes through its parser
        # (daemon/api/reasoning.py): reasoning, content and tool calls
        parsers = [parsed.answer_parser() for _ in range(parsed.engine.n)] if parsed.parses_answer else None
        sent_calls = [0] * parsed.engine.n

        async def pieces(index: int, items, logprobs) -> None:
            for kind, value in items:
                if kind == "content":
                    await send(chat_api.chunk(parsed, created, text=value, index=index, logprobs=logprobs))
                elif kind == "reasoning":
                    await send(chat_api.chunk(parsed, created, reasoning=value, index=index, logprobs=logprobs))
                else:
                    await send(chat_api.chunk(parsed, created, index=index, logprobs=logprobs,
                                         tool_call=(sent_calls[index], value)))
                    sent_calls[index] += 1
                logprobs = None
            if logprobs:
                await send(chat_api.chunk(parsed, created, index=index, logprobs=logprobs))

        try:
            if parsed.chat:
                for i in range(parsed.engine.n):
                    await send(chat_api.chunk(parsed, created, role=True, index=i))
            failed = None
            while True:
                event = await handle.events.get()
                logprobs = formatters[event.index].format(event.logprobs) if parsed.logprobs and event.logprobs else None
                reason = event.finish_reason
                if parsers is not None:
                    parser = parsers[event.index]
                    items = parser.feed(event.text) + (parser.finish() if reason is not None else [])
                    if not items and event.token_ids:     # a token whose text is held: an event still
                        items = [("content", "")]
                    await pieces(event.index, items, logprobs)
                    if parser.calls and reason == "stop":
                        reason = "tool_calls"
                elif event.text or logprobs or event.token_ids:   # an event per token, "" too
                    await send(chat_api.chunk(parsed, created, text=event.text, index=event.index,
                                         logprobs=logprobs))
                if reason == "error":
                    failed = event.error
                elif reason is not None:
                    await send(chat_api.chunk(parsed, created, finish_reason=reason,
                                         index=event.index))
                if event.last:
                    break
            if failed is not None:
                await send(ApiError(500, f"generation failed: {failed}", type="server_error",
                                    code="engine_error").body())
            elif parsed.include_usage:
                await send(chat_api.chunk(parsed, created, stats=event.stats))
            await send(b"[DONE]")
            await response.write_eof()
        except ConnectionError:
            # The client left mid-answer ("Cannot write to closing transport"): its request
            # stops (the caller cancels it) and there is nobody to tell; aiohttp would log
            # the error as a traceback of its own.
            request[CLIENT_GONE] = True
        return response

    async def _stream_messages(self, request: web.Request, parsed: chat_api.ParsedRequest,
                               handle: RequestHandle, headers: dict[str, str]) -> web.StreamResponse:
        """Anthropic's event stream of one answer (daemon/api/messages.py)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", **headers})
        await response.prepare(request)

        async def send(kind: str, payload: dict) -> None:
            data = json.dumps(payload, separators=(",", ":")).encode()
            await response.write(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")

        parser = parsed.answer_parser() or AnswerParser(reasoning=False)
        blocks = messages_api.BlockStream()
        prompt = len(parsed.engine.prompt_ids)     # (the cache's share is known at the end)
        try:
            await send("message_start", {"type": "message_start", "message": {
                "id": "msg_" + parsed.engine.request_id.removeprefix("chatcmpl-"), "type": "message",
                "role": "assistant", "model": parsed.model, "content": [], "stop_reason": None,
                "stop_sequence": None, "usage": {"input_tokens": prompt, "output_tokens": 0}}})
            event = await _pump(handle, parser, blocks, send)
            if event.finish_reason == "error":
                await send("error", messages_api.error_body(ApiError(
                    500, f"generation failed: {event.error}", type="server_error")))
            else:
                reason = "tool_calls" if parser.calls and event.finish_reason == "stop" else event.finish_reason
                await send("message_delta", {"type": "message_delta", "delta": {
                    "stop_reason": messages_api.stop_reason(reason, event.stop_string),
                    "stop_sequence": event.stop_string},
                    "usage": messages_api.usage(event.stats)})
                await send("message_stop", {"type": "message_stop"})
            await response.write_eof()
        except ConnectionError:
            request[CLIENT_GONE] = True
        return response

    async def _stream_responses(self, request: web.Request, parsed: chat_api.ParsedRequest,
                                handle: RequestHandle, headers: dict[str, str],
                                body: dict) -> web.StreamResponse:
        """The Responses API's event stream of one answer (daemon/api/responses.py)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", **headers})
        await response.prepare(request)
        sequence = 0

        async def send(kind: str, payload: dict) -> None:
            nonlocal sequence
            data = json.dumps({"type": kind, "sequence_number": sequence, **payload},
                              separators=(",", ":")).encode()
            sequence += 1
            await response.write(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")

        request_id = "resp_" + parsed.engine.request_id.removeprefix("chatcmpl-")
        created = int(time.time())
        parser = parsed.answer_parser() or AnswerParser(reasoning=False)
        items = responses_api.ItemStream()
        try:
            start = responses_api.response(body, request_id, parsed.model, [], None, None, created,
                                           status="in_progress")
            await send("response.created", {"response": start})
            await send("response.in_progress", {"response": start})
            event = await _pump(handle, parser, items, send)
            if event.finish_reason == "error":
                failed = responses_api.response(body, request_id, parsed.model, items.items, None,
                                                event.stats, created, status="failed")
                failed["error"] = {"code": "server_error", "message": f"generation failed: {event.error}"}
                await send("response.failed", {"response": failed})
            else:
                final = responses_api.response(body, request_id, parsed.model, items.items,
                                               event.finish_reason, event.stats, created)
                await send("response.completed" if final["status"] == "completed" else "response.incomplete",
                           {"response": final})
            await response.write_eof()
        except ConnectionError:
            request[CLIENT_GONE] = True
        return response

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        await self._refresh_snapshot(request)
        body = generate_latest(self.state.registry) if self.state.registry is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _refresh_snapshot(self, request: web.Request) -> None:
        """A stats reading for a scrape: while requests run, the last one if younger than
        SNAPSHOT_REUSE_S; else a
        fresh one from the engine thread, waited for at most half the scraper's timeout
        (X-Prometheus-Scrape-Timeout-Seconds) and SCRAPE_WAIT_S — a long prefill holds the
        engine, and then the previous reading is served. Running and waiting counts are
        always read live (the engine keeps them under its own lock)."""
        loaded = self.state.loaded
        if loaded is None or self.state.phase == "loading":
            return
        busy = loaded.engine.stats().running > 0     # idle: a fresh reading costs nobody
        if not busy or time.monotonic() - self.state.snapshot_at >= SNAPSHOT_REUSE_S:
            wait = SCRAPE_WAIT_S
            with contextlib.suppress(ValueError):
                wait = min(wait, 0.5 * float(request.headers.get("X-Prometheus-Scrape-Timeout-Seconds", wait)))
            with contextlib.suppress(TimeoutError, EngineClosedError):
                await asyncio.wait_for(asyncio.wrap_future(
                    loaded.engine.call(lambda: self.state.stats_snapshot(loaded))), max(wait, 0.0))
        if self.state.last_snapshot is not None:
            live = loaded.engine.stats()
            self.state.last_snapshot = replace(self.state.last_snapshot, requests_running=live.running,
                                         requests_waiting=live.waiting)

    async def _on_engine(self, fn):
        loaded = self._require_ready()
        return await asyncio.wrap_future(loaded.engine.call(fn))

    async def stats(self, request: web.Request) -> web.Response:
        loaded = self._require_ready()
        return web.json_response(await self._on_engine(lambda: self.state.stats_snapshot(loaded)))

    async def pins(self, request: web.Request) -> web.Response:
        loaded = self._require_ready()

        def read() -> dict:
            provider = loaded.engine.model.experts
            session = loaded.session
            if getattr(provider, "cache", None) is None:
                return {"model_fingerprint": None, "pins": []}
            counts = provider.usage.counts()
            pins = sorted(provider.cache.pins)
            return {"model_fingerprint": getattr(session, "fingerprint", None),
                    "pins": [{"layer": l, "expert": e,
                              "score": float(counts[provider.moe_layers.index(l), e])}
                             for l, e in pins]}
        return web.json_response(await self._on_engine(read))

    async def pins_reset(self, request: web.Request) -> web.Response:
        self._require_admin(request)
        loaded = self._require_ready()

        def reset() -> dict:
            provider = loaded.engine.model.experts
            if getattr(provider, "cache", None) is None:
                return {"reset": False, "pins": 0}
            if loaded.session is not None:
                return {"reset": True, "pins_dropped": loaded.session.reset()}
            return {"reset": True, "pins_dropped": provider.reset_learning()}
        return web.json_response(await self._on_engine(reset))
