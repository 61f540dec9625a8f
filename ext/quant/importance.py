"""How much each input column of each routed expert matters, from calibration text.

The output error of a projection y = W x caused by replacing W with W + dW is
sum_c dW[r, c] x[c] per row; over the inputs the projection sees, its expected square is
(with the cross terms dropped) sum_c dW[r, c]^2 E[x[c]^2]. So a column's importance is the
mean square of the activation it multiplies, per expert and projection — the statistic
llama.cpp's imatrix tool gathers. For a routed expert:

    gate, up   x = the MoE layer's input (post-attention RMSNorm) of the tokens routed to it
    down       x = silu(gate x) * up x of those tokens

gathered by running moed's forward pass over calibration text (`gather`). An expert the
text rarely routes to has a noisy estimate, so `ImportanceStats.column_importance` blends
its mean with the layer's (over every routed token) as if `prior_tokens` more tokens had
the layer's statistics.

Use text the model will not be evaluated on (for moed's default model: its training
modules, never the held-out ones).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ext.models.experts import ExpertWeights
from ext.models.model import Model

PRIOR_TOKENS = 16.0   # default pseudo-count of the layer's statistics in an expert's estimate


@dataclass
class ImportanceStats:
    """Sums of squared activations per (layer, expert) and projection input, float64.

    inputs[l]: [E, H] sum of x^2 of the gate/up input; acts[l]: [E, I] of the down
    input; counts[l]: [E] tokens routed. tokens: positions run through the model.
    """

    num_experts: int
    second_moments: bool = False
    inputs: dict[int, np.ndarray] = field(default_factory=dict)
    input_moments: dict[int, np.ndarray] = field(default_factory=dict)
    act_moments: dict[int, np.ndarray] = field(default_factory=dict)
    acts: dict[int, np.ndarray] = field(default_factory=dict)
    counts: dict[int, np.ndarray] = field(default_factory=dict)
    tokens: int = 0

    def observe(self, layer: int, experts: list[int], weights: list[ExpertWeights],
                x: np.ndarray, group_start: np.ndarray) -> None:
        """`Model.moe_observer`: add the rows each expert of `experts` gets."""
        if layer not in self.inputs:
            H, I = x.shape[1], weights[0].gate.shape[0]
            self.inputs[layer] = np.zeros((self.num_experts, H))
            self.acts[layer] = np.zeros((self.num_experts, I))
            self.counts[layer] = np.zeros(self.num_experts)
            if self.second_moments:
                self.input_moments[layer] = np.zeros((self.num_experts, H, H))
                self.act_moments[layer] = np.zeros((self.num_experts, I, I))
        for g, (e, w) in enumerate(zip(experts, weights)):
            rows = np.asarray(x[group_start[g]:group_start[g + 1]], np.float32)   # [n, H]
            gate = rows @ np.asarray(w.gate, np.float32).T                       # [n, I]
            up = rows @ np.asarray(w.up, np.float32).T
            act = gate / (1.0 + np.exp(-gate)) * up                              # SwiGLU
            self.inputs[layer][e] += np.square(rows, dtype=np.float64).sum(0)
            self.acts[layer][e] += np.square(act, dtype=np.float64).sum(0)
            self.counts[layer][e] += rows.shape[0]
            if self.second_moments:
                r64, a64 = rows.astype(np.float64), act.astype(np.float64)
                self.input_moments[layer][e] += r64.T @ r64
                self.act_moments[layer][e] += a64.T @ a64

    def column_importance(self, layer: int, expert: int, projection: str,
                          prior_tokens: float = PRIOR_TOKENS) -> np.ndarray:
        """[C] float32 importance of the input columns of one projection ("gate", "up" or
        "down"): (sum_e + prior_tokens * layer mean) / (count_e + prior_tokens). Raises
        KeyError for a layer the text never reached."""
        sums = self.acts[layer] if projection == "down" else self.inputs[layer]
        counts = self.counts[layer]
        total = counts.sum()
        prior = sums.sum(0) / max(total, 1.0)
        imp = (sums[expert] + prior_tokens * prior) / (counts[expert] + prior_tokens)
        return imp.astype(np.float32)

    def moment_matrix(self, layer: int, expert: int, projection: str,
                      prior_tokens: float = PRIOR_TOKENS) -> np.ndarray:
        """[C, C] float64 mean of x x^T of one projection's input, blended with the layer's
        like `column_importance` (needs second_moments=True)."""
        sums = self.act_moments[layer] if projection == "down" else self.input_moments[layer]
        counts = self.counts[layer]
        prior = sums.sum(0) / max(counts.sum(), 1.0)
        return (sums[expert] + prior_tokens * prior) / (counts[expert] + prior_tokens)

    def routed_tokens(self, layer: int) -> np.ndarray:
        return self.counts[layer]


def gather(model: Model, windows: Iterable[np.ndarray],
           progress: Callable[[int, int], None] | None = None, *,
           second_moments: bool = False) -> ImportanceStats:
    """Run each window of token ids (a fresh sequence each) through `model` and gather the
    statistics of its routed experts. `model.moe_observer` is restored afterwards."""
    windows = list(windows)
    stats = ImportanceStats(num_experts=model.config.num_experts, second_moments=second_moments)
    saved = model.moe_observer
    model.moe_observer = stats.observe
    try:
        for i, ids in enumerate(windows):
            seq = model.new_sequence(capacity=len(ids))
            model.forward(seq, ids)
            stats.tokens += len(ids)
            if progress is not None:
                progress(i + 1, len(windows))
    finally:
        model.moe_observer = saved
    return stats
