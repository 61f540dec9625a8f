"""The `moed` command line.

Every command keeps stdout for its result (generated text, JSON, a path) and sends
logs and progress to stderr; progress bars appear only when stderr is a terminal.
Exit status: 0 on success, 1 when the input (model directory, config, prompt) is
at fault, 2 for a usage error (argparse's convention).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

# OpenMP threads that spin while waiting starve the io workers and any other process of
# the CPU they need; on a busy 2-core machine decode with 2 compute threads and streamed
# experts fell from ~150 to ~5 tokens/s (moed generate, demo model, 4.7 MiB cache, a
# second process loading the CPU), and passive waiting kept it at 137-156. Set before
# libgomp loads (the kernels import it lazily); OMP_WAIT_POLICY=ACTIVE overrides.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

log = logging.getLogger("moed")


class _Progress:
    """A one-line progress bar on stderr when it is a TTY; silent otherwise."""

    def __init__(self, label: str):
        self.label = label
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {done / 2**20:8.1f} MiB")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


MAX_THREADS = 1024


def _thread_count(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_THREADS}, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024): 512M, 2G, 65536."""
    from daemon.config import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class UsageError(Exception):
    """A command-line value that argparse's types cannot check alone (exit 2)."""


MODEL_HELP = 'model directory ("default": the embedded default model)'


def _model_dir(path: str) -> str:
    """An existing directory, else a usage error naming it."""
    from pathlib import Path

    p = Path(path)
    if not p.exists():
        raise UsageError(f"--model: {path} does not exist")
    if not p.is_dir():
        raise UsageError(f"--model: {path} is not a directory (expected a model directory "
                         "with config.json, tokenizer.json and *.safetensors)")
    return path


def _sampling(args: argparse.Namespace):
    """SamplingParams from the command's flags; a usage error naming the flag at fault."""
    from ext.sampling import SamplingParamError, SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)
    except SamplingParamError as e:
        raise UsageError(f"--{e.field.replace('_', '-')}: {e}") from None


def _utf8_prompt(prompt: str) -> None:
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("PROMPT is not valid UTF-8") from None


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.model is None:
        return _generate_over_socket(args)
    from ext.generate import Generation
    from ext.model import Model
    from ext.tokenizer import Tokenizer, stop_token_ids

    sampling = _sampling(args)
    if args.socket is not None:
        raise UsageError("--socket asks the daemon and --model runs in this process: give one")
    _model_dir(args.model)
    _utf8_prompt(args.prompt)
    t0 = time.perf_counter()
    tokenizer = Tokenizer.from_model_dir(args.model)
    model, session = _load_model(args)
    log.info("model loaded: %s (%s, %d layers, %d experts, top_k %d) in %.2f s, %d threads",
             args.model, model.config.model_type, model.config.num_hidden_layers,
             model.config.num_experts, model.config.top_k, time.perf_counter() - t0, model.n_threads)
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    gen = Generation(model, prompt_ids, max_tokens=args.max_tokens, sampling=sampling,
                     stop_ids=stop_token_ids(args.model))
    decoder = tokenizer.stream_decoder()
    out = sys.stdout
    for token in gen:
        piece = decoder.step(token)
        if piece:
            out.write(piece)
            out.flush()
    out.write(decoder.finish() + "\n")
    out.flush()
    log.info("generated %d tokens (finish_reason=%s, prompt %d tokens): time to first token "
             "%.3f s, decode %.2f tokens/s%s", gen.completion_tokens, gen.finish_reason,
             len(prompt_ids), gen.time_to_first_token_s, gen.decode_tokens_per_s,
             f", seed {gen.sampler.seed}" if sampling.temperature > 0 else " (greedy)")
    if session is not None:
        log.info("expert cache: %s", json.dumps(session.summary()))
        try:
            session.flush()
        except OSError as e:
            log.warning("state_save_failed: %s", e)
    model.close()
    return 0


def _load_model(args: argparse.Namespace):
    """The model with the expert provider the options ask for; (model, session or None)."""
    from daemon.session import open_model

    return open_model(args.model, threads=args.threads, cache_bytes=args.expert_cache_bytes,
                      experts=args.experts, io_workers=args.io_workers,
                      prefetch=not args.no_prefetch, pin_fraction=args.pin_fraction,
                      state_dir=args.state_dir, environ=os.environ)


# ---------------------------------------------------------------- commands that ask the daemon

# generate's in-process-only options (dest -> flag); over the socket the daemon's own apply.
_IN_PROCESS_ONLY = {"threads": "--threads", "io_workers": "--io-workers", "experts": "--experts",
                    "expert_cache_bytes": "--expert-cache-bytes", "state_dir": "--state-dir",
                    "no_prefetch": "--no-prefetch", "pin_fraction": "--pin-fraction"}


def _socket(args: argparse.Namespace) -> str:

    from daemon.client import default_socket

    return args.socket or default_socket(os.environ)


class _TextOut:
    """Pieces of an answer written to stdout as they arrive; remembers whether a line is open."""

    def __init__(self):
        self.open = False

    def __call__(self, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()
        self.open = True

    def end_line(self) -> None:
        if self.open:
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.open = False


def _ask(args: argparse.Namespace, call):
    """Run `call(client)` (a coroutine) against the daemon; its result.

    DaemonError (including "nothing answers on the socket") propagates with a one-line
    message; `_client_command` turns it into exit status 1.
    """
    import asyncio

    from daemon.client import Client

    async def run():
        async with Client(_socket(args)) as client:
            return await call(client)
    return asyncio.run(run())


def _client_command(fn):
    """Wrap a command that talks to the daemon: its errors print one line and exit 1."""
    def command(args: argparse.Namespace) -> int:
        from daemon.client import DaemonError

        try:
            return fn(args)
        except DaemonError as e:
            print(f"moed {args.command}: error: {e}", file=sys.stderr)
            return 1
    return command


def _request_body(args: argparse.Namespace, *, prompt: str | None = None,
                  messages: list[dict] | None = None) -> dict:
    from daemon.client import completion_request

    return completion_request(prompt=prompt, messages=messages, max_tokens=args.max_tokens,
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              seed=args.seed)


@_client_command
def _generate_over_socket(args: argparse.Namespace) -> int:
    given = [flag for dest, flag in _IN_PROCESS_ONLY.items()
             if getattr(args, dest) != args.in_process_defaults[dest]]
    if given:
        raise UsageError(f"{', '.join(given)} only apply with --model (generation in this "
                         "process); the daemon serves with its own settings")
    _sampling(args)
    _utf8_prompt(args.prompt)
    if args.chat:
        path = "/v1/chat/completions"
        body = _request_body(args, messages=[{"role": "user", "content": args.prompt}])
    else:
        path, body = "/v1/completions", _request_body(args, prompt=args.prompt)
    text = _TextOut()
    try:
        result = _ask(args, lambda client: client.stream(path, body, text))
    except BaseException:
        text.end_line()
        raise
    sys.stdout.write("\n")      # like the in-process mode: the answer ends with a newline
    sys.stdout.flush()
    tokens = result.completion_tokens
    log.info("generated %s tokens (finish_reason=%s) through %s: first text after %s, "
             "%.2f s in all", "?" if tokens is None else tokens, result.finish_reason,
             _socket(args), "-" if result.time_to_first_text_s is None
             else f"{result.time_to_first_text_s:.3f} s", result.duration_s)
    return 0


CHAT_COMMANDS = "/exit (or Ctrl-D) ends the chat, /reset forgets the conversation"


@_client_command
def _cmd_chat(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from daemon.client import Client, DaemonError, DaemonUnavailableError

    _sampling(args)
    socket_path = _socket(args)
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)

    async def connect() -> Client:
        return Client(socket_path)

    with asyncio.Runner() as runner:
        client = runner.run(connect())
        try:
            models = runner.run(client.get("/v1/models"))
            if interactive:
                name = (models.get("data") or [{}])[0].get("id", "?")
                print(f"moed chat with {name} at {socket_path}; {CHAT_COMMANDS}.", file=sys.stderr)
            while (line := _read_turn(interactive)) is not None:
                line = line.strip()
                if not line:
                    continue
                if line in ("/exit", "/quit"):
                    break
                if line == "/reset":
                    history = list(system)
                    if interactive:
                        print("(conversation forgotten)", file=sys.stderr)
                    continue
                history.append({"role": "user", "content": line})
                text = _TextOut()
                try:
                    result = runner.run(client.stream("/v1/chat/completions",
                                                      _request_body(args, messages=history), text))
                except KeyboardInterrupt:
                    if not interactive:
                        raise
                    text.end_line()
                    print("(interrupted)", file=sys.stderr)
                    history.pop()
                    continue
                except DaemonUnavailableError:
                    raise
                except DaemonError as e:
                    text.end_line()
                    if not interactive:
                        raise
                    print(f"moed chat: error: {e}", file=sys.stderr)
                    history.pop()
                    continue
                sys.stdout.write("\n")
                sys.stdout.flush()
                history.append({"role": "assistant", "content": result.text})
                if result.finish_reason == "length" and interactive:
                    print(f"(answer cut at --max-tokens {args.max_tokens})", file=sys.stderr)
        finally:
            runner.run(client.close())
    return 0


def _read_turn(interactive: bool) -> str | None:
    """The user's next line, or None at end of input."""
    if not interactive:
        line = sys.stdin.readline()
        return line or None
    try:
        if sys.stdout.isatty():
            return input("> ")
        sys.stderr.write("> ")
        sys.stderr.flush()
        return input()
    except EOFError:
        sys.stderr.write("\n")
        return None
    except KeyboardInterrupt:       # Ctrl-C at the prompt ends the chat (exit status 130)
        sys.stderr.write("\n")
        raise


@_client_command
def _cmd_stats(args: argparse.Namespace) -> int:
    print(json.dumps(_ask(args, lambda client: client.get("/v1/moed/stats")), indent=2))
    return 0


@_client_command
def _cmd_pins(args: argparse.Namespace) -> int:
    if args.reset:
        answer = _ask(args, lambda client: client.post("/v1/moed/pins/reset"))
    else:
        answer = _ask(args, lambda client: client.get("/v1/moed/pins"))
    print(json.dumps(answer, indent=2))
    return 0


@_client_command
def _cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from daemon.demo import DemoError, DemoOptions, default_cache_dir, run_demo

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


def _threads() -> int:
    from ext.model import default_threads

    return default_threads()


def _cmd_make_model(args: argparse.Namespace) -> int:
    from ext.makemodel import make_model

    out = make_model(args.out, arch=args.arch, layers=args.layers, experts=args.experts,
                     top_k=args.top_k, hidden=args.hidden, intermediate=args.intermediate,
                     dtype=args.dtype, shard_size=args.shard_size, seed=args.seed,
                     vocab_size=args.vocab_size, heads=args.heads, kv_heads=args.kv_heads,
                     initializer_range=args.initializer_range, overwrite=args.force,
                     routing_skew=args.routing_skew,
                     progress=_Progress(f"writing {args.out}"))
    print(json.dumps({"model": str(out)}))
    return 0


def _configure_logging(level: str) -> None:
    """Send moed's logs to the current stderr: JSON lines, or readable text on a terminal."""
    from telemetry.logs import configure

    configure(level)


def _cmd_serve(args: argparse.Namespace) -> int:

    from daemon.config import load_config
    from daemon.server import serve

    config, warnings = load_config(args, os.environ)
    _configure_logging(config.log_level)
    for w in warnings:
        log.warning("config_warning: %s", w)
    config.require_model()
    log.info("config: %s", json.dumps(config.to_dict()))
    return serve(config, reload=lambda: load_config(args, os.environ)[0], environ=os.environ,
                 version=_version())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moed")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def _cmd_bench(args: argparse.Namespace) -> int:
    from daemon.bench import BenchConfig, run_bench
    from ext.tokenizer import Tokenizer

    _model_dir(args.model)
    prompt = tuple(Tokenizer.from_model_dir(args.model).encode(args.prompt)) if args.prompt else ()
    bench = BenchConfig(model=args.model, cache_bytes=args.expert_cache_bytes, tokens=args.tokens,
                        prompt_ids=prompt, temperature=args.temperature, seed=args.seed,
                        threads=args.threads or _threads(), io_workers=args.io_workers,
                        repeats=args.repeats, prefetch=not args.no_prefetch,
                        idle_prefetch=not args.no_idle_prefetch)
    report = run_bench(bench, progress=_Steps("bench runs"))
    from daemon.state import default_state_dir
    from daemon.tuning import probe_summary
    probe = probe_summary(default_state_dir(os.environ), args.model, bench.io_workers)
    if probe is not None:     # for reference; the roofline uses this run's own measurement
        report["storage_probe"] = probe
    print(json.dumps(report, indent=2))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from daemon.state import default_state_dir
    from daemon.tuning import TuneConfig, run_tune

    _model_dir(args.model)

    def progress(message: str) -> None:
        if sys.stderr.isatty():
            print(f"moed tune: {message}", file=sys.stderr, flush=True)

    cfg = TuneConfig(model=args.model, cache_bytes=args.expert_cache_bytes,
                     state_dir=Path(args.state_dir) if args.state_dir else default_state_dir(os.environ),
                     threads=args.threads or _threads(), io_workers=args.io_workers,
                     window_steps=args.window_steps, pairs=args.pairs,
                     compare_tokens=args.compare_tokens, compare_repeats=args.compare_repeats)
    report = run_tune(cfg, progress=progress)
    print(json.dumps(report, indent=2))
    return 0


def _cmd_iobench(args: argparse.Namespace) -> int:
    from daemon.iobench import model_target, run_iobench, save_report, scratch_target
    from daemon.state import default_state_dir

    if (args.model is None) == (args.file is None):
        raise UsageError("give exactly one of --model DIR and --file PATH")
    if not args.seconds > 0:
        raise UsageError(f"--seconds: must be > 0, got {args.seconds}")
    t0 = time.monotonic()
    created = False
    if args.model is not None:
        target = model_target(args.model)
    else:
        target, created = scratch_target(args.file, args.size, args.block)
    try:
        # 5 % of --seconds stays for the interpreter's start, the imports and the save.
        budget = max(0.0, 0.95 * args.seconds - (time.monotonic() - t0))
        report = run_iobench(target, seconds=budget, progress=_Steps("iobench passes"))
    finally:
        if created:
            os.unlink(args.file)
    text = json.dumps(report, indent=2)
    path = save_report(args.state_dir or default_state_dir(os.environ), text + "\n", report["device"])
    print(text)
    print(f"moed iobench: saved to {path} (moed serve and moed tune read it there)", file=sys.stderr)
    return 0


class _Steps:
    """'label i/n' on a terminal's stderr; nothing in logs."""

    def __init__(self, label: str):
        self.label = label

    def __call__(self, done: int, total: int) -> None:
        if sys.stderr.isatty():
            sys.stderr.write(f"\r{self.label} {done}/{total}" + ("\n" if done >= total else ""))
            sys.stderr.flush()


def _cmd_replay_trace(args: argparse.Namespace) -> int:
    from scheduler.replay import replay_trace

    policies = args.policy or ["default", "lru", "belady"]
    kwargs = {} if args.pin_fraction is None else {"pin_fraction": args.pin_fraction}
    result = replay_trace(args.trace, args.slots_per_layer, policies,
                          warm_tokens=args.warm_tokens, **kwargs)
    print(json.dumps(result, indent=2))
    return 0


class _ExamplesFormatter(argparse.HelpFormatter):
    """Wraps one-paragraph text (the description) but keeps text of several lines (the
    examples in an epilog) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _add_sampling_arguments(parser: argparse.ArgumentParser, *, max_tokens: int,
                            per: str = "continuation") -> None:
    """--max-tokens, --temperature, --top-p, --top-k, --seed (greedy by default)."""
    parser.add_argument("--max-tokens", type=_positive_int, default=max_tokens, metavar="N",
                        help=f"most new tokens per {per} (default: {max_tokens})")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 for greedy decoding (default), else sampling temperature")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="nucleus sampling mass in (0, 1] (default: 1, off)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="sample among the K most likely tokens (default: 0, off)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="random seed; the same seed gives the same tokens")


def build_parser() -> argparse.ArgumentParser:
    from daemon.config import add_arguments

    moed_version = _version()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS,
                        choices=["debug", "info", "warning", "error"],
                        help="verbosity of the log on stderr (default: info)")
    machine = argparse.ArgumentParser(add_help=False)  # options of commands that run the model
    machine.add_argument("--threads", type=_thread_count, default=None, metavar="N",
                         help="compute threads (default: CPUs available)")
    machine.add_argument("--io-workers", type=_thread_count, default=2, metavar="N",
                         help="reader threads for experts streamed from disk (default: 2)")
    parser = argparse.ArgumentParser(
        prog="moed", parents=[common],
        description="Serve Mixture-of-Experts language models whose experts stream from disk.",
        epilog="Run 'moed COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"moed {moed_version}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser(
        "demo", parents=[common],
        help="try moed: start a daemon on the embedded default model and stream a completion",
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
        formatter_class=_ExamplesFormatter)
    d.add_argument("--dir", default=None, metavar="DIR", type=_nonempty,
                   help="where the demo keeps its learned state and last run's figures "
                        "(default: $XDG_CACHE_HOME/moed, else ~/.cache/moed)")
    d.add_argument("--model", default=None, metavar="DIR", type=_nonempty,
                   help="serve this Hugging Face model directory instead of the embedded "
                        "default model")
    d.add_argument("--keep", action="store_true",
                   help="keep the daemon serving after the demo, until Ctrl-C")
    d.add_argument("--max-tokens", type=_positive_int, default=96, metavar="N",
                   help="most tokens of the answer (default: 96)")
    d.set_defaults(func=_cmd_demo)

    client = argparse.ArgumentParser(add_help=False)  # options of commands that ask the daemon
    client.add_argument("--socket", default=None, metavar="PATH", type=_nonempty,
                        help="the daemon's Unix socket (default: $MOED_SOCKET, else "
                             "/run/moed/moed.sock)")

    g = sub.add_parser(
        "generate", parents=[common, machine, client],
        help="generate text from a prompt, through the daemon (or in-process with --model)",
        description="Stream the continuation of PROMPT to stdout. Without --model, the moed "
                    "daemon (moed serve) generates it, asked over its Unix socket; with --model "
                    "DIR, this process loads the model directory and generates it, no daemon "
                    "involved (--threads, --io-workers and the expert cache options apply only "
                    "then). Decoding is greedy unless --temperature is given. Logs and timings "
                    "go to stderr.",
        epilog="examples:\n"
               "  moed generate --max-tokens 64 'def fibonacci('\n"
               "  moed generate --socket /tmp/moed.sock --chat 'Write a haiku about caches.'\n"
               "  moed generate --model default --max-tokens 64 'def fibonacci('",
        formatter_class=_ExamplesFormatter)
    g.add_argument("prompt", metavar="PROMPT",
                   help="raw text to continue; with --chat, one user message")
    g.add_argument("--model", default=None, metavar="DIR", type=_nonempty,
                   help="generate in this process from this model directory (config.json, "
                        "tokenizer.json, *.safetensors; \"default\": the embedded default "
                        "model) instead of asking the daemon")
    _add_sampling_arguments(g, max_tokens=128)
    g.add_argument("--chat", action="store_true",
                   help="put PROMPT through the model's chat template as a user message")
    g.add_argument("--experts", choices=["mmap", "resident"], default="mmap",
                   help="without --expert-cache-bytes: memory-mapped shards (default) or "
                        "all experts read into RAM at start")
    g.add_argument("--expert-cache-bytes", type=_size, default=None, metavar="SIZE",
                   help="stream routed experts from disk into a cache of SIZE bytes (K/M/G "
                        "suffixes), learning pins across runs; at least top_k experts per "
                        "MoE layer")
    g.add_argument("--state-dir", default=None, metavar="DIR",
                   help="where learned expert usage is kept (default: $STATE_DIRECTORY, "
                        "else ~/.local/state/moed)")
    g.add_argument("--no-prefetch", action="store_true",
                   help="with --expert-cache-bytes: do not read predicted experts ahead")
    g.add_argument("--pin-fraction", type=_fraction, default=0.5, metavar="F",
                   help="with --expert-cache-bytes: share of the spare cache pinned to the "
                        "experts learned as hot (default: 0.5)")
    g.set_defaults(func=_cmd_generate,
                   in_process_defaults={dest: g.get_default(dest) for dest in _IN_PROCESS_ONLY})

    c = sub.add_parser(
        "chat", parents=[common, client], help="chat with the daemon's model on the terminal",
        description="A chat on the terminal with the model the daemon serves: each line you type "
                    "is a user message, the answer streams back, and the conversation so far is "
                    "sent with every message (through the model's chat template). "
                    f"{CHAT_COMMANDS}. Reads standard input, so a file or a pipe of "
                    "messages works too (one answer per line on stdout). Decoding is greedy "
                    "unless --temperature is given.",
        epilog="examples:\n"
               "  moed chat\n"
               "  moed chat --socket /tmp/moed.sock --system 'Answer in one sentence.'\n"
               "  printf 'Hello!\\nAnd what can you do?\\n' | moed chat --max-tokens 64",
        formatter_class=_ExamplesFormatter)
    c.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message put before the conversation")
    _add_sampling_arguments(c, max_tokens=512, per="answer")
    c.set_defaults(func=_cmd_chat)

    st = sub.add_parser(
        "stats", parents=[common, client],
        help="print the daemon's statistics (expert cache, hit rate, tokens/s) as JSON",
        description="Ask the daemon for its own statistics (GET /v1/moed/stats): requests "
                    "running and waiting, tokens/s, the expert cache's tiers, hit rate, hits, "
                    "misses and bytes read. Prints the JSON on stdout. The cache has three "
                    "tiers: pinned (the experts learned to be hot; traffic never evicts them), "
                    "dynamic (per layer, evicted by the cache policy) and staging (prefetched "
                    "guesses: a used one joins its layer's dynamic tier, an unused one is "
                    "dropped). resident_slots hold an expert (or are reading one); "
                    "reserved_slots are being read.",
        epilog="example: moed stats --socket /tmp/moed.sock")
    st.set_defaults(func=_cmd_stats)

    pn = sub.add_parser(
        "pins", parents=[common, client],
        help="print the experts the daemon keeps pinned (or forget what it learned) as JSON",
        description="Ask the daemon which experts it keeps pinned in its cache, learned from "
                    "their use (GET /v1/moed/pins: layer, expert, usage score). With --reset, "
                    "make it forget the learned usage and drop the pins (POST "
                    "/v1/moed/pins/reset; allowed for the daemon's own user and root). Prints "
                    "the JSON answer on stdout.",
        epilog="examples:\n"
               "  moed pins --socket /tmp/moed.sock\n"
               "  moed pins --socket /tmp/moed.sock --reset",
        formatter_class=_ExamplesFormatter)
    pn.add_argument("--reset", action="store_true",
                    help="forget the learned expert usage and drop the pin set")
    pn.set_defaults(func=_cmd_pins)


    m = sub.add_parser(
        "make-model", parents=[common], help="write a random-weight MoE checkpoint in Hugging Face layout",
        description="Write a checkpoint with random weights (config.json, tokenizer, sharded "
                    "safetensors with an index) that transformers and moed both load. For "
                    "tests and benchmarks: the text it generates is noise.",
        epilog="example: moed make-model --arch qwen3_moe --layers 4 --experts 16 --top-k 4 "
               "--hidden 256 --intermediate 128 --out ./demo-model")
    m.add_argument("--arch", required=True, choices=["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"],
                   help="model family (config.json model_type)")
    m.add_argument("--layers", type=_positive_int, required=True, help="num_hidden_layers")
    m.add_argument("--experts", type=_positive_int, required=True, help="routed experts per layer")
    m.add_argument("--top-k", type=_positive_int, required=True, help="experts per token")
    m.add_argument("--hidden", type=_positive_int, required=True, help="hidden_size")
    m.add_argument("--intermediate", type=_positive_int, required=True,
                   help="each expert's intermediate size")
    m.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="bf16",
                   help="stored dtype (default: bf16)")
    m.add_argument("--shard-size", type=_size, default=_size("2G"), metavar="BYTES",
                   help="largest shard, e.g. 64M or 2G (default: 2G)")
    m.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    m.add_argument("--vocab-size", type=_positive_int, default=None,
                   help="tokenizer vocabulary (default: 512)")
    m.add_argument("--heads", type=_positive_int, default=None, help="attention heads")
    m.add_argument("--kv-heads", type=_positive_int, default=None, help="key/value heads")
    m.add_argument("--initializer-range", type=float, default=0.02,
                   help="standard deviation of the random weights (default: 0.02)")
    m.add_argument("--routing-skew", type=float, default=None, metavar="S",
                   help="build routers whose expert popularity per layer follows Zipf(S) (about 1 "
                        "on real code workloads) with realistic reuse between consecutive "
                        "tokens; default: plain random weights")
    m.add_argument("--force", action="store_true", help="replace an existing checkpoint in --out")
    m.add_argument("--out", required=True, metavar="DIR", type=_nonempty, help="directory to write")
    m.set_defaults(func=_cmd_make_model)

    b = sub.add_parser(
        "bench", parents=[common, machine],
        help="measure decode speed of the expert cache against its naive mode and the roofline",
        description="Generate --tokens tokens several times from a cold expert cache: the naive "
                    "mode (LRU, no pins, no prefetch) and moed's (learned pins from a warm-up "
                    "run, its eviction policy, prefetch), alternating, then measure disk "
                    "bandwidth and kernel throughput for the roofline. Prints one JSON report.",
        epilog="example: moed bench --model ./bench-model --expert-cache-bytes 256M --tokens 64")
    b.add_argument("--model", required=True, metavar="DIR", type=_nonempty, help=MODEL_HELP)
    b.add_argument("--expert-cache-bytes", type=_size, required=True, metavar="SIZE",
                   help="expert cache budget (K/M/G suffixes)")
    b.add_argument("--tokens", type=_positive_int, default=64, metavar="N",
                   help="tokens generated per run (default: 64)")
    b.add_argument("--repeats", type=_positive_int, default=3, metavar="R",
                   help="runs of each mode (default: 3)")
    b.add_argument("--prompt", default="", help="prompt text (default: a fixed token pattern)")
    b.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    b.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    b.add_argument("--no-prefetch", action="store_true",
                   help="moed mode without prefetch (isolates the eviction policy and pins)")
    b.add_argument("--no-idle-prefetch", action="store_true",
                   help="moed mode prefetches only its likely candidates, none of the less "
                        "likely ones it otherwise reads into idle io workers")
    b.set_defaults(func=_cmd_bench)

    t = sub.add_parser(
        "tune", parents=[common, machine],
        help="find the best threads, io workers, prefetch width and cache split for a model here",
        description="Run the self-tuner once in the foreground on a built-in workload (one "
                    "sequence sampling at temperature 0.7 from fixed code prompts): compute "
                    "threads, io workers and prefetch width one at a time by interleaved A/B "
                    "windows (a change is kept only when it wins all 4 pairs with a median gain "
                    "of at least 3 % and a repeat confirms it; a change that alters the greedy "
                    "tokens of a check prompt is rejected and logged as a bug), then the cache "
                    "size and pinned share by replaying the routing it recorded. Then tuned and "
                    "default settings are compared from a cold cache, interleaved. Prints one "
                    "JSON report (what it tried and kept) and saves the winners in the state "
                    "directory for this model and this hardware; --threads and --io-workers "
                    "give the defaults it starts from.",
        epilog="example: moed tune --model ./bench-model --expert-cache-bytes 768M")
    t.add_argument("--model", required=True, metavar="DIR", type=_nonempty, help=MODEL_HELP)
    t.add_argument("--expert-cache-bytes", type=_size, required=True, metavar="SIZE",
                   help="expert cache budget, the most the tuner may use (K/M/G suffixes)")
    t.add_argument("--state-dir", metavar="DIR", default=None,
                   help="where learned usage and the winners live (default: moed's state directory)")
    t.add_argument("--window-steps", type=_positive_int, default=16, metavar="N",
                   help="decode steps per A/B window (default: 16)")
    t.add_argument("--pairs", type=_positive_int, default=4, metavar="N",
                   help="interleaved A/B pairs per trial (default: 4)")
    t.add_argument("--compare-tokens", type=_positive_int, default=64, metavar="N",
                   help="tokens per run of the final tuned-vs-default comparison (default: 64)")
    t.add_argument("--compare-repeats", type=_positive_int, default=3, metavar="R",
                   help="runs of each in that comparison (default: 3)")
    t.set_defaults(func=_cmd_tune)

    io = sub.add_parser(
        "iobench", parents=[common],
        help="measure random expert-sized reads from the disk, per io path and queue depth",
        description="Read expert-sized blocks at random from the model's own shards (or a "
                    "scratch file) through the io worker pool: O_DIRECT (when the filesystem "
                    "supports it) and buffered, queue depth 1, 2, 4, 8 and 16, each cell "
                    "repeated; buffered passes start cold (fdatasync, then "
                    "POSIX_FADV_DONTNEED). Prints one JSON report and saves it in the state "
                    "directory as iobench-<device>.json.",
        epilog="example: moed iobench --model ./bench-model --seconds 30\n"
               "         moed iobench --file ./scratch.bin --size 2G",
        formatter_class=_ExamplesFormatter)
    io.add_argument("--model", metavar="DIR", type=_nonempty, help=MODEL_HELP)
    io.add_argument("--file", metavar="PATH", type=_nonempty,
                    help="scratch file instead: read as it is, or written with --size bytes "
                         "and removed afterwards when missing")
    io.add_argument("--size", type=_size, metavar="SIZE", help="scratch file size (K/M/G)")
    io.add_argument("--block", type=_size, default=4 << 20, metavar="SIZE",
                    help="scratch read size (default: 4M)")
    io.add_argument("--seconds", type=float, default=60.0, metavar="S",
                    help="time for the whole run, split over every pass (default: 60)")
    io.add_argument("--state-dir", metavar="DIR", default=None,
                    help="where the result is saved (default: moed's state directory)")
    io.set_defaults(func=_cmd_iobench)

    r = sub.add_parser(
        "replay-trace", parents=[common],
        help="replay a routing trace through the expert cache policies (no compute)",
        description="Replay a routing trace (JSON Lines, one token per line: "
                    '{"tok": n, "layers": [[expert ids], ...]}) through the scheduler\'s own '
                    "cache policies and print their hit rates as JSON. Tokens before "
                    "--warm-tokens are only observed (moed learns its pins from them); from "
                    "there caches start empty, moed's learned pins are loaded, and hits are "
                    "counted. Caches are per layer; Belady is the offline optimum.",
        epilog="example: moed replay-trace ../shared/traces/kimi_linear_decode/trace_kimi_300.jsonl "
               "--slots-per-layer 16")
    r.add_argument("trace", metavar="TRACE", help="routing trace, JSON Lines")
    r.add_argument("--slots-per-layer", type=_positive_int, required=True, metavar="N",
                   help="cache size in experts per MoE layer (at least top_k)")
    from scheduler.eviction import POLICIES
    r.add_argument("--policy", action="append", metavar="P",
                   choices=["default", *POLICIES, "belady"],
                   help="policy to replay, one of default (moed's), "
                        f"{', '.join(POLICIES)}, belady (the offline optimum) "
                        "(repeatable; default: default, lru, belady)")
    r.add_argument("--warm-tokens", type=int, default=None, metavar="W",
                   help="tokens observed before counting starts (default: half the trace)")
    r.add_argument("--pin-fraction", type=float, default=None, metavar="F",
                   help="share of the slots moed pins from what it learned (default: the "
                        "scheduler's measured choice)")
    r.set_defaults(func=_cmd_replay_trace)

    s = sub.add_parser(
        "serve", parents=[common],
        help="run the daemon: OpenAI-compatible HTTP on a Unix socket",
        description="Serve a model to local programs over a Unix socket (OpenAI-compatible "
                    "/v1/completions and /v1/chat/completions, streaming with SSE), with the "
                    "expert cache, learned pins and prefetch. Runs until SIGTERM or Ctrl-C; "
                    "SIGHUP re-reads the configuration. Logs go to stderr.",
        epilog="example: moed serve --model default --socket /tmp/moed.sock "
               "--expert-cache-bytes 64M\n"
               "then:    curl --unix-socket /tmp/moed.sock http://localhost/v1/models",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(s, exclude={"log_level"})
    s.set_defaults(func=_cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model", None) is not None:
        from daemon.config import resolve_model_alias
        args.model = resolve_model_alias(args.model)
    _configure_logging(getattr(args, "log_level", "info"))
    from daemon.config import ConfigError as ServeConfigError
    from daemon.io import ExpertReadError
    from ext.checkpoint import CheckpointError
    from ext.config import ConfigError
    from ext.tokenizer import ChatTemplateError, TokenizerFilesError

    try:
        return args.func(args)
    except UsageError as e:
        parser.error(str(e))  # exits 2, like argparse's own checks
    except (CheckpointError, ConfigError, ServeConfigError, TokenizerFilesError, ChatTemplateError,
            ExpertReadError, ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"moed {args.command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except OSError as e:  # an unwritable stdout or --out, an unreadable file
        print(f"moed {args.command}: error: {e}", file=sys.stderr)
        return 1
    except MemoryError as e:
        print(f"moed {args.command}: error: out of memory: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
