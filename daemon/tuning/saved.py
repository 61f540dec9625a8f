"""The tuner's winners, kept per (model, hardware) fingerprint in the state directory.

``TunedStore`` writes ``tuned-<model fingerprint[:16]>.json`` like the usage file (atomic,
locked; daemon/store/state.py). A file written on other hardware (`hardware_facts`
differ) is ignored with a warning; another model has another file. Settings read back
are checked one by one (`valid_settings`): a value out of range is dropped, never used.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from daemon.machine.system import cpu_model, mem_total_bytes, usable_cpus
from daemon.store.probe import block_device
from daemon.store.state import StateStore
from daemon.tuning.knobs import IO_WORKERS, PREFETCH_WIDTH, THREADS
from telemetry.logs import get_logger

log = get_logger("tuning")

TUNED_VERSION = 1


def hardware_facts(model_dir: str | os.PathLike) -> dict[str, Any]:
    """What tuned settings depend on: CPU model and usable CPUs, RAM, the model's disk."""
    return {"cpu": cpu_model(), "cpus": usable_cpus(), "mem_total_bytes": mem_total_bytes(),
            "machine": platform.machine(), "disk": block_device(model_dir)}

def hardware_fingerprint(facts: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


# The prefill chunk `moed tune` measured (daemon/tuning/prefill.py); `moed serve` takes it
# under prefill_chunk = auto, within what its memory plan allows (daemon/service/loading.py).
PREFILL_CHUNK_SETTING = "prefill_chunk"
PREFILL_CHUNK_MAX = 16384       # the serve key's own bound (daemon/service/config.py)

SETTING_RANGES = {THREADS: (1, 1024), IO_WORKERS: (1, 1024), PREFETCH_WIDTH: (0, 1 << 16),
                  "cache_bytes": (1, 1 << 62), PREFILL_CHUNK_SETTING: (1, PREFILL_CHUNK_MAX)}


def valid_settings(settings: Mapping[str, Any], path: Path | str) -> dict[str, Any]:
    """The saved settings that are usable: whole numbers (not booleans) in range for the
    known knobs, pin_fraction a number in [0, 1]. Each other one is dropped with a warning."""
    kept: dict[str, Any] = {}
    for name, value in settings.items():
        if name in SETTING_RANGES:
            lo, hi = SETTING_RANGES[name]
            ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
        elif name == "pin_fraction":
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and 0.0 <= value <= 1.0)
        else:
            ok = False
        if ok:
            kept[name] = value
        else:
            log.warning("tuned_setting_ignored", path=str(path), setting=str(name)[:64],
                        value=value if len(repr(value)) < 80 else "<long>",
                        reason="not a usable value")
    return kept

class TunedStore:
    """The tuner's winners for one model on this hardware, in the state directory.

    Raises OSError when the state directory cannot be created (like StateStore).
    """

    def __init__(self, state_dir: Path, model_fingerprint: str, facts: Mapping[str, Any]):
        self.store = StateStore(Path(state_dir), model_fingerprint, kind="tuned")
        self.facts = dict(facts)
        self.hardware = hardware_fingerprint(facts)

    @property
    def path(self) -> Path:
        return self.store.path

    def load(self) -> dict[str, Any] | None:
        """The saved settings, or None: no file, a bad one (set aside), or one written on
        other hardware (ignored, with a warning naming what changed)."""
        payload = self.store.load()
        if payload is None:
            return None
        if payload.get("version") != TUNED_VERSION or not isinstance(payload.get("settings"), dict):
            log.warning("tuned_settings_ignored", path=str(self.path),
                        reason="unknown payload version or shape")
            return None
        if payload.get("hardware") != self.hardware:
            before = payload.get("hardware_facts")
            before = before if isinstance(before, dict) else {}
            changed = sorted(str(k) for k in set(before) | set(self.facts)
                             if before.get(k) != self.facts.get(k))
            log.warning("tuned_settings_invalidated", path=str(self.path), reason="hardware changed",
                        changed=changed or ["fingerprint"],
                        effect="the defaults apply until the tuner runs again")
            return None
        return valid_settings(payload["settings"], self.path)

    @property
    def writable(self) -> bool:
        return self.store.writable

    def save(self, settings: Mapping[str, Any], report: Mapping[str, Any] | None = None) -> None:
        """Write the winners (replacing any earlier ones). Raises OSError
        (StateReadOnlyError in a read-only state directory)."""
        payload = {"version": TUNED_VERSION, "hardware": self.hardware,
                   "hardware_facts": self.facts, "settings": dict(settings),
                   "report": dict(report or {})}
        self.store.save(lambda _current: payload)
