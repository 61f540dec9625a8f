"""Sampling parameters and their validation, without numpy: a client that only checks its
flags before sending them to the daemon imports this, not the sampler (ext/sampling.py,
which re-exports both names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


class SamplingParamError(ValueError):
    """A sampling parameter out of range; `.field` names it (e.g. "top_p")."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    Attributes:
        temperature: >= 0. 0 means greedy argmax; otherwise logits are divided by it.
        top_p: in (0, 1]. Keep the smallest most-likely prefix whose probability mass
            is >= top_p (always at least one token). 1.0 disables the filter.
        top_k: >= 0. Keep the top_k most likely tokens before top_p; 0 disables it.
        seed: seed of the PCG64 stream; None draws one from os.urandom.
        presence_penalty, frequency_penalty: in [-2, 2] (OpenAI's range); 0 disables.
        logit_bias: (token id >= 0, bias in [-100, 100]) pairs, ids distinct; the ids'
            range is the vocabulary's, checked by the caller that knows it.

    Raises:
        ValueError: a field is out of range; the message names the field.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise SamplingParamError("temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise SamplingParamError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool)
                and self.top_k >= 0):
            raise SamplingParamError("top_k", f"top_k must be an int >= 0, got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int)
                                          and not isinstance(self.seed, bool)
                                          and self.seed >= 0):
            raise SamplingParamError("seed", f"seed must be None or an int >= 0, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and -2.0 <= value <= 2.0):
                raise SamplingParamError(name, f"{name} must be a number in [-2, 2], got {value!r}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                and isinstance(b, (int, float)) and not isinstance(b, bool) and -100 <= b <= 100
                for t, b in self.logit_bias):
            raise SamplingParamError("logit_bias", "logit_bias maps distinct token ids >= 0 to "
                                                   "biases in [-100, 100]")

    def with_seed(self, seed: int | None) -> SamplingParams:
        """The same parameters with another seed."""
        return replace(self, seed=seed)
