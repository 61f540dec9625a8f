"""make-model for DeepSeek-V3, GLM-4.5 and GPT-OSS: the layouts transformers 5 writes
(and the published releases ship), loaded by transformers without missing or
unexpected keys, with make-model's family fields and their overrides."""
import json
from pathlib import Path

import pytest
import torch
import transformers
from checkpoint_files import headers

from ext.makemodel import make_model

FRONTIER = ("deepseek_v3", "glm4_moe", "gpt_oss")
SMALL = dict(layers=3, experts=8, top_k=2, hidden=64, intermediate=32, heads=4, vocab_size=300)


def _load(model_dir: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True)
    return model, {k: list(v) for k, v in info.items()}


@pytest.mark.parametrize("arch, dtype", [(a, d) for a in FRONTIER for d in ("f32", "bf16")]
                         + [("deepseek_v3", "fp8"), ("glm4_moe", "fp8"), ("gpt_oss", "mxfp4")])
def test_transformers_loads_every_tensor(tmp_path, arch, dtype):
    model_dir = make_model(tmp_path / "m", arch=arch, dtype=dtype, shard_size=40_000, seed=1, **SMALL)
    assert len(list(model_dir.glob("*.safetensors"))) >= 3
    model, info = _load(model_dir)
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    assert type(model).__name__ == {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                                    "gpt_oss": "GptOssForCausalLM"}[arch]
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7, 200]])).logits
    assert torch.isfinite(logits).all()


def test_deepseek_v3_shapes_follow_the_published_ratios(tmp_path):
    # head_dim 128 gives DeepSeek-V3's own MLA sizes: a 576-row kv_a_proj_with_mqa.
    d = make_model(tmp_path / "m", arch="deepseek_v3", layers=2, experts=16, top_k=4, hidden=1024,
                   intermediate=64, heads=8, vocab_size=300)
    h = headers(d)
    config = json.loads((d / "config.json").read_text())
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_nope_head_dim"],
            config["qk_rope_head_dim"], config["v_head_dim"]) == (1536, 512, 128, 64, 128)
    assert (config["n_group"], config["topk_group"], config["first_k_dense_replace"]) == (8, 4, 1)
    assert config["num_key_value_heads"] == config["num_attention_heads"] == 8
    a = "model.layers.1.self_attn."
    assert h[a + "kv_a_proj_with_mqa.weight"]["shape"] == [576, 1024]
    assert h[a + "kv_b_proj.weight"]["shape"] == [8 * 256, 512]
    assert h[a + "q_b_proj.weight"]["shape"] == [8 * 192, 1536]
    assert h["model.layers.1.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"   # as published
    assert "model.layers.0.mlp.gate_proj.weight" in h and "model.layers.0.mlp.gate.weight" not in h
    assert h["model.layers.1.mlp.shared_experts.down_proj.weight"]["shape"] == [1024, 64]


def test_fp8_keeps_partial_blocks_of_the_576_row_projection(tmp_path):
    d = make_model(tmp_path / "m", arch="deepseek_v3", dtype="fp8", layers=2, experts=16, top_k=4,
                   hidden=1024, intermediate=128, heads=8, vocab_size=300)
    h = headers(d)
    kv_a = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert h[kv_a]["dtype"] == "F8_E4M3" and h[kv_a + "_scale_inv"]["shape"] == [5, 8]   # 576 = 4.5 x 128
    assert h["model.layers.1.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"
    assert h["model.layers.1.mlp.gate.weight"]["dtype"] == "BF16"


def test_options_change_the_tensors_and_unknown_ones_are_refused(tmp_path):
    d = make_model(tmp_path / "m", arch="deepseek_v3", options={"q_lora_rank": None, "n_group": 4,
                                                                  "topk_group": 2}, **SMALL)
    h = headers(d)
    assert "model.layers.1.self_attn.q_proj.weight" in h
    assert not any("q_a_proj" in n for n in h)
    config = json.loads((d / "config.json").read_text())
    assert config["q_lora_rank"] is None and (config["n_group"], config["topk_group"]) == (4, 2)
    with pytest.raises(ValueError, match="no config field 'kv_heads'"):
        make_model(tmp_path / "x", arch="deepseek_v3", options={"kv_heads": 2}, **SMALL)
    with pytest.raises(ValueError, match="cannot route"):
        make_model(tmp_path / "y", arch="deepseek_v3", options={"n_group": 8, "topk_group": 4}, **SMALL)
    with pytest.raises(ValueError, match="options apply to"):
        make_model(tmp_path / "z", arch="qwen3_moe", options={"n_group": 2}, **SMALL)
    with pytest.raises(ValueError, match="kv_heads"):
        make_model(tmp_path / "w", arch="deepseek_v3", **{**SMALL, "heads": 4}, kv_heads=2)


def test_gpt_oss_layouts(tmp_path):
    plain = headers(make_model(tmp_path / "b", arch="gpt_oss", **SMALL))
    e = "model.layers.0.mlp.experts."
    assert plain[e + "gate_up_proj"]["shape"] == [8, 64, 64]        # [E, H, 2I]: in, out
    assert plain[e + "down_proj"]["shape"] == [8, 32, 64]           # [E, I, H]
    assert plain[e + "gate_up_proj_bias"]["shape"] == [8, 64]
    assert plain["model.layers.0.self_attn.sinks"]["shape"] == [4]
    assert plain["model.layers.0.mlp.router.bias"]["shape"] == [8]
    mx = make_model(tmp_path / "q", arch="gpt_oss", dtype="mxfp4", **SMALL)
    q = headers(mx)
    assert q[e + "gate_up_proj_blocks"] == {**q[e + "gate_up_proj_blocks"], "dtype": "U8",
                                            "shape": [8, 64, 2, 16]}            # [E, 2I, H/32, 16]
    assert q[e + "down_proj_scales"]["shape"] == [8, 64, 1]                      # [E, H, I/32]
    assert e + "gate_up_proj" not in q and q[e + "gate_up_proj_bias"]["dtype"] == "BF16"
    quant = json.loads((mx / "config.json").read_text())["quantization_config"]
    assert quant == {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with pytest.raises(ValueError, match="MXFP4"):
        make_model(tmp_path / "f", arch="gpt_oss", dtype="fp8", **SMALL)
