"""The step scheduler (daemon/engine/steps.py): a step's rows are every decoding
sequence's next token, then the prompts' next chunks in admission order within the
budget StepTimes gives; the ratio is checked wherever it is set."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from daemon.engine.steps import INITIAL_PREFILL_ROWS, MIN_PREFILL_ROWS, PREFILL_STEP_RATIO, StepScheduler


@dataclass
class Row:
    prompt: np.ndarray
    prefilled: int = 0
    last_token: int = 0

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt.size


def _prompt(n: int) -> np.ndarray:
    return np.arange(1, n + 1, dtype=np.int64)


def test_a_step_alone_takes_the_whole_chunk_across_prompts_in_order():
    s = StepScheduler(chunk=16)
    a, b, c = Row(_prompt(10), prefilled=3), Row(_prompt(20)), Row(_prompt(5))
    rows = s.plan([a, b, c])
    assert [(r, t.tolist()) for r, t in rows] == [(a, list(range(4, 11))),     # its 7 left
                                                  (b, list(range(1, 10)))]     # 9 of 20
    assert sum(t.size for _, t in rows) == 16


def test_decode_rows_come_first_and_prompts_get_the_measured_budget_beside_them():
    s = StepScheduler(chunk=64)
    d1, d2 = Row(_prompt(3), prefilled=3, last_token=7), Row(_prompt(2), prefilled=2, last_token=9)
    p = Row(_prompt(100))
    rows = s.plan([p, d1, d2])
    assert [(r, t.tolist()) for r, t in rows] == [(d1, [7]), (d2, [9]),
                                                  (p, list(range(1, INITIAL_PREFILL_ROWS + 1)))]
    for _ in range(9):
        s.observe(0.010, 0, 2)                 # decode steps of 10 ms
    s.observe(0.064, 64, 0)                    # a prompt row costs 1 ms
    rows = s.plan([p, d1, d2])
    want = int((PREFILL_STEP_RATIO - 1) * 0.010 / 0.001)
    assert [t.size for _, t in rows] == [1, 1, min(want, 2 * INITIAL_PREFILL_ROWS)]


def test_nothing_running_plans_nothing():
    assert StepScheduler(chunk=8).plan([]) == []


@pytest.mark.parametrize("ratio", [1.0, 0.5, float("nan"), float("-inf")])
def test_a_ratio_not_above_one_is_refused_at_start_and_when_set(ratio):
    with pytest.raises(ValueError, match="prefill_step_ratio must be > 1"):
        StepScheduler(ratio=ratio)
    s = StepScheduler(ratio=2.0)
    with pytest.raises(ValueError, match="prefill_step_ratio must be > 1"):
        s.ratio = ratio
    assert s.ratio == 2.0


def _timed(ratio: float, decode_s: float = 0.010, row_s: float = 0.001) -> StepScheduler:
    """A scheduler of chunk 64 that has seen decode steps of decode_s and a prompt step
    of row_s a row."""
    s = StepScheduler(chunk=64, ratio=ratio)
    for _ in range(9):
        s.observe(decode_s, 0, 2)
    s.observe(64 * row_s, 64, 0)
    return s


def _prefill_sizes(s: StepScheduler, steps: int) -> list[int]:
    d1, d2 = Row(_prompt(3), prefilled=3, last_token=7), Row(_prompt(2), prefilled=2, last_token=9)
    p = Row(_prompt(10_000))
    sizes = []
    for _ in range(steps):
        rows = s.plan([d1, p, d2])
        assert [t.size for r, t in rows if r is not p] == [1, 1]      # the streams never wait a step
        sizes.append(sum(t.size for r, t in rows if r is p))
        p.prefilled += sizes[-1]
    return sizes


def test_the_ratio_spans_streams_first_to_prompt_first():
    # inf (llama.cpp's order): every step beside the decodes fills the chunk at once
    assert _prefill_sizes(_timed(float("inf")), 3) == [62, 62, 62]
    # the default: the chunk grows (at most doubling a step) to (R - 1) decode steps' worth
    want = int((PREFILL_STEP_RATIO - 1) * 0.010 / 0.001)
    assert _prefill_sizes(_timed(PREFILL_STEP_RATIO), 4)[-1] == min(want, 62)
    # near 1 (streams first): the fewest rows a step takes beside decodes
    assert _prefill_sizes(_timed(1.01), 4)[-1] == MIN_PREFILL_ROWS


def test_a_prompt_first_scheduler_plans_as_one_with_nothing_decoding():
    s = StepScheduler(chunk=16, ratio=float("inf"))
    d, p = Row(_prompt(1), prefilled=1, last_token=5), Row(_prompt(40))
    assert [(r, t.size) for r, t in s.plan([p, d])] == [(d, 1), (p, 15)]    # nothing timed yet
