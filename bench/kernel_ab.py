"""Benchmark: two builds of the kernels against each other, in one process, round by round.

A kernel change worth a few per cent is lost in the noise of separate runs on a shared
machine (the same command moves 2x between runs). This script loads the compiled
kernels of two checkouts (`--a DIR` and `--b DIR`, each holding a built
`ext/kernels/_kernels*.so`, e.g. `git worktree add ../old HEAD~1`, then `python setup.py
build_ext --inplace` there) into one process as two modules, gives both the same weights
(bench/matvec.py's `make_weight`, wrapped by each module's own QuantizedWeight) and the
same input, and alternates them round by round (A B, B A, ...). A round is one pass over a
ring of copies of the weight at least `--stream-mib` MiB (96: larger than the last-level
cache, so every call reads its weight from DRAM, as a decode step does), timed after one
untimed call that wakes the threads.

For each format and shape it prints the median GB/s of each build (codes plus scales and
mins), the ratio B / A of every round pair (>1: B is faster) as median and quartiles,
and whether both builds' outputs are bit-identical. One JSON object on stdout.

    python bench/kernel_ab.py --a ../old --b . [--formats bf16,int8,int4-mins]
        [--shapes 1024x1024,4096x4096] [--threads 2] [--rounds 12] [--tokens 1]

`--tokens T` times the mat-mat of T tokens instead of the mat-vec. `--fast` times both
builds' fast numerics (`matmul(..., fast=True)`; the formats it does not change stay
exact), e.g. two versions of the fast numerics against each other.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matvec  # noqa: E402


def load_build(directory: str):
    """The `_kernels` extension module built in checkout `directory` (a fresh module
    object, not registered in sys.modules). Raises SystemExit naming the directory when
    it holds no built kernels."""
    found = sorted(Path(directory).glob("ext/kernels/_kernels*.so"))
    if not found:
        raise SystemExit(f"kernel_ab: {directory}: no built ext/kernels/_kernels*.so "
                         f"(run `python setup.py build_ext --inplace` there)")
    spec = importlib.util.spec_from_file_location("ext.kernels._kernels", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rewrap(module, w):
    """Weight `w` (an ndarray or a QuantizedWeight of any build) for `module`: the same
    arrays, wrapped by that build's own QuantizedWeight."""
    if isinstance(w, np.ndarray):
        return w
    extra = () if w.mins is None else (w.mins,)
    return module.QuantizedWeight(w.fmt, w.codes, w.scales, *extra)


def quartiles(values: list[float]) -> list[float]:
    v = sorted(values)
    return [v[(len(v) - 1) // 4], v[(3 * (len(v) - 1)) // 4]]


def compare(builds, name: str, R: int, C: int, args, rng: np.random.Generator) -> dict:
    """One format and shape: both builds over the same ring, `args.rounds` rounds."""
    one = matvec.make_weight(name, R, C, args.group_size, rng)
    nbytes = one.nbytes                     # codes, scales and mins
    ring = [one] + [matvec.make_weight(name, R, C, args.group_size, rng)
                    for _ in range(matvec.ring_size(nbytes, args.stream_mib) - 1)]
    x = rng.standard_normal((args.tokens, C), dtype=np.float32)
    rings = [[rewrap(m, w) for w in ring] for m in builds]
    outs = [np.empty((args.tokens, R), np.float32) for _ in builds]
    for m, ws, out in zip(builds, rings, outs):
        m.matmul(ws[0], x, out, args.threads, fast=args.fast)
    identical = bool(np.array_equal(outs[0], outs[1]))
    seconds: list[list[float]] = [[], []]
    for r in range(args.rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            m, ws, out = builds[i], rings[i], outs[i]
            m.matmul(ws[-1], x, out, args.threads, fast=args.fast)   # wakes the threads, untimed
            t0 = time.perf_counter()
            for w in ws:
                m.matmul(w, x, out, args.threads, fast=args.fast)
            seconds[i].append((time.perf_counter() - t0) / len(ws))
    ratios = [a / b for a, b in zip(seconds[0], seconds[1])]
    gbs = [nbytes / statistics.median(s) / 1e9 for s in seconds]
    return {"format": name, "shape": [R, C], "weight_bytes": nbytes, "ring": len(ring),
            "a_gb_per_s": round(gbs[0], 3), "b_gb_per_s": round(gbs[1], 3),
            "b_over_a": round(statistics.median(ratios), 4),
            "b_over_a_quartiles": [round(q, 4) for q in quartiles(ratios)],
            "identical_outputs": identical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="checkout holding build A's kernels")
    parser.add_argument("--b", required=True, help="checkout holding build B's kernels")
    parser.add_argument("--formats", default="bf16,fp8-f32,mxfp4,int8,int4-mins",
                        help=f"comma-separated, of {','.join(matvec.FORMATS)}")
    parser.add_argument("--shapes", default="1024x512,512x1024,1024x1024,4096x4096",
                        help="rows x columns, comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="compute threads (default 2)")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of each build (default 12)")
    parser.add_argument("--stream-mib", type=int, default=96, help="ring size in MiB (default 96)")
    parser.add_argument("--tokens", type=int, default=1, help="tokens per call (default 1: mat-vec)")
    parser.add_argument("--group-size", type=int, default=32, help="int4/int8 group size (default 32)")
    parser.add_argument("--fast", action="store_true",
                        help="time the fast numerics (matmul(..., fast=True)) of both builds")
    args = parser.parse_args()
    formats = args.formats.split(",")
    unknown = sorted(set(formats) - set(matvec.FORMATS))
    if unknown:
        parser.error(f"--formats: unknown {','.join(unknown)}; known: {','.join(matvec.FORMATS)}")
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        if any(len(s) != 2 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        parser.error(f"--shapes: expected ROWSxCOLUMNS[,...], got {args.shapes!r}")
    if args.rounds < 1 or args.threads < 1 or args.tokens < 1:
        parser.error("--rounds, --threads and --tokens must be >= 1")
    builds = [load_build(args.a), load_build(args.b)]
    rng = np.random.default_rng(0)
    results = [compare(builds, name, R, C, args, rng) for R, C in shapes for name in formats]
    print(json.dumps({"a": {"dir": args.a, "build": builds[0].build_info()},
                      "b": {"dir": args.b, "build": builds[1].build_info()},
                      "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
                      "fast": args.fast,
                      "stream_mib": args.stream_mib, "results": results}, indent=2))


if __name__ == "__main__":
    main()
