"""Autoregressive generation over one sequence: prefill, then one decode step per token.

A `Generation` is an iterator of new token ids. It stops after a stop token (which
it does not yield), after `max_tokens`, or at the model's context length, and then
says why in `finish_reason` ("stop" or "length", OpenAI's names). Timings use the
clock passed in (default `time.perf_counter`), in seconds.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from ext.models.model import Model
from ext.sampling import Sampler, SamplingParams


class Generation:
    """Tokens generated for one prompt, produced lazily.

    Args:
        model: a loaded Model (driven from the calling thread only).
        prompt_ids: the prompt, ids in [0, vocab_size); at least one.
        max_tokens: upper bound on new tokens (>= 1); capped by the context.
        sampling: temperature / top_p / top_k / seed.
        stop_ids: ids that end generation (not yielded).
        clock: seconds, monotonic.
    Raises:
        ValueError: empty prompt, max_tokens < 1, or the prompt does not leave
            room for one new token within max_position_embeddings.
    Attributes after iteration: finish_reason, completion_tokens, and the time
    to first token and decode time (seconds).
    """

    def __init__(self, model: Model, prompt_ids: Iterable[int], *, max_tokens: int,
                 sampling: SamplingParams = SamplingParams(), stop_ids: Iterable[int] = (),
                 clock: Callable[[], float] = time.perf_counter):
        self.model = model
        self.prompt_ids = [int(t) for t in prompt_ids]
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        context = model.config.max_position_embeddings
        if len(self.prompt_ids) >= context:
            raise ValueError(f"prompt of {len(self.prompt_ids)} tokens leaves no room in the "
                             f"context of {context} tokens")
        self.max_tokens = min(max_tokens, context - len(self.prompt_ids))
        self.sampler = Sampler(sampling)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.clock = clock
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.time_to_first_token_s = 0.0
        self.decode_s = 0.0
        self._it = self._run()

    def __iter__(self) -> Iterator[int]:
        return self._it

    def __next__(self) -> int:
        return next(self._it)

    def _run(self) -> Iterator[int]:
        model = self.model
        # The KV cache grows by doubling; do not reserve a huge max_tokens up front.
        seq = model.new_sequence(capacity=len(self.prompt_ids) + min(self.max_tokens, 1024))
        t0 = self.clock()
        _set_phase(model, "prefill")
        logits = model.forward(seq, np.asarray(self.prompt_ids, np.int64))
        _set_phase(model, "decode")
        for i in range(self.max_tokens):
            token = self.sampler.sample(logits[-1])
            if i == 0:
                self.time_to_first_token_s = self.clock() - t0
                t_first = self.clock()
            if token in self.stop_ids:
                self.finish_reason = "stop"
                return
            self.completion_tokens += 1
            yield token
            if i + 1 < self.max_tokens:
                logits = model.forward(seq, [token])
            self.decode_s = self.clock() - t_first
        self.finish_reason = "length"

    @property
    def decode_tokens_per_s(self) -> float:
        """(completion_tokens - 1) / time from first to last token; 0 if undefined."""
        if self.completion_tokens < 2 or self.decode_s <= 0:
            return 0.0
        return (self.completion_tokens - 1) / self.decode_s


def _set_phase(model: Model, phase: str) -> None:
    """Tell an expert provider that counts per phase what the next forward is ("prefill"
    or "decode", as the daemon's engine does)."""
    if hasattr(model.experts, "phase"):
        model.experts.phase = phase
