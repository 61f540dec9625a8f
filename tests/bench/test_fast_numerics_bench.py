"""bench/fast_numerics.py's MXFP4 writer: a bf16 make-model checkpoint re-encoded as MXFP4
loads in moed, and its experts are the OCP MX reading of the source, checked against
tests/quant_reference.py's independent decoder."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from quant_reference import dequantize_mxfp4
from safetensors import safe_open

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import fast_numerics  # noqa: E402

from ext.formats.checkpoint import Checkpoint  # noqa: E402
from ext.makemodel import make_model  # noqa: E402
from ext.models.model import Model  # noqa: E402
from ext.models.weights import weight_values  # noqa: E402

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast-numerics")
    src = make_model(root / "bf16", arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=64,
                     intermediate=32, dtype="bf16", seed=5)
    return src, fast_numerics.write_mxfp4(src, root / "mxfp4")


def _tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor as stored; bf16 as ml_dtypes.bfloat16 (safetensors' numpy reader has
    no bf16: read through its torch reader)."""
    out = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = (t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                             if t.dtype == torch.bfloat16 else t.numpy())
    return out


def test_the_mxfp4_model_loads_and_its_experts_are_the_mx_reading_of_the_source(converted):
    src, out = converted
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    source, written = _tensors(src), _tensors(out)
    model = Model.load(out, n_threads=1, experts="resident")
    try:
        assert model.weight_formats()["experts"] == "mxfp4"
        checked = 0
        for loc in model.layout:
            for w in loc.projections():
                base = w.name.removesuffix(".weight")
                blocks, scales = written[base + ".weight_blocks"], written[base + ".weight_scales"]
                R, C = w.shape
                assert blocks.shape == (R, C // 32, 16) and scales.shape == (R, C // 32)
                assert blocks.dtype == np.uint8 and scales.dtype == np.uint8
                decoded = dequantize_mxfp4(blocks, scales)
                np.testing.assert_array_equal(weight_values(model.checkpoint, w), decoded)

                x = source[w.name].astype(np.float32).reshape(R, C // 32, 32)
                amax = np.abs(x).max(axis=-1)
                assert (amax > 0).all()
                scale = np.exp2(np.floor(np.log2(amax)) - 2)     # OCP MX: emax of E2M1 is 2
                np.testing.assert_array_equal(scales.astype(np.int64) - 127,
                                              np.floor(np.log2(amax)) - 2)
                v = x / scale[..., None]                          # in [-8, 8)
                d = decoded.reshape(R, C // 32, 32) / scale[..., None]
                assert np.isin(np.abs(d), E2M1_GRID).all()        # on the E2M1 grid
                target = np.clip(v, -6, 6)                        # saturating at 6
                nearest = np.abs(np.abs(target)[..., None] - E2M1_GRID).min(axis=-1)
                # the nearest grid point (within half a grid step), sign kept
                np.testing.assert_allclose(np.abs(target - d), nearest, rtol=0, atol=1e-6)
                assert (np.sign(d) * np.sign(v) >= 0).all()
                checked += 1
        assert checked == 2 * 4 * 3
    finally:
        model.close()
    others = [n for n in source if ".mlp.experts." not in n]
    assert others and all(n in written for n in others)
    for n in others:                                               # verbatim
        assert written[n].dtype == source[n].dtype
        assert written[n].tobytes() == source[n].tobytes()
    assert not any(n.endswith(".weight") and ".mlp.experts." in n for n in written)


def test_a_quantised_source_is_refused(converted, tmp_path):
    _, out = converted
    with pytest.raises(ValueError, match="already quantised"):
        fast_numerics.write_mxfp4(out, tmp_path / "again")


def test_format_names_resolve_to_moed_repacks_defaults():
    spec = fast_numerics.repack_spec("int4")
    assert (spec.experts.scheme, spec.experts.group_size, spec.experts.min) == ("int4", 32, True)
    assert spec.method == "search"
    assert fast_numerics.repack_spec("int8").experts.group_size == 32
    assert fast_numerics.repack_spec("int4-g64").experts.group_size == 64
