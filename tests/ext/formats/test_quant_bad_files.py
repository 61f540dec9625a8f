"""Damaged low-bit checkpoints: each gives one error naming the file and the tensor (or
config.json and the field) — from `Model.load`, from `moed generate` (exit 1, one line)
and from `moed serve` (exit 1, the `model_load_failed` log line)."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ext.formats.checkpoint import Checkpoint, CheckpointError
from ext.formats.quant import (BadScaleError, FormatMismatchError, MissingPieceError,
                               PieceShapeError, QuantizationConfigError)
from ext.makemodel import make_model
from ext.models.model import Model

from checkpoint_files import edit_header

ROOT = Path(__file__).resolve().parents[3]
SIZES = dict(arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=64, intermediate=32,
             shard_size=20_000)
EXPERT = "model.layers.1.mlp.experts.2.up_proj"
DENSE = "model.layers.0.self_attn.k_proj"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lowbit-bad")
    return {name: make_model(root / name, **SIZES, **kw) for name, kw in (
        ("bf16", {}), ("fp8", {"dtype": "fp8"}), ("fp8-e8m0", {"dtype": "fp8", "scale_dtype": "e8m0"}),
        ("mxfp4", {"dtype": "mxfp4"}))}


@pytest.fixture
def copy(pristine, tmp_path):
    def get(name: str) -> Path:
        return Path(shutil.copytree(pristine[name], tmp_path / name))
    return get


def _index(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def _drop(d: Path, tensor: str) -> None:
    index = _index(d)
    del index["weight_map"][tensor]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _poke(d: Path, tensor: str, values: np.ndarray) -> Path:
    """Overwrite the first bytes of `tensor`'s data with `values`."""
    with Checkpoint(d) as ckpt:
        info = ckpt.info(tensor)
    with open(info.path, "r+b") as f:
        f.seek(info.offset)
        f.write(values.tobytes())
    return Path(info.path)


def _config(d: Path, edit) -> None:
    config = json.loads((d / "config.json").read_text())
    edit(config)
    (d / "config.json").write_text(json.dumps(config))


def _fails(d: Path, kind: type, *names: str) -> CheckpointError:
    with pytest.raises(kind) as e:
        Model.load(d, n_threads=1)
    for name in names:
        assert name in str(e.value), (name, str(e.value))
    return e.value


# ------------------------------------------------------------------------ pieces


@pytest.mark.parametrize("module", [EXPERT, DENSE])
def test_missing_scale_tensor(copy, module):
    d = copy("fp8")
    _drop(d, f"{module}.weight_scale_inv")
    shard = _index(d)["weight_map"][f"{module}.weight"]
    err = _fails(d, MissingPieceError, f"{module}.weight_scale_inv", shard)
    assert "block scales" in str(err)


@pytest.mark.parametrize("module", [EXPERT, DENSE])
def test_scale_grid_of_the_wrong_shape(copy, module):
    d = copy("fp8")
    shard = edit_header(d, f"{module}.weight_scale_inv", shape=[1, 1, 1])
    _fails(d, PieceShapeError, f"{module}.weight_scale_inv", shard.name, "needs [1, 1]")


@pytest.mark.parametrize("value", [np.nan, np.inf, -1.0], ids=["nan", "inf", "negative"])
@pytest.mark.parametrize("module", [EXPERT, DENSE])
def test_nan_inf_and_negative_scales(copy, module, value):
    d = copy("fp8")
    shard = _poke(d, f"{module}.weight_scale_inv", np.array([value], np.float32))
    _fails(d, BadScaleError, f"{module}.weight_scale_inv", shard.name, "NaN, infinite or negative")


@pytest.mark.parametrize("name, tensor", [("fp8-e8m0", f"{EXPERT}.weight_scale_inv"),
                                          ("fp8-e8m0", f"{DENSE}.weight_scale_inv"),
                                          ("mxfp4", f"{EXPERT}.weight_scales")])
def test_e8m0_255(copy, name, tensor):
    d = copy(name)
    shard = _poke(d, tensor, np.array([255], np.uint8))
    _fails(d, BadScaleError, tensor, shard.name, "255 (NaN)")


def test_blocks_and_scales_that_disagree(copy):
    d = copy("mxfp4")
    shard = edit_header(d, f"{EXPERT}.weight_scales", shape=[16, 4])   # same bytes, other shape
    _fails(d, PieceShapeError, f"{EXPERT}.weight_scales", shard.name, "needs [32, 2]")


def test_blocks_without_their_scales(copy):
    d = copy("mxfp4")
    _drop(d, f"{EXPERT}.weight_scales")
    _fails(d, MissingPieceError, f"{EXPERT}.weight_scales")


# ------------------------------------------------------------------------ config and tensors


@pytest.mark.parametrize("field, value, what", [
    ("quant_method", "awq", "'awq' is not supported (supported: fp8, "),
    ("fmt", "e5m2", "'e5m2' is not supported"),
    ("activation_scheme", "static", "'static' is not supported"),
    ("scale_fmt", "ue4m3", "'ue4m3' is not supported"),
])
def test_unknown_quant_method_fmt_or_scheme(copy, field, value, what):
    d = copy("fp8")
    _config(d, lambda c: c["quantization_config"].__setitem__(field, value))
    err = _fails(d, QuantizationConfigError, "config.json", f"quantization_config.{field}", what)
    assert err.field == f"quantization_config.{field}"


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
Q = "model.layers.0.mlp.experts.0.gate_proj.weight"          # the first weight a load resolves


@pytest.mark.parametrize("model, quantization_config, tensor, what", [
    ("bf16", FP8_CONFIG, Q, "dtype BF16, but config.json's quantization_config (quant_method 'fp8')"),
    ("fp8", None, Q, "stored as fp8_e4m3, but config.json has no quantization_config"),
    ("fp8", {"quant_method": "mxfp4"}, Q, "quant_method 'mxfp4' stores mxfp4"),
    ("mxfp4", None, "model.layers.0.mlp.experts.0.gate_proj.weight_blocks",
     "stored as mxfp4, but config.json has no quantization_config"),
    ("mxfp4", FP8_CONFIG, "model.layers.0.mlp.experts.0.gate_proj.weight_blocks",
     "quant_method 'fp8' stores fp8_e4m3"),
], ids=["fp8-config-bf16-tensors", "fp8-tensors-no-config", "mxfp4-config-fp8-tensors",
        "mxfp4-tensors-no-config", "fp8-config-mxfp4-tensors"])
def test_config_and_tensors_that_disagree(copy, model, quantization_config, tensor, what):
    d = copy(model)
    _config(d, lambda c: c.pop("quantization_config", None) if quantization_config is None
            else c.__setitem__("quantization_config", quantization_config))
    _fails(d, FormatMismatchError, tensor, what)


def test_e8m0_scales_without_scale_fmt_ue8m0(copy):
    d = copy("fp8-e8m0")
    _config(d, lambda c: c["quantization_config"].pop("scale_fmt"))
    _fails(d, PieceShapeError, "weight_scale_inv", "dtype U8", "scale_fmt 'ue8m0'")


def test_an_fp8_embedding_is_refused(copy):
    """Embeddings, norms and biases are read as stored, in f32/f16/bf16 only."""
    d = copy("fp8")
    with Checkpoint(d) as ckpt:
        embed = ckpt.info("model.embed_tokens.weight")
    shard = Path(embed.path)
    n = struct.unpack("<Q", shard.read_bytes()[:8])[0]
    begin = embed.offset - 8 - n
    edit_header(d, embed.name, dtype="F8_E4M3", data_offsets=[begin, begin + embed.nbytes // 2])
    _fails(d, CheckpointError, embed.name, shard.name, "dtype F8_E4M3")


# ------------------------------------------------------------------------ the commands


def _moed(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daemon.commands.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_generate_reports_a_bad_scale_in_one_line_and_exits_1(copy):
    d = copy("fp8")
    shard = _poke(d, f"{EXPERT}.weight_scale_inv", np.array([np.nan], np.float32))
    proc = _moed("generate", "--model", str(d), "--max-tokens", "2", "hi")
    assert proc.returncode == 1 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [f"moed generate: error: {shard}: tensor '{EXPERT}.weight_scale_inv': 1 of 1 "
                      "scales are NaN, infinite or negative (first: np.float32(nan) at [0, 0])"]


def test_serve_reports_a_config_tensor_mismatch_and_exits_1(copy):
    from daemon_proc import Daemon, short_dir
    d = copy("mxfp4")
    _config(d, lambda c: c.__setitem__("quantization_config", {"quant_method": "fp8"}))
    workdir = short_dir()
    try:
        daemon = Daemon(d, workdir, wait_ready=False)
        assert daemon.wait_exit(120) == 1
        (failed,) = [e for e in daemon.events if e["event"] == "model_load_failed"]
        assert "model.layers.0.mlp.experts.0.gate_proj.weight_blocks" in failed["error"]
        assert "stored as mxfp4" in failed["error"] and str(d) in failed["error"]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
