"""What each architecture's checkpoint holds: its tensors, in file order, and config.json.

Tensor names and config keys were checked against what transformers 5.24's own
`save_pretrained` writes for `MixtralForCausalLM`, `Qwen2MoeForCausalLM`,
`Qwen3MoeForCausalLM` and `OlmoeForCausalLM` (per-expert tensors, not the fused
`gate_up_proj` that transformers uses in memory). Shape legend as in ext/makemodel/make.py.
A new family is an entry of `_ARCH`, its tensors in `tensor_specs` and its keys in
`config_json`.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

_ARCH = {
    # model_type: (architectures entry, rope_theta, rms_norm_eps)
    "mixtral": ("MixtralForCausalLM", 1e6, 1e-5),
    "qwen2_moe": ("Qwen2MoeForCausalLM", 1e6, 1e-6),
    "qwen3_moe": ("Qwen3MoeForCausalLM", 1e6, 1e-6),
    "olmoe": ("OlmoeForCausalLM", 1e4, 1e-5),
}


# What a tensor is to the model, which decides how a low-bit --dtype stores it:
EXPERT = "expert"          # a routed expert's gate/up/down weight
ATTENTION = "attention"    # q/k/v/o projection weights
MLP = "mlp"                # a shared expert's (or dense MLP's) projection weights
ROUTER = "router"          # a router (mlp.gate) or a shared expert's gate: linear, kept
HEAD = "head"              # lm_head: linear, kept
OTHER = "other"            # embeddings, norms, biases: never quantised


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: name, shape, how to fill it ("random" or "ones") and its
    role (EXPERT, ATTENTION, MLP, ROUTER, HEAD or OTHER)."""

    name: str
    shape: tuple[int, ...]
    fill: str
    role: str = OTHER

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensor_specs(arch: str, d: dict) -> Iterator[TensorSpec]:
    """Yield every tensor of the checkpoint, in file order (embeddings, layers, head)."""
    H, I, E, D, Nq, Nkv = d["H"], d["I"], d["E"], d["D"], d["Nq"], d["Nkv"]
    yield TensorSpec("model.embed_tokens.weight", (d["V"], H), "random")
    for layer in range(d["L"]):
        p = f"model.layers.{layer}."
        yield TensorSpec(p + "input_layernorm.weight", (H,), "ones")
        for proj, rows in (("q", Nq * D), ("k", Nkv * D), ("v", Nkv * D)):
            yield TensorSpec(f"{p}self_attn.{proj}_proj.weight", (rows, H), "random", ATTENTION)
            if arch == "qwen2_moe":
                yield TensorSpec(f"{p}self_attn.{proj}_proj.bias", (rows,), "random")
        yield TensorSpec(p + "self_attn.o_proj.weight", (H, Nq * D), "random", ATTENTION)
        if arch == "qwen3_moe":
            yield TensorSpec(p + "self_attn.q_norm.weight", (D,), "ones")
            yield TensorSpec(p + "self_attn.k_norm.weight", (D,), "ones")
        elif arch == "olmoe":
            yield TensorSpec(p + "self_attn.q_norm.weight", (Nq * D,), "ones")
            yield TensorSpec(p + "self_attn.k_norm.weight", (Nkv * D,), "ones")
        yield TensorSpec(p + "post_attention_layernorm.weight", (H,), "ones")
        if arch == "mixtral":
            yield TensorSpec(p + "block_sparse_moe.gate.weight", (E, H), "random", ROUTER)
            for e in range(E):
                q = f"{p}block_sparse_moe.experts.{e}."
                yield TensorSpec(q + "w1.weight", (I, H), "random", EXPERT)  # gate
                yield TensorSpec(q + "w3.weight", (I, H), "random", EXPERT)  # up
                yield TensorSpec(q + "w2.weight", (H, I), "random", EXPERT)  # down
            continue
        yield TensorSpec(p + "mlp.gate.weight", (E, H), "random", ROUTER)
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            yield TensorSpec(q + "gate_proj.weight", (I, H), "random", EXPERT)
            yield TensorSpec(q + "up_proj.weight", (I, H), "random", EXPERT)
            yield TensorSpec(q + "down_proj.weight", (H, I), "random", EXPERT)
        if arch == "qwen2_moe":
            S = d["S"]
            yield TensorSpec(p + "mlp.shared_expert.gate_proj.weight", (S, H), "random", MLP)
            yield TensorSpec(p + "mlp.shared_expert.up_proj.weight", (S, H), "random", MLP)
            yield TensorSpec(p + "mlp.shared_expert.down_proj.weight", (H, S), "random", MLP)
            yield TensorSpec(p + "mlp.shared_expert_gate.weight", (1, H), "random", ROUTER)
    yield TensorSpec("model.norm.weight", (H,), "ones")
    yield TensorSpec("lm_head.weight", (d["V"], H), "random", HEAD)


def config_json(arch: str, d: dict, top_k: int, config_dtype: str, ids: dict,
            max_position_embeddings: int, initializer_range: float) -> dict:
    """config.json contents: the keys transformers 5 writes, plus top-level rope_theta."""
    architecture, rope_theta, rms_norm_eps = _ARCH[arch]
    config: dict[str, object] = {
        "architectures": [architecture],
        "model_type": arch,
        "vocab_size": d["V"],
        "hidden_size": d["H"],
        "num_hidden_layers": d["L"],
        "num_attention_heads": d["Nq"],
        "num_key_value_heads": d["Nkv"],
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": initializer_range,
        "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "rope_theta": rope_theta,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "num_experts_per_tok": top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "dtype": config_dtype,
        "torch_dtype": config_dtype,
    }
    if arch == "mixtral":
        config.update(num_local_experts=d["E"], intermediate_size=d["I"], head_dim=d["D"],
                      sliding_window=None, router_jitter_noise=0.0)
    elif arch == "qwen2_moe":
        config.update(num_experts=d["E"], moe_intermediate_size=d["I"],
                      intermediate_size=d["S"], shared_expert_intermediate_size=d["S"],
                      norm_topk_prob=False, qkv_bias=True, decoder_sparse_step=1,
                      mlp_only_layers=[], use_sliding_window=False)
    elif arch == "qwen3_moe":
        config.update(num_experts=d["E"], moe_intermediate_size=d["I"],
                      intermediate_size=d["I"], head_dim=d["D"], norm_topk_prob=True,
                      attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[],
                      use_sliding_window=False)
    else:  # olmoe
        config.update(num_experts=d["E"], intermediate_size=d["I"], norm_topk_prob=False,
                      attention_bias=False, clip_qkv=None)
    return dict(sorted(config.items()))
