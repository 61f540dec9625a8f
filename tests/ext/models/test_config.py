"""Tests for ext/models/config.py: config.json as transformers 5 writes it and as Hub checkpoints do.

The oracle is transformers itself: a config built with its classes (or read back from
the same file with `AutoConfig`) gives the expected value of every ModelConfig field,
using the expressions of the transformers 5 modeling code (head_dim, MoE layer choice,
sliding-window layer types). Hub-style dicts are abridged copies of the published
config.json files, with the keys moed reads kept verbatim.
"""

import json

import pytest
import transformers

from ext.models.config import (ConfigError, MissingConfigFieldError, UnsupportedConfigError,
                               UnsupportedModelError, load_config, parse_config)

# --------------------------------------------------------------- fixtures

# Small transformers 5 configs, each with non-default values so a field that is
# ignored or read under the wrong name shows up.
TF_CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[0, 3],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-5,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=[2, 3]),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        shared_expert_intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2,
        use_sliding_window=True, sliding_window=32, max_window_layers=4,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5}, tie_word_embeddings=True,
        max_position_embeddings=1024, eos_token_id=7),
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, num_local_experts=6, num_experts_per_tok=2,
        sliding_window=128, rope_parameters={"rope_type": "default", "rope_theta": 2e5},
        rms_norm_eps=1e-6, max_position_embeddings=512),
    "olmoe": lambda: transformers.OlmoeConfig(
        vocab_size=1000, hidden_size=48, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, num_experts=8, num_experts_per_tok=3,
        clip_qkv=8.0, max_position_embeddings=256, norm_topk_prob=True),
}

# As published on the Hub (transformers 4.x writers): top-level rope_theta, rope_scaling.
HUB_CONFIGS = {
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
    "mistralai/Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
        "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000},
    "allenai/OLMoE-1B-7B-0924": {
        "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "clip_qkv": None, "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 1024, "max_position_embeddings": 4096,
        "model_type": "olmoe", "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16,
        "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0", "use_cache": True,
        "vocab_size": 50304},
    "Qwen/Qwen1.5-MoE-A2.7B": {
        "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192,
        "max_window_layers": 21, "model_type": "qwen2_moe", "moe_intermediate_size": 1408,
        "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
        "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 5632,
        "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.0.dev0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936},
}


def _minimal(model_type, **overrides):
    """The fields a config of the family needs, small, plus overrides (None deletes)."""
    raw = {"model_type": model_type, "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
           "num_experts_per_tok": 2, "num_local_experts" if model_type == "mixtral" else "num_experts": 4}
    if model_type in ("qwen2_moe", "qwen3_moe"):
        raw["moe_intermediate_size"] = 16
    if model_type == "qwen2_moe":
        raw["shared_expert_intermediate_size"] = 48
    for key, value in overrides.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def _write(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def _expected(c, n_layers=None):
    """Every ModelConfig field from a transformers config object, as its modeling code reads it."""
    mt = c.model_type
    n = c.num_hidden_layers
    qwen = mt in ("qwen2_moe", "qwen3_moe")
    if mt == "qwen2_moe":
        windows = tuple(c.sliding_window if t == "sliding_attention" else None for t in c.layer_types)
    elif mt == "olmoe":
        windows = (None,) * n
    else:  # mixtral, qwen3_moe: one window for every layer (None when off)
        windows = (c.sliding_window,) * n
    if qwen:
        moe = tuple(l not in c.mlp_only_layers and c.num_experts > 0
                    and (l + 1) % c.decoder_sparse_step == 0 for l in range(n))
    else:
        moe = (True,) * n
    return {
        "model_type": mt,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": n,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "num_experts": c.num_experts,  # attribute_map covers num_local_experts
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size if qwen else c.intermediate_size,
        "intermediate_size": c.intermediate_size,
        "shared_expert_intermediate_size": c.shared_expert_intermediate_size if mt == "qwen2_moe" else 0,
        "norm_topk_prob": getattr(c, "norm_topk_prob", True),  # Mixtral always renormalises
        "qkv_bias": c.qkv_bias if mt == "qwen2_moe" else False,
        "qk_norm": {"qwen3_moe": "head", "olmoe": "full"}.get(mt, "none"),
        "clip_qkv": getattr(c, "clip_qkv", None),
        "rope_theta": c.rope_parameters["rope_theta"],
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "sliding_windows": windows,
        "moe_layers": moe,
        "max_position_embeddings": c.max_position_embeddings,
    }


def _assert_matches(cfg, expected):
    got = {name: getattr(cfg, name) for name in expected}
    assert got == expected
    assert cfg.top_k == cfg.num_experts_per_tok
    assert len(cfg.sliding_windows) == len(cfg.moe_layers) == cfg.num_hidden_layers


def _raises(exc_type, raw_or_dir, *needles):
    """Assert `exc_type` exactly, and that the message names each needle and the file."""
    with pytest.raises(ConfigError) as info:
        if isinstance(raw_or_dir, dict):
            parse_config(raw_or_dir, "/models/m/config.json")
        else:
            load_config(raw_or_dir)
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    path = "/models/m/config.json" if isinstance(raw_or_dir, dict) else str(raw_or_dir / "config.json")
    assert path in message
    for needle in needles:
        assert needle in message
    return info.value


# ----------------------------------------------------- transformers 5 writers

@pytest.mark.parametrize("family", sorted(TF_CONFIGS))
def test_save_pretrained_config_matches_transformers(tmp_path, family):
    tf_config = TF_CONFIGS[family]()
    tf_config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written  # the v5 spelling
    cfg = load_config(tmp_path)
    _assert_matches(cfg, _expected(tf_config))
    # ... and so does what transformers reads back from the same file.
    _assert_matches(cfg, _expected(transformers.AutoConfig.from_pretrained(tmp_path)))


@pytest.mark.parametrize("family", sorted(TF_CONFIGS))
def test_to_dict_config_matches_transformers(family):
    tf_config = TF_CONFIGS[family]()
    _assert_matches(parse_config(tf_config.to_dict()), _expected(tf_config))


def test_transformers_configs_values_spelled_out():
    """The oracle above, pinned to literal values for the cases that matter."""
    q3 = parse_config(TF_CONFIGS["qwen3_moe"]().to_dict())
    assert "num_local_experts" in TF_CONFIGS["qwen3_moe"]().to_dict()  # how v5 writes Qwen3-MoE
    assert (q3.num_experts, q3.head_dim, q3.norm_topk_prob, q3.rope_theta) == (16, 32, True, 1e6)
    assert q3.moe_layers == (False, True, True, False, True, True)
    assert q3.eos_token_ids == (2, 3) and q3.bos_token_id == 1 and q3.qk_norm == "head"
    q2 = parse_config(TF_CONFIGS["qwen2_moe"]().to_dict())
    assert q2.sliding_windows == (32, None, 32, None, None, None)
    assert q2.moe_layers == (False, True, False, True, False, True)
    assert (q2.shared_expert_intermediate_size, q2.qkv_bias, q2.norm_topk_prob) == (48, True, False)
    assert q2.eos_token_ids == (7,) and q2.tie_word_embeddings
    mx = parse_config(TF_CONFIGS["mixtral"]().to_dict())
    assert (mx.num_experts, mx.head_dim, mx.norm_topk_prob) == (6, 16, True)
    assert mx.sliding_windows == (128, 128, 128) and mx.moe_intermediate_size == 96
    ol = parse_config(TF_CONFIGS["olmoe"]().to_dict())
    assert (ol.clip_qkv, ol.qk_norm, ol.head_dim, ol.sliding_windows) == (8.0, "full", 8, (None, None))


# ----------------------------------------------------------- Hub writers

@pytest.mark.parametrize("repo", sorted(HUB_CONFIGS))
def test_hub_config_matches_transformers(tmp_path, repo):
    cfg = load_config(_write(tmp_path, HUB_CONFIGS[repo]))
    _assert_matches(cfg, _expected(transformers.AutoConfig.from_pretrained(tmp_path)))


def test_hub_configs_values_spelled_out(tmp_path):
    q3 = parse_config(HUB_CONFIGS["Qwen/Qwen3-30B-A3B"])
    # head_dim 128 is not hidden_size / heads (64); norm_topk_prob true; top-level rope_theta.
    assert (q3.head_dim, q3.norm_topk_prob, q3.rope_theta, q3.num_experts) == (128, True, 1e6, 128)
    assert q3.sliding_windows == (None,) * 48 and all(q3.moe_layers)
    assert (q3.bos_token_id, q3.eos_token_ids, q3.qkv_bias) == (151643, (151645,), False)
    mx = parse_config(HUB_CONFIGS["mistralai/Mixtral-8x7B-v0.1"])
    assert (mx.num_experts, mx.top_k, mx.norm_topk_prob, mx.rope_theta) == (8, 2, True, 1e6)
    assert (mx.head_dim, mx.num_key_value_heads, mx.moe_intermediate_size) == (128, 8, 14336)
    ol = parse_config(HUB_CONFIGS["allenai/OLMoE-1B-7B-0924"])
    assert (ol.num_experts, ol.norm_topk_prob, ol.rope_theta, ol.clip_qkv) == (64, False, 1e4, None)
    assert ol.bos_token_id is None and ol.eos_token_ids == (50279,)
    q2 = parse_config(HUB_CONFIGS["Qwen/Qwen1.5-MoE-A2.7B"])
    assert (q2.qkv_bias, q2.rope_theta, q2.shared_expert_intermediate_size) == (True, 1e6, 5632)
    assert q2.sliding_windows == (None,) * 24  # sliding_window set, use_sliding_window false


# ------------------------------------------------------------------ defaults

@pytest.mark.parametrize("family, tf_class", [
    ("qwen2_moe", transformers.Qwen2MoeConfig),
    ("qwen3_moe", transformers.Qwen3MoeConfig),
    ("olmoe", transformers.OlmoeConfig),
])
def test_norm_topk_prob_defaults_to_the_class_default(family, tf_class):
    assert tf_class().norm_topk_prob is False
    assert parse_config(_minimal(family)).norm_topk_prob is False
    assert parse_config(_minimal(family, norm_topk_prob=True)).norm_topk_prob is True


@pytest.mark.parametrize("value", [None, False, True])
def test_mixtral_always_renormalises(value):
    raw = _minimal("mixtral") if value is None else _minimal("mixtral", norm_topk_prob=value)
    assert parse_config(raw).norm_topk_prob is True


def test_defaults_for_absent_optional_fields():
    cfg = parse_config(_minimal("qwen3_moe"))
    assert cfg.head_dim == 32 // 4
    assert cfg.rope_theta == transformers.Qwen3MoeConfig().rope_parameters["rope_theta"]
    assert cfg.rms_norm_eps == transformers.Qwen3MoeConfig().rms_norm_eps
    assert cfg.moe_layers == (True,) * 4 and cfg.sliding_windows == (None,) * 4
    assert cfg.eos_token_ids == () and cfg.bos_token_id is None and not cfg.tie_word_embeddings
    mx = parse_config(_minimal("mixtral", num_key_value_heads=None))
    assert mx.num_key_value_heads == mx.num_attention_heads
    assert mx.rope_theta == transformers.MixtralConfig().rope_parameters["rope_theta"] == 1e6
    assert mx.rms_norm_eps == transformers.MixtralConfig().rms_norm_eps


@pytest.mark.parametrize("family, name", [
    ("qwen3_moe", "num_experts"), ("qwen3_moe", "num_local_experts"),
    ("qwen2_moe", "num_experts"), ("qwen2_moe", "num_local_experts"),
    ("olmoe", "num_experts"), ("olmoe", "num_local_experts"),
    ("mixtral", "num_local_experts"), ("mixtral", "num_experts"),
])
def test_num_experts_under_either_name(family, name):
    raw = _minimal(family, num_experts=None, num_local_experts=None)
    raw[name] = 12
    assert parse_config(raw).num_experts == 12


@pytest.mark.parametrize("family, name", [("qwen3_moe", "num_experts"), ("mixtral", "num_local_experts")])
def test_num_experts_missing_names_the_family_field(family, name):
    raw = _minimal(family, num_experts=None, num_local_experts=None)
    err = _raises(MissingConfigFieldError, raw, f"'{name}'")
    assert err.field == name


# ------------------------------------------------------------- sliding windows

@pytest.mark.parametrize("n_layers, max_window_layers, expected", [
    (6, 4, (64, None, 64, None, None, None)),
    (6, 0, (None,) * 6),
    (24, None, tuple(None if i % 2 else 64 for i in range(24))),  # absent: class default 28
    (8, 3, (64, None, 64, None, None, None, None, None)),
])
def test_qwen2_moe_windows_from_use_sliding_window_and_max_window_layers(
        n_layers, max_window_layers, expected):
    fields = dict(num_hidden_layers=n_layers, use_sliding_window=True, sliding_window=64)
    if max_window_layers is not None:
        fields["max_window_layers"] = max_window_layers
    cfg = parse_config(_minimal("qwen2_moe", **fields))  # Hub style: no layer_types
    assert cfg.sliding_windows == expected
    oracle = transformers.Qwen2MoeConfig(**fields)
    assert cfg.sliding_windows == tuple(64 if t == "sliding_attention" else None
                                        for t in oracle.layer_types)


def test_qwen2_moe_layer_types_win_over_the_pattern():
    layer_types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    cfg = parse_config(_minimal("qwen2_moe", use_sliding_window=True, sliding_window=16,
                                layer_types=layer_types, max_window_layers=4))
    assert cfg.sliding_windows == (None, 16, 16, None)
    off = parse_config(_minimal("qwen2_moe", use_sliding_window=False, sliding_window=16,
                                layer_types=layer_types))
    assert off.sliding_windows == (None,) * 4


@pytest.mark.parametrize("family, fields, expected", [
    ("mixtral", dict(sliding_window=4096), (4096,) * 4),
    ("mixtral", dict(sliding_window=None), (None,) * 4),
    ("mixtral", dict(sliding_window=4096, use_sliding_window=False), (4096,) * 4),
    ("qwen3_moe", dict(sliding_window=512, use_sliding_window=True), (512,) * 4),
    ("qwen3_moe", dict(sliding_window=4096, use_sliding_window=False), (None,) * 4),
    ("olmoe", dict(sliding_window=4096, use_sliding_window=True), (None,) * 4),
    ("qwen2_moe", dict(sliding_window=4096), (None,) * 4),  # use_sliding_window defaults off
])
def test_sliding_windows_per_family(family, fields, expected):
    assert parse_config(_minimal(family, **fields)).sliding_windows == expected


def test_sliding_window_of_wrong_type_is_rejected():
    err = _raises(ConfigError, _minimal("mixtral", sliding_window="4096"), "'sliding_window'", "'4096'")
    assert err.field == "sliding_window"
    _raises(ConfigError, _minimal("qwen2_moe", use_sliding_window=True, sliding_window=16,
                                  layer_types=["full_attention"] * 3), "'layer_types'")
    _raises(UnsupportedConfigError, _minimal("qwen2_moe", use_sliding_window=True, sliding_window=16,
                                             layer_types=["chunked_attention"] * 4),
            "'layer_types'", "chunked_attention")


# ------------------------------------------------------------------ MoE layers

@pytest.mark.parametrize("mlp_only_layers, step, expected", [
    ([], 1, (True, True, True, True, True, True)),
    ([0, 3], 1, (False, True, True, False, True, True)),
    ([], 2, (False, True, False, True, False, True)),
    ([1, 2], 3, (False, False, False, False, False, True)),
])
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_moe_layers_from_mlp_only_layers_and_decoder_sparse_step(family, mlp_only_layers, step, expected):
    fields = dict(num_hidden_layers=6, mlp_only_layers=mlp_only_layers, decoder_sparse_step=step)
    cfg = parse_config(_minimal(family, **fields))
    assert cfg.moe_layers == expected
    tf_class = {"qwen2_moe": transformers.Qwen2MoeConfig, "qwen3_moe": transformers.Qwen3MoeConfig}[family]
    assert cfg.moe_layers == _expected(tf_class(**fields))["moe_layers"]


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_every_layer_is_moe_for_mixtral_and_olmoe(family):
    cfg = parse_config(_minimal(family, mlp_only_layers=[0], decoder_sparse_step=2))
    assert cfg.moe_layers == (True,) * 4


def test_bad_moe_layer_fields():
    _raises(ConfigError, _minimal("qwen3_moe", mlp_only_layers=[4]), "'mlp_only_layers'", "4")
    _raises(ConfigError, _minimal("qwen3_moe", mlp_only_layers=[-1]), "'mlp_only_layers'")
    _raises(ConfigError, _minimal("qwen3_moe", mlp_only_layers=3), "'mlp_only_layers'", "expected list")
    _raises(ConfigError, _minimal("qwen2_moe", decoder_sparse_step=0), "'decoder_sparse_step'", "positive")


# --------------------------------------------------------------------- errors

@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "Mixtral"])
def test_unsupported_model_type(tmp_path, model_type):
    err = _raises(UnsupportedModelError, _write(tmp_path, _minimal(model_type)),
                  "'model_type'", repr(model_type), "config.json")
    assert err.field == "model_type"
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("family", sorted(TF_CONFIGS))
@pytest.mark.parametrize("name", ["hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "num_experts_per_tok", "vocab_size", "intermediate_size"])
def test_missing_required_field(tmp_path, family, name):
    err = _raises(MissingConfigFieldError, _write(tmp_path, _minimal(family, **{name: None})),
                  f"'{name}'", "missing", "config.json")
    assert err.field == name


def test_missing_family_specific_fields():
    _raises(MissingConfigFieldError, _minimal("qwen3_moe", moe_intermediate_size=None), "'moe_intermediate_size'")
    _raises(MissingConfigFieldError, _minimal("qwen2_moe", shared_expert_intermediate_size=None),
            "'shared_expert_intermediate_size'")
    # Mixtral's experts are intermediate_size wide; moe_intermediate_size is not needed.
    assert parse_config(_minimal("mixtral")).moe_intermediate_size == 64


@pytest.mark.parametrize("field, value", [
    ("hidden_size", "2048"),
    ("hidden_size", 2048.0),
    ("hidden_size", True),
    ("num_hidden_layers", 2.5),
    ("num_attention_heads", 0),
    ("num_key_value_heads", 3),  # does not divide 4 heads
    ("num_experts_per_tok", 5),  # more than 4 experts
    ("norm_topk_prob", "true"),
    ("norm_topk_prob", 1),
    ("tie_word_embeddings", "false"),
    ("rms_norm_eps", "1e-6"),
    ("rms_norm_eps", 0),
    ("rope_theta", "1e6"),
    ("rope_theta", -1.0),
    ("eos_token_id", "2"),
    ("eos_token_id", [1, "2"]),
    ("head_dim", "128"),
    ("max_position_embeddings", -5),
])
def test_bad_types_and_values_name_the_field(tmp_path, field, value):
    err = _raises(ConfigError, _write(tmp_path, _minimal("qwen3_moe", **{field: value})),
                  f"'{field}'", "config.json")
    assert err.field == field


def test_hidden_size_not_divisible_by_heads_without_head_dim():
    _raises(ConfigError, _minimal("olmoe", hidden_size=30), "'hidden_size'", "30")
    assert parse_config(_minimal("qwen3_moe", hidden_size=30, head_dim=8)).head_dim == 8


def test_odd_head_dim_is_unsupported():
    _raises(UnsupportedConfigError, _minimal("qwen3_moe", head_dim=7), "'head_dim'", "7")


@pytest.mark.parametrize("block, key", [
    ("rope_parameters", "rope_type"),  # transformers 5
    ("rope_scaling", "rope_type"),  # Hub, transformers >= 4.45
    ("rope_scaling", "type"),  # Hub, older
])
def test_yarn_rope_is_rejected_by_name(tmp_path, block, key):
    raw = _minimal("qwen3_moe", **{block: {key: "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32768}})
    err = _raises(UnsupportedConfigError, _write(tmp_path, raw), f"'{block}.rope_type'", "'yarn'")
    assert err.field == f"{block}.rope_type"


def test_yarn_rope_as_transformers_writes_it(tmp_path):
    transformers.Qwen3MoeConfig(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 32768}, max_position_embeddings=131072).save_pretrained(tmp_path)
    _raises(UnsupportedConfigError, tmp_path, "'rope_parameters.rope_type'", "'yarn'")


def test_default_rope_blocks_are_accepted():
    cfg = parse_config(_minimal("olmoe", rope_scaling={"type": "default"}, rope_theta=5e5))
    assert cfg.rope_theta == 5e5
    cfg = parse_config(_minimal("olmoe", rope_parameters={"rope_type": "default", "rope_theta": 3e5}))
    assert cfg.rope_theta == 3e5
    _raises(UnsupportedConfigError, _minimal("olmoe", rope_parameters={
        "rope_type": "default", "rope_theta": 3e5, "partial_rotary_factor": 0.5}),
        "'rope_parameters.partial_rotary_factor'")
    _raises(ConfigError, _minimal("olmoe", rope_scaling="yarn"), "'rope_scaling'")


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_other_activations_are_rejected(tmp_path, act):
    err = _raises(UnsupportedConfigError, _write(tmp_path, _minimal("mixtral", hidden_act=act)),
                  "'hidden_act'", repr(act))
    assert err.field == "hidden_act"


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_attention_bias_is_rejected_where_unsupported(family):
    _raises(UnsupportedConfigError, _minimal(family, attention_bias=True), "'attention_bias'")
    assert parse_config(_minimal(family, attention_bias=False)).qkv_bias is False


@pytest.mark.parametrize("content,message", [(b"{\"model_type\": \"mixtral\",", "invalid JSON"),
                                             (b"", "invalid JSON"), (b"\xff\xfe{}", "not UTF-8")])
def test_invalid_json_file(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    err = _raises(ConfigError, tmp_path, message)
    assert err.field is None and err.path == str(tmp_path / "config.json")


def test_json_that_is_not_an_object(tmp_path):
    _raises(ConfigError, _write(tmp_path, [1, 2]), "expected a JSON object")


def test_missing_file(tmp_path):
    err = _raises(ConfigError, tmp_path, "file not found")
    assert err.field is None
    _raises(ConfigError, tmp_path / "absent", "file not found")


def test_path_to_the_file_instead_of_the_directory(tmp_path):
    _write(tmp_path, _minimal("mixtral"))
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path / "config.json")
