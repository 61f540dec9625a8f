"""Reading the memory moed may use: /proc/meminfo and this process's cgroup tree.

Conventions (the whole module):
  Every path is under `root` ("/" in production; a fake tree in a tmp dir in tests), and
  every number handed out is bytes. MemAvailable and MemTotal of the live system come
  from psutil (`psutil.virtual_memory()`, which also estimates MemAvailable on kernels
  older than 3.14 that lack the line); under a fake root they are read from its
  proc/meminfo, psutil being tied to the real /proc. The cgroup parsing psutil does not
  do is here. A file that is missing or unreadable makes its value
  unknown (None, or the cgroup is skipped) — reading never raises. The numbers go to the
  pure planner, scheduler/planner.py (docs/design.md "Memory planner").

Which hierarchy: the one that carries the memory controller. /proc/self/cgroup names this
process's cgroup per hierarchy ("0::/path" for v2, "N:memory:/path" or "N:cpu,memory:/path"
for v1); /proc/self/mountinfo says where each is mounted (fstype cgroup2; or fstype cgroup
with "memory" in the super options). A v2 mount is used only when its cgroup.controllers
lists "memory": a hybrid host has a "0::/" line and a cgroup2 mount without it, and keeps
memory on v1. The limits of the process's cgroup and of each ancestor up to the mount's
root are read, because a parent's limit binds its children too.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import psutil

from scheduler.planner import CgroupLimit, MemoryPlanError, available_bytes

NO_LIMIT_THRESHOLD = 2**62  # v1 writes "unlimited" as ~2**63 rounded to a page


@dataclass(frozen=True)
class MemoryReading:
    """One reading of the system, in bytes.

    mem_available_bytes: /proc/meminfo MemAvailable; None when absent.
    cgroup_limits: this process's cgroup first, then its ancestors up to the hierarchy's
      root, each whose limit file could be read (limit_bytes None = no limit).
    """

    mem_available_bytes: int | None
    cgroup_limits: tuple[CgroupLimit, ...]


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except (OSError, ValueError):
        return None


def _parse_limit(text: str | None) -> tuple[bool, int | None]:
    """(known, bytes) of a limit file: "max" or >= 2**62 is (True, None)."""
    if text is None:
        return False, None
    value = text.strip()
    if value == "max":
        return True, None
    try:
        number = int(value)
    except ValueError:
        return False, None
    return True, (None if number >= NO_LIMIT_THRESHOLD else number)


def _parse_int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def _stat_field(text: str | None, key: str) -> int | None:
    """A "key value" line of memory.stat."""
    for line in (text or "").splitlines():
        words = line.split()
        if len(words) == 2 and words[0] == key:
            return _parse_int(words[1])
    return None


def _live(root: str | os.PathLike) -> bool:
    return os.path.realpath(root) == "/"


def read_mem_available(root: str | os.PathLike = "/") -> int | None:
    """MemAvailable in bytes: psutil's on the live system, else <root>/proc/meminfo's (the
    file says kB); None when absent."""
    if _live(root):
        return psutil.virtual_memory().available
    match = re.search(r"^MemAvailable:\s+(\d+)\s*kB", _read_text(Path(root, "proc/meminfo")) or "",
                      re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class _Mount:
    root: str         # the cgroup path mounted there ("/" unless namespaced or bind-mounted)
    mountpoint: str
    fstype: str
    super_options: tuple[str, ...]


def _mounts(root: Path) -> list[_Mount]:
    mounts = []
    for line in (_read_text(root / "proc/self/mountinfo") or "").splitlines():
        head, sep, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(after) < 3:
            continue
        mounts.append(_Mount(_unescape(fields[3]), _unescape(fields[4]), after[0],
                             tuple(after[2].split(","))))
    return mounts


def _memory_hierarchy(root: Path) -> tuple[int, str, _Mount] | None:
    """(version, this process's cgroup path, its mount) on the memory hierarchy, or None."""
    v2_path, v1_path = None, None
    for line in (_read_text(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy_id, controllers, path = parts
        if hierarchy_id == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    mounts = _mounts(root)
    if v2_path is not None:
        for mount in mounts:
            controllers = _read_text(_host(root, mount.mountpoint) / "cgroup.controllers") or ""
            if mount.fstype == "cgroup2" and "memory" in controllers.split():
                return 2, v2_path, mount
    if v1_path is not None:
        for mount in mounts:
            if mount.fstype == "cgroup" and "memory" in mount.super_options:
                return 1, v1_path, mount
    return None


def _host(root: Path, absolute: str) -> Path:
    """An absolute path of the system under `root`."""
    return root / absolute.lstrip("/")


def _cgroup_dirs(root: Path, path: str, mount: _Mount) -> list[Path]:
    """This cgroup's directory, then each ancestor's, ending at the mount point."""
    top = _host(root, mount.mountpoint)
    mount_root = mount.root.rstrip("/")
    if path == mount_root or path.startswith(mount_root + "/"):
        relative = [p for p in path[len(mount_root):].split("/") if p]
    else:  # the cgroup is outside what is mounted: only the mount's own root is visible
        relative = []
    return [top.joinpath(*relative[:depth]) for depth in range(len(relative), -1, -1)]


def _read_v2(directory: Path) -> CgroupLimit | None:
    known_max, memory_max = _parse_limit(_read_text(directory / "memory.max"))
    known_high, memory_high = _parse_limit(_read_text(directory / "memory.high"))
    if not (known_max or known_high):
        return None
    limits = [b for b in (memory_max, memory_high) if b is not None]
    return CgroupLimit(str(directory), 2, min(limits) if limits else None,
                       _parse_int(_read_text(directory / "memory.current")),
                       _stat_field(_read_text(directory / "memory.stat"), "inactive_file"))


def _read_v1(directory: Path) -> CgroupLimit | None:
    stat = _read_text(directory / "memory.stat")
    known, limit = _parse_limit(_read_text(directory / "memory.limit_in_bytes"))
    hierarchical = _stat_field(stat, "hierarchical_memory_limit")
    if hierarchical is not None:
        known = True
        if hierarchical < NO_LIMIT_THRESHOLD:
            limit = hierarchical if limit is None else min(limit, hierarchical)
    if not known:
        return None
    return CgroupLimit(str(directory), 1, limit,
                       _parse_int(_read_text(directory / "memory.usage_in_bytes")),
                       _stat_field(stat, "total_inactive_file"))


def read_cgroup_limits(root: str | os.PathLike = "/") -> tuple[CgroupLimit, ...]:
    """The memory limits of this process's cgroup and its ancestors (see the module doc)."""
    base = Path(root)
    found = _memory_hierarchy(base)
    if found is None:
        return ()
    version, path, mount = found
    read = _read_v2 if version == 2 else _read_v1
    limits = (read(directory) for directory in _cgroup_dirs(base, path, mount))
    return tuple(limit for limit in limits if limit is not None)


def read_memory(root: str | os.PathLike = "/") -> MemoryReading:
    """Read MemAvailable and the cgroup limits under `root`; never raises for missing files."""
    return MemoryReading(read_mem_available(root), read_cgroup_limits(root))


def read_available_bytes(root: str | os.PathLike = "/") -> int | None:
    """The bytes this process may still add: MemAvailable, bounded by the headroom of its
    cgroup and of each ancestor with a limit (limit - (usage - inactive_file)) — the
    planner's own figure, scheduler.planner.available_bytes of `read_memory(root)` with no
    configured cap. None when neither MemAvailable nor a cgroup limit is known."""
    reading = read_memory(root)
    try:
        return available_bytes(reading.mem_available_bytes, reading.cgroup_limits)
    except MemoryPlanError:
        return None


def read_memory_pressure(root: str | os.PathLike = "/") -> float | None:
    """PSI ``some avg10`` of /proc/pressure/memory, in percent; None where PSI is absent
    (kernels without CONFIG_PSI, or psi=0) or the file is malformed."""
    return read_pressure_file(Path(root) / "proc" / "pressure" / "memory")


def read_pressure_file(path: str | os.PathLike) -> float | None:
    """PSI ``some avg10`` of a pressure file (/proc/pressure/memory, or a cgroup v2
    memory.pressure), in percent; None when it is absent or malformed."""
    text = _read_text(Path(path))
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            for field in line.split()[1:]:
                key, _, value = field.partition("=")
                if key == "avg10":
                    try:
                        return float(value)
                    except ValueError:
                        return None
    return None


def read_mem_total(root: str | os.PathLike = "/") -> int | None:
    """MemTotal in bytes: psutil's on the live system, else <root>/proc/meminfo's (the file
    says kB); None when absent."""
    if _live(root):
        return psutil.virtual_memory().total
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", _read_text(Path(root, "proc/meminfo")) or "",
                      re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None
