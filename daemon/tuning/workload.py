"""The built-in workload the tuner measures when it has no traffic of its own.

`Workload`: one sequence decoding with seeded sampling (temperature 0.7) from fixed code
prompts (`workload_prompts`); a window is `steps` decode steps and its cost is the median
seconds per step (batch size 1, so the per-sequence cost is the step time). Every step's
routing can be recorded (`RoutingRecorder`) for the cache-split replay.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from ext.models.model import Model
from ext.sampling import Sampler, SamplingParams

TEMPERATURE = 0.7
RECORD_TOKENS = 2048            # routing kept for the replay (most recent tokens)
CODE_PROMPTS = ("def ", "class ", "import ", "    def __init__(self", "for i in range(")


class RoutingRecorder:
    """Routing of single-token decode steps: [token][moe layer] -> expert ids, the
    most recent `limit` tokens (the replay input of `choose_cache_split`)."""

    def __init__(self, n_moe_layers: int, limit: int = RECORD_TOKENS):
        self.n = n_moe_layers
        self.limit = limit
        self.tokens: list[list[list[int]]] = []
        self._current: list[list[int]] = []

    def observe(self, layer_index: int, experts) -> None:
        self._current.append(sorted(int(e) for e in experts))
        if len(self._current) == self.n:
            self.tokens.append(self._current)
            self._current = []
            if len(self.tokens) > self.limit:
                del self.tokens[: len(self.tokens) - self.limit]

    def abandon_step(self) -> None:
        self._current = []

class Workload:
    """One sequence decoding from fixed prompts with seeded sampling; restarts when full.

    prompts: token id lists. Costs are seconds per decode step (batch 1).
    """

    def __init__(self, model: Model, prompts: list[list[int]], capacity: int = 512,
                 seed: int = 0, clock: Callable[[], float] = time.perf_counter):
        self.model = model
        self.capacity = min(capacity, model.config.max_position_embeddings)
        self.prompts = [p[: max(1, self.capacity // 2)] for p in prompts]
        self.clock = clock
        self.sampler = Sampler(SamplingParams(temperature=TEMPERATURE, seed=seed))
        self._i = 0
        self.seq = None
        self.token = 0

    def _restart(self) -> None:
        prompt = self.prompts[self._i % len(self.prompts)]
        self._i += 1
        self.seq = self.model.new_sequence(capacity=self.capacity)
        self.token = self.sampler.sample(self.model.forward(self.seq, prompt)[-1])

    def window(self, steps: int, on_step: Callable[[float, int], None] | None = None) -> float:
        """Run `steps` decode steps; the median seconds per step. on_step(seconds, 1) is
        called after each (the live tuner's feed when the daemon is idle)."""
        times = []
        for _ in range(steps):
            if self.seq is None or self.seq.length + 1 >= self.capacity:
                self._restart()
            t0 = self.clock()
            logits = self.model.forward(self.seq, [self.token])
            times.append(self.clock() - t0)
            if on_step is not None:
                on_step(times[-1], 1)
            self.token = self.sampler.sample(logits[-1])
        return statistics.median(times)

def workload_prompts(model_dir: str | Path, vocab_size: int) -> list[list[int]]:
    """Code prompts through the model's tokenizer; fixed ids for a model without one."""
    from ext.tokenizer import Tokenizer, TokenizerFilesError
    try:
        tok = Tokenizer.from_model_dir(model_dir)
        return [tok.encode(p, add_special_tokens=False) for p in CODE_PROMPTS]
    except (TokenizerFilesError, OSError):
        return [[1 + (i * 37 + j * 101) % (vocab_size - 1) for i in range(16)] for j in range(4)]
