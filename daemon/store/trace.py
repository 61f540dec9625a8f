"""Recording the routing of real requests in the replay format (`moed replay-trace`).

`TraceWriter` appends one JSON line per decoded position, `{"tok": n, "layers": [[top_k
expert ids, ascending], ... one list per MoE layer]}` — the format of
../shared/traces/README.md and `scheduler.replay.load_trace`. `tok` counts the lines of
this file. A batched decode step writes one line per sequence, in row order; prompt
(prefill) positions are not written: the trace is what decoding asked of the cache.

It is fed by the expert provider (`observe_routing`, then `end_step` when the next step
begins). A write that fails (disk full, file removed) is logged once and recording stops;
serving goes on. `RecordingProvider` adds the same recording to a provider that keeps
every expert in memory (memory-mapped or resident), which routes but streams nothing.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ext.models.experts import ExpertProvider, ExpertWeights
from telemetry.logs import get_logger

log = get_logger("trace")


class TraceWriter:
    """Append decode routing to `path` (created, or appended to when it exists).

    n_layers: MoE layers per line. Raises OSError when the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike, n_layers: int):
        self.path = Path(path)
        self.n_layers = n_layers
        self._file = open(self.path, "a", encoding="utf-8")
        self._rows: list[np.ndarray | None] = [None] * n_layers
        self.lines = 0
        self.failed = False

    def routed(self, layer_index: int, ids: np.ndarray) -> None:
        """Layer `layer_index` routed this step's rows: ids [T, K] (copied)."""
        self._rows[layer_index] = np.sort(np.asarray(ids), axis=1)

    def end_step(self) -> None:
        """The step whose routing was given is over: write its rows (when every layer ran)."""
        rows, self._rows = self._rows, [None] * self.n_layers
        if self.failed or any(r is None for r in rows):
            return
        lines = []
        for t in range(rows[0].shape[0]):
            lines.append(json.dumps({"tok": self.lines, "layers": [r[t].tolist() for r in rows]},
                                    separators=(",", ":")))
            self.lines += 1
        try:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
        except OSError as e:
            self.failed = True
            log.warning("trace_recording_stopped", path=str(self.path), error=str(e), lines=self.lines)

    def close(self) -> None:
        self.end_step()
        try:
            self._file.close()
        except OSError as e:
            log.warning("trace_close_failed", path=str(self.path), error=str(e))


class RecordingProvider(ExpertProvider):
    """An in-memory expert provider (mmap or resident) whose decode routing a
    `TraceWriter` records; everything else is the wrapped provider's."""

    wants_routing = True

    def __init__(self, inner: ExpertProvider, writer: TraceWriter):
        self.inner = inner
        self.trace_writer = writer
        self.phase = "decode"

    def acquire(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        return self.inner.acquire(layer, experts)

    def release(self, layer: int, experts: Sequence[int]) -> None:
        self.inner.release(layer, experts)

    def begin_step(self, tokens: int) -> None:
        self.trace_writer.end_step()
        self.inner.begin_step(tokens)

    def end_step(self) -> None:
        self.inner.end_step()

    def observe_routing(self, layer: int, ids: np.ndarray) -> None:
        if self.phase == "decode":
            self.trace_writer.routed(self._index[layer], ids)

    def bind(self, moe_layers: Sequence[int]) -> RecordingProvider:
        self._index = {layer: i for i, layer in enumerate(moe_layers)}
        return self

    def failing(self) -> str | None:
        """The inner provider's `failing()` (memory-mapped experts have one), else None."""
        failing = getattr(self.inner, "failing", None)
        return failing() if failing is not None else None

    def close(self) -> None:
        self.trace_writer.close()
        self.inner.close()
