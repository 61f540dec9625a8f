"""Expert addressing (ExpertLayout), the simple providers, and load-time validation."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from ext.formats.checkpoint import (Checkpoint, MissingTensorError, TensorRangeError,
                                    TruncatedFileError)
from ext.kernels._kernels import QuantizedWeight
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import (ExpertLayout, MmapExpertProvider, ResidentExpertProvider,
                                expert_tensor_name)
from ext.models.model import Model

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("experts")
    return {arch: make_model(root / arch, arch=arch, layers=2, experts=4, top_k=2, hidden=64,
                             intermediate=32, dtype="bf16", shard_size=30_000, seed=3,
                             initializer_range=0.1)
            for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_gives_file_offset_length_dtype_shape(models, arch):
    ckpt = Checkpoint(models[arch])
    layout = ExpertLayout(ckpt, load_config(models[arch]))
    assert len(layout) == 2 * 4
    loc = layout[(1, 3)]
    assert loc.gate.name == expert_tensor_name(arch, 1, 3, "gate")
    assert (loc.gate.shape, loc.up.shape, loc.down.shape) == ((32, 64), (32, 64), (64, 32))
    assert loc.gate.format == "bf16" and loc.nbytes == 3 * 32 * 64 * 2
    assert [p.dtype for p in loc.pieces()] == ["BF16"] * 3
    # the byte range really holds the tensor
    for info in loc.pieces():
        with open(info.path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.nbytes)
        assert raw == ckpt.load(info.name).tobytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_mmap_and_resident_providers_agree(models, arch):
    ckpt = Checkpoint(models[arch])
    layout = ExpertLayout(ckpt, load_config(models[arch]))
    mm, res = MmapExpertProvider(layout), ResidentExpertProvider(ckpt, layout)
    for a, b in zip(mm.acquire(0, [2, 0]), res.acquire(0, [2, 0])):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint16), y.view(np.uint16))
    with pytest.raises(KeyError):
        res.acquire(5, [0])
    mm.close()
    res.close()


def test_a_shard_cut_after_the_acquire_fails_the_release_and_is_mapped_again(tmp_path):
    """The cut falls between acquire's size check and the kernels' reads: the reads see
    zeros (no SIGBUS), release raises TruncatedFileError naming the file, and once the
    file is whole the next acquire maps it again and serves the stored bytes."""
    d = make_model(tmp_path / "m", arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=64,
                   intermediate=32, dtype="bf16", shard_size=30_000, seed=3)
    ckpt = Checkpoint(d)
    layout = ExpertLayout(ckpt, load_config(d))
    mm, res = MmapExpertProvider(layout), ResidentExpertProvider(ckpt, layout)
    loc = layout[(1, 3)]
    path = loc.gate.pieces[0].path
    here = [i for i in loc.pieces() if i.path == path]
    saved = Path(path).read_bytes()
    weights = mm.acquire(1, [3])                            # the size check passes
    os.truncate(path, min(i.offset for i in here))
    cut = [w for w, stored in zip(weights[0], loc.projections())
           if stored is not None and stored.pieces[0].path == path]
    assert cut and all(np.count_nonzero(w.view(np.uint16)) == 0 for w in cut)   # zeros, alive
    with pytest.raises(TruncatedFileError, match="truncated while served") as err:
        mm.release(1, [3])
    assert err.value.path == path and path in mm.failing()
    del weights, cut
    Path(path).write_bytes(saved)
    assert mm.failing() is None
    for a, b in zip(mm.acquire(1, [3])[0], res.acquire(1, [3])[0]):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    mm.release(1, [3])
    mm.close()
    res.close()


def test_a_shard_truncated_then_replaced_by_rename_is_opened_again_from_its_path(tmp_path):
    """A shard cut, then restored as rsync or `cp` + `mv` do (a whole copy renamed over
    it): the open file (the path's old inode) stays short, and the error says so; the
    first acquire after the rename opens the file the path names and serves its bytes,
    and failing() is None once the path's file is whole."""
    d = make_model(tmp_path / "m", arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=64,
                   intermediate=32, dtype="bf16", shard_size=30_000, seed=3)
    ckpt = Checkpoint(d)
    layout = ExpertLayout(ckpt, load_config(d))
    mm, res = MmapExpertProvider(layout), ResidentExpertProvider(ckpt, layout)
    loc = layout[(1, 3)]
    path = loc.gate.pieces[0].path
    cut_at = min(i.offset for i in loc.pieces() if i.path == path)
    saved = Path(path).read_bytes()
    mm.acquire(1, [3])
    mm.release(1, [3])
    os.truncate(path, cut_at)
    with pytest.raises(TruncatedFileError, match=f"ends at byte {cut_at},"):
        mm.acquire(1, [3])
    assert path in mm.failing()
    Path(path + ".new").write_bytes(saved)
    os.rename(path + ".new", path)                      # the old inode stays cut
    assert mm.failing() is None
    for a, b in zip(mm.acquire(1, [3])[0], res.acquire(1, [3])[0]):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    mm.release(1, [3])
    assert mm.failing() is None
    mm.close()
    res.close()


def test_a_cut_shard_removed_from_its_path_is_named_as_the_open_file(tmp_path):
    """The open file is short and the path names no file: the error says the bytes end
    in the file open under that path, not in a file the path names."""
    d = make_model(tmp_path / "m", arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=64,
                   intermediate=32, dtype="bf16", shard_size=30_000, seed=3)
    layout = ExpertLayout(Checkpoint(d), load_config(d))
    mm = MmapExpertProvider(layout)
    path = layout[(1, 3)].gate.pieces[0].path
    mm.acquire(1, [3])
    mm.release(1, [3])
    os.truncate(path, 100)
    os.rename(path, path + ".old")
    with pytest.raises(TruncatedFileError, match=r"the file open as .* \(since removed or "
                                                 r"replaced there\) ends at byte 100,"):
        mm.acquire(1, [3])
    mm.close()


@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_lowbit_experts_stay_in_their_stored_format(tmp_path, dtype):
    """Both providers hand out QuantizedWeights over the stored bytes (no conversion)."""
    d = make_model(tmp_path / dtype, arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=64,
                   intermediate=32, dtype=dtype, shard_size=30_000, seed=3)
    ckpt = Checkpoint(d)
    layout = ExpertLayout(ckpt, load_config(d))
    loc = layout[(1, 2)]
    assert layout.format == {"fp8": "fp8_e4m3", "mxfp4": "mxfp4"}[dtype]
    mm, res = MmapExpertProvider(layout), ResidentExpertProvider(ckpt, layout)
    for a, b, stored in zip(mm.acquire(1, [2])[0], res.acquire(1, [2])[0], loc.projections()):
        assert isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight)
        assert a.fmt == b.fmt == stored.format and a.shape == b.shape == stored.shape
        assert a.nbytes == b.nbytes == stored.nbytes
        for x, y, piece in zip((a.codes, a.scales), (b.codes, b.scales), stored.pieces):
            assert x.tobytes() == y.tobytes() == ckpt.read(piece).tobytes()
        assert not a.codes.flags.writeable          # a view of the read-only map
    mm.close()
    res.close()
    ckpt.close()


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_missing_expert_projection_is_named(models, tmp_path):
    d = _copy(models["qwen3_moe"], tmp_path / "m")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    victim = expert_tensor_name("qwen3_moe", 1, 2, "up")
    del index["weight_map"][victim]
    index_path.write_text(json.dumps(index))
    with pytest.raises(MissingTensorError) as e:
        Model.load(d)
    assert victim in str(e.value)


def test_expert_shape_disagreeing_with_config_is_named(models, tmp_path):
    d = _copy(models["olmoe"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 16
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TensorRangeError) as e:
        Model.load(d)
    assert expert_tensor_name("olmoe", 0, 0, "gate") in str(e.value)
    assert "config" in str(e.value)


def test_missing_dense_tensor_is_named(models, tmp_path):
    d = _copy(models["mixtral"], tmp_path / "m")
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.1.self_attn.k_proj.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(MissingTensorError) as e:
        Model.load(d)
    assert "model.layers.1.self_attn.k_proj.weight" in str(e.value)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_and_moed_agree_on_make_model_output(models, arch):
    """What make-model writes, transformers loads and moed computes the same way."""
    ref = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32).eval()
    ids = np.random.default_rng(1).integers(0, 256, 24)
    with torch.no_grad():
        expected = ref(torch.tensor(ids[None])).logits[0].numpy()
    model = Model.load(models[arch], n_threads=2, numerics="exact")
    got = model.forward(model.new_sequence(), ids, all_logits=True)
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.9


def test_experts_with_nan_weights_are_named_not_the_next_router(tmp_path):
    """NaN in layer 1's experts: the error names layer 1 and its experts (in prefill and in
    decode), not layer 2's router, which would see the NaN next."""
    d = make_model(tmp_path / "m", arch="qwen3_moe", layers=3, experts=4, top_k=2, hidden=64,
                   intermediate=32, dtype="bf16", seed=2)
    with Checkpoint(d) as ckpt:
        infos = [ckpt.info(f"model.layers.1.mlp.experts.{e}.down_proj.weight") for e in range(4)]
    for info in infos:                       # bf16 NaN (0x7fc0) in every weight of the tensor
        with open(info.path, "r+b") as f:
            f.seek(info.offset)
            f.write(b"\xc0\x7f" * (info.nbytes // 2))
    model = Model.load(d, n_threads=1)
    for prompt in ([1, 2, 3, 4, 5], [7]):
        with pytest.raises(ValueError, match=r"^layer 1: routed experts [0-3](, [0-3])+ produced NaN or inf"):
            model.forward(model.new_sequence(), prompt)
    model.close()


def test_experts_that_produced_nan_stay_named_until_their_rows_are_finite_again(tmp_path):
    """Model.broken_weights (what /health reports) names the experts whose output held NaN
    while their weights stay broken, and forgets each once it computes finite rows."""
    d = make_model(tmp_path / "m", arch="qwen3_moe", layers=3, experts=4, top_k=2, hidden=64,
                   intermediate=32, dtype="bf16", seed=2)
    with Checkpoint(d) as ckpt:
        infos = [ckpt.info(f"model.layers.1.mlp.experts.{e}.down_proj.weight") for e in range(4)]
    saved = []
    for info in infos:
        with open(info.path, "r+b") as f:
            f.seek(info.offset)
            saved.append(f.read(info.nbytes))
            f.seek(info.offset)
            f.write(b"\xc0\x7f" * (info.nbytes // 2))
    model = Model.load(d, n_threads=1)
    assert model.broken_weights() is None
    for prompt in ([1, 2, 3, 4, 5], [7], [9]):
        with pytest.raises(ValueError, match="^layer 1: "):
            model.forward(model.new_sequence(), prompt)
        assert model.broken_weights().startswith("layer 1: experts ")
    assert {l for l, _ in model.broken_experts} == {1}
    model.close()
    for info, data in zip(infos, saved):     # the weights are whole again
        with open(info.path, "r+b") as f:
            f.seek(info.offset)
            f.write(data)
    model = Model.load(d, n_threads=1)
    model.broken_experts = frozenset({(1, e) for e in range(4)})
    model.forward(model.new_sequence(), list(range(1, 60)))     # routes to every expert
    assert model.broken_weights() is None
    model.close()
