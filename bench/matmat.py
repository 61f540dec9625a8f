"""Benchmark: the small mat-mat (T = 2..16 tokens, batched decode and short prefill)
against T mat-vecs, for every weight format of bench/matvec.py.

Prints one JSON object to stdout. For each format and each T of `--tokens`, on a weight
of `--shape` (default 768 x 2048, a Qwen3-30B-A3B routed expert's gate): one `matmul`
of x [T, C] ("matmat") and T `matmul` calls of one row each ("matvecs"), both on
`--threads` threads, cold (caches flushed before every run, as bench/matvec.py does),
interleaved round by round with the order rotated, median of `--repeats` rounds with
the spread. Reported per (format, T): microseconds per token row of each, their ratio
(speedup = matvecs / matmat; > 1 means the mat-mat is faster per row) and whether the
mat-mat's rows are bit-equal to the mat-vecs' (they must be: the placement rule).
`--fast` times the fast numerics (`matmul(..., fast=2)`, `numerics = "fast-bf16"`): the
int8, int4 and mxfp4 formats under q8x2-32 and bf16 under bf16-dp instead of exact
(other formats are exact in both).

Against numpy's f32 BLAS: per T, numpy's `x @ w.T` on the weight as float32 (4 bytes a
weight, read cold like the others) is timed in the same rounds, and every format's
mat-mat is given as GFLOP/s (2 R C T / time) and as the ratio of its GFLOP/s to
numpy's (> 1: moed's kernel does the product faster than the BLAS on f32 weights).
numpy's threads are its BLAS's own: set OPENBLAS_NUM_THREADS (recorded in the output)
to the same count as --threads for a like-for-like figure.

Warm figures too ("gflops_matmat_warm", "ratio_to_numpy_f32_warm", numpy's "gflops_warm"):
the same mat-mats run back to back, WARM_CALLS calls a run after one untimed call, the
weight in the caches and both thread pools awake, interleaved the same way (with a pause
before each run, at least 0.1 s, so that the previous entry's spinning threads are gone). That is how a
BLAS is usually measured and what a prefill step's kernels see (the pool never sleeps
between them). The cold figures idle the pools before each call (`--pause`): on a VM an
idle second vCPU can take longer to come back than a whole call lasts, so a cold
2-thread figure can say more about the host than about the kernel.

"build" says which SIMD path the kernels were built with; the machine's load average
is recorded before and after (a shared machine gives noisy figures).

    python bench/matmat.py [--repeats 15] [--threads 2] [--tokens 2,4,8,16] [--shape 768x2048] [--fast]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from ext.kernels import _kernels
from matvec import Timer, make_weight, parse_timing_args


WARM_CALLS = 20


def warm_rounds(runs: dict, repeats: int, pause: float, calls: int = WARM_CALLS) -> dict[str, list[float]]:
    """Seconds per call of each callable in `runs`: after `pause` seconds idle (the
    other entry's threads stop spinning: OpenBLAS's would take the second core) one
    untimed call, then `calls` timed back to back; `repeats` interleaved rounds with the
    order rotated."""
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            time.sleep(pause)
            runs[name]()
            t0 = time.perf_counter()
            for _ in range(calls):
                runs[name]()
            times[name].append((time.perf_counter() - t0) / calls)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2,4,8,16", help="comma-separated T (default 2,4,8,16)")
    parser.add_argument("--shape", default="768x2048", help="RxC weight shape (default 768x2048)")
    parser.add_argument("--fast", action="store_true",
                        help="fast numerics (fast-bf16: int8, int4, mxfp4 and bf16 weights)")
    args, formats = parse_timing_args(parser, flush_mib=128, pause=0.1)
    tokens = [int(t) for t in args.tokens.split(",")]
    R, C = (int(v) for v in args.shape.lower().split("x"))

    rng = np.random.default_rng(0)
    weights = {name: make_weight(name, R, C, args.group_size, rng) for name in formats}
    x = rng.standard_normal((max(tokens), C), dtype=np.float32)
    out = np.empty((max(tokens), R), np.float32)
    bit_equal = {}
    for name, w in weights.items():
        for T in tokens:
            together, alone = np.empty((T, R), np.float32), np.empty((T, R), np.float32)
            _kernels.matmul(w, x[:T], together, args.threads, fast=2 if args.fast else 0)
            for t in range(T):
                _kernels.matmul(w, x[t:t + 1], alone[t:t + 1], args.threads, fast=2 if args.fast else 0)
            bit_equal[name, T] = bool(np.array_equal(together.view(np.uint32), alone.view(np.uint32)))

    def matvecs(w, T):
        for t in range(T):
            _kernels.matmul(w, x[t:t + 1], out[t:t + 1], args.threads, fast=2 if args.fast else 0)

    runs = {}
    w32 = weights.get("f32")
    w32 = np.ascontiguousarray(w32 if w32 is not None else rng.standard_normal((R, C), dtype=np.float32))
    for T in tokens:
        runs["numpy", T, "matmat"] = lambda T=T: np.matmul(x[:T], w32.T, out=out[:T])
    for name, w in weights.items():
        for T in tokens:
            runs[name, T, "matmat"] = lambda w=w, T=T: _kernels.matmul(w, x[:T], out[:T], args.threads, fast=2 if args.fast else 0)
            runs[name, T, "matvecs"] = lambda w=w, T=T: matvecs(w, T)
    load_before = os.getloadavg()
    times = Timer(args.flush_mib, args.pause).rounds(runs, args.repeats)
    warm = warm_rounds({k: f for k, f in runs.items() if k[2] == "matmat"}, args.repeats, max(args.pause, 0.1))
    table = {}
    for name in formats:
        table[name] = {}
        for T in tokens:
            mm, mv = times[name, T, "matmat"], times[name, T, "matvecs"]
            per_row = {k: round(statistics.median(v) / T * 1e6, 2) for k, v in (("matmat", mm), ("matvecs", mv))}
            np_med = statistics.median(times["numpy", T, "matmat"])
            table[name][T] = {
                "gflops_matmat": round(2 * R * C * T / statistics.median(mm) / 1e9, 2),
                "ratio_to_numpy_f32": round(np_med / statistics.median(mm), 3),
                "us_per_row_matmat": per_row["matmat"],
                "us_per_row_matvecs": per_row["matvecs"],
                "speedup": round(statistics.median(mv) / statistics.median(mm), 3),
                "us_per_row_matmat_spread": [round(min(mm) / T * 1e6, 2), round(max(mm) / T * 1e6, 2)],
                "us_per_row_matvecs_spread": [round(min(mv) / T * 1e6, 2), round(max(mv) / T * 1e6, 2)],
                "bit_equal_to_matvecs": bit_equal[name, T],
                "gflops_matmat_warm": round(2 * R * C * T / statistics.median(warm[name, T, "matmat"]) / 1e9, 2),
                "ratio_to_numpy_f32_warm": round(statistics.median(warm["numpy", T, "matmat"])
                                                 / statistics.median(warm[name, T, "matmat"]), 3),
                "gflops_matmat_warm_spread": [
                    round(2 * R * C * T / max(warm[name, T, "matmat"]) / 1e9, 2),
                    round(2 * R * C * T / min(warm[name, T, "matmat"]) / 1e9, 2)],
            }
    print(json.dumps({
        "build": _kernels.build_info(),
        "machine": {"cpus": os.cpu_count(), "loadavg_before": [round(v, 2) for v in load_before],
                    "loadavg_after": [round(v, 2) for v in os.getloadavg()]},
        "shape": [R, C], "repeats": args.repeats, "moed_threads": args.threads,
        "group_size": args.group_size, "fast": args.fast,
        "all_bit_equal": all(bit_equal.values()),
        "numpy_f32": {T: {"gflops": round(2 * R * C * T / statistics.median(times["numpy", T, "matmat"]) / 1e9, 2),
                          "spread_us": [round(min(times["numpy", T, "matmat"]) * 1e6, 1),
                                        round(max(times["numpy", T, "matmat"]) * 1e6, 1)],
                          "gflops_warm": round(2 * R * C * T / statistics.median(warm["numpy", T, "matmat"]) / 1e9, 2)}
                      for T in tokens},
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "slower_per_row": sorted(f"{n} T={T}" for n in formats for T in tokens
                                 if table[n][T]["speedup"] < 1),
        "formats": table,
    }, indent=2))


if __name__ == "__main__":
    main()
