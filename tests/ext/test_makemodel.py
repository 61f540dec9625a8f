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

from checkpoint_files import FullFile, headers, no_space

from ext.makemodel import ARCHITECTURES, build_tokenizer, make_model
from ext.tokenizer import Tokenizer, stop_token_ids

TINY = dict(layers=2, experts=4, top_k=2, hidden=32, intermediate=16)
# The families whose tests here spell out their per-module layout (the others:
# tests/ext/test_makemodel_frontier.py).
FIRST_FAMILIES = ARCHITECTURES[:4]


def _tensors(model_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def _file_digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.mark.parametrize("arch", FIRST_FAMILIES)
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
    # Qwen3's markers and Mixtral's <s> and </s>, added tokens, push the vocabulary to the
    # next multiple of 64
    assert config.vocab_size == (576 if arch in ("qwen3_moe", "mixtral") else 512)
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
    assert logits.shape == (1, 4, config.vocab_size)
    assert torch.isfinite(logits).all()

    generation = transformers.GenerationConfig.from_pretrained(model_dir)
    eos = {"mixtral": 513, "olmoe": 0}.get(arch, 2)     # </s>, <|endoftext|> or <|im_end|>
    assert generation.eos_token_id == ([0] if eos == 0 else [eos, 0]) and config.eos_token_id == eos


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
    model_dir = make_model(tmp_path / "m", arch="qwen2_moe", **TINY)
    tok = Tokenizer.from_model_dir(model_dir)
    assert tok.vocab_size == 512
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (    # Qwen1.5's default system
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert stop_token_ids(model_dir) == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} == {2, 0}


@pytest.mark.parametrize("arch, system, prompt, eos", [
    # the published templates (ext/makemodel/templates): Mixtral-Instruct refuses a system
    # message; OLMoE-Instruct's BOS and EOS are both <|endoftext|>
    ("mixtral", False, "<s>[INST] hi [/INST]ok</s>[INST] and? [/INST]", "</s>"),
    ("qwen2_moe", True, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                        "ok<|im_end|>\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>"),
    ("olmoe", True, "<|endoftext|><|system|>\nS\n<|user|>\nhi\n<|assistant|>\nok<|endoftext|>\n<|user|>\nand?\n"
                    "<|assistant|>\n", "<|endoftext|>"),
])
def test_the_families_published_templates_render_as_transformers_does(tmp_path, arch, system, prompt, eos):
    transformers = pytest.importorskip("transformers")
    model_dir = make_model(tmp_path / "m", arch=arch, **TINY)
    ours = Tokenizer.from_model_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    messages = ([{"role": "system", "content": "S"}] if system else []) + turns
    assert ours.apply_chat_template(messages) == prompt == theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert ours.eos_token == eos and stop_token_ids(model_dir) >= {ours.token_to_id(eos)}
    if not system:
        with pytest.raises(ValueError, match="roles must alternate"):
            ours.apply_chat_template([{"role": "system", "content": "S"}] + turns)


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


def _full_disk(monkeypatch, name: str) -> None:
    """Writing the file `name` (in whatever directory) fails with ENOSPC: a shard after its
    first bytes (a partial file on disk), a JSON file at once."""
    import builtins

    from ext.makemodel import shards as shards_module

    if name.endswith(".safetensors"):
        real_open = builtins.open

        def opening(path, mode="r", *args, **kwargs):
            f = real_open(path, mode, *args, **kwargs)
            return FullFile(f) if "w" in mode and Path(path).name == name else f
        monkeypatch.setattr(shards_module, "open", opening, raising=False)
    else:
        real_write_text = Path.write_text

        def write_text(self, *args, **kwargs):
            if self.name == name:
                no_space()
            return real_write_text(self, *args, **kwargs)
        monkeypatch.setattr(Path, "write_text", write_text)


@pytest.mark.parametrize("name", ["model.safetensors", "model-00002-of-00004.safetensors",
                                  "model.safetensors.index.json", "config.json", "tokenizer.json"])
def test_a_full_disk_names_the_file_and_leaves_no_partial_model(tmp_path, monkeypatch, capsys, name):
    """ENOSPC once said only "[Errno 28] No space left on device" and left a partial
    model.safetensors without a config: the error names the file as it would be in --out,
    keeps its errno, and nothing of the checkpoint is left (--out removed when make-model
    created it)."""
    from daemon.commands.cli import main

    out = tmp_path / "m"
    shard_size = "20000" if "-of-" in name or "index" in name else "1G"
    _full_disk(monkeypatch, name)
    args = ["make-model", "--arch", "mixtral", "--layers", "2", "--experts", "4", "--top-k", "2",
            "--hidden", "32", "--intermediate", "16", "--shard-size", shard_size, "--out", str(out)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "moed make-model: error: [Errno 28] No space left on device: " in err, err
    assert f"writing {out / name}\n" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_keeps_an_existing_out_dir_and_the_checkpoint_force_would_replace(
        tmp_path, monkeypatch):
    """--out exists with another file and a checkpoint --force is to replace: a full disk
    leaves both as they were (the old checkpoint is deleted only once the new one is whole)."""
    make_model(tmp_path, arch="olmoe", **TINY)
    (tmp_path / "notes.txt").write_text("mine")
    before = _file_digests(tmp_path)
    _full_disk(monkeypatch, "model.safetensors")
    with pytest.raises(OSError, match="No space left on device: writing .*model.safetensors"):
        make_model(tmp_path, arch="mixtral", overwrite=True, **TINY)
    assert _file_digests(tmp_path) == before


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


@pytest.mark.parametrize("arch, markers", [
    ("qwen3_moe", ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")),
    ("glm4_moe", ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                  "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
])
def test_a_familys_markers_are_plain_added_tokens_as_in_its_published_tokenizer(tmp_path, arch, markers):
    transformers = pytest.importorskip("transformers")
    model_dir = make_model(tmp_path / "m", arch=arch, **TINY)
    ours = Tokenizer.from_model_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert [ours.added_tokens[m] for m in markers] == list(range(512, 512 + len(markers)))
    decoder = theirs.added_tokens_decoder
    assert [(decoder[512 + k].content, decoder[512 + k].special) for k in range(len(markers))] == [
        (m, False) for m in markers]
    text = "a" + "b".join(markers) + "c"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert [i for i in ids if i >= 512] == list(range(512, 512 + len(markers)))   # one token each
    assert ours.decode(ids) == text == theirs.decode(ids, skip_special_tokens=True)  # kept in the text


# ------------------------------------------------------------------ low-bit layouts

LOWBIT = dict(layers=2, experts=4, top_k=2, hidden=160, intermediate=96)


_headers = headers


@pytest.mark.parametrize("arch", FIRST_FAMILIES)
def test_fp8_layout_is_deepseek_v3s(tmp_path, arch):
    model_dir = make_model(tmp_path / "m", arch=arch, dtype="fp8", shard_size=40_000, **LOWBIT)
    headers = _headers(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    up = "w3" if arch == "mixtral" else "up_proj"
    kept = [f"model.layers.{l}.{moe}.gate" for l in range(2)]
    if arch == "qwen2_moe":
        kept = [m for l in range(2) for m in (f"model.layers.{l}.mlp.gate",
                                               f"model.layers.{l}.mlp.shared_expert_gate")]
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128], "modules_to_not_convert": [*kept, "lm_head"]}
    assert config["torch_dtype"] == "bfloat16"
    expert = f"model.layers.1.{moe}.experts.3.{up}.weight"
    assert headers[expert]["dtype"] == "F8_E4M3" and headers[expert]["shape"] == [96, 160]
    assert headers[expert + "_scale_inv"] == {**headers[expert + "_scale_inv"], "dtype": "F32",
                                              "shape": [1, 2]}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert headers[q + "_scale_inv"]["shape"] == [2, 2]       # 160 = 128 + 32 each way
    for name, entry in headers.items():
        quantised = entry["dtype"] == "F8_E4M3"
        assert quantised == (name + "_scale_inv" in headers)
        if not quantised and not name.endswith("_scale_inv"):
            assert entry["dtype"] == "BF16", name
    assert headers["lm_head.weight"]["dtype"] == headers[f"model.layers.0.{moe}.gate.weight"]["dtype"] == "BF16"
    assert not any(n.endswith(("_blocks", "_scales")) for n in headers)


@pytest.mark.parametrize("arch", FIRST_FAMILIES)
def test_mxfp4_layout_is_gpt_osss_blocks_and_scales_per_expert(tmp_path, arch):
    model_dir = make_model(tmp_path / "m", arch=arch, dtype="mxfp4", **LOWBIT)
    headers = _headers(model_dir)
    quant = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "mxfp4" and "lm_head" in quant["modules_to_not_convert"]
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    down = "w2" if arch == "mixtral" else "down_proj"
    d = f"model.layers.0.{moe}.experts.1.{down}.weight"
    assert headers[d + "_blocks"]["dtype"] == headers[d + "_scales"]["dtype"] == "U8"
    assert headers[d + "_blocks"]["shape"] == [160, 3, 16] and headers[d + "_scales"]["shape"] == [160, 3]
    assert d not in headers
    assert {e["dtype"] for n, e in headers.items() if ".experts." not in n} == {"BF16"}


@pytest.mark.parametrize("kwargs", [dict(dtype="fp8", scale_dtype="bf16"),
                                    dict(dtype="fp8", scale_dtype="e8m0"),
                                    dict(dtype="mxfp4")])
def test_lowbit_files_are_deterministic_aligned_and_reported(tmp_path, kwargs):
    calls = []
    a = make_model(tmp_path / "a", arch="qwen2_moe", shard_size=30_000, seed=2,
                   progress=lambda done, total: calls.append((done, total)), **LOWBIT, **kwargs)
    b = make_model(tmp_path / "b", arch="qwen2_moe", shard_size=30_000, seed=2, **LOWBIT, **kwargs)
    assert _file_digests(a) == _file_digests(b)
    index = json.loads((a / "model.safetensors.index.json").read_text())
    assert calls[-1] == (index["metadata"]["total_size"],) * 2
    size = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "U8": 1}
    for path in a.glob("*.safetensors"):
        with safe_open(path, "pt") as f:                 # the reference reader accepts it
            assert set(f.keys()) == {n for n, s in index["weight_map"].items() if s == path.name}
    for name, entry in _headers(a).items():               # every tensor aligned to its element
        assert entry["data_offsets"][0] % size[entry["dtype"]] == 0, name
    if kwargs.get("scale_dtype") == "e8m0":
        config = json.loads((a / "config.json").read_text())
        assert config["quantization_config"]["scale_fmt"] == "ue8m0"
        assert _headers(a)["model.layers.0.self_attn.q_proj.weight_scale_inv"]["dtype"] == "U8"


def test_fp8_values_are_the_bf16_models_quantised(tmp_path):
    """Same seed: the fp8 checkpoint's non-quantised tensors are the bf16 one's bytes, and
    its FP8 weights round the same draws (E4M3 keeps 4 significant bits)."""
    bf16 = _tensors(make_model(tmp_path / "b", arch="olmoe", seed=5, **LOWBIT))
    f32 = _tensors(make_model(tmp_path / "f", arch="olmoe", seed=5, dtype="f32", **LOWBIT))
    fp8_dir = make_model(tmp_path / "q", arch="olmoe", seed=5, dtype="fp8", **LOWBIT)
    with safe_open(fp8_dir / "model.safetensors", "pt") as f:
        router = f.get_tensor("model.layers.1.mlp.gate.weight")
        w = f.get_tensor("model.layers.1.mlp.experts.2.gate_proj.weight").float().numpy()
        scale = f.get_tensor("model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv").numpy()
    assert np.array_equal(router.view(dtype=__import__("torch").int16).numpy(),
                          bf16["model.layers.1.mlp.gate.weight"].view(np.int16))
    exact = f32["model.layers.1.mlp.experts.2.gate_proj.weight"]            # [96, 160]
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:96, :160]
    assert np.abs(w * full - exact).max() <= np.abs(exact).max() * 2 ** -4
    assert np.allclose(scale[0], [np.abs(exact[:, :128]).max() / 448, np.abs(exact[:, 128:]).max() / 448])


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="bf16", scale_dtype="f32"), "apply to dtype 'fp8' only"),
    (dict(dtype="mxfp4", scale_fmt="ue8m0"), "apply to dtype 'fp8' only"),
    (dict(dtype="fp8", scale_dtype="f16"), "scale_dtype must be one of"),
    (dict(dtype="fp8", scale_dtype="e8m0", scale_fmt="float"), "needs scale_fmt 'ue8m0'"),
    (dict(dtype="fp8", scale_dtype="bf16", scale_fmt="ue8m0"), "f32 or e8m0"),
    (dict(dtype="mxfp4"), "multiples of 32"),
])
def test_invalid_lowbit_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_model(tmp_path / "x", arch="qwen3_moe", **TINY, **kwargs)
    assert not (tmp_path / "x").exists()


def test_cli_writes_fp8_with_bf16_scales(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "daemon.commands.cli", "make-model", "--arch", "mixtral",
                           "--layers", "1", "--experts", "2", "--top-k", "1", "--hidden", "96",
                           "--intermediate", "80", "--dtype", "fp8", "--scale-dtype", "bf16",
                           "--out", str(out)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    headers = _headers(out)
    assert headers["model.layers.0.block_sparse_moe.experts.1.w2.weight_scale_inv"]["dtype"] == "BF16"
    assert headers["model.layers.0.block_sparse_moe.experts.1.w2.weight"]["shape"] == [96, 80]
