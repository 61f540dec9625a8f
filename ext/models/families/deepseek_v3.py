"""DeepSeek-V3 / R1 / V3.1 and Kimi K2 (`DeepseekV3ForCausalLM`): multi-head latent
attention over a compressed cache, sigmoid routing with a selection-only correction
bias and group-limited choice (`noaux_tc`), shared experts beside the routed ones, the
first `first_k_dense_replace` layers dense, YaRN RoPE with interleaved pairs.
Source: transformers 5 `models/deepseek_v3/`. Kimi K2 writes `model_type: kimi_k2`
with the same architecture. The multi-token-prediction layers stored after the
decoder's (`num_nextn_predict_layers`) are not used for decoding.

`read_moe` and `TENSORS` are the pieces GLM-4.5 shares (families/glm4_moe.py).
"""
from __future__ import annotations

from typing import Any

from ext.models.config import (ConfigReader, MlaConfig, ModelConfig, read_decoder,
                               read_experts, read_rope)
from ext.models.family import Family, TensorNames
from ext.models.mla import LatentAttention
from ext.models.routing import SigmoidGroupedTopK

TENSORS = TensorNames(shared_expert="shared_experts")


def read_moe(r: ConfigReader, n_layers: int, *, n_group: int, topk_group: int,
             routed_scaling_factor: float, first_k_dense_replace: int) -> dict[str, Any]:
    """The MoE fields of the DeepSeek-V3 layout (ModelConfig keyword arguments), with
    the family's class defaults: routed experts (`n_routed_experts`), shared experts
    (`n_shared_experts` × moe_intermediate_size), leading dense layers, group-limited
    sigmoid routing. Raises ConfigError naming a field whose grouping cannot work."""
    n_experts, top_k, field = read_experts(r, "n_routed_experts", "num_local_experts")
    moe_intermediate = r.positive("moe_intermediate_size")
    n_shared = r.get("n_shared_experts", int, 1)
    if n_shared < 0:
        raise r.error("n_shared_experts", f"must be >= 0, got {n_shared}")
    first_dense = r.get("first_k_dense_replace", int, first_k_dense_replace)
    if not 0 <= first_dense <= n_layers:
        raise r.error("first_k_dense_replace", f"{first_dense} not in [0, {n_layers}]")
    groups = r.positive("n_group", n_group)
    kept = r.positive("topk_group", topk_group)
    if n_experts % groups:
        raise r.error("n_group", f"{groups} does not divide {field} {n_experts}")
    if kept > groups:
        raise r.error("topk_group", f"{kept} exceeds n_group {groups}")
    size = n_experts // groups
    if kept < groups and size < 2:
        raise r.error("n_group", f"groups of {size} expert cannot be ranked by their two best scores")
    if top_k > kept * size:
        raise r.error("num_experts_per_tok", f"{top_k} exceeds the {kept * size} experts of "
                                             f"topk_group {kept} groups")
    scaling = r.get("routed_scaling_factor", float, routed_scaling_factor)
    if not 0 < scaling < float("inf"):
        raise r.error("routed_scaling_factor", f"must be a positive finite number, got {scaling}")
    mtp = r.get("num_nextn_predict_layers", int, 0)
    if mtp < 0:
        raise r.error("num_nextn_predict_layers", f"must be >= 0, got {mtp}")
    return dict(
        num_experts=n_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=moe_intermediate, intermediate_size=r.positive("intermediate_size"),
        shared_expert_intermediate_size=n_shared * moe_intermediate,
        moe_layers=tuple(l >= first_dense for l in range(n_layers)),
        norm_topk_prob=r.get("norm_topk_prob", bool, True),
        n_group=groups, topk_group=kept, routed_scaling_factor=scaling,
        num_nextn_predict_layers=mtp)


def read_mla(r: ConfigReader) -> MlaConfig:
    """The MLA sizes; an explicit null `q_lora_rank` means a plain q_proj (absent:
    the class default 1536)."""
    q_lora = None if "q_lora_rank" in r.raw and r.raw["q_lora_rank"] is None \
        else r.positive("q_lora_rank", 1536)
    rope_dim = r.positive("qk_rope_head_dim")
    if rope_dim % 2:
        raise r.unsupported("qk_rope_head_dim", f"RoPE needs an even number of dims, got {rope_dim}")
    return MlaConfig(q_lora_rank=q_lora, kv_lora_rank=r.positive("kv_lora_rank"),
                     qk_nope_head_dim=r.positive("qk_nope_head_dim"), qk_rope_head_dim=rope_dim,
                     v_head_dim=r.positive("v_head_dim"))


def read_config(r: ConfigReader) -> ModelConfig:
    mla = read_mla(r)
    common = read_decoder(r, default_theta=None, default_eps=1e-6, head_dim=mla.qk_head_dim)
    n = common["num_hidden_layers"]
    if common["num_key_value_heads"] != common["num_attention_heads"]:
        raise r.unsupported("num_key_value_heads", "multi-head latent attention gives every head "
                            f"its own key: must equal num_attention_heads {common['num_attention_heads']}")
    theta, partial, scaling = read_rope(r, default_theta=1e4,
                                        max_position_embeddings=common["max_position_embeddings"])
    if partial != 1.0:
        raise r.unsupported("partial_rotary_factor", "MLA rotates all qk_rope_head_dim dims")
    bias = r.get("attention_bias", bool, False)
    return ModelConfig(
        model_type=r.raw["model_type"], **common,
        **read_moe(r, n, n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3),
        qkv_bias=bias, o_bias=bias, qk_norm="none", clip_qkv=None, rope_theta=theta,
        rotary_dim=mla.qk_rope_head_dim, rope_interleave=r.get("rope_interleave", bool, True),
        rope_scaling=scaling, mla=mla, sliding_windows=(None,) * n)


FAMILY = Family(
    model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", read_config=read_config,
    attention=LatentAttention, routing=SigmoidGroupedTopK, tensors=TENSORS)
