"""`moed stats` and `moed pins`: what the daemon knows of its cache, as JSON."""
from __future__ import annotations

import argparse
import json

from daemon.commands.args import ExamplesFormatter, Parents
from daemon.commands.ask import ask, client_command, target


def register(sub, parents: Parents) -> None:
    """`moed stats` and `moed pins` and their options."""
    st = sub.add_parser(
        "stats", parents=[parents.common, parents.client],
        description="Ask the daemon for its own statistics (GET /v1/moed/stats): requests "
                    "running and waiting, tokens/s, the expert cache's tiers, hit rate, hits, "
                    "misses and bytes read. Prints the JSON on stdout. The cache has three "
                    "tiers: pinned (the experts learned to be hot; traffic never evicts them), "
                    "dynamic (per layer, evicted by the cache policy) and staging (prefetched "
                    "guesses: a used one joins its layer's dynamic tier, an unused one is "
                    "dropped). resident_slots hold an expert (or are reading one); "
                    "reserved_slots are being read.",
        epilog="examples:\n"
               "  moed stats --socket /tmp/moed.sock\n"
               "  MOED_API_KEY=... moed stats --url http://10.0.0.5:8000",
        formatter_class=ExamplesFormatter)
    st.set_defaults(func=run_stats)

    pn = sub.add_parser(
        "pins", parents=[parents.common, parents.client],
        description="Ask the daemon which experts it keeps pinned in its cache, learned from "
                    "their use (GET /v1/moed/pins: layer, expert, usage score). With --reset, "
                    "make it forget the learned usage and drop the pins (POST "
                    "/v1/moed/pins/reset; allowed for the daemon's own user and root, over its "
                    "Unix socket only, never over --url). Prints "
                    "the JSON answer on stdout.",
        epilog="examples:\n"
               "  moed pins --socket /tmp/moed.sock\n"
               "  moed pins --socket /tmp/moed.sock --reset",
        formatter_class=ExamplesFormatter)
    pn.add_argument("--reset", action="store_true",
                    help="forget the learned expert usage and drop the pin set")
    pn.set_defaults(func=run_pins)

@client_command
def run_stats(args: argparse.Namespace) -> int:
    print(json.dumps(ask(target(args), lambda client: client.get("/v1/moed/stats")), indent=2))
    return 0

@client_command
def run_pins(args: argparse.Namespace) -> int:
    from daemon.commands.client import DaemonError

    where = target(args)
    if not args.reset:
        answer = ask(where, lambda client: client.get("/v1/moed/pins"))
    else:
        try:
            answer = ask(where, lambda client: client.post("/v1/moed/pins/reset"))
        except DaemonError as e:
            if e.status != 403 or where.url is None:
                raise
            raise DaemonError(f"the moed daemon at {where} takes --reset (an admin call) only "
                              "over its Unix socket, from its own user or root, never over "
                              "TCP: run moed pins --reset --socket PATH on its machine "
                              "(HTTP 403)", status=e.status, type=e.type, code=e.code) from None
    print(json.dumps(answer, indent=2))
    return 0
