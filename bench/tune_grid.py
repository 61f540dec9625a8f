"""Benchmark: `moed tune`'s winners against the best point of a grid over the same knobs.

    python bench/tune_grid.py --model DIR --expert-cache-bytes SIZE [--state-dir DIR]
                              [--tokens 64] [--repeats 3] [--points tuned,t2-io4-pf0]

Reads the winners `moed tune` saved for this model and hardware (run it first with the
same --state-dir and budget), then measures, interleaved, every point of a grid of 24
over the knobs the tuner sets by A/B — compute threads {1, 2} x io workers {1, 2, 4, 8}
x prefetch width {0, top_k, 2 top_k} — plus the tuned settings and the defaults. Every
point gets the tuned cache split (budget and pinned share) so the comparison isolates
those knobs. One run = a fresh cache (pins from the learned usage), page cache dropped,
`--tokens` tokens sampled at temperature 0.7 from fixed prompts; a point's figure is the
median of `--repeats` runs taken in rounds (each round visits every point once), and the
spread is min..max. Prints one JSON object: every point, the best grid point, the tuned
point, and tuned / best and tuned / default. With --points, only the named points are
measured (a focused re-measurement of, say, the best grid point against the tuned one: the
best of 24 noisy medians is biased upward).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

from daemon.commands.args import size
from daemon.commands.tune_runs import TuneConfig, compare_settings
from daemon.store.session import open_model
from daemon.store.state import default_state_dir
from daemon.tuning.knobs import IO_WORKERS, PREFETCH_WIDTH, THREADS
from daemon.tuning.saved import TunedStore, hardware_facts
from daemon.tuning.workload import workload_prompts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--expert-cache-bytes", type=size, required=True)
    parser.add_argument("--state-dir", default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--points", default="",
                        help="comma-separated point names to measure (e.g. tuned,t2-io4-pf0); "
                             "default: the whole grid plus tuned and default")
    args = parser.parse_args(argv)
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir(os.environ)

    model, session = open_model(args.model, threads=2, cache_bytes=args.expert_cache_bytes,
                                state_dir=state_dir)
    try:
        facts = hardware_facts(args.model)
        tuned = TunedStore(state_dir, model.checkpoint.fingerprint(), facts).load()
        if tuned is None:
            print(f"no tuned settings for {args.model} in {state_dir}: run moed tune first",
                  file=sys.stderr)
            return 1
        k = model.config.top_k
        split = {"cache_bytes": tuned["cache_bytes"], "pin_fraction": tuned["pin_fraction"]}
        points = {f"t{t}-io{w}-pf{p}": {THREADS: t, IO_WORKERS: w, PREFETCH_WIDTH: p, **split}
                  for t, w, p in itertools.product((1, 2), (1, 2, 4, 8), (0, k, 2 * k))}
        points["tuned"] = dict(tuned)
        points["default"] = {THREADS: 2, IO_WORKERS: 2, PREFETCH_WIDTH: k,
                             "cache_bytes": args.expert_cache_bytes,
                             "pin_fraction": session.options.pin_fraction}
        if args.points:
            wanted = args.points.split(",")
            unknown = [w for w in wanted if w not in points]
            if unknown:
                print(f"unknown points {unknown}; known: {sorted(points)}", file=sys.stderr)
                return 2
            points = {name: points[name] for name in wanted}
        cfg = TuneConfig(model=args.model, cache_bytes=args.expert_cache_bytes, state_dir=state_dir,
                         compare_tokens=args.tokens, compare_repeats=args.repeats)
        prompts = workload_prompts(args.model, model.config.vocab_size)
        runs = compare_settings(session, model, prompts, points, cfg,
                                lambda m: print(m, file=sys.stderr, flush=True))
    finally:
        model.close()
    grid = {name: r for name, r in runs.items() if name not in ("tuned", "default")}

    def figure(name):
        r = runs[name]
        return {"settings": points[name], "tokens_per_second": round(r["tokens_per_second"], 3),
                "spread": [min(r["runs"]), max(r["runs"])], "runs": r["runs"]}
    if args.points:             # a focused comparison: the points measured, nothing derived
        print(json.dumps({"model": args.model, "tokens": args.tokens, "repeats": args.repeats,
                          "points": {name: figure(name) for name in runs}}, indent=2))
        return 0
    best = max(grid, key=lambda n: grid[n]["tokens_per_second"])
    print(json.dumps({
        "model": args.model, "expert_cache_bytes": args.expert_cache_bytes,
        "tokens": args.tokens, "repeats": args.repeats, "grid_points": len(grid),
        "best_grid_point": {"name": best, **figure(best)},
        "tuned": figure("tuned"), "default": figure("default"),
        "tuned_over_best_grid": round(runs["tuned"]["tokens_per_second"]
                                      / grid[best]["tokens_per_second"], 3),
        "tuned_over_default": round(runs["tuned"]["tokens_per_second"]
                                    / runs["default"]["tokens_per_second"], 3),
        "grid": {name: figure(name) for name in grid},
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
