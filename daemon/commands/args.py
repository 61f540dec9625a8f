"""What the commands share: argument types, parent parsers, progress, sampling flags.

Every type raises argparse.ArgumentTypeError (exit 2 with argparse's message); a value
that argparse's types cannot check alone raises UsageError, which `main` turns into the
same exit 2.

Cheap to import, like every command module's top: `moed --help` and `moed --version` load
only argparse and these modules; what a command needs beyond them (numpy, the model code,
aiohttp, structlog) it imports when it runs.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NamedTuple


class Parents(NamedTuple):
    """The parent parsers whose options several commands share."""

    common: argparse.ArgumentParser     # --log-level
    machine: argparse.ArgumentParser    # --threads, --io-workers (commands that run the model)
    client: argparse.ArgumentParser     # --socket | --url, --api-key (commands that ask the daemon)


class Progress:
    """Progress of long work as a tqdm bar on stderr when stderr is a terminal (with the
    rate and the time left); nothing at all otherwise, so logs stay clean.

    Call it as `progress(done, total)` (done and total in `unit`; "B" shows bytes with
    binary prefixes), `note(message)` for a line above the bar, and `close()` at the end
    (also when `done` reaches `total`). `enabled` says whether anything is shown.
    """

    def __init__(self, label: str, unit: str = "it"):
        self.label = label
        self.unit = unit
        self.enabled = sys.stderr.isatty()
        self._bar = None

    def _open(self, total: int | None):
        if self._bar is None:
            from tqdm import tqdm

            try:
                columns = os.get_terminal_size(sys.stderr.fileno()).columns
            except (OSError, ValueError, AttributeError):
                columns = 0
            # a terminal that reports no width (a bare pty) would get no bar at all
            self._bar = tqdm(total=total, desc=self.label, unit=self.unit, file=sys.stderr,
                             unit_scale=self.unit == "B", unit_divisor=1024 if self.unit == "B" else 1000,
                             dynamic_ncols=columns > 0, ncols=None if columns > 0 else 100,
                             nrows=None if columns > 0 else 24, leave=True,
                             disable=not self.enabled)
        return self._bar

    def __call__(self, done: int, total: int | None) -> None:
        if not self.enabled:
            return
        bar = self._open(total)
        if total is not None and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)
        if total is not None and done >= total:
            self.close()

    def note(self, message: str) -> None:
        """A line of text above the bar (a stage begins, a result); terminal only."""
        if self.enabled:
            self._open(None).write(f"{self.label}: {message}", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value

MAX_THREADS = 1024

def thread_count(text: str) -> int:
    value = positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_THREADS}, got {value}")
    return value

def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value

def nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text

def size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024): 512M, 2G, 65536."""
    from daemon.service.config import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None

class UsageError(Exception):
    """A command-line value that argparse's types cannot check alone (exit 2)."""

MODEL_HELP = 'model directory ("default": the embedded default model)'

def check_model_dir(path: str) -> str:
    """An existing directory, else a usage error naming it."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"--model: {path} does not exist")
    if not p.is_dir():
        raise UsageError(f"--model: {path} is not a directory (expected a model directory "
                         "with config.json, tokenizer.json and *.safetensors)")
    return path

def read_text_file(path: str, flag: str) -> str:
    """The UTF-8 text of `path`: a usage error naming `flag` when it is not a file, a
    ValueError naming the file when it is not UTF-8."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag}: {path} is not a file")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None

def sampling_params(args: argparse.Namespace):
    """SamplingParams from the command's flags; a usage error naming the flag at fault."""
    from ext.sampling_params import SamplingParamError, SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)
    except SamplingParamError as e:
        raise UsageError(f"--{e.field.replace('_', '-')}: {e}") from None

def utf8_prompt(prompt: str) -> None:
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("PROMPT is not valid UTF-8") from None

class ExamplesFormatter(argparse.HelpFormatter):
    """Wraps one-paragraph text (the description) but keeps text of several lines (the
    examples in an epilog) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

def add_sampling_arguments(parser: argparse.ArgumentParser, *, max_tokens: int,
                            per: str = "continuation") -> None:
    """--max-tokens, --temperature, --top-p, --top-k, --seed (greedy by default)."""
    parser.add_argument("--max-tokens", type=positive_int, default=max_tokens, metavar="N",
                        help=f"most new tokens per {per} (default: {max_tokens})")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 for greedy decoding (default), else sampling temperature")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="nucleus sampling mass in (0, 1] (default: 1, off)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="sample among the K most likely tokens (default: 0, off)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="random seed; the same seed gives the same tokens")

def cpu_threads() -> int:
    from ext.models.model import default_threads

    return default_threads()

def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("moed")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"

def configure_logging(level: str) -> None:
    """Send moed's logs to the current stderr: JSON lines, or readable text on a terminal."""
    from telemetry.logs import configure

    configure(level)


NUMERICS_HELP = ("numerics of int8, int4 and MXFP4 weights: exact (dequantised exactly, f32 "
                 "activations), fast (int8 activations in blocks of 32, exact integer dots) "
                 "or auto (fast when the model has such weights, else exact); fast-bf16 is "
                 "fast and also rounds activations to bf16 for bf16 weights (VDPBF16PS's "
                 "arithmetic); f16, f32 and FP8 are exact in all (default: %(default)s)")


def add_numerics(parser: argparse.ArgumentParser) -> None:
    """`--numerics {auto,exact,fast,fast-bf16}` on a command that runs the model (default auto)."""
    from daemon.service.config import NUMERICS

    parser.add_argument("--numerics", choices=NUMERICS, default="auto", help=NUMERICS_HELP)


def parents() -> Parents:
    """Fresh parent parsers (argparse copies their actions into each child)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS,
                        choices=["debug", "info", "warning", "error"],
                        help="verbosity of the log on stderr (default: info)")
    machine = argparse.ArgumentParser(add_help=False)  # options of commands that run the model
    machine.add_argument("--threads", type=thread_count, default=None, metavar="N",
                         help="compute threads (default: CPUs available)")
    machine.add_argument("--io-workers", type=thread_count, default=2, metavar="N",
                         help="reader threads for experts streamed from disk (default: 2)")
    client = argparse.ArgumentParser(add_help=False)  # options of commands that ask the daemon
    where = client.add_mutually_exclusive_group()
    where.add_argument("--socket", default=None, metavar="PATH", type=nonempty,
                       help="the daemon's Unix socket (default: $MOED_SOCKET, else "
                            "/run/moed/moed.sock)")
    where.add_argument("--url", default=None, metavar="URL", type=nonempty,
                       help="ask the daemon over HTTP at URL instead, http://HOST:PORT (moed "
                            "serve --tcp-address) or https:// through a TLS proxy (default: "
                            "$MOED_URL)")
    client.add_argument("--api-key", default=None, metavar="KEY", type=nonempty,
                        help="with --url: the daemon's API key, sent as Authorization: Bearer "
                             "(default: $MOED_API_KEY)")
    return Parents(common, machine, client)
