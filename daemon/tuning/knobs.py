"""The tuner's knobs on a loaded model, applied live between decode steps.

`LiveKnobs` applies a settings dict without reloading anything: compute threads
(`Model.n_threads`), io workers (`IoPool.set_workers`) and prefetch width
(`StreamingExpertProvider.set_prefetch`, 0 = off). None of them changes output.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from daemon.store.probe import probe_io_workers
from ext.models.model import Model
from scheduler.tuner import Knob

THREADS, IO_WORKERS, PREFETCH_WIDTH = "threads", "io_workers", "prefetch_width"


class LiveKnobs:
    """Applies tuner settings to a model and its streaming provider, between steps."""

    def __init__(self, model: Model):
        self.model = model

    def current(self) -> dict[str, Any]:
        p = self.model.experts
        return {THREADS: self.model.n_threads, IO_WORKERS: p.io.n_workers,
                PREFETCH_WIDTH: p.prefetch_width}

    def apply(self, settings: Mapping[str, Any]) -> None:
        p = self.model.experts
        if THREADS in settings:
            self.model.n_threads = int(settings[THREADS])
        if IO_WORKERS in settings and settings[IO_WORKERS] != p.io.n_workers:
            p.io.set_workers(int(settings[IO_WORKERS]))
        if PREFETCH_WIDTH in settings and settings[PREFETCH_WIDTH] != self.current()[PREFETCH_WIDTH]:
            p.set_prefetch(int(settings[PREFETCH_WIDTH]))   # a change drops pending predictions

def default_knobs(top_k: int, cpus: int) -> list[Knob]:
    """Threads 1..cpus, io workers 1..16 (doubling), prefetch width 0 (off), top_k,
    top_k + top_k/2, 2 top_k."""
    widths = sorted({0, top_k, top_k + max(1, top_k // 2), 2 * top_k})
    return [Knob(THREADS, tuple(range(1, max(1, cpus) + 1))),
            Knob(IO_WORKERS, (1, 2, 4, 8, 16)),
            Knob(PREFETCH_WIDTH, tuple(widths))]

def snap_to(knob: Knob, value: Any) -> Any:
    """The candidate of `knob` closest to `value` (a start value off the grid)."""
    return min(knob.values, key=lambda v: (abs(v - value), v))

def probe_proposals(knobs: list[Knob], state_dir: Path | None,
                    model_dir: str | Path) -> list[tuple[str, Any]]:
    """[(IO_WORKERS, n)] when a saved storage probe suggests n io workers (snapped to the
    knob's values) and io workers are tuned; else []. The tuner tests it against the start."""
    io_knob = next((k for k in knobs if k.name == IO_WORKERS), None)
    probed = probe_io_workers(state_dir, model_dir)
    if io_knob is None or probed is None:
        return []
    return [(IO_WORKERS, snap_to(io_knob, probed))]
