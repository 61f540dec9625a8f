"""`moed serve`: one serving process, from binding its socket to its last state flush.

Phases, as in uvicorn's server: `startup` (bind the socket — before anything slow — and
start answering /health with 503 "loading"; load the model in a worker thread while
telling systemd to extend its start timeout; start the engine; READY), `main_loop`
(the background loops of daemon/service/background.py; SIGHUP reloads the config),
`shutdown` (STOPPING; stop accepting; let running requests finish within
shutdown_grace_s; cancel the rest; flush learned usage; close the socket). Signal
handlers only set events. The HTTP routes are daemon/service/app.py's.

Threads: the event loop (HTTP, timers), the engine thread (the model), the io workers
(expert reads). The loop never blocks on the model or the disk.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from aiohttp import web

from daemon.service.app import HttpApp
from daemon.service.background import BackgroundTasks
from daemon.service.config import KEYS, ServeConfig
from daemon.service.connections import GatedSite, fit_open_files, tcp_socket
from daemon.service.listen import AdoptedListener, ListenError, adopt_fd, bind_unix_socket
from daemon.service.loading import load_for_serving, promised_bytes, reload_expert_cache_bytes
from daemon.service.sdnotify import Notifier, listen_fds
from daemon.service.serving import ServingState
from daemon.store.reads import READ_SECONDS_BUCKETS
from daemon.tuning.knobs import PREFETCH_WIDTH
from ext.formats.files import read_json
from ext.formats.quant import quantization_label
from ext.kernels import resolve_numerics
from ext.models.config import load_config as load_model_config
from telemetry.logs import get_logger, set_level
from telemetry.metrics import DaemonMetrics

log = get_logger("server")

EXTEND_TIMEOUT_S = 30.0         # EXTEND_TIMEOUT_USEC step while the model loads
SHUTDOWN_CONNECTIONS_S = 5.0    # after the drain: open connections get this long to close
LINGERING_S = 0.5               # reading on after an early answer (startup())
# Keys a SIGHUP cannot apply: read once, at bind or load. A reload that changes one keeps
# the running value and says so (the `reloaded` line's needs_restart).
RESTART_KEYS = frozenset({
    "model", "socket", "socket_mode", "socket_group", "state_dir", "metrics_address",
    "tcp_address", "threads", "io_workers", "tuner", "expert_cache_mode", "header_timeout_s",
    "max_connections", "max_connections_per_peer", "record_trace", "max_context_tokens",
    "numerics", "half_life_tokens", "prefill_chunk"})


class Daemon:
    """One serving process. `run()` returns the exit code.

    config: the validated ServeConfig. reload: a callable returning a fresh ServeConfig
    (re-reads file and environment; raises ValueError when invalid) for SIGHUP.
    load: a callable (config) -> Loaded, run in a worker thread (the model load).
    listener: a bound, listening socket (from daemon/service/listen.py), with close().
    telemetry: the daemon's telemetry.metrics.DaemonMetrics (its registry is rendered at
    /metrics; its collector reads `last_snapshot`), or None.

    `state` (daemon/service/serving.py) is what the routes and the background loops read
    and what the lifecycle changes: phase, the loaded model, the configuration.
    """

    def __init__(self, config: ServeConfig, *, load, reload, listener, notifier: Notifier,
                 telemetry=None):
        self.state = ServingState(config, notifier, telemetry)
        self._load = load
        self._reload = reload
        self.listener = listener
        self._stop = asyncio.Event()
        self._hup = asyncio.Event()
        self._sigints = 0
        self._runners: list[web.AppRunner] = []
        self.sites: dict[str, GatedSite] = {}   # by listener: "socket", "tcp", "metrics"
        self.metrics_bound: str | None = None
        self.exit_code = 0
        self.http = HttpApp(self.state)
        # The app of metrics_address (None without telemetry: nothing to serve there).
        self.metrics_app = self.http.metrics_application() if telemetry is not None else None
        self.background = BackgroundTasks(self.state)

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
        config = self.state.config
        # keepalive_timeout bounds the wait for a whole request head, from the connection's
        # start and after each answer (daemon/service/connections.py)
        # lingering_time: after an answer given before its body was read (a 413), aiohttp
        # reads and discards the rest for this long so that the client sees the answer
        # before the connection closes; its default of 10 s let an endless body stream in
        # at gigabytes a second.
        runner = web.AppRunner(self.http.application(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_CONNECTIONS_S,
                               keepalive_timeout=config.header_timeout_s,
                               lingering_time=LINGERING_S)
        await runner.setup()
        self._runners.append(runner)
        self.sites["socket"] = self._site(runner, self.listener.sock, "socket")
        await self.sites["socket"].start()
        if config.tcp_address is not None:
            tcp = config.tcp_address
            host, port = await self._start_tcp(runner, "tcp", "tcp_address", tcp)
            log.info("tcp_listening", address=f"{host}:{port}", api_key=config.api_key is not None)
        if self.metrics_app is not None:
            metrics_runner = web.AppRunner(self.metrics_app, access_log=None,
                                           keepalive_timeout=config.header_timeout_s)
            await metrics_runner.setup()
            self._runners.append(metrics_runner)
            host, port = await self._start_tcp(metrics_runner, "metrics", "metrics_address",
                                               config.metrics_address)
            self.metrics_bound = f"{host}:{port}"
            log.info("metrics_listening", address=self.metrics_bound)
        log.info("socket_listening", socket=self.listener.path)
        load_started = time.monotonic()
        load = asyncio.ensure_future(asyncio.to_thread(self._load, self.state.config))
        while not load.done():
            self.state.notifier.extend_timeout(int(2 * EXTEND_TIMEOUT_S * 1e6))
            stop = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({load, stop}, timeout=EXTEND_TIMEOUT_S,
                               return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if self._stop.is_set() and not load.done():
                log.info("stopping_during_load")
                self.exit_code = 0
                with contextlib.suppress(BaseException):
                    self.state.loaded = await load       # the load thread cannot be interrupted
                return False
        try:
            self.state.loaded = load.result()
            self.state.load_seconds = time.monotonic() - load_started
        except (OSError, ValueError) as e:
            log.error("model_load_failed", error=str(e))
            print(f"moed serve: error: {e}", file=sys.stderr, flush=True)   # for a person too
            self.exit_code = 1
            return False
        self.state.loaded.engine.start()
        self.state.phase = "ready"
        self.state.notifier.ready()
        formats = self.state.loaded.weight_formats
        log.info("ready", model=self.state.loaded.model_names[0], socket=self.listener.path,
                 load_seconds=round(self.state.load_seconds, 3),
                 expert_format=formats.get("experts"), dense_format=formats.get("dense"),
                 quant_method=(formats.get("quantization") or {}).get("quant_method", "none"),
                 quantization=formats.get("quantization"), numerics=formats.get("numerics"),
                 numerics_configured=self.state.config.numerics)
        return True

    def _site(self, runner: web.BaseRunner, sock, listener: str) -> GatedSite:
        telemetry = self.state.telemetry
        config = self.state.config
        # The per-peer cap is for TCP peers. On the Unix socket every local client of one
        # uid (a proxy, an application's workers) is one peer, and the socket's mode and
        # group already say who may connect.
        per_peer = None if listener == "socket" else config.max_connections_per_peer
        return GatedSite(runner, sock, limit=config.max_connections, listener=listener,
                         per_peer=per_peer,
                         on_refused=telemetry.connection_refused if telemetry is not None else None)

    async def _start_tcp(self, runner: web.BaseRunner, listener: str, key: str,
                         address) -> tuple[str, int]:
        """Bind and serve a TCP listener; (host, port) bound. A bind error names the
        config key to change."""
        try:
            sock = tcp_socket(address.host, address.port)
        except OSError as e:
            raise OSError(e.errno, f"{key} {address}: {e.strerror}; set --{key.replace('_', '-')} "
                                   "HOST:PORT (port 0 picks a free port)") from None
        self.sites[listener] = self._site(runner, sock, listener)
        await self.sites[listener].start()
        return sock.getsockname()[:2]

    async def main_loop(self) -> None:
        """Serve until a stop signal: the background loops and the SIGHUP reloader run in
        one TaskGroup and are cancelled when `_stop` is set."""
        async with asyncio.TaskGroup() as tasks:
            loops = self.background.start(tasks) + [tasks.create_task(self._reloader())]
            await self._stop.wait()
            for t in loops:
                t.cancel()

    async def _reloader(self) -> None:
        while True:
            await self._hup.wait()
            self._hup.clear()
            await self.reload()

    async def reload(self) -> None:
        """SIGHUP: re-read the config; apply limits, log level, api_key and the cache budget
        live. The `reloaded` line names every key whose value changed (by name only: never
        a value, so the api_key stays out of the log): `applied`, and `needs_restart` for
        those of RESTART_KEYS (their running values stay; `reload_needs_restart` warns)."""
        self.state.notifier.reloading()
        try:
            new = self._reload()
        except (OSError, ValueError, RecursionError) as e:
            log.error("reload_failed", error=str(e), kept="previous configuration")
            self.state.notifier.ready()
            return
        # the values, not to_dict(): it shows every api_key as the same "<redacted>"
        changed = {k for k in KEYS if getattr(new, k) != getattr(self.state.config, k)}
        fixed = changed & RESTART_KEYS
        if self.state.config.expert_cache_mode == "naive":   # the baseline stays the baseline
            fixed |= changed & {"pin_fraction", "prefetch"}
        if fixed:
            log.warning("reload_needs_restart", keys=sorted(fixed),
                        effect="their running values stay until a restart")
        new = replace(new, **{k: getattr(self.state.config, k) for k in fixed})
        loaded = self.state.loaded
        try:
            if loaded is not None:
                # the memory planner may have started it with fewer sequences than configured:
                # they stay until the key itself changes
                sequences = loaded.engine.max_concurrent_sequences
                loaded.engine.set_limits(new.max_concurrent_sequences
                                         if "max_concurrent_sequences" in changed else sequences,
                                         new.max_queue)
                loaded.engine.prefill_step_ratio = new.prefill_step_ratio
                if "prefix_cache_persist_bytes" in changed and loaded.prefix_store is not None:
                    # the next save (idle, flush, shutdown) writes within the new budget;
                    # 0 stops saving and leaves the last file, which a start at 0 does not read
                    loaded.prefix_store.budget_bytes = new.prefix_cache_persist_bytes
                    loaded.prefix_saved_version, loaded.prefix_save_failed = -1, False
                if "prefix_cache_bytes" in changed:
                    await asyncio.wrap_future(loaded.engine.call(
                        lambda: loaded.engine.prefix_cache.resize(new.prefix_cache_bytes)))
                    if self.state.memory_watcher is not None:
                        self.state.memory_watcher.set_prefix_maximum(new.prefix_cache_bytes)
                if loaded.templates is not None:
                    loaded.templates.set_limits(new.chat_template_max_chars,
                                                new.chat_template_timeout_s)
                if loaded.grammars is not None:
                    loaded.grammars.set_limits(new.grammar_compile_timeout_s,
                                               new.grammar_compile_memory_bytes)
                if ("expert_cache_bytes" in changed or "pin_fraction" in changed
                        or "prefetch" in changed) and loaded.session is not None:
                    if "expert_cache_bytes" in changed and new.expert_cache_bytes is not None:
                        new = self._clamp_expert_cache(new, loaded)
                    if self.state.memory_watcher is not None and new.expert_cache_bytes is not None:
                        self.state.memory_watcher.set_maximum(new.expert_cache_bytes, new.pin_fraction)
                    tuner = loaded.tuner
                    if "prefetch" in changed and tuner is not None:   # the operator decides now
                        await asyncio.wrap_future(loaded.engine.call(
                            lambda: tuner.stop("prefetch set by reload", keep={PREFETCH_WIDTH})))
                    await asyncio.wrap_future(loaded.engine.call(lambda: loaded.session.rebuild(
                        new.expert_cache_bytes, new.pin_fraction,
                        new.prefetch if "prefetch" in changed else None)))
            set_level(new.log_level)
        except (OSError, ValueError) as e:
            if loaded is not None:   # the new limits went in before the cache refused: undo
                old = self.state.config
                loaded.engine.set_limits(sequences, old.max_queue)
            log.error("reload_failed", error=str(e), kept="previous configuration")
            self.state.notifier.ready()
            return
        self.state.config = new
        log.info("reloaded", changed=sorted(changed), applied=sorted(changed - fixed),
                 needs_restart=sorted(fixed))
        self.state.notifier.ready()

    def _clamp_expert_cache(self, new: ServeConfig, loaded) -> ServeConfig:
        """`new` with its expert_cache_bytes cut to what memory holds now
        (loading.reload_expert_cache_bytes: never below the cache it has), logged when
        cut. Call after the prefix cache took its new capacity."""
        session = loaded.session
        granted = reload_expert_cache_bytes(new.expert_cache_bytes, session.options.cache_bytes,
                                            promised_bytes(loaded), session.provider.slot_bytes)
        if granted == new.expert_cache_bytes:
            return new
        log.warning("expert_cache_bytes_clamped", key="expert_cache_bytes",
                    asked_bytes=new.expert_cache_bytes, granted_bytes=granted,
                    reason="the memory available now holds no more")
        return replace(new, expert_cache_bytes=granted)

    async def shutdown(self) -> None:
        self.state.notifier.stopping()
        self.state.phase = "draining"
        loaded = self.state.loaded
        if loaded is not None:
            if loaded.grammars is not None:   # a compile is never waited for: killed now
                loaded.grammars.close()
            engine = loaded.engine
            engine.stop_accepting()
            stats = engine.stats()
            log.info("draining", running=stats.running, waiting=stats.waiting,
                     grace_s=self.state.config.shutdown_grace_s)
            finished = await asyncio.to_thread(engine.wait_idle, self.state.config.shutdown_grace_s)
            if not finished:
                log.warning("shutdown_grace_expired", grace_s=self.state.config.shutdown_grace_s)
                engine.cancel_all()
                await asyncio.to_thread(engine.wait_idle, None)
            await self.state.flush_state()
            engine.stop()
        for runner in reversed(self._runners):
            await runner.cleanup()
        if loaded is not None:
            loaded.close()
        self.listener.close()
        log.info("stopped", exit_code=self.exit_code)



def _plain_format(model_dir) -> tuple[str, ...]:
    """The format label of the checkpoint's unquantised weights from config.json's
    `torch_dtype` (or `dtype`): ("bf16",), ("f16",), ("f32",), or () when it says
    nothing readable. For the numerics label before the load (fast-bf16 changes bf16)."""
    try:
        raw = read_json(Path(model_dir, "config.json"))
    except (OSError, ValueError):                # ValueError: MetadataFileError, bad JSON
        return ()
    dtype = (raw.get("torch_dtype") or raw.get("dtype")) if isinstance(raw, dict) else None
    label = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(dtype) if isinstance(dtype, str) else None
    return (label,) if label else ()


def serve(config: ServeConfig, *, reload, environ: Mapping[str, str], version: str) -> int:
    """Run the daemon until a signal stops it; the exit code (0 after a clean drain).

    reload: () -> ServeConfig, re-reading file and environment (SIGHUP).
    Binding happens first: "another moed serves PATH" and a non-socket path exit 1
    before any model is read.
    """
    fit_open_files(2 + (config.tcp_address is not None), config.max_connections)
    fds = listen_fds(environ)
    try:
        if fds:
            listener = AdoptedListener(adopt_fd(fds[0]))
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
        quantization = quantization_label(model_config.quantization)
        moe_layers = [l for l, is_moe in enumerate(model_config.moe_layers) if is_moe]
        formats = tuple(model_config.quantization.formats if model_config.quantization else ())
        formats += _plain_format(config.require_model())
    except ValueError:
        model_type, quantization, moe_layers = "unknown", "unknown", []   # the load reports the real error
        formats = ()
    daemon: Daemon | None = None
    # The mode the model will run (Model.numerics_in_force once loaded): config.numerics
    # resolved against the quantised formats config.json declares.
    numerics = resolve_numerics(config.numerics, formats)
    telemetry = DaemonMetrics(version=version, model_type=model_type, moe_layers=moe_layers,
                              quantization=quantization, numerics=numerics,
                              read_seconds_buckets=READ_SECONDS_BUCKETS,
                              source=lambda: daemon.state.last_snapshot if daemon is not None else None)
    notifier = Notifier(environ)
    daemon = Daemon(config, load=lambda c: load_for_serving(c, environ, telemetry), reload=reload,
                    listener=listener, notifier=notifier, telemetry=telemetry)
    try:
        return asyncio.run(daemon.run())
    finally:
        listener.close()
        notifier.close()
