"""What each architecture's checkpoint holds: its tensors, in file order, and config.json.

Tensor names and config keys were checked against what transformers 5.24's own
`save_pretrained` writes for `MixtralForCausalLM`, `Qwen2MoeForCausalLM`,
`Qwen3MoeForCausalLM`, `OlmoeForCausalLM`, `DeepseekV3ForCausalLM` and
`Glm4MoeForCausalLM` (per-expert tensors, not the fused `gate_up_proj` that
transformers uses in memory) and `GptOssForCausalLM` (experts fused over [E, ...]:
`gate_up_proj` [E, H, 2I] with gate and up in alternate columns and `down_proj`
[E, I, H], stored [in, out] as transformers keeps them, with biases; or, in MXFP4,
`gate_up_proj_blocks` [E, 2I, H/32, 16] / `_scales` [E, 2I, H/32] and the same for
down_proj, rows = outputs, as openai/gpt-oss-* ship them). Shape legend as in
ext/makemodel/make.py. A new family is an entry of `_ARCH`, its tensors in
`tensor_specs`, its keys in `config_json` and its own fields (with their defaults) in
`family_fields`.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss")

_ARCH = {
    # model_type: (architectures entry, rope_theta, rms_norm_eps)
    "mixtral": ("MixtralForCausalLM", 1e6, 1e-5),
    "qwen2_moe": ("Qwen2MoeForCausalLM", 1e6, 1e-6),
    "qwen3_moe": ("Qwen3MoeForCausalLM", 1e6, 1e-6),
    "olmoe": ("OlmoeForCausalLM", 1e4, 1e-5),
    "deepseek_v3": ("DeepseekV3ForCausalLM", 1e4, 1e-6),
    "glm4_moe": ("Glm4MoeForCausalLM", 1e4, 1e-5),
    "gpt_oss": ("GptOssForCausalLM", 150000.0, 1e-5),
}


# What a tensor is to the model, which decides how a low-bit --dtype stores it:
EXPERT = "expert"          # a routed expert's gate/up/down weight
ATTENTION = "attention"    # q/k/v/o projection weights
MLP = "mlp"                # a shared expert's (or dense MLP's) projection weights
ROUTER = "router"          # a router (mlp.gate) or a shared expert's gate: linear, kept
HEAD = "head"              # lm_head: linear, kept
OTHER = "other"            # embeddings, norms, biases: never quantised
FLOAT32 = "float32"        # stored as F32 whatever the dtype (DeepSeek's e_score_correction_bias)


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
    """Yield every tensor of the checkpoint, in file order (embeddings, layers, head).
    For the families with fields of their own, d["fields"] holds them (family_fields)."""
    if arch in _FRONTIER_TENSORS:
        yield from _FRONTIER_TENSORS[arch](d, d["fields"])
        return
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


def config_json(arch: str, d: dict, top_k: int, config_dtype: str, ids: tuple[int, int, int],
            max_position_embeddings: int, initializer_range: float) -> dict:
    """config.json contents: the keys transformers 5 writes, plus top-level rope_theta.
    ids: the BOS, EOS and padding token ids."""
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
        "bos_token_id": ids[0],
        "eos_token_id": ids[1],
        "pad_token_id": ids[2],
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
    elif arch == "olmoe":
        config.update(num_experts=d["E"], intermediate_size=d["I"], norm_topk_prob=False,
                      attention_bias=False, clip_qkv=None)
    else:   # the families with fields of their own
        config.pop("rope_theta")
        config.pop("router_aux_loss_coef")
        config.update(d["fields"])
        config["rope_parameters"] = {"rope_theta": rope_theta, **config["rope_parameters"]}
    return dict(sorted(config.items()))


def family_fields(arch: str, d: dict, top_k: int, overrides: dict | None = None) -> dict:
    """config.json fields of `arch`'s own (beyond the shared sizes), with make-model's
    defaults — sized like the published models relative to head_dim D: DeepSeek-V3's
    MLA has qk_nope_head_dim D, qk_rope_head_dim D/2, v_head_dim D, kv_lora_rank 4D and
    q_lora_rank 12D (D = 128 gives the real 128/64/128/512/1536, and a 576-row
    kv_a_proj_with_mqa) — then `overrides` (keys of the result only; None keeps a
    field null, e.g. q_lora_rank for a plain q_proj). {} for the first four families.
    Raises ValueError for an unknown key, or fields that cannot make a model."""
    E, I, D, L = d["E"], d["I"], d["D"], d["L"]
    if arch == "deepseek_v3":
        groups = 8 if E % 8 == 0 and E >= 16 else 1
        kept = max(1, groups // 2)
        if top_k > kept * (E // groups):
            kept = groups
        fields = dict(q_lora_rank=12 * D, kv_lora_rank=4 * D, qk_nope_head_dim=D,
                      qk_rope_head_dim=max(2, D // 2 // 2 * 2), v_head_dim=D,
                      n_routed_experts=E, moe_intermediate_size=I, intermediate_size=4 * I,
                      n_shared_experts=1, first_k_dense_replace=1 if L > 1 else 0,
                      n_group=groups, topk_group=kept, routed_scaling_factor=2.5,
                      norm_topk_prob=True, rope_interleave=True, attention_bias=False,
                      num_nextn_predict_layers=0, topk_method="noaux_tc", scoring_func="sigmoid",
                      rope_parameters={"rope_type": "default"})
    elif arch == "glm4_moe":
        fields = dict(head_dim=D, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                      n_routed_experts=E, moe_intermediate_size=I, intermediate_size=4 * I,
                      n_shared_experts=1, first_k_dense_replace=1 if L > 1 else 0, n_group=1,
                      topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                      num_nextn_predict_layers=0, rope_parameters={"rope_type": "default"})
    elif arch == "gpt_oss":
        fields = dict(head_dim=D, num_local_experts=E, intermediate_size=I, sliding_window=128,
                      layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention"
                                   for i in range(L)],
                      attention_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0,
                      router_aux_loss_coef=0.9,
                      rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": False,
                                       "original_max_position_embeddings": 4096})
    else:
        fields = {}
    for key, value in (overrides or {}).items():
        if key not in fields:
            raise ValueError(f"{arch} has no config field {key!r} make-model sets "
                             f"(its fields: {', '.join(sorted(fields)) or 'none'})")
        fields[key] = value
    _check_fields(arch, fields, top_k)
    return fields


def _check_fields(arch: str, f: dict, top_k: int) -> None:
    if arch == "deepseek_v3":
        E, groups, kept = f["n_routed_experts"], f["n_group"], f["topk_group"]
        for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not isinstance(f[k], int) or f[k] <= 0:
                raise ValueError(f"{k} must be a positive int, got {f[k]!r}")
        if f["qk_rope_head_dim"] % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {f['qk_rope_head_dim']}")
        if f["q_lora_rank"] is not None and (not isinstance(f["q_lora_rank"], int) or f["q_lora_rank"] <= 0):
            raise ValueError(f"q_lora_rank must be a positive int or None, got {f['q_lora_rank']!r}")
        if E % groups or kept > groups or (kept < groups and E // groups < 2) \
                or top_k > kept * (E // groups):
            raise ValueError(f"n_group {groups} / topk_group {kept} cannot route top_k {top_k} "
                             f"of {E} experts")
    if arch == "gpt_oss" and f["sliding_window"] is not None and f["sliding_window"] <= 0:
        raise ValueError(f"sliding_window must be positive, got {f['sliding_window']}")


def _moe_block(p: str, d: dict, f: dict, layer: int) -> Iterator[TensorSpec]:
    """DeepSeek-V3's and GLM-4.5's MLP: dense before first_k_dense_replace, else router
    (+ F32 e_score_correction_bias), routed experts and the shared experts."""
    H, I, E = d["H"], d["I"], d["E"]
    if layer < f["first_k_dense_replace"]:
        S = f["intermediate_size"]
        yield TensorSpec(p + "mlp.gate_proj.weight", (S, H), "random", MLP)
        yield TensorSpec(p + "mlp.up_proj.weight", (S, H), "random", MLP)
        yield TensorSpec(p + "mlp.down_proj.weight", (H, S), "random", MLP)
        return
    yield TensorSpec(p + "mlp.gate.weight", (E, H), "random", ROUTER)
    yield TensorSpec(p + "mlp.gate.e_score_correction_bias", (E,), "random", FLOAT32)
    for e in range(E):
        q = f"{p}mlp.experts.{e}."
        yield TensorSpec(q + "gate_proj.weight", (I, H), "random", EXPERT)
        yield TensorSpec(q + "up_proj.weight", (I, H), "random", EXPERT)
        yield TensorSpec(q + "down_proj.weight", (H, I), "random", EXPERT)
    S = f["n_shared_experts"] * I
    if S:
        yield TensorSpec(p + "mlp.shared_experts.gate_proj.weight", (S, H), "random", MLP)
        yield TensorSpec(p + "mlp.shared_experts.up_proj.weight", (S, H), "random", MLP)
        yield TensorSpec(p + "mlp.shared_experts.down_proj.weight", (H, S), "random", MLP)


def _deepseek_tensors(d: dict, f: dict) -> Iterator[TensorSpec]:
    H, Nq = d["H"], d["Nq"]
    qr, r = f["q_lora_rank"], f["kv_lora_rank"]
    dn, dr, dv = f["qk_nope_head_dim"], f["qk_rope_head_dim"], f["v_head_dim"]
    bias = f["attention_bias"]
    yield TensorSpec("model.embed_tokens.weight", (d["V"], H), "random")
    for layer in range(d["L"]):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        yield TensorSpec(p + "input_layernorm.weight", (H,), "ones")
        if qr is None:
            yield TensorSpec(a + "q_proj.weight", (Nq * (dn + dr), H), "random", ATTENTION)
        else:
            yield TensorSpec(a + "q_a_proj.weight", (qr, H), "random", ATTENTION)
            if bias:
                yield TensorSpec(a + "q_a_proj.bias", (qr,), "random")
            yield TensorSpec(a + "q_a_layernorm.weight", (qr,), "ones")
            yield TensorSpec(a + "q_b_proj.weight", (Nq * (dn + dr), qr), "random", ATTENTION)
        yield TensorSpec(a + "kv_a_proj_with_mqa.weight", (r + dr, H), "random", ATTENTION)
        if bias:
            yield TensorSpec(a + "kv_a_proj_with_mqa.bias", (r + dr,), "random")
        yield TensorSpec(a + "kv_a_layernorm.weight", (r,), "ones")
        yield TensorSpec(a + "kv_b_proj.weight", (Nq * (dn + dv), r), "random", ATTENTION)
        yield TensorSpec(a + "o_proj.weight", (H, Nq * dv), "random", ATTENTION)
        if bias:
            yield TensorSpec(a + "o_proj.bias", (H,), "random")
        yield TensorSpec(p + "post_attention_layernorm.weight", (H,), "ones")
        yield from _moe_block(p, d, f, layer)
    yield TensorSpec("model.norm.weight", (H,), "ones")
    yield TensorSpec("lm_head.weight", (d["V"], H), "random", HEAD)


def _gqa_tensors(p: str, d: dict, D: int, bias: bool, o_bias: bool, qk_norm: bool) -> Iterator[TensorSpec]:
    """q/k/v/o projections (with biases) and per-head q/k norms of a GQA layer."""
    H, Nq, Nkv = d["H"], d["Nq"], d["Nkv"]
    a = p + "self_attn."
    for proj, rows in (("q", Nq * D), ("k", Nkv * D), ("v", Nkv * D)):
        yield TensorSpec(f"{a}{proj}_proj.weight", (rows, H), "random", ATTENTION)
        if bias:
            yield TensorSpec(f"{a}{proj}_proj.bias", (rows,), "random")
    yield TensorSpec(a + "o_proj.weight", (H, Nq * D), "random", ATTENTION)
    if o_bias:
        yield TensorSpec(a + "o_proj.bias", (H,), "random")
    if qk_norm:
        yield TensorSpec(a + "q_norm.weight", (D,), "ones")
        yield TensorSpec(a + "k_norm.weight", (D,), "ones")


def _glm_tensors(d: dict, f: dict) -> Iterator[TensorSpec]:
    H = d["H"]
    yield TensorSpec("model.embed_tokens.weight", (d["V"], H), "random")
    for layer in range(d["L"]):
        p = f"model.layers.{layer}."
        yield TensorSpec(p + "input_layernorm.weight", (H,), "ones")
        yield from _gqa_tensors(p, d, f["head_dim"], f["attention_bias"], False, f["use_qk_norm"])
        yield TensorSpec(p + "post_attention_layernorm.weight", (H,), "ones")
        yield from _moe_block(p, d, f, layer)
    yield TensorSpec("model.norm.weight", (H,), "ones")
    yield TensorSpec("lm_head.weight", (d["V"], H), "random", HEAD)


def _gpt_oss_tensors(d: dict, f: dict) -> Iterator[TensorSpec]:
    """GPT-OSS: experts fused over [E, ...]; in MXFP4 (d["rows_out"]) drawn [E, out, in]
    so that the encoder sees rows of outputs, else [E, in, out] as transformers stores
    the plain floats."""
    H, I, E, Nq = d["H"], d["I"], d["E"], d["Nq"]
    yield TensorSpec("model.embed_tokens.weight", (d["V"], H), "random")
    for layer in range(d["L"]):
        p = f"model.layers.{layer}."
        m = p + "mlp."
        yield TensorSpec(p + "input_layernorm.weight", (H,), "ones")
        yield from _gqa_tensors(p, d, f["head_dim"], f["attention_bias"], f["attention_bias"], False)
        yield TensorSpec(p + "self_attn.sinks", (Nq,), "random")
        yield TensorSpec(p + "post_attention_layernorm.weight", (H,), "ones")
        yield TensorSpec(m + "router.weight", (E, H), "random", ROUTER)
        yield TensorSpec(m + "router.bias", (E,), "random")
        gate_up, down = ((E, 2 * I, H), (E, H, I)) if d.get("rows_out") else ((E, H, 2 * I), (E, I, H))
        yield TensorSpec(m + "experts.gate_up_proj", gate_up, "random", EXPERT)
        yield TensorSpec(m + "experts.gate_up_proj_bias", (E, 2 * I), "random")
        yield TensorSpec(m + "experts.down_proj", down, "random", EXPERT)
        yield TensorSpec(m + "experts.down_proj_bias", (E, H), "random")
    yield TensorSpec("model.norm.weight", (H,), "ones")
    yield TensorSpec("lm_head.weight", (d["V"], H), "random", HEAD)


_FRONTIER_TENSORS = {"deepseek_v3": _deepseek_tensors, "glm4_moe": _glm_tensors,
                     "gpt_oss": _gpt_oss_tensors}
