"""The embedded default model (daemon/default_model) against transformers, and its files.

transformers loads the committed bf16 model as published and computes in f32 (as moed
does); moed must produce the same greedy tokens (32 after each prompt) with every expert
in RAM and with the experts streamed through a cache of a quarter of them. The
tokenizer must encode like transformers' fast tokenizer built from the same files.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from daemon.commands.demo import default_model_dir
from daemon.store.session import open_model
from ext.models.config import load_config
from ext.tokenizer import Tokenizer

MODEL_DIR = default_model_dir()
NEW_TOKENS = 32
PROMPTS = ("def ", "class ", "import ", "    def __init__(self, path):\n        self.")
MAX_SAFETENSORS_BYTES = 15.5e6


@pytest.fixture(scope="module")
def reference():
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_model_dir(MODEL_DIR)


def reference_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def moed_greedy(model, prompt: list[int]) -> list[int]:
    seq = model.new_sequence()
    logits = model.forward(seq, prompt)
    tokens = []
    while len(tokens) < NEW_TOKENS:
        tokens.append(int(np.argmax(logits[-1])))
        logits = model.forward(seq, [tokens[-1]])
    return tokens


def test_the_committed_files_are_the_documented_model():
    raw = json.loads((MODEL_DIR / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3MoeForCausalLM"]
    assert raw["norm_topk_prob"] is True                        # written explicitly
    config = load_config(MODEL_DIR)
    assert (config.num_hidden_layers, config.num_experts, config.top_k) == (8, 32, 4)
    weights = MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= MAX_SAFETENSORS_BYTES
    card = (MODEL_DIR / "README.md").read_text()
    for needed in ("Qwen3MoeForCausalLM", "PSF-2.0", "bits per byte", "held out"):
        assert needed in card


@pytest.mark.parametrize("prompt", PROMPTS)
def test_moed_matches_transformers_token_for_token(reference, tokenizer, prompt, tmp_path):
    ids = tokenizer.encode(prompt)
    expected = reference_greedy(reference, ids)
    resident, _ = open_model(MODEL_DIR, threads=2, cache_bytes=None, experts="resident")
    try:
        assert moed_greedy(resident, ids) == expected, tokenizer.decode(expected)
    finally:
        resident.close()
    # the experts streamed through a cache of a quarter of them: the same tokens
    quarter = sum(p.numel() for n, p in reference.named_parameters() if "experts" in n) * 2 // 4
    streamed, session = open_model(MODEL_DIR, threads=1, cache_bytes=quarter, state_dir=tmp_path)
    try:
        assert session is not None
        assert moed_greedy(streamed, ids) == expected
        assert session.summary()["misses"] > 0                  # it really streamed
    finally:
        streamed.close()


def test_the_tokenizer_encodes_like_transformers(tokenizer):
    reference = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    text = (MODEL_DIR / "README.md").read_text() + "\n\tdef f(x):\n        return x ** 2  # é ∑\n"
    assert tokenizer.encode(text) == reference(text, add_special_tokens=False)["input_ids"]
    assert reference.eos_token_id == 0


def test_the_chat_template_hands_code_over_to_continue(tokenizer):
    messages = [{"role": "system", "content": "utilities"},
                {"role": "user", "content": "def add(a, b):\n"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True) == \
        "# utilities\ndef add(a, b):\n"
