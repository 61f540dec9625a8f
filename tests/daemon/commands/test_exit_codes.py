"""Exit codes, usage lines and error messages of every command, as docs/cli.md states them:
a bad argument (a --model path that does not exist is one) exits 2 with the command's own
usage; a model directory or input that cannot be used exits 1 with one line
`moed COMMAND: error: ...` naming the file, tensor or field at fault; no traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ext.makemodel import make_model

MOED = str(Path(sys.executable).with_name("moed"))
MISSING = "/nonexistent/moed-model"
NO_SOCKET = "/nonexistent/moed.sock"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("exits")
    model = make_model(root / "model", arch="qwen3_moe", layers=2, experts=8, top_k=2,
                       hidden=64, intermediate=32, dtype="bf16", seed=0)
    no_tokenizer = root / "no_tokenizer"
    no_tokenizer.mkdir()
    for p in model.iterdir():
        if p.name != "tokenizer.json":
            (no_tokenizer / p.name).write_bytes(p.read_bytes())
    trace = root / "bad.jsonl"
    trace.write_text('{"tok": 0, "layers": [[1, 2]]}\nnot json\n')
    config = root / "none.toml"
    config.write_text("")
    return {"model": str(model), "no_tokenizer": str(no_tokenizer), "trace": str(trace),
            "config": str(config), "root": str(root)}


def run(*args: str, config: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    env["MOED_CONFIG"] = config
    return subprocess.run([MOED, *args], capture_output=True, text=True, env=env, timeout=120,
                          stdin=subprocess.DEVNULL)


USAGE = [   # (argv, the message on stderr): exit 2, the command's usage
    (["serve", "--model", MISSING], f"moed serve: error: --model: {MISSING} does not exist"),
    (["generate", "--model", MISSING, "hi"], f"moed generate: error: --model: {MISSING} does not exist"),
    (["generate", "--model", "{model}", "--top-p", "2", "hi"], "moed generate: error: --top-p:"),
    (["generate", "--model", "{model}"], "moed generate: error: the following arguments are required: PROMPT"),
    (["bench", "--model", MISSING, "--expert-cache-bytes", "1M"], f"moed bench: error: --model: {MISSING} does not exist"),
    (["tune", "--model", MISSING, "--expert-cache-bytes", "1M"], f"moed tune: error: --model: {MISSING} does not exist"),
    (["iobench", "--model", MISSING], f"moed iobench: error: --model: {MISSING} does not exist"),
    (["demo", "--model", MISSING], f"moed demo: error: --model: {MISSING} does not exist"),
    (["replay-trace", "nope.jsonl", "--slots-per-layer", "4"], "moed replay-trace: error: TRACE: nope.jsonl does not exist"),
    (["replay-trace", "{trace}", "--slots-per-layer", "4", "--pin-fraction", "2"], "moed replay-trace: error: argument --pin-fraction"),
    (["make-model", "--arch", "gpt9", "--layers", "1", "--experts", "2", "--top-k", "1",
      "--hidden", "8", "--intermediate", "8", "--out", "x"], "moed make-model: error: argument --arch"),
    (["stats", "--socket", ""], "moed stats: error: argument --socket"),
    (["nonsense"], "moed: error: argument COMMAND: invalid choice: 'nonsense'"),
]

UNUSABLE = [   # (argv, the message on stderr): exit 1, one error line
    (["serve", "--model", "{no_tokenizer}", "--socket", "{root}/s.sock", "--metrics-address",
      "127.0.0.1:0"], "moed serve: error: {no_tokenizer}/tokenizer.json: missing"),
    (["serve", "--model", "{model}", "--socket", "{root}/t.sock", "--metrics-address",
      "127.0.0.1:0", "--expert-cache-bytes", "1K"], "moed serve: error: "),
    (["generate", "--model", "{no_tokenizer}", "hi"], "moed generate: error: {no_tokenizer}/tokenizer.json: missing"),
    (["generate", "--socket", NO_SOCKET, "hi"], f"moed generate: error: cannot connect to the moed daemon at {NO_SOCKET}"),
    (["stats", "--socket", NO_SOCKET], f"moed stats: error: cannot connect to the moed daemon at {NO_SOCKET}"),
    (["pins", "--socket", NO_SOCKET], f"moed pins: error: cannot connect to the moed daemon at {NO_SOCKET}"),
    (["chat", "--socket", NO_SOCKET], f"moed chat: error: cannot connect to the moed daemon at {NO_SOCKET}"),
    (["replay-trace", "{trace}", "--slots-per-layer", "4"], "moed replay-trace: error: {trace}:2: not a trace line"),
    (["bench", "--model", "{model}", "--expert-cache-bytes", "1K"], "moed bench: error: "),
]


def _fill(items, files):
    return [x.format(**files) for x in items]


@pytest.mark.parametrize("argv, says", USAGE, ids=[" ".join(a[:2]) for a, _ in USAGE])
def test_a_bad_argument_exits_2_with_the_command_s_usage(files, argv, says):
    proc = run(*_fill(argv, files), config=files["config"])
    command = argv[0] if argv[0] != "nonsense" else ""
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"usage: moed {command}".rstrip()), proc.stderr
    assert says.format(**files) in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, says", UNUSABLE, ids=[" ".join(a[:2]) for a, _ in UNUSABLE])
def test_an_unusable_model_or_input_exits_1_with_one_error_line(files, argv, says):
    proc = run(*_fill(argv, files), config=files["config"])
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"moed {argv[0]}: error: ")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith(says.format(**files)), errors[0]
    assert "Traceback" not in proc.stderr
    if argv[0] == "serve" and "--expert-cache-bytes" in argv:
        assert "minimum" in errors[0] or "at least" in errors[0]     # the error gives the minimum
