"""Where a decode step's time goes: inside the kernels, and everything between them.

    python bench/decode_overhead.py --model DIR [--threads 1,2] [--tokens 64] [--rounds 5]
        [--numerics exact] [--busy 0]

Loads the model with every expert in RAM, then decodes --tokens tokens greedily from a
4-token prompt, round after round (one round per thread count in turn, so a busy spell
of a shared machine falls on every setting). During the timed tokens every function of
`ext.kernels._kernels` that the forward pass calls goes through a wrapper that adds its
wall time to a total: a step's time outside the kernels is the step's time less that
total (Python, numpy glue, routing bookkeeping, sampling). The wrappers' own cost is
measured on an empty call and subtracted from the outside share (it would not be there
without them), and reported.

`--busy N` starts N processes that spin on a core (a pure-Python busy loop) for the
whole timed part, to show how the thread counts behave when another process wants a
core; they are stopped at the end.

Prints one JSON object: per thread count, each round's tokens/s and outside share, and
their medians and spread; the kernels' build_info() (which SIMD path ran), their pool's
counters (`pool_info()`), the CPU, and the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ext.models.attention  # noqa: E402
import ext.models.ffn  # noqa: E402
import ext.models.mla  # noqa: E402
import ext.models.model  # noqa: E402
import ext.models.rope  # noqa: E402
import ext.models.routing  # noqa: E402
from daemon.machine.system import cpu_model  # noqa: E402
from ext.kernels import _kernels  # noqa: E402
from ext.models.model import Model  # noqa: E402
from ext.sampling import Sampler, SamplingParams  # noqa: E402

MODULES = (ext.models.attention, ext.models.ffn, ext.models.mla, ext.models.model,
           ext.models.rope, ext.models.routing)


class TimedKernels:
    """Stands in for `_kernels` in the model's modules: every callable attribute is
    wrapped to add its wall seconds to `seconds` and count its calls; other attributes
    (classes, constants) are passed through."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name):
        target = getattr(_kernels, name)
        if not callable(target) or isinstance(target, type):
            return target

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return target(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        setattr(self, name, timed)        # found directly from now on
        return timed


def wrapper_seconds(timed: TimedKernels, n: int = 20000) -> float:
    """Seconds one wrapped call adds over a direct call (an empty kernel call timed
    both ways, median of 5)."""
    direct = _kernels.openmp_enabled
    wrapped = timed.__getattr__("openmp_enabled")
    costs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            direct()
        t1 = time.perf_counter()
        for _ in range(n):
            wrapped()
        costs.append(((time.perf_counter() - t1) - (t1 - t0)) / n)
    return max(0.0, statistics.median(costs))


def one_round(model: Model, tokens: int, timed: TimedKernels, per_call: float) -> dict:
    seq = model.new_sequence(capacity=tokens + 8)
    sampler = Sampler(SamplingParams(temperature=0))
    logits = model.forward(seq, [1, 2, 3, 4])
    token = sampler.sample(logits[-1])
    logits = model.forward(seq, [token])                  # one untimed step: buffers warm
    timed.seconds, timed.calls = 0.0, 0
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = sampler.sample(logits[-1])
        logits = model.forward(seq, [token])
    total = time.perf_counter() - t0
    outside = max(0.0, total - timed.seconds - timed.calls * per_call)
    return {"tokens_per_second": tokens / (total - timed.calls * per_call),
            "outside_kernels_share": outside / (total - timed.calls * per_call),
            "kernel_calls_per_token": timed.calls / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    parser.add_argument("--tokens", type=int, default=64, help="timed tokens per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--numerics", default="exact", choices=("exact", "fast"))
    parser.add_argument("--busy", type=int, default=0,
                        help="processes spinning on a core while the rounds run (default 0)")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    timed = TimedKernels()
    for module in MODULES:
        module.K_ = timed
    per_call = wrapper_seconds(timed)
    models = {t: Model.load(args.model, n_threads=t, experts="resident", numerics=args.numerics)
              for t in threads}
    rows: dict[int, list[dict]] = {t: [] for t in threads}
    load_before = os.getloadavg()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        for r in range(args.rounds):
            for t in threads[r % len(threads):] + threads[:r % len(threads)]:
                rows[t].append(one_round(models[t], args.tokens, timed, per_call))
                print(f"round {r + 1} threads {t}: {rows[t][-1]}", file=sys.stderr)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    out = {"model": args.model, "numerics": models[threads[0]].numerics_in_force(),
           "weights": models[threads[0]].weight_formats(), "tokens": args.tokens,
           "rounds": args.rounds, "busy": args.busy, "wrapper_seconds_per_call": per_call,
           "build_info": _kernels.build_info(), "cpu": cpu_model(),
           "load_average": {"before": load_before, "after": os.getloadavg()}, "threads": {}}
    out["pool"] = _kernels.pool_info()
    for t in threads:
        tps = [row["tokens_per_second"] for row in rows[t]]
        share = [row["outside_kernels_share"] for row in rows[t]]
        out["threads"][str(t)] = {
            "tokens_per_second": statistics.median(tps), "tokens_per_second_runs": tps,
            "outside_kernels_share": statistics.median(share),
            "outside_kernels_share_runs": share,
            "kernel_calls_per_token": rows[t][0]["kernel_calls_per_token"]}
    if len(threads) > 1:
        base = rows[threads[0]]
        for t in threads[1:]:
            ratios = sorted(b["tokens_per_second"] / a["tokens_per_second"]
                            for a, b in zip(base, rows[t]))
            out["threads"][str(t)][f"ratio_to_{threads[0]}_thread"] = {
                "median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}
    for m in models.values():
        m.close()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
