"""Mixtral (`MixtralForCausalLM`): GQA, one sliding window for every layer, softmax
top-k routing that always renormalises, experts w1/w3/w2 under block_sparse_moe.
Source: transformers 5 `models/mixtral/`."""
from __future__ import annotations

from ext.models.attention import GroupedQueryAttention
from ext.models.config import (ConfigReader, ModelConfig, read_decoder, read_experts,
                               read_uniform_window)
from ext.models.family import Family, TensorNames
from ext.models.routing import SoftmaxTopK


def read_config(r: ConfigReader) -> ModelConfig:
    common = read_decoder(r, default_theta=1e6, default_eps=1e-5)
    n_experts, top_k, _ = read_experts(r, "num_local_experts", "num_experts")
    intermediate = r.positive("intermediate_size")
    n = common["num_hidden_layers"]
    return ModelConfig(
        model_type="mixtral", **common, num_experts=n_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=intermediate, intermediate_size=intermediate,
        shared_expert_intermediate_size=0, norm_topk_prob=True, qkv_bias=False, qk_norm="none",
        clip_qkv=None, sliding_windows=read_uniform_window(r, n, True), moe_layers=(True,) * n)


FAMILY = Family(
    model_type="mixtral", architecture="MixtralForCausalLM", read_config=read_config,
    attention=GroupedQueryAttention, routing=SoftmaxTopK,
    tensors=TensorNames(moe_block="block_sparse_moe", expert_projections=("w1", "w3", "w2")))
