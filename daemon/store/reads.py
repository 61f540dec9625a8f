"""Expert reads: shard byte ranges -> slot buffers, on io worker threads.

Conventions. Every offset is an absolute file offset in bytes and every size is in bytes.
What is read is a ``ReadPlan`` (daemon/store/plans.py) into a slot buffer
(daemon/store/slots.py). ``IoPool`` owns its worker threads and its shard file
descriptors.

The io path is decided once, at start-up, by ``probe_direct_io`` doing a real aligned
O_DIRECT read (``open()`` succeeding proves nothing): "direct" reads bypass the page
cache; "buffered" reads go through it and then drop what they read with
``POSIX_FADV_DONTNEED`` (one advice value per call, at most 8 MiB per call — the
``read_ahead_kb`` granularity beyond which one call was measured to act on only the first
8 MiB).
"""
from __future__ import annotations

import collections
import ctypes
import heapq
import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import numpy as np

from daemon.store.plans import ALIGN, ReadPlan, ReadSpan
from telemetry.logs import get_logger

log = get_logger("io")

FADVISE_PIECE_BYTES = 8 << 20  # bytes per posix_fadvise call (read_ahead_kb = 8 MiB)

DEMAND, PREFETCH, PIN_LOAD = "demand", "prefetch", "pin_load"
# Queue priority per read reason: lower goes first; FIFO within one class.
PRIORITY = {DEMAND: 0, PREFETCH: 1, PIN_LOAD: 2}
REASONS = tuple(PRIORITY)

# Upper bounds (seconds) of the cumulative read-latency buckets in IoStats: an NVMe read of
# one expert takes tens of microseconds to a second (moed_expert_read_seconds).
READ_SECONDS_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, float("inf"))
RECENT_READS = 4096  # latencies kept for percentiles (the most recent ones)


def probe_direct_io(path: str | os.PathLike) -> bool:
    """Whether O_DIRECT reads work on ``path``'s filesystem.

    Decided by a real read: open ``path`` with O_DIRECT and read 4096 bytes at offset 0
    into a page-aligned buffer. Returns False on any OSError (EINVAL at open or at read on
    filesystems without O_DIRECT support, a missing file, ...), True otherwise. A file
    shorter than 4096 bytes still probes correctly (the read stops at end of file).
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    if flags == os.O_RDONLY:
        return False
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, flags)
        try:
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
    except OSError as e:
        log.info("direct_io_unavailable", path=str(path), error=str(e))
        return False
    finally:
        buf.close()
    return True


# ----------------------------------------------------------------------------- errors

class ExpertReadError(OSError):
    """An expert read that failed: EIO, a file truncated, removed or replaced under us.

    The message names the expert, the file, the tensor(s) and the file offset; the same
    facts are attributes: ``path``, ``tensors`` (names), ``offset``, ``layer``, ``expert``;
    ``errno`` is the underlying error's, or None for a short read.
    """

    def __init__(self, message: str, *, path: str, tensors: tuple[str, ...], offset: int,
                 layer: int, expert: int, errno: int | None = None):
        super().__init__(message)
        self.errno = errno
        self.path, self.tensors, self.offset = path, tensors, offset
        self.layer, self.expert = layer, expert


class _ShortRead(Exception):
    pass


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return f"{os.strerror(e.errno)} (errno {e.errno})"
    return str(e)


def _diagnose(fd: int | None, path: str) -> str:
    """What changed on disk: the file removed, replaced (new inode) or its size now."""
    try:
        st_path = os.stat(path)
    except FileNotFoundError:
        return "file removed"
    except OSError as e:
        return f"stat failed: {_describe(e)}"
    if fd is None:
        return f"file is {st_path.st_size} bytes"
    st_fd = os.fstat(fd)
    if (st_fd.st_dev, st_fd.st_ino) != (st_path.st_dev, st_path.st_ino):
        return f"file replaced (inode {st_fd.st_ino} -> {st_path.st_ino})"
    return f"file is {st_fd.st_size} bytes"


# ----------------------------------------------------------------------------- file handles

class _File:
    __slots__ = ("fd", "users", "stale")

    def __init__(self, fd: int):
        self.fd, self.users, self.stale = fd, 0, False


class _FileCache:
    """One fd per (path, direct), shared by the workers, reference counted.

    An fd found bad is marked stale and closed when its last user lets go, so a worker
    never reads from an fd number that another worker closed (and the kernel reused).
    """

    def __init__(self) -> None:
        self._files: dict[tuple[str, bool], _File] = {}
        self._lock = threading.Lock()

    def acquire(self, path: str, direct: bool) -> _File:
        with self._lock:
            f = self._files.get((path, direct))
            if f is None:
                flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
                f = self._files[(path, direct)] = _File(os.open(path, flags))
            f.users += 1
            return f

    def release(self, f: _File) -> None:
        with self._lock:
            f.users -= 1
            if f.stale and f.users == 0:
                os.close(f.fd)

    def invalidate(self, path: str, direct: bool, f: _File) -> None:
        """Forget ``f`` (the caller still holds it); the next acquire reopens the path."""
        with self._lock:
            if self._files.get((path, direct)) is f:
                del self._files[(path, direct)]
                f.stale = True

    def close(self) -> None:
        with self._lock:
            files, self._files = list(self._files.values()), {}
            for f in files:
                f.stale = True
                if f.users == 0:
                    os.close(f.fd)


# ----------------------------------------------------------------------------- the pool

@dataclass(frozen=True)
class IoStats:
    """A snapshot of an IoPool's counters (totals since the pool started).

    ``bytes_issued``: per reason, the sum of ``slot_bytes`` (aligned lengths) of the reads
    started, retries excluded (``bytes_retried``). ``reads_completed``: per reason, reads
    that succeeded. ``read_seconds_*`` cover successful reads, from the first preadv to
    the last (queue wait excluded): ``_total`` their sum, ``_buckets`` cumulative
    (upper bound, count) pairs ending at +inf, ``recent_read_seconds`` the latest
    RECENT_READS of them. ``read_cpu_seconds_total``: CPU time the workers spent on
    reads (their thread time from taking a job to resolving it, successful or not).
    """

    io_path: str
    n_workers: int
    bytes_issued: dict[str, int]
    bytes_retried: int
    reads_completed: dict[str, int]
    read_errors: int
    retries_succeeded: int
    cancelled: int
    read_seconds_total: float
    read_seconds_buckets: tuple[tuple[float, int], ...]
    recent_read_seconds: tuple[float, ...]
    queue_depth: int
    in_flight: int
    read_cpu_seconds_total: float = 0.0


@dataclass(order=True)
class _Job:
    priority: int
    seq: int
    plan: ReadPlan = field(compare=False)
    buffer: memoryview = field(compare=False)
    reason: str = field(compare=False)
    future: Future = field(compare=False)


class IoPool:
    """Worker threads that read expert plans into slot buffers with ``os.preadv``.

    ``n_workers`` daemon threads named ``moed-io-<i>`` take jobs from one priority queue:
    DEMAND before PREFETCH before PIN_LOAD, FIFO within a class. ``direct=True`` opens the
    shards with O_DIRECT (decide it with ``probe_direct_io``); ``io_path`` reports
    "direct" or "buffered". ``_before_read`` is a test hook called on the worker with
    (plan, reason) just before each read starts.

    A failed read is retried once after reopening the file (which picks up a shard that
    was replaced by a file of the same layout); if the retry fails the job's future
    raises ExpertReadError and the pool keeps serving other reads. `failing()` tells
    whether the latest read to finish failed (and why), for the daemon's /health.
    """

    def __init__(self, n_workers: int, direct: bool,
                 _before_read: Callable[[ReadPlan, str], None] | None = None):
        if n_workers <= 0:
            raise ValueError(f"n_workers must be > 0, got {n_workers}")
        if direct and not hasattr(os, "O_DIRECT"):
            raise ValueError("O_DIRECT is not available on this platform")
        self.n_workers = n_workers
        self.direct = direct
        self.io_path = "direct" if direct else "buffered"
        self._before_read = _before_read
        self._files = _FileCache()
        self._heap: list[_Job] = []
        # future -> its job in the heap (a job not found here is stale: an expedited
        # read's old entry, skipped when popped), so that expedite costs O(log n)
        self._queued: dict[Future, _Job] = {}
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closing = False
        self._stats_lock = threading.Lock()
        self._bytes_issued = dict.fromkeys(REASONS, 0)
        self._reads_completed = dict.fromkeys(REASONS, 0)
        self._bytes_retried = self._read_errors = self._retries_succeeded = 0
        self._cancelled = self._in_flight = 0
        # (file, offset) of a span whose latest read failed -> (the error, the span's end):
        # it stays failing until a read of that span succeeds or the file is long enough
        # to hold it again (reads of other spans do not clear it).
        self._failing: dict[tuple[str, int], tuple[str, int]] = {}
        self._read_seconds_total = 0.0
        self._read_cpu_seconds_total = 0.0
        self._bucket_counts = [0] * len(READ_SECONDS_BUCKETS)
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_READS)
        self._threads: dict[int, threading.Thread] = {}   # worker index -> thread
        self._retired: list[threading.Thread] = []        # workers that left after set_workers
        with self._cond:
            self._grow()

    def _grow(self) -> None:
        """Start workers up to n_workers. Call with _cond held."""
        for i in range(self.n_workers):
            if i not in self._threads:
                t = threading.Thread(target=self._work, args=(i,), name=f"moed-io-{i}", daemon=True)
                self._threads[i] = t
                t.start()

    def set_workers(self, n_workers: int) -> None:
        """Change the number of reader threads while serving: new workers start at once;
        surplus ones finish the read they are on and leave. Raises ValueError for n <= 0
        and RuntimeError on a closed pool."""
        if n_workers <= 0:
            raise ValueError(f"n_workers must be > 0, got {n_workers}")
        with self._cond:
            if self._closing:
                raise RuntimeError("IoPool is closed")
            self.n_workers = n_workers
            self._grow()
            self._cond.notify_all()

    # -- submitting

    def submit(self, plan: ReadPlan, buffer, reason: str) -> Future:
        """Queue a read of ``plan`` into ``buffer``; returns a Future of the bytes read.

        ``buffer``: writable, at least ``plan.slot_bytes`` bytes, owned by the caller and
        untouched by it until the future is done (for O_DIRECT: 4096-aligned, as
        ``SlotArena.buffer`` is). ``reason``: DEMAND, PREFETCH or PIN_LOAD. The future's
        result is the number of bytes read from disk (``slot_bytes`` unless a span ends
        past the end of its file); it raises ExpertReadError on failure. Raises
        ValueError (bad reason, buffer too small, unaligned for O_DIRECT) and
        RuntimeError (pool closed).
        """
        if reason not in PRIORITY:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        mv = memoryview(buffer).cast("B")
        if mv.readonly:
            raise ValueError("buffer is read-only")
        if mv.nbytes < plan.slot_bytes:
            raise ValueError(f"buffer of {mv.nbytes} bytes is smaller than the "
                             f"{plan.slot_bytes}-byte slot of expert ({plan.layer}, {plan.expert})")
        if self.direct:
            address = ctypes.addressof(ctypes.c_char.from_buffer(mv))   # (writable, non-empty)
            if plan.align % ALIGN or address % ALIGN:
                raise ValueError(f"O_DIRECT needs a {ALIGN}-aligned plan and buffer "
                                 f"(plan align {plan.align}, buffer address {address:#x})")
        future: Future = Future()
        with self._cond:
            if self._closing:
                raise RuntimeError("IoPool is closed")
            job = _Job(PRIORITY[reason], next(self._seq), plan, mv, reason, future)
            self._queued[future] = job
            heapq.heappush(self._heap, job)
            self._cond.notify()
        return future

    def expedite(self, future: Future) -> bool:
        """A queued read whose bytes are needed now (a prefetch or pin load a step asks for)
        goes ahead as a demand read: after the demand reads already queued, before every
        prefetch and pin load. True when it was queued; False when it has started, is done
        or is not this pool's (nothing changes)."""
        with self._cond:
            job = self._queued.get(future)
            if job is None:
                return False
            if job.priority > PRIORITY[DEMAND]:          # the old entry stays, stale
                self._queued[future] = job = replace(job, priority=PRIORITY[DEMAND], seq=next(self._seq))
                heapq.heappush(self._heap, job)
            return True

    def cancel_pending(self, reason: str = PREFETCH) -> int:
        """Cancel the queued (not started) reads of ``reason``; returns how many."""
        with self._cond:
            live = [j for j in self._heap if self._queued.get(j.future) is j]
            keep = [j for j in live if j.reason != reason]
            dropped = [j for j in live if j.reason == reason]
            heapq.heapify(keep)
            self._heap = keep
            for j in dropped:
                del self._queued[j.future]
        n = sum(j.future.cancel() for j in dropped)
        with self._stats_lock:
            self._cancelled += n
        return n

    # -- the workers

    def _next_job(self, index: int) -> _Job | None:
        """The next job for worker `index`; None when it should leave (the pool closed
        and drained, or set_workers dropped below it)."""
        with self._cond:
            while True:
                if index >= self.n_workers and not self._closing:
                    self._retired.append(self._threads.pop(index))
                    return None
                while self._heap:
                    job = heapq.heappop(self._heap)
                    if self._queued.get(job.future) is job:
                        del self._queued[job.future]
                        return job
                if self._closing:
                    return None
                self._cond.wait()

    def _work(self, index: int) -> None:
        while (job := self._next_job(index)) is not None:
            cpu_start = time.thread_time()
            self._run_job(job)
            with self._stats_lock:
                self._read_cpu_seconds_total += time.thread_time() - cpu_start

    def _run_job(self, job: _Job) -> None:
        """Read one job's plan and resolve its future (a worker's thread)."""
        if not job.future.set_running_or_notify_cancel():
            with self._stats_lock:
                self._cancelled += 1
            return
        with self._stats_lock:
            self._in_flight += 1
            self._bytes_issued[job.reason] += job.plan.slot_bytes
        try:
            if self._before_read is not None:
                self._before_read(job.plan, job.reason)
            start = time.perf_counter()
            n = self._read_plan(job.plan, job.buffer)
            seconds = time.perf_counter() - start
        except ExpertReadError as e:
            log.warning("expert_read_failed", reason=job.reason, error=str(e))
            with self._stats_lock:
                self._read_errors += 1
                self._in_flight -= 1
                self._failing[(e.path, e.offset)] = (str(e), e.offset + next(
                    (sp.needed_bytes for sp in job.plan.spans
                     if (sp.path, sp.offset) == (e.path, e.offset)), 0))
            job.future.set_exception(e)
        except BaseException as e:  # a bug, not a disk error: hand it to the caller
            with self._stats_lock:
                self._in_flight -= 1
            job.future.set_exception(e)
        else:
            with self._stats_lock:
                self._in_flight -= 1
                if self._failing:
                    for span in job.plan.spans:
                        self._failing.pop((span.path, span.offset), None)
                self._reads_completed[job.reason] += 1
                self._read_seconds_total += seconds
                self._recent.append(seconds)
                for i, bound in enumerate(READ_SECONDS_BUCKETS):
                    if seconds <= bound:
                        self._bucket_counts[i] += 1
                        break
            job.future.set_result(n)

    def _read_plan(self, plan: ReadPlan, buffer: memoryview) -> int:
        return sum(self._read_span(plan, span,
                                   buffer[span.slot_offset:span.slot_offset + span.length])
                   for span in plan.spans)

    def _read_span(self, plan: ReadPlan, span: ReadSpan, view: memoryview) -> int:
        """Read one span, retrying once after reopening the file; raises ExpertReadError."""
        failures: list[str] = []
        errno = None
        for attempt in (0, 1):
            if attempt:
                with self._stats_lock:
                    self._bytes_retried += span.length
            f = None
            try:
                f = self._files.acquire(span.path, self.direct)
                n = self._preadv(f.fd, span, view)
            except (OSError, _ShortRead) as e:
                errno = getattr(e, "errno", None)
                cause = _describe(e)
                if f is not None:  # the open worked: look at what changed on disk
                    cause += f"; {_diagnose(f.fd, span.path)}"
                    self._files.invalidate(span.path, self.direct, f)
                failures.append(cause)
                continue
            finally:
                if f is not None:
                    self._files.release(f)
            if attempt:
                log.info("expert_read_retry_succeeded", layer=plan.layer, expert=plan.expert,
                         path=str(span.path), first_error=str(failures[0]))
                with self._stats_lock:
                    self._retries_succeeded += 1
            return n
        names = tuple(t.name for t in span.tensors)
        raise ExpertReadError(
            f"reading expert ({plan.layer}, {plan.expert}) from {span.path}: tensor(s) "
            f"{', '.join(names)} at offset {span.offset} ({span.length} bytes, {self.io_path}): "
            f"{failures[0]}; retry after reopening the file: {failures[1]}",
            path=span.path, tensors=names, offset=span.offset, layer=plan.layer,
            expert=plan.expert, errno=errno)

    def _preadv(self, fd: int, span: ReadSpan, view: memoryview) -> int:
        """Fill ``view`` from the span; a stop at end of file is fine past needed_bytes."""
        done = 0
        while done < span.length:
            n = os.preadv(fd, [view[done:]], span.offset + done)
            if n == 0:
                break
            done += n
            if self.direct and n % ALIGN:  # end of file inside a block: nothing follows
                break
        if done < span.needed_bytes:
            raise _ShortRead(f"end of file after {done} of the {span.needed_bytes} bytes "
                             "the tensors need")
        if not self.direct:
            _drop_cached(fd, span.offset, span.length)
        return done

    # -- reporting and shutdown

    def failing(self) -> str | None:
        """The error of a failed read whose bytes have not been read whole since, else
        None. A read of the same span succeeding clears it, and so does its file holding
        the span's bytes again (one stat per failing span: a truncated shard written back);
        reads of other experts, in the same file or not, do not. Thread-safe; cheap enough
        for every /health call."""
        with self._stats_lock:
            failing = list(self._failing.items())
        for (path, offset), (message, end) in failing:
            try:
                whole = os.stat(path).st_size >= end
            except OSError:
                whole = False
            if not whole:
                return message
            with self._stats_lock:
                self._failing.pop((path, offset), None)
        return None

    def totals(self) -> tuple[float, int, float, int]:
        """(read CPU seconds, reads finished (errors included), read service seconds,
        workers): the running totals a caller takes per step, cheaper than `stats`."""
        with self._stats_lock:
            return (self._read_cpu_seconds_total, sum(self._reads_completed.values()) + self._read_errors,
                    self._read_seconds_total, self.n_workers)

    def stats(self) -> IoStats:
        """A consistent snapshot of the counters (thread-safe)."""
        with self._cond:
            depth = len(self._queued)
        with self._stats_lock:
            return IoStats(
                io_path=self.io_path, n_workers=self.n_workers,
                bytes_issued=dict(self._bytes_issued), bytes_retried=self._bytes_retried,
                reads_completed=dict(self._reads_completed), read_errors=self._read_errors,
                retries_succeeded=self._retries_succeeded, cancelled=self._cancelled,
                read_seconds_total=self._read_seconds_total,
                read_seconds_buckets=tuple(zip(READ_SECONDS_BUCKETS,
                                               itertools.accumulate(self._bucket_counts))),
                recent_read_seconds=tuple(self._recent), queue_depth=depth,
                in_flight=self._in_flight, read_cpu_seconds_total=self._read_cpu_seconds_total)

    def close(self) -> None:
        """Finish every queued read, join the workers, close the files. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            threads = list(self._threads.values()) + self._retired
        for t in threads:
            t.join()
        self._files.close()

    def __enter__(self) -> IoPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_cached(fd: int, offset: int, length: int) -> None:
    """POSIX_FADV_DONTNEED over [offset, offset + length) in pieces of at most 8 MiB."""
    for start in range(offset, offset + length, FADVISE_PIECE_BYTES):
        os.posix_fadvise(fd, start, min(FADVISE_PIECE_BYTES, offset + length - start),
                         os.POSIX_FADV_DONTNEED)


def drop_page_cache(paths) -> None:
    """Drop the page-cache pages of every file in ``paths``: ``fdatasync`` first when the
    file can be opened for writing (dirty pages cannot be dropped), then
    POSIX_FADV_DONTNEED over all of it in 8 MiB pieces (see the module doc)."""
    for p in paths:
        try:
            wfd = os.open(p, os.O_WRONLY)
        except OSError:  # read-only file or filesystem: nothing of ours can be dirty
            pass
        else:
            try:
                os.fdatasync(wfd)
            finally:
                os.close(wfd)
        fd = os.open(p, os.O_RDONLY)
        try:
            _drop_cached(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
