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
import sys
import time
from collections.abc import Sequence

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


def _cmd_generate(args: argparse.Namespace) -> int:
    from ext.generate import Generation
    from ext.model import Model
    from ext.sampling import SamplingParamError, SamplingParams
    from ext.tokenizer import Tokenizer, stop_token_ids

    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed)
    except SamplingParamError as e:
        raise UsageError(f"--{e.field.replace('_', '-')}: {e}") from None
    _model_dir(args.model)
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("PROMPT is not valid UTF-8") from None
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
    import os

    from daemon.session import open_model

    return open_model(args.model, threads=args.threads, cache_bytes=args.expert_cache_bytes,
                      experts=args.experts, io_workers=args.io_workers,
                      prefetch=not args.no_prefetch, pin_fraction=args.pin_fraction,
                      state_dir=args.state_dir, environ=os.environ)


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
    import os

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
                        repeats=args.repeats, prefetch=not args.no_prefetch)
    report = run_bench(bench, progress=_Steps("bench runs"))
    print(json.dumps(report, indent=2))
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

    g = sub.add_parser(
        "generate", parents=[common, machine], help="generate text from a prompt, in-process (no daemon)",
        description="Load a Hugging Face MoE model directory and stream the continuation of "
                    "PROMPT to stdout. Logs and timings go to stderr.",
        epilog="example: moed generate --model ./demo-model --max-tokens 64 'def fibonacci('")
    g.add_argument("prompt", metavar="PROMPT",
                   help="raw text to continue; with --chat, one user message")
    g.add_argument("--model", required=True, metavar="DIR", type=_nonempty,
                   help="model directory: config.json, tokenizer.json, *.safetensors")
    g.add_argument("--max-tokens", type=_positive_int, default=128, metavar="N",
                   help="most new tokens to generate (default: 128)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 for greedy decoding (default), else sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling mass in (0, 1] (default: 1, off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens (default: 0, off)")
    g.add_argument("--seed", type=int, default=None, metavar="S",
                   help="random seed; the same seed gives the same tokens")
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
    g.set_defaults(func=_cmd_generate)

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
    b.add_argument("--model", required=True, metavar="DIR", type=_nonempty, help="model directory")
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
    b.set_defaults(func=_cmd_bench)

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
    r.add_argument("--policy", action="append", metavar="P",
                   help="policy to replay (repeatable; default: default, lru, belady)")
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
        epilog="example: moed serve --model ./demo-model --socket /tmp/moed.sock "
               "--expert-cache-bytes 64M\n"
               "then:    curl --unix-socket /tmp/moed.sock http://localhost/v1/models",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(s, exclude={"log_level"})
    s.set_defaults(func=_cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
