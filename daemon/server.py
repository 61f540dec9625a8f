"""`moed serve`: the asyncio service on a Unix socket (OpenAI-compatible HTTP, aiohttp).

Phases, as in uvicorn's server: `startup` (bind the socket — before anything slow — and
start answering /health with 503 "loading"; load the model in a worker thread while
telling systemd to extend its start timeout; start the engine; READY), `main_loop`
(wait for a signal; SIGHUP reloads the config), `shutdown` (STOPPING; stop accepting;
let running requests finish within shutdown_grace_s; cancel the rest; flush learned
usage; close the socket). Signal handlers only set events.

Threads: the event loop (HTTP, timers), the engine thread (the model), the io workers
(expert reads). The loop never blocks on the model or the disk: it talks to the
engine through `Engine.submit` / `Engine.call` and awaits futures.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
GET /metrics, GET /v1/moed/stats, GET /v1/moed/pins, POST /v1/moed/pins/reset (admin:
the daemon's uid or root, from SO_PEERCRED; refused on TCP). Errors are OpenAI-shaped.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from daemon import api
from daemon.api import ApiError
from daemon.config import ServeConfig
from daemon.engine import Engine, EngineClosedError, QueueFullError, RequestHandle
from daemon.sdnotify import Notifier
from daemon.stats import collect, status_line
from telemetry.logs import get_logger, set_level

log = get_logger("server")

IDLE_TUNING_AFTER_S = 30.0      # tuner = live+idle: idle this long before the built-in workload
IDLE_POLL_S = 1.0
PROBE_SECONDS = 4.0             # the storage probe after READY (issue: at most 5 s)
PROBE_IDLE_S = 1.0              # ... once nothing has been served for this long
FLUSH_INTERVAL_S = 60.0         # learned usage written to the state file this often
STATUS_INTERVAL_S = 5.0         # systemd STATUS= line refresh
EXTEND_TIMEOUT_S = 30.0         # EXTEND_TIMEOUT_USEC step while the model loads
RETRY_AFTER_S = 1
SCRAPE_WAIT_S = 2.0             # /metrics waits at most this long for a fresh snapshot, else the last one
SNAPSHOT_REUSE_S = 0.5          # a snapshot younger than this serves a scrape (scrape storms cost nothing)
SHUTDOWN_CONNECTIONS_S = 5.0    # after the drain: open connections get this long to close


@dataclass
class Loaded:
    """What startup builds once the model is in memory."""

    engine: Engine
    model_names: tuple[str, ...]
    stop_ids: frozenset[int]
    context: int
    session: object | None      # daemon.cli-style streaming session (provider, store)
    model_type: str
    tuner: object | None = None  # daemon.tuning.LiveTuner (tuner = live / live+idle)
    workload: object | None = None  # daemon.tuning.Workload for live+idle


def peer_uid(request: web.Request) -> int | None:
    """The uid of the process at the other end of a Unix-socket connection, else None."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _is_tcp(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)


def error_response(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=e.headers)


class Daemon:
    """One serving process. `run()` returns the exit code.

    config: the validated ServeConfig. reload: a callable returning a fresh ServeConfig
    (re-reads file and environment; raises ValueError when invalid) for SIGHUP.
    load: a callable (config) -> Loaded, run in a worker thread (the model load).
    listener: a bound, listening socket (from daemon.listen), with close().
    telemetry: the daemon's telemetry.metrics.DaemonMetrics (its registry is rendered at
    /metrics; its collector reads `last_snapshot`), or None.
    """

    def __init__(self, config: ServeConfig, *, load, reload, listener, notifier: Notifier,
                 telemetry=None):
        self.config = config
        self._load = load
        self._reload = reload
        self.listener = listener
        self.notifier = notifier
        self.telemetry = telemetry
        self.registry = telemetry.registry if telemetry is not None else None
        # The app of metrics_address (None without telemetry: nothing to serve there).
        self.metrics_app = self.metrics_application() if telemetry is not None else None
        self.last_snapshot = None        # telemetry.metrics.Snapshot of the latest stats reading
        self._snapshot_at = float("-inf")  # time.monotonic() of that reading
        self.load_seconds = 0.0
        self.loaded: Loaded | None = None
        self.memory_watcher = None          # daemon.squeeze.MemoryWatcher (streamed experts)
        self.phase = "loading"           # loading | ready | draining
        self._stop = asyncio.Event()
        self._hup = asyncio.Event()
        self._sigints = 0
        self._handlers: set[asyncio.Task] = set()
        self._runners: list[web.AppRunner] = []
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.metrics_bound: str | None = None
        self.exit_code = 0

    # ------------------------------------------------------------------ the app

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._count, self._errors, self._auth])
        app.router.add_get("/health", self.health, name="health")
        app.router.add_get("/v1/models", self.models, name="models")
        app.router.add_post("/v1/completions", self.completions, name="completions")
        app.router.add_post("/v1/chat/completions", self.chat_completions, name="chat_completions")
        app.router.add_get("/metrics", self.metrics, name="metrics")
        app.router.add_get("/v1/moed/stats", self.stats, name="stats")
        app.router.add_get("/v1/moed/pins", self.pins, name="pins")
        app.router.add_post("/v1/moed/pins/reset", self.pins_reset, name="pins_reset")
        return app

    @web.middleware
    async def _count(self, request: web.Request, handler):
        """Count every response by route name and status (499: the client went away)."""
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except (asyncio.CancelledError, ConnectionError):
            status = 499
            raise
        finally:
            if self.telemetry is not None:
                self.telemetry.response(request.match_info.route.name, status)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return error_response(e)
        except RequestPayloadError as e:    # e.g. a body whose Content-Encoding is broken
            return error_response(ApiError(400, f"the request body cannot be read: {e}"))
        except web.HTTPException as e:      # aiohttp's own 404/405/413: OpenAI-shaped
            if e.status < 400:
                raise
            kind = {404: "not_found_error", 405: "invalid_request_error",
                    413: "invalid_request_error"}.get(e.status, "invalid_request_error")
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None  # 405 must say
            return error_response(ApiError(e.status, f"{request.method} {request.path}: {e.reason}",
                                           type=kind, headers=allow))
        except (asyncio.CancelledError, ConnectionError):
            raise                            # the client went away: nobody to answer
        except Exception as e:              # a bug: answer in OpenAI's shape, keep serving
            log.exception("request_failed", path=request.path)
            return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                           type="server_error", code="internal_error"))

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if _is_tcp(request) and self.config.api_key:
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or key.strip() != self.config.api_key:
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                               code="invalid_api_key")
        return await handler(request)

    def _require_ready(self) -> Loaded:
        if self.phase == "loading" or self.loaded is None:
            raise ApiError(503, "moed is loading the model", type="service_unavailable",
                           code="loading", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.phase == "draining":
            raise ApiError(503, "moed is shutting down", type="service_unavailable",
                           code="shutting_down")
        return self.loaded

    def _require_admin(self, request: web.Request) -> None:
        uid = peer_uid(request)
        if uid is None or uid not in (0, os.getuid()):
            raise ApiError(403, "admin calls are allowed only from the daemon's user or root, "
                                "over the Unix socket", type="permission_error",
                           code="permission_denied")

    async def _json(self, request: web.Request):
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, f"request body of {request.content_length} bytes is over the "
                                f"limit of {limit} bytes (max_body_bytes)", code="request_too_large")
        data = bytearray()      # read(n) returns what has arrived: loop until EOF or over
        while len(data) <= limit:
            part = await request.content.read(limit + 1 - len(data))
            if not part:
                break
            data += part
        if len(data) > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes (max_body_bytes)",
                           code="request_too_large")
        try:
            return json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: huge ints too
            raise ApiError(400, f"the request body is not valid JSON: {type(e).__name__}: "
                                f"{str(e)[:200]}") from None

    # ------------------------------------------------------------------ routes

    async def health(self, request: web.Request) -> web.Response:
        if self.phase == "ready":
            return web.json_response({"status": "ok"})
        reason = "loading the model" if self.phase == "loading" else "shutting down"
        return web.json_response({"status": self.phase, "reason": reason}, status=503)

    async def models(self, request: web.Request) -> web.Response:
        loaded = self._require_ready()
        return web.json_response({"object": "list", "data": [
            {"id": loaded.model_names[0], "object": "model", "created": int(self.started_wall),
             "owned_by": "moed"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        loaded = self._require_ready()
        body = await self._json(request)
        engine = loaded.engine
        parsed = await asyncio.to_thread(      # templates and tokenization are CPU work
            api.parse_request, body, chat=chat, model_names=loaded.model_names, tokenizer=engine.tokenizer,
            stop_ids=loaded.stop_ids, context=loaded.context, max_tokens_cap=self.config.max_tokens,
            request_timeout_s=self.config.request_timeout_s, now=engine.clock())
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
        handle.endpoint = "chat_completions" if chat else "completions"
        try:
            if parsed.stream:
                return await self._stream(request, parsed, handle)
            return await self._collect(parsed, handle)
        finally:
            if not handle.finished:
                handle.cancel()      # the client went away (or we failed): free the place

    async def _collect(self, parsed: api.ParsedRequest, handle: RequestHandle) -> web.Response:
        parts = []
        while True:
            event = await handle.events.get()
            parts.append(event.text)
            if event.finish_reason is not None:
                break
        if event.finish_reason == "error":
            raise ApiError(500, f"generation failed: {event.error}", type="server_error",
                           code="engine_error")
        return web.json_response(api.full_response(parsed, "".join(parts), event.finish_reason,
                                                   event.stats))

    async def _stream(self, request: web.Request, parsed: api.ParsedRequest,
                      handle: RequestHandle) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        created = int(time.time())

        async def send(payload) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload, separators=(",", ":")).encode()
            await response.write(b"data: " + data + b"\n\n")

        if parsed.chat:
            await send(api.chunk(parsed, created, role=True))
        while True:
            event = await handle.events.get()
            if event.text:
                await send(api.chunk(parsed, created, text=event.text))
            if event.finish_reason is not None:
                break
        if event.finish_reason == "error":
            await send(ApiError(500, f"generation failed: {event.error}", type="server_error",
                                code="engine_error").body())
        else:
            await send(api.chunk(parsed, created, finish_reason=event.finish_reason))
            if parsed.include_usage:
                await send(api.chunk(parsed, created, stats=event.stats))
        await send(b"[DONE]")
        await response.write_eof()
        return response

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        await self._refresh_snapshot(request)
        body = generate_latest(self.registry) if self.registry is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def metrics_application(self) -> web.Application:
        """The app of `metrics_address`: /metrics only, counted like the socket's routes."""
        app = web.Application(middlewares=[self._count])
        app.router.add_get("/metrics", self.metrics, name="metrics")
        return app

    async def _refresh_snapshot(self, request: web.Request) -> None:
        """A stats reading for a scrape: while requests run, the last one if younger than
        SNAPSHOT_REUSE_S; else a
        fresh one from the engine thread, waited for at most half the scraper's timeout
        (X-Prometheus-Scrape-Timeout-Seconds) and SCRAPE_WAIT_S — a long prefill holds the
        engine, and then the previous reading is served. Running and waiting counts are
        always read live (the engine keeps them under its own lock)."""
        loaded = self.loaded
        if loaded is None or self.phase == "loading":
            return
        busy = loaded.engine.stats().running > 0     # idle: a fresh reading costs nobody
        if not busy or time.monotonic() - self._snapshot_at >= SNAPSHOT_REUSE_S:
            wait = SCRAPE_WAIT_S
            with contextlib.suppress(ValueError):
                wait = min(wait, 0.5 * float(request.headers.get("X-Prometheus-Scrape-Timeout-Seconds", wait)))
            with contextlib.suppress(TimeoutError, EngineClosedError):
                await asyncio.wait_for(asyncio.wrap_future(
                    loaded.engine.call(lambda: self.stats_snapshot(loaded))), max(wait, 0.0))
        if self.last_snapshot is not None:
            live = loaded.engine.stats()
            self.last_snapshot = replace(self.last_snapshot, requests_running=live.running,
                                         requests_waiting=live.waiting)

    async def _on_engine(self, fn):
        loaded = self._require_ready()
        return await asyncio.wrap_future(loaded.engine.call(fn))

    async def stats(self, request: web.Request) -> web.Response:
        loaded = self._require_ready()
        return web.json_response(await self._on_engine(lambda: self.stats_snapshot(loaded)))

    def stats_snapshot(self, loaded: Loaded) -> dict:
        """moed's own statistics (runs on the engine thread); the same reading becomes
        `last_snapshot`, which /metrics exports (daemon.stats)."""
        snapshot, out = collect(loaded.engine, loaded.session,
                                memory_budget_bytes=(loaded.session.options.cache_bytes
                                                     if loaded.session is not None else 0),
                                memory_available_bytes=_mem_available(),
                                model_load_seconds=self.load_seconds)
        self.last_snapshot = snapshot
        self._snapshot_at = time.monotonic()
        out.update(model=loaded.model_names[0], uptime_seconds=time.monotonic() - self.started)
        out["tuner"] = {"mode": self.config.tuner if loaded.tuner is not None else "off"}
        if loaded.tuner is not None:
            t = loaded.tuner.tuner
            out["tuner"].update(finished=loaded.tuner.finished, settings=dict(t.settings()),
                                best=dict(t.incumbent), trials=len(t.trials),
                                kept=sum(1 for x in t.trials if x.outcome == "win"))
        return out

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

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """startup -> main_loop -> shutdown; the process exit code."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        loop.add_signal_handler(signal.SIGHUP, self._hup.set)
        try:
            if await self.startup():
                await self.main_loop()
        except BaseException:
            self.exit_code = 1
            raise
        finally:
            await self.shutdown()
        return self.exit_code

    def _on_sigint(self) -> None:
        self._sigints += 1
        if self._sigints > 1:
            log.warning("forced_exit", signal="SIGINT")
            os._exit(130)
        self._stop.set()

    async def startup(self) -> bool:
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_CONNECTIONS_S)
        await runner.setup()
        self._runners.append(runner)
        await web.SockSite(runner, self.listener.sock).start()
        if self.config.tcp_address is not None:
            tcp = self.config.tcp_address
            await _start_site(web.TCPSite(runner, tcp.host, tcp.port), "tcp_address", tcp)
            host, port = [a for a in runner.addresses if isinstance(a, tuple)][-1][:2]
            log.info("tcp_listening", address=f"{host}:{port}", api_key=self.config.api_key is not None)
        if self.metrics_app is not None:
            metrics_runner = web.AppRunner(self.metrics_app, access_log=None)
            await metrics_runner.setup()
            self._runners.append(metrics_runner)
            address = self.config.metrics_address
            await _start_site(web.TCPSite(metrics_runner, address.host, address.port),
                              "metrics_address", address)
            host, port = metrics_runner.addresses[0][:2]
            self.metrics_bound = f"{host}:{port}"
            log.info("metrics_listening", address=self.metrics_bound)
        log.info("socket_listening", socket=self.listener.path)
        load_started = time.monotonic()
        load = asyncio.ensure_future(asyncio.to_thread(self._load, self.config))
        while not load.done():
            self.notifier.extend_timeout(int(2 * EXTEND_TIMEOUT_S * 1e6))
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({load, stop}, timeout=EXTEND_TIMEOUT_S,
                               return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if self._stop.is_set() and not load.done():
                log.info("stopping_during_load")
                self.exit_code = 0
                with contextlib.suppress(BaseException):
                    self.loaded = await load       # the load thread cannot be interrupted
                return False
        try:
            self.loaded = load.result()
            self.load_seconds = time.monotonic() - load_started
        except (OSError, ValueError) as e:
            log.error("model_load_failed", error=str(e))
            self.exit_code = 1
            return False
        self.loaded.engine.start()
        self.phase = "ready"
        self.notifier.ready()
        log.info("ready", model=self.loaded.model_names[0], socket=self.listener.path,
                 load_seconds=round(self.load_seconds, 3))
        return True

    async def main_loop(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            timers = [tasks.create_task(self._watchdog()), tasks.create_task(self._status()),
                      tasks.create_task(self._flusher()), tasks.create_task(self._reloader()),
                      tasks.create_task(self._idle_tuning()), tasks.create_task(self._memory_watch()),
                      tasks.create_task(self._storage_probe())]
            await self._stop.wait()
            for t in timers:
                t.cancel()

    async def _watchdog(self) -> None:
        interval = self.notifier.watchdog_interval_s()
        if interval is None:
            return
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    async def _status(self) -> None:
        while True:
            try:
                snap = await self._on_engine(lambda: self.stats_snapshot(self.loaded))
                self.notifier.status(status_line(snap))
            except ApiError:
                pass
            await asyncio.sleep(STATUS_INTERVAL_S)

    async def _storage_probe(self) -> None:
        """Streamed experts and no saved `moed iobench` result for the model's disk: once
        the daemon has been idle for a moment after READY, run a short probe (at most
        PROBE_SECONDS, on the engine thread so no read of a request competes with it) and
        save it in the state directory, as `moed iobench` does. A request that arrives
        meanwhile stops the probe between two of its passes (a fraction of a second) and
        goes first; the probe starts again at the next idle moment. A failure is a warning."""
        from daemon.iobench import (ProbeInterrupted, block_device, model_target, report_path,
                                    run_iobench, save_report)

        loaded = self.loaded
        if loaded is None or loaded.session is None or loaded.session.store is None:
            return
        state_dir = loaded.session.store.state_dir
        try:
            target = await asyncio.to_thread(model_target, self.config.model)
            if report_path(state_dir, block_device(target.files[0])).exists():
                return
        except (OSError, ValueError) as e:
            log.warning("storage_probe_skipped", error=str(e))
            return
        def request_waiting() -> bool:
            return loaded.engine.stats().waiting > 0

        while True:
            idle_since = time.monotonic()
            while time.monotonic() - idle_since < PROBE_IDLE_S:
                await asyncio.sleep(0.25)
                s = loaded.engine.stats()
                if s.running or s.waiting:
                    idle_since = time.monotonic()
            log.info("storage_probe_started", seconds=PROBE_SECONDS)
            try:
                report = await asyncio.wrap_future(loaded.engine.call(
                    lambda: run_iobench(target, seconds=PROBE_SECONDS, repeats=2,
                                        interrupted=request_waiting)))
                path = await asyncio.to_thread(save_report, state_dir,
                                               json.dumps(report, indent=2) + "\n", report["device"])
                break
            except ProbeInterrupted as e:
                log.info("storage_probe_deferred", reason="a request arrived", progress=str(e))
            except (OSError, ValueError) as e:
                log.warning("storage_probe_failed", error=str(e))
                return
        best = max(report["results"], key=lambda r: r["gb_per_s"])
        log.info("storage_probe_saved", path=str(path), io_path=report["io_path"],
                 best_gb_per_s=round(best["gb_per_s"], 3), best_mode=best["mode"],
                 best_queue_depth=best["queue_depth"])

    async def _memory_watch(self) -> None:
        """Streamed experts: every MEMORY_POLL_S re-read the memory available and shrink or
        grow the expert cache (daemon.squeeze) up to the budget it started with (configured,
        or planned); a failed reading or resize is a warning."""
        from daemon.squeeze import MEMORY_POLL_S, MemoryWatcher
        from daemon.streaming import minimum_cache_bytes

        loaded = self.loaded
        if loaded is None or loaded.session is None:
            return
        model = loaded.engine.model
        self.memory_watcher = MemoryWatcher(
            loaded.session, loaded.session.options.cache_bytes,     # configured or planned
            minimum_cache_bytes(model.layout, model.config),
            run_on_engine=lambda fn: loaded.engine.call(fn).result())
        while True:
            await asyncio.sleep(MEMORY_POLL_S)
            try:
                await asyncio.to_thread(self.memory_watcher.check)
            except (OSError, ValueError) as e:
                log.warning("memory_watch_failed", error=str(e))

    async def _idle_tuning(self) -> None:
        """tuner = live+idle: while nothing is served for IDLE_TUNING_AFTER_S, feed the live
        tuner one window of the built-in workload at a time (requests wait at most one
        window). Its routing does not count as usage: pins follow real traffic only."""
        loaded = self.loaded
        if loaded is None or loaded.tuner is None or loaded.workload is None:
            return
        tuner, workload, engine = loaded.tuner, loaded.workload, loaded.engine
        idle_since = time.monotonic()

        def window() -> None:
            provider = loaded.session.provider
            provider.observe_usage = False
            try:
                workload.window(tuner.window_steps, on_step=tuner.step_done)
            finally:
                provider.observe_usage = True

        while not tuner.finished:
            await asyncio.sleep(IDLE_POLL_S)
            s = engine.stats()
            if s.running or s.waiting:
                idle_since = time.monotonic()
                continue
            if time.monotonic() - idle_since < IDLE_TUNING_AFTER_S:
                continue
            try:
                await asyncio.wrap_future(engine.call(window))
            except (OSError, ValueError) as e:
                log.warning("idle_tuning_window_failed", error=str(e))
                return

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            await self.flush_state()

    async def flush_state(self) -> None:
        loaded = self.loaded
        if loaded is None or loaded.session is None:
            return
        try:
            saved = await asyncio.wrap_future(loaded.engine.call(loaded.session.flush))
        except OSError as e:
            log.warning("state_save_failed", error=str(e))
        else:
            if saved:
                log.info("state_saved", path=str(loaded.session.store.path))

    async def _reloader(self) -> None:
        while True:
            await self._hup.wait()
            self._hup.clear()
            await self.reload()

    async def reload(self) -> None:
        """SIGHUP: re-read the config; apply limits, log level and the cache budget live."""
        self.notifier.reloading()
        try:
            new = self._reload()
        except (OSError, ValueError, RecursionError) as e:
            log.error("reload_failed", error=str(e), kept="previous configuration")
            self.notifier.ready()
            return
        changed = {k for k, v in new.to_dict().items() if self.config.to_dict().get(k) != v}
        fixed = changed & {"model", "socket", "socket_mode", "socket_group", "state_dir",
                           "metrics_address", "tcp_address", "threads", "io_workers", "tuner"}
        if fixed:
            log.warning("reload_needs_restart", keys=sorted(fixed))
        new = replace(new, **{k: getattr(self.config, k) for k in fixed})
        loaded = self.loaded
        try:
            if loaded is not None:
                loaded.engine.set_limits(new.max_concurrent_sequences, new.max_queue)
                if ("expert_cache_bytes" in changed or "pin_fraction" in changed
                        or "prefetch" in changed) and loaded.session is not None:
                    if self.memory_watcher is not None and new.expert_cache_bytes is not None:
                        self.memory_watcher.set_maximum(new.expert_cache_bytes, new.pin_fraction)
                    tuner = loaded.tuner
                    if "prefetch" in changed and tuner is not None:   # the operator decides now
                        from daemon.tuning import PREFETCH_WIDTH
                        await asyncio.wrap_future(loaded.engine.call(
                            lambda: tuner.stop("prefetch set by reload", keep={PREFETCH_WIDTH})))
                    await asyncio.wrap_future(loaded.engine.call(lambda: loaded.session.rebuild(
                        new.expert_cache_bytes, new.pin_fraction,
                        new.prefetch if "prefetch" in changed else None)))
            set_level(new.log_level)
        except (OSError, ValueError) as e:
            if loaded is not None:   # the new limits went in before the cache refused: undo
                old = self.config
                loaded.engine.set_limits(old.max_concurrent_sequences, old.max_queue)
            log.error("reload_failed", error=str(e), kept="previous configuration")
            self.notifier.ready()
            return
        self.config = new
        log.info("reloaded", changed=sorted(changed - fixed))
        self.notifier.ready()

    async def shutdown(self) -> None:
        self.notifier.stopping()
        self.phase = "draining"
        loaded = self.loaded
        if loaded is not None:
            engine = loaded.engine
            engine.stop_accepting()
            stats = engine.stats()
            log.info("draining", running=stats.running, waiting=stats.waiting,
                     grace_s=self.config.shutdown_grace_s)
            finished = await asyncio.to_thread(engine.wait_idle, self.config.shutdown_grace_s)
            if not finished:
                log.warning("shutdown_grace_expired", grace_s=self.config.shutdown_grace_s)
                engine.cancel_all()
                await asyncio.to_thread(engine.wait_idle, None)
            await self.flush_state()
            engine.stop()
        for runner in reversed(self._runners):
            await runner.cleanup()
        if loaded is not None:
            loaded.engine.model.close()
        self.listener.close()
        log.info("stopped", exit_code=self.exit_code)


async def _start_site(site: web.TCPSite, key: str, address) -> None:
    """Start a TCP listener; a bind error names the config key to change."""
    try:
        await site.start()
    except OSError as e:
        raise OSError(e.errno, f"{key} {address}: {e.strerror}; set --{key.replace('_', '-')} "
                               "HOST:PORT (port 0 picks a free port)") from None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------- wiring


def request_finished(handle: RequestHandle, telemetry=None) -> None:
    """The canonical log line of one request, and the same numbers into the request
    histograms of `telemetry` (a DaemonMetrics, or None). Called on the engine thread."""
    s = handle.stats
    if telemetry is not None:
        telemetry.request_finished(handle.finish_reason, s.queue_s, s.time_to_first_token_s,
                                   s.duration_s)
    log.info("request_finished", request_id=handle.request.request_id, endpoint=handle.endpoint,
             finish_reason=handle.finish_reason, prompt_tokens=s.prompt_tokens,
             completion_tokens=s.completion_tokens, queue_seconds=round(s.queue_s, 6),
             time_to_first_token_seconds=None if s.time_to_first_token_s is None
             else round(s.time_to_first_token_s, 6),
             duration_seconds=round(s.duration_s, 6), decode_steps=s.decode_steps,
             decode_steps_after_cancel=s.steps_after_cancel, expert_hits=s.expert_hits,
             expert_misses=s.expert_misses, expert_bytes_read=s.expert_bytes_read)


def load_for_serving(config: ServeConfig, environ: Mapping[str, str], telemetry=None) -> Loaded:
    """Open the model, tokenizer, learned state and engine that `config` describes.

    telemetry: the daemon's DaemonMetrics, fed by the engine's hooks (or None)."""
    from daemon.session import open_model
    from ext.tokenizer import Tokenizer, stop_token_ids

    model_dir = config.require_model()
    tokenizer = Tokenizer.from_model_dir(model_dir)
    stop_ids = frozenset(stop_token_ids(model_dir))
    cache_bytes = config.expert_cache_bytes
    if cache_bytes is None:          # the memory planner decides (raises MemoryPlanError)
        from daemon.memory import plan_serving_memory
        planned = plan_serving_memory(model_dir, max_concurrent_sequences=config.max_concurrent_sequences,
                                      pin_fraction=config.pin_fraction)
        p = planned.plan
        log.info("memory_plan", available_bytes=p.available_bytes, dense_bytes=p.dense_bytes,
                 kv_bytes=p.kv_bytes, kv_context_tokens=planned.context,
                 runtime_bytes=p.runtime_bytes, margin_bytes=p.margin_bytes,
                 expert_cache_bytes=p.expert_cache_bytes, all_experts_bytes=planned.all_experts_bytes,
                 experts="streamed" if planned.stream else "memory-mapped (they all fit)")
        if planned.stream:
            cache_bytes = p.expert_cache_bytes
    model, session = open_model(model_dir, threads=config.threads, cache_bytes=cache_bytes,
                                io_workers=config.io_workers, prefetch=config.prefetch,
                                pin_fraction=config.pin_fraction,
                                half_life_tokens=config.half_life_tokens, mlock=True,
                                state_dir=config.state_dir, environ=environ)
    engine = Engine(model, tokenizer, max_concurrent_sequences=config.max_concurrent_sequences,
                    max_queue=config.max_queue,
                    on_finish=lambda handle: request_finished(handle, telemetry),
                    on_decode_step=telemetry.decode_step_done if telemetry is not None else None,
                    on_token_gap=telemetry.token_gap if telemetry is not None else None)
    tuner = workload = None
    if session is not None and config.tuner != "off":
        from daemon.config import DEFAULT_SOURCE
        from daemon.tuning import (IO_WORKERS, PREFETCH_WIDTH, THREADS, Workload,
                                   start_live_tuning, workload_prompts)
        fixed = {knob for key, knob in (("threads", THREADS), ("io_workers", IO_WORKERS))
                 if config.sources.get(key, DEFAULT_SOURCE) != DEFAULT_SOURCE}
        if not config.prefetch or config.sources.get("prefetch", DEFAULT_SOURCE) != DEFAULT_SOURCE:
            fixed.add(PREFETCH_WIDTH)
        state_dir = session.store.state_dir if session.store is not None else None
        tuner = start_live_tuning(model, session, config.tuner, fixed, state_dir, model_dir)
        if tuner is not None:
            engine.step_observers.append(tuner.step_done)
            if config.tuner == "live+idle":
                workload = Workload(model, workload_prompts(model_dir, model.config.vocab_size))
    path = Path(model_dir).resolve()
    names = (path.name, str(model_dir), str(path))
    return Loaded(engine=engine, model_names=tuple(dict.fromkeys(names)), stop_ids=stop_ids,
                  context=model.config.max_position_embeddings, session=session,
                  model_type=model.config.model_type, tuner=tuner, workload=workload)


class _AdoptedListener:
    """A socket-activated listener: the service manager owns the file; close only the fd."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        try:
            self.path = sock.getsockname() or f"fd {sock.fileno()}"
        except OSError:
            self.path = f"fd {sock.fileno()}"

    def close(self) -> None:
        self.sock.close()


def serve(config: ServeConfig, *, reload, environ: Mapping[str, str], version: str) -> int:
    """Run the daemon until a signal stops it; the exit code (0 after a clean drain).

    reload: () -> ServeConfig, re-reading file and environment (SIGHUP).
    Binding happens first: "another moed serves PATH" and a non-socket path exit 1
    before any model is read.
    """
    from daemon.io import READ_SECONDS_BUCKETS
    from daemon.listen import ListenError, adopt_fd, bind_unix_socket
    from daemon.sdnotify import listen_fds
    from ext.config import load_config as load_model_config
    from telemetry.metrics import DaemonMetrics

    fds = listen_fds(environ)
    try:
        if fds:
            listener = _AdoptedListener(adopt_fd(fds[0]))
        else:
            listener = bind_unix_socket(config.socket, mode=config.socket_mode,
                                        group=config.socket_group)
    except (ListenError, OSError) as e:
        log.error("socket_unavailable", socket=config.socket, error=str(e))
        print(f"moed serve: error: {e}", file=sys.stderr)
        return 1
    try:
        model_config = load_model_config(config.require_model())
        model_type = model_config.model_type
        moe_layers = [l for l, is_moe in enumerate(model_config.moe_layers) if is_moe]
    except ValueError:
        model_type, moe_layers = "unknown", []   # the load reports the real error
    daemon: Daemon | None = None
    telemetry = DaemonMetrics(version=version, model_type=model_type, moe_layers=moe_layers,
                              read_seconds_buckets=READ_SECONDS_BUCKETS,
                              source=lambda: daemon.last_snapshot if daemon is not None else None)
    notifier = Notifier(environ)
    daemon = Daemon(config, load=lambda c: load_for_serving(c, environ, telemetry), reload=reload,
                    listener=listener, notifier=notifier, telemetry=telemetry)
    try:
        return asyncio.run(daemon.run())
    finally:
        listener.close()
        notifier.close()
