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

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ext.models.config import ModelConfig
from ext.models.experts import ExpertWeights
from ext.models.model import Model
from ext.models.weights import float_values

PRIOR_TOKENS = 16.0   # default pseudo-count of the layer's statistics in an expert's estimate


@dataclass
class ImportanceStats:
    """Sums of squared activations per (layer, expert) and projection input, float64.

    inputs[l]: [E, H] sum of x^2 of the gate/up input; acts[l]: [E, I] of the down
    input; counts[l]: [E] tokens routed. tokens: positions run through the model. With
    `second_moments`, also input_moments[l] [E, H, H] and act_moments[l] [E, I, I], the
    sums of x x^T (GPTQ's statistic), for the layers in `moment_layers` (None: all).
    """

    num_experts: int
    second_moments: bool = False
    moment_layers: frozenset[int] | None = None
    inputs: dict[int, np.ndarray] = field(default_factory=dict)
    acts: dict[int, np.ndarray] = field(default_factory=dict)
    input_moments: dict[int, np.ndarray] = field(default_factory=dict)
    act_moments: dict[int, np.ndarray] = field(default_factory=dict)
    counts: dict[int, np.ndarray] = field(default_factory=dict)
    tokens: int = 0

    def _moments_of(self, layer: int) -> bool:
        return self.second_moments and (self.moment_layers is None or layer in self.moment_layers)

    def observe(self, layer: int, experts: list[int], weights: list[ExpertWeights],
                x: np.ndarray, group_start: np.ndarray) -> None:
        """`Model.moe_observer`: add the rows each expert of `experts` gets."""
        if layer not in self.inputs:
            H, I = x.shape[1], weights[0].gate.shape[0]
            self.inputs[layer] = np.zeros((self.num_experts, H))
            self.acts[layer] = np.zeros((self.num_experts, I))
            self.counts[layer] = np.zeros(self.num_experts)
            if self._moments_of(layer):
                self.input_moments[layer] = np.zeros((self.num_experts, H, H))
                self.act_moments[layer] = np.zeros((self.num_experts, I, I))
        for g, (e, w) in enumerate(zip(experts, weights)):
            rows = np.asarray(x[group_start[g]:group_start[g + 1]], np.float32)   # [n, H]
            gate = rows @ float_values(w.gate).T                                 # [n, I]
            up = rows @ float_values(w.up).T
            act = gate / (1.0 + np.exp(-gate)) * up                              # SwiGLU
            self.inputs[layer][e] += np.square(rows, dtype=np.float64).sum(0)
            self.acts[layer][e] += np.square(act, dtype=np.float64).sum(0)
            self.counts[layer][e] += rows.shape[0]
            if self._moments_of(layer):
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
        prior = sums.sum(0) / max(counts.sum(), 1.0)
        imp = (sums[expert] + prior_tokens * prior) / (counts[expert] + prior_tokens)
        return imp.astype(np.float32)

    def moment_matrix(self, layer: int, expert: int, projection: str,
                      prior_tokens: float = PRIOR_TOKENS) -> np.ndarray:
        """[C, C] float64 mean of x x^T of one projection's input, blended with the layer's
        like `column_importance`. KeyError for a layer whose moments were not gathered."""
        sums = self.act_moments[layer] if projection == "down" else self.input_moments[layer]
        counts = self.counts[layer]
        prior = sums.sum(0) / max(counts.sum(), 1.0)
        return (sums[expert] + prior_tokens * prior) / (counts[expert] + prior_tokens)

    def for_layer(self, layer: int) -> ImportanceStats:
        """The statistics that hold `layer`'s (these)."""
        return self


def moment_bytes(config: ModelConfig) -> int:
    """Bytes of one MoE layer's second moments (every expert's [H, H] and [I, I], float64)."""
    H, I = config.hidden_size, config.moe_intermediate_size
    return config.num_experts * (H * H + I * I) * 8


def gather(model: Model, windows: Iterable[np.ndarray],
           progress: Callable[[int, int], None] | None = None, *,
           second_moments: bool = False,
           moment_layers: Iterable[int] | None = None) -> ImportanceStats:
    """Run each window of token ids (a fresh sequence each) through `model` and gather the
    statistics of its routed experts (second moments of `moment_layers` only, when
    given). `model.moe_observer` is restored afterwards."""
    windows = list(windows)
    stats = ImportanceStats(num_experts=model.config.num_experts, second_moments=second_moments,
                            moment_layers=None if moment_layers is None else frozenset(moment_layers))
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


class LayerwiseMoments:
    """Second moments for GPTQ gathered a few layers at a time, so that they never take
    more than `budget_bytes` (every expert's [H, H] + [I, I] float64 per layer: 2.4 GB a
    layer for 128 experts of hidden 2048, far more than RAM for a whole large model).

    `for_layer(l)` returns statistics holding layer l's moments, running `model` over the
    calibration windows again for the next layers that fit the budget when l is not among
    those held (layers are asked for in increasing order by the repack, so a model whose
    moments fit is gathered once). Thread-safe. progress(done, total) as `gather`'s, per
    pass.
    """

    def __init__(self, model: Model, windows: list[np.ndarray], budget_bytes: int,
                 progress: Callable[[int, int], None] | None = None):
        self.model = model
        self.windows = windows
        self.moe_layers = [l for l, m in enumerate(model.config.moe_layers) if m]
        self.per_pass = max(1, budget_bytes // max(moment_bytes(model.config), 1))
        self.progress = progress
        self.passes = 0
        self._stats: ImportanceStats | None = None
        self._lock = threading.Lock()

    def for_layer(self, layer: int) -> ImportanceStats:
        with self._lock:
            held = self._stats.moment_layers if self._stats is not None else frozenset()
            if layer not in held:
                i = self.moe_layers.index(layer)
                self._stats = None                      # free the last pass's moments first
                self._stats = gather(self.model, self.windows, self.progress, second_moments=True,
                                     moment_layers=self.moe_layers[i:i + self.per_pass])
                self.passes += 1
            return self._stats
