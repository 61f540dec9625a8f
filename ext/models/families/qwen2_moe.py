"""Qwen2-MoE (`Qwen2MoeForCausalLM`): GQA with q/k/v biases, per-layer sliding windows,
softmax top-k routing, and a shared expert behind a sigmoid gate.
Source: transformers 5 `models/qwen2_moe/`."""
from __future__ import annotations

from ext.models.attention import GroupedQueryAttention
from ext.models.config import (ConfigReader, ModelConfig, read_decoder, read_experts,
                               read_layer_types, read_mlp_only_layers, read_window)
from ext.models.family import Family, TensorNames
from ext.models.routing import SoftmaxTopK


def _sliding_windows(r: ConfigReader, n_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows: `layer_types` when given, else the pattern transformers'
    Qwen2MoeConfig builds from `max_window_layers`; none unless `use_sliding_window`."""
    if not (bool(r.raw.get("use_sliding_window", False)) and r.raw.get("sliding_window") is not None):
        return (None,) * n_layers
    window = read_window(r)
    max_window_layers = r.get("max_window_layers", int, 28)
    pattern = ["sliding_attention" if (i + 1) % 2 and i < max_window_layers else "full_attention"
               for i in range(n_layers)]
    return read_layer_types(r, n_layers, window, default=pattern)


def read_config(r: ConfigReader) -> ModelConfig:
    common = read_decoder(r, default_theta=1e4, default_eps=1e-6)
    n_experts, top_k, _ = read_experts(r, "num_experts", "num_local_experts")
    n = common["num_hidden_layers"]
    return ModelConfig(
        model_type="qwen2_moe", **common, num_experts=n_experts, num_experts_per_tok=top_k,
        intermediate_size=r.positive("intermediate_size"),
        moe_intermediate_size=r.positive("moe_intermediate_size"),
        moe_layers=read_mlp_only_layers(r, n, n_experts),
        shared_expert_intermediate_size=r.positive("shared_expert_intermediate_size"),
        norm_topk_prob=r.get("norm_topk_prob", bool, False), qkv_bias=r.get("qkv_bias", bool, True),
        qk_norm="none", clip_qkv=None, sliding_windows=_sliding_windows(r, n))


FAMILY = Family(
    model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM", read_config=read_config,
    attention=GroupedQueryAttention, routing=SoftmaxTopK,
    tensors=TensorNames(shared_expert="shared_expert", shared_expert_gate="shared_expert_gate"))
