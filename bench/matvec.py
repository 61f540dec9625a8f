"""Benchmark: bytes/s of moed's bf16 mat-vec against numpy's f32 BLAS mat-vec.

Prints one JSON object to stdout. Shape 4096 x 14336 (Mixtral's w1 transposed: the
rows are 14336 outputs of length 4096), 2 threads for moed; numpy's BLAS uses its
own thread pool (as many threads as it is allowed). Runs are interleaved (moed,
numpy, moed, ...) and the median of each is reported, with the ratio of weight
bytes moved per second. Before every run the caches are flushed (the weights
stream from DRAM, as a model's do) and both thread pools are left to go idle.

    python bench/matvec.py [--repeats 15] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import ml_dtypes
import numpy as np

from ext.kernels import _kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved runs of each (default 15)")
    parser.add_argument("--threads", type=int, default=2, help="moed compute threads (default 2)")
    parser.add_argument("--rows", type=int, default=14336, help="weight rows (default 14336)")
    parser.add_argument("--cols", type=int, default=4096, help="weight columns (default 4096)")
    parser.add_argument("--flush-mib", type=int, default=512,
                        help="bytes written between runs to evict the caches (default 512 MiB)")
    parser.add_argument("--pause", type=float, default=0.5,
                        help="seconds of idle between runs (default 0.5)")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((args.rows, args.cols), dtype=np.float32)
    w_bf16 = w32.astype(ml_dtypes.bfloat16)
    w32 = w_bf16.astype(np.float32)
    x = rng.standard_normal((1, args.cols), dtype=np.float32)
    out = np.empty((1, args.rows), np.float32)
    _kernels.matmul(w_bf16, x, out, args.threads)  # warm up both
    ref = w32 @ x[0]
    max_rel_err = float(np.abs(out[0] - ref).max() / np.abs(ref).max())

    flush = np.zeros(args.flush_mib << 17)  # float64: MiB * 2**20 / 8

    def cold() -> None:
        """Evict both matrices from the caches and let both thread pools go idle
        (OpenBLAS and OpenMP workers spin for a while after a call, stealing the
        cores from whoever runs next)."""
        np.add(flush, 1.0, out=flush)
        time.sleep(args.pause)

    t_moed, t_numpy = [], []
    for _ in range(args.repeats):
        cold()
        t0 = time.perf_counter()
        _kernels.matmul(w_bf16, x, out, args.threads)
        t_moed.append(time.perf_counter() - t0)
        cold()
        t0 = time.perf_counter()
        np.dot(w32, x[0])
        t_numpy.append(time.perf_counter() - t0)
    moed_bps = w_bf16.nbytes / statistics.median(t_moed)
    numpy_bps = w32.nbytes / statistics.median(t_numpy)
    print(json.dumps({
        "shape": [args.rows, args.cols],
        "repeats": args.repeats,
        "moed_threads": args.threads,
        "openmp": _kernels.openmp_enabled(),
        "moed_bf16_gb_per_s": round(moed_bps / 1e9, 3),
        "numpy_f32_gb_per_s": round(numpy_bps / 1e9, 3),
        "bytes_per_s_ratio": round(moed_bps / numpy_bps, 3),
        "moed_median_ms": round(statistics.median(t_moed) * 1e3, 3),
        "numpy_median_ms": round(statistics.median(t_numpy) * 1e3, 3),
        "max_rel_err_vs_f32": max_rel_err,
        "moed_gb_per_s_spread": [round(w_bf16.nbytes / t / 1e9, 2) for t in (max(t_moed), min(t_moed))],
        "numpy_gb_per_s_spread": [round(w32.nbytes / t / 1e9, 2) for t in (max(t_numpy), min(t_numpy))],
    }, indent=2))


if __name__ == "__main__":
    main()
