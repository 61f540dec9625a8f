"""Tests for ext.makemodel: layout, determinism, and loading with transformers."""

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from ext.makemodel import ARCHITECTURES, build_tokenizer, make_model
from ext.tokenizer import Tokenizer, stop_token_ids

TINY = dict(layers=2, experts=4, top_k=2, hidden=32, intermediate=16)


def _tensors(model_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def _file_digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_transformers_loads_without_missing_or_unexpected_keys(tmp_path, arch, dtype):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    extra = dict(head_dim=16) if arch == "qwen3_moe" else {}  # Nq * D != H is legal here
    model_dir = make_model(tmp_path / arch, arch=arch, dtype=dtype, shard_size=20_000,
                           seed=3, **TINY, **extra)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True)
    assert {k: list(v) for k, v in info.items()} == {
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}

    config = model.config
    assert config.model_type == arch
    assert config.num_hidden_layers == 2
    assert config.hidden_size == 32
    assert config.num_experts_per_tok == 2
    assert config.vocab_size == 512
    assert config.tie_word_embeddings is False
    if arch in ("mixtral", "qwen3_moe"):
        assert config.num_local_experts == 4
    if arch != "mixtral":
        assert config.num_experts == 4
    if arch in ("qwen2_moe", "qwen3_moe"):
        assert config.moe_intermediate_size == 16
    else:
        assert config.intermediate_size == 16
    if arch == "qwen2_moe":
        assert config.shared_expert_intermediate_size == 64
    if arch == "qwen3_moe":
        assert config.head_dim == 16
    if arch != "mixtral":
        assert config.norm_topk_prob is (arch == "qwen3_moe")
    assert config.rope_parameters["rope_theta"] == (1e4 if arch == "olmoe" else 1e6)

    # The loaded parameters are the file's values, not a fresh initialisation.
    stored = _tensors(model_dir)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.input_layernorm.weight"):
        expected = stored[name].astype(np.float32)
        np.testing.assert_array_equal(model.state_dict()[name].numpy(), expected)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7, 300]])).logits
    assert logits.shape == (1, 4, 512)
    assert torch.isfinite(logits).all()

    generation = transformers.GenerationConfig.from_pretrained(model_dir)
    assert generation.eos_token_id == [2, 0]


def test_tensor_names_and_shapes(tmp_path):
    qwen2 = _tensors(make_model(tmp_path / "q2", arch="qwen2_moe", **TINY))
    assert qwen2["model.layers.0.mlp.gate.weight"].shape == (4, 32)
    assert qwen2["model.layers.1.mlp.experts.3.gate_proj.weight"].shape == (16, 32)
    assert qwen2["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (32, 16)
    assert qwen2["model.layers.0.mlp.shared_expert.up_proj.weight"].shape == (64, 32)
    assert qwen2["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 32)
    assert qwen2["model.layers.0.self_attn.k_proj.bias"].shape == (16,)  # 2 kv heads * 8
    olmoe = _tensors(make_model(tmp_path / "ol", arch="olmoe", **TINY))
    assert olmoe["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert olmoe["model.layers.0.self_attn.k_norm.weight"].shape == (16,)
    mixtral = _tensors(make_model(tmp_path / "mx", arch="mixtral", **TINY))
    assert mixtral["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, 32)
    assert mixtral["model.layers.0.block_sparse_moe.experts.2.w2.weight"].shape == (32, 16)
    assert len(mixtral) == 1 + 2 * (2 + 4 + 1 + 4 * 3) + 2
    assert len(qwen2) == 1 + 2 * (2 + 7 + 1 + 4 * 3 + 4) + 2


def test_multi_shard_index_is_consistent(tmp_path):
    shard_size = 20_000
    model_dir = make_model(tmp_path / "m", arch="qwen3_moe", shard_size=shard_size, **TINY)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(model_dir.glob("*.safetensors"))
    n = len(shards)
    assert n > 2
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (model_dir / "model.safetensors").exists()
    seen, total_size, total_params = {}, 0, 0
    for path in shards:
        data_bytes = 0
        with safe_open(path, "np") as f:
            names = list(f.keys())
            for name in names:
                tensor = f.get_tensor(name)
                assert tensor.dtype == ml_dtypes.bfloat16
                seen[name] = path.name
                data_bytes += tensor.nbytes
                total_params += tensor.size
        assert data_bytes <= shard_size or len(names) == 1  # an oversized tensor sits alone
        total_size += data_bytes
    assert seen == index["weight_map"]
    assert index["metadata"] == {"total_size": total_size, "total_parameters": total_params}
    assert list(index["weight_map"]) == sorted(index["weight_map"])


def test_single_shard_when_everything_fits(tmp_path):
    model_dir = make_model(tmp_path / "m", arch="olmoe", **TINY)
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]


def test_safetensors_header_is_aligned_and_valid(tmp_path):
    model_dir = make_model(tmp_path / "m", arch="mixtral", **TINY)
    raw = (model_dir / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert header_len % 8 == 0
    header = json.loads(raw[8:8 + header_len])
    assert header.pop("__metadata__") == {"format": "pt"}
    ends = sorted(entry["data_offsets"] for entry in header.values())
    assert ends[0][0] == 0 and ends[-1][1] == len(raw) - 8 - header_len
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))


def test_same_seed_is_byte_identical_and_bf16_is_rounded_f32(tmp_path):
    args = dict(arch="qwen2_moe", shard_size=30_000, **TINY)
    a = make_model(tmp_path / "a", seed=11, **args)
    b = make_model(tmp_path / "b", seed=11, **args)
    c = make_model(tmp_path / "c", seed=12, **args)
    f32 = make_model(tmp_path / "f32", seed=11, dtype="f32", **args)
    assert _file_digests(a) == _file_digests(b)
    ta, tc, tf = _tensors(a), _tensors(c), _tensors(f32)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert not np.array_equal(ta[name], tc[name])
    assert tf[name].dtype == np.float32
    for key in ta:
        np.testing.assert_array_equal(ta[key], tf[key].astype(ml_dtypes.bfloat16))
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_tensor_values_do_not_depend_on_model_size(tmp_path):
    small = _tensors(make_model(tmp_path / "s", arch="qwen3_moe", **{**TINY, "layers": 1}))
    large = _tensors(make_model(tmp_path / "l", arch="qwen3_moe", **{**TINY, "layers": 3}))
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    np.testing.assert_array_equal(small[name], large[name])


def test_weight_statistics(tmp_path):
    model_dir = make_model(tmp_path / "m", arch="qwen3_moe", dtype="f32", seed=0,
                           initializer_range=0.05, layers=1, experts=2, top_k=1,
                           hidden=128, intermediate=256)
    tensors = _tensors(model_dir)
    w = tensors["model.layers.0.mlp.experts.0.gate_proj.weight"]  # 32768 values
    bound = 0.05 * math.sqrt(3)
    assert np.abs(w).max() <= bound
    assert abs(float(w.std()) - 0.05) < 0.001
    assert abs(float(w.mean())) < 0.001
    np.testing.assert_array_equal(tensors["model.norm.weight"], np.ones(128, np.float32))
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_norm.weight"], np.ones(64, np.float32))


def test_default_heads_and_config_keys(tmp_path):
    model_dir = make_model(tmp_path / "m", arch="qwen3_moe", layers=1, experts=2, top_k=1,
                           hidden=256, intermediate=64, vocab_size=600)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 640
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 1e6
    assert config["rope_parameters"]["rope_type"] == "default"
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["norm_topk_prob"] is True
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert config["eos_token_id"] == 2 and config["bos_token_id"] == 0
    mixtral = json.loads((make_model(tmp_path / "x", arch="mixtral", **TINY) / "config.json").read_text())
    assert mixtral["num_local_experts"] == 4 and "num_experts" not in mixtral
    assert "moe_intermediate_size" not in mixtral and mixtral["intermediate_size"] == 16


def test_tokenizer_files_work_with_ext_tokenizer(tmp_path):
    model_dir = make_model(tmp_path / "m", arch="olmoe", **TINY)
    tok = Tokenizer.from_model_dir(model_dir)
    assert tok.vocab_size == 512
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert stop_token_ids(model_dir) == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} == {2, 0}


def test_tokenizer_training_is_deterministic_across_processes():
    code = ("import hashlib; from ext.makemodel import build_tokenizer; "
            "print(hashlib.sha256(build_tokenizer(700).to_str().encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert out == hashlib.sha256(build_tokenizer(700).to_str().encode()).hexdigest()


def test_progress_reports_every_byte(tmp_path):
    calls = []
    model_dir = make_model(tmp_path / "m", arch="mixtral", shard_size=20_000,
                           progress=lambda done, total: calls.append((done, total)), **TINY)
    total = json.loads((model_dir / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert calls[-1] == (total, total)
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and dones[0] > 0
    assert {t for _, t in calls} == {total}


def test_existing_checkpoint_needs_overwrite(tmp_path):
    make_model(tmp_path, arch="olmoe", shard_size=20_000, **TINY)
    with pytest.raises(FileExistsError, match="already holds a checkpoint.*--force"):
        make_model(tmp_path, arch="olmoe", **TINY)
    make_model(tmp_path, arch="olmoe", overwrite=True, **TINY)  # now fits one shard
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(arch="llama"), "arch"),
    (dict(dtype="int8"), "dtype"),
    (dict(top_k=5), "top_k"),
    (dict(layers=0), "layers"),
    (dict(heads=4, kv_heads=3), "kv_heads"),
    (dict(head_dim=16), "head_dim"),
    (dict(shared_intermediate=8), "shared_intermediate"),
    (dict(vocab_size=100), "vocab_size"),
])
def test_invalid_arguments(tmp_path, kwargs, message):
    args = {"arch": "mixtral", **TINY, **kwargs}
    with pytest.raises(ValueError, match=message):
        make_model(tmp_path, **args)


def test_build_tokenizer_reaches_requested_size():
    tok = build_tokenizer(512)
    assert tok.get_vocab_size() == 512
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
