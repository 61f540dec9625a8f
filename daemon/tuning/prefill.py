"""The prefill chunk from measured throughput: what `moed tune` runs for `prefill_chunk`.

A forward step takes at most `prefill_chunk` prompt tokens. A larger step reads each
routed expert once for more tokens (from disk when the experts stream, from DRAM when
they are resident) and runs the GEMM kernels on more rows a weight load; it also needs
larger step buffers, and on a given CPU and model the gain flattens or turns
(attention over a longer chunk, caches). `moed serve`'s rule (`prefill_chunk = "auto"`,
daemon/service/loading.py) is a fixed guess; this measures it on the machine and model
at hand:

- candidates: PREFILL_CANDIDATES up to the model's `step_capacity` (the largest chunk
  the memory plan allows for the tune's cache budget);
- one prompt of `prompt_tokens` tokens (the built-in workload's prompts, repeated) is
  prefilled once per candidate per round, the candidates' order rotated round by round,
  from the same starting state (`before_run`: `moed tune` empties the expert cache and
  drops the page cache, so streamed experts are read as a fresh prompt reads them);
- the rule (`choose_prefill_chunk`): the incumbent (what the fixed rule takes) stays
  unless a candidate is faster in every round and by at least scheduler.tuner.MIN_GAIN
  in the median round (`scheduler.tuner.wins`, the live tuner's rule); among those, the
  fastest median.

Logits do not depend on the chunk (tests/ext/models/test_prefill_chunk.py), so nothing
here can change output.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from ext.models.model import Model
from scheduler.tuner import wins

PREFILL_CANDIDATES = (64, 128, 256, 512, 1024)


def prefill_candidates(capacity: int) -> list[int]:
    """PREFILL_CANDIDATES up to `capacity` (the step buffers' rows), and `capacity`
    itself when it lies between them. Raises ValueError when capacity < 1."""
    if capacity < 1:
        raise ValueError(f"step capacity must be >= 1, got {capacity}")
    out = [c for c in PREFILL_CANDIDATES if c <= capacity]
    if not out or (capacity not in out and capacity < PREFILL_CANDIDATES[-1]):
        out.append(capacity)
    return sorted(set(out))


def prefill_prompt(prompts: Sequence[Sequence[int]], tokens: int) -> np.ndarray:
    """`tokens` ids ([tokens] int64): the prompts one after another, repeated. Raises
    ValueError when there are no ids to repeat or tokens < 1."""
    ids = [int(t) for p in prompts for t in p]
    if not ids or tokens < 1:
        raise ValueError(f"need prompt ids and tokens >= 1, got {len(ids)} ids and tokens={tokens}")
    reps = -(-tokens // len(ids))
    return np.asarray((ids * reps)[:tokens], dtype=np.int64)


def measure_prefill_chunks(model: Model, ids: np.ndarray, candidates: Sequence[int], rounds: int,
                           before_run: Callable[[], None] | None = None,
                           progress: Callable[[str], None] | None = None) -> dict[int, list[float]]:
    """Prompt tokens per second of prefilling `ids` with each chunk of `candidates`, one
    figure per round ({chunk: [tokens/s per round]}), interleaved with the order rotated.
    `before_run` is called before every timed prefill. The model's chunk is restored
    afterwards. Raises ValueError for a candidate above the model's step capacity or
    rounds < 1."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    bad = [c for c in candidates if not 1 <= c <= model.step_capacity]
    if bad:
        raise ValueError(f"chunks {bad} exceed the step buffers ({model.step_capacity} rows)")
    start = model.prefill_chunk
    runs: dict[int, list[float]] = {c: [] for c in candidates}
    order = list(candidates)
    try:
        for r in range(rounds):
            for c in order[r % len(order):] + order[:r % len(order)]:
                model.set_prefill_chunk(c)
                seq = model.new_sequence(ids.size + 1)
                if before_run is not None:
                    before_run()
                t0 = time.perf_counter()
                model.forward(seq, ids)
                runs[c].append(ids.size / (time.perf_counter() - t0))
                if progress:
                    progress(f"prefill round {r + 1}/{rounds}, chunk {c}: {runs[c][-1]:.1f} tokens/s")
    finally:
        model.set_prefill_chunk(start)
    return runs


def choose_prefill_chunk(runs: dict[int, list[float]], incumbent: int) -> int:
    """The chunk to keep: `incumbent`, unless other chunks beat it in every round with a
    median gain of at least MIN_GAIN (scheduler.tuner.wins over the per-round gains
    tokens/s / incumbent's - 1); then the one of those with the highest median.
    Raises ValueError when the incumbent was not measured."""
    if incumbent not in runs:
        raise ValueError(f"the incumbent chunk {incumbent} was not measured")
    base = runs[incumbent]
    better = [c for c, v in runs.items()
              if c != incumbent and wins([x / y - 1.0 for x, y in zip(v, base)])]
    if not better:
        return incumbent
    return max(better, key=lambda c: statistics.median(runs[c]))
