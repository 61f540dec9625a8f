"""Benchmark: the attention kernel (`_kernels.attention`) over a long context, as a prompt
chunk and as a decode step, optionally against another build of the kernels.

For each context length L of `--contexts` and each T of `--tokens`: T queries at
positions L - T .. L - 1 (the last chunk of an L-token prompt, or with T = 1 the decode
step at context L) over a cache of L keys and values, `--heads` query heads sharing
`--kv-heads` key/value heads of `--head-dim` dims (default: the llama.cpp comparison's
checkpoint, Qwen3-MoE with 16 / 8 heads of 64). Timed warm (the cache, 2 x L x kv-heads x
head-dim x 4 bytes, is what every chunk of a prompt reads), median of `--rounds` rounds,
each round the best of `--repeats` calls. Reported: milliseconds per call and multiply-adds
per second (QK and PV: T x heads x keys seen x head-dim x 2).

With `--a DIR` (a checkout with built kernels, e.g. `git worktree add ../old HEAD~1` and
`python setup.py build_ext --inplace` there) both builds run alternately round by round
(A B, B A, ...), and each row also gives the ratio A-time / B-time per round (> 1: this
build, B, is faster) as median, min and max, and whether the outputs are bit-identical.
One JSON object on stdout, with the SIMD path of each build.

    python bench/attention.py [--a ../old] [--threads 1] [--contexts 512,2000,4096]
        [--tokens 1,64] [--rounds 7]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ext.kernels import _kernels  # noqa: E402
from kernel_ab import load_build  # noqa: E402


def call(module, q, k, v, pos0, out, threads):
    """module.attention with or without the scores scratch argument older builds take."""
    try:
        module.attention(q, k, v, pos0, 0, 0.125, out, threads)
    except TypeError:
        scratch = np.empty((threads, k.shape[1]), np.float32)
        module.attention(q, k, v, pos0, 0, 0.125, out, scratch, threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", help="checkout with another build of the kernels (A); this one is B")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--contexts", default="512,2000,4096")
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    builds = {"b": _kernels}
    if args.a:
        builds = {"a": load_build(args.a), "b": _kernels}
    rng = np.random.default_rng(0)
    NH, NKV, D = args.heads, args.kv_heads, args.head_dim
    rows = []
    load_before = os.getloadavg()
    for L in (int(c) for c in args.contexts.split(",")):
        k = rng.standard_normal((NKV, L, D), dtype=np.float32)
        v = rng.standard_normal((NKV, L, D), dtype=np.float32)
        for T in (int(t) for t in args.tokens.split(",")):
            q = rng.standard_normal((T, NH, D), dtype=np.float32)
            outs = {name: np.empty_like(q) for name in builds}
            times = {name: [] for name in builds}
            order = list(builds)
            for r in range(args.rounds):
                for name in (order if r % 2 == 0 else order[::-1]):
                    best = float("inf")
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        call(builds[name], q, k, v, L - T, outs[name], args.threads)
                        best = min(best, time.perf_counter() - t0)
                    times[name].append(best)
            macs = T * NH * (L - T + (T + 1) / 2) * D * 2
            row = {"context": L, "tokens": T}
            for name in builds:
                med = statistics.median(times[name])
                row[f"ms_{name}"] = round(med * 1e3, 3)
                row[f"gmacs_{name}"] = round(macs / med / 1e9, 2)
            if args.a:
                ratios = [a / b for a, b in zip(times["a"], times["b"])]
                row["speedup_b_over_a"] = {"median": round(statistics.median(ratios), 3),
                                           "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
                row["bit_identical"] = bool(np.array_equal(outs["a"].view(np.uint32),
                                                           outs["b"].view(np.uint32)))
            rows.append(row)
    print(json.dumps({
        "bench": "attention",
        "shape": {"heads": NH, "kv_heads": NKV, "head_dim": D},
        "threads": args.threads, "rounds": args.rounds, "repeats": args.repeats,
        "build": {name: {key: m.build_info()[key] for key in ("simd", "fast")}
                  for name, m in builds.items()},
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
        "results": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
