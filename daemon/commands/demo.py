"""`moed demo`: the daemon and a client on the embedded default model, for someone who just
installed moed.

What it does, in order:
1. Takes the embedded default model (`default_model_dir`: a small Qwen3-MoE trained on
   the Python standard library, shipped as package data; see its README.md) or the model
   directory given with ``--model``, checks that it can be served and says what it is.
2. Gives the expert cache `DEMO_CACHE_FRACTION` of the routed experts' bytes (never
   below the daemon's minimum plus room for pins), so the experts do not fit, and starts
   `moed serve` ``1 + 2 * repeats`` times on a private socket, each time after dropping
   the shards' page cache (POSIX_FADV_DONTNEED; no root needed), so every expert the
   daemon reads comes from disk (it reads with O_DIRECT, or drops what it read):
   a. moed learning: moed's cache from an emptied state directory, completing
      `LEARN_PROMPT` (another prompt, and longer, so that the pin learner can decide); it
      saves what it learned (usage counts, and pins when the learner found they pay) on
      SIGTERM, and the demo keeps a copy of that state;
   b. `repeats` times, alternately (so that the machine's load falls on both alike):
      the naive cache (``expert_cache_mode = "naive"``: LRU, no pins, no prefetch,
      nothing learned), cold, completing `DEMO_PROMPT`; and moed restarted from the copy
      of the learned state (found by the model's fingerprint), completing `DEMO_PROMPT`.
      The last restart's answer is streamed to stdout.
3. Prints the learning run on a line of its own (another prompt: not comparable), then a
   row for each of the naive cache and the restarted moed: the median tokens/s with its
   min-max over the starts, and the figures that do not depend on the machine's speed
   (expert bytes read per token, hit rates of the answer's and of the prompt's lookups,
   bytes read before the request). Then in words how they compared, whichever way it came
   out: nothing is expected. A difference in speed is called one only when the ranges do
   not overlap. The page-cache (mmap) mode is not compared: without a memory cgroup
   nothing holds the page cache to the same budget.
4. Stops each daemon with SIGTERM and requires exit code 0. With ``--keep`` the last one
   keeps serving until Ctrl-C (or SIGTERM) first.

Progress goes to stderr; the daemon's own log stays hidden unless it fails, then its last
lines are shown. The learned usage lives in ``<dir>/demo-state`` (keyed by the model's
fingerprint): that directory (only it) is emptied when a demo starts, the learning run
fills it, and it is put back to what the learning run saved before each restart.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from daemon.commands.args import ExamplesFormatter, Parents, check_model_dir, nonempty, positive_int
from daemon.commands.ask import client_command
from daemon.service.config import default_model_dir

# The default model completes Python code: the first start learns on one function, the
# second (and the naive cache) complete another.
LEARN_PROMPT = "def read_lines(path):\n    \"\"\"Return the lines of the file at path.\"\"\"\n"
DEMO_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
DEMO_CACHE_FRACTION = 0.25     # of the routed experts' bytes ...
# ... but at least this many slots per MoE layer beyond the daemon's minimum (top_k per
# layer): pins come out of that spare room (for the default model, 8 of 32 experts per
# layer is top_k 4 + 4 spare, so a quarter it is).
DEMO_SPARE_SLOTS_PER_LAYER = 2
DEMO_MAX_TOKENS = 96
# Starts of each of the naive cache and the restarted moed. With no real difference, the
# 5 + 5 tokens/s figures come out in two separate ranges by chance 2 times in C(10, 5) = 252.
DEMO_REPEATS = 5
# The first start answers this many times as many tokens: pin learning decides after two
# windows of 32 tokens at the earliest, and only when learning stays a small share of the time.
LEARN_TOKENS_FACTOR = 4
DEMO_TEMPERATURE = 0.7
DEMO_SEED = 0                  # the same text every run: only the cache changes between runs
STATE_DIR_NAME = "demo-state"
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 30
# Variables that would make the child act for someone else: another config, another
# unit's socket activation or notifications.
_FOREIGN_ENV = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "NOTIFY_SOCKET", "WATCHDOG_USEC",
                "WATCHDOG_PID")
UNIX_PATH_MAX = 107


class DemoError(Exception):
    """The demo cannot go on; the message says why (and shows the daemon's last log lines)."""


@dataclass(frozen=True)
class DemoOptions:
    """What `moed demo` was asked to do, built at the edge (the CLI).

    cache_dir: where the learned state lives (its demo-state directory is emptied at start).
    model_dir: the model to serve (None: the embedded default model).
    keep: keep the daemon serving after the demo until SIGINT/SIGTERM.
    repeats: starts of each of the naive cache and the restarted moed (at least 2).
    environ: the environment the daemon child starts from (MOED_* keys are dropped).
    """

    cache_dir: Path
    model_dir: Path | None = None
    keep: bool = False
    max_tokens: int = DEMO_MAX_TOKENS
    repeats: int = DEMO_REPEATS
    environ: Mapping[str, str] = field(default_factory=dict)


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/moed``, else ``~/.cache/moed`` (the XDG base directory rules)."""
    base = environ.get("XDG_CACHE_HOME")
    if base and os.path.isabs(base):
        return Path(base) / "moed"
    home = environ.get("HOME") or os.path.expanduser("~")
    return Path(home) / ".cache" / "moed"


# ---------------------------------------------------------------------- the model


def check_model(model_dir: Path) -> None:
    """Raise DemoError naming the file at fault when `model_dir` cannot be served."""
    from ext.formats.checkpoint import Checkpoint, CheckpointError
    from ext.models.config import ConfigError, load_config
    from ext.models.experts import ExpertLayout

    if not model_dir.is_dir():
        raise DemoError(f"no model directory at {model_dir}")
    if not (model_dir / "tokenizer.json").is_file():
        raise DemoError(f"{model_dir / 'tokenizer.json'} is missing: the demo needs a tokenizer")
    try:
        with Checkpoint(model_dir) as checkpoint:
            ExpertLayout(checkpoint, load_config(model_dir))
    except (CheckpointError, ConfigError, OSError) as e:
        raise DemoError(f"the model in {model_dir} cannot be served: {e}") from None


@dataclass(frozen=True)
class CacheBudget:
    """The demo's expert cache: bytes given to the daemon and what they compare to."""

    cache_bytes: int
    expert_bytes: int        # every routed expert, each in its (aligned) cache slot size
    minimum_bytes: int       # the daemon's minimum: top_k slots per MoE layer
    slots: int
    experts: int


def cache_budget(model_dir: Path, fraction: float = DEMO_CACHE_FRACTION,
                 spare_per_layer: int = DEMO_SPARE_SLOTS_PER_LAYER) -> CacheBudget:
    """An expert cache of `fraction` of the routed experts, in whole slots; at least the
    daemon's minimum plus `spare_per_layer` slots per MoE layer (the pinned tier's room),
    at most every expert. Raises the checkpoint's errors."""
    from daemon.store.plans import max_slot_bytes
    from daemon.store.streaming import minimum_cache_bytes
    from ext.formats.checkpoint import Checkpoint
    from ext.models.config import load_config
    from ext.models.experts import ExpertLayout

    config = load_config(model_dir)
    with Checkpoint(model_dir) as checkpoint:
        layout = ExpertLayout(checkpoint, config)
        slot = max_slot_bytes(layout)
        minimum = minimum_cache_bytes(layout, config)
        experts = len(layout)
    moe_layers = sum(config.moe_layers)
    slots = min(experts, max(math.ceil(fraction * experts),
                             minimum // slot + spare_per_layer * moe_layers))
    return CacheBudget(cache_bytes=slots * slot, expert_bytes=experts * slot,
                       minimum_bytes=minimum, slots=slots, experts=experts)


# ---------------------------------------------------------------------- the daemon


class ServeProcess:
    """`moed serve` as a child process; its JSON log lines are parsed as they arrive.

    argv: the command; env: its environment. The last LOG_TAIL_LINES lines of its stderr
    are kept for an error report. Use from one event loop.
    """

    def __init__(self, argv: list[str], env: Mapping[str, str]):
        self.argv = argv
        self.env = dict(env)
        self.proc: asyncio.subprocess.Process | None = None
        self.events: list[dict] = []
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._reader: asyncio.Task | None = None
        self._changed = asyncio.Event()

    async def start(self) -> None:
        # A session of its own: a terminal's Ctrl-C reaches only the demo, which stops
        # the daemon with SIGTERM (a second SIGINT would make the daemon skip its drain).
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=self.env, start_new_session=True, limit=2**20)
        self._reader = asyncio.create_task(self._read_log())

    async def _read_log(self) -> None:
        async for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    self.events.append(event)
            self._changed.set()
        await self.proc.wait()
        self._changed.set()

    def find(self, name: str) -> dict | None:
        return next((e for e in self.events if e.get("event") == name), None)

    async def wait_event(self, name: str, timeout: float) -> dict:
        """The first log event called `name`; DemoError when the daemon exits or times out first."""
        deadline = time.monotonic() + timeout
        while (found := self.find(name)) is None:
            if self._reader.done():
                raise DemoError(f"moed serve exited with code {self.proc.returncode} before "
                                f"it was {name}" + self.log_tail())
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                raise DemoError(f"moed serve logged no {name!r} event within {timeout:.0f} s"
                                + self.log_tail()) from None
        return found

    def log_tail(self) -> str:
        lines = "\n".join(f"  {line}" for line in self.tail)
        return f"; its last log lines:\n{lines}" if lines else "; it logged nothing"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then the exit code; SIGKILL (and DemoError) when it does not end in time."""
        if self.proc is None:
            return 0
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), timeout)
        except TimeoutError:
            self.proc.kill()
            await self._reader
            raise DemoError(f"moed serve did not stop within {timeout:.0f} s of SIGTERM; "
                            "killed it" + self.log_tail()) from None
        return self.proc.returncode


def serve_command(model_dir: Path, socket_path: str, state_dir: Path, config_path: Path,
                  cache_bytes: int, mode: str = "moed") -> list[str]:
    """The `moed serve` command line of the demo daemon (this Python, this moed).

    -P keeps the current directory off the child's import path: run from a source
    checkout, its uncompiled ext/ would otherwise hide the installed, compiled one.
    """
    return [sys.executable, "-P", "-m", "daemon.commands.cli", "serve", "--log-level", "info",
            "--config", str(config_path), "--model", str(model_dir), "--socket", socket_path,
            "--state-dir", str(state_dir), "--expert-cache-bytes", str(cache_bytes),
            "--metrics-address", "127.0.0.1:0", "--expert-cache-mode", mode,
            # the runs compare hit rates: a tuner moving the prefetch width between them
            # would blur what the learned pins did
            "--tuner", "off"]


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without MOED_* settings and service-manager variables meant for a parent."""
    return {k: v for k, v in environ.items()
            if not k.startswith("MOED_") and k not in _FOREIGN_ENV}


# ---------------------------------------------------------------------- the run


@dataclass(frozen=True)
class RunSpec:
    """One daemon start of the demo: its name, its expert cache mode, its prompt."""

    name: str
    mode: str                 # ServeConfig.expert_cache_mode: "moed" or "naive"
    prompt: str
    max_tokens: int
    shown: bool               # stream the completion to stdout
    learned: bool = False     # start from the copy of what the learning run saved


@dataclass
class RunFigures:
    """What one daemon start measured (all from the daemon's own counters).

    tokens: completion tokens; duration_s: request sent to answer done (prompt included).
    bytes_read: expert bytes read from the shards, the reads before the request (pins, the
    warm start's experts: start_bytes_read) included. prompt_hits / prompt_misses: expert
    cache lookups of the prompt's prefill; answer_hits / answer_misses: of the decode
    steps (a lookup served by a prefetch already under way counts as a hit).
    pins_at_start / pins_at_end: experts pinned before and after the request.
    """

    name: str
    text: str
    tokens: int
    duration_s: float
    bytes_read: int
    start_bytes_read: int
    prompt_hits: int
    prompt_misses: int
    answer_hits: int
    answer_misses: int
    pins_at_start: int
    pins_at_end: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_read / max(1, self.tokens)

    @property
    def answer_hit_rate(self) -> float | None:
        return _rate(self.answer_hits, self.answer_misses)

    @property
    def prompt_hit_rate(self) -> float | None:
        return _rate(self.prompt_hits, self.prompt_misses)


def figures_from_stats(name: str, text: str, tokens: int, duration_s: float, before: dict,
                       after: dict, pins_at_start: int, pins_at_end: int) -> RunFigures:
    """RunFigures from /v1/moed/stats read before and after the request (one request per
    daemon start, so the counters after it are the run's)."""
    experts = after.get("experts") or {}
    lookups = experts.get("lookups") or {}

    def count(phase: str, *kinds: str) -> int:
        return sum(int((lookups.get(phase) or {}).get(kind, 0)) for kind in kinds)

    return RunFigures(
        name=name, text=text, tokens=tokens, duration_s=duration_s,
        bytes_read=int(experts.get("bytes_read", 0)),
        start_bytes_read=int((before.get("experts") or {}).get("bytes_read", 0)),
        prompt_hits=count("prefill", "hit", "prefetch_hit"), prompt_misses=count("prefill", "miss"),
        answer_hits=count("decode", "hit", "prefetch_hit"), answer_misses=count("decode", "miss"),
        pins_at_start=pins_at_start, pins_at_end=pins_at_end)


def _rate(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


LEARN_NAME = "moed learning"
NAIVE_NAME = "naive LRU, cold"
WARM_NAME = "moed, restarted"


def demo_runs(max_tokens: int, repeats: int) -> list[RunSpec]:
    """The demo's daemon starts, in order (see the module doc): the learning run, then
    `repeats` pairs of the naive cache and moed restarted with what it learned. The last
    one's answer is shown, and with --keep that daemon keeps serving."""
    runs = [RunSpec(LEARN_NAME, "moed", LEARN_PROMPT, LEARN_TOKENS_FACTOR * max_tokens,
                    shown=False)]
    for i in range(1, repeats + 1):
        runs.append(RunSpec(f"{NAIVE_NAME} {i}/{repeats}", "naive", DEMO_PROMPT, max_tokens,
                            shown=False))
        runs.append(RunSpec(f"{WARM_NAME} {i}/{repeats}", "moed", DEMO_PROMPT, max_tokens,
                            shown=i == repeats, learned=True))
    return runs


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _kib(n: float) -> str:
    return f"{n / 2**10:.0f} KiB"


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def model_line(model_dir: Path, embedded: bool) -> str:
    """One line saying what the model is."""
    from ext.models.config import load_config

    config = load_config(model_dir)
    shape = (f"{config.model_type}, {sum(config.moe_layers)} MoE layers of {config.num_experts} "
             f"experts, {config.top_k} per token")
    if embedded:
        return (f"the model: moed's embedded default model, a small Mixture-of-Experts ({shape}) "
                "trained on the Python standard library; it completes Python code")
    return f"the model: {model_dir} ({shape})"


@dataclass(frozen=True)
class Spread:
    """One figure over a mode's starts: its median, least and most."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float | None]) -> Spread | None:
        """None when no start had the figure (a rate with no lookups)."""
        known = sorted(v for v in values if v is not None)
        if not known:
            return None
        return cls(statistics.median(known), known[0], known[-1])

    def shown(self, fmt: Callable[[float], str]) -> str:
        """'median (min-max)', or the one value when every start had it."""
        if self.low == self.high:
            return fmt(self.median)
        return f"{fmt(self.median)} ({fmt(self.low)}-{fmt(self.high)})"


# The columns of the table: heading, figure of one start, format. `moed demo --help` and
# docs/cli.md name them the same way.
_COLUMNS: list[tuple[str, Callable[[RunFigures], float | None], Callable[[float], str]]] = [
    ("tokens/s median (min-max)", lambda r: r.tokens_per_s, lambda x: f"{x:.1f}"),
    ("read/token", lambda r: r.bytes_per_token, lambda x: _kib(x)),
    ("answer hit rate", lambda r: r.answer_hit_rate, lambda x: _percent(x)),
    ("prompt hit rate", lambda r: r.prompt_hit_rate, lambda x: _percent(x)),
    ("read before request", lambda r: r.start_bytes_read, lambda x: _kib(x)),
]


def summary_lines(runs: list[RunFigures], budget: CacheBudget, io_path: str | None) -> list[str]:
    """The comparison printed on stdout after the answer, from every start in the order of
    `demo_runs` (the learning run, then naive and restarted moed alternately): the learning
    run on a line of its own, a row per mode with the median tokens/s and its min-max, and
    what the figures say in words, whichever way they came out."""
    learn, naive, warm = runs[0], runs[1::2], runs[2::2]
    assert len(naive) == len(warm) >= 1, len(runs)
    lines = [
        f"expert cache budget: {_mib(budget.cache_bytes)} for {_mib(budget.expert_bytes)} of "
        f"routed experts ({100 * budget.cache_bytes / budget.expert_bytes:.0f} %); the shards' "
        "page cache was dropped (POSIX_FADV_DONTNEED) before each start and the daemon reads "
        f"experts {'with O_DIRECT' if io_path == 'direct' else 'dropping what it read'}, so "
        "every miss is read from disk",
        f"learning run (another prompt and {learn.tokens} tokens, not comparable with the rows "
        f"below): {learn.tokens_per_s:.1f} tokens/s, {_kib(learn.bytes_per_token)} read/token, "
        f"answer hit rate {_percent(learn.answer_hit_rate)}, prompt hit rate "
        f"{_percent(learn.prompt_hit_rate)}",
        f"the same prompt and seed, {warm[-1].tokens} tokens, {len(naive)} starts of each, "
        "alternately:",
    ]
    cells = [["", *(heading for heading, _, _ in _COLUMNS)]]
    for name, mode in ((NAIVE_NAME, naive), (WARM_NAME, warm)):
        row = [name]
        for _, figure, fmt in _COLUMNS:
            spread = Spread.of([figure(r) for r in mode])
            row.append("n/a" if spread is None else spread.shown(fmt))
        cells.append(row)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        lines.append("  ".join([row[0].ljust(widths[0])]
                               + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]).rstrip())
    lines.append("(tokens/s: answer tokens over the request's time, the prompt included; "
                 "read/token: expert bytes read from disk per answer token, the reads before "
                 "the request included; answer hit rate: the expert cache lookups of the "
                 "answer's tokens; prompt hit rate: those of the prompt; read before request: "
                 "expert bytes the daemon read at start, before the request came)")
    lines.extend(_verdict_lines(naive, warm))
    lines.append(_warm_start_line(learn, naive, warm))
    lines.append("not compared: the page-cache (mmap) mode, since nothing here can hold the "
                 "page cache to the same budget (that takes a memory cgroup); without one it "
                 f"keeps all {_mib(budget.expert_bytes)} of experts in RAM")
    return lines


def _same_in_every_start(runs: list[RunFigures]) -> bool:
    """Whether the counted figures (not the time) were the same in each of `runs`."""
    return len({(r.tokens, r.bytes_read, r.start_bytes_read, r.prompt_hits, r.prompt_misses,
                 r.answer_hits, r.answer_misses) for r in runs}) == 1


def _compare(ours: Spread | None, theirs: Spread | None, more: str, less: str,
             fmt: Callable[[float], str]) -> str:
    """How `ours` compares with `theirs`: more or less only when their ranges (min-max over
    the starts) do not overlap, 'the same' when every start of both had one value, else
    within the noise."""
    if ours is None or theirs is None or theirs.median <= 0:
        return "n/a"
    ratio = ours.median / theirs.median
    if ours.low > theirs.high:
        return f"{ratio:.2f}x ({more})"
    if ours.high < theirs.low:
        return f"{ratio:.2f}x ({less})"
    if ours.low == ours.high == theirs.low == theirs.high:
        return "the same"
    return (f"within the noise ({ratio:.2f}x of the medians {fmt(ours.median)} and "
            f"{fmt(theirs.median)}, but the ranges {fmt(ours.low)}-{fmt(ours.high)} and "
            f"{fmt(theirs.low)}-{fmt(theirs.high)} overlap)")


def _points(ours: Spread | None, theirs: Spread | None) -> str:
    if ours is None or theirs is None:
        return "n/a"
    return f"{100 * (ours.median - theirs.median):+.1f} points"


def _verdict_lines(naive: list[RunFigures], warm: list[RunFigures]) -> list[str]:
    """moed restarted with what it learned against the cold naive cache, same prompt: first
    the counted figures (bytes read, hits), which the machine's speed does not move, then
    tokens/s, which it does."""
    def spread(runs: list[RunFigures], figure: Callable[[RunFigures], float | None]):
        return Spread.of([figure(r) for r in runs])

    same = _same_in_every_start(naive) and _same_in_every_start(warm)
    reads = _compare(spread(warm, lambda r: r.bytes_per_token),
                     spread(naive, lambda r: r.bytes_per_token),
                     "MORE read on this machine", "less read", _kib)
    answer = _points(spread(warm, lambda r: r.answer_hit_rate),
                     spread(naive, lambda r: r.answer_hit_rate))
    prompt = _points(spread(warm, lambda r: r.prompt_hit_rate),
                     spread(naive, lambda r: r.prompt_hit_rate))
    speed = _compare(spread(warm, lambda r: r.tokens_per_s),
                     spread(naive, lambda r: r.tokens_per_s),
                     "faster: every moed start was faster than every naive one",
                     "SLOWER on this machine: every moed start was slower than every naive one",
                     lambda x: f"{x:.1f}")
    counted = ("the same in every start of each mode: they follow from the prompt, the seed and "
               "the cache, not from the machine's speed" if same else
               "they varied between starts of a mode (prefetches ending in another order), so "
               "these are medians")
    return [f"moed restarted with what it learned, against the naive cache: bytes read per "
            f"token {reads}; answer hit rate {answer}; prompt hit rate {prompt} ({counted})",
            f"speed, which this machine's load moves: tokens/s {speed}"]


def _warm_start_line(learn: RunFigures, naive: list[RunFigures], warm: list[RunFigures]) -> str:
    """What the restarts took from the learning run, in plain words."""
    read_before = Spread.of([r.start_bytes_read for r in warm])
    prompt_warm = Spread.of([r.prompt_hit_rate for r in warm])
    prompt_naive = Spread.of([r.prompt_hit_rate for r in naive])

    def percent(spread: Spread | None) -> str:
        return "n/a" if spread is None else spread.shown(_percent)

    pins = warm[0].pins_at_start
    if learn.pins_at_end == 0 and pins == 0:
        pinned = ("no experts were pinned: pins come only when the tuner finds that they pay, "
                  "and in the learning run it found they did not")
    else:
        pinned = (f"{pins} experts were pinned at start (the learning run ended with "
                  f"{learn.pins_at_end} pins, which its tuner found pay)")
    return (f"warm start: each restart found the state the learning run saved, by the model's "
            f"fingerprint: the experts its cache held when it stopped and their usage counts, "
            f"from which it read those experts ({read_before.shown(_kib)}) before the request, so the prompt's lookups hit "
            f"{percent(prompt_warm)}, against {percent(prompt_naive)} for the naive cache; "
            f"{pinned}")


def _reset_state_dir(state_dir: Path) -> None:
    """Empty the demo's own learned-state directory: the first start starts from nothing."""
    shutil.rmtree(state_dir, ignore_errors=True)
    try:
        state_dir.mkdir(parents=True)
    except OSError as e:
        raise DemoError(f"cannot create the demo's state directory {state_dir}: {e.strerror}") from None


def _copy_state(source: Path, target: Path) -> None:
    """Make `target` a copy of the state directory `source` (what was there goes)."""
    shutil.rmtree(target, ignore_errors=True)
    try:
        shutil.copytree(source, target)
    except OSError as e:
        raise DemoError(f"cannot copy the learned state from {source} to {target}: {e}") from None


def model_bytes(model_dir: Path) -> int:
    """The size of the files of the model directory (not of its subdirectories)."""
    return sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())


def tiny_model_line(size_bytes: int) -> str:
    """What the embedded default model's answers are worth, said after the completion."""
    return (f"(the default model is tiny, {size_bytes / 1e6:.0f} MB: its completions are "
            "plausible-looking Python, not correct code, and chat with it is meaningless)")


def run_demo(options: DemoOptions, *, out: TextIO, note: Callable[[str], None]) -> int:
    """Run the whole demo; 0 on success. Raises DemoError (with the daemon's last log lines)."""
    from daemon.store.reads import drop_page_cache
    from ext.formats.checkpoint import Checkpoint

    cache_dir = options.cache_dir.expanduser().absolute()
    model_dir = (options.model_dir or default_model_dir()).expanduser().absolute()
    check_model(model_dir)
    out.write(model_line(model_dir, options.model_dir is None) + "\n")
    out.flush()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DemoError(f"cannot create the demo directory {cache_dir}: {e.strerror}") from None
    budget = cache_budget(model_dir)
    embedded = options.model_dir is None
    size = model_bytes(model_dir)
    state_dir = cache_dir / STATE_DIR_NAME
    _reset_state_dir(state_dir)
    with Checkpoint(model_dir) as checkpoint:
        shards = list(checkpoint.shards)
    workdir = tempfile.mkdtemp(prefix="moed-demo-")
    try:
        socket_path = os.path.join(workdir, "moed.sock")
        if len(os.fsencode(socket_path)) > UNIX_PATH_MAX:
            raise DemoError(f"the temporary directory {workdir} is too long for a Unix socket "
                            "path; set TMPDIR to a shorter directory")
        config_path = Path(workdir) / "moed.toml"
        config_path.write_text("# moed demo: every setting is on the command line\n")
        learned_dir = Path(workdir) / "learned-state"
        specs = demo_runs(options.max_tokens, options.repeats)
        note(f"{len(specs)} starts of moed serve on {socket_path}, each with an expert cache "
             f"of {_mib(budget.cache_bytes)} ({budget.slots} of {budget.experts} experts, "
             f"{_mib(budget.expert_bytes)} in all) and the shards' page cache dropped first: "
             f"moed learning (state in {state_dir}, emptied now), then {options.repeats} times "
             "each, alternately, the naive cache (LRU, no pins, no prefetch, nothing learned) "
             "and moed restarted with what it learned")
        figures: list[RunFigures] = []

        def finish(last: RunFigures, io_path: str | None) -> None:
            figures.append(last)
            if any(r.text != last.text for r in figures[1:]):
                note("note: the answers to the same prompt and seed differed between starts")
            if embedded:
                out.write(tiny_model_line(size) + "\n\n")
            for line in summary_lines(figures, budget, io_path):
                out.write(line + "\n")
            out.flush()

        for spec in specs:
            if spec.learned:
                _copy_state(learned_dir, state_dir)   # every restart starts from the same state
            try:
                drop_page_cache(shards)
            except OSError as e:
                raise DemoError(f"cannot drop the page cache of the model's shards: {e}") from None
            argv = serve_command(model_dir, socket_path, state_dir, config_path,
                                 budget.cache_bytes, spec.mode)
            last = spec is specs[-1]
            run = asyncio.run(_serve_and_ask(options, spec, argv, socket_path, out, note,
                                             finish=finish if last else None,
                                             keep=options.keep and last))
            if not last:
                figures.append(run)
            if spec is specs[0]:
                _copy_state(state_dir, learned_dir)
        note("done")
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _serve_and_ask(options: DemoOptions, spec: RunSpec, argv: list[str], socket_path: str,
                         out: TextIO, note: Callable[[str], None],
                         finish: Callable[[RunFigures, str | None], None] | None = None,
                         keep: bool = False) -> RunFigures:
    """Start the daemon, ask `spec.prompt`, read its counters, call `finish(figures, io
    path)` when given, keep serving until a signal when `keep`, and stop the daemon (exit
    code 0 required). Returns the figures."""
    from daemon.commands.client import Client, Target, completion_request

    daemon = ServeProcess(argv, child_environment(options.environ))
    t0 = time.monotonic()
    await daemon.start()
    try:
        await daemon.wait_event("ready", READY_TIMEOUT_S)
        metrics = daemon.find("metrics_listening")
        metrics_url = f"http://{metrics['address']}/metrics" if metrics else "(not served)"
        note(f"{spec.name}: daemon ready in {time.monotonic() - t0:.1f} s; asking it to "
             f"complete {spec.prompt!r}")
        async with Client(Target.unix(socket_path)) as client:
            before = await client.get("/v1/moed/stats")
            pins_at_start = len((await client.get("/v1/moed/pins")).get("pins") or ())

            def write(piece: str) -> None:
                if spec.shown:
                    out.write(piece)
                    out.flush()

            body = completion_request(prompt=spec.prompt, max_tokens=spec.max_tokens,
                                      temperature=DEMO_TEMPERATURE, seed=DEMO_SEED)
            if spec.shown:
                out.write(spec.prompt)
            result = await client.stream("/v1/completions", body, write)
            if spec.shown:
                out.write("\n\n")
                out.flush()
            stats = await client.get("/v1/moed/stats")
            pins_at_end = len((await client.get("/v1/moed/pins")).get("pins") or ())
        figures = figures_from_stats(spec.name, result.text, result.completion_tokens or 0,
                                     result.duration_s, before, stats, pins_at_start, pins_at_end)
        if finish is not None:
            finish(figures, (stats.get("experts") or {}).get("io_path"))
        if keep:
            await _serve_until_signal(daemon, socket_path, metrics_url, note)
        elif spec.shown:
            note(f"{spec.name}: metrics were at {metrics_url} while it ran (--keep keeps the "
                 "last one serving)")
        note(f"{spec.name}: stopping the daemon (SIGTERM)")
        code = await daemon.stop()
        if code != 0:
            raise DemoError(f"moed serve exited with code {code} after SIGTERM" + daemon.log_tail())
        return figures
    except BaseException:
        if daemon.running:
            with contextlib.suppress(DemoError):
                await daemon.stop()
        raise


async def _serve_until_signal(daemon: ServeProcess, socket_path: str, metrics_url: str,
                              note: Callable[[str], None]) -> None:
    """--keep: let the daemon serve until SIGINT or SIGTERM reaches the demo (or it exits)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    note("the daemon keeps serving; try, in another terminal:\n"
         f"  moed chat --socket {socket_path}\n"
         f"  moed stats --socket {socket_path}\n"
         f"  curl --unix-socket {socket_path} http://localhost/v1/models\n"
         f"  curl {metrics_url}\n"
         "press Ctrl-C to stop it")
    try:
        waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(daemon.proc.wait())}
        _done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    if not daemon.running:
        raise DemoError(f"moed serve exited on its own with code {daemon.proc.returncode}"
                        + daemon.log_tail())


# ---------------------------------------------------------------- the command

def register(sub, parents: Parents) -> None:
    """`moed demo` and its options."""
    d = sub.add_parser(
        "demo", parents=[parents.common],
        description="Show moed at work with nothing but the install: with the embedded "
                    "default model (a small Qwen3-MoE that completes Python code, trained on "
                    "the standard library) and an expert cache of a quarter of its experts, "
                    "start moed serve on a private socket, each time after dropping the model "
                    "files' page cache so that experts are read from disk: once for moed "
                    "learning which experts are hot (on another prompt), then --repeats times "
                    "each, alternately, the naive cache (LRU, no pins, no prefetch) and moed "
                    "restarted with what it learned; the last restart streams a code "
                    "completion. Then print what they measured (tokens/s median (min-max), "
                    "read/token: bytes read from disk per token, answer hit rate, prompt hit "
                    "rate, read before request) and how they compare, whichever way that came "
                    "out: tokens/s differ only when their ranges do not overlap. Progress goes "
                    "to stderr; the completion and the figures to stdout.",
        epilog="examples:\n"
               "  moed demo\n"
               "  moed demo --keep          (then: moed chat --socket PATH, as it prints)\n"
               "  moed demo --dir ./moed-demo --model ./my-model",
        formatter_class=ExamplesFormatter)
    d.add_argument("--dir", default=None, metavar="DIR", type=nonempty,
                   help="the demo keeps the state its runs learn in DIR/demo-state, which it "
                        "empties when it starts (nothing else in DIR is touched; default DIR: "
                        "$XDG_CACHE_HOME/moed, else ~/.cache/moed)")
    d.add_argument("--model", default=None, metavar="DIR", type=nonempty,
                   help="serve this Hugging Face model directory instead of the embedded "
                        "default model")
    d.add_argument("--keep", action="store_true",
                   help="keep the last daemon (moed with what it learned) serving after the "
                        "demo, until Ctrl-C")
    d.add_argument("--max-tokens", type=positive_int, default=DEMO_MAX_TOKENS, metavar="N",
                   help=f"most tokens of each answer; the learning start answers "
                        f"{LEARN_TOKENS_FACTOR} times as many (default: {DEMO_MAX_TOKENS})")
    d.add_argument("--repeats", type=at_least_two, default=DEMO_REPEATS, metavar="N",
                   help="starts of each of the naive cache and the restarted moed, at least 2 "
                        f"(default: {DEMO_REPEATS})")
    d.set_defaults(func=run)


def at_least_two(text: str) -> int:
    """argparse type: an integer of at least 2 (one start each cannot tell noise apart)."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}")
    return value


@client_command
def run(args: argparse.Namespace) -> int:
    if args.model:
        check_model_dir(args.model)
    options = DemoOptions(cache_dir=Path(args.dir) if args.dir else default_cache_dir(os.environ),
                          model_dir=Path(args.model) if args.model else None, keep=args.keep,
                          max_tokens=args.max_tokens, repeats=args.repeats,
                          environ=os.environ)
    try:
        return run_demo(options, out=sys.stdout,
                        note=lambda message: print(f"moed demo: {message}", file=sys.stderr,
                                                   flush=True))
    except DemoError as e:
        print(f"moed demo: error: {e}", file=sys.stderr)
        return 1
