"""Every command's log, piped as a service or script sees it, keeps the log contract
(tests/log_contract.py): JSON events with snake_case names and their values as fields —
the expert cache's summary, the config line, generate's summary, iobench, bench and tune
among them — at the most verbose level, so that every event the run reaches is checked."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import log_contract
from ext.makemodel import make_model

MOED = str(Path(sys.executable).with_name("moed"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("logs") / "model", arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=0)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    return subprocess.run([MOED, "--log-level", "debug", *args], capture_output=True, text=True,
                          env=env, timeout=300, stdin=subprocess.DEVNULL)


COMMANDS = {
    "generate": lambda m, t: ["generate", "--model", str(m), "--max-tokens", "6", "--seed", "1",
                              "--expert-cache-bytes", "64K", "--state-dir", str(t / "state"),
                              "def f():"],
    "generate_resident": lambda m, t: ["generate", "--model", str(m), "--max-tokens", "4",
                                       "--experts", "resident", "hi"],
    "bench": lambda m, t: ["bench", "--model", str(m), "--expert-cache-bytes", "64K",
                           "--tokens", "4", "--repeats", "1"],
    "tune": lambda m, t: ["tune", "--model", str(m), "--expert-cache-bytes", "64K",
                          "--state-dir", str(t / "state"), "--window-steps", "2", "--pairs", "1",
                          "--compare-tokens", "4", "--compare-repeats", "1", "--threads", "1"],
    "iobench": lambda m, t: ["iobench", "--file", str(t / "scratch"), "--size", "4M",
                             "--seconds", "1", "--state-dir", str(t / "state")],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_commands_log_by_the_contract(command, model, tmp_path):
    proc = _run(*COMMANDS[command](model, tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in proc.stderr.splitlines()]
    assert events, "the command logged nothing at debug level"
    assert log_contract.problems(proc.stderr.splitlines()) == []


def test_a_command_that_fails_logs_by_the_contract_plus_one_line_for_a_person(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{not json")
    proc = _run("generate", "--model", str(tmp_path / "model"), "hi")
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1].startswith("moed generate: error: ")
    assert log_contract.problems(proc.stderr.splitlines()) == []


def test_serve_logs_the_state_dir_it_will_save_to_not_null(model, tmp_path, monkeypatch, capsys):
    import daemon.service.daemon as service
    from daemon.commands.cli import main

    monkeypatch.setattr(service, "serve", lambda config, **kwargs: 0)    # the config line only
    for key in [k for k in os.environ if k.startswith("MOED_")] + ["STATE_DIRECTORY"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    config = tmp_path / "moed.toml"
    config.write_text("")
    assert main(["serve", "--model", str(model), "--socket", str(tmp_path / "moed.sock"),
                 "--config", str(config)]) == 0
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines()
              if line.startswith("{")]
    [logged] = [e for e in events if e["event"] == "config"]
    assert logged["state_dir"] == str(tmp_path / "xdg" / "moed")
