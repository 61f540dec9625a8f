"""Benchmark: the expert cache's hit rate right after `moed serve` restarts, against the
end of the previous session and against a cold start, with the experts streaming from
disk through a cache of `--cache-fraction` of their bytes.

Per round: a daemon on a fresh state directory generates `--tokens` x 4 tokens (four
requests, different code prompts, sampled at temperature 0.7, EOS ignored); the decode hit
rate of its last request (hits and prefetch hits over lookups, /v1/moed/stats) is the
"before" figure. It is stopped (SIGTERM: the learned usage is flushed) and started again on
the same state directory (the warm start reads the experts its usage expects), and a fifth
request's decode hit rate is "after the restart"; the same request on a daemon with a fresh
state directory is "cold". Prints one JSON object: the three hit rates per round, their
medians, and after - before and after - cold in points.

    python bench/restart_hit_rate.py [--model DIR] [--tokens 256] [--cache-fraction 0.25] [--rounds 3]
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


def decode_hit_rate(before: dict, after: dict) -> float:
    """Decode hits (and prefetch hits) over decode lookups between two stats documents."""
    def counts(doc):
        d = doc["experts"]["lookups"]["decode"]
        return d.get("hit", 0) + d.get("prefetch_hit", 0), sum(d.values())
    (h0, n0), (h1, n1) = counts(before), counts(after)
    return (h1 - h0) / (n1 - n0) if n1 > n0 else float("nan")


def generate(s: Serve, prompt: str, tokens: int, seed: int) -> float:
    before = s.http.get("/v1/moed/stats").json()
    r = s.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": tokens, "temperature": 0.7,
                                             "seed": seed, "ignore_eos": True})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    return decode_hit_rate(before, s.http.get("/v1/moed/stats").json())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with Checkpoint(args.model) as ckpt:
        _, all_experts = expert_slot_bytes(ExpertLayout(ckpt, load_config(args.model)))
    cache = int(all_experts * args.cache_fraction)
    flags = ("--expert-cache-bytes", str(cache), "--prefix-cache-bytes", "0")
    rows = []
    for r in range(args.rounds):
        state, fresh = tempfile.mkdtemp(prefix="moedstate"), tempfile.mkdtemp(prefix="moedstate")
        try:
            s = Serve(args.model, state, args.threads, *flags)
            rates = [generate(s, PROMPTS[i], args.tokens, 100 * r + i) for i in range(4)]
            s.stop()
            s = Serve(args.model, state, args.threads, *flags)
            after = generate(s, PROMPTS[4], args.tokens, 100 * r + 4)
            s.stop()
            s = Serve(args.model, fresh, args.threads, *flags)
            cold = generate(s, PROMPTS[4], args.tokens, 100 * r + 4)
            s.stop()
        finally:
            shutil.rmtree(state, ignore_errors=True)
            shutil.rmtree(fresh, ignore_errors=True)
        rows.append({"before": round(rates[-1], 4), "after_restart": round(after, 4), "cold": round(cold, 4),
                     "first_session": [round(x, 4) for x in rates]})
        print(f"round {r + 1}: before {rates[-1]:.3f}, after the restart {after:.3f}, cold {cold:.3f}",
              file=sys.stderr)
    med = {k: statistics.median(row[k] for row in rows) for k in ("before", "after_restart", "cold")}
    print(json.dumps({
        "model": args.model, "tokens": args.tokens, "cache_fraction": args.cache_fraction,
        "expert_cache_bytes": cache, "all_experts_bytes": all_experts, "threads": args.threads,
        "loadavg": os.getloadavg(), "rounds": rows, "median": med,
        "after_minus_before_points": round(100 * (med["after_restart"] - med["before"]), 2),
        "after_minus_cold_points": round(100 * (med["after_restart"] - med["cold"]), 2)}, indent=2))


if __name__ == "__main__":
    main()
