"""The oracle: moed against Hugging Face transformers on tiny random MoE models.

Every architecture case (tests/oracle_models.py) is built with transformers' own
classes in f32 and bf16, saved in 50 KB shards, and run by both sides: greedy
generation must agree token for token, and logits (teacher-forced and per decode
step) within 1e-4 × max |logit|. Seeds are taken in order until the reference's
greedy steps and routing decisions have clear margins, so that an exact token match
is a fair demand (docs/design.md, "Correctness: the oracle"). Placement (threads, where
the experts sit, how the prompt is chunked) must not change a single bit, and the
routing kernel is checked on a 64-expert top-8 router against numpy and torch.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle_models import (ARCH_CASES, cached_moed_runs, NEW_TOKENS, PROMPT_LEN, Reference, SeedRejected,
                           assert_logits_close, check_margins, load_reference_model, moed_greedy,
                           open_model, select_seed, shard_layout)

import ext.models.model
from ext.kernels import _kernels
from ext.models.model import Model

DTYPES = ("f32", "bf16")

CASES = [pytest.param(case, dtype, id=f"{case.id}-{dtype}") for case in ARCH_CASES for dtype in DTYPES]
CLIP_CASES = [p for p in CASES if p.values[0].model_type == "olmoe"]

# The placement tests use one bf16 model with a shared expert, a dense layer and a
# sliding window shorter than the prompts.
PLACEMENT_CASE = next(c for c in ARCH_CASES if c.id == "qwen2_moe-dense_layer1-window6")
PLACEMENT_DTYPE = "bf16"
LONG_PROMPT = 70


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """get(case, dtype) -> Reference, built once per module (seed selection included)."""
    cache: dict[tuple[str, str], Reference] = {}

    def get(case, dtype) -> Reference:
        key = (case.id, dtype)
        if key not in cache:
            cache[key] = select_seed(case, dtype, tmp_path_factory.mktemp(f"{case.id}-{dtype}"))
        return cache[key]

    return get


def one_by_one(model: Model, token_ids: list[int]) -> np.ndarray:
    """[T, V] logits of `token_ids` fed to a fresh sequence one token per forward."""
    seq = model.new_sequence()
    return np.concatenate([model.forward(seq, [t]) for t in token_ids])


def all_at_once(model: Model, token_ids: list[int]) -> np.ndarray:
    return model.forward(model.new_sequence(), token_ids, all_logits=True)


@pytest.fixture(scope="module")
def moed_runs(references):
    """get(case, dtype) -> (greedy tokens, step logits, teacher-forced logits) from moed."""
    return cached_moed_runs(references)


# ------------------------------------------------------------- the fixtures themselves


@pytest.mark.parametrize("case, dtype", CASES)
def test_checkpoint_has_several_shards_and_split_experts(references, case, dtype):
    n_shards, expert_files = shard_layout(references(case, dtype).model_dir)
    assert n_shards >= 3
    assert any(len(files) >= 2 for files in expert_files.values()), \
        "no expert has its projections in two different shard files"


@pytest.mark.parametrize("case, dtype", CLIP_CASES)
def test_olmoe_clip_qkv_actually_clips(references, case, dtype):
    clip = case.overrides["clip_qkv"]
    assert references(case, dtype).qkv_absmax > clip


def test_margin_check_rejects_thin_margins():
    clear = np.array([[0.0, 1.0, 5.0]], np.float32)
    router_clear = [[np.array([[3.0, 2.0, 1.0, 0.0]], np.float32)]]
    check_margins(clear, router_clear, top_k=2)
    with pytest.raises(SeedRejected, match="logit gap"):
        check_margins(np.array([[0.0, 5.0, 5.0 - 1e-5]], np.float32), router_clear, top_k=2)
    with pytest.raises(SeedRejected, match="router gap"):
        check_margins(clear, [[np.array([[3.0, 2.0, 2.0, 0.0]], np.float32)]], top_k=2)


# ------------------------------------------------------------- moed against transformers


@pytest.mark.parametrize("case, dtype", CASES)
def test_greedy_tokens_match_transformers(references, moed_runs, case, dtype):
    ref = references(case, dtype)
    tokens, _, _ = moed_runs(case, dtype)
    assert len(ref.prompt) == PROMPT_LEN and len(ref.tokens) == NEW_TOKENS
    assert tokens == ref.tokens


@pytest.mark.parametrize("case, dtype", CASES)
def test_teacher_forced_logits_match_transformers(references, moed_runs, case, dtype):
    ref = references(case, dtype)
    _, _, teacher = moed_runs(case, dtype)
    assert teacher.shape == (PROMPT_LEN + NEW_TOKENS, ref.teacher_logits.shape[1])
    assert_logits_close(teacher, ref.teacher_logits, "teacher-forced logits")
    # Both sides' teacher-forced argmax reproduce the greedy continuation.
    assert np.argmax(teacher[PROMPT_LEN - 1:-1], axis=1).tolist() == ref.tokens


@pytest.mark.parametrize("case, dtype", CASES)
def test_decode_step_logits_match_transformers(references, moed_runs, case, dtype):
    ref = references(case, dtype)
    _, steps, _ = moed_runs(case, dtype)
    assert_logits_close(steps, ref.step_logits, "greedy step logits")


# ------------------------------------------------------------- placement is invisible


@pytest.fixture(scope="module")
def placement_ref(references):
    return references(PLACEMENT_CASE, PLACEMENT_DTYPE)


def placement_run(ref: Reference, n_threads: int, experts: str):
    with open_model(ref.model_dir, n_threads=n_threads, experts=experts) as model:
        tokens, steps = moed_greedy(model, ref.prompt)
        teacher = all_at_once(model, ref.prompt + ref.tokens)
    return tokens, steps, teacher


@pytest.mark.parametrize("n_threads, experts", [(1, "mmap"), (2, "resident"), (1, "resident")],
                         ids=["threads1-mmap", "threads2-resident", "threads1-resident"])
def test_threads_and_expert_residency_do_not_change_a_bit(placement_ref, n_threads, experts):
    base_tokens, base_steps, base_teacher = placement_run(placement_ref, 2, "mmap")
    tokens, steps, teacher = placement_run(placement_ref, n_threads, experts)
    assert tokens == base_tokens == placement_ref.tokens
    assert np.array_equal(steps, base_steps)
    assert np.array_equal(teacher, base_teacher)


def test_prefill_at_once_equals_token_by_token(placement_ref):
    ids = (placement_ref.prompt + placement_ref.tokens)[:32]
    with open_model(placement_ref.model_dir) as model:
        at_once = all_at_once(model, ids)
        stepped = one_by_one(model, ids)
        assert at_once.shape == (32, model.config.vocab_size)
        assert np.array_equal(at_once, stepped)
        # Greedy continuation after a one-call prefill and after a token-by-token one.
        tokens_once, steps_once = moed_greedy(model, ids, 8)
        seq = model.new_sequence()
        for t in ids[:-1]:
            model.forward(seq, [t])
        logits = model.forward(seq, [ids[-1]])
        assert np.array_equal(logits, at_once[-1:])
        assert np.array_equal(logits, steps_once[:1])
        tokens_stepped = []
        for _ in range(8):
            tokens_stepped.append(int(np.argmax(logits[0])))
            assert np.array_equal(logits[0], steps_once[len(tokens_stepped) - 1])
            logits = model.forward(seq, [tokens_stepped[-1]])
    assert tokens_stepped == tokens_once
    assert tokens_once == placement_ref.tokens[24:32]


def test_prompt_longer_than_prefill_chunk(placement_ref):
    assert LONG_PROMPT > ext.models.model.PREFILL_CHUNK
    ids = np.random.default_rng(7).integers(0, 256, LONG_PROMPT).tolist()
    with open_model(placement_ref.model_dir) as model:
        at_once = all_at_once(model, ids)
        last_only = model.forward(model.new_sequence(), ids)
        stepped = one_by_one(model, ids)
    assert at_once.shape == (LONG_PROMPT, 256)
    assert np.array_equal(at_once, stepped)
    assert np.array_equal(last_only, at_once[-1:])
    with torch.inference_mode():
        expected = load_reference_model(placement_ref.model_dir)(input_ids=torch.tensor([ids])).logits[0]
    assert_logits_close(at_once, expected.numpy(), f"logits of a {LONG_PROMPT}-token prompt")


# ------------------------------------------------------------- routing kernel

E64, TOP8 = 64, 8


def route(logits: np.ndarray, top_k: int, renormalize: bool):
    T = logits.shape[0]
    ids = np.full((T, top_k), -1, np.int32)
    weights = np.full((T, top_k), np.nan, np.float32)
    _kernels.route(np.ascontiguousarray(logits, np.float32), top_k, renormalize, ids, weights)
    return ids, weights


def softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.fixture
def router_logits():
    return (np.random.default_rng(42).standard_normal((48, E64)) * 2.0).astype(np.float32)


def test_route_without_renormalisation_keeps_top8_mass(router_logits):
    ids, weights = route(router_logits, TOP8, renormalize=False)
    probs = softmax64(router_logits)
    mass = -np.sort(-probs, axis=1)[:, :TOP8].sum(axis=1)
    assert mass.max() < 0.99
    np.testing.assert_allclose(weights.sum(axis=1), mass, rtol=0, atol=1e-6)
    np.testing.assert_allclose(weights, np.take_along_axis(probs, ids.astype(np.int64), 1),
                               rtol=1e-5, atol=0)


def test_route_renormalised_sums_to_one(router_logits):
    _, weights = route(router_logits, TOP8, renormalize=True)
    assert np.abs(weights.sum(axis=1) - 1.0).max() <= 1e-6


@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renormalised"])
def test_route_order_is_descending(router_logits, renormalize):
    ids, weights = route(router_logits, TOP8, renormalize)
    assert np.all(np.diff(weights, axis=1) < 0)       # random logits: strictly descending
    chosen = np.take_along_axis(router_logits, ids.astype(np.int64), 1)
    assert np.all(np.diff(chosen, axis=1) < 0)


def test_route_ties_go_to_the_lower_expert_id():
    logits = np.zeros((3, E64), np.float32)              # row 0: all equal
    logits[1, [60, 3, 42, 17]] = 2.0                     # row 1: a four-way tie on top
    logits[1, [9, 33, 50, 1, 8]] = -1.0                  # ... then distinct lower values
    logits[1, [40]] = 1.0
    logits[2] = -np.arange(E64, dtype=np.float32) / 8    # row 2: 6 distinct, then a tie
    logits[2, :6] = [5.0, 4.0, 6.0, 3.5, 4.5, 3.0]       #   straddling rank 8
    logits[2, [50, 12, 31, 20]] = 2.0
    ids, weights = route(logits, TOP8, renormalize=False)
    assert ids[0].tolist() == list(range(TOP8))
    np.testing.assert_allclose(weights[0], 1 / E64, rtol=1e-6)
    assert ids[1].tolist() == [3, 17, 42, 60, 40, 0, 2, 4]
    assert np.all(weights[1, :4] == weights[1, 0]) and np.all(weights[1, 5:] == weights[1, 5])
    assert ids[2].tolist() == [2, 0, 4, 1, 3, 5, 12, 20]
    assert np.all(np.diff(weights, axis=1) <= 0)


@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renormalised"])
def test_route_matches_torch_topk(renormalize):
    logits = (np.random.default_rng(3).standard_normal((256, E64)) * 3.0).astype(np.float32)
    ids, weights = route(logits, TOP8, renormalize)
    probs = torch.softmax(torch.from_numpy(logits), dim=-1, dtype=torch.float32)
    top_v, top_i = torch.topk(probs, TOP8 + 1, dim=-1)
    top_v, top_i = top_v.numpy(), top_i.numpy()
    no_ties = np.all(np.diff(top_v, axis=1) < 0, axis=1)  # distinct among the top 9
    assert no_ties.sum() >= 250
    assert np.array_equal(ids[no_ties], top_i[no_ties, :TOP8])
    expected = top_v[:, :TOP8]
    if renormalize:
        expected = expected / expected.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(weights[no_ties], expected[no_ties], rtol=1e-5, atol=1e-7)
