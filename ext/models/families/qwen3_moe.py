"""Qwen3-MoE (`Qwen3MoeForCausalLM`): GQA with RMSNorm of q and k per head, a free
head_dim, softmax top-k routing. Source: transformers 5 `models/qwen3_moe/`."""
from __future__ import annotations

from ext.models.attention import GroupedQueryAttention
from ext.models.config import (ConfigReader, ModelConfig, read_decoder, read_experts,
                               read_mlp_only_layers, read_uniform_window)
from ext.models.family import Family, TensorNames
from ext.models.routing import SoftmaxTopK


def read_config(r: ConfigReader) -> ModelConfig:
    common = read_decoder(r, default_theta=1e4, default_eps=1e-6)
    n_experts, top_k, _ = read_experts(r, "num_experts", "num_local_experts")
    n = common["num_hidden_layers"]
    if r.get("attention_bias", bool, False):
        raise r.unsupported("attention_bias", "attention biases are not supported for this family")
    return ModelConfig(
        model_type="qwen3_moe", **common, num_experts=n_experts, num_experts_per_tok=top_k,
        intermediate_size=r.positive("intermediate_size"),
        moe_intermediate_size=r.positive("moe_intermediate_size"),
        moe_layers=read_mlp_only_layers(r, n, n_experts), shared_expert_intermediate_size=0,
        norm_topk_prob=r.get("norm_topk_prob", bool, False), qkv_bias=False, qk_norm="head",
        clip_qkv=None,
        sliding_windows=read_uniform_window(r, n, bool(r.raw.get("use_sliding_window", False))))


FAMILY = Family(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", read_config=read_config,
    attention=GroupedQueryAttention, routing=SoftmaxTopK, tensors=TensorNames())
