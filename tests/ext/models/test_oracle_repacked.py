"""The oracle for moed's own repack format: a repacked model is exact against its own
dequantised weights.

Each case is a bf16 `make_model` checkpoint repacked by `moed repack`'s writer (int4 with
and without a minimum, int8, int8 dense weights too) into several shards. The reference
is transformers (its own classes) on the repacked checkpoint's weights dequantised by
tests/lowbit_reference.py — the test's own numpy reading of the format (tests/
quant_reference.py), not moed's kernels or ext/formats. moed, reading the codes natively,
must agree token for token over 32 greedy tokens and within 1e-4 x max |logit|
teacher-forced; seeds are taken in order until the reference has clear margins
(tests/oracle_models.py). Placement (threads, residency) must not change a bit.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from lowbit_reference import assert_placement_invisible
from oracle_models import NEW_TOKENS, PROMPT_LEN, assert_logits_close

from ext.formats.repacked import QuantScheme
from ext.makemodel import make_model
from ext.quant.repack import RepackSpec, repack

SIZES = dict(layers=2, experts=8, top_k=2, hidden=160, intermediate=96, shard_size=60_000,
             initializer_range=0.1, vocab_size=320)
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


@dataclass(frozen=True)
class RepackCase:
    arch: str
    scheme: str                      # "int4-min", "int4", "int8"
    options: dict = field(default_factory=dict, hash=False)

    @property
    def id(self) -> str:
        return "-".join([self.arch, self.scheme, *(f"{k}_{v}" for k, v in self.options.items())])

    def spec(self) -> RepackSpec:
        name, *rest = self.scheme.split("-")
        dense = QuantScheme("int8", 32) if self.options.get("dense") else None
        return RepackSpec(QuantScheme(name, 32, "min" in rest), dense=dense)

    def make(self, root: Path, seed: int) -> Path:
        src = make_model(root / "bf16", arch=self.arch, dtype="bf16", seed=seed, **SIZES)
        out = root / "repacked"
        repack(src, out, self.spec(), shard_size=40_000)
        return out


CASES = [RepackCase(a, s) for a in ARCHS for s in ("int4-min", "int8")] + [
    RepackCase("qwen3_moe", "int4"),
    RepackCase("qwen2_moe", "int4-min", {"dense": True}),      # attention, shared expert: int8
    RepackCase("qwen3_moe", "int8", {"dense": True}),
]
PARAMS = [pytest.param(c, id=c.id) for c in CASES]


@pytest.mark.parametrize("case", PARAMS)
def test_the_repacked_checkpoint_is_sharded_and_natively_quantised(lowbit_oracle, case):
    ref = lowbit_oracle.reference(case)
    assert len(list(ref.model_dir.glob("*.safetensors"))) >= 3
    quant = json.loads((ref.model_dir / "config.json").read_text())["quantization_config"]
    spec = case.spec()
    assert (quant["scheme"], quant["group_size"], quant["min"]) == (
        spec.experts.scheme, spec.experts.group_size, spec.experts.min)
    formats = lowbit_oracle.moed(case)[3]
    assert formats["experts"] == spec.experts.scheme
    dense = formats["dense_formats"]
    assert ("int8" in dense) == bool(case.options.get("dense"))
    assert "bf16" in dense                      # routers (and lm_head) are never quantised


@pytest.mark.parametrize("case", PARAMS)
def test_moed_matches_transformers_on_the_dequantised_weights(lowbit_oracle, case):
    """Greedy tokens identical; teacher-forced and step logits within 1e-4 x max |logit|."""
    ref = lowbit_oracle.reference(case)
    tokens, steps, teacher, _ = lowbit_oracle.moed(case)
    assert (len(ref.prompt), len(tokens)) == (PROMPT_LEN, NEW_TOKENS) and tokens == ref.tokens
    assert_logits_close(teacher, ref.teacher_logits, "teacher-forced logits")
    assert_logits_close(steps, ref.step_logits, "greedy step logits")


PLACEMENT = [pytest.param(c, id=c.id) for c in CASES if c.arch == "qwen2_moe"]


@pytest.mark.parametrize("case", PLACEMENT)
@pytest.mark.parametrize("n_threads, experts", [(1, "mmap"), (2, "resident"), (1, "resident")],
                         ids=["threads1-mmap", "threads2-resident", "threads1-resident"])
def test_threads_and_residency_do_not_change_a_bit(lowbit_oracle, case, n_threads, experts):
    assert_placement_invisible(lowbit_oracle.reference(case), lowbit_oracle.moed(case),
                               n_threads=n_threads, experts=experts)
