"""Benchmark: the expert cache's hit rate right after `moed serve` restarts, against the
end of the previous session and against a cold start, with the experts streaming from
disk through a cache of `--cache-fraction` of their bytes.

Per round: a daemon on a fresh state directory generates `--tokens` x 4 tokens (four
requests, different code prompts, sampled at temperature 0.7, EOS ignored); the decode hit
rate of its last request (hits and prefetch hits over lookups, /v1/moed/stats) is the
"before" figure. It is stopped (SIGTERM: the learned usage and the cache's working set are
saved) and started again on the same state directory (the warm start reads the working
set back), and a fifth request's decode hit rate is "after the restart"; the same request
on a daemon with a fresh state directory is "cold", and on a daemon that served the same
four requests first without a restart, "no restart" (the seeds make every daemon generate
the same tokens: "no restart" is what a restart would ideally give, while "before" is
another prompt's figure). Recorded too: the fifth request's prompt hit rate (its
prefill's lookups, which the warm start's experts serve first: a prompt's prefill turns a
small cache over, so the decode figure is mostly the cache's steady state), and whether
the referee had prefetch on when each measured request ended (it decides on measured time,
so on a loaded machine it flips from run to run, and it moves the hit rate more than
anything a restart keeps; `--no-prefetch` leaves it out). Prints one JSON object: the hit
rates per round, their medians and spreads, and after - before, after - no restart and
after - cold in points.

    python bench/restart_hit_rate.py [--model DIR] [--tokens 256] [--cache-fraction 0.25] [--rounds 3]
                                     [--no-prefetch]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from prefix_restart import Serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from daemon.service.loading import expert_slot_bytes  # noqa: E402
from ext.formats.checkpoint import Checkpoint  # noqa: E402
from ext.models.config import load_config  # noqa: E402
from ext.models.experts import ExpertLayout  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "daemon" / "default_model"
PROMPTS = ["def parse_args(argv):\n    parser = argparse.ArgumentParser(",
           "class LRUCache:\n    def __init__(self, capacity):\n",
           "import numpy as np\n\ndef softmax(x):\n",
           "for i, line in enumerate(open(path)):\n    if not line.strip():\n",
           "async def fetch(session, url):\n    async with session.get(url) as r:\n"]


def hit_rate(before: dict, after: dict, phase: str = "decode") -> float:
    """Hits (and prefetch hits) over lookups of `phase` ("decode" or "prefill": the prompt's)
    between two stats documents."""
    def counts(doc):
        d = doc["experts"]["lookups"][phase]
        return d.get("hit", 0) + d.get("prefetch_hit", 0), sum(d.values())
    (h0, n0), (h1, n1) = counts(before), counts(after)
    return (h1 - h0) / (n1 - n0) if n1 > n0 else float("nan")


def prefetch_on(doc: dict) -> bool | None:
    """Whether the referee has prefetch on (None: no referee, or prefetch not managed)."""
    referee = (doc.get("adaptation") or {}).get("referee") or {}
    state = (referee.get("mechanisms") or {}).get("prefetch")
    return None if state is None else bool(state["on"])


def generate(s: Serve, prompt: str, tokens: int, seed: int) -> tuple[float, bool | None, float]:
    """(the request's decode hit rate, whether prefetch was on when it ended, its prompt's
    hit rate)."""
    before = s.http.get("/v1/moed/stats").json()
    r = s.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": tokens, "temperature": 0.7,
                                             "seed": seed, "ignore_eos": True})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    after = s.http.get("/v1/moed/stats").json()
    return hit_rate(before, after), prefetch_on(after), hit_rate(before, after, "prefill")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-prefetch", action="store_true",
                        help="serve with --no-prefetch: the cache's own hits, without the referee's "
                             "prefetch switch (timed, so it flips with the machine's load)")
    args = parser.parse_args()
    with Checkpoint(args.model) as ckpt:
        _, all_experts = expert_slot_bytes(ExpertLayout(ckpt, load_config(args.model)))
    cache = int(all_experts * args.cache_fraction)
    flags = ("--expert-cache-bytes", str(cache), "--prefix-cache-bytes", "0") + (
        ("--no-prefetch",) if args.no_prefetch else ())
    rows = []
    for r in range(args.rounds):
        state, fresh, kept = (tempfile.mkdtemp(prefix="moedstate") for _ in range(3))
        try:
            s = Serve(args.model, state, args.threads, *flags)
            first = [generate(s, PROMPTS[i], args.tokens, 100 * r + i) for i in range(4)]
            s.stop()
            s = Serve(args.model, state, args.threads, *flags)
            after, after_prefetch, after_prompt = generate(s, PROMPTS[4], args.tokens, 100 * r + 4)
            s.stop()
            s = Serve(args.model, fresh, args.threads, *flags)
            cold, cold_prefetch, cold_prompt = generate(s, PROMPTS[4], args.tokens, 100 * r + 4)
            s.stop()
            s = Serve(args.model, kept, args.threads, *flags)
            for i in range(4):
                generate(s, PROMPTS[i], args.tokens, 100 * r + i)
            same, same_prefetch, same_prompt = generate(s, PROMPTS[4], args.tokens, 100 * r + 4)
            s.stop()
        finally:
            for d in (state, fresh, kept):
                shutil.rmtree(d, ignore_errors=True)
        rates = [x for x, _, _ in first]
        prefetch = {"before": first[-1][1], "after_restart": after_prefetch, "cold": cold_prefetch,
                    "no_restart": same_prefetch}
        rows.append({"before": round(rates[-1], 4), "after_restart": round(after, 4), "cold": round(cold, 4),
                     "no_restart": round(same, 4), "first_session": [round(x, 4) for x in rates],
                     "prefetch_on": prefetch,
                     "prompt_hit_rate": {"after_restart": round(after_prompt, 4), "cold": round(cold_prompt, 4),
                                         "no_restart": round(same_prompt, 4)}})
        print(f"round {r + 1}: before {rates[-1]:.3f}, after the restart {after:.3f}, cold {cold:.3f}, "
              f"no restart {same:.3f}; prompt {after_prompt:.3f} / {cold_prompt:.3f} / {same_prompt:.3f}; "
              f"prefetch on: {prefetch}", file=sys.stderr)
    keys = ("before", "after_restart", "cold", "no_restart")
    med = {k: statistics.median(row[k] for row in rows) for k in keys}
    spread = {k: [min(row[k] for row in rows), max(row[k] for row in rows)] for k in keys}
    prompt = {k: statistics.median(row["prompt_hit_rate"][k] for row in rows) for k in keys[1:]}
    print(json.dumps({
        "model": args.model, "tokens": args.tokens, "cache_fraction": args.cache_fraction,
        "prefetch": not args.no_prefetch,
        "expert_cache_bytes": cache, "all_experts_bytes": all_experts, "threads": args.threads,
        "loadavg": os.getloadavg(), "rounds": rows, "median": med, "spread": spread,
        "prompt_hit_rate_median": prompt,
        "after_minus_before_points": round(100 * (med["after_restart"] - med["before"]), 2),
        "after_minus_no_restart_points": round(100 * (med["after_restart"] - med["no_restart"]), 2),
        "after_minus_cold_points": round(100 * (med["after_restart"] - med["cold"]), 2)}, indent=2))


if __name__ == "__main__":
    main()
