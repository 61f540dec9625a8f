"""Benchmark: weight bytes/s of moed's mat-vec in every weight format against numpy's f32
BLAS mat-vec of the same logical shape, and the time of one token's expert FFN.

Prints one JSON object to stdout. For each shape (default 768 x 2048 and 2048 x 768, a
Qwen3-30B-A3B routed expert's gate/up and down, and 4096 x 4096, a dense attention
projection) every format runs `matmul` of one token on 2 threads (`--threads`); numpy's
BLAS uses its own thread pool (as many threads as it is allowed) on the float32 weights.
numpy is timed in a child process of its own (spawned once, driven round by round over
a pipe), so the two thread pools never live in one process: in one process, OpenBLAS's
threads and the kernels' OpenMP threads each keep spinning for a while after a call
and took each other's cores, which made the 2-thread figures unreliable. Nothing in
the timing process calls BLAS (its error check sums in float64 without it), and the
idle of `--pause` before every run (default 0.5 s) outlasts both pools' spinning.
2-thread figures still need an otherwise idle machine: on 2 cores, any other busy
process deschedules one of the two threads for a time slice (a 0.6 ms mat-vec then
takes 10-60 ms), so compare "gb_per_s_spread" and the load average in the JSON.
Formats: moed's dense f32/f16/bf16, fp8_e4m3 with 128 x 128 block scales in float32,
bfloat16 and UE8M0, MXFP4, int8 and int4 (symmetric and with mins) in groups of
`--group-size` ("int4-mins" and "int8" at 32 are what `moed repack` writes by default). Runs are interleaved round by round (numpy, then each format, the
order rotated every round) and the median of `--repeats` rounds is reported with the
spread; ratio = moed's bytes/s / numpy's bytes/s, where a format's bytes are its codes
plus scales (plus mins); "ratio_of_best" compares the fastest run of each instead (less
sensitive to other load on the machine); "goal_met" says whether the median ratio
reaches `--goal` (0.8). Before every run the caches are flushed (the weights stream
from DRAM, as a model's do) and the thread pools are left to go idle.

The expert FFN part times `expert_ffn` of one token through one expert of
`--expert H,I` (gate, up [I, H], down [H, I]) per format, cold, against numpy doing the
same in f32 (three mat-vecs and SiLU).

"build" says which SIMD path the kernels were built with (build_info()) and "machine"
the CPU and the load average around the run (a shared machine gives noisy figures).

    python bench/matvec.py [--repeats 15] [--threads 2] [--shapes 768x2048,2048x768,4096x4096]

For one core against one core: OPENBLAS_NUM_THREADS=1 python bench/matvec.py --threads 1
(the JSON records OPENBLAS_NUM_THREADS / OMP_NUM_THREADS as set).

`--fast` also times the fast numerics (`matmul(..., fast=True)`, "q8x2-32": activations
as two int8 planes per block of 32, the codes and their residual, and integer block dots
of each) of every int8, int4 and mxfp4 format, as "<format>-fast"
beside the exact "<format>" in the same interleaved rounds (and in the expert FFN);
"build"."fast" names the integer-dot path that ran.

`--stream-mib M` times a stream of mat-vecs instead of one: each side holds a ring of
copies of its weight, at least M MiB in all (and at least 3), and a run — after the same
flush and idle — calls it on every copy in turn; the first call (which wakes the thread
pool) is not timed, the others are, each over a weight no cache holds (the ring is
larger than the last-level cache), so a figure is the steady bytes/s of a decode step's
run of different weights with the threads awake. On machines whose idle cores are slow
to wake (a virtual machine's halted vCPU takes milliseconds), a single cold 2-thread call
mostly measures that wake-up; the stream does not.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import time

import ml_dtypes
import numpy as np

from ext.kernels import _kernels

FORMATS = ("f32", "f16", "bf16", "fp8-f32", "fp8-bf16", "fp8-ue8m0", "mxfp4", "int8",
           "int4", "int4-mins")
FAST_FORMATS = ("mxfp4", "int8", "int4", "int4-mins")   # the formats fast mode changes


def timed_names(formats, fast: bool) -> list[tuple[str, str, bool]]:
    """(label, format, fast) of every run: each format, and with `fast` each of
    FAST_FORMATS again as "<format>-fast"."""
    runs = [(name, name, False) for name in formats]
    if fast:
        runs += [(name + "-fast", name, True) for name in formats if name in FAST_FORMATS]
    return runs


def make_weight(name: str, R: int, C: int, group: int, rng: np.random.Generator):
    """A random [R, C] weight in format `name` (an ndarray or QuantizedWeight) with values
    of a plausible magnitude."""
    if name in ("f32", "f16", "bf16"):
        w = rng.standard_normal((R, C), dtype=np.float32) * np.float32(0.02)
        return w.astype({"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[name])
    if name.startswith("fp8"):
        codes = rng.integers(0, 256, (R, C), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= 1  # no NaN codes
        grid = (-(-R // 128), -(-C // 128))
        scales = rng.uniform(1e-5, 1e-4, grid).astype(np.float32)
        if name == "fp8-bf16":
            scales = scales.astype(ml_dtypes.bfloat16)
        elif name == "fp8-ue8m0":
            scales = rng.integers(110, 115, grid, dtype=np.uint8)
        return _kernels.QuantizedWeight("fp8_e4m3", codes, scales)
    if name == "mxfp4":
        return _kernels.QuantizedWeight("mxfp4", rng.integers(0, 256, (R, C // 32, 16), dtype=np.uint8),
                                        rng.integers(118, 122, (R, C // 32), dtype=np.uint8))
    scales = rng.uniform(1e-3, 2e-3, (R, C // group)).astype(np.float16)
    if name == "int8":
        return _kernels.QuantizedWeight("int8", rng.integers(-128, 128, (R, C), dtype=np.int8), scales)
    mins = (-8 * scales.astype(np.float32)).astype(np.float16) if name == "int4-mins" else None
    return _kernels.QuantizedWeight("int4", rng.integers(0, 256, (R, C // 2), dtype=np.uint8),
                                    scales, mins)


def _values(w) -> np.ndarray:
    return _kernels.dequantize(w)


def ring_size(nbytes: int, stream_mib: int) -> int:
    """Copies of an `nbytes` weight in a ring of at least `stream_mib` MiB (at least 3)."""
    return max(3, -(-(stream_mib << 20) // nbytes))


def copy_weight(w):
    """A copy of a weight (an ndarray or QuantizedWeight) in its own memory."""
    if isinstance(w, np.ndarray):
        return w.copy()
    extra = () if w.mins is None else (w.mins.copy(),)
    return _kernels.QuantizedWeight(w.fmt, w.codes.copy(), w.scales.copy(), *extra)


def _own_seconds(result, elapsed: float) -> float:
    """A run's seconds: what it returned when it timed itself (`stream_seconds`, a float),
    else the `elapsed` time around it."""
    return result if isinstance(result, float) else elapsed


def stream_seconds(calls) -> float:
    """Seconds per call of calls[1:], run back to back after calls[0] (not timed)."""
    calls[0]()
    t0 = time.perf_counter()
    for call in calls[1:]:
        call()
    return (time.perf_counter() - t0) / (len(calls) - 1)


class Timer:
    """Cold, interleaved timings: flush the caches and idle before every run."""

    def __init__(self, flush_mib: int, pause: float):
        self.flush = np.zeros(flush_mib << 17)  # float64: MiB * 2**20 / 8
        self.pause = pause

    def cold(self) -> None:
        """Evict the weights from the caches and let both thread pools go idle
        (OpenBLAS and OpenMP workers spin for a while after a call)."""
        np.add(self.flush, 1.0, out=self.flush)
        time.sleep(self.pause)

    def rounds(self, runs: dict, repeats: int, timed_elsewhere: dict | None = None) -> dict[str, list[float]]:
        """Seconds of each callable in `runs`, `repeats` interleaved rounds, rotating
        the order every round so that no entry always follows the same neighbour.
        `timed_elsewhere`: callables that go cold and time themselves (in another
        process) and return their seconds; they join the same rotation."""
        timed_elsewhere = timed_elsewhere or {}
        names = list(timed_elsewhere) + list(runs)
        times: dict[str, list[float]] = {n: [] for n in names}
        for i in range(repeats):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                if name in timed_elsewhere:
                    times[name].append(timed_elsewhere[name]())
                    continue
                self.cold()
                t0 = time.perf_counter()
                seconds = runs[name]()
                elapsed = time.perf_counter() - t0
                times[name].append(_own_seconds(seconds, elapsed))
        return times


def _numpy_work(kind: str, a: int, b: int, stream_mib: int = 0):
    """numpy's f32 work for one token: "matvec" of an [a, b] weight, or "ffn", one
    expert of hidden a and intermediate b (gate, up [b, a], down [a, b], SiLU).
    With stream_mib, "matvec" runs over a ring of copies (see `ring_size`) and returns
    the seconds of one mat-vec (the first call, waking the pool, left out)."""
    rng = np.random.default_rng(1)
    if kind == "matvec":
        w = rng.standard_normal((a, b), dtype=np.float32)
        x = rng.standard_normal(b, dtype=np.float32)
        if stream_mib:
            ring = [w] + [w.copy() for _ in range(ring_size(w.nbytes, stream_mib) - 1)]
            return lambda: stream_seconds([lambda w=w: np.dot(w, x) for w in ring])
        return lambda: np.dot(w, x)
    gate, up = (rng.standard_normal((b, a), dtype=np.float32) * np.float32(0.02) for _ in range(2))
    down = rng.standard_normal((a, b), dtype=np.float32) * np.float32(0.02)
    x = rng.standard_normal(a, dtype=np.float32)

    def ffn():
        g, u = gate @ x, up @ x
        return down @ (g / (1 + np.exp(-g)) * u)
    return ffn


def _numpy_child(conn, kind: str, a: int, b: int, flush_mib: int, pause: float,
                 stream_mib: int = 0) -> None:
    """The numpy side, in a process of its own: each message asks for one cold run of
    `_numpy_work(kind, a, b, stream_mib)` and is answered with its seconds."""
    work = _numpy_work(kind, a, b, stream_mib)
    work()
    timer = Timer(flush_mib, pause)
    while conn.recv():
        timer.cold()
        t0 = time.perf_counter()
        seconds = work()
        conn.send(_own_seconds(seconds, time.perf_counter() - t0))
    conn.close()


class NumpyProcess:
    """numpy's f32 BLAS work (`_numpy_work`) in a spawned child process; `run()` times
    one cold call there (the caller is idle, waiting) and returns its seconds."""

    def __init__(self, kind: str, a: int, b: int, flush_mib: int, pause: float, stream_mib: int = 0):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_numpy_child,
                                 args=(child, kind, a, b, flush_mib, pause, stream_mib), daemon=True)
        self._proc.start()
        child.close()

    def run(self) -> float:
        self._conn.send(True)
        return self._conn.recv()

    def close(self) -> None:
        self._conn.send(False)
        self._proc.join()


def _gb(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _rounds_with_numpy(timer: Timer, runs: dict, args, kind: str, a: int, b: int) -> dict:
    """timer.rounds over `runs` and, as "numpy_f32", numpy's `kind` work in its child."""
    numpy_proc = NumpyProcess(kind, a, b, args.flush_mib, args.pause,
                              args.stream_mib if kind == "matvec" else 0)
    try:
        return timer.rounds(runs, args.repeats, {"numpy_f32": numpy_proc.run})
    finally:
        numpy_proc.close()


def bench_shape(R: int, C: int, formats, args, timer: Timer, rng) -> dict:
    weights = {name: make_weight(name, R, C, args.group_size, rng) for name in formats}
    w32_bytes = R * C * 4
    x = rng.standard_normal((1, C), dtype=np.float32)
    out = np.empty((1, R), np.float32)
    errors = {}
    labels = timed_names(formats, args.fast)
    for label, name, fast in labels:  # warm up, and check each result (float64, no BLAS call)
        w = weights[name]
        _kernels.matmul(w, x, out, args.threads, fast=fast)
        ref = (_values(w).astype(np.float64) * x[0].astype(np.float64)).sum(axis=1)
        errors[label] = float(np.abs(out[0] - ref).max() / np.abs(ref).max())
    if args.stream_mib:
        rings = {name: [w] + [copy_weight(w) for _ in range(ring_size(w.nbytes, args.stream_mib) - 1)]
                 for name, w in weights.items()}
        runs = {label: (lambda ring=rings[name], fast=fast: stream_seconds(
                    [lambda v=v: _kernels.matmul(v, x, out, args.threads, fast=fast) for v in ring]))
                for label, name, fast in labels}
    else:
        runs = {label: (lambda w=weights[name], fast=fast: _kernels.matmul(w, x, out, args.threads, fast=fast))
                for label, name, fast in labels}
    times = _rounds_with_numpy(timer, runs, args, "matvec", R, C)
    numpy_s = statistics.median(times["numpy_f32"])
    report = {"shape": [R, C],
              "numpy_f32": {"gb_per_s": _gb(w32_bytes, numpy_s), "median_ms": round(numpy_s * 1e3, 3),
                            "gb_per_s_spread": [_gb(w32_bytes, max(times["numpy_f32"])),
                                                _gb(w32_bytes, min(times["numpy_f32"]))],
                            "process": "child"},
              "formats": {}}
    for name, fmt, _ in labels:
        w = weights[fmt]
        s = statistics.median(times[name])
        report["formats"][name] = {
            "bits_per_weight": round(8 * w.nbytes / (R * C), 4),
            "gb_per_s": _gb(w.nbytes, s),
            "ratio_to_numpy": round((w.nbytes / s) / (w32_bytes / numpy_s), 3),
            "ratio_of_best": round((w.nbytes / min(times[name])) / (w32_bytes / min(times["numpy_f32"])), 3),
            "goal_met": bool((w.nbytes / s) / (w32_bytes / numpy_s) >= args.goal),
            "median_ms": round(s * 1e3, 3),
            "gb_per_s_spread": [_gb(w.nbytes, max(times[name])), _gb(w.nbytes, min(times[name]))],
            "max_rel_err": errors[name],
        }
    return report


def bench_expert(H: int, I: int, formats, args, timer: Timer, rng) -> dict:
    experts = {name: [make_weight(name, r, c, args.group_size, rng) for r, c in ((I, H), (I, H), (H, I))]
               for name in formats}
    x = rng.standard_normal((1, H), dtype=np.float32)
    gs = np.array([0, 1], np.int64)
    hbuf, out = np.empty((1, I), np.float32), np.empty((1, H), np.float32)
    runs = {}
    for label, name, fast in timed_names(formats, args.fast):
        g, u, d = experts[name]
        runs[label] = lambda g=g, u=u, d=d, fast=fast: _kernels.expert_ffn(
            [g], [u], [d], x, gs, hbuf, out, args.threads, fast=fast)
        runs[label]()
    times = _rounds_with_numpy(timer, runs, args, "ffn", H, I)
    report = {"hidden_size": H, "intermediate_size": I, "formats": {}}
    for name in times:
        nbytes = 3 * H * I * 4 if name == "numpy_f32" else sum(
            w.nbytes for w in experts[name.removesuffix("-fast")])
        s = statistics.median(times[name])
        report["formats"][name] = {"expert_bytes": nbytes, "median_ms": round(s * 1e3, 3),
                                   "gb_per_s": _gb(nbytes, s),
                                   "ms_spread": [round(min(times[name]) * 1e3, 3),
                                                 round(max(times[name]) * 1e3, 3)]}
    return report


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def parse_timing_args(parser: argparse.ArgumentParser, *, flush_mib: int, pause: float):
    """Add the options every kernel benchmark shares (rounds, threads, formats, group
    size, cache flush, pause) to `parser` and parse: (args, the list of formats)."""
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--threads", type=int, default=2, help="moed compute threads (default 2)")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help=f"comma-separated formats (default all: {','.join(FORMATS)})")
    parser.add_argument("--group-size", type=int, default=32, help="int4/int8 group size (default 32)")
    parser.add_argument("--flush-mib", type=int, default=flush_mib,
                        help=f"bytes written between runs to evict the caches (default {flush_mib} MiB)")
    parser.add_argument("--pause", type=float, default=pause,
                        help=f"seconds of idle between runs (default {pause})")
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    unknown = set(formats) - set(FORMATS)
    if unknown:
        parser.error(f"unknown formats {sorted(unknown)} (choose from {', '.join(FORMATS)})")
    return args, formats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="768x2048,2048x768,4096x4096",
                        help="comma-separated RxC weight shapes (default 768x2048,2048x768,4096x4096)")
    parser.add_argument("--expert", default="2048,768",
                        help="H,I of the expert FFN timing, or 'none' (default 2048,768)")
    parser.add_argument("--goal", type=float, default=0.8,
                        help="bytes/s ratio to numpy each format should reach (default 0.8)")
    parser.add_argument("--stream-mib", type=int, default=0,
                        help="time a stream of mat-vecs over a ring of at least this many MiB of "
                             "copies of each weight, threads awake (default 0: one cold call)")
    parser.add_argument("--fast", action="store_true",
                        help="also time fast mode (two int8 activation planes) of the int8, int4 and mxfp4 "
                             "formats, as <format>-fast")
    args, formats = parse_timing_args(parser, flush_mib=512, pause=0.5)

    rng = np.random.default_rng(0)
    timer = Timer(args.flush_mib, args.pause)
    load_before = os.getloadavg()
    shapes = []
    for spec in args.shapes.split(","):
        R, C = (int(v) for v in spec.lower().split("x"))
        shapes.append(bench_shape(R, C, formats, args, timer, rng))
    expert = None
    if args.expert != "none":
        H, I = (int(v) for v in args.expert.split(","))
        expert = bench_expert(H, I, formats, args, timer, rng)
    print(json.dumps({
        "build": _kernels.build_info(),
        "machine": {"cpu": _cpu_model(), "cpus": os.cpu_count(),
                    "blas_threads_env": {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
                                         if k in os.environ},
                    "loadavg_before": [round(v, 2) for v in load_before],
                    "loadavg_after": [round(v, 2) for v in os.getloadavg()]},
        "repeats": args.repeats,
        "fast": args.fast,
        "mode": f"stream of {args.stream_mib} MiB rings" if args.stream_mib else "one cold call",
        "moed_threads": args.threads,
        "group_size": args.group_size,
        "matvec": shapes,
        "formats_missing_goal": sorted({f"{name} {'x'.join(map(str, s['shape']))}" for s in shapes
                                        for name, r in s["formats"].items() if not r["goal_met"]}),
        "expert_ffn": expert,
    }, indent=2))


if __name__ == "__main__":
    main()
