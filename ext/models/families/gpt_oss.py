"""GPT-OSS 20B / 120B (`GptOssForCausalLM`): GQA with biases on q/k/v/o, a learned sink
logit per head in every softmax, layers alternating sliding-window and full attention
(`layer_types`, `sliding_window`), YaRN RoPE; the router is a linear layer with a bias
whose top_k logits are softmaxed (top-k first); the experts are fused over [E, ...]
with gate and up interleaved, carry biases and use the clamped SwiGLU
(`swiglu_limit`, `swiglu_alpha`); MXFP4 experts as published, or plain floats.
Source: transformers 5 `models/gpt_oss/`.
"""
from __future__ import annotations

import math

from ext.models.attention import GroupedQueryAttention
from ext.models.config import (ConfigReader, ModelConfig, read_decoder, read_experts,
                               read_layer_types, read_rope, read_window)
from ext.models.family import Family, TensorNames
from ext.models.ffn import GptOssExperts
from ext.models.routing import TopKSoftmax

# GptOssConfig's default RoPE block (transformers 5), used when config.json has none.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def _sliding_windows(r: ConfigReader, n_layers: int) -> tuple[int | None, ...]:
    """`layer_types` (default: sliding for even layers, as GptOssConfig builds them) with
    `sliding_window` (default 128); a null window makes every layer full attention."""
    if "sliding_window" not in r.raw:
        window = 128
    elif r.raw["sliding_window"] is None:
        return (None,) * n_layers
    else:
        window = read_window(r)
    pattern = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    return read_layer_types(r, n_layers, window, default=pattern)


def read_config(r: ConfigReader) -> ModelConfig:
    common = read_decoder(r, default_theta=None, default_eps=1e-5, head_dim=r.positive("head_dim", 64),
                          default_context=131072)
    n = common["num_hidden_layers"]
    theta, partial, scaling = read_rope(r, default_theta=150000.0, default_scaling=DEFAULT_ROPE,
                                        max_position_embeddings=common["max_position_embeddings"])
    if partial != 1.0:
        raise r.unsupported("partial_rotary_factor", "GPT-OSS rotates the whole head")
    n_experts, top_k, _ = read_experts(r, "num_local_experts", "num_experts")
    intermediate = r.positive("intermediate_size")
    bias = r.get("attention_bias", bool, True)
    alpha = r.get("swiglu_alpha", float, 1.702)
    limit = r.get("swiglu_limit", float, 7.0)
    for field, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
        if not 0 < value < math.inf:
            raise r.error(field, f"must be a positive finite number, got {value}")
    return ModelConfig(
        model_type="gpt_oss", **common, num_experts=n_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=intermediate, intermediate_size=intermediate,
        shared_expert_intermediate_size=0, norm_topk_prob=True, qkv_bias=bias, o_bias=bias,
        qk_norm="none", clip_qkv=None, rope_theta=theta, rope_scaling=scaling,
        sliding_windows=_sliding_windows(r, n), moe_layers=(True,) * n, attention_sinks=True,
        router_bias=True, expert_activation="clamped_swiglu", swiglu_alpha=alpha,
        swiglu_limit=limit, expert_bias=True)


FAMILY = Family(
    model_type="gpt_oss", architecture="GptOssForCausalLM", read_config=read_config,
    attention=GroupedQueryAttention, routing=TopKSoftmax,
    tensors=TensorNames(router="router", fused_experts=True), experts=GptOssExperts)
