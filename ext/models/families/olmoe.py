"""OLMoE (`OlmoeForCausalLM`): GQA with RMSNorm over the whole q and k projections and
an optional clamp of q, k, v (`clip_qkv`), softmax top-k routing.
Source: transformers 5 `models/olmoe/`."""
from __future__ import annotations

import math

from ext.models.attention import GroupedQueryAttention
from ext.models.config import ConfigReader, ModelConfig, read_decoder, read_experts
from ext.models.family import Family, TensorNames
from ext.models.routing import SoftmaxTopK


def read_config(r: ConfigReader) -> ModelConfig:
    common = read_decoder(r, default_theta=1e4, default_eps=1e-5)
    n_experts, top_k, _ = read_experts(r, "num_experts", "num_local_experts")
    intermediate = r.positive("intermediate_size")
    n = common["num_hidden_layers"]
    if r.get("attention_bias", bool, False):
        raise r.unsupported("attention_bias", "attention biases are not supported for this family")
    clip_qkv = r.get("clip_qkv", float, None)
    if clip_qkv is not None and not 0 < clip_qkv < math.inf:
        raise r.error("clip_qkv", f"must be a positive finite number, got {clip_qkv}")
    return ModelConfig(
        model_type="olmoe", **common, num_experts=n_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=intermediate, intermediate_size=intermediate,
        shared_expert_intermediate_size=0, norm_topk_prob=r.get("norm_topk_prob", bool, False),
        qkv_bias=False, qk_norm="full", clip_qkv=clip_qkv, sliding_windows=(None,) * n,
        moe_layers=(True,) * n)


FAMILY = Family(
    model_type="olmoe", architecture="OlmoeForCausalLM", read_config=read_config,
    attention=GroupedQueryAttention, routing=SoftmaxTopK, tensors=TensorNames())
