"""Tests for ext/formats/checkpoint.py: header parsing, validation errors, loads, fingerprint.

Valid checkpoints are written with ``safetensors.numpy.save_file`` (the reference writer);
broken ones are written byte by byte so that each defect can be produced on its own.
"""

import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from ext.formats.checkpoint import (Checkpoint, CheckpointError, HeaderError, MissingShardError,
                                    MissingTensorError, TensorInfo, TensorOverlapError,
                                    TensorRangeError, TruncatedFileError, UnsupportedDtypeError,
                                    read_header)


def write_raw(path, header, data=b"", header_len=None):
    """Write a safetensors file by hand: <Q N> + header (dict -> JSON, or raw bytes) + data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def write_index(model_dir, weight_map):
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


@pytest.fixture
def model(tmp_path):
    """A two-shard bf16/f16/f32 checkpoint with index and config; returns (dir, arrays)."""
    rng = np.random.default_rng(0)
    shard1 = {
        "model.embed_tokens.weight": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
        "model.layers.0.mlp.experts.0.down_proj.weight":
            rng.standard_normal((4, 6)).astype(np.float16),
        "model.norm.weight": rng.standard_normal(4).astype(np.float32),
    }
    shard2 = {
        "model.layers.0.mlp.experts.1.down_proj.weight":
            rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16),
        "model.layers.0.mlp.gate.weight": rng.standard_normal((2, 4)).astype(np.float32),
        "lm_head.weight": rng.standard_normal((8, 4)).astype(np.float16),
    }
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file(shard1, str(tmp_path / names[0]))
    save_file(shard2, str(tmp_path / names[1]))
    write_index(tmp_path, {**{k: names[0] for k in shard1}, **{k: names[1] for k in shard2}})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "test", "hidden_size": 4}))
    return tmp_path, {**shard1, **shard2}


def test_round_trip_loads_native_dtypes_from_recorded_offsets(model):
    model_dir, arrays = model
    with Checkpoint(model_dir) as ckpt:
        assert ckpt.model_dir == model_dir
        assert ckpt.shards == sorted(str(p) for p in model_dir.glob("*.safetensors"))
        assert set(ckpt.tensors) == set(arrays)
        assert ckpt.total_bytes == sum(a.nbytes for a in arrays.values())
        for name, expected in arrays.items():
            info = ckpt.info(name)
            assert name in ckpt
            assert os.path.isabs(info.path)
            assert (info.shape, info.nbytes) == (expected.shape, expected.nbytes)
            assert info.dtype == {"bfloat16": "BF16", "float16": "F16",
                                  "float32": "F32"}[expected.dtype.name]
            with open(info.path, "rb") as f:
                f.seek(info.offset)
                assert f.read(info.nbytes) == expected.tobytes()
            got = ckpt.load(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert got.tobytes() == expected.tobytes()
            assert got.flags.c_contiguous and got.flags.writeable and got.flags.owndata
        assert "model.layers.9.mlp.gate.weight" not in ckpt


def test_offset_is_absolute_first_data_byte(tmp_path):
    data = np.arange(3, dtype=np.float32).tobytes() + np.arange(2, dtype=np.float16).tobytes()
    header = {"__metadata__": {"format": "pt"},
              "a": entry("F32", [3], 0, 12), "b": entry("F16", [2], 12, 16)}
    path = write_raw(tmp_path / "x.safetensors", header, data)
    n = len(json.dumps(header).encode())
    infos = read_header(path)
    assert infos == {
        "a": TensorInfo("a", str(path), 8 + n, 12, "F32", (3,)),
        "b": TensorInfo("b", str(path), 8 + n + 12, 4, "F16", (2,)),
    }


def test_fingerprint_stable_across_reopen_and_follows_config(model):
    model_dir, _ = model
    with Checkpoint(model_dir) as ckpt:
        first = ckpt.fingerprint()
    with Checkpoint(model_dir) as ckpt:
        assert ckpt.fingerprint() == first
    (model_dir / "config.json").write_text(json.dumps({"model_type": "test", "hidden_size": 5}))
    with Checkpoint(model_dir) as ckpt:
        changed = ckpt.fingerprint()
    assert len(first) == 64 and changed != first


def test_fingerprint_survives_moving_the_directory(model, tmp_path_factory):
    model_dir, _ = model
    moved = tmp_path_factory.mktemp("elsewhere") / "model"
    with Checkpoint(model_dir) as ckpt:
        before = ckpt.fingerprint()
    shutil.copytree(model_dir, moved)
    with Checkpoint(moved) as ckpt:
        assert ckpt.fingerprint() == before


def test_single_file_with_unloadable_dtype_opens_but_refuses_load(tmp_path):
    f32 = np.array([1.5, -2.0], dtype=np.float32)
    i64 = np.array([7, 8, 9], dtype=np.int64)
    write_raw(tmp_path / "model.safetensors",
              {"w": entry("F32", [2], 0, 8), "ids": entry("I64", [3], 8, 32)},
              f32.tobytes() + i64.tobytes())
    with Checkpoint(tmp_path) as ckpt:
        assert ckpt.shards == [str(tmp_path / "model.safetensors")]
        np.testing.assert_array_equal(ckpt.load("w"), f32)
        assert ckpt.info("ids").nbytes == 24
        with pytest.raises(UnsupportedDtypeError) as err:
            ckpt.load("ids")
    assert "model.safetensors" in str(err.value) and "'ids'" in str(err.value)
    assert "I64" in str(err.value) and err.value.tensor == "ids"


def test_index_wins_over_single_file(model):
    model_dir, arrays = model
    write_raw(model_dir / "model.safetensors", {"stray": entry("F32", [1], 0, 4)}, b"\0" * 4)
    with Checkpoint(model_dir) as ckpt:
        assert "stray" not in ckpt and set(ckpt.tensors) == set(arrays)


def test_tensors_missing_from_index_are_ignored(model):
    model_dir, arrays = model
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    del index["weight_map"]["lm_head.weight"]
    write_index(model_dir, index["weight_map"])
    with Checkpoint(model_dir) as ckpt:
        assert "lm_head.weight" not in ckpt and len(ckpt.tensors) == len(arrays) - 1


def test_empty_and_scalar_tensors_load(tmp_path):
    header = {"empty": entry("BF16", [0, 4], 0, 0), "scalar": entry("F32", [], 0, 4)}
    write_raw(tmp_path / "model.safetensors", header, np.float32(3.25).tobytes())
    with Checkpoint(tmp_path) as ckpt:
        empty, scalar = ckpt.load("empty"), ckpt.load("scalar")
    assert empty.shape == (0, 4) and empty.dtype == ml_dtypes.bfloat16
    assert scalar.shape == () and scalar.item() == 3.25


def test_read_only_files_load(model):
    model_dir, arrays = model
    for p in model_dir.iterdir():
        p.chmod(0o444)
    model_dir.chmod(0o555)
    try:
        with Checkpoint(model_dir) as ckpt:
            for name, expected in arrays.items():
                assert ckpt.load(name).tobytes() == expected.tobytes()
    finally:
        model_dir.chmod(0o755)


def test_load_after_close_raises(model):
    model_dir, _ = model
    ckpt = Checkpoint(model_dir)
    ckpt.load("model.norm.weight")
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.load("model.norm.weight")


# --- One test per defect: exception type, and a message naming the file and tensor. ---

def assert_names(err, path, tensor=None):
    message = str(err.value)
    assert path.name in message and err.value.path == str(path)
    assert err.value.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in message


def test_file_shorter_than_eight_bytes(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x05\0\0")
    with pytest.raises(HeaderError) as err:
        read_header(path)
    assert_names(err, path)


def test_header_length_beyond_file(tmp_path):
    path = write_raw(tmp_path / "long.safetensors", {"a": entry("F32", [1], 0, 4)}, b"\0" * 4,
                     header_len=10_000)
    with pytest.raises(HeaderError, match="10000") as err:
        read_header(path)
    assert_names(err, path)


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe{}", b"[1, 2]",
                                 b'{"a": 1, "a": 2}', b'{"__metadata__": 3}'])
def test_header_not_a_json_object(tmp_path, raw):
    path = write_raw(tmp_path / "bad.safetensors", raw)
    with pytest.raises(HeaderError) as err:
        read_header(path)
    assert_names(err, path)


@pytest.mark.parametrize("bad", [
    {"shape": [1], "data_offsets": [0, 4]},
    {"dtype": "F32", "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [1]},
    {"dtype": 4, "shape": [1], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [1], "data_offsets": [0]},
    {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]},
    [1, 2],
])
def test_malformed_entry(tmp_path, bad):
    path = write_raw(tmp_path / "entry.safetensors", {"w.weight": bad}, b"\0" * 4)
    with pytest.raises(HeaderError) as err:
        read_header(path)
    assert_names(err, path, "w.weight")


def test_file_shorter_than_last_tensor(tmp_path):
    header = {"first": entry("F32", [2], 0, 8), "last": entry("F32", [4], 8, 24)}
    path = write_raw(tmp_path / "cut.safetensors", header, b"\0" * 20)
    with pytest.raises(TruncatedFileError) as err:
        read_header(path)
    assert_names(err, path, "last")


def test_bytes_after_the_last_tensor_are_read_past_with_one_warning(model, log_records):
    model_dir, arrays = model
    records = log_records("moed.checkpoint")
    with Checkpoint(model_dir):
        pass
    assert records == []                               # what save_file writes: no warning
    shard = model_dir / "model-00002-of-00002.safetensors"
    size = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\xde\xad" * 50)                      # 100 bytes nobody indexed
    with Checkpoint(model_dir) as ck:
        np.testing.assert_array_equal(ck.load("lm_head.weight"), arrays["lm_head.weight"])
    with Checkpoint(model_dir):                        # opened again: said once
        pass
    [warning] = records
    assert (warning["event"], warning["level"]) == ("shard_trailing_bytes", "warning")
    assert warning["path"] == str(shard) and warning["trailing_bytes"] == 100
    assert (warning["data_end"], warning["file_bytes"]) == (size, size + 100)


def test_range_disagrees_with_shape_times_dtype(tmp_path):
    path = write_raw(tmp_path / "size.safetensors", {"w": entry("BF16", [2, 3], 0, 24)},
                     b"\0" * 24)
    with pytest.raises(TensorRangeError, match="needs 12") as err:
        read_header(path)
    assert_names(err, path, "w")


def test_range_runs_backwards(tmp_path):
    path = write_raw(tmp_path / "back.safetensors", {"w": entry("F32", [0], 8, 4)}, b"\0" * 8)
    with pytest.raises(TensorRangeError, match="backwards") as err:
        read_header(path)
    assert_names(err, path, "w")


def test_overlapping_ranges_name_both_tensors(tmp_path):
    header = {"a": entry("F32", [4], 0, 16), "b": entry("F32", [2], 12, 20)}
    path = write_raw(tmp_path / "lap.safetensors", header, b"\0" * 20)
    with pytest.raises(TensorOverlapError) as err:
        read_header(path)
    assert_names(err, path, "b")
    assert "'a'" in str(err.value)


def test_range_inside_another_overlaps(tmp_path):
    header = {"big": entry("F32", [8], 0, 32), "mid": entry("F32", [1], 20, 24),
              "tail": entry("F32", [1], 32, 36)}
    path = write_raw(tmp_path / "nest.safetensors", header, b"\0" * 36)
    with pytest.raises(TensorOverlapError) as err:
        read_header(path)
    assert_names(err, path, "mid")
    assert "'big'" in str(err.value)


def test_unknown_dtype_rejected_at_open(tmp_path):
    write_raw(tmp_path / "model.safetensors", {"w": entry("F7", [1], 0, 1)}, b"\0")
    with pytest.raises(UnsupportedDtypeError, match="F7") as err:
        Checkpoint(tmp_path)
    assert_names(err, tmp_path / "model.safetensors", "w")


def test_index_names_missing_shard(model):
    model_dir, _ = model
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(MissingShardError) as err:
        Checkpoint(model_dir)
    assert_names(err, model_dir / "model-00002-of-00002.safetensors", "lm_head.weight")


def test_index_maps_tensor_to_shard_lacking_it(model):
    model_dir, _ = model
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    write_index(model_dir, index["weight_map"])
    with pytest.raises(MissingTensorError) as err:
        Checkpoint(model_dir)
    assert_names(err, model_dir / "model-00001-of-00002.safetensors", "lm_head.weight")


def test_unknown_tensor_via_load_and_info(model):
    model_dir, _ = model
    with Checkpoint(model_dir) as ckpt:
        for lookup in (ckpt.load, ckpt.info):
            with pytest.raises(MissingTensorError) as err:
                lookup("model.layers.7.mlp.gate.weight")
            assert_names(err, model_dir, "model.layers.7.mlp.gate.weight")


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="model.safetensors") as err:
        Checkpoint(tmp_path)
    assert_names(err, tmp_path)


def test_bad_shard_header_in_sharded_model_names_the_shard(model):
    model_dir, _ = model
    shard = model_dir / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(TruncatedFileError) as err:
        Checkpoint(model_dir)
    assert_names(err, shard, "lm_head.weight")


@pytest.mark.parametrize("raw, tensor", [
    (b"{weight_map", None),
    (b'{"metadata": {}}', None),
    (b'{"weight_map": ["a"]}', None),
    (b"[]", None),
    (b'{"weight_map": {"w": "../model.safetensors"}}', "w"),
    (b'{"weight_map": {"w": 3}}', "w"),
])
def test_malformed_index(model, raw, tensor):
    model_dir, _ = model
    index_path = model_dir / "model.safetensors.index.json"
    index_path.write_bytes(raw)
    with pytest.raises(HeaderError) as err:
        Checkpoint(model_dir)
    assert_names(err, index_path, tensor)
