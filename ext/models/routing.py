"""Routing rules: which top_k experts a token goes to, and with what weights.

A rule turns the router's output for T tokens into ids [T, K] int32 (in rank
order: the order the weighted sum of expert outputs is taken in) and weights
[T, K] float32. Ties go to the lower expert id. The prefetch hint ranks the next
layer's experts with the same rule (`hint_scores`), or its predictions would be
wrong in a way no output test can see.

Shape legend: T tokens, H hidden_size, E num_experts, K top_k.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ext.formats.quant import ROUTER
from ext.kernels import _kernels as K_
from ext.models.config import ModelConfig
from ext.models.weights import Weight


@dataclass
class RouterWeights:
    """One MoE layer's router: weight [E, H] in its stored format (an array, or a
    QuantizedWeight if the checkpoint quantised it)."""

    weight: Weight


class SoftmaxTopK:
    """softmax over all experts, the top_k largest, renormalised to sum 1 when
    `norm_topk_prob`. Source: transformers' `*TopKRouter.forward` of Mixtral,
    Qwen2-MoE, Qwen3-MoE and OLMoE."""

    def __init__(self, config: ModelConfig):
        self.config = config

    def load(self, prefix: str, linear) -> RouterWeights:
        """The router module `prefix` (e.g. model.layers.3.mlp.gate) via
        `linear(module, shape, role)`."""
        c = self.config
        return RouterWeights(weight=linear(prefix, (c.num_experts, c.hidden_size), ROUTER))

    def logits(self, router: RouterWeights, h: np.ndarray, out: np.ndarray, n_threads: int) -> np.ndarray:
        """out [T, E] = the router applied to h [T, H]."""
        K_.matmul(router.weight, h, out, n_threads)
        return out

    def select(self, router: RouterWeights, logits: np.ndarray, ids: np.ndarray,
               weights: np.ndarray) -> None:
        """Fill ids [T, K] and weights [T, K] from logits [T, E]; ValueError on NaN/inf."""
        K_.route(logits, self.config.num_experts_per_tok, self.config.norm_topk_prob, ids, weights)

    def hint_scores(self, router: RouterWeights, logits: np.ndarray) -> np.ndarray:
        """[T, E] scores whose order per token is this rule's choice: the logits."""
        return logits
