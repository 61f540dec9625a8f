"""The `moed` command line: the parser of every command, and exit codes.

Each command lives in its own module of daemon/commands/ with `register(sub, parents)`
(its arguments, beside its code) and the function it runs; this module lists them in
COMMANDS, with the one line `moed --help` shows for each, in the order it shows them. A
command's module is imported (and its `register` called) only when the command is parsed:
`moed --version` and `moed --help` import none, `moed COMMAND --help` only COMMAND's. A
command module is also cheap to import: what its command needs beyond argparse (numpy,
ml_dtypes, the model code, aiohttp, structlog) it imports in the function that runs it,
or keeps in a module of its own that this function imports (bench_runs.py,
tune_runs.py). tests/daemon/commands/test_startup.py holds both to it.

Every command keeps stdout for its result (generated text, JSON, a path) and sends
logs and progress to stderr; progress bars appear only when stderr is a terminal.
Exit status: 0 on success, 1 when the input (model directory, config, prompt) is
at fault, 2 for a usage error (argparse's convention).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NamedTuple

# OpenMP threads that spin while waiting starve the io workers and any other process of
# the CPU they need; on a busy 2-core machine decode with 2 compute threads and streamed
# experts fell from ~150 to ~5 tokens/s (moed generate, demo model, 4.7 MiB cache, a
# second process loading the CPU), and passive waiting kept it at 137-156. Set before
# libgomp loads (the kernels import it lazily, and only a running command imports the
# kernels); OMP_WAIT_POLICY=ACTIVE overrides. The kernels' own threads are moed's pool
# (ext/kernels/_pool.h), which spins a bounded 50 us and then sleeps whatever this says;
# it stays for any OpenMP code a library loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from daemon.commands.args import (Parents, UsageError, configure_logging, parents,  # noqa: E402
                                  version)


class _Version(argparse.Action):
    """--version: the package version is looked up (importlib.metadata, tens of ms) only
    when asked for, not each time the parser is built."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"moed {version()}")
        parser.exit()


class Command(NamedTuple):
    """A command as `moed --help` lists it; `module` has its `register` and `run`."""

    name: str
    module: str
    help: str


# The order of `moed --help`.
COMMANDS = (
    Command("demo", "daemon.commands.demo",
            "try moed: its expert cache against a naive one, experts read from disk"),
    Command("generate", "daemon.commands.generate",
            "generate text from a prompt, through the daemon (or in-process with --model)"),
    Command("chat", "daemon.commands.chat", "chat with the daemon's model on the terminal"),
    Command("stats", "daemon.commands.stats",
            "print the daemon's statistics (expert cache, hit rate, tokens/s) as JSON"),
    Command("pins", "daemon.commands.stats",
            "print the experts the daemon keeps pinned (or forget what it learned) as JSON"),
    Command("make-model", "daemon.commands.make_model",
            "write a random-weight MoE checkpoint in Hugging Face layout"),
    Command("repack", "daemon.commands.repack",
            "write a copy of a model with int4/int8 routed experts (lossy; see moed eval)"),
    Command("eval", "daemon.commands.evaluate",
            "compare a model with a reference over teacher-forced text (KL, top-1, bits/byte)"),
    Command("bench", "daemon.commands.bench",
            "measure decode speed of the expert cache against its naive mode and the roofline"),
    Command("tune", "daemon.commands.tune",
            "find the best threads, io workers, prefetch width, cache split and prefill chunk for a "
            "model here"),
    Command("iobench", "daemon.commands.iobench",
            "measure random expert-sized reads from the disk, per io path and queue depth"),
    Command("replay-trace", "daemon.commands.replay",
            "replay a routing trace through the expert cache policies (no compute)"),
    Command("serve", "daemon.commands.serve",
            "run the daemon: OpenAI- and Anthropic-compatible HTTP on a Unix socket and TCP"),
    Command("install-service", "daemon.commands.install_service",
            "install moed as a systemd service (user, config, state directory, units)"),
)


class _Parsers(dict):
    """A command's name -> its parser, built on the first lookup of the name: `load(name)`
    has the command's `register` add it. `in` answers for the parsers built so far (what
    argparse's add_parser asks); the action's `choices` name every command."""

    def __init__(self, load):
        super().__init__()
        self._load = load

    def __missing__(self, name: str) -> argparse.ArgumentParser:
        self._load(name)
        return dict.__getitem__(self, name)


class _Commands(argparse._SubParsersAction):
    """The COMMAND argument of `moed`: lists every command of `commands` by its name and
    help line, and imports a command's module to build its parser only when the command is
    parsed (or its parser is asked for: `parser_of`)."""

    def __init__(self, *args, commands: Sequence[Command], parents: Parents, **kwargs):
        super().__init__(*args, **kwargs)
        self._commands = {c.name: c for c in commands}
        self._parents = parents
        self._name_parser_map = _Parsers(self._register)
        self.choices = tuple(self._commands)       # argparse checks the name against these
        self._choices_actions = [self._ChoicesPseudoAction(c.name, (), c.help) for c in commands]

    def _register(self, name: str) -> None:
        module = importlib.import_module(self._commands[name].module)
        module.register(self, self._parents)

    def parser_of(self, name: str) -> argparse.ArgumentParser:
        """The parser of command `name` (KeyError when there is no such command)."""
        return self._name_parser_map[name]


def build_parser() -> argparse.ArgumentParser:
    """The `moed` parser: every command of COMMANDS as a subcommand, each built when parsed."""
    shared = parents()
    parser = argparse.ArgumentParser(
        prog="moed", parents=[shared.common],
        description="Serve Mixture-of-Experts language models whose experts stream from disk.",
        epilog="Run 'moed COMMAND --help' for a command's options.")
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="show program's version number and exit")
    parser.add_subparsers(dest="command", required=True, metavar="COMMAND", action=_Commands,
                          commands=COMMANDS, parents=shared)
    return parser


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subparser of `command` (for its usage line), else `parser` itself."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, _Commands) and command in action.choices:
            return action.parser_of(command)
    return parser


def _drop_unwritable_stdout() -> None:
    """When stdout cannot take what is buffered for it (a closed pipe, a full disk), point
    its descriptor at /dev/null: else the interpreter's own flush at exit fails again, says
    "Exception ignored" and turns the exit status into 120 (what Python's documentation
    advises for SIGPIPE)."""
    try:
        sys.stdout.flush()
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def input_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that say the input (model directory, config, prompt) is at fault:
    exit 1 with one line. Imported only once a command has failed with something else than
    a usage error: their modules load numpy and ml_dtypes, which `moed --help` must not."""
    from daemon.service.config import ConfigError as ServeConfigError
    from daemon.store.reads import ExpertReadError
    from ext.formats.checkpoint import CheckpointError
    from ext.models.config import ConfigError
    from ext.tokenizer import ChatTemplateError, TokenizerFilesError

    return (CheckpointError, ConfigError, ServeConfigError, TokenizerFilesError, ChatTemplateError,
            ExpertReadError, ValueError, FileNotFoundError, FileExistsError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status (see the module doc)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model", None) is not None:
        from daemon.service.config import resolve_model_alias
        args.model = resolve_model_alias(args.model)
    configure_logging(getattr(args, "log_level", "info"))

    # An except clause's exceptions are evaluated only when one is being handled, so
    # input_errors() imports nothing unless the command failed. BrokenPipeError, MemoryError
    # and KeyboardInterrupt are none of them, so they are handled first, without the import.
    try:
        return args.func(args)
    except UsageError as e:  # exits 2 with the command's own usage, like argparse's checks
        command_parser(parser, args.command).error(str(e))
    except BrokenPipeError:
        _drop_unwritable_stdout()
        return 0
    except MemoryError as e:
        print(f"moed {args.command}: error: out of memory: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except input_errors() as e:
        print(f"moed {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # an unwritable stdout or --out, an unreadable file
        print(f"moed {args.command}: error: {e}", file=sys.stderr)
        _drop_unwritable_stdout()
        return 1


if __name__ == "__main__":
    sys.exit(main())
