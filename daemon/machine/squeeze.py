"""The expert cache under memory pressure: shrink when the room moed runs in needs memory
back, grow back slowly when it returns (docs/design.md "Memory planner"; scheduler.planner's
`CacheSqueeze` decides, this module reads and applies).

The room is the memory moed may use: the tightest cgroup limit over its process (v1 or
v2, its own group and every ancestor), else the host's MemTotal; the water marks are
relative to it (`scheduler.planner.default_squeeze_policy`). Every `MEMORY_POLL_S` seconds
`MemoryWatcher.check` takes one reading (`system_feed`):

  available   what can still be had without taking page cache from anyone: the tightest
              of MemAvailable and, for each cgroup with a limit, limit - (usage - its page
              cache, active and inactive). A cgroup full of page cache (moed's own shard
              reads, a backup) is not short of memory: the kernel reclaims it first.
  pressure    PSI "some avg10" — the binding cgroup's own memory.pressure on v2, else the
              host's /proc/pressure/memory.

and when the budget changes, rebuilds the streaming provider on the engine thread between
two steps. The prefix cache (daemon/engine/prefix_cache.py) gives way before the expert
cache: what a shrink asks for comes first off its capacity (its least recently used blocks
are evicted), and only what that does not free comes off the expert cache; it grows back
last, once the expert cache is at its budget, by the same steps after the same calm
readings. In the expert cache the dynamic tier gives way first: the pinned slot count is
kept while the budget above the minimum holds it. The old slot arena is unmapped, so its pages go back
to the kernel at once (RSS falls). Output never changes: this is placement.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from daemon.machine.memory import (read_mem_total, read_memory, read_memory_pressure,
                                   read_pressure_file)
from scheduler.planner import (CacheSqueeze, CgroupLimit, SqueezePolicy, available_bytes,
                               default_squeeze_policy)
from telemetry.logs import get_logger

log = get_logger("squeeze")

MEMORY_POLL_S = 5.0
# memory.stat keys of the page cache a cgroup holds, per hierarchy version
_FILE_KEYS = {1: ("total_active_file", "total_inactive_file"), 2: ("active_file", "inactive_file")}


@dataclass(frozen=True)
class MemoryFeed:
    """One reading, in bytes (None: unknown).

    available_bytes: what can be had without taking page cache back (see the module
    doc); pressure_avg10: PSI some avg10 in percent (None: no PSI). reclaimable_available_bytes:
    the planner's figure (page cache counted as free only when inactive). room_bytes: the
    tightest cgroup limit, else MemTotal. cgroup: the binding cgroup's path, version,
    limit, usage and page cache, or None without a limit.
    """

    available_bytes: int | None
    pressure_avg10: float | None
    reclaimable_available_bytes: int | None = None
    room_bytes: int | None = None
    cgroup: dict | None = None

    def to_dict(self) -> dict:
        return {"available_bytes": self.available_bytes, "pressure_avg10": self.pressure_avg10,
                "reclaimable_available_bytes": self.reclaimable_available_bytes,
                "room_bytes": self.room_bytes, "cgroup": self.cgroup}


def _stat(directory: Path) -> dict[str, int]:
    try:
        text = (directory / "memory.stat").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) == 2 and words[1].isdigit():
            out[words[0]] = int(words[1])
    return out


def cgroup_file_bytes(limit: CgroupLimit) -> int:
    """The page cache (active and inactive file pages) of the cgroup at `limit.path`."""
    stat = _stat(Path(limit.path))
    return sum(stat.get(key, 0) for key in _FILE_KEYS.get(limit.version, ()))


def system_feed(cap_bytes: int | None = None, root: str = "/") -> MemoryFeed:
    """The real reading of this machine and this process's cgroups (see the module doc)."""
    reading = read_memory(root)
    bounds = [b for b in (reading.mem_available_bytes, cap_bytes) if b is not None]
    binding: tuple[int, CgroupLimit, int] | None = None
    for limit in reading.cgroup_limits:
        if limit.limit_bytes is None:
            continue
        usage = limit.usage_bytes or 0
        file_bytes = min(cgroup_file_bytes(limit), usage)
        headroom = max(0, limit.limit_bytes - (usage - file_bytes))
        bounds.append(headroom)
        if binding is None or limit.limit_bytes < binding[1].limit_bytes:
            binding = (headroom, limit, file_bytes)
    pressure = None
    cgroup = None
    if binding is not None:
        headroom, limit, file_bytes = binding
        cgroup = {"path": limit.path, "version": limit.version, "limit_bytes": limit.limit_bytes,
                  "usage_bytes": limit.usage_bytes, "page_cache_bytes": file_bytes,
                  "available_bytes": headroom}
        if limit.version == 2:
            pressure = read_pressure_file(Path(limit.path) / "memory.pressure")
    if pressure is None:
        pressure = read_memory_pressure(root)
    try:
        reclaimable = available_bytes(reading.mem_available_bytes, reading.cgroup_limits, cap_bytes)
    except ValueError:
        reclaimable = None
    room = binding[1].limit_bytes if binding is not None else read_mem_total(root)
    return MemoryFeed(min(bounds) if bounds else None, pressure, reclaimable, room, cgroup)


class MemoryWatcher:
    """Reads memory and resizes the expert cache of `session` (an ExpertSession).

    run_on_engine: runs a callable on the engine thread and returns its result (blocking).
    maximum_bytes: the configured budget, which the cache never exceeds.
    feed: one reading per call (default: `system_feed`); tests pass a simulated one.
    prefix_cache: the engine's PrefixCache (capacity_bytes, resize, stats) that shrinks
    first, or None; its capacity at start is its maximum (`set_prefix_maximum`).
    policy: thresholds (default: `default_squeeze_policy` of the configured budget and the
    room of each reading — the cgroup's limit, else MemTotal, or mem_total_bytes when
    given and the reading has none; recomputed when the room changes).
    """

    def __init__(self, session, maximum_bytes: int, minimum_bytes: int,
                 run_on_engine: Callable[[Callable[[], object]], object],
                 feed: Callable[[], MemoryFeed] = system_feed, mem_total_bytes: int | None = None,
                 policy: SqueezePolicy | None = None, prefix_cache=None):
        self.session = session
        self.prefix_cache = prefix_cache
        self.prefix_maximum = prefix_cache.capacity_bytes if prefix_cache is not None else 0
        self.prefix_shrinks = self.prefix_grows = 0
        self._prefix_calm = 0
        self.run_on_engine = run_on_engine
        self.feed = feed
        self._fixed_policy = policy is not None
        self._fallback_room = mem_total_bytes or read_mem_total() or 4 * maximum_bytes
        self.room = self._fallback_room
        if policy is None:                     # the room of the first reading sets the marks
            first = feed()
            self.room = first.room_bytes or self._fallback_room
        slot = session.provider.slot_bytes
        self.squeeze = CacheSqueeze(policy or default_squeeze_policy(maximum_bytes, self.room),
                                    minimum_bytes=minimum_bytes, maximum_bytes=maximum_bytes,
                                    slot_bytes=slot)
        self.pin_fraction = session.options.pin_fraction   # the configured share
        self.shrinks = self.grows = 0
        self.last: MemoryFeed | None = None
        self._pinned_unsqueezed = session.provider.cache.pinned_slots

    def set_maximum(self, maximum_bytes: int, pin_fraction: float) -> None:
        """A new configured budget and pin share (SIGHUP)."""
        self.squeeze.maximum = max(maximum_bytes, self.squeeze.minimum)
        self.pin_fraction = pin_fraction
        if not self._fixed_policy:
            self.squeeze.policy = default_squeeze_policy(self.squeeze.maximum, self.room)

    def set_prefix_maximum(self, maximum_bytes: int) -> None:
        """A new configured prefix cache capacity (SIGHUP; the caller resizes the cache)."""
        self.prefix_maximum = maximum_bytes

    @property
    def current_bytes(self) -> int:
        return self.session.options.cache_bytes

    def report(self) -> dict:
        """JSON-ready: the latest reading, the water marks, what the squeeze did."""
        p = self.squeeze.policy
        return {"reading": None if self.last is None else self.last.to_dict(),
                "low_water_bytes": p.low_water_bytes, "high_water_bytes": p.high_water_bytes,
                "pressure_avg10_threshold": p.pressure_avg10, "cache_bytes": self.current_bytes,
                "maximum_bytes": self.squeeze.maximum, "minimum_bytes": self.squeeze.minimum,
                "shrinks": self.shrinks, "grows": self.grows,
                "prefix_cache": None if self.prefix_cache is None else {
                    "capacity_bytes": self.prefix_cache.capacity_bytes,
                    "maximum_bytes": self.prefix_maximum, "shrinks": self.prefix_shrinks,
                    "grows": self.prefix_grows}}

    def check(self) -> int | None:
        """Take one reading; resize when needed. The new budget, or None (no change)."""
        reading = self.feed()
        self.last = reading
        room = reading.room_bytes or self._fallback_room
        if room != self.room and not self._fixed_policy:
            self.room = room
            self.squeeze.policy = default_squeeze_policy(self.squeeze.maximum, room)
        current = self.current_bytes
        provider = self.session.provider
        pinned = provider.cache.pinned_slots
        if current >= self.squeeze.maximum:
            self._pinned_unsqueezed = pinned       # what the pins hold when nothing squeezes
        target = self.squeeze.target(current, reading.available_bytes, reading.pressure_avg10)
        if self.prefix_cache is not None:
            target = self._prefix_first(current, target, reading, room)
        if target == current:
            return None
        spare = target // provider.slot_bytes - self.squeeze.minimum // provider.slot_bytes
        if target < current:     # the dynamic tier gives way first, the pins last
            new_pinned = min(pinned, spare)
            self.shrinks += 1
        else:                    # the pins come back towards what they held before
            new_pinned = min(spare, max(pinned, self._pinned_unsqueezed))
            self.grows += 1
        self.run_on_engine(lambda: self.session.rebuild(cache_bytes=target, pinned_slots=new_pinned))
        (log.warning if target < current else log.info)(
            "expert_cache_shrunk" if target < current else "expert_cache_grown",
            from_bytes=current, to_bytes=target, available_bytes=reading.available_bytes,
            pressure_avg10=reading.pressure_avg10,
            pinned_slots=self.session.provider.cache.pinned_slots, room_bytes=room)
        return target

    def _prefix_first(self, current: int, target: int, reading: MemoryFeed, room: int) -> int:
        """The prefix cache's turn: on a shrink it gives what it can first, and the expert
        cache's target becomes what is still needed; with the expert cache at its budget
        and calm readings above high water it grows back. Returns the expert cache's
        target."""
        prefix, squeeze = self.prefix_cache, self.squeeze
        cut = squeeze.last_cut
        if cut > 0:
            self._prefix_calm = 0
            capacity = prefix.capacity_bytes
            if capacity == 0:
                return target
            held = prefix.stats().bytes
            new_capacity = max(0, capacity - cut)
            self.run_on_engine(lambda: prefix.resize(new_capacity))
            self.prefix_shrinks += 1
            freed = held - min(held, new_capacity)
            log.warning("prefix_cache_shrunk", from_bytes=capacity, to_bytes=new_capacity,
                        freed_bytes=freed, available_bytes=reading.available_bytes,
                        pressure_avg10=reading.pressure_avg10, room_bytes=room)
            rest = cut - freed
            if rest <= 0:
                return current
            return squeeze._clamp(current - max(rest, squeeze.slot))
        p = squeeze.policy
        available = reading.available_bytes
        calm = (available is not None and available > p.high_water_bytes
                and (reading.pressure_avg10 is None or reading.pressure_avg10 < p.pressure_avg10))
        if target != current or current < squeeze.maximum or not calm \
                or prefix.capacity_bytes >= self.prefix_maximum:
            self._prefix_calm = 0
            return target
        self._prefix_calm += 1
        if self._prefix_calm < p.calm_readings:
            return target
        capacity = prefix.capacity_bytes
        grown = min(self.prefix_maximum, capacity + min(max(1, self.prefix_maximum // 16),
                                                        available - p.high_water_bytes))
        self.run_on_engine(lambda: prefix.resize(grown))
        self.prefix_grows += 1
        log.info("prefix_cache_grown", from_bytes=capacity, to_bytes=grown,
                 available_bytes=available, room_bytes=room)
        return target
