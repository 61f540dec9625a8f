"""`moed repack`'s output: a spec-conforming, streaming-friendly model directory whose
config and tensors agree, and whose bad inputs are refused with the culprit named."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from checkpoint_files import FullFile, no_space
from daemon.commands.cli import main
from ext.formats.checkpoint import Checkpoint
from ext.formats.quant import QuantizationConfigError, QuantizationError
from ext.formats.repacked import ALIGNMENT, PADDING_PREFIX, QuantScheme
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout, expert_tensor_name
from ext.models.model import Model
from ext.models.weights import float_values
from ext.quant.importance import LayerwiseMoments, gather, moment_bytes
from ext.quant.repack import TEMP_LOCK, TEMP_MARK, RepackSpec, remove_stale_temporaries, repack

from checkpoint_files import edit_header

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A bf16 make-model checkpoint in several shards."""
    out = tmp_path_factory.mktemp("src") / "model"
    make_model(out, arch="qwen3_moe", layers=2, experts=6, top_k=2, hidden=64, intermediate=64,
               dtype="bf16", shard_size=40_000, initializer_range=0.1)
    return out


@pytest.fixture(scope="module")
def repacked(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("rp") / "int4"
    assert main(["repack", "--model", str(source), "--scheme", "int4", "--out", str(out),
                 "--shard-size", "64K"]) == 0
    return out


def _raw_config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _experts(d: Path) -> dict:
    """Weight name -> StoredWeight of every routed expert projection, as moed reads them."""
    config = load_config(d)
    with Checkpoint(d) as ckpt:
        layout = ExpertLayout(ckpt, config)
    return {w.name: w for loc in layout for w in loc.projections()}


def _decode(scheme: QuantScheme, codes, scale, minimum):
    """Independent decode from the spec in docs/formats.md (low nibble first; g = min(g, C))."""
    if scheme.scheme == "int4":
        q = np.stack([codes & 15, codes >> 4], -1).reshape(codes.shape[0], -1).astype(np.float32)
        q = q if scheme.min else q - 8
    else:
        q = codes.astype(np.float32)
    g = q.shape[1] // scale.shape[1]
    out = q * np.repeat(scale.astype(np.float32), g, axis=1)
    if scheme.min:
        out = out + np.repeat(minimum.astype(np.float32), g, axis=1)
    return out


def test_the_output_is_valid_safetensors_without_holes(repacked):
    """The safetensors library (which refuses holes and overlaps) reads every shard, and
    each shard's data starts on a 4 KiB boundary of the file."""
    shards = sorted(repacked.glob("*.safetensors"))
    assert len(shards) >= 2
    for shard in shards:
        with safe_open(shard, "np") as f:
            for name in f.keys():
                if name.startswith(PADDING_PREFIX):
                    assert not f.get_tensor(name).any()
        with open(shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        assert (8 + n) % ALIGNMENT == 0


def test_config_lists_the_scheme_and_matches_the_tensors(repacked, source):
    raw = _raw_config(repacked)
    q = raw["quantization_config"]
    assert q["quant_method"] == "moed" and q["scheme"] == "int4" and q["group_size"] == 32
    assert q["min"] is True and q["dense"] is None
    assert q["source"] == {"experts_format": "bf16", "quantization_config": None}
    assert {k: v for k, v in raw.items() if k != "quantization_config"} == _raw_config(source)
    experts = _experts(repacked)
    assert len(experts) == 2 * 6 * 3 and {w.format for w in experts.values()} == {"int4"}
    with Checkpoint(repacked) as ckpt:
        assert not any(n.startswith(PADDING_PREFIX) for n in ckpt.tensors)   # not in the index
    model = Model.load(repacked, n_threads=1, numerics="exact")
    assert model.weight_formats()["quantization"] == {
        "quant_method": "moed", "scheme": "int4", "group_size": 32, "min": True,
        "label": "int4-g32-min", "dense": None}
    assert model.weight_formats()["experts"] == "int4"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (repacked / name).read_bytes() == (source / name).read_bytes()


def test_each_expert_is_one_aligned_read(repacked):
    """An expert's 9 tensors lie in one shard, start on 4 KiB, and sit back to back (gaps
    only to 64-byte tensor starts), so one aligned read of the expert's span covers them."""
    parts = _experts(repacked)
    for layer in range(2):
        for expert in range(6):
            infos = [i for p in ("gate", "up", "down")
                     for i in parts[expert_tensor_name("qwen3_moe", layer, expert, p)].pieces]
            assert len(infos) == 9 and len({i.path for i in infos}) == 1
            infos.sort(key=lambda i: i.offset)
            assert infos[0].offset % ALIGNMENT == 0
            assert all(i.offset % 64 == 0 for i in infos)
            for a, b in zip(infos, infos[1:]):
                assert 0 <= b.offset - (a.offset + a.nbytes) < 64


def test_values_decode_close_to_the_source_weights(repacked, source):
    """An independent decode of the codes is within one quantisation step of the bf16
    weights (every tensor, every group)."""
    scheme = QuantScheme("int4", 32, True)
    with Checkpoint(source) as src, Checkpoint(repacked) as rp:
        for name, w in _experts(repacked).items():
            codes, scale, mins = (rp.read(p) for p in w.pieces)
            values = _decode(scheme, codes, scale, mins)
            original = src.load(name).astype(np.float32)
            step = np.repeat(np.abs(scale.astype(np.float32)), 32, axis=1)
            assert values.shape == original.shape
            assert np.all(np.abs(values - original) <= step * 1.01 + 1e-6), name


def test_int8_with_dense_int8_quantises_attention_but_not_routers_or_embeddings(source, tmp_path):
    out = tmp_path / "int8"
    assert main(["repack", "--model", str(source), "--scheme", "int8", "--dense", "int8",
                 "--out", str(out)]) == 0
    q = _raw_config(out)["quantization_config"]
    assert q["scheme"] == "int8" and q["min"] is False and q["dense"]["scheme"] == "int8"
    model = Model.load(out, n_threads=1, numerics="exact")
    formats = {m: w.format for m, w in model.dense_weights.items()}
    assert formats["model.layers.0.self_attn.q_proj"] == "int8"
    assert formats["model.layers.0.mlp.gate"] == "bf16"           # the router
    assert model.weight_formats()["dense"] == "mixed" and model.layout.format == "int8"
    with Checkpoint(out) as ckpt:
        assert ckpt.info("model.embed_tokens.weight").dtype == "BF16"
        assert ckpt.info("lm_head.weight").dtype == "BF16"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_repacks(arch, tmp_path):
    src = tmp_path / "src"
    make_model(src, arch=arch, layers=2, experts=4, top_k=2, hidden=64, intermediate=32)
    out = tmp_path / "out"
    assert main(["repack", "--model", str(src), "--scheme", "int4", "--symmetric",
                 "--out", str(out)]) == 0
    parts = _experts(out)
    with Checkpoint(src) as s:
        layout = ExpertLayout(s, load_config(src))
        assert set(parts) == {w.name for loc in layout for w in loc.projections()}
    # down has C = 32 columns: one group of 32; gate/up C = 64: two groups
    down = parts[expert_tensor_name(arch, 0, 0, "down")]
    assert down.pieces[1].shape == (64, 1) and len(down.pieces) == 2
    assert parts[expert_tensor_name(arch, 0, 0, "up")].pieces[1].shape == (32, 2)
    Model.load(out, n_threads=1).close()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_projections_with_groups_of_different_sizes_load_and_decode(scheme, tmp_path):
    """--group-size 64 with intermediate_size 32: gate/up in groups of 64, down (32
    columns) in groups of 32 — one model, two group sizes, each decoded as stored."""
    src = tmp_path / "src"
    make_model(src, arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=128, intermediate=32)
    out = tmp_path / "out"
    assert main(["repack", "--model", str(src), "--scheme", scheme, "--group-size", "64",
                 "--out", str(out)]) == 0
    parts = _experts(out)
    gate, down = (parts[expert_tensor_name("qwen3_moe", 1, 2, p)] for p in ("gate", "down"))
    assert gate.block == (1, 64) and gate.pieces[1].shape == (32, 2)
    assert down.block == (1, 32) and down.pieces[1].shape == (128, 1)
    model = Model.load(out, n_threads=1, numerics="exact")
    try:
        got = model.experts.acquire(1, [2])[0]
        with Checkpoint(out) as ckpt:
            for w, kernel in ((gate, got.gate), (down, got.down)):
                codes, scale, *mins = (ckpt.read(p) for p in w.pieces)
                want = _decode(QuantScheme(scheme, 64, scheme == "int4"), codes, scale,
                               mins[0] if mins else None)
                np.testing.assert_array_equal(float_values(kernel), want)
        logits = model.forward(model.new_sequence(8), np.arange(8), all_logits=True)
        assert logits.shape == (8, model.config.vocab_size) and np.isfinite(logits).all()
    finally:
        model.close()


def test_a_previous_repack_is_refused_without_force_and_replaced_with_it(source, repacked,
                                                                         tmp_path, capsys):
    out = Path(shutil.copytree(repacked, tmp_path / "taken"))
    (out / "notes.txt").write_text("mine")
    assert main(["repack", "--model", str(source), "--scheme", "int8", "--out", str(out)]) == 1
    assert "--force" in capsys.readouterr().err and (out / "notes.txt").exists()
    assert main(["repack", "--model", str(source), "--scheme", "int8", "--out", str(out),
                 "--force"]) == 0
    assert not (out / "notes.txt").exists()
    assert _raw_config(out)["quantization_config"]["scheme"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]    # no temporaries left


@pytest.mark.parametrize("force", [False, True])
def test_an_empty_out_directory_is_taken(source, tmp_path, force):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["repack", "--model", str(source), "--scheme", "int8", "--out", str(out),
                 *(["--force"] if force else [])]) == 0
    assert _raw_config(out)["quantization_config"]["scheme"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("out, says", [
    ("haz", "contains the model directory"),                   # the source's parent
    ("haz/src/original", "inside the model directory"),        # a folder of the source
    ("haz/src/../src/original/..", "is the model directory itself"),
    ("haz/other", "has no config.json: it is not a repack's output"),
    ("haz/notes.txt", "is a file, not a directory"),
    ("haz/hf", 'has no quantization_config with quant_method "moed"'),
])
def test_force_never_replaces_the_source_or_what_a_repack_did_not_write(source, tmp_path, out,
                                                                         says, capsys):
    """`moed repack --model haz/src --out haz --force` once deleted the model: --force
    replaces only an empty directory or a previous repack's output, and never one that
    contains the source or lies inside it. The refusal names the directory and why."""
    haz = tmp_path / "haz"
    src = Path(shutil.copytree(source, haz / "src"))
    (src / "original").mkdir()
    (src / "original" / "consolidated.txt").write_text("weights")
    (haz / "notes.txt").write_text("notes")
    (haz / "other").mkdir()
    (haz / "other" / "keep.txt").write_text("mine")
    shutil.copytree(source, haz / "hf")                         # a model, not a repack
    before = _tree(haz)
    for force in ([], ["--force"]):
        assert main(["repack", "--model", str(src), "--scheme", "int4", "--out",
                     str(tmp_path / out), *force]) == 1
        err = capsys.readouterr().err
        assert f"moed repack: error: --out {tmp_path / out} " in err and says in err, err
    assert _tree(haz) == before
    assert not [p for p in tmp_path.rglob(f"*{TEMP_MARK}*")]


# ----------------------------------------------------------- temporaries of killed repacks

def _temporary(parent: Path, name: str, pid: int, lock: bool) -> Path:
    d = parent / f".{name}{TEMP_MARK}{pid}.{os.urandom(4).hex()}"
    (d / "new").mkdir(parents=True)
    (d / "new" / "model-00001-of-00002.safetensors").write_bytes(b"partial" * 1000)
    if lock:
        (d / TEMP_LOCK).write_bytes(b"")
    return d


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def test_a_repack_removes_killed_repacks_temporaries_and_keeps_running_ones(source, tmp_path,
                                                                           capsys):
    """Beside --out: a temporary whose lock is free (its writer is gone, even though the pid
    in its name is alive: reused) and one with no lock whose pid is dead are removed; one
    whose lock is held (a repack writing now) and hidden directories that are not a
    repack's stay."""
    running = _temporary(tmp_path, "int4", os.getpid(), lock=True)
    free = _temporary(tmp_path, "int4", os.getpid(), lock=True)
    other_out = _temporary(tmp_path, "other", _dead_pid(), lock=True)
    unlocked_dead = _temporary(tmp_path, "int4", _dead_pid(), lock=False)
    unlocked_alive = _temporary(tmp_path, "int4", os.getpid(), lock=False)
    (tmp_path / ".int4.flenl5dg").mkdir()                      # not named as a repack's
    (tmp_path / ".cache").mkdir()
    fd = os.open(running / TEMP_LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert main(["repack", "--model", str(source), "--scheme", "int4", "--out",
                     str(tmp_path / "int4")]) == 0
        assert running.is_dir() and unlocked_alive.is_dir()
        assert not free.exists() and not other_out.exists() and not unlocked_dead.exists()
        assert (tmp_path / ".int4.flenl5dg").is_dir() and (tmp_path / ".cache").is_dir()
        assert "repack_removed_stale_temporary" in capsys.readouterr().err
    finally:
        os.close(fd)
    assert remove_stale_temporaries(tmp_path) == [running]     # its lock is free now


_KILLED_REPACK = """
import os, signal, sys
from ext.formats.repacked import QuantScheme
from ext.quant.repack import RepackSpec, repack
def die(done, total):
    if done:
        os.kill(os.getpid(), signal.SIGKILL)
repack(sys.argv[1], sys.argv[2], RepackSpec(QuantScheme("int4", 32, True)), shard_size=40_000,
       progress=die)
"""


def test_the_temporary_of_a_repack_killed_midway_is_removed_by_the_next(source, tmp_path):
    """A repack killed with SIGKILL while it writes leaves its temporary, named as a
    repack's and with the lock its writer held; the rerun removes it. While a repack
    writes, its own temporary's lock is held, so that no other repack removes it."""
    out = tmp_path / "int4"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_REPACK, str(source), str(out)],
                            cwd=Path(__file__).parents[3], stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -9, err.decode()
    [left] = [p for p in tmp_path.iterdir()]
    assert left.name.startswith(f".int4{TEMP_MARK}{proc.pid}.") and not out.exists()
    assert (left / TEMP_LOCK).exists() and any((left / "new").iterdir())

    seen = []

    def look(done, total):
        if not seen:
            [mine] = [p for p in tmp_path.iterdir() if p.name.startswith(".int4")]
            seen.append(mine)
            assert remove_stale_temporaries(tmp_path) == []     # held: a repack writing
            assert mine.is_dir()
    repack(source, out, RepackSpec(QuantScheme("int4", 32, True)), progress=look)
    assert seen and seen[0] != left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int4"]


def test_out_may_not_be_the_model_and_a_repacked_model_is_not_repacked_again(source, repacked,
                                                                             capsys):
    assert main(["repack", "--model", str(source), "--scheme", "int4", "--out", str(source),
                 "--force"]) == 1
    assert "model directory itself" in capsys.readouterr().err
    assert main(["repack", "--model", str(repacked), "--scheme", "int4", "--out",
                 str(repacked.parent / "again")]) == 1
    assert "already repacked" in capsys.readouterr().err


def test_unknown_scheme_and_bad_flag_combinations_are_usage_errors(source, tmp_path):
    for argv in (["--scheme", "int3"], ["--scheme", "int8", "--symmetric"],
                 ["--scheme", "int4", "--method", "gptq"], ["--scheme", "int4", "--group-size", "48"]):
        with pytest.raises(SystemExit) as e:
            main(["repack", "--model", str(source), "--out", str(tmp_path / "x"), *argv])
        assert e.value.code == 2


def test_a_row_the_scheme_cannot_cut_is_refused_naming_the_tensor(tmp_path, capsys):
    src = tmp_path / "odd"
    make_model(src, arch="qwen3_moe", layers=1, experts=2, top_k=1, hidden=64, intermediate=48)
    assert main(["repack", "--model", str(src), "--scheme", "int4", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "down_proj.weight" in err and "48 columns" in err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------- config and tensors disagree

def _tamper(repacked: Path, tmp_path: Path, edit) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(repacked, bad)
    raw = _raw_config(bad)
    edit(raw["quantization_config"])
    (bad / "config.json").write_text(json.dumps(raw))
    return bad


@pytest.mark.parametrize("edit,message", [
    (lambda q: q.update(scheme="int8", min=False), "stored as int4, but .* it stores this weight as int8"),
    (lambda q: q.update(min=False), "no min tensor"),
    (lambda q: q.update(group_size=64), r"F16 \[64, 1\]"),
    (lambda q: q.update(weights=["model.layers.*.mlp.experts.*.gate_proj.weight"]),
     "does not quantise"),
    (lambda q: q.update(weights=["nothing.*"]), "match no tensor"),
])
def test_config_and_tensors_that_disagree_are_refused_naming_the_tensor(repacked, tmp_path, edit,
                                                                        message):
    bad = _tamper(repacked, tmp_path, edit)
    with pytest.raises(QuantizationError, match=message) as e:
        Model.load(bad, n_threads=1)
    assert e.value.path is not None and str(bad) in e.value.path


@pytest.mark.parametrize("edit,field", [
    (lambda q: q.update(scheme="int2"), "scheme"),
    (lambda q: q.update(group_size=16), "group_size"),
    (lambda q: q.update(format_version=9), "format_version"),
    (lambda q: q.update(scheme="int8"), "min"),
    (lambda q: q.update(weights=[]), "weights"),
    (lambda q: q.update(alignment=1000), "alignment"),
])
def test_bad_quantization_config_fields_are_named(repacked, tmp_path, edit, field, capsys):
    bad = _tamper(repacked, tmp_path, edit)
    with pytest.raises(QuantizationConfigError) as e:
        load_config(bad)
    assert e.value.field == f"quantization_config.{field}"
    assert str(bad / "config.json") in str(e.value)
    assert main(["generate", "--model", str(bad), "--max-tokens", "2", "x"]) == 1
    assert f"quantization_config.{field}" in capsys.readouterr().err


def test_a_missing_or_non_finite_scale_is_refused(repacked, tmp_path):
    bad = tmp_path / "nan"
    shutil.copytree(repacked, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale"
    with Checkpoint(bad) as ckpt:
        info = ckpt.info(name)
    with open(info.path, "r+b") as f:
        f.seek(info.offset)
        f.write(np.array([np.nan], np.float16).tobytes())
    with pytest.raises(QuantizationError, match="NaN or infinite") as e:
        Model.load(bad, n_threads=1)
    assert e.value.tensor == name
    del index["weight_map"][name]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(QuantizationError, match="missing") as e:
        Model.load(bad, n_threads=1)
    assert e.value.tensor == name


@pytest.mark.parametrize("tensor,fields,message", [
    # same bytes, other dtype: the scale must be F16
    ("model.layers.1.mlp.experts.2.up_proj.weight_scale", {"dtype": "BF16"}, "scale must be F16"),
    # same bytes, other shape: int4 codes of [R, C] are U8 [R, C/2]
    ("model.layers.0.mlp.experts.3.down_proj.weight", {"shape": [32, 64]},
     r"shape \[32, 64\], but int4 codes of a weight \[64, 64\] are \[64, 32\]"),
    # int4 codes retyped as int8's: the config stores int4
    ("model.layers.0.mlp.experts.1.gate_proj.weight", {"dtype": "I8"},
     "stored as int8, but config.json's quantization_config .* stores this weight as int4"),
])
def test_pieces_whose_header_disagrees_with_the_config_are_refused(repacked, tmp_path, tensor,
                                                                   fields, message):
    bad = Path(shutil.copytree(repacked, tmp_path / "bad"))
    edit_header(bad, tensor, **fields)
    with pytest.raises(QuantizationError, match=message) as e:
        Model.load(bad, n_threads=1)
    assert e.value.path is not None and str(bad) in e.value.path
    assert e.value.tensor is not None and e.value.tensor.startswith(tensor.rsplit(".", 1)[0])


# ----------------------------------------------------------- calibration and threads

def test_threads_do_not_change_a_byte(source, tmp_path):
    spec = RepackSpec(QuantScheme("int4", 32, True))
    outs = []
    for threads in (1, 3):
        out = tmp_path / f"t{threads}"
        repack(source, out, spec, shard_size=64 << 10, threads=threads)
        outs.append({p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))})
    assert outs[0] == outs[1] and len(outs[0]) >= 2


def test_second_moments_in_layer_passes_equal_one_pass(source):
    """A budget of one layer's moments gathers them in one pass per MoE layer, and each
    layer's moments equal those of a single pass over every layer."""
    model = Model.load(source, n_threads=1, numerics="exact")
    windows = [np.arange(1, 40), np.arange(100, 131)]
    whole = gather(model, windows, second_moments=True)
    lazy = LayerwiseMoments(model, windows, budget_bytes=moment_bytes(model.config))
    for layer in (0, 1):
        stats = lazy.for_layer(layer)
        assert stats.moment_layers == {layer}
        for e in range(6):
            np.testing.assert_array_equal(stats.moment_matrix(layer, e, "down"),
                                          whole.moment_matrix(layer, e, "down"))
    assert lazy.passes == 2
    assert lazy.for_layer(1) is stats and lazy.passes == 2      # held: no third pass
    np.testing.assert_array_equal(whole.counts[1], stats.counts[1])
    assert whole.counts[0].sum() == 2 * (39 + 31)               # top_k 2 per token


def test_gptq_from_calibration_text_is_recorded_and_loads(source, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    out = tmp_path / "gptq"
    assert main(["repack", "--model", str(source), "--scheme", "int4", "--out", str(out),
                 "--calibration-text", str(text), "--calibration-tokens", "200"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["method"] == "gptq" and printed["bits_per_weight"] == 5.0
    q = _raw_config(out)["quantization_config"]
    assert q["quantizer"]["method"] == "gptq"
    assert q["quantizer"]["calibration"]["files"] == ["calib.txt"]
    assert 0 < q["quantizer"]["calibration"]["tokens"] <= 200
    searched = tmp_path / "search"
    assert main(["repack", "--model", str(source), "--scheme", "int4", "--out", str(searched)]) == 0
    assert _raw_config(searched)["quantization_config"]["quantizer"]["method"] == "search"
    a = {p.name: p.read_bytes() for p in out.glob("*.safetensors")}
    b = {p.name: p.read_bytes() for p in searched.glob("*.safetensors")}
    assert a.keys() == b.keys() and a != b
    Model.load(out, n_threads=1).close()


@pytest.mark.parametrize("dtype,kept", [("fp8", "fp8_e4m3"), ("mxfp4", "bf16")])
def test_a_low_bit_source_repacks_to_int4_and_says_what_it_loses(dtype, kept, tmp_path, capsys):
    """FP8 / MXFP4 experts are decoded and rounded again into int4 (a warning says so);
    the weights the repack keeps (FP8 attention) still load in their format."""
    src = make_model(tmp_path / dtype, arch="qwen2_moe", layers=2, experts=4, top_k=2,
                     hidden=64, intermediate=64, dtype=dtype, initializer_range=0.1)
    out = tmp_path / "int4"
    assert main(["repack", "--model", str(src), "--scheme", "int4", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert printed["source_format"] == {"fp8": "fp8_e4m3", "mxfp4": "mxfp4"}[dtype]
    assert any("rounded a second time" in loss for loss in printed["losses"])
    assert '"level": "warning"' in captured.err and "repack_loses_precision" in captured.err
    q = _raw_config(out)["quantization_config"]
    assert q["source"]["quantization_config"]["quant_method"] == dtype
    model = Model.load(out, n_threads=1, numerics="exact")
    formats = model.weight_formats()
    assert formats["experts"] == "int4"
    assert model.dense_weights["model.layers.0.self_attn.q_proj"].format == kept
    ids = model.forward(model.new_sequence(), [1, 2, 3])
    assert np.isfinite(ids).all()
    # the int4 values are close to the low-bit source's (one int4 step)
    src_model = Model.load(src, n_threads=1, numerics="exact")
    a = float_values(model.experts.acquire(1, [1])[0].down)
    b = float_values(src_model.experts.acquire(1, [1])[0].down)
    assert 0 < np.abs(a - b).max() <= np.abs(b).max() / 7


def test_lm_head_joins_the_dense_weights_only_when_asked(source, tmp_path):
    """RepackSpec(lm_head=True) quantises lm_head with the dense scheme; the model reads it
    as int8 and its logits stay close to the source's; without a dense scheme it is refused."""
    out = tmp_path / "head"
    repack(source, out, RepackSpec(QuantScheme("int4", 32, True), dense=QuantScheme("int8", 32),
                                   lm_head=True))
    with Checkpoint(out) as ckpt:
        assert ckpt.info("model.embed_tokens.weight").dtype == "BF16"
        assert ckpt.info("lm_head.weight").dtype == "I8"              # codes, and a scale
        assert ckpt.info("lm_head.weight_scale").shape == (ckpt.info("lm_head.weight").shape[0], 2)
    model, reference = Model.load(out, n_threads=1, numerics="exact"), Model.load(source, n_threads=1, numerics="exact")
    assert model.dense_weights["lm_head"].format == "int8"
    prompt = [3, 14, 15, 92, 65]
    got = model.forward(model.new_sequence(), prompt, all_logits=True)
    want = reference.forward(reference.new_sequence(), prompt, all_logits=True)
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
    model.close()
    reference.close()
    with pytest.raises(ValueError, match="lm_head is quantised with the dense scheme"):
        RepackSpec(QuantScheme("int8", 32), lm_head=True)


def test_the_lm_head_option_of_the_command(source, tmp_path, capsys):
    out = tmp_path / "all-int8"
    assert main(["repack", "--model", str(source), "--scheme", "int8", "--dense", "int8",
                 "--lm-head", "int8", "--out", str(out)]) == 0
    with Checkpoint(out) as ckpt:
        assert ckpt.info("lm_head.weight").dtype == "I8"
    with pytest.raises(SystemExit) as e:
        main(["repack", "--model", str(source), "--scheme", "int8", "--lm-head", "int8",
              "--out", str(tmp_path / "no")])
    assert e.value.code == 2
    assert "--lm-head int8 takes the dense weights' scheme" in capsys.readouterr().err


# --------------------------------------------------------------- a disk that fills up

@pytest.mark.parametrize("full_at", ["shard", "index", "config", "copy"])
def test_a_full_disk_is_reported_naming_the_file_being_written(source, tmp_path, monkeypatch,
                                                               capsys, full_at):
    """ENOSPC while writing the output once said only "[Errno 28] No space left on
    device": the error names the file as it would be in --out, keeps its errno, and the
    repack leaves nothing behind."""
    import builtins

    from ext.quant import repack as repack_module

    out = tmp_path / "out"
    if full_at == "shard":              # a write into the second shard
        real_open = builtins.open

        def opening(path, mode="r", *args, **kwargs):
            f = real_open(path, mode, *args, **kwargs)
            return FullFile(f) if "w" in mode and Path(path).name.startswith("model-00002-of-") else f
        monkeypatch.setattr(repack_module, "open", opening, raising=False)
        name = "model-00002-of-00004.safetensors"
    elif full_at in ("index", "config"):
        name = "model.safetensors.index.json" if full_at == "index" else "config.json"
        real_write_text = Path.write_text

        def write_text(self, *args, **kwargs):
            if self.name == name:
                no_space()
            return real_write_text(self, *args, **kwargs)
        monkeypatch.setattr(Path, "write_text", write_text)
    else:
        name = "tokenizer.json"
        real_copyfile = shutil.copyfile
        monkeypatch.setattr(repack_module.shutil, "copyfile", lambda src, dst: (
            no_space() if Path(dst).name == name else real_copyfile(src, dst)))
    assert main(["repack", "--model", str(source), "--scheme", "int4", "--out", str(out),
                 "--shard-size", "96K"]) == 1
    err = capsys.readouterr().err
    assert "moed repack: error: [Errno 28] No space left on device: " in err, err
    assert f"{out / name}\n" in err, err
    if full_at == "copy":
        assert f"copying {source.resolve() / name} to {out / name}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []      # no output, no temporary
