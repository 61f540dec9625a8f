"""config.json of DeepSeek-V3, Kimi K2, GLM-4.5 and GPT-OSS as the Hub checkpoints and
transformers 5 write them: every field moed reads, with transformers as the oracle for
what each means (its config classes for the defaults, its RoPE initialisers for the
frequencies and YaRN's attention factor, its attention modules for the softmax scale)."""
import copy
import json

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ext.models.config import (ConfigError, MissingConfigFieldError, UnsupportedConfigError,
                               load_config, parse_config)
from ext.models.families import FAMILIES, kv_bytes_per_token
from ext.models.mla import LatentAttention
from ext.models.rope import rope_frequencies

# Abridged copies of the published config.json files (the keys moed reads, verbatim).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "bos_token_id": 0,
    "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280}
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "n_routed_experts": 384, "n_group": 1,
           "topk_group": 1, "first_k_dense_replace": 1, "num_attention_heads": 64,
           "num_key_value_heads": 64, "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
           "max_position_embeddings": 131072, "vocab_size": 163840,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                            "type": "yarn"}}
GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "eos_token_id": [151329, 151336, 151338],
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5,
    "intermediate_size": 10944, "max_position_embeddings": 131072, "model_type": "glm4_moe",
    "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
    "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "use_qk_norm": False,
    "vocab_size": 151552}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"],
                            "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088}
HUB = {"deepseek-ai/DeepSeek-V3": DEEPSEEK_V3, "moonshotai/Kimi-K2-Instruct": KIMI_K2,
       "zai-org/GLM-4.5-Air": GLM_45_AIR, "openai/gpt-oss-20b": GPT_OSS_20B}


def _transformers_config(raw: dict, tmp_path):
    """transformers' own reading of `raw` (Kimi K2 under the deepseek_v3 name it maps to)."""
    raw = {**raw, "model_type": "deepseek_v3"} if raw["model_type"] == "kimi_k2" else raw
    raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return transformers.AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("repo", sorted(HUB))
def test_hub_configs_read_as_transformers_reads_them(tmp_path, repo):
    raw = HUB[repo]
    cfg = parse_config(copy.deepcopy(raw), "/m/config.json")
    tf = _transformers_config(raw, tmp_path)
    assert cfg.num_hidden_layers == tf.num_hidden_layers and cfg.vocab_size == tf.vocab_size
    assert cfg.num_experts == tf.num_local_experts and cfg.top_k == tf.num_experts_per_tok
    assert cfg.rms_norm_eps == tf.rms_norm_eps
    assert cfg.max_position_embeddings == tf.max_position_embeddings
    # RoPE: the frequencies and YaRN's cos/sin factor as transformers computes them.
    rope_type = tf.rope_parameters["rope_type"]
    init = ROPE_INIT_FUNCTIONS[rope_type] if rope_type != "default" else None
    dim = cfg.rotary_dim or cfg.head_dim
    inv_freq, factor = rope_frequencies(cfg.rope_theta, dim, cfg.rope_scaling)
    if init is None:
        partial = tf.rope_parameters.get("partial_rotary_factor", 1.0)
        d = int((getattr(tf, "head_dim", None) or tf.hidden_size // tf.num_attention_heads) * partial)
        want = 1.0 / (tf.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        want_factor = 1.0
    else:
        want, want_factor = init(tf)
    np.testing.assert_allclose(inv_freq, want.numpy(), rtol=2e-6)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    if tf.model_type == "deepseek_v3":
        attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(tf, 0)
        assert LatentAttention(cfg, 1, 1).scale == pytest.approx(attention.scaling, rel=1e-12)
        m = cfg.mla
        assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
            tf.q_lora_rank, tf.kv_lora_rank, tf.qk_nope_head_dim, tf.qk_rope_head_dim, tf.v_head_dim)
        assert cfg.rope_interleave is True
    if tf.model_type in ("deepseek_v3", "glm4_moe"):
        assert (cfg.n_group, cfg.topk_group) == (tf.n_group, tf.topk_group)
        assert cfg.routed_scaling_factor == tf.routed_scaling_factor
        assert cfg.moe_layers == tuple(l >= tf.first_k_dense_replace for l in range(tf.num_hidden_layers))
        assert cfg.shared_expert_intermediate_size == tf.moe_intermediate_size * tf.n_shared_experts
        assert cfg.num_nextn_predict_layers == 1
    if tf.model_type == "gpt_oss":
        assert cfg.sliding_windows == tuple(tf.sliding_window if t == "sliding_attention" else None
                                            for t in tf.layer_types)
        assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (tf.swiglu_limit, tf.swiglu_alpha)
        assert cfg.attention_sinks and cfg.o_bias and cfg.router_bias
    if tf.model_type == "glm4_moe":
        assert cfg.rotary_dim == 64 and cfg.qkv_bias and cfg.qk_norm == "none"


def test_published_values_spelled_out():
    ds = parse_config(copy.deepcopy(DEEPSEEK_V3))
    assert (ds.num_experts, ds.top_k, ds.head_dim, ds.num_key_value_heads) == (256, 8, 192, 128)
    assert ds.rope_scaling.factor == 40 and ds.rope_scaling.mscale_all_dim == 1.0
    assert ds.quantization.weight_block_size == (128, 128)
    # 61 layers x (512 + 64) floats: the compressed cache; expanded K and V: 128 heads x (192 + 128)
    assert kv_bytes_per_token(ds) == 61 * 576 * 4
    kimi = parse_config(copy.deepcopy(KIMI_K2))
    assert kimi.model_type == "kimi_k2" and FAMILIES["kimi_k2"] is FAMILIES["deepseek_v3"]
    assert (kimi.num_experts, kimi.routed_scaling_factor, kimi.n_group) == (384, 2.827, 1)
    gpt = parse_config(copy.deepcopy(GPT_OSS_20B))
    assert gpt.sliding_windows[:3] == (128, None, 128) and gpt.head_dim == 64
    assert gpt.rope_scaling.truncate is False and gpt.quantization.quant_method == "mxfp4"
    glm = parse_config(copy.deepcopy(GLM_45_AIR))
    assert glm.eos_token_ids == (151329, 151336, 151338) and glm.rope_theta == 1e6


def test_transformers_5_writes_are_read_too(tmp_path):
    for i, tf in enumerate([
            transformers.DeepseekV3Config(q_lora_rank=None, n_group=2, topk_group=1, n_routed_experts=16,
                                          hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                          num_hidden_layers=3, first_k_dense_replace=1),
            transformers.Glm4MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, use_qk_norm=True, num_hidden_layers=2),
            transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=3, sliding_window=16)]):
        d = tmp_path / str(i)
        tf.save_pretrained(d)
        cfg = load_config(d)
        if tf.model_type == "deepseek_v3":
            assert cfg.mla.q_lora_rank is None and cfg.moe_layers == (False, True, True)
            assert cfg.rope_scaling is None
        if tf.model_type == "glm4_moe":
            assert cfg.rotary_dim == 8 and cfg.qk_norm == "head"
        if tf.model_type == "gpt_oss":
            assert cfg.sliding_windows == (16, None, 16) and cfg.rope_scaling.factor == 32.0


@pytest.mark.parametrize("raw, error, field", [
    ({**DEEPSEEK_V3, "n_group": 6}, ConfigError, "n_group"),
    ({**DEEPSEEK_V3, "topk_group": 9}, ConfigError, "topk_group"),
    ({**DEEPSEEK_V3, "n_group": 256, "topk_group": 4}, ConfigError, "n_group"),
    ({**DEEPSEEK_V3, "num_experts_per_tok": 200}, ConfigError, "num_experts_per_tok"),
    ({**DEEPSEEK_V3, "num_key_value_heads": 64}, UnsupportedConfigError, "num_key_value_heads"),
    ({**DEEPSEEK_V3, "qk_rope_head_dim": 63}, UnsupportedConfigError, "qk_rope_head_dim"),
    ({k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}, MissingConfigFieldError, "kv_lora_rank"),
    ({**DEEPSEEK_V3, "routed_scaling_factor": -1.0}, ConfigError, "routed_scaling_factor"),
    ({**DEEPSEEK_V3, "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "type": "longrope"}},
     UnsupportedConfigError, "rope_scaling.rope_type"),
    ({**DEEPSEEK_V3, "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": "big"}},
     ConfigError, "rope_scaling.factor"),
    ({**GLM_45_AIR, "partial_rotary_factor": 1.5}, ConfigError, "partial_rotary_factor"),
    ({**GPT_OSS_20B, "swiglu_limit": 0.0}, ConfigError, "swiglu_limit"),
    ({**GPT_OSS_20B, "layer_types": ["sliding_attention"] * 3}, ConfigError, "layer_types"),
    ({**GPT_OSS_20B, "sliding_window": -4}, ConfigError, "sliding_window"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_fields_are_named(raw, error, field):
    with pytest.raises(ConfigError) as info:
        parse_config(copy.deepcopy(raw), "/m/config.json")
    assert type(info.value) is error and info.value.field == field
    assert "/m/config.json" in str(info.value)


def test_absent_q_lora_rank_is_the_class_default_and_null_means_q_proj():
    raw = {k: v for k, v in DEEPSEEK_V3.items() if k != "q_lora_rank"}
    assert parse_config(raw).mla.q_lora_rank == transformers.DeepseekV3Config().q_lora_rank == 1536
    assert parse_config({**DEEPSEEK_V3, "q_lora_rank": None}).mla.q_lora_rank is None
