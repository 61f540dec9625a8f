"""The serving state of one daemon: what the HTTP routes and the background loops read,
and what the lifecycle (daemon/service/daemon.py) changes.

`phase` is "loading" until the model is loaded and the engine runs, "ready" while
serving, "draining" from SIGTERM on. `loaded` is None until the load finishes. `config`
is replaced as a whole by a successful SIGHUP reload. Only the event loop's thread
changes these; the engine thread runs `stats_snapshot` through `Engine.call`.
"""
from __future__ import annotations

import asyncio
import time

from daemon.machine.memory import read_available_bytes
from daemon.machine.system import rss_bytes
from daemon.service.config import ServeConfig
from daemon.service.loading import Loaded
from daemon.service.sdnotify import Notifier
from daemon.service.stats import collect
from telemetry.logs import get_logger

log = get_logger("server")


class ServingState:
    """config: the ServeConfig in force. notifier: sd_notify. telemetry: the daemon's
    telemetry.metrics.DaemonMetrics (its registry is rendered at /metrics; its collector
    reads `last_snapshot`), or None."""

    def __init__(self, config: ServeConfig, notifier: Notifier, telemetry=None):
        self.config = config
        self.notifier = notifier
        self.telemetry = telemetry
        self.registry = telemetry.registry if telemetry is not None else None
        self.phase = "loading"           # loading | ready | draining
        self.loaded: Loaded | None = None
        self._prefix_saving = asyncio.Lock()  # one save at a time (write_atomically's temp file)
        self.load_seconds = 0.0
        self.last_snapshot = None        # telemetry.metrics.Snapshot of the latest stats reading
        self.snapshot_at = float("-inf")  # time.monotonic() of that reading
        self.memory_watcher = None       # daemon.machine.squeeze.MemoryWatcher (streamed experts)
        self.started = time.monotonic()
        self.started_wall = time.time()

    def read_failure(self) -> str | None:
        """Why expert reads fail now, else None: the io pool of a streamed expert cache
        (the latest read to finish failed), or memory-mapped experts' own check (a shard
        truncated below an expert it holds, until it is whole again)."""
        if self.loaded is None:
            return None
        session = self.loaded.session
        if session is not None:
            return session.provider.io.failing()
        failing = getattr(self.loaded.engine.model.experts, "failing", None)
        return failing() if failing is not None else None

    def weights_failure(self) -> str | None:
        """Which routed experts' weights produce NaN or inf, so that the requests routed to
        them fail ("layer 1: experts 0, 3"), until they compute finite rows again; else
        None (ext/models/model.py, Model.broken_weights)."""
        if self.loaded is None:
            return None
        broken = getattr(self.loaded.engine.model, "broken_weights", None)
        return broken() if broken is not None else None

    def stats_snapshot(self, loaded: Loaded) -> dict:
        """moed's own statistics (runs on the engine thread); the same reading becomes
        `last_snapshot`, which /metrics exports (daemon/service/stats.py)."""
        snapshot, out = collect(loaded.engine, loaded.session,
                                memory_budget_bytes=(loaded.session.options.cache_bytes
                                                     if loaded.session is not None else 0),
                                memory_available_bytes=read_available_bytes(),
                                model_load_seconds=self.load_seconds, rss_bytes=rss_bytes())
        self.last_snapshot = snapshot
        self.snapshot_at = time.monotonic()
        out.update(model=loaded.model_names[0], uptime_seconds=time.monotonic() - self.started)
        out["tuner"] = {"mode": self.config.tuner if loaded.tuner is not None else "off"}
        if loaded.tuner is not None:
            t = loaded.tuner.tuner
            out["tuner"].update(finished=loaded.tuner.finished, settings=dict(t.settings()),
                                best=dict(t.incumbent), trials=len(t.trials),
                                kept=sum(1 for x in t.trials if x.outcome == "win"),
                                noise=t.noise, calibrating=t.calibrating,
                                window_steps=loaded.tuner.window_steps * t.window_multiplier)
        return out

    async def save_prefix_cache(self) -> None:
        """The prefix cache's blocks into its file (daemon/engine/prefix_store.py) if it
        changed since the last save: listed on the engine thread (references, no copy),
        written on a worker thread. A save asked while one runs (the idle saver, the
        flush, a reload's) waits for it, then saves if the cache changed since."""
        async with self._prefix_saving:
            await self._save_prefix_cache()

    async def _save_prefix_cache(self) -> None:
        loaded = self.loaded
        if loaded is None or loaded.prefix_store is None or not loaded.prefix_store.budget_bytes:
            return
        cache = loaded.engine.prefix_cache
        version, blocks = await asyncio.wrap_future(loaded.engine.call(lambda: (cache.version, cache.snapshot())))
        if version == loaded.prefix_saved_version:
            return
        started, budget = time.monotonic(), loaded.prefix_store.budget_bytes
        try:
            n = await asyncio.to_thread(loaded.prefix_store.save, blocks)
        except OSError as e:        # tried again once the cache changes, at the next flush
            loaded.prefix_saved_version = version
            loaded.prefix_save_failed = True
            log.warning("prefix_cache_save_failed", path=str(loaded.prefix_store.path), error=str(e))
            return
        loaded.prefix_save_failed = False
        # a reload that set another budget meanwhile asked for a save at it: still owed
        loaded.prefix_saved_version = version if loaded.prefix_store.budget_bytes == budget else -1
        log.info("prefix_cache_saved", path=str(loaded.prefix_store.path), blocks=n,
                 tokens=n * cache.block_tokens, seconds=round(time.monotonic() - started, 3))

    async def flush_state(self) -> None:
        """Merge the learned usage into the state file (on the engine thread), and save
        the prefix cache when it changed; a failed write is a warning and what was learned
        stays in memory for the next flush."""
        await self.save_prefix_cache()
        loaded = self.loaded
        if loaded is None or loaded.session is None:
            return
        try:
            saved = await asyncio.wrap_future(loaded.engine.call(loaded.session.flush))
        except OSError as e:
            log.warning("state_save_failed", path=str(loaded.session.store.path), error=str(e))
        else:
            if saved:
                log.info("state_saved", path=str(loaded.session.store.path))
