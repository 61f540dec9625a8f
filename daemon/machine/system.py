"""Readings of this process and the system, through psutil: the CPUs moed may use, its
resident memory, the machine's RAM, the CPU's model.

Every function reads the live system now and never raises for a reading the platform
does not offer (None instead, or a fallback that says so).
"""
from __future__ import annotations

import platform
from pathlib import Path

import psutil


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(psutil.Process().cpu_affinity()))
    except (AttributeError, psutil.Error, OSError):     # no affinity on this platform
        return max(1, psutil.cpu_count() or 1)


def mem_total_bytes() -> int:
    """The machine's RAM in bytes (MemTotal)."""
    return psutil.virtual_memory().total


def rss_bytes() -> int:
    """This process's resident set size in bytes."""
    return psutil.Process().memory_info().rss


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 7B13"): /proc/cpuinfo's "model name" (psutil has
    no such reading), else platform.processor() or the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
