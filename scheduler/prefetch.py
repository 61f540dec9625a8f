"""How far to trust the next-layer predictor: its precision by rank, learned online.

The prefetcher ranks a layer's experts by that layer's router applied to the hidden
state one layer early. Its raw softmax probabilities are no estimate of use: with 64
experts and top_k 8, a candidate ranked first is used almost always yet carries a
softmax probability near 0.05 (measured on a `make-model --routing-skew 1` checkpoint:
precision 0.999 at rank 0, 0.47 at rank 7, mean probabilities 0.051 and 0.022). A
prefetch must weigh the chance it is used against the value of what it evicts
(scheduler/eviction.py, probability of use per token), so the score it needs is the
predictor's precision at that rank, which this module measures as the model runs.

`RankCalibration` keeps, per rank r < max_rank, decayed counts of how often the
candidate at rank r was among the experts the layer then needed. precision(r) is the
posterior mean under a Beta(1, 1) prior, (used + 1) / (seen + 2): 0.5 before any
observation, so a cold start neither trusts nor ignores the predictor. Decode (one
token) and prefill (a chunk's union) are kept apart by the caller: their precisions
differ.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

CALIBRATION_HALF_LIFE = 512.0   # observations (layer steps) over which old outcomes fade


class RankCalibration:
    """Decayed per-rank precision of a ranked prediction.

    max_rank: ranks tracked (candidates beyond it score as the last tracked rank).
    half_life: observations after which an outcome weighs half (> 0).
    Raises ValueError for max_rank < 1 or half_life <= 0.
    """

    def __init__(self, max_rank: int, half_life: float = CALIBRATION_HALF_LIFE):
        if max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {max_rank}")
        if not half_life > 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.max_rank = int(max_rank)
        self._decay = 2.0 ** (-1.0 / half_life)
        self._used = [0.0] * self.max_rank
        self._seen = [0.0] * self.max_rank
        self.observations = 0

    def observe(self, ranked: Sequence[int], needed: Collection[int]) -> None:
        """One prediction's outcome: `ranked` candidates best first, `needed` what was used."""
        d = self._decay
        for r in range(self.max_rank):
            self._used[r] *= d
            self._seen[r] *= d
        for r, e in enumerate(ranked[: self.max_rank]):
            self._seen[r] += 1.0
            if e in needed:
                self._used[r] += 1.0
        self.observations += 1

    def precision(self, rank: int) -> float:
        """Estimated probability that the candidate at `rank` (0 = best) is used, in (0, 1)."""
        r = min(max(int(rank), 0), self.max_rank - 1)
        return (self._used[r] + 1.0) / (self._seen[r] + 2.0)

    def precisions(self) -> list[float]:
        """precision(r) for every tracked rank, best rank first."""
        return [self.precision(r) for r in range(self.max_rank)]
