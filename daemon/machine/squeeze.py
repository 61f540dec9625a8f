"""The expert cache under memory pressure: shrink when the machine needs memory back,
grow back slowly when it returns (DESIGN.md "Memory planner"; scheduler.planner's
`CacheSqueeze` decides, this module reads and applies).

Every `MEMORY_POLL_S` seconds `MemoryWatcher.check` takes one reading — available memory
(the tightest of MemAvailable and the cgroup headroom, `scheduler.planner.available_bytes`)
and PSI memory pressure — and when the budget changes, rebuilds the streaming provider on
the engine thread between two steps. The dynamic tier gives way first: the pinned slot
count is kept while the budget above the minimum holds it. The old slot arena is unmapped,
so its pages go back to the kernel at once (RSS falls). Output never changes: this is
placement.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from daemon.machine.memory import read_mem_total, read_memory, read_memory_pressure
from scheduler.planner import CacheSqueeze, SqueezePolicy, available_bytes, default_squeeze_policy
from telemetry.logs import get_logger

log = get_logger("squeeze")

MEMORY_POLL_S = 5.0


@dataclass(frozen=True)
class MemoryFeed:
    """One reading: available bytes (None: unknown) and PSI some avg10 (None: no PSI)."""

    available_bytes: int | None
    pressure_avg10: float | None


def system_feed(cap_bytes: int | None = None) -> MemoryFeed:
    """The real reading of this machine and this process's cgroups."""
    reading = read_memory()
    return MemoryFeed(available_bytes(reading.mem_available_bytes, reading.cgroup_limits, cap_bytes),
                      read_memory_pressure())


class MemoryWatcher:
    """Reads memory and resizes the expert cache of `session` (an ExpertSession).

    run_on_engine: runs a callable on the engine thread and returns its result (blocking).
    maximum_bytes: the configured budget, which the cache never exceeds.
    feed: one reading per call (default: `system_feed`); tests pass a simulated one.
    policy: thresholds (default: `default_squeeze_policy` of the configured budget and
    MemTotal, or mem_total_bytes when given).
    """

    def __init__(self, session, maximum_bytes: int, minimum_bytes: int,
                 run_on_engine: Callable[[Callable[[], object]], object],
                 feed: Callable[[], MemoryFeed] = system_feed, mem_total_bytes: int | None = None,
                 policy: SqueezePolicy | None = None):
        self.session = session
        self.run_on_engine = run_on_engine
        self.feed = feed
        slot = session.provider.slot_bytes
        total = mem_total_bytes or read_mem_total() or 4 * maximum_bytes
        self.squeeze = CacheSqueeze(policy or default_squeeze_policy(maximum_bytes, total),
                                    minimum_bytes=minimum_bytes, maximum_bytes=maximum_bytes,
                                    slot_bytes=slot)
        self.pin_fraction = session.options.pin_fraction   # the configured share
        self.shrinks = self.grows = 0

    def set_maximum(self, maximum_bytes: int, pin_fraction: float) -> None:
        """A new configured budget and pin share (SIGHUP)."""
        self.squeeze.maximum = max(maximum_bytes, self.squeeze.minimum)
        self.pin_fraction = pin_fraction

    @property
    def current_bytes(self) -> int:
        return self.session.options.cache_bytes

    def check(self) -> int | None:
        """Take one reading; resize when needed. The new budget, or None (no change)."""
        reading = self.feed()
        current = self.current_bytes
        target = self.squeeze.target(current, reading.available_bytes, reading.pressure_avg10)
        if target == current:
            return None
        provider = self.session.provider
        pinned = provider.cache.pinned_slots
        spare = target // provider.slot_bytes - self.squeeze.minimum // provider.slot_bytes
        if target < current:     # the dynamic tier gives way first, the pins last
            new_pinned = min(pinned, spare)
            self.shrinks += 1
        else:                    # pins grow back towards the configured share
            new_pinned = min(spare, max(pinned, int(spare * self.pin_fraction)))
            self.grows += 1
        # StreamingOptions.pin_fraction is a share of the spare slots, floored
        fraction = 0.0 if spare <= 0 else min(1.0, (new_pinned + 0.5) / spare)
        self.run_on_engine(lambda: self.session.rebuild(cache_bytes=target, pin_fraction=fraction))
        (log.warning if target < current else log.info)(
            "expert_cache_shrunk" if target < current else "expert_cache_grown",
            from_bytes=current, to_bytes=target, available_bytes=reading.available_bytes,
            pressure_avg10=reading.pressure_avg10,
            pinned_slots=self.session.provider.cache.pinned_slots)
        return target
