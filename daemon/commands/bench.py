"""`moed bench`: its options, and the command. The benchmark itself (its runs and every
figure of the report) is daemon/commands/bench_runs.py, imported only when the command
runs: numpy and the model code stay out of `moed --help`."""
from __future__ import annotations

import argparse
import json
import os

from daemon.commands.args import (MODEL_HELP, Parents, Progress, add_numerics, check_model_dir,
                                  cpu_threads,
                                  nonempty, positive_int, size)


def register(sub, parents: Parents) -> None:
    """`moed bench` and its options."""
    b = sub.add_parser(
        "bench", parents=[parents.common, parents.machine],
        description="Generate --tokens tokens several times from a cold expert cache: the naive "
                    "mode (LRU, no pins, no prefetch) and moed's (learned pins from a warm-up "
                    "run, its eviction policy, prefetch), alternating, then measure disk "
                    "bandwidth and kernel throughput for the roofline. Prints one JSON report.",
        epilog="example: moed bench --model ./bench-model --expert-cache-bytes 256M --tokens 64")
    b.add_argument("--model", required=True, metavar="DIR", type=nonempty, help=MODEL_HELP)
    add_numerics(b)
    b.add_argument("--expert-cache-bytes", type=size, required=True, metavar="SIZE",
                   help="expert cache budget (K/M/G suffixes)")
    b.add_argument("--tokens", type=positive_int, default=64, metavar="N",
                   help="tokens generated per run (default: 64)")
    b.add_argument("--repeats", type=positive_int, default=3, metavar="R",
                   help="runs of each mode (default: 3)")
    b.add_argument("--prompt", default="", metavar="TEXT",
                   help="prompt text (default: a fixed token pattern)")
    b.add_argument("--prompt-file", default=None, metavar="FILE",
                   help="read the prompt text from FILE (UTF-8), cut to --prompt-tokens tokens")
    b.add_argument("--prompt-tokens", type=positive_int, default=256, metavar="N",
                   help="with --prompt-file: at most this many prompt tokens, and never more "
                        "than the context leaves room for (default: 256)")
    b.add_argument("--no-referee", action="store_true",
                   help="moed mode without the do-no-harm referee (every mechanism stays on)")
    b.add_argument("--temperature", type=float, default=0.7, metavar="T",
                   help="sampling temperature (default: 0.7)")
    b.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default: 0)")
    b.add_argument("--no-prefetch", action="store_true",
                   help="moed mode without prefetch (isolates the eviction policy and pins)")
    b.add_argument("--no-idle-prefetch", action="store_true",
                   help="moed mode prefetches only its likely candidates, none of the less "
                        "likely ones it otherwise reads into idle io workers")
    b.set_defaults(func=run)



def run(args: argparse.Namespace) -> int:
    check_model_dir(args.model)
    from daemon.commands.bench_runs import BenchConfig, prompt_ids, run_bench
    from daemon.store.probe import probe_summary
    from daemon.store.state import default_state_dir

    prompt = prompt_ids(args.model, args.prompt, args.prompt_file, args.prompt_tokens, args.tokens)
    bench = BenchConfig(model=args.model, cache_bytes=args.expert_cache_bytes, tokens=args.tokens,
                        prompt_ids=prompt, temperature=args.temperature, seed=args.seed,
                        threads=args.threads or cpu_threads(), io_workers=args.io_workers,
                        repeats=args.repeats, prefetch=not args.no_prefetch,
                        idle_prefetch=not args.no_idle_prefetch, referee=not args.no_referee,
                        numerics=args.numerics)
    progress = Progress("bench runs", unit="run")
    report = run_bench(bench, progress=progress)
    progress.note(report["speedup_vs_naive_verdict"])
    progress.close()
    probe = probe_summary(default_state_dir(os.environ), args.model, bench.io_workers)
    if probe is not None:     # for reference; the roofline uses this run's own measurement
        report["storage_probe"] = probe
    print(json.dumps(report, indent=2))
    return 0
