"""The daemon's background tasks while it serves, each a loop in the main TaskGroup.

- `_watchdog`: WATCHDOG=1 pings to systemd;
- `_status`: the STATUS= line (tokens/s, hit rate);
- `_flusher`: learned usage into the state file every FLUSH_INTERVAL_S (and the prefix
  cache into its file, when it changed);
- `_prefix_saver`: the prefix cache into its file PREFIX_SAVE_IDLE_S after the last
  request ended, when it changed: an agent's turn survives a kill -9 that follows it;
- `_storage_probe`: one short `moed iobench` probe when idle after READY, if none is saved;
- `_memory_watch`: the expert cache shrinks and grows with the memory available;
- `_idle_tuning`: tuner = live+idle feeds the live tuner the built-in workload when idle.

Each reads the serving state of its `Daemon` and runs work on the engine thread
(`Engine.call`); a failure is a warning, never the end of the daemon.
"""
from __future__ import annotations

import asyncio
import json
import time

from daemon.machine.squeeze import MEMORY_POLL_S, MemoryWatcher
from daemon.service.serving import ServingState
from daemon.service.stats import status_line
from daemon.store.probe import (ProbeInterrupted, block_device, model_target, report_path,
                                run_iobench, save_report)
from daemon.store.streaming import minimum_cache_bytes
from telemetry.logs import get_logger

log = get_logger("server")

IDLE_TUNING_AFTER_S = 30.0      # tuner = live+idle: idle this long before the built-in workload
IDLE_POLL_S = 1.0
PROBE_SECONDS = 4.0             # the storage probe after READY (issue: at most 5 s)
PROBE_IDLE_S = 1.0              # ... once nothing has been served for this long
FLUSH_INTERVAL_S = 60.0         # learned usage written to the state file this often
STATUS_INTERVAL_S = 5.0         # systemd STATUS= line refresh
PREFIX_SAVE_IDLE_S = 2.0        # the prefix cache saved once nothing has run for this long


class BackgroundTasks:
    """The background loops of one daemon; `start(tasks)` creates them in a TaskGroup."""

    def __init__(self, state: ServingState):
        self.state = state

    def start(self, tasks: asyncio.TaskGroup) -> list[asyncio.Task]:
        """Create every loop in `tasks`; the tasks (the caller cancels them to stop)."""
        return [tasks.create_task(loop()) for loop in (
            self._watchdog, self._status, self._flusher, self._idle_tuning, self._memory_watch,
            self._storage_probe, self._prefix_saver)]

    async def _watchdog(self) -> None:
        """WATCHDOG=1 at the interval systemd asks for (none: nothing to do)."""
        interval = self.state.notifier.watchdog_interval_s()
        if interval is None:
            return
        while True:
            self.state.notifier.watchdog()
            await asyncio.sleep(interval)

    async def _status(self) -> None:
        """systemd's STATUS= line (tokens/s and hit rate), every STATUS_INTERVAL_S."""
        while True:
            loaded = self.state.loaded
            if loaded is not None and self.state.phase == "ready":
                snap = await asyncio.wrap_future(
                    loaded.engine.call(lambda: self.state.stats_snapshot(loaded)))
                self.state.notifier.status(status_line(snap))
            await asyncio.sleep(STATUS_INTERVAL_S)

    async def _flusher(self) -> None:
        """The learned usage into the state file every FLUSH_INTERVAL_S."""
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            await self.state.flush_state()

    async def _prefix_saver(self) -> None:
        """Save the prefix cache when it changed and the engine has been idle for
        PREFIX_SAVE_IDLE_S (its disk writes never compete with a request's expert reads)."""
        idle_since = None
        while True:
            await asyncio.sleep(IDLE_POLL_S / 2)
            loaded = self.state.loaded
            if (loaded is None or loaded.prefix_store is None or not loaded.prefix_store.budget_bytes
                    or loaded.prefix_save_failed or self.state.phase != "ready"):
                continue                         # (after a failed save, the flusher retries)
            stats = loaded.engine.stats()
            if stats.running or stats.waiting:
                idle_since = None
                continue
            now = time.monotonic()
            idle_since = idle_since or now
            if now - idle_since >= PREFIX_SAVE_IDLE_S and loaded.prefix_saved_version != \
                    loaded.engine.prefix_cache.version:
                await self.state.save_prefix_cache()

    async def _storage_probe(self) -> None:
        """Streamed experts and no saved `moed iobench` result for the model's disk: once
        the daemon has been idle for a moment after READY, run a short probe (at most
        PROBE_SECONDS, on the engine thread so no read of a request competes with it) and
        save it in the state directory, as `moed iobench` does. A request that arrives
        meanwhile stops the probe between two of its passes (a fraction of a second) and
        goes first; the probe starts again at the next idle moment. A failure is a warning."""
        loaded = self.state.loaded
        if (loaded is None or loaded.session is None or loaded.session.store is None
                or not loaded.session.store.writable):
            return
        state_dir = loaded.session.store.state_dir
        try:
            target = await asyncio.to_thread(model_target, self.state.config.model)
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
        grow the expert cache (daemon/machine/squeeze.py) up to the budget it started with (configured,
        or planned), the prefix cache giving way first; a failed reading or resize is a warning."""
        loaded = self.state.loaded
        if loaded is None or loaded.session is None:
            return
        model = loaded.engine.model
        self.state.memory_watcher = MemoryWatcher(
            loaded.session, loaded.session.options.cache_bytes,     # configured or planned
            minimum_cache_bytes(model.layout, model.config),
            run_on_engine=lambda fn: loaded.engine.call(fn).result(),
            prefix_cache=loaded.engine.prefix_cache)
        while True:
            await asyncio.sleep(MEMORY_POLL_S)
            try:
                await asyncio.to_thread(self.state.memory_watcher.check)
            except (OSError, ValueError) as e:
                log.warning("memory_watch_failed", error=str(e))

    async def _idle_tuning(self) -> None:
        """tuner = live+idle: while nothing is served for IDLE_TUNING_AFTER_S, feed the live
        tuner one window of the built-in workload at a time (requests wait at most one
        window). Its routing does not count as usage: pins follow real traffic only."""
        loaded = self.state.loaded
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
