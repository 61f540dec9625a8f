"""Tiny reference models for the oracle tests, built with transformers' own classes.

Each `ArchCase` is one architecture configuration; `build_reference` builds it with
`torch.manual_seed(seed)`, saves it with `save_pretrained(max_shard_size="50KB")` in
the requested dtype, loads it back with `AutoModelForCausalLM` in float32 (the
reference computes in f32 on the dtype-rounded weights, like moed), runs a greedy
generation and a teacher-forced forward, and checks the seed's margins: a clear
top-1/top-2 logit gap at every generation step and a clear gap between the k-th and
(k+1)-th router probabilities of every token at every MoE layer. `select_seed` takes
seeds 0, 1, ... until one passes (docs/design.md, "Correctness: the oracle").

Shape legend: T tokens, V vocab_size, E num_experts, K num_experts_per_tok.
"""
from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

log = logging.getLogger(__name__)

INITIALIZER_RANGE = 0.1
PROMPT_LEN = 8
NEW_TOKENS = 32
MAX_SEEDS = 20
LOGIT_GAP_REL = 1e-4    # top-1 minus top-2 logit, relative to max |logit| of the step
ROUTER_GAP = 1e-6       # k-th minus (k+1)-th router probability (softmax in f32)
SHARD_SIZE = "50KB"
LOGIT_TOL_REL = 1e-4    # moed's logits against the reference, relative to max |logit|

# Sizes shared by every family; a case's `overrides` replace or extend them.
_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    initializer_range=INITIALIZER_RANGE,
    max_position_embeddings=128,
)

_FAMILY: dict[str, tuple[type, type, dict[str, Any]]] = {
    # model_type: (config class, model class, family-specific sizes)
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=8, moe_intermediate_size=32, intermediate_size=48)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=8, moe_intermediate_size=32, intermediate_size=48,
                       shared_expert_intermediate_size=40)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=8, intermediate_size=32)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(num_experts=8, intermediate_size=32, pad_token_id=1, eos_token_id=2)),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    dict(num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=32,
                         intermediate_size=48, n_shared_experts=1, kv_lora_rank=32,
                         q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         n_group=1, topk_group=1, first_k_dense_replace=1)),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM,
                 dict(n_routed_experts=8, moe_intermediate_size=32, intermediate_size=48,
                      head_dim=24, first_k_dense_replace=1)),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                dict(num_local_experts=8, intermediate_size=32, head_dim=16)),
}

# Parameters transformers initialises to zeros that the reference draws instead, so that
# what they do is seen: DeepSeek-V3 / GLM-4.5's selection-only correction bias (large
# enough to change choices, as trained ones do) and GPT-OSS's expert biases.
_DRAWN = {"e_score_correction_bias": 0.3, "gate_up_proj_bias": 0.1, "down_proj_bias": 0.1}


@dataclass(frozen=True)
class ArchCase:
    """One architecture configuration of the oracle (dtype chosen separately)."""

    id: str
    model_type: str
    overrides: dict[str, Any] = field(default_factory=dict, hash=False)

    def config(self) -> transformers.PretrainedConfig:
        config_cls, _, family = _FAMILY[self.model_type]
        return config_cls(**{**_COMMON, **family, **self.overrides})


ARCH_CASES = (
    ArchCase("qwen3_moe-head_dim24-norm_topk", "qwen3_moe",
             dict(head_dim=24, norm_topk_prob=True)),
    ArchCase("qwen3_moe-head_dim24-no_norm_topk", "qwen3_moe",
             dict(head_dim=24, norm_topk_prob=False)),
    ArchCase("qwen2_moe-dense_layer1-window6", "qwen2_moe",
             dict(mlp_only_layers=[1], use_sliding_window=True, sliding_window=6,
                  max_window_layers=2)),
    ArchCase("qwen2_moe-sparse_step2-window6", "qwen2_moe",
             dict(num_hidden_layers=4, decoder_sparse_step=2, use_sliding_window=True,
                  sliding_window=6, max_window_layers=2)),
    ArchCase("mixtral-window5", "mixtral", dict(sliding_window=5)),
    ArchCase("mixtral-window5-tied", "mixtral", dict(sliding_window=5, tie_word_embeddings=True)),
    ArchCase("olmoe-clip3", "olmoe", dict(clip_qkv=3.0)),
)

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Reference:
    """What transformers computed for one saved model (all float32 numpy).

    prompt: [PROMPT_LEN] ids; tokens: NEW_TOKENS greedy ids; step_logits:
    [NEW_TOKENS, V], row i the logits that chose tokens[i]; teacher_logits:
    [PROMPT_LEN + NEW_TOKENS, V] of one forward over prompt + tokens;
    router_logits: per forward call of the greedy run, per MoE layer, [T, E];
    qkv_absmax: OLMoE only, the largest |q|, |k|, |v| seen before clamping.
    """

    model_dir: Path
    seed: int
    prompt: list[int]
    tokens: list[int]
    step_logits: np.ndarray
    teacher_logits: np.ndarray
    router_logits: list[list[np.ndarray]]
    qkv_absmax: float | None


class SeedRejected(Exception):
    """A seed's reference run has a margin too small for an exact comparison."""


def make_prompt(vocab_size: int, seed: int, n: int = PROMPT_LEN) -> list[int]:
    return np.random.default_rng(1000 + seed).integers(0, vocab_size, n).tolist()


def save_model(case: ArchCase, dtype: str, seed: int, model_dir: Path) -> None:
    """Build the case's model with torch.manual_seed(seed) and save it in `dtype`."""
    _, model_cls, _ = _FAMILY[case.model_type]
    torch.manual_seed(seed)
    model = model_cls(case.config())
    with torch.no_grad():
        for name, tensor in model.named_buffers(prefix="", recurse=True):
            std = _DRAWN.get(name.rsplit(".", 1)[-1])
            if std is not None:
                tensor.normal_(0.0, std)
        for name, tensor in model.named_parameters():
            std = _DRAWN.get(name.rsplit(".", 1)[-1])
            if std is not None:
                tensor.normal_(0.0, std)
    model.to(TORCH_DTYPES[dtype]).save_pretrained(model_dir, max_shard_size=SHARD_SIZE)


def load_reference_model(model_dir: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def shard_layout(model_dir: Path) -> tuple[int, dict[str, set[str]]]:
    """(number of shard files, {expert prefix: set of files its projections lie in})."""
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = index["weight_map"]
    experts: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        if ".experts." in name:
            prefix = name.rsplit(".", 2)[0]        # model.layers.L.<moe>.experts.E
            experts.setdefault(prefix, set()).add(file)
    return len(set(weight_map.values())), experts


@torch.inference_mode()
def reference_run(model: torch.nn.Module, prompt: list[int], n_new: int = NEW_TOKENS,
                  clip_qkv: float | None = None) -> tuple[list[int], np.ndarray, np.ndarray,
                                                          list[list[np.ndarray]], float | None]:
    """Greedy generation by hand (forward with the KV cache, argmax each step) and one
    teacher-forced forward over prompt + generated tokens."""
    absmax = [0.0]
    hooks = []
    if clip_qkv is not None:                     # OLMoE clamps q_norm(q), k_norm(k), v
        def record(_module, _inputs, output):
            absmax[0] = max(absmax[0], float(output.abs().max()))
        for layer in model.model.layers:
            attn = layer.self_attn
            hooks += [m.register_forward_hook(record) for m in (attn.q_norm, attn.k_norm, attn.v_proj)]
    try:
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, output_router_logits=True)
        tokens: list[int] = []
        step_logits = []
        routers = []
        while True:
            routers.append([r.float().numpy().copy() for r in out.router_logits])
            logits = out.logits[0, -1].float()
            step_logits.append(logits.numpy().copy())
            tokens.append(int(torch.argmax(logits)))
            if len(tokens) == n_new:
                break
            out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True,
                        output_router_logits=True)
        teacher = model(input_ids=torch.tensor([prompt + tokens]), use_cache=False).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return (tokens, np.stack(step_logits), teacher.float().numpy().copy(), routers,
            absmax[0] if clip_qkv is not None else None)


def routing_margins(model: torch.nn.Module):
    """The routing rule's decision margins for `check_margins`, from the reference model:
    rule(moe_layer, router_logits [T, E]) -> (gap [T] between the k-th and (k+1)-th
    candidate, in the score the rule ranks by; what is ranked). Softmax families:
    probabilities; DeepSeek-V3 / GLM-4.5: sigmoid + correction bias, after the group
    choice, whose own gap (topk_group-th against the next group's top-2 sum) counts too;
    GPT-OSS: the logits (with the router bias) that top-k picks from."""
    config = model.config
    k = config.num_experts_per_tok
    if config.model_type in ("deepseek_v3", "glm4_moe"):
        biases = [layer.mlp.gate.e_score_correction_bias.float().numpy()
                  for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        n_group, topk_group = config.n_group, config.topk_group

        def grouped(moe_layer: int, logits: np.ndarray):
            choice = 1.0 / (1.0 + np.exp(-logits.astype(np.float64))) + biases[moe_layer]
            T, E = choice.shape
            gaps = np.full(T, np.inf)
            if topk_group < n_group:
                g = choice.reshape(T, n_group, E // n_group)
                top2 = -np.sort(-g, axis=2)[:, :, :2].sum(axis=2)
                ranked = -np.sort(-top2, axis=1)
                gaps = ranked[:, topk_group - 1] - ranked[:, topk_group]
                dropped = np.argsort(-top2, axis=1, kind="stable")[:, topk_group:]
                np.put_along_axis(g, dropped[:, :, None].repeat(E // n_group, 2), -np.inf, axis=1)
            ranked = -np.sort(-choice, axis=1)
            return np.minimum(gaps, ranked[:, k - 1] - ranked[:, k]), "biased sigmoid scores"
        return grouped
    if config.model_type == "gpt_oss":
        def logit_gap(moe_layer: int, logits: np.ndarray):
            ranked = -np.sort(-logits.astype(np.float64), axis=1)
            return ranked[:, k - 1] - ranked[:, k], "router logits"
        return logit_gap
    return _softmax_rule(k)


def _softmax_rule(k: int):
    def softmax_gap(moe_layer: int, logits: np.ndarray):
        probs = torch.softmax(torch.from_numpy(logits), dim=-1, dtype=torch.float32).numpy()
        ranked = -np.sort(-probs, axis=-1)
        return ranked[:, k - 1] - ranked[:, k], "router probabilities"
    return softmax_gap


def check_margins(step_logits: np.ndarray, router_logits: list[list[np.ndarray]], top_k: int,
                  rule=None) -> None:
    """Raise SeedRejected unless every greedy step and every routing decision is clear
    (`rule`: from `routing_margins`; default the softmax families')."""
    for step, row in enumerate(step_logits):
        top2 = np.sort(row)[-2:]
        gap = float(top2[1] - top2[0])
        need = LOGIT_GAP_REL * float(np.abs(row).max())
        if gap < need:
            raise SeedRejected(f"top-1/top-2 logit gap {gap:.3g} < {need:.3g} at step {step}")
    for call, layers in enumerate(router_logits):
        for moe_layer, logits in enumerate(layers):
            gaps, what = (rule or _softmax_rule(top_k))(moe_layer, logits)
            if gaps.min() < ROUTER_GAP:
                t = int(gaps.argmin())
                raise SeedRejected(f"router gap {gaps[t]:.3g} < {ROUTER_GAP:g} ({what}) between ranks "
                                   f"{top_k} and {top_k + 1} at forward call {call}, MoE layer "
                                   f"#{moe_layer}, token {t}")


def build_reference(case: ArchCase, dtype: str, seed: int, model_dir: Path) -> Reference:
    """Save the model for `seed` and run the reference; SeedRejected on thin margins."""
    save_model(case, dtype, seed, model_dir)
    model = load_reference_model(model_dir)
    config = model.config
    prompt = make_prompt(config.vocab_size, seed)
    clip = getattr(config, "clip_qkv", None)
    tokens, step_logits, teacher, routers, absmax = reference_run(model, prompt, clip_qkv=clip)
    check_margins(step_logits, routers, config.num_experts_per_tok, routing_margins(model))
    return Reference(model_dir, seed, prompt, tokens, step_logits, teacher, routers, absmax)


def select_seed(case: ArchCase, dtype: str, root: Path) -> Reference:
    """The reference of the first seed in 0..MAX_SEEDS-1 whose margins are clear.

    Each rejected seed is logged; after MAX_SEEDS rejections the test fails, naming
    the case and the last reason.
    """
    name = f"{case.id}-{dtype}"
    last = ""
    for seed in range(MAX_SEEDS):
        try:
            ref = build_reference(case, dtype, seed, root / f"seed{seed}")
        except SeedRejected as e:
            last = str(e)
            log.warning("%s: seed %d rejected (%s)%s", name, seed, last,
                        f"; taking seed {seed + 1}" if seed + 1 < MAX_SEEDS else "")
            continue
        log.info("%s: using seed %d", name, seed)
        return ref
    pytest.fail(f"oracle case {name}: no seed in 0..{MAX_SEEDS - 1} gives clear margins "
                         f"(last: {last})")


# ------------------------------------------------------------- the moed side


@contextlib.contextmanager
def open_model(model_dir, n_threads=2, experts="mmap"):
    """moed's Model of `model_dir` in exact numerics (the mode the oracle checks, asked for
    by name: the daemon's default, auto, runs quantised weights fast), closed on exit."""
    from ext.models.model import Model

    model = Model.load(model_dir, n_threads=n_threads, experts=experts, numerics="exact")
    try:
        yield model
    finally:
        model.close()


def moed_greedy(model, prompt: list[int], n_new: int = NEW_TOKENS):
    """(tokens, [n_new, V] logits that chose them): prefill, then one token per forward."""
    seq = model.new_sequence()
    logits = model.forward(seq, prompt)
    tokens, steps = [], []
    while True:
        assert logits.shape == (1, model.config.vocab_size)
        steps.append(logits[0])
        tokens.append(int(np.argmax(logits[0])))
        if len(tokens) == n_new:
            return tokens, np.stack(steps)
        logits = model.forward(seq, [tokens[-1]])


def moed_run(model_dir, prompt: list[int], tokens: list[int], **kw):
    """moed's (greedy tokens, [NEW_TOKENS, V] step logits, teacher-forced logits over
    prompt + tokens) for a reference's prompt and tokens; kw as `open_model`'s."""
    with open_model(model_dir, **kw) as model:
        got, steps = moed_greedy(model, prompt)
        teacher = model.forward(model.new_sequence(), prompt + tokens, all_logits=True)
    return got, steps, teacher


def cached_moed_runs(references):
    """get(case, dtype) -> `moed_run` of that case's reference, computed once."""
    cache = {}

    def get(case, dtype):
        key = (case.id, dtype)
        if key not in cache:
            ref = references(case, dtype)
            cache[key] = moed_run(ref.model_dir, ref.prompt, ref.tokens)
        return cache[key]

    return get


def assert_logits_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """max |actual - expected| <= LOGIT_TOL_REL x max |expected|."""
    assert actual.shape == expected.shape, what
    scale = float(np.abs(expected).max())
    err = float(np.abs(actual - expected).max())
    assert err <= LOGIT_TOL_REL * scale, \
        f"{what}: max |Δ| {err:.3g} > {LOGIT_TOL_REL:g} × max |logit| {scale:.3g}"
