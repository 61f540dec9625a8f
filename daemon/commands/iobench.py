"""`moed iobench`: the storage probe from the command line (daemon/store/probe.py)."""
from __future__ import annotations

import argparse
import json
import os
import time

from daemon.commands.args import (MODEL_HELP, ExamplesFormatter, Parents, Progress, UsageError,
                                  check_model_dir,
                                  nonempty, size)


def register(sub, parents: Parents) -> None:
    """`moed iobench` and its options."""
    io = sub.add_parser(
        "iobench", parents=[parents.common],
        description="Read expert-sized blocks at random from the model's own shards (or a "
                    "scratch file) through the io worker pool: O_DIRECT (when the filesystem "
                    "supports it) and buffered, queue depth 1, 2, 4, 8 and 16, each cell "
                    "repeated; buffered passes start cold (fdatasync, then "
                    "POSIX_FADV_DONTNEED). Prints one JSON report and saves it in the state "
                    "directory as iobench-<device>.json.",
        epilog="example: moed iobench --model ./bench-model --seconds 30\n"
               "         moed iobench --file ./scratch.bin --size 2G",
        formatter_class=ExamplesFormatter)
    io.add_argument("--model", metavar="DIR", type=nonempty, help=MODEL_HELP)
    io.add_argument("--file", metavar="PATH", type=nonempty,
                    help="scratch file instead: read as it is, or written with --size bytes "
                         "and removed afterwards when missing")
    io.add_argument("--size", type=size, metavar="SIZE", help="scratch file size (K/M/G)")
    io.add_argument("--block", type=size, default=4 << 20, metavar="SIZE",
                    help="scratch read size (default: 4M)")
    io.add_argument("--seconds", type=float, default=60.0, metavar="S",
                    help="time for the whole run, split over every pass (default: 60)")
    io.add_argument("--state-dir", metavar="DIR", default=None,
                    help="where the result is saved (default: moed's state directory)")
    io.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    from daemon.store.probe import model_target, run_iobench, save_report, scratch_target
    from daemon.store.state import default_state_dir
    from telemetry.logs import get_logger

    log = get_logger("iobench")
    if (args.model is None) == (args.file is None):
        raise UsageError("give exactly one of --model DIR and --file PATH")
    if not args.seconds > 0:
        raise UsageError(f"--seconds: must be > 0, got {args.seconds}")
    t0 = time.monotonic()
    created = False
    if args.model is not None:
        target = model_target(check_model_dir(args.model))
    else:
        target, created = scratch_target(args.file, args.size, args.block)
    try:
        # 5 % of --seconds stays for the interpreter's start, the imports and the save.
        budget = max(0.0, 0.95 * args.seconds - (time.monotonic() - t0))
        report = run_iobench(target, seconds=budget, progress=Progress("iobench passes", unit="pass"))
    finally:
        if created:
            os.unlink(args.file)
    text = json.dumps(report, indent=2)
    path = save_report(args.state_dir or default_state_dir(os.environ), text + "\n", report["device"])
    print(text)
    log.info("storage_probe_saved", path=str(path), read_by="moed serve, moed tune")
    return 0
