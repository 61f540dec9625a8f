"""`moed --version`, `moed --help` and `moed COMMAND --help` load none of the heavy
modules: a command's numpy, ml_dtypes, model code, aiohttp, structlog and the like are
imported when the command runs, never to build the parser; and a command's module only
when that command is parsed. The modules are those the process holds when it exits, so a
module imported eagerly again anywhere on the way (a command module's top, args.py, a
package's __init__) fails here. The kernels' OpenMP wait policy is still set before they
load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.commands.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[3]
MOED = ("import atexit, json, sys\n"
        "atexit.register(lambda: print('\\nMODULES', json.dumps(sorted(sys.modules)),\n"
        "                              file=sys.stderr))\n"
        "from daemon.commands.cli import main\n"
        "sys.exit(main())\n")
# Top-level packages (or exact modules) that only running a command may import.
HEAVY = ("numpy", "ml_dtypes", "aiohttp", "ext.kernels", "ext.models", "ext.formats",
         "daemon.store", "daemon.tuning", "structlog", "tokenizers", "safetensors", "jinja2",
         "tqdm", "psutil", "prometheus_client", "llguidance")


def _imports(*argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The result of `moed ARGV` (the console script's `main`) and every module the process
    held at its exit (printed by an atexit hook on stderr's last line)."""
    proc = subprocess.run([sys.executable, "-c", MOED, *argv], capture_output=True, text=True,
                          cwd=ROOT)
    head, _, modules = proc.stderr.rpartition("\nMODULES ")
    proc.stderr = head
    return proc, set(json.loads(modules))


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules for h in HEAVY if m == h or m.startswith(h + "."))


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["--log-level", "debug", "--help"]],
                         ids=" ".join)
def test_version_and_help_import_nothing_heavy(argv):
    proc, modules = _imports(*argv)
    assert proc.returncode == 0
    assert proc.stdout.startswith("moed " if argv == ["--version"] else "usage: moed")
    assert "daemon.commands.args" in modules         # the list was read
    assert _heavy(modules) == []
    assert not modules & {c.module for c in COMMANDS}   # nor any command's module


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_command_help_imports_nothing_heavy(command):
    proc, modules = _imports(command.name, "--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"usage: moed {command.name}")
    assert _heavy(modules) == []
    assert modules & {c.module for c in COMMANDS} == {command.module}   # no other command's


def test_a_bad_argument_exits_2_before_the_command_loads_its_modules():
    """argparse's own checks exit 2 while parsing; a command's checks of its own (a --model
    that does not exist) run before it imports its heavy modules (logging is set up by
    then: structlog may load)."""
    proc, modules = _imports("bench", "--no-such-flag")
    assert proc.returncode == 2
    assert "moed bench: error: the following arguments are required: --model" in proc.stderr
    assert _heavy(modules) == []
    proc, modules = _imports("bench", "--model", "/nonexistent/moed-model",
                             "--expert-cache-bytes", "1M")
    assert proc.returncode == 2
    assert "moed bench: error: --model: /nonexistent/moed-model does not exist" in proc.stderr
    assert [m for m in _heavy(modules) if not m.startswith("structlog")] == []


def test_the_openmp_wait_policy_is_set_before_the_kernels_load():
    """cli sets OMP_WAIT_POLICY=PASSIVE (unless given) when it is imported, before the
    kernels load; their threads are moed's own pool, so the threshold is the same either way."""
    code = ("import os, sys\n"
            "import daemon.commands.cli\n"
            "assert 'ext.kernels' not in sys.modules\n"
            "from ext.kernels import _kernels\n"
            "print(os.environ['OMP_WAIT_POLICY'], _kernels.parallel_threshold())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["PASSIVE", "32768"]
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    assert proc.stdout.split() == ["ACTIVE", "32768"]


def test_every_listed_command_has_a_parser_and_every_parser_is_listed():
    """Each command's module registers the parser of every name COMMANDS gives it, under
    that name, and no parser that `moed --help` would not list."""
    from daemon.commands.cli import build_parser, command_parser

    parser = build_parser()
    for command in COMMANDS:
        sub = command_parser(parser, command.name)
        assert sub is not parser and sub.prog == f"moed {command.name}"
    (action,) = parser._subparsers._group_actions
    assert sorted(action._name_parser_map) == sorted(c.name for c in COMMANDS)
    assert [a.dest for a in action._choices_actions] == [c.name for c in COMMANDS]


def test_generate_through_the_daemon_imports_no_numpy_nor_model_code(tmp_path):
    """`moed generate` without --model is a client: its flags are checked (sampling
    parameters included) and sent; numpy and the model code stay unloaded."""
    proc, modules = _imports("generate", "--socket", str(tmp_path / "none.sock"), "def f(x):")
    assert proc.returncode != 0 and "none.sock" in proc.stderr     # it tried to connect
    assert "aiohttp" in modules                                      # the client ran
    assert [m for m in _heavy(modules) if m.split(".")[0] != "aiohttp" and
            not m.startswith(("structlog",))] == []
    assert "importlib.metadata" not in modules       # the version is looked up for --version only
