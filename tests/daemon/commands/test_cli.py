"""The `moed` command line: make-model and generate, stdout/stderr discipline, errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from daemon.commands.cli import main
from ext.generate import Generation
from ext.models.model import Model
from ext.sampling import SamplingParams
from ext.tokenizer import Tokenizer

MOED = [sys.executable, "-m", "daemon.commands.cli"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "model"
    assert main(["make-model", "--arch", "qwen3_moe", "--layers", "2", "--experts", "8",
                 "--top-k", "2", "--hidden", "64", "--intermediate", "32", "--dtype", "bf16",
                 "--shard-size", "40K", "--initializer-range", "0.2", "--out", str(out)]) == 0
    return out


def test_make_model_writes_a_sharded_checkpoint(model_dir):
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert all((model_dir / s).exists() for s in shards)
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_generate_prints_only_the_text_on_stdout(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--max-tokens", "12", "--seed", "1",
                 "hello"]) == 0
    out, err = capsys.readouterr()
    # stdout is exactly the decoded greedy continuation plus a newline
    tok = Tokenizer.from_model_dir(model_dir)
    model = Model.load(model_dir, n_threads=1)
    gen = Generation(model, tok.encode("hello"), max_tokens=12)
    assert out == tok.decode(list(gen)) + "\n"
    assert "model_loaded" in err and "generation_finished" in err


@pytest.mark.parametrize("flags, numerics", [([], ("fast", "auto")),
                                             (["--numerics", "exact"], ("exact", "exact")),
                                             (["--numerics", "fast"], ("fast", "fast"))])
def test_generate_on_an_int4_repack_runs_and_reports_the_resolved_numerics(
        model_dir, tmp_path_factory, capsys, flags, numerics):
    int4 = tmp_path_factory.getbasetemp() / "cli-int4"
    if not int4.exists():
        assert main(["repack", "--model", str(model_dir), "--scheme", "int4", "--out", str(int4),
                     "--shard-size", "40K"]) == 0
        capsys.readouterr()
    assert main(["generate", "--model", str(int4), "--max-tokens", "12", *flags, "hello"]) == 0
    out, err = capsys.readouterr()
    loaded = json.loads(next(l for l in err.splitlines() if '"model_loaded"' in l))
    assert (loaded["numerics"], loaded["numerics_configured"]) == numerics
    tok = Tokenizer.from_model_dir(int4)
    model = Model.load(int4, n_threads=1, numerics=numerics[0])
    assert model.numerics_in_force() == numerics[0]
    gen = Generation(model, tok.encode("hello"), max_tokens=12)
    assert out == tok.decode(list(gen)) + "\n"


def test_same_seed_same_text_different_seed_differs(model_dir, capsys):
    runs = []
    for seed in ("7", "7", "8"):
        assert main(["generate", "--model", str(model_dir), "--max-tokens", "16",
                     "--temperature", "1.5", "--seed", seed, "x"]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_chat_uses_the_template(model_dir, capsys):
    tok = Tokenizer.from_model_dir(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    model = Model.load(model_dir, n_threads=1)
    gen = Generation(model, tok.encode(text, add_special_tokens=False), max_tokens=8)
    expected = tok.decode(list(gen))
    assert main(["generate", "--model", str(model_dir), "--max-tokens", "8", "--chat", "hi"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_missing_model_dir_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tmp_path / "nope"), "hi"])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "nope does not exist" in err


def test_model_dir_without_tokenizer_names_the_file(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 1
    assert "tokenizer.json" in capsys.readouterr().err


def test_bad_sampling_value_is_a_usage_error_before_loading(model_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(model_dir), "--top-p", "1.5", "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--top-p" in err and "model_loaded" not in err


def test_log_level_after_the_command_and_version(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--max-tokens", "2",
                 "--log-level", "warning", "hi"]) == 0
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("moed ")


def test_corrupt_shard_names_the_file(model_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in model_dir.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    assert main(["generate", "--model", str(bad), "hi"]) == 1
    err = capsys.readouterr().err
    assert shard.name in err


@pytest.mark.parametrize("command", [[], ["generate"], ["make-model"]])
def test_help_works(command):
    proc = subprocess.run(MOED + command + ["--help"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0
    assert "usage: moed" in proc.stdout
    assert proc.stderr == ""


def test_console_script_streams(model_dir):
    env = dict(os.environ)
    proc = subprocess.run(MOED + ["generate", "--model", str(model_dir), "--max-tokens", "5",
                                  "--threads", "1", "abc"],
                          capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and len(proc.stdout) > 1


def test_generation_stops_on_stop_token_and_reports_reasons(model_dir):
    model = Model.load(model_dir, n_threads=1)
    tok = Tokenizer.from_model_dir(model_dir)
    prompt = tok.encode("abc")
    free = list(Generation(model, prompt, max_tokens=10))
    assert len(free) == 10
    stopped = Generation(model, prompt, max_tokens=10, stop_ids={free[3]})
    first = free.index(free[3])
    assert list(stopped) == free[:first]
    assert stopped.finish_reason == "stop"
    capped = Generation(model, prompt, max_tokens=4)
    assert list(capped) == free[:4] and capped.finish_reason == "length"


def test_generation_respects_the_context(model_dir):
    model = Model.load(model_dir, n_threads=1)
    context = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="context"):
        Generation(model, [1] * context, max_tokens=1)
    gen = Generation(model, [1] * (context - 3), max_tokens=100)
    assert len(list(gen)) == 3 and gen.finish_reason == "length"


def test_sampled_generation_is_reproducible(model_dir):
    model = Model.load(model_dir, n_threads=2)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123)
    a = list(Generation(model, [5, 6, 7], max_tokens=20, sampling=params))
    model1 = Model.load(model_dir, n_threads=1, experts="resident")
    b = list(Generation(model1, [5, 6, 7], max_tokens=20, sampling=params))
    assert a == b
    assert np.unique(a).size > 1


def test_model_default_names_the_embedded_model(tmp_path, monkeypatch):
    from daemon.service.config import ServeConfig, default_model_dir, resolve_model_alias
    monkeypatch.chdir(tmp_path)
    assert resolve_model_alias("default") == str(default_model_dir())
    assert ServeConfig(model="default").require_model() == str(default_model_dir())
    (tmp_path / "default").mkdir()                  # a real directory of that name wins
    assert resolve_model_alias("default") == "default"


def test_generate_with_model_default(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model", "default", "--max-tokens", "6", "--temperature", "0",
                 "def fibonacci(n):\n"]) == 0
    assert capsys.readouterr().out.strip()
