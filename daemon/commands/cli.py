"""The `moed` command line: the parser of every command, and exit codes.

Each command lives in its own module of daemon/commands/ with `register(sub, parents)`
(its arguments, beside its code) and the function it runs; this module puts them under
one parser in the order `moed --help` lists them. A command module is cheap to import:
what its command needs beyond argparse (numpy, ml_dtypes, the model code, aiohttp,
structlog) it imports in the function that runs it, or keeps in a module of its own that
this function imports (bench_runs.py, tune_runs.py). So `moed --version`, `moed --help` and
`moed COMMAND --help` load none of it (tests/daemon/commands/test_startup.py).

Every command keeps stdout for its result (generated text, JSON, a path) and sends
logs and progress to stderr; progress bars appear only when stderr is a terminal.
Exit status: 0 on success, 1 when the input (model directory, config, prompt) is
at fault, 2 for a usage error (argparse's convention).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# OpenMP threads that spin while waiting starve the io workers and any other process of
# the CPU they need; on a busy 2-core machine decode with 2 compute threads and streamed
# experts fell from ~150 to ~5 tokens/s (moed generate, demo model, 4.7 MiB cache, a
# second process loading the CPU), and passive waiting kept it at 137-156. Set before
# libgomp loads (the kernels import it lazily, and only a running command imports the
# kernels); OMP_WAIT_POLICY=ACTIVE overrides. A passive worker takes ~60 us to wake, so
# the kernels then run calls of fewer than 6 Mi multiply-adds on one thread
# (ext/kernels/_kernels.pyx, parallel_threshold).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from daemon.commands import (bench, chat, demo, evaluate, generate, install_service,  # noqa: E402
                             iobench, make_model, repack, replay, serve, stats, tune)
from daemon.commands.args import UsageError, configure_logging, parents, version  # noqa: E402

# The order of `moed --help`.
COMMANDS = (demo, generate, chat, stats, make_model, repack, evaluate, bench, tune, iobench,
            replay, serve, install_service)


def build_parser() -> argparse.ArgumentParser:
    """The `moed` parser: every command of COMMANDS as a subcommand."""
    shared = parents()
    parser = argparse.ArgumentParser(
        prog="moed", parents=[shared.common],
        description="Serve Mixture-of-Experts language models whose experts stream from disk.",
        epilog="Run 'moed COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"moed {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub, shared)
    return parser


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subparser of `command` (for its usage line), else `parser` itself."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
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
