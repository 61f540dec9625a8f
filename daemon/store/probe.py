"""`moed iobench`: random expert-sized reads through the io worker pool, per io path and depth.

What one run measures. A *block* is the model's commonest expert slot size
(``ReadPlan.slot_bytes`` from ``plans_for``; an expert split across shards may differ): the reads are real expert ReadPlans of that size, picked at random
(seeded), so they hit the shards exactly as the daemon does. With ``--file`` the blocks are
``block_bytes``-sized pieces of a scratch file instead. A *cell* is (mode, queue depth):
mode "direct" (O_DIRECT, only when ``probe_direct_io`` says it works) or "buffered", queue
depth QD in QUEUE_DEPTHS = an IoPool of QD workers, each with one read in flight (a
finished read submits the next from the worker's done callback, so no read waits on this
thread). A *pass* is one timed run of one cell; passes go repeat by repeat, cells in order
inside a repeat (interleaved, so the spread over repeats shows drift, e.g. a virtual
disk's host cache), and share ``seconds`` between them.

Honest cold buffered passes: before each one every file is ``fdatasync``-ed (on an fd
opened for writing when allowed; dirty pages are not dropped otherwise) and then dropped
with POSIX_FADV_DONTNEED; the fraction of its pages resident (mmap + mincore) is reported
before and after the drop. The pool itself drops what it reads after each buffered read.

Units: bytes, seconds; ``gb_per_s`` is 10^9 bytes per second of issued block bytes;
latency is from submit to completion of one read, in milliseconds.
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import itertools
import json
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from daemon.store.plans import ALIGN, ReadPlan, ReadSpan, TensorPlacement, plans_for, round_up
from daemon.store.reads import DEMAND, IoPool, drop_page_cache, probe_direct_io
from daemon.store.slots import SlotArena
from ext.formats.checkpoint import TensorInfo

QUEUE_DEPTHS = (1, 2, 4, 8, 16)
DEFAULT_BLOCK_BYTES = 4 << 20  # --file mode
_BUDGET_SHARE = 0.9  # of the time left per pass: the rest covers dropping and draining
# A pool worker's own memory while it reads (its thread stack and allocator arena as
# touched): a 16-worker probe of 2.25 MiB blocks grew the process's peak RSS by 44.5 MiB,
# 8.4 MiB more than its arena, 0.53 MiB a worker; rounded up.
PROBE_BYTES_PER_WORKER = 1 << 20


def probe_memory_bytes(block_bytes: int, queue_depths=QUEUE_DEPTHS) -> int:
    """The most a `run_iobench` over blocks of ``block_bytes`` adds to the process, in
    bytes: its SlotArena (one block per read in flight at the deepest queue depth, rounded
    up as SlotArena rounds a slot) and that many pool workers (PROBE_BYTES_PER_WORKER).
    The daemon's memory plan reserves it for the idle storage probe
    (daemon/service/loading.py `runtime_bytes`)."""
    depth = max(queue_depths)
    return depth * (round_up(block_bytes, max(ALIGN, mmap.PAGESIZE)) + PROBE_BYTES_PER_WORKER)


@dataclass(frozen=True)
class Target:
    """What to read: ``plans`` (all ``block_bytes`` long) over ``files``."""

    files: tuple[str, ...]
    plans: tuple[ReadPlan, ...]
    block_bytes: int


# ----------------------------------------------------------------------------- targets

def model_target(model_dir: str | os.PathLike) -> Target:
    """Every expert plan of the model whose slot has the commonest size and lies inside its files.

    Raises FileNotFoundError when ``model_dir`` is not a directory, and the loaders'
    errors (CheckpointError, ConfigError) for a broken model.
    """
    from ext.formats.checkpoint import Checkpoint
    from ext.models.config import load_config
    from ext.models.experts import ExpertLayout

    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"--model: {model_dir} is not a model directory")
    checkpoint = Checkpoint(model_dir)
    try:
        layout = ExpertLayout(checkpoint, load_config(model_dir))
        plans = list(plans_for(layout).values())
        files = tuple(str(s) for s in checkpoint.shards)
    finally:
        checkpoint.close()
    if not plans:
        raise ValueError(f"--model: {model_dir} has no routed experts to read")
    sizes = {f: os.path.getsize(f) for f in files}
    # The commonest slot size (an expert split across two shards, or ending at a file's
    # end, can have a different one): same size for every read (bytes = reads x block)
    # and no read stopping at end of file.
    sizes_seen = collections.Counter(p.slot_bytes for p in plans)
    block = max(sizes_seen, key=lambda b: (sizes_seen[b], b))
    chosen = tuple(p for p in plans if p.slot_bytes == block
                   and all(s.offset + s.length <= sizes[s.path] for s in p.spans))
    if not chosen:
        raise ValueError(f"--model: no expert of {model_dir} has a {block}-byte slot inside "
                         "its shard")
    return Target(files=files, plans=chosen, block_bytes=block)


def scratch_target(path: str | os.PathLike, size_bytes: int | None,
                   block_bytes: int = DEFAULT_BLOCK_BYTES) -> tuple[Target, bool]:
    """Blocks of ``block_bytes`` over a scratch file; returns (target, created).

    An existing file of at least ``size_bytes`` (or any size when None) is read as it is;
    a missing one is written with ``size_bytes`` seeded random bytes and fsync-ed
    (``created`` is True: the caller removes it). Raises ValueError for a block that is
    not a positive multiple of 4096, a file smaller than one block or than ``size_bytes``,
    or a missing file without ``size_bytes``.
    """
    path = str(path)
    if block_bytes <= 0 or block_bytes % ALIGN:
        raise ValueError(f"block must be a positive multiple of {ALIGN} bytes, got {block_bytes}")
    created = False
    if not os.path.exists(path):
        if size_bytes is None:
            raise ValueError(f"--file: {path} does not exist; give --size to create it")
        if size_bytes < block_bytes:
            raise ValueError(f"--size: {size_bytes} bytes is less than one {block_bytes}-byte block")
        _write_scratch(path, size_bytes)
        created = True
    size = os.path.getsize(path)
    if size < max(block_bytes, size_bytes or 0):
        raise ValueError(f"--file: {path} is {size} bytes, less than "
                         f"{max(block_bytes, size_bytes or 0)}")
    plans = tuple(_block_plan(path, i, block_bytes) for i in range(size // block_bytes))
    return Target(files=(path,), plans=plans, block_bytes=block_bytes), created


def _write_scratch(path: str, size_bytes: int) -> None:
    rng = np.random.default_rng(0)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for start in range(0, size_bytes, DEFAULT_BLOCK_BYTES):
            os.write(fd, rng.bytes(min(DEFAULT_BLOCK_BYTES, size_bytes - start)))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def _block_plan(path: str, index: int, block_bytes: int) -> ReadPlan:
    """A one-span plan of block ``index`` (one opaque uint8 piece; read, never viewed)."""
    offset = index * block_bytes
    info = TensorInfo(name=f"block.{index}", path=path, offset=offset, nbytes=block_bytes,
                      dtype="U8", shape=(block_bytes,))
    span = ReadSpan(path=path, offset=offset, length=block_bytes, slot_offset=0, tensors=(info,))
    return ReadPlan(layer=0, expert=index, align=ALIGN, spans=(span,),
                    placements=(TensorPlacement(info, 0, 0),), slot_bytes=block_bytes)


# ----------------------------------------------------------------------------- the page cache

class _Mincore:
    """mmap/mincore/munmap through ctypes (the stdlib's mmap object exposes no address for a
    read-only mapping, and has no mincore)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.mmap, self.munmap, self.mincore = lib.mmap, lib.munmap, lib.mincore
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        self.mmap.restype = ctypes.c_void_p
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: str | os.PathLike) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of ``path``), by mmap + mincore.

    Maps the file read-only and shared (no page is touched, so none is faulted in).
    Raises OSError when the file cannot be opened, mapped or queried.
    """
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    if pages == 0:
        return 0, 0
    libc = _Mincore()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}", str(path))
        try:
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore: {os.strerror(err)}", str(path))
            resident = sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return resident, pages


def page_residency(paths) -> float:
    """Fraction of the pages of ``paths`` (all together) resident in the page cache; 1.0
    for files without pages."""
    resident = total = 0
    for p in paths:
        r, n = resident_pages(p)
        resident, total = resident + r, total + n
    return resident / total if total else 1.0


def block_device(path: str | os.PathLike) -> str:
    """Name of the block device holding ``path`` (``/sys/dev/block/MAJ:MIN``), else
    "MAJ:MIN" (overlay, tmpfs and other filesystems without one)."""
    dev = os.stat(path).st_dev
    key = f"{os.major(dev)}:{os.minor(dev)}"
    link = Path("/sys/dev/block") / key
    try:
        return Path(os.path.realpath(link, strict=True)).name
    except OSError:
        return key


# ----------------------------------------------------------------------------- one pass

@dataclass
class _Pass:
    reads: int
    bytes: int
    seconds: float
    latencies: list[float]


def run_pass(pool: IoPool, arena: SlotArena, plans, queue_depth: int, seconds: float,
             rng: np.random.Generator) -> _Pass:
    """Keep ``queue_depth`` reads in flight on ``pool`` for ``seconds``; the drain after
    the deadline is timed too. Each read goes to its own arena slot. Raises the first
    read's error (ExpertReadError) after the pass has drained."""
    lock = threading.Lock()
    done = threading.Event()
    latencies: list[float] = []
    state = {"in_flight": 0, "bytes": 0, "end": 0.0, "error": None}
    picks = rng.integers(len(plans), size=1 << 16)  # pre-drawn: the rng is not thread-safe
    pick = itertools.count()  # next() on it is atomic

    def submit(slot: int) -> None:
        plan = plans[picks[next(pick) % len(picks)]]
        t = time.perf_counter()
        fut = pool.submit(plan, arena.buffer(slot), DEMAND)
        fut.add_done_callback(lambda f: finished(f, slot, plan, t))

    def finished(f: Future, slot: int, plan: ReadPlan, t_submit: float) -> None:
        now = time.perf_counter()
        error = f.exception()
        with lock:
            if error is None:
                latencies.append(now - t_submit)
                state["bytes"] += plan.slot_bytes
            elif state["error"] is None:
                state["error"] = error
            again = error is None and state["error"] is None and now < deadline
            if not again:
                state["in_flight"] -= 1
                if state["in_flight"] == 0:
                    state["end"] = now
                    done.set()
        if again:
            submit(slot)

    start = time.perf_counter()
    deadline = start + seconds
    with lock:
        state["in_flight"] = queue_depth
    for slot in range(queue_depth):
        submit(slot)
    done.wait()
    if state["error"] is not None:
        raise state["error"]
    return _Pass(reads=len(latencies), bytes=state["bytes"], seconds=state["end"] - start,
                 latencies=latencies)


# ----------------------------------------------------------------------------- the run

class ProbeInterrupted(Exception):
    """run_iobench stopped between two passes because its ``interrupted()`` said so."""


def run_iobench(target: Target, seconds: float = 60.0, repeats: int = 3, seed: int = 0,
                queue_depths=QUEUE_DEPTHS, direct: bool | None = None,
                progress: Callable[[int, int], None] | None = None,
                clock: Callable[[], float] = time.monotonic,
                interrupted: Callable[[], bool] | None = None) -> dict:
    """Every (mode, queue depth) cell ``repeats`` times within ``seconds``; the report.

    ``direct``: None probes O_DIRECT on the first file (cells for "direct" only if it
    works), False skips it. The time left is shared evenly among the passes left, so
    setup and cache dropping come out of the same budget (a pass still completes
    ``queue_depth`` reads when no time is left). Returns the JSON-ready report (see the
    module doc); raises ValueError for ``repeats`` < 2, ExpertReadError on a failed read.
    ``interrupted``: asked before every pass; True stops the run with ProbeInterrupted
    (the daemon's probe gives way to a request this way, within one pass).
    """
    if repeats < 2:
        raise ValueError(f"repeats must be >= 2, got {repeats}")
    t_end = clock() + seconds
    can_direct = probe_direct_io(target.files[0]) if direct is None else direct
    modes = ("direct", "buffered") if can_direct else ("buffered",)
    cells = [(m, qd) for m in modes for qd in queue_depths]
    runs: dict[tuple[str, int], list[_Pass]] = {c: [] for c in cells}
    residency: dict[tuple[str, int], list[dict]] = {c: [] for c in cells}
    rng = np.random.default_rng(seed)
    total, n = repeats * len(cells), 0
    with SlotArena(max(queue_depths), target.block_bytes) as arena:
        for _ in range(repeats):
            for mode, qd in cells:
                if interrupted is not None and interrupted():
                    raise ProbeInterrupted(f"stopped after {n} of {total} passes")
                if mode == "buffered":
                    before = page_residency(target.files)
                    drop_page_cache(target.files)
                    residency[(mode, qd)].append(
                        {"before": before, "after": page_residency(target.files)})
                budget = max(0.0, t_end - clock()) * _BUDGET_SHARE / (total - n)
                with IoPool(qd, direct=mode == "direct") as pool:
                    runs[(mode, qd)].append(run_pass(pool, arena, target.plans, qd, budget, rng))
                n += 1
                if progress:
                    progress(n, total)
    results = []
    for cell in cells:
        passes = runs[cell]
        rates = [p.bytes / p.seconds / 1e9 for p in passes]
        lat_ms = np.array([x for p in passes for x in p.latencies]) * 1e3
        entry = {
            "mode": cell[0], "queue_depth": cell[1],
            "gb_per_s": statistics.median(rates),
            "latency_ms": {"p50": float(np.percentile(lat_ms, 50)),
                           "p99": float(np.percentile(lat_ms, 99))},
            "repeats": len(passes),
            "spread": {"gb_per_s_min": min(rates), "gb_per_s_max": max(rates)},
            "gb_per_s_runs": rates,
            "reads": sum(p.reads for p in passes),
            "bytes": sum(p.bytes for p in passes),
        }
        if residency[cell]:
            entry["page_residency"] = residency[cell]
        results.append(entry)
    return {"device": block_device(target.files[0]),
            "io_path": "direct" if can_direct else "buffered",
            "block_bytes": target.block_bytes, "results": results,
            "files": list(target.files), "blocks": len(target.plans),
            "budget_seconds": seconds}


def report_path(state_dir: str | os.PathLike, device: str) -> Path:
    """Where the report of `device` lives: ``<state_dir>/iobench-<device>.json``."""
    return Path(state_dir) / f"iobench-{device.replace('/', '_')}.json"


def save_report(state_dir: str | os.PathLike, text: str, device: str) -> Path:
    """Write ``text`` to ``<state_dir>/iobench-<device>.json`` atomically (temp, fsync,
    rename); creates the directory (0o700). Returns the path."""
    d = Path(state_dir)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = report_path(d, device)
    tmp = d / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def saved_probe(state_dir: Path | None, model_dir: str | Path) -> dict | None:
    """The saved storage probe report of the disk holding the model's shards, or None."""
    if state_dir is None:
        return None
    try:
        shard = next(p for p in sorted(Path(model_dir).iterdir()) if p.suffix == ".safetensors")
        report = json.loads(report_path(state_dir, block_device(shard)).read_text())
        return report if isinstance(report, dict) else None
    except (OSError, ValueError, StopIteration):
        return None

def probe_rows(report: dict) -> list[dict]:
    """The well-formed results of a storage probe report on the io path it chose
    (queue depth a whole number in [1, 1024], GB/s a number >= 0); [] when malformed."""
    try:
        return [r for r in report["results"] if r["mode"] == report["io_path"]
                and type(r["queue_depth"]) is int and 1 <= r["queue_depth"] <= 1024
                and type(r["gb_per_s"]) in (int, float) and r["gb_per_s"] >= 0]
    except (KeyError, TypeError, AttributeError):
        return []

def probe_io_workers(state_dir: Path | None, model_dir: str | Path, share: float = 0.95) -> int | None:
    """The io worker count the saved storage probe (`moed iobench`, or the daemon's probe
    after READY) suggests: the smallest queue depth reaching `share` of the best GB/s on
    the io path it found. None without a usable saved probe for the model's disk."""
    report = saved_probe(state_dir, model_dir)
    rows = probe_rows(report) if report is not None else []
    if not rows:
        return None
    best = max(float(r["gb_per_s"]) for r in rows)
    return min(r["queue_depth"] for r in rows if r["gb_per_s"] >= share * best)

def probe_summary(state_dir: Path | None, model_dir: str | Path, io_workers: int) -> dict | None:
    """The saved probe in brief, for `moed bench`: io path, device, GB/s at `io_workers`
    and the best queue depth. None without a usable saved probe."""
    report = saved_probe(state_dir, model_dir)
    rows = probe_rows(report) if report is not None else []
    if not rows:
        return None
    at = [r["gb_per_s"] for r in rows if r["queue_depth"] == io_workers]
    best = max(rows, key=lambda r: r["gb_per_s"])
    return {"io_path": report["io_path"], "device": report.get("device"),
            "gb_per_s_at_io_workers": at[0] if at else None,
            "best_gb_per_s": best["gb_per_s"], "best_queue_depth": best["queue_depth"]}
