"""`moed demo`: the daemon and a client on the embedded default model, for someone who just
installed moed.

What it does, in order:
1. Takes the embedded default model (`default_model_dir`: a small Qwen3-MoE trained on
   the Python standard library, shipped as package data; see its README.md) or the model
   directory given with ``--model``, and checks that it can be served.
2. Starts `moed serve` as a child process on a private socket in a new temporary
   directory, with an expert cache of `DEMO_CACHE_FRACTION` of the routed experts' bytes
   (never below the daemon's minimum plus room for pins), a state directory inside the
   cache directory (``$XDG_CACHE_HOME/moed``, else ``~/.cache/moed``, or ``--dir``; so
   the next run starts with the pins this one learned), and metrics on a free loopback
   port. Its JSON log lines on stderr are read as they arrive: readiness is its ``ready``
   event.
3. Streams a completion of `DEMO_PROMPT` (a chat message; the default model's template
   hands it over as code to continue) through the socket to stdout.
4. Prints what the cache did (hit rate, against the previous run's on the same model;
   bytes read, tokens/s, pins, metrics URL) on stdout, stops the daemon with SIGTERM and
   requires exit code 0. With ``--keep`` the daemon keeps serving until Ctrl-C (or
   SIGTERM) first.

Progress goes to stderr; the daemon's own log stays hidden unless it fails, then its last
lines are shown. The learned usage lives in ``<dir>/demo-state`` (keyed by the model's
fingerprint), the last run's figures in ``<dir>/demo-last-run.json``.
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
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from daemon.commands.args import ExamplesFormatter, Parents, check_model_dir, nonempty, positive_int
from daemon.commands.ask import client_command
from daemon.service.config import default_model_dir

if TYPE_CHECKING:       # the client (aiohttp) is imported when the demo runs
    from daemon.commands.client import StreamResult

DEMO_PROMPT = "def fibonacci(n):\n"      # the default model completes Python code
DEMO_CACHE_FRACTION = 0.25     # of the routed experts' bytes ...
# ... but at least this many slots per MoE layer beyond the daemon's minimum (top_k per
# layer): pins come out of that spare room (for the default model, 8 of 32 experts per
# layer is top_k 4 + 4 spare, so a quarter it is).
DEMO_SPARE_SLOTS_PER_LAYER = 2
DEMO_MAX_TOKENS = 96
DEMO_TEMPERATURE = 0.7
DEMO_SEED = 0                  # the same text every run: only the cache changes between runs
STATE_DIR_NAME = "demo-state"
LAST_RUN_NAME = "demo-last-run.json"
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

    cache_dir: where the learned state and the last run's figures live.
    model_dir: the model to serve (None: the embedded default model).
    keep: keep the daemon serving after the demo until SIGINT/SIGTERM.
    environ: the environment the daemon child starts from (MOED_* keys are dropped).
    """

    cache_dir: Path
    model_dir: Path | None = None
    keep: bool = False
    max_tokens: int = DEMO_MAX_TOKENS
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
                  cache_bytes: int) -> list[str]:
    """The `moed serve` command line of the demo daemon (this Python, this moed).

    -P keeps the current directory off the child's import path: run from a source
    checkout, its uncompiled ext/ would otherwise hide the installed, compiled one.
    """
    return [sys.executable, "-P", "-m", "daemon.commands.cli", "serve", "--log-level", "info",
            "--config", str(config_path), "--model", str(model_dir), "--socket", socket_path,
            "--state-dir", str(state_dir), "--expert-cache-bytes", str(cache_bytes),
            "--metrics-address", "127.0.0.1:0",
            # the runs compare hit rates: a tuner moving the prefetch width between them
            # would blur what the learned pins did
            "--tuner", "off"]


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without MOED_* settings and service-manager variables meant for a parent."""
    return {k: v for k, v in environ.items()
            if not k.startswith("MOED_") and k not in _FOREIGN_ENV}


# ---------------------------------------------------------------------- the run


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def summary_lines(*, result: StreamResult, stats: dict, pins: dict, budget: CacheBudget,
                  metrics_url: str, previous: dict | None, keep: bool,
                  start_pinned: int = 0) -> list[str]:
    """The stats summary printed on stdout after the answer."""
    tokens = result.completion_tokens or 0
    rate = tokens / result.duration_s if result.duration_s > 0 else 0.0
    first = ("" if result.time_to_first_text_s is None
             else f", first text after {result.time_to_first_text_s:.2f} s")
    experts = stats.get("experts") or {}
    hit_rate = stats.get("hit_rate")
    before = ""
    if previous is not None and isinstance(previous.get("hit_rate"), (int, float)):
        before = f" (previous run: {_percent(previous['hit_rate'])}"
        if isinstance(hit_rate, (int, float)):
            before += f", {100 * (hit_rate - previous['hit_rate']):+.1f} points"
        before += ")"
    pinned = len(pins.get("pins") or ())
    adaptation = (stats.get("cache") or {}).get("adaptation") or stats.get("adaptation") or {}
    lines = [
        f"moed demo: {tokens} tokens in {result.duration_s:.2f} s, {rate:.1f} tokens/s "
        f"(prompt included){first}",
        f"expert cache: {_mib(budget.cache_bytes)} for {_mib(budget.expert_bytes)} of routed "
        f"experts ({100 * budget.cache_bytes / budget.expert_bytes:.0f} %), hit rate "
        f"{_percent(hit_rate)}{before}",
        f"expert bytes read from disk: {_mib(experts.get('bytes_read', 0))} "
        f"({experts.get('hits', 0)} hits, {experts.get('prefetch_hits', 0)} found already "
        f"being read, {experts.get('misses', 0)} misses; prefetch read "
        f"{_mib((experts.get('bytes_read_by_reason') or {}).get('prefetch', 0))} ahead of need, "
        f"{_mib(experts.get('prefetch_wasted_bytes', 0))} of it unused)",
    ]
    lines.append(f"pinned experts: {pinned} of {budget.experts} now, {start_pinned} when this run "
                 "started" + (" (learned in earlier runs)" if start_pinned else ""))
    lines += _learning_lines(adaptation)
    lines.append(f"metrics: {metrics_url}" + ("" if keep else " (while the daemon ran; "
                                              "--keep keeps it serving)"))
    return lines


def _learning_lines(adaptation: dict) -> list[str]:
    """What the pin learner decided and why, and what the referee estimates, in words."""
    out = []
    learning = adaptation.get("pin_learning") or {}
    last = learning.get("last")
    if learning:
        if last is None:
            out.append("pin learning: no decision yet (the first needs 64 tokens of routing, "
                       "prompt included, and learning may take only a small share of the time)")
        elif last["validation"]["challenger"]["hit_rate"] is None:
            v = last["validation"]
            kept = "kept" if learning.get("share") else "no pins kept"
            out.append(f"pin learning: {kept} — on the older tokens the set in use (share "
                       f"{v['incumbent']['share']:.3g}) was still the best candidate")
        else:
            v = last["validation"]
            won = v["challenger"]
            kept = "kept" if learning.get("share") else "no pins kept"
            out.append(f"pin learning: {kept} — on the newest {v['window_tokens']} tokens the "
                       f"best candidate (share {won['share']:.3g}, {won['source']} counts) hit "
                       f"{_percent(won['hit_rate'])} against {_percent(v['incumbent']['hit_rate'])} "
                       f"for the set in use (share {v['incumbent']['share']:.3g}); pins change only "
                       "when they win by a margin")
    prior = adaptation.get("next_expert_prior") or {}
    if prior.get("from_earlier_session"):
        if prior.get("weighted_layers"):
            out.append(f"next-expert statistics from earlier runs: {prior['weighted_layers']} layers, "
                       f"weighted {prior['mean_weight']:.2f} now (0..1: how well they have predicted "
                       "this run's routing)")
        else:
            out.append("next-expert statistics from earlier runs: kept for the predictive policy, "
                       "which is turned off now")
    naive = adaptation.get("against_naive") or {}
    referee = adaptation.get("referee") or {}
    if naive.get("naive_hit_rate") is not None:
        off = [m for m, st in (referee.get("mechanisms") or {}).items() if st.get("managed") and not st.get("on")]
        speedup = (referee.get("latest") or {}).get("estimated_speedup")
        out.append(f"do no harm: the naive cache (LRU, no pins, no prefetch) would have hit "
                   f"{_percent(naive['naive_hit_rate'])} of these decode lookups"
                   + (f"; estimated speed-up over it {speedup:.2f}x" if speedup else "")
                   + (f"; turned off as not paying here: {', '.join(off)}" if off else ""))
    return out


def _read_last_run(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_last_run(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def run_demo(options: DemoOptions, *, out: TextIO, note: Callable[[str], None]) -> int:
    """Run the whole demo; 0 on success. Raises DemoError (with the daemon's last log lines)."""
    cache_dir = options.cache_dir.expanduser().absolute()
    model_dir = (options.model_dir or default_model_dir()).expanduser().absolute()
    check_model(model_dir)
    note(f"model: {model_dir}" + (" (the embedded default model)" if options.model_dir is None else ""))
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DemoError(f"cannot create the demo directory {cache_dir}: {e.strerror}") from None
    budget = cache_budget(model_dir)
    state_dir = cache_dir / STATE_DIR_NAME
    workdir = tempfile.mkdtemp(prefix="moed-demo-")
    try:
        socket_path = os.path.join(workdir, "moed.sock")
        if len(os.fsencode(socket_path)) > UNIX_PATH_MAX:
            raise DemoError(f"the temporary directory {workdir} is too long for a Unix socket "
                            "path; set TMPDIR to a shorter directory")
        config_path = Path(workdir) / "moed.toml"
        config_path.write_text("# moed demo: every setting is on the command line\n")
        argv = serve_command(model_dir, socket_path, state_dir, config_path, budget.cache_bytes)
        note(f"starting moed serve on {socket_path} with an expert cache of "
             f"{_mib(budget.cache_bytes)} ({budget.slots} of {budget.experts} experts, "
             f"{_mib(budget.expert_bytes)} in all), learned state in {state_dir}")
        return asyncio.run(_serve_and_ask(options, argv, socket_path, budget, model_dir,
                                          cache_dir / LAST_RUN_NAME, out, note))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _serve_and_ask(options: DemoOptions, argv: list[str], socket_path: str,
                         budget: CacheBudget, model_dir: Path, last_run: Path, out: TextIO,
                         note: Callable[[str], None]) -> int:
    from daemon.commands.client import Client, completion_request

    daemon = ServeProcess(argv, child_environment(options.environ))
    t0 = time.monotonic()
    await daemon.start()
    try:
        await daemon.wait_event("ready", READY_TIMEOUT_S)
        metrics = daemon.find("metrics_listening")
        metrics_url = f"http://{metrics['address']}/metrics" if metrics else "(not served)"
        note(f"daemon ready in {time.monotonic() - t0:.1f} s; asking it: {DEMO_PROMPT!r}")
        async with Client(socket_path) as client:
            start_pinned = len((await client.get("/v1/moed/pins")).get("pins") or ())

            def write(piece: str) -> None:
                out.write(piece)
                out.flush()

            body = completion_request(messages=[{"role": "user", "content": DEMO_PROMPT}],
                                      max_tokens=options.max_tokens, temperature=DEMO_TEMPERATURE,
                                      seed=DEMO_SEED)
            write(DEMO_PROMPT)
            result = await client.stream("/v1/chat/completions", body, write)
            out.write("\n\n")
            stats = await client.get("/v1/moed/stats")
            pins = await client.get("/v1/moed/pins")
        previous = _read_last_run(last_run)
        if previous is not None and (previous.get("model") != str(model_dir)
                                     or previous.get("max_tokens") != options.max_tokens):
            previous = None     # another model's or another length's figures compare to nothing
        for line in summary_lines(result=result, stats=stats, pins=pins, budget=budget,
                                  metrics_url=metrics_url, previous=previous, keep=options.keep,
                                  start_pinned=start_pinned):
            out.write(line + "\n")
        out.flush()
        if options.keep:
            await _serve_until_signal(daemon, socket_path, metrics_url, note)
        note("stopping the daemon (SIGTERM)")
        code = await daemon.stop()
        if code != 0:
            raise DemoError(f"moed serve exited with code {code} after SIGTERM" + daemon.log_tail())
        _write_last_run(last_run, {"model": str(model_dir), "max_tokens": options.max_tokens,
                                   "hit_rate": stats.get("hit_rate"),
                                   "pinned_experts": len(pins.get("pins") or ()),
                                   "completion_tokens": result.completion_tokens})
        note("done" if previous is not None else
             "done; run it again to start from what this run learned")
        return 0
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
        description="Show moed at work with nothing but the install: start moed serve on a "
                    "private socket with the embedded default model (a small Qwen3-MoE that "
                    "completes Python code, trained on the standard library) and an expert "
                    "cache of a quarter of its experts, stream a completion of a Python "
                    "prompt from it, print what the cache did (hit rate, bytes read from disk, "
                    "tokens/s, pinned experts, metrics address) and stop the daemon. The "
                    "daemon remembers which experts were used: run the demo again and it "
                    "starts with them pinned, and prints the hit rate next to the previous "
                    "run's. Progress goes to stderr; the completion and the summary to stdout.",
        epilog="examples:\n"
               "  moed demo\n"
               "  moed demo --keep          (then: moed chat --socket PATH, as it prints)\n"
               "  moed demo --dir ./moed-demo --model ./my-model",
        formatter_class=ExamplesFormatter)
    d.add_argument("--dir", default=None, metavar="DIR", type=nonempty,
                   help="where the demo keeps its learned state and last run's figures "
                        "(default: $XDG_CACHE_HOME/moed, else ~/.cache/moed)")
    d.add_argument("--model", default=None, metavar="DIR", type=nonempty,
                   help="serve this Hugging Face model directory instead of the embedded "
                        "default model")
    d.add_argument("--keep", action="store_true",
                   help="keep the daemon serving after the demo, until Ctrl-C")
    d.add_argument("--max-tokens", type=positive_int, default=96, metavar="N",
                   help="most tokens of the answer (default: 96)")
    d.set_defaults(func=run)


@client_command
def run(args: argparse.Namespace) -> int:
    if args.model:
        check_model_dir(args.model)
    options = DemoOptions(cache_dir=Path(args.dir) if args.dir else default_cache_dir(os.environ),
                          model_dir=Path(args.model) if args.model else None, keep=args.keep,
                          max_tokens=args.max_tokens, environ=os.environ)
    try:
        return run_demo(options, out=sys.stdout,
                        note=lambda message: print(f"moed demo: {message}", file=sys.stderr,
                                                   flush=True))
    except DemoError as e:
        print(f"moed demo: error: {e}", file=sys.stderr)
        return 1
