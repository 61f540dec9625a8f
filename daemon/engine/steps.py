"""The step scheduler: what goes into each forward step of the engine (daemon/engine/engine.py).

A step holds a row for every sequence that decodes and, beside them, the next chunk of
each prompt still being prefilled, within a token budget; `StepScheduler.plan` makes
that list and `StepScheduler.observe` takes each step's measured time.

Chunked prefill. A prompt is prefilled a chunk per step beside the running decodes, as
vLLM's chunked prefill and llama.cpp's n_ubatch do. While nothing decodes a step takes
the model's prefill_chunk prompt tokens (`prefill_chunk`; under auto 512 or up to 1024,
or what `moed tune` measured fastest: daemon/service/loading.py); while sequences
decode, the chunk is sized from measured step times so that a step takes about
`prefill_step_ratio` times a decode step alone (the running streams keep their pace, the
prompt still gets most of the machine). The ratio r trades one for the other: the prompt
gets (r - 1) d of each step of r d, so its time to first token is at least r / (r - 1)
times its time alone, while the streams' tokens come r times slower during it. It is
more than that bound: the decode rows cost a step they share about what they cost alone
(on a model whose experts are cached the rows share nothing worth having), and a small
chunk costs more per token than a full one (each chunk reads the prompt's KV cache once
more); bench/step_costs.py measures both. Measured on a small checkpoint: about 2.2
times at the default 2.75 on one thread; on two threads about 2.9 (measured when the
kernels' threads were OpenMP's, waiting passively), since the small calls of a shared
step ran on one thread (below the kernels' parallel_threshold) while a full chunk alone
used both. Chunking never changes output: a position's logits depend only on the tokens
up to it.

A ratio of inf puts prompts first (llama.cpp's order): every step beside the decodes
takes the whole chunk, as with nothing decoding, so a prompt's time to first token is
its time alone and the streams wait a full chunk's step between tokens. The ratio is
the one knob from streams first (near 1) to prompt first (inf), as vLLM's
max_num_batched_tokens is there, but in time rather than tokens.
"""
from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np

from ext.models.model import PREFILL_CHUNK

PREFILL_STEP_RATIO = 2.75  # a step with prefill rows aims at this many decode steps' time
INITIAL_PREFILL_ROWS = 8   # the first chunk beside decodes, before any step was timed
STEP_WINDOW = 9            # recent steps whose times size the chunk
MIN_PREFILL_ROWS = 4       # prompt tokens a step takes beside decodes, at least


class StepRow(Protocol):
    """What the scheduler reads of a running sequence (the engine's choice)."""

    prompt: np.ndarray      # [P] int64
    prefilled: int          # prompt positions in its KV cache
    last_token: int         # the token a decode row continues with

    @property
    def prefilling(self) -> bool: ...


R = TypeVar("R", bound=StepRow)


class StepTimes:
    """Recent step times that size the prefill chunk beside decodes.

    decode_s: the median of the last STEP_WINDOW steps of decode rows only. A step with
    prefill rows tells what its prefill rows cost: its whole time alone, or its time
    less decode_s beside decodes; prefill_row_s is the sum of those costs over the sum of
    the rows of the last STEP_WINDOW such steps — a ratio of sums, so a large chunk
    weighs as much as its rows and a small one's noise (a step slowed by something else
    on the machine) cannot drive the chunk down to nothing. The chunk at most doubles or
    halves from one step to the next and never drops below MIN_PREFILL_ROWS.
    """

    def __init__(self, chunk: int = PREFILL_CHUNK) -> None:
        self.chunk = chunk                      # rows of a step at most (the model's prefill_chunk)
        self._decode = collections.deque(maxlen=STEP_WINDOW)
        self._prefill = collections.deque(maxlen=STEP_WINDOW)    # (seconds, rows)
        self._last = INITIAL_PREFILL_ROWS

    @property
    def decode_s(self) -> float | None:
        return statistics.median(self._decode) if self._decode else None

    @property
    def prefill_row_s(self) -> float | None:
        rows = sum(n for _, n in self._prefill)
        return sum(t for t, _ in self._prefill) / rows if rows else None

    def observe(self, seconds: float, prefill_rows: int, decode_rows: int) -> None:
        if prefill_rows == 0:
            self._decode.append(seconds)
        elif decode_rows == 0:
            self._prefill.append((seconds, prefill_rows))
        elif self._decode:
            self._prefill.append((max(seconds - self.decode_s, 0.05 * seconds), prefill_rows))

    def prefill_rows(self, decode_rows: int, ratio: float) -> int:
        """Prompt tokens for the next step beside `decode_rows` decode rows (ratio inf:
        the whole chunk less the decode rows, as with none)."""
        room = self.chunk - decode_rows
        if decode_rows == 0 or ratio == math.inf:
            return room
        decode_s, row_s = self.decode_s, self.prefill_row_s
        if not decode_s or not row_s:           # nothing timed yet (or a clock that stands)
            return min(room, INITIAL_PREFILL_ROWS)
        want = int((ratio - 1) * decode_s / row_s)
        self._last = min(room, max(MIN_PREFILL_ROWS, self._last // 2, min(want, 2 * self._last)))
        return self._last


class StepScheduler:
    """Plans the engine's steps: decode rows first, then prompt chunks, in admission
    order, within the budget StepTimes gives for `ratio` (`prefill_step_ratio`, > 1, or
    inf: prompts first, every step fills the chunk).

    chunk: the most rows of a step (the model's prefill_chunk). Raises ValueError for a
    ratio that is not > 1 (also when set later).
    """

    def __init__(self, chunk: int = PREFILL_CHUNK, ratio: float = PREFILL_STEP_RATIO):
        self.times = StepTimes(chunk)
        self.ratio = ratio

    @property
    def ratio(self) -> float:
        return self._ratio

    @ratio.setter
    def ratio(self, value: float) -> None:
        if not value > 1:
            raise ValueError(f"prefill_step_ratio must be > 1, got {value}")
        self._ratio = value

    def plan(self, running: Sequence[R]) -> list[tuple[R, np.ndarray]]:
        """The rows of the next step: (sequence, the tokens it continues with) — one
        token for each sequence that decodes, then for the prompts still prefilling (in
        order) as many of their next tokens as the budget leaves."""
        rows = [(r, np.array([r.last_token], np.int64)) for r in running if not r.prefilling]
        budget = self.times.prefill_rows(len(rows), self.ratio)
        for r in running:
            if r.prefilling and budget > 0:
                take = min(budget, r.prompt.size - r.prefilled)
                rows.append((r, r.prompt[r.prefilled:r.prefilled + take]))
                budget -= take
        return rows

    def observe(self, seconds: float, prefill_rows: int, decode_rows: int) -> None:
        """A step ran: its time, prompt tokens and decode rows (StepTimes.observe)."""
        self.times.observe(seconds, prefill_rows, decode_rows)
