"""Decode tokens/s by compute threads and OpenMP wait policy, each run its own process.

    python bench/wait_policy.py [--model default] [--tokens 256] [--repeats 5]
        [--configs t1,t2-passive,t2-spin]

OpenMP reads OMP_WAIT_POLICY when it loads, so every configuration runs in a fresh
process: "t1" (1 compute thread), "t2-passive" (2 threads, OMP_WAIT_POLICY=PASSIVE, what
the `moed` command sets), "t2-spin" (2 threads, libgomp's default of spinning a while
before sleeping), "t2-spin3000" (2 threads spinning 3000 rounds, then sleeping:
GOMP_SPINCOUNT=3000), and "-threshold=N" appended to any of them sets the kernels'
parallel_threshold (multiply-adds below which a call runs on one thread). Each run
decodes --tokens tokens greedily with every expert in RAM after a 4-token prompt; rounds
visit every configuration once (order rotated), and each configuration's median and
spread over --repeats rounds are printed with its ratio to the first configuration
(median of the per-round ratios). One JSON object; the machine's load average before and
after says how quiet it was.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
import numpy as np
from ext.kernels import _kernels
from daemon.service.config import resolve_model_alias
from daemon.store.session import open_model
model_dir, threads, tokens, threshold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if threshold > 0:
    _kernels.set_parallel_threshold(threshold)
model, _ = open_model(resolve_model_alias(model_dir), threads=threads, cache_bytes=None, experts="resident")
seq = model.new_sequence(capacity=tokens + 8)
logits = model.forward(seq, [1, 2, 3, 4])
t0 = time.perf_counter()
for _ in range(tokens):
    logits = model.forward(seq, [int(np.argmax(logits[-1]))])
print(json.dumps({"tokens_per_second": tokens / (time.perf_counter() - t0),
                  "parallel_threshold": _kernels.parallel_threshold()}))
"""


def parse_config(name: str) -> tuple[int, dict, int]:
    """(threads, environment changes, threshold or 0) of a configuration name."""
    base, _, threshold = name.partition("-threshold=")
    table = {"t1": (1, {}), "t2-passive": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
             "t2-spin": (2, {"OMP_WAIT_POLICY": ""}),
             "t2-spin3000": (2, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"})}
    if base not in table:
        raise SystemExit(f"unknown configuration {name!r}; known: {', '.join(table)} (+ -threshold=N)")
    threads, env = table[base]
    return threads, env, int(threshold or 0)


def run(model: str, name: str, tokens: int) -> dict:
    threads, changes, threshold = parse_config(name)
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    env.update({k: v for k, v in changes.items() if v})
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(threads), str(tokens), str(threshold)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--configs", default="t1,t2-passive,t2-spin")
    args = p.parse_args(argv)
    names = args.configs.split(",")
    for n in names:
        parse_config(n)
    load_before = os.getloadavg()
    runs: dict[str, list[float]] = {n: [] for n in names}
    thresholds: dict[str, int] = {}
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            res = run(args.model, n, args.tokens)
            runs[n].append(round(res["tokens_per_second"], 1))
            thresholds[n] = res["parallel_threshold"]
            print(f"round {r + 1}: {n} {res['tokens_per_second']:.0f} tokens/s", file=sys.stderr)
    first = names[0]
    from ext.kernels import _kernels
    report = {"model": args.model, "tokens": args.tokens, "repeats": args.repeats,
              "build": _kernels.build_info(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "configs": {n: {"tokens_per_second_median": statistics.median(v), "runs": v,
                              "spread": [min(v), max(v)], "parallel_threshold": thresholds[n],
                              f"ratio_to_{first}": round(statistics.median(a / b for a, b in zip(v, runs[first])), 3)}
                          for n, v in runs.items()}}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
