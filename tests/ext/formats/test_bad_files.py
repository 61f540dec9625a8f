"""Hostile model directories: every one gives an error naming the file, never a hang,
a crash or a traceback. (Found by an adversarial run; each case is one test.)"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ext.formats.checkpoint import Checkpoint, CheckpointError, HeaderError, MissingShardError
from ext.makemodel import make_model
from ext.models.config import ConfigError, load_config
from ext.models.model import Model
from ext.tokenizer import ChatTemplateError, Tokenizer, TokenizerFilesError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("bad") / "good", arch="qwen3_moe", layers=2,
                      experts=4, top_k=2, hidden=64, intermediate=32, shard_size=30_000)


@pytest.fixture
def model(good, tmp_path) -> Path:
    d = tmp_path / "m"
    shutil.copytree(good, d)
    return d


def _shard(d: Path) -> Path:
    return sorted(d.glob("model-*.safetensors"))[1]


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_fifo_metadata_file_is_refused_not_waited_on(model, name):
    (model / name).unlink()
    os.mkfifo(model / name)
    with pytest.raises((ConfigError, TokenizerFilesError), match="not a regular file"):
        (load_config if name == "config.json" else Tokenizer.from_model_dir)(model)


def test_config_linked_to_dev_zero_is_refused(model):
    (model / "config.json").unlink()
    (model / "config.json").symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="config.json.*not a regular file"):
        load_config(model)


@pytest.mark.parametrize("target", ["config.json", "model.safetensors.index.json",
                                    "tokenizer_config.json"])
def test_deeply_nested_json_names_the_file(model, target):
    (model / target).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises((ConfigError, CheckpointError, TokenizerFilesError), match="nested too deeply") as e:
        if target == "tokenizer_config.json":
            Tokenizer.from_model_dir(model)
        elif target == "config.json":
            load_config(model)
        else:
            Checkpoint(model)
    assert target in str(e.value)


def test_deeply_nested_shard_header(model):
    shard = _shard(model)
    body = b"[" * 50_000 + b"]" * 50_000
    shard.write_bytes(len(body).to_bytes(8, "little") + body)
    with pytest.raises(HeaderError, match="nested too deeply") as e:
        Checkpoint(model)
    assert shard.name in str(e.value)


def test_shard_that_is_a_directory(model):
    shard = _shard(model)
    shard.unlink()
    shard.mkdir()
    with pytest.raises(MissingShardError, match="not a regular file") as e:
        Checkpoint(model)
    assert shard.name in str(e.value)


def test_index_that_is_a_directory(model):
    index = model / "model.safetensors.index.json"
    index.unlink()
    index.mkdir()
    with pytest.raises(HeaderError, match="not a regular file"):
        Checkpoint(model)


def test_huge_integer_in_config_names_the_file(model):
    cfg = (model / "config.json").read_text()
    (model / "config.json").write_text(cfg.replace('"vocab_size": ', '"vocab_size": ' + "9" * 5000 + ", \"x\": "))
    with pytest.raises(ConfigError, match="config.json"):
        load_config(model)


@pytest.mark.parametrize("field,value", [("rope_theta", "NaN"), ("rope_theta", "Infinity"),
                                         ("num_hidden_layers", "1000000000000")])
def test_non_finite_or_absurd_config_values(model, field, value):
    raw = json.loads((model / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw[field] = float(value) if value in ("NaN", "Infinity") else int(value)
    (model / "config.json").write_text(json.dumps(raw))  # json writes NaN / Infinity literals
    with pytest.raises(ConfigError, match=field):
        load_config(model)


@pytest.mark.parametrize("template", ["{{ 1 / 0 }}", "{{ 1 + 'a' }}", "{{ [1, 'a'] | sort }}",
                                      "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"])
def test_failing_chat_templates_are_chat_template_errors(model, template):
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        Tokenizer.from_model_dir(model).apply_chat_template([{"role": "user", "content": "x"}])


def test_non_utf8_chat_template_file_names_it(model):
    (model / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(TokenizerFilesError, match="chat_template.jinja.*not UTF-8"):
        Tokenizer.from_model_dir(model)


def test_nan_weights_name_the_layer(model):
    """A router producing NaN says which layer, instead of a bare kernel message."""
    from ext.formats.checkpoint import Checkpoint as C
    ckpt = C(model)
    info = ckpt.info("model.layers.1.mlp.gate.weight")
    with open(info.path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\xff" * info.nbytes)
    m = Model.load(model, n_threads=1)
    with pytest.raises(ValueError, match="layer 1: router_logits contain NaN"):
        m.forward(m.new_sequence(), [1, 2, 3])


def test_make_model_force_removes_a_stale_chat_template(model):
    (model / "chat_template.jinja").write_text("{{ raise_exception('stale') }}")
    make_model(model, arch="olmoe", layers=1, experts=2, top_k=1, hidden=64, intermediate=16,
               overwrite=True)
    assert not (model / "chat_template.jinja").exists()


def _moed(*args, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daemon.commands.cli", *args], stdout=stdout,
                          stderr=subprocess.PIPE, cwd=ROOT)


@pytest.mark.parametrize("args", [["--threads", "2147483648"], ["--io-workers", "0"],
                                  ["--model", ""]])
def test_bad_generate_arguments_are_usage_errors(good, args):
    argv = ["generate", "--model", str(good), *args, "hi"]
    proc = _moed(*argv)
    assert proc.returncode == 2 and b"Traceback" not in proc.stderr


def test_non_utf8_prompt_is_a_usage_error(good):
    proc = _moed("generate", "--model", str(good), b"\xff\xfe abc".decode("utf-8", "surrogateescape"))
    assert proc.returncode == 2 and b"not valid UTF-8" in proc.stderr


def test_shard_size_inf_is_a_usage_error(tmp_path):
    proc = _moed("make-model", "--arch", "olmoe", "--layers", "1", "--experts", "2", "--top-k", "1",
                 "--hidden", "64", "--intermediate", "16", "--shard-size", "inf", "--out",
                 str(tmp_path / "x"))
    assert proc.returncode == 2 and b"not a size" in proc.stderr


def test_unwritable_stdout_is_an_error_not_a_traceback(good):
    with open("/dev/full", "w") as full:
        proc = _moed("generate", "--model", str(good), "--max-tokens", "64", "hi", stdout=full)
    assert proc.returncode == 1
    assert b"Traceback" not in proc.stderr and b"error" in proc.stderr


def test_stdout_closed_by_its_reader_ends_quietly(good):
    """`moed generate ... | head -c 0`: the reader is gone before the first piece; exit 0,
    not Python's 120 with "Exception ignored" from its last flush."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as closed:
        proc = _moed("generate", "--model", str(good), "--max-tokens", "64", "hi", stdout=closed)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert b"Exception ignored" not in proc.stderr and b"Traceback" not in proc.stderr
