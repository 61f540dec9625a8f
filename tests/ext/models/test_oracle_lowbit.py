"""The oracle for the published low-bit formats: FP8 E4M3 with block scales and MXFP4.

Each case is a checkpoint `make_model` writes in the published layout (several shards,
hidden 160 and intermediate 80/96: not multiples of 128, so every FP8 scale grid has
partial blocks, q_proj's in both directions). The reference is transformers (its own
classes) run on the checkpoint's weights dequantised by tests/lowbit_reference.py — an
independent numpy reading of the format descriptions, with the block size taken from
the config, never guessed from the grid. moed must agree token for token over 32 greedy
tokens and within 1e-4 x max |logit| teacher-forced; seeds are taken in order until the
reference has clear margins (tests/oracle_models.py). Placement — threads, where the
experts sit, prefill chunking — must not change a bit in any format.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from lowbit_reference import assert_placement_invisible, dequantise
from oracle_models import NEW_TOKENS, PROMPT_LEN, Reference, assert_logits_close, open_model

from ext.formats.checkpoint import Checkpoint
from ext.formats.quant import FP8_E4M3, MXFP4
from ext.makemodel import make_model

SIZES = dict(layers=2, experts=8, top_k=2, hidden=160, shard_size=60_000,
             initializer_range=0.1, vocab_size=320)
INTERMEDIATE = {"fp8": 80, "mxfp4": 96}     # MXFP4 groups 32 inputs: 80 is not a multiple


@dataclass(frozen=True)
class LowBitCase:
    """One make-model checkpoint: architecture, --dtype and its scale options."""

    arch: str
    dtype: str
    options: dict = field(default_factory=dict, hash=False)

    @property
    def id(self) -> str:
        return "-".join([self.arch, self.dtype, *(f"{k}_{v}" for k, v in self.options.items())])

    def make(self, out: Path, seed: int) -> Path:
        return make_model(out, arch=self.arch, dtype=self.dtype, seed=seed,
                          intermediate=INTERMEDIATE[self.dtype], **SIZES, **self.options)


ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
CASES = [LowBitCase(a, d) for a in ARCHS for d in ("fp8", "mxfp4")] + [
    LowBitCase("qwen3_moe", "fp8", {"scale_dtype": "bf16"}),
    LowBitCase("qwen3_moe", "fp8", {"scale_dtype": "e8m0"}),
    LowBitCase("qwen3_moe", "fp8", {"scale_fmt": "ue8m0"}),
]
PARAMS = [pytest.param(c, id=c.id) for c in CASES]


@pytest.fixture
def references(lowbit_oracle):
    return lowbit_oracle.reference


# ------------------------------------------------------------- the checkpoints themselves


@pytest.mark.parametrize("case", PARAMS)
def test_checkpoint_is_the_published_layout(references, case):
    ref = references(case)
    config = json.loads((ref.model_dir / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == case.dtype
    shards = sorted(ref.model_dir.glob("*.safetensors"))
    assert len(shards) >= 3
    ckpt = Checkpoint(ref.model_dir)
    moe = "block_sparse_moe" if case.arch == "mixtral" else "mlp"
    gate = "w1" if case.arch == "mixtral" else "gate_proj"
    expert = f"model.layers.1.{moe}.experts.5.{gate}"
    I, H = INTERMEDIATE[case.dtype], SIZES["hidden"]
    if case.dtype == "fp8":
        assert quant["fmt"] == "e4m3" and quant["weight_block_size"] == [128, 128]
        assert quant["activation_scheme"] == "dynamic"
        q = ckpt.info("model.layers.0.self_attn.q_proj.weight")
        assert (q.dtype, q.shape) == ("F8_E4M3", (160, 160))
        scale = ckpt.info("model.layers.0.self_attn.q_proj.weight_scale_inv")
        assert scale.shape == (2, 2)              # 160 = 128 + a partial block of 32
        assert ckpt.info(f"{expert}.weight_scale_inv").shape == (1, 2)
        assert ckpt.info(f"{expert}.weight").dtype == "F8_E4M3"
        want = {"bf16": "BF16", "e8m0": "U8"}.get(case.options.get("scale_dtype"), "F32")
        assert scale.dtype == want
        assert quant.get("scale_fmt", "float") == (
            "ue8m0" if case.options.get("scale_dtype") == "e8m0" or case.options.get("scale_fmt")
            else "float")
        assert ckpt.info(f"model.layers.0.{moe}.gate.weight").dtype == "BF16"
        assert "lm_head" in quant["modules_to_not_convert"]
    else:
        blocks, scales = ckpt.info(f"{expert}.weight_blocks"), ckpt.info(f"{expert}.weight_scales")
        assert (blocks.dtype, blocks.shape) == ("U8", (I, H // 32, 16))
        assert (scales.dtype, scales.shape) == ("U8", (I, H // 32))
        assert f"{expert}.weight" not in ckpt
        assert ckpt.info("model.layers.0.self_attn.q_proj.weight").dtype == "BF16"
    ckpt.close()


def test_reference_dequantiser_reads_make_model_values(tmp_path):
    """The test's own reading of both formats recovers the values make-model drew (its
    f32 version, same seed) within each format's rounding: FP8 within half a step of
    E4M3 (2^-4 relative to the block maximum), MXFP4 within E2M1's coarser grid."""
    kw = dict(arch="qwen3_moe", layers=1, experts=2, top_k=1, hidden=160, intermediate=96, seed=4)
    exact = dequantise(make_model(tmp_path / "f32", dtype="f32", **kw))
    name = "model.layers.0.mlp.experts.1.down_proj.weight"          # [160, 96]
    for dtype, bound in (("fp8", 2 ** -4), ("mxfp4", 0.26)):
        got = dequantise(make_model(tmp_path / dtype, dtype=dtype, **kw))
        err = np.abs(got[name] - exact[name]).max() / np.abs(exact[name]).max()
        assert 0 < err <= bound, (dtype, err)


# ------------------------------------------------------------- moed against transformers


@pytest.fixture
def moed_runs(lowbit_oracle):
    return lowbit_oracle.moed


@pytest.mark.parametrize("case", PARAMS)
def test_greedy_tokens_match_transformers(references, moed_runs, case):
    ref = references(case)
    tokens = moed_runs(case)[0]
    assert len(ref.prompt) == PROMPT_LEN and len(ref.tokens) == NEW_TOKENS
    assert tokens == ref.tokens


@pytest.mark.parametrize("case", PARAMS)
def test_logits_match_transformers(references, moed_runs, case):
    ref = references(case)
    _, steps, teacher, _ = moed_runs(case)
    assert_logits_close(teacher, ref.teacher_logits, "teacher-forced logits")
    assert_logits_close(steps, ref.step_logits, "greedy step logits")
    assert np.argmax(teacher[PROMPT_LEN - 1:-1], axis=1).tolist() == ref.tokens


@pytest.mark.parametrize("case", PARAMS)
def test_moed_reports_the_stored_format(references, case):
    with open_model(references(case).model_dir) as model:
        formats = model.weight_formats()
    if case.dtype == "fp8":
        # attention in FP8, the routers and lm_head kept in bf16
        assert formats["experts"] == FP8_E4M3 and formats["dense"] == "mixed"
        assert formats["dense_formats"]["bf16"] == SIZES["layers"] * (
            2 if case.arch == "qwen2_moe" else 1) + 1
        assert formats["quantization"]["weight_block_size"] == [128, 128]
    else:
        assert formats["experts"] == MXFP4 and formats["dense"] == "bf16"
        assert formats["quantization"] == {"quant_method": "mxfp4"}


# ------------------------------------------------------------- placement is invisible

PLACEMENT = [pytest.param(c, id=c.id) for c in CASES
             if c.arch == "qwen2_moe" and not c.options]       # shared expert: dense FP8 too


@pytest.mark.parametrize("case", PLACEMENT)
@pytest.mark.parametrize("n_threads, experts", [(1, "mmap"), (2, "resident"), (1, "resident")],
                         ids=["threads1-mmap", "threads2-resident", "threads1-resident"])
def test_threads_and_residency_do_not_change_a_bit(references, moed_runs, case, n_threads, experts):
    assert_placement_invisible(references(case), moed_runs(case), n_threads=n_threads,
                               experts=experts)


@pytest.mark.parametrize("case", PLACEMENT)
def test_prefill_at_once_equals_token_by_token(references, case):
    ref = references(case)
    ids = (ref.prompt + ref.tokens)[:24]
    with open_model(ref.model_dir) as model:
        at_once = model.forward(model.new_sequence(), ids, all_logits=True)
        seq = model.new_sequence()
        stepped = np.concatenate([model.forward(seq, [t]) for t in ids])
    assert np.array_equal(at_once, stepped)
