"""`moed tune`: its options, and the command. What it runs (`run_tune`) is
daemon/commands/tune_runs.py, imported only when the command runs: numpy and the model
code stay out of `moed --help`."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from daemon.commands.args import (MODEL_HELP, Parents, Progress, UsageError, add_numerics,
                                  check_model_dir, cpu_threads, nonempty, positive_int, size)


def register(sub, parents: Parents) -> None:
    """`moed tune` and its options."""
    t = sub.add_parser(
        "tune", parents=[parents.common, parents.machine],
        description="Run the self-tuner once in the foreground on a built-in workload (one "
                    "sequence sampling at temperature 0.7 from fixed code prompts): compute "
                    "threads, io workers and prefetch width one at a time by interleaved A/B "
                    "windows (first A-vs-A pairs measure the noise and set the window length so "
                    "a 3 % effect can be resolved; a change is kept only when it wins all 4 pairs "
                    "with a median gain of at least 3 % and a repeat confirms it; a change that "
                    "alters the greedy tokens of a check prompt is rejected and logged as a bug), "
                    "then the cache size and pinned share by replaying the routing it recorded. "
                    "Then tuned and default settings are compared from a cold cache, interleaved: "
                    "the tuned ones are saved only if that comparison confirms them, else the "
                    "defaults are. Last, the prefill chunk: one prompt prefilled with each chunk "
                    "of 64 .. 1024 tokens (as far as the cache budget allows), rounds "
                    "interleaved from an empty cache; the fixed rule's chunk is kept unless "
                    "another is faster in every round and by 3 % in the median one. Prints one "
                    "JSON report (what it tried and kept) and saves the winners in the state "
                    "directory for this model and this hardware (moed serve starts from them; "
                    "its prefill_chunk = auto takes the measured chunk); --threads and "
                    "--io-workers give the defaults it starts from.",
        epilog="example: moed tune --model ./bench-model --expert-cache-bytes 768M")
    t.add_argument("--model", required=True, metavar="DIR", type=nonempty, help=MODEL_HELP)
    t.add_argument("--expert-cache-bytes", type=size, required=True, metavar="SIZE",
                   help="expert cache budget, the most the tuner may use (K/M/G suffixes)")
    t.add_argument("--state-dir", metavar="DIR", default=None,
                   help="where learned usage and the winners live (default: moed's state directory)")
    t.add_argument("--window-steps", type=positive_int, default=16, metavar="N",
                   help="decode steps per A/B window (default: 16)")
    t.add_argument("--pairs", type=positive_int, default=4, metavar="N",
                   help="interleaved A/B pairs per trial (default: 4)")
    t.add_argument("--compare-tokens", type=positive_int, default=64, metavar="N",
                   help="tokens per run of the final tuned-vs-default comparison (default: 64)")
    t.add_argument("--compare-repeats", type=positive_int, default=5, metavar="R",
                   help="runs of each in that comparison (default: 5); the tuned settings are "
                        "saved only when they win the median pair and all pairs but one, else "
                        "the defaults are")
    t.add_argument("--prefill-tokens", type=int, default=1024, metavar="N",
                   help="prompt tokens of the prefill chunk measurement (default: 1024; 0 skips "
                        "it and keeps what was saved before)")
    t.add_argument("--prefill-rounds", type=positive_int, default=3, metavar="R",
                   help="interleaved rounds of that measurement (default: 3)")
    add_numerics(t)
    t.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_model_dir(args.model)
    if args.prefill_tokens < 0:
        raise UsageError(f"--prefill-tokens must be >= 0, got {args.prefill_tokens}")
    from daemon.commands.tune_runs import TuneConfig, run_tune
    from daemon.store.state import default_state_dir

    bar = Progress("moed tune", unit="step")
    steps = 0

    def progress(message: str) -> None:      # a stage begun or a result: one more step
        nonlocal steps
        steps += 1
        bar.note(message)
        bar(steps, None)

    cfg = TuneConfig(model=args.model, cache_bytes=args.expert_cache_bytes,
                     state_dir=Path(args.state_dir) if args.state_dir else default_state_dir(os.environ),
                     threads=args.threads or cpu_threads(), io_workers=args.io_workers,
                     window_steps=args.window_steps, pairs=args.pairs,
                     compare_tokens=args.compare_tokens, compare_repeats=args.compare_repeats,
                     prefill_tokens=args.prefill_tokens, prefill_rounds=args.prefill_rounds,
                     numerics=args.numerics)
    try:
        report = run_tune(cfg, progress=progress)
    finally:
        bar.close()
    print(json.dumps(report, indent=2))
    return 0
