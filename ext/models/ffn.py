"""Expert FFN kinds: how a family's routed experts turn their token rows into outputs.

The MoE block hands an expert kind the experts of one acquire, their weights
(`ExpertWeights`) and the token rows grouped by expert; the kind calls the kernel of
its activation and layout. Shape legend: N token-expert rows, H hidden_size, I
moe_intermediate_size, E num_experts, K experts of the call.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ext.kernels import _kernels as K_
from ext.models.config import ModelConfig

F32 = np.float32


class SwiGluExperts:
    """y = down(silu(gate x) * up x), one module per expert (every family but GPT-OSS).
    Nothing of the experts is resident."""

    def __init__(self, config: ModelConfig, transposed: bool = False, fast: bool = False):
        self.config = config
        self.fast = fast

    def load(self, moe: str, tensor) -> None:
        return None

    def __call__(self, resident, experts: Sequence[int], weights_of, x: np.ndarray,
                 group_start: np.ndarray, hbuf: np.ndarray, out: np.ndarray, n_threads: int) -> None:
        """out [N, H] = each expert's FFN of its rows of x [N, H] (`_kernels.expert_ffn`)."""
        K_.expert_ffn([w.gate for w in weights_of], [w.up for w in weights_of],
                      [w.down for w in weights_of], x, group_start, hbuf, out, n_threads,
                      fast=self.fast)


@dataclass
class ExpertBiases:
    """GPT-OSS's expert biases of one layer, resident in f32: gate_up [E, 2I] (gate and up
    interleaved like the weight's outputs) and down [E, H]."""

    gate_up: np.ndarray
    down: np.ndarray


class GptOssExperts:
    """GPT-OSS: gate_up interleaved (gate i = output 2i, up i = output 2i + 1), biases on
    both projections, the clamped SwiGLU (swiglu_alpha, swiglu_limit) — transformers'
    GptOssExperts — computed by `_kernels.expert_ffn_fused`; weights MXFP4 rows, or plain
    floats stored [in, out] (`transposed`). The biases are small and stay resident."""

    def __init__(self, config: ModelConfig, transposed: bool = False, fast: bool = False):
        c = self.config = config
        self.transposed = transposed
        self.fast = fast
        self._gate_up_bias = np.empty((c.num_experts, 2 * c.moe_intermediate_size), F32)
        self._down_bias = np.empty((c.num_experts, c.hidden_size), F32)

    def load(self, moe: str, tensor) -> ExpertBiases:
        c = self.config
        return ExpertBiases(
            gate_up=tensor(f"{moe}.experts.gate_up_proj_bias",
                           (c.num_experts, 2 * c.moe_intermediate_size), f32=True),
            down=tensor(f"{moe}.experts.down_proj_bias", (c.num_experts, c.hidden_size), f32=True))

    def __call__(self, resident: ExpertBiases, experts: Sequence[int], weights_of, x: np.ndarray,
                 group_start: np.ndarray, hbuf: np.ndarray, out: np.ndarray, n_threads: int) -> None:
        k = len(experts)
        ids = np.asarray(experts, np.int64)
        gate_up_bias, down_bias = self._gate_up_bias[:k], self._down_bias[:k]
        np.take(resident.gate_up, ids, axis=0, out=gate_up_bias)
        np.take(resident.down, ids, axis=0, out=down_bias)
        c = self.config
        K_.expert_ffn_fused([w.gate for w in weights_of], [w.down for w in weights_of],
                            gate_up_bias, down_bias, x, group_start, hbuf, out, self.transposed,
                            c.swiglu_alpha, c.swiglu_limit, n_threads, fast=self.fast)
