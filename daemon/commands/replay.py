"""`moed replay-trace`: a routing trace through the expert cache policies (no compute)."""
from __future__ import annotations

import argparse
import json
import os

from daemon.commands.args import ExamplesFormatter, Parents, UsageError, fraction, positive_int
from scheduler.policy_names import POLICY_NAMES


def register(sub, parents: Parents) -> None:
    """`moed replay-trace` and its options."""
    r = sub.add_parser(
        "replay-trace", parents=[parents.common],
        description="Replay a routing trace (JSON Lines, one token per line: "
                    '{"tok": n, "layers": [[expert ids], ...]}, as `moed serve --record-trace` '
                    "and `moed generate --record-trace` write it) through the scheduler's own "
                    "cache policies and print their hit rates as JSON. Hits are counted from "
                    "--warm-tokens on. Two starts, both printed by default: warm (every cache, "
                    "LRU's and Belady's too, has replayed the tokens before --warm-tokens "
                    "uncounted) and cold (every cache starts empty there; moed's learned pins "
                    "are loaded). moed's policies learn their pins while they replay, as the "
                    "daemon does; the standard policies run without pins; Belady is the offline "
                    "optimum. The summary gives the default's lead over LRU in points and the "
                    "share of the LRU-to-Belady gap it closes.",
        epilog="example: record a trace of your own traffic, then replay it:\n"
               "  moed serve --model default --socket /tmp/moed.sock "
               "--record-trace ./routing.jsonl\n"
               "  moed generate --socket /tmp/moed.sock --max-tokens 256 'def fibonacci('\n"
               "  moed replay-trace ./routing.jsonl --slots-per-layer 16",
        formatter_class=ExamplesFormatter)
    r.add_argument("trace", metavar="TRACE", help="routing trace, JSON Lines")
    r.add_argument("--slots-per-layer", type=positive_int, required=True, metavar="N",
                   help="cache size in experts per MoE layer (at least top_k)")
    r.add_argument("--policy", action="append", metavar="P",
                   choices=["default", *POLICY_NAMES, "belady"],
                   help="policy to replay, one of default (moed's), "
                        f"{', '.join(POLICY_NAMES)}, belady (the offline optimum) "
                        f"(repeatable; default: {', '.join(DEFAULT_POLICIES)})")
    r.add_argument("--warm-tokens", type=int, default=None, metavar="W",
                   help="tokens before counting starts (default: half the trace)")
    r.add_argument("--start", choices=["warm", "cold", "both"], default="both",
                   help="warm: every cache replays the first W tokens first; cold: every cache "
                        "starts empty at W (default: both)")
    r.add_argument("--pin-fraction", type=fraction, default=None, metavar="F",
                   help="pin this fixed share of all slots from what the first W tokens taught "
                        "instead of learning the pins while replaying")
    r.set_defaults(func=run)


DEFAULT_POLICIES = ("default", "lru", "lfu", "slru", "s3fifo", "belady")


def run(args: argparse.Namespace) -> int:
    from scheduler.replay import replay_trace, summarise

    if not os.path.exists(args.trace):
        raise UsageError(f"TRACE: {args.trace} does not exist")
    if os.path.isdir(args.trace):
        raise UsageError(f"TRACE: {args.trace} is a directory, not a JSON Lines file")
    policies = args.policy or list(DEFAULT_POLICIES)
    starts = ["warm", "cold"] if args.start == "both" else [args.start]
    results = {start: replay_trace(args.trace, args.slots_per_layer, policies,
                                   warm_tokens=args.warm_tokens, pin_fraction=args.pin_fraction,
                                   start=start) for start in starts}
    first = results[starts[0]]
    report = {"trace": args.trace, "slots_per_layer": first["slots_per_layer"],
              "warm_tokens": first["warm_tokens"], "tokens": first["tokens"],
              "layers": first["layers"], "top_k": first["top_k"], "num_experts": first["num_experts"],
              **{start: {name: {k: v for k, v in r.items()} for name, r in result["policies"].items()}
                 for start, result in results.items()},
              "summary": summarise(results)}
    print(json.dumps(report, indent=2))
    return 0
