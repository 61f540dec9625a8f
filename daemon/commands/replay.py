"""`moed replay-trace`: a routing trace through the expert cache policies (no compute)."""
from __future__ import annotations

import argparse
import json
import os

from daemon.commands.args import Parents, UsageError, fraction, positive_int


def register(sub, parents: Parents) -> None:
    """`moed replay-trace` and its options."""
    r = sub.add_parser(
        "replay-trace", parents=[parents.common],
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
    r.add_argument("--slots-per-layer", type=positive_int, required=True, metavar="N",
                   help="cache size in experts per MoE layer (at least top_k)")
    from scheduler.eviction import POLICIES
    r.add_argument("--policy", action="append", metavar="P",
                   choices=["default", *POLICIES, "belady"],
                   help="policy to replay, one of default (moed's), "
                        f"{', '.join(POLICIES)}, belady (the offline optimum) "
                        "(repeatable; default: default, lru, belady)")
    r.add_argument("--warm-tokens", type=int, default=None, metavar="W",
                   help="tokens observed before counting starts (default: half the trace)")
    r.add_argument("--pin-fraction", type=fraction, default=None, metavar="F",
                   help="share of the slots moed pins from what it learned (default: the "
                        "scheduler's measured choice)")
    r.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    from scheduler.replay import replay_trace

    if not os.path.exists(args.trace):
        raise UsageError(f"TRACE: {args.trace} does not exist")
    if os.path.isdir(args.trace):
        raise UsageError(f"TRACE: {args.trace} is a directory, not a JSON Lines file")

    policies = args.policy or ["default", "lru", "belady"]
    kwargs = {} if args.pin_fraction is None else {"pin_fraction": args.pin_fraction}
    result = replay_trace(args.trace, args.slots_per_layer, policies,
                          warm_tokens=args.warm_tokens, **kwargs)
    print(json.dumps(result, indent=2))
    return 0
