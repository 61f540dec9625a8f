"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`): GQA with q/k/v biases, an optional
per-head RMSNorm of q and k (`use_qk_norm`) and RoPE on the first half of each head
(`partial_rotary_factor`), with DeepSeek-V3's MoE — sigmoid routing with a
selection-only correction bias and groups, `routed_scaling_factor`, shared experts,
leading dense layers — read and computed by the same pieces (families/deepseek_v3.py).
Source: transformers 5 `models/glm4_moe/`.
"""
from __future__ import annotations

from ext.models.attention import GroupedQueryAttention
from ext.models.config import ConfigReader, ModelConfig, read_decoder, read_rope
from ext.models.families.deepseek_v3 import TENSORS, read_moe
from ext.models.family import Family
from ext.models.routing import SigmoidGroupedTopK


def read_config(r: ConfigReader) -> ModelConfig:
    common = read_decoder(r, default_theta=None, default_eps=1e-5, default_context=131072)
    n = common["num_hidden_layers"]
    theta, partial, scaling = read_rope(r, default_theta=1e4, default_partial=0.5,
                                        max_position_embeddings=common["max_position_embeddings"])
    rotary_dim = int(common["head_dim"] * partial)
    if rotary_dim < 2:
        raise r.error("partial_rotary_factor", f"{partial} of head_dim {common['head_dim']} rotates no pair")
    return ModelConfig(
        model_type="glm4_moe", **common,
        **read_moe(r, n, n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1),
        qkv_bias=r.get("attention_bias", bool, False),
        qk_norm="head" if r.get("use_qk_norm", bool, False) else "none", clip_qkv=None,
        rope_theta=theta, rotary_dim=rotary_dim, rope_scaling=scaling, sliding_windows=(None,) * n)


FAMILY = Family(
    model_type="glm4_moe", architecture="Glm4MoeForCausalLM", read_config=read_config,
    attention=GroupedQueryAttention, routing=SigmoidGroupedTopK, tensors=TENSORS)
