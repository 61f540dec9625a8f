"""Tests for make_model(routing_skew=S): realistic expert routing for cache benchmarks.

A small qwen3_moe checkpoint is run by moed's own engine, sampling at temperature 0.7 as
the benchmarks do, and the experts every MoE layer picks at each decode step are recorded
by wrapping `ext.kernels._kernels.route` where ext.models.model calls it. Per layer we measure:
  - top 25 %: share of the top_k selections taken by the most chosen quarter of experts
    (0.25 for uniform routing);
  - exponent: least-squares slope of log share against log rank, negated (Zipf exponent);
  - reuse: share of a token's experts that the previous token also chose (top_k / E for
    independent uniform routing; about 0.35-0.45 on real decode traces at Zipf 1, see
    ../shared/traces/README.md).

Bands. Over 12 model and sampling seeds this shape measured, per layer, top 25 %
0.64-0.73, exponent 0.99-1.27 and reuse 0.39-0.44 at S = 1 (exact Zipf(1) drawn
independently for 256 tokens reads exponent ~1.04), and 0.31-0.35, 0.20-0.31, 0.11-0.18 at
S = 0.001. The asserted bands leave room around those.
"""

import hashlib
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

import ext.makemodel.shards as shards
import ext.makemodel.skew as skew_construction
import ext.models.model as model_module
from ext.generate import Generation
from ext.makemodel import make_model
from ext.models.model import Model
from ext.sampling import SamplingParams
from ext.tokenizer import Tokenizer

SHAPE = dict(arch="qwen3_moe", layers=4, hidden=256, experts=32, top_k=4, intermediate=64)
TOKENS = 256
PROMPT = "<|im_start|>user\nWrite a function that sorts a list.<|im_end|>\n<|im_start|>assistant\n"
TINY = dict(layers=2, experts=4, top_k=2, hidden=32, intermediate=16)

# sha256 over the safetensors files, the index and config.json of
# make_model(arch="qwen3_moe", seed=3, shard_size=20_000, **TINY), computed with the
# version of make-model that had no routing_skew keyword (then recomputed once, unskewed,
# when Qwen3's marker tokens grew its vocabulary from 512 to 576 rows).
LEGACY_DIGEST = "72ebbb863693605e842593f5f97b91c6657907797ee3a01e637b2f8ed7255a91"


def _layer_stats(ids: np.ndarray, experts: int) -> tuple[float, float, float]:
    """(top 25 % share, fitted Zipf exponent, previous-token reuse) of ids [T, top_k]."""
    T, K = ids.shape
    counts = np.bincount(ids.ravel(), minlength=experts).astype(np.float64)
    share = np.sort(counts)[::-1] / counts.sum()
    top = float(share[:max(1, experts // 4)].sum())
    used = share > 0
    rank = np.arange(1, experts + 1)
    exponent = -float(np.polyfit(np.log(rank[used]), np.log(share[used]), 1)[0])
    chosen = np.zeros((T, experts), bool)
    np.put_along_axis(chosen, ids.astype(np.int64), True, axis=1)
    reuse = float((chosen[1:] & chosen[:-1]).sum() / ((T - 1) * K))
    return top, exponent, reuse


def _decode_routing(model_dir: Path, seed: int = 1) -> tuple[list[int], np.ndarray]:
    """Generate TOKENS tokens at temperature 0.7; return the whole sequence and the
    experts chosen at each decode step, [steps, layers, top_k]."""
    model = Model.load(model_dir, n_threads=2)
    steps = []
    real_route = model_module.K_.route

    def route(logits, top_k, renormalize, ids, weights):
        real_route(logits, top_k, renormalize, ids, weights)
        if ids.shape[0] == 1:                                # a decode step, not the prompt
            steps.append(ids[0].copy())

    prompt = Tokenizer.from_model_dir(model_dir).encode(PROMPT)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_module.K_, "route", route)
            generated = list(Generation(model, prompt, max_tokens=TOKENS,
                                        sampling=SamplingParams(temperature=0.7, seed=seed)))
    finally:
        model.close()
    layers = model.config.num_hidden_layers
    return prompt + generated, np.array(steps).reshape(-1, layers, SHAPE["top_k"])


@pytest.fixture(scope="module")
def skewed(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("skew1"), routing_skew=1.0, seed=0, **SHAPE)


@pytest.fixture(scope="module")
def skewed_routing(skewed) -> tuple[list[int], np.ndarray]:
    return _decode_routing(skewed)


def test_skew_one_gives_zipf_popularity_and_real_reuse(skewed_routing):
    _, ids = skewed_routing
    assert ids.shape == (TOKENS - 1, SHAPE["layers"], SHAPE["top_k"])
    stats = np.array([_layer_stats(ids[:, l], SHAPE["experts"]) for l in range(SHAPE["layers"])])
    for layer, (top, exponent, reuse) in enumerate(stats):
        assert top >= 0.40, f"layer {layer}: top 25 % of experts take only {top:.3f}"
        assert 0.8 <= exponent <= 1.45, f"layer {layer}: fitted Zipf exponent {exponent:.2f}"
        assert 0.33 <= reuse <= 0.50, f"layer {layer}: previous-token reuse {reuse:.3f}"
    assert 0.35 <= stats[:, 2].mean() <= 0.45, f"mean reuse {stats[:, 2].mean():.3f}"
    # Each layer has its own ranking: the hottest experts differ between layers.
    hottest = [set(np.argsort(-np.bincount(ids[:, l].ravel(), minlength=SHAPE["experts"]))[:4])
               for l in range(SHAPE["layers"])]
    assert len({frozenset(h) for h in hottest}) > 1


@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_lowbit_versions_keep_the_skew(tmp_path, skewed, dtype):
    """--routing-skew with --dtype fp8|mxfp4: the routers are the bf16 model's bytes (kept
    in bf16), the experts and attention its values rounded, and routing keeps the bands."""
    lowbit = make_model(tmp_path / dtype, routing_skew=1.0, seed=0, dtype=dtype, **SHAPE)
    from safetensors import safe_open

    router = "model.layers.2.mlp.gate.weight"
    bf16_router, low_router = (safe_open(sorted(d.glob("*.safetensors"))[0], "pt").get_tensor(router)
                               for d in (skewed, lowbit))
    assert bf16_router.dtype == low_router.dtype and bf16_router.equal(low_router)
    _, ids = _decode_routing(lowbit)
    for layer in range(SHAPE["layers"]):
        top, exponent, reuse = _layer_stats(ids[:, layer], SHAPE["experts"])
        assert top >= 0.40 and 0.8 <= exponent <= 1.45 and 0.30 <= reuse <= 0.50, \
            (layer, top, exponent, reuse)


def test_vanishing_skew_routes_near_uniformly(tmp_path):
    # Not S = 0: S = 0 keeps today's plain random weights byte for byte, and those do not
    # route uniformly (attention's context average dominates the residual stream, so
    # layers >= 1 keep choosing the same few experts; see ext/makemodel/skew.py).
    _, ids = _decode_routing(make_model(tmp_path, routing_skew=0.001, seed=0, **SHAPE))
    uniform_reuse = SHAPE["top_k"] / SHAPE["experts"]
    for layer in range(SHAPE["layers"]):
        top, exponent, reuse = _layer_stats(ids[:, layer], SHAPE["experts"])
        assert top <= 0.40, f"layer {layer}: top 25 % of experts take {top:.3f}"
        assert exponent <= 0.45, f"layer {layer}: fitted Zipf exponent {exponent:.2f}"
        assert reuse <= uniform_reuse + 0.1, f"layer {layer}: previous-token reuse {reuse:.3f}"


def _family_routing(model_dir: Path, seed: int = 1) -> tuple[np.ndarray, list[float]]:
    """Any family: generate TOKENS tokens at temperature 0.7 and record, at each decode
    step, every MoE layer's chosen experts and its input h (through the family's routing
    rule, `model.routing`). Returns the ids [steps, MoE layers, top_k] and, per pair of
    consecutive MoE layers, the top_k recall of the prefetch hint: the next layer's
    router applied to this layer's h, ranked by the rule's `hint_scores`."""
    model = Model.load(model_dir, n_threads=2)
    rule = model.routing
    inputs, chosen = [], []
    logits, select = rule.logits, rule.select

    def recording_logits(router, h, out, n_threads):
        if out.ctypes.data == model.ws.router_logits.ctypes.data and h.shape[0] == 1:
            inputs.append(h[0].copy())                       # the layer's own routing, decoding
        return logits(router, h, out, n_threads)

    def recording_select(router, scores, ids, weights):
        select(router, scores, ids, weights)
        if ids.shape[0] == 1:
            chosen.append(ids[0].copy())

    prompt = Tokenizer.from_model_dir(model_dir).encode(PROMPT)
    routers = [layer.router for layer in model.layers if layer.router is not None]
    K, E = model.config.num_experts_per_tok, model.config.num_experts
    try:
        rule.logits, rule.select = recording_logits, recording_select
        list(Generation(model, prompt, max_tokens=TOKENS, sampling=SamplingParams(temperature=0.7, seed=seed)))
        rule.logits = logits
        ids = np.array(chosen).reshape(-1, len(routers), K)
        h = np.array(inputs, np.float32).reshape(ids.shape[0], len(routers), -1)
        recall = []
        for l in range(len(routers) - 1):
            scores = rule.hint_scores(routers[l + 1], rule.logits(
                routers[l + 1], np.ascontiguousarray(h[:, l]), np.empty((h.shape[0], E), np.float32), 2))
            guess = np.argsort(-scores, axis=1, kind="stable")[:, :K]
            recall.append(float(np.mean([len(set(g) & set(i)) / K for g, i in zip(guess, ids[:, l + 1])])))
    finally:
        model.close()
    return ids, recall


@pytest.mark.parametrize("arch, dtype", [("deepseek_v3", "bf16"), ("glm4_moe", "fp8"),
                                         ("gpt_oss", "mxfp4"), ("gpt_oss", "bf16")])
def test_skew_one_on_the_frontier_families(tmp_path, arch, dtype):
    """Their own routing rules (sigmoid + correction bias + groups, top-k then softmax),
    dense leading layers, shared experts, MLA, biases, the clamped SwiGLU: the same
    popularity, reuse and next-layer predictability as the first families. Measured
    (module doc): top 25 % 0.63-0.73, exponent 0.95-1.37, reuse 0.35-0.44, next-layer
    recall 0.63-0.81 per layer."""
    ids, recall = _family_routing(make_model(tmp_path, routing_skew=1.0, seed=0, dtype=dtype,
                                             **{**SHAPE, "arch": arch}))
    stats = np.array([_layer_stats(ids[:, l], SHAPE["experts"]) for l in range(ids.shape[1])])
    for layer, (top, exponent, reuse) in enumerate(stats):
        assert top >= 0.55, f"layer {layer}: top 25 % of experts take only {top:.3f}"
        assert 0.8 <= exponent <= 1.5, f"layer {layer}: fitted Zipf exponent {exponent:.2f}"
        assert 0.30 <= reuse <= 0.50, f"layer {layer}: previous-token reuse {reuse:.3f}"
    assert 0.33 <= stats[:, 2].mean() <= 0.47, f"mean reuse {stats[:, 2].mean():.3f}"
    assert min(recall) >= 0.55 and np.mean(recall) >= 0.65, f"next-layer recall {recall}"


def test_the_frontier_skew_keeps_transformers_reading(tmp_path):
    """A skewed checkpoint of each frontier family loads in transformers with every tensor
    used, and the skew's zeroed biases and solved correction bias are what it reads."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for arch in ("deepseek_v3", "glm4_moe", "gpt_oss"):
        model_dir = make_model(tmp_path / arch, arch=arch, routing_skew=1.0, seed=0, **TINY)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, output_loading_info=True)
        assert {k: list(v) for k, v in info.items()} == {
            "missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}, arch
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[5, 9, 77, 3]])).logits).all()
        state = model.state_dict()
        layer = model.config.num_hidden_layers - 1
        if arch == "gpt_oss":
            for name in ("mlp.router.bias", "mlp.experts.down_proj_bias", "self_attn.o_proj.bias",
                         "self_attn.v_proj.bias"):
                assert not state[f"model.layers.{layer}.{name}"].any(), name
            assert state[f"model.layers.{layer}.self_attn.q_proj.bias"].any()
        else:
            bias = state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
            assert abs(float(bias.sum())) < 1e-4 and bias.std() > 0   # leans against popularity


def _legacy_digest(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")) + [
            model_dir / "model.safetensors.index.json", model_dir / "config.json"]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("skew", [None, 0, 0.0])
def test_no_skew_writes_todays_files(tmp_path, skew):
    extra = {} if skew is None else {"routing_skew": skew}
    model_dir = make_model(tmp_path, arch="qwen3_moe", seed=3, shard_size=20_000, **TINY, **extra)
    assert _legacy_digest(model_dir) == LEGACY_DIGEST


def test_transformers_loads_skewed_model_and_routes_the_same_way(skewed, skewed_routing):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        skewed, dtype=torch.float32, output_loading_info=True)
    assert {k: list(v) for k, v in info.items()} == {
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    sequence, ids = skewed_routing
    with torch.no_grad():
        out = model(torch.tensor([sequence[:-1]]), output_router_logits=True)
    assert torch.isfinite(out.logits).all()
    k, steps = SHAPE["top_k"], ids.shape[0]
    for layer, logits in enumerate(out.router_logits):      # [positions, E] per layer
        hf = torch.topk(logits[-steps:], k, dim=-1).indices.numpy()
        top, _, _ = _layer_stats(hf, SHAPE["experts"])
        assert top >= 0.40, f"transformers, layer {layer}: top 25 % take {top:.3f}"
        same = np.mean([set(a) == set(b) for a, b in zip(hf, ids[:, layer])])
        assert same >= 0.9, f"layer {layer}: moed and transformers agree on {same:.1%} of steps"


def _tensors(model_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_skewed_files_are_deterministic_and_do_not_depend_on_sharding_or_chunks(tmp_path, monkeypatch):
    args = dict(arch="qwen2_moe", routing_skew=1.0, seed=7, **TINY)
    one = _tensors(make_model(tmp_path / "one", **args))
    again = _tensors(make_model(tmp_path / "again", **args))
    sharded = _tensors(make_model(tmp_path / "sharded", shard_size=20_000, **args))
    f32 = _tensors(make_model(tmp_path / "f32", dtype="f32", **args))
    monkeypatch.setattr(shards, "_CHUNK_ELEMENTS", 100)  # several rows per chunk, cut at rows
    chunked = _tensors(make_model(tmp_path / "chunked", **args))
    plain = _tensors(make_model(tmp_path / "plain", **{**args, "routing_skew": None}))
    assert one.keys() == again.keys() == sharded.keys() == chunked.keys() == plain.keys()
    for name in one:
        np.testing.assert_array_equal(one[name], again[name])
        np.testing.assert_array_equal(one[name], sharded[name])
        np.testing.assert_array_equal(one[name], chunked[name])
        np.testing.assert_array_equal(one[name], f32[name].astype(ml_dtypes.bfloat16))
    # Only rows are edited: the tensors the construction leaves alone are the plain ones.
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_proj.bias"):
        np.testing.assert_array_equal(one[name], plain[name])
    assert not np.array_equal(one["model.layers.0.mlp.gate.weight"], plain["model.layers.0.mlp.gate.weight"])


@pytest.mark.parametrize("skew", [-1.0, math.nan, math.inf, True, "1"])
def test_invalid_routing_skew(tmp_path, skew):
    with pytest.raises(ValueError, match="routing_skew"):
        make_model(tmp_path, arch="mixtral", routing_skew=skew, **TINY)


@pytest.mark.parametrize("experts, top_k, skew", [(64, 8, 1.0), (32, 4, 1.0), (8, 2, 2.0), (4, 4, 1.0)])
def test_offsets_reproduce_the_zipf_shares(experts, top_k, skew):
    """Mean-field offsets: top_k of offset + N(0, 1) picks each rank at its share."""
    offsets = skew_construction._zipf_offsets(experts, top_k, skew)
    target = skew_construction._zipf_shares(experts, top_k, skew)
    logits = offsets + np.random.default_rng(0).standard_normal((20_000, experts))
    ids = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
    shares = np.bincount(ids.ravel(), minlength=experts) / ids.size
    np.testing.assert_allclose(shares, target, rtol=0.25, atol=0.002)
    quarter = max(1, experts // 4)
    assert abs(shares[:quarter].sum() - target[:quarter].sum()) < 0.02
