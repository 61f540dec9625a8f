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

F32 = np.float32


@dataclass
class RouterWeights:
    """One MoE layer's router: weight [E, H] in its stored format (an array, or a
    QuantizedWeight if the checkpoint quantised it); bias [E] f32 of the linear
    (GPT-OSS) and the selection-only correction bias [E] f32 (DeepSeek-V3, GLM-4.5
    `e_score_correction_bias`), or None."""

    weight: Weight
    bias: np.ndarray | None = None
    correction_bias: np.ndarray | None = None


class SoftmaxTopK:
    """softmax over all experts, the top_k largest, renormalised to sum 1 when
    `norm_topk_prob`. Source: transformers' `*TopKRouter.forward` of Mixtral,
    Qwen2-MoE, Qwen3-MoE and OLMoE."""

    def __init__(self, config: ModelConfig):
        self.config = config

    def load(self, prefix: str, tensor, linear) -> RouterWeights:
        """The router module `prefix` (e.g. model.layers.3.mlp.gate): its weight through
        `linear(module, shape, role)` (in its stored format), vectors through
        `tensor(name, shape, f32=False)`."""
        return RouterWeights(weight=self._weight(prefix, linear))

    def _weight(self, prefix: str, linear) -> Weight:
        c = self.config
        return linear(prefix, (c.num_experts, c.hidden_size), ROUTER)

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


class SigmoidGroupedTopK(SoftmaxTopK):
    """DeepSeek-V3 / GLM-4.5 (`noaux_tc`): sigmoid scores, `e_score_correction_bias`
    added for the choice only, group-limited to the `topk_group` best of `n_group`
    groups (ranked by the sum of their two best biased scores), weights the unbiased
    scores of the chosen experts, renormalised when `norm_topk_prob`, times
    `routed_scaling_factor` (`_kernels.route_grouped`). Source: transformers'
    DeepseekV3TopkRouter and Glm4MoeTopkRouter."""

    def load(self, prefix: str, tensor, linear) -> RouterWeights:
        return RouterWeights(weight=self._weight(prefix, linear),
                             correction_bias=tensor(f"{prefix}.e_score_correction_bias",
                                                    (self.config.num_experts,), f32=True))

    def select(self, router: RouterWeights, logits: np.ndarray, ids: np.ndarray,
               weights: np.ndarray) -> None:
        c = self.config
        K_.route_grouped(logits, router.correction_bias, c.n_group, c.topk_group,
                         c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor,
                         ids, weights)

    def hint_scores(self, router: RouterWeights, logits: np.ndarray) -> np.ndarray:
        """The choice scores sigmoid(logits) + correction bias, -inf outside each
        token's kept groups: the order `select` picks experts in."""
        c = self.config
        T, E = logits.shape
        choice = F32(1.0) / (F32(1.0) + np.exp(-logits)) + router.correction_bias   # [T, E]
        if c.topk_group < c.n_group:
            grouped = choice.reshape(T, c.n_group, E // c.n_group)
            top2 = -np.sort(-grouped, axis=2)[:, :, :2].sum(axis=2)           # [T, n_group]
            order = np.lexsort((np.broadcast_to(np.arange(c.n_group), top2.shape), -top2), axis=1)
            dropped = np.ones((T, c.n_group), bool)
            np.put_along_axis(dropped, order[:, :c.topk_group], False, axis=1)
            grouped[dropped] = -np.inf
        return choice


class TopKSoftmax(SoftmaxTopK):
    """GPT-OSS: the router is a linear layer with a bias; the top_k logits are chosen
    first and only they are softmaxed (`_kernels.route_topk_softmax`). Source:
    transformers' GptOssTopKRouter."""

    def load(self, prefix: str, tensor, linear) -> RouterWeights:
        return RouterWeights(weight=self._weight(prefix, linear),
                             bias=tensor(f"{prefix}.bias", (self.config.num_experts,), f32=True))

    def logits(self, router: RouterWeights, h: np.ndarray, out: np.ndarray, n_threads: int) -> np.ndarray:
        K_.matmul(router.weight, h, out, n_threads)
        out += router.bias
        return out

    def select(self, router: RouterWeights, logits: np.ndarray, ids: np.ndarray,
               weights: np.ndarray) -> None:
        K_.route_topk_softmax(logits, self.config.num_experts_per_tok, ids, weights)
