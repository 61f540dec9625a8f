"""`moed generate`: stream a continuation of a prompt, in this process or through the daemon."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from daemon.commands.args import (ExamplesFormatter, Parents, UsageError, add_numerics,
                                  add_sampling_arguments, check_model_dir, fraction, nonempty,
                                  sampling_params, size, utf8_prompt)
from daemon.commands.ask import TextOut, ask, client_command, request_body, target


def register(sub, parents: Parents) -> None:
    """`moed generate` and its options."""
    g = sub.add_parser(
        "generate", parents=[parents.common, parents.machine, parents.client],
        description="Stream the continuation of PROMPT to stdout. Without --model, the moed "
                    "daemon (moed serve) generates it, asked over its Unix socket (or over HTTP "
                    "with --url); with --model "
                    "DIR, this process loads the model directory and generates it, no daemon "
                    "involved (--threads, --io-workers and the expert cache options apply only "
                    "then). Decoding is greedy unless --temperature is given. Logs and timings "
                    "go to stderr.",
        epilog="examples:\n"
               "  moed generate --max-tokens 64 'def fibonacci('\n"
               "  moed generate --socket /tmp/moed.sock --chat 'Write a haiku about caches.'\n"
               "  MOED_API_KEY=... moed generate --url http://10.0.0.5:8000 'def fibonacci('\n"
               "  moed generate --model default --max-tokens 64 'def fibonacci('",
        formatter_class=ExamplesFormatter)
    g.add_argument("prompt", metavar="PROMPT",
                   help="raw text to continue; with --chat, one user message")
    g.add_argument("--model", default=None, metavar="DIR", type=nonempty,
                   help="generate in this process from this model directory (config.json, "
                        "tokenizer.json, *.safetensors; \"default\": the embedded default "
                        "model) instead of asking the daemon")
    add_sampling_arguments(g, max_tokens=128)
    g.add_argument("--chat", action="store_true",
                   help="put PROMPT through the model's chat template as a user message")
    add_numerics(g)
    g.add_argument("--experts", choices=["mmap", "resident"], default="mmap",
                   help="without --expert-cache-bytes: memory-mapped shards (default) or "
                        "all experts read into RAM at start")
    g.add_argument("--expert-cache-bytes", type=size, default=None, metavar="SIZE",
                   help="stream routed experts from disk into a cache of SIZE bytes (K/M/G "
                        "suffixes), learning pins across runs; at least top_k experts per "
                        "MoE layer")
    g.add_argument("--state-dir", default=None, metavar="DIR",
                   help="where learned expert usage is kept (default: $STATE_DIRECTORY, "
                        "else ~/.local/state/moed)")
    g.add_argument("--no-prefetch", action="store_true",
                   help="with --expert-cache-bytes: do not read predicted experts ahead")
    g.add_argument("--pin-fraction", type=fraction, default=0.5, metavar="F",
                   help="with --expert-cache-bytes: the largest share of the spare cache the "
                        "pins may take; the share itself (0 included) is learned while "
                        "generating (default: 0.5)")
    g.add_argument("--record-trace", default=None, metavar="FILE",
                   help="append the routing of every decoded token to FILE, one JSON line "
                        "per token in the format `moed replay-trace` reads (with --model; "
                        "`moed serve --record-trace` records the daemon's requests)")
    g.set_defaults(func=run,
                   in_process_defaults={dest: g.get_default(dest) for dest in _IN_PROCESS_ONLY})

def run(args: argparse.Namespace) -> int:
    if args.model is None:
        return _generate_by_the_daemon(args)
    from ext.formats.quant import quantization_label
    from ext.generate import Generation
    from ext.tokenizer import Tokenizer, stop_token_ids
    from telemetry.logs import get_logger

    log = get_logger("cli")
    sampling = sampling_params(args)
    asking = [flag for flag, value in (("--socket", args.socket), ("--url", args.url),
                                       ("--api-key", args.api_key)) if value is not None]
    if asking:
        raise UsageError(f"{', '.join(asking)} (asking the daemon) and --model (generating in "
                         "this process) do not go together: give one")
    check_model_dir(args.model)
    utf8_prompt(args.prompt)
    t0 = time.perf_counter()
    tokenizer = Tokenizer.from_model_dir(args.model)
    model, session = _load_model(args)
    formats = model.weight_formats()
    log.info("model_loaded", model=args.model, model_type=model.config.model_type,
             layers=model.config.num_hidden_layers, experts=model.config.num_experts,
             top_k=model.config.top_k, expert_format=formats["experts"],
             dense_format=formats["dense"], quantization=quantization_label(model.config.quantization),
             numerics=formats["numerics"], numerics_configured=args.numerics,
             load_seconds=round(time.perf_counter() - t0, 3), threads=model.n_threads)
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
    log.info("generation_finished", completion_tokens=gen.completion_tokens,
             finish_reason=gen.finish_reason, prompt_tokens=len(prompt_ids),
             time_to_first_token_s=round(gen.time_to_first_token_s, 4),
             decode_tokens_per_s=round(gen.decode_tokens_per_s, 2),
             seed=gen.sampler.seed if sampling.temperature > 0 else None,
             greedy=sampling.temperature == 0)
    if session is not None:
        log.info("expert_cache_summary", **session.summary())
        try:
            session.flush()
        except OSError as e:
            log.warning("state_save_failed", path=str(session.store.path), error=str(e))
    model.close()
    return 0

def _load_model(args: argparse.Namespace):
    """The model with the expert provider the options ask for; (model, session or None)."""
    from daemon.store.session import open_model

    return open_model(args.model, threads=args.threads, cache_bytes=args.expert_cache_bytes,
                      experts=args.experts, io_workers=args.io_workers,
                      prefetch=not args.no_prefetch, pin_fraction=args.pin_fraction,
                      state_dir=args.state_dir, environ=os.environ, record_trace=args.record_trace,
                      numerics=args.numerics)

_IN_PROCESS_ONLY = {"threads": "--threads", "io_workers": "--io-workers", "experts": "--experts",
                    "expert_cache_bytes": "--expert-cache-bytes", "state_dir": "--state-dir",
                    "no_prefetch": "--no-prefetch", "pin_fraction": "--pin-fraction",
                    "record_trace": "--record-trace", "numerics": "--numerics"}

@client_command
def _generate_by_the_daemon(args: argparse.Namespace) -> int:
    from telemetry.logs import get_logger

    given = [flag for dest, flag in _IN_PROCESS_ONLY.items()
             if getattr(args, dest) != args.in_process_defaults[dest]]
    if given:
        raise UsageError(f"{', '.join(given)} only apply with --model (generation in this "
                         "process); the daemon serves with its own settings")
    sampling_params(args)
    utf8_prompt(args.prompt)
    where = target(args)
    if args.chat:
        path = "/v1/chat/completions"
        body = request_body(args, messages=[{"role": "user", "content": args.prompt}])
    else:
        path, body = "/v1/completions", request_body(args, prompt=args.prompt)
    text = TextOut()
    try:
        result = ask(where, lambda client: client.stream(path, body, text))
    except BaseException:
        text.end_line()
        raise
    sys.stdout.write("\n")      # like the in-process mode: the answer ends with a newline
    sys.stdout.flush()
    tokens = result.completion_tokens
    log = get_logger("cli")
    log.info("generation_finished", completion_tokens=tokens, finish_reason=result.finish_reason,
             **where.log_fields(),
             time_to_first_text_s=None if result.time_to_first_text_s is None
             else round(result.time_to_first_text_s, 4), duration_s=round(result.duration_s, 3))
    return 0
