"""Expert reads (daemon/store/reads.py): plan geometry, both io paths, priorities, errors, counters,
slot memory."""
from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from daemon.store.plans import ALIGN, ReadPlan, max_slot_bytes, plans_for
from daemon.store.reads import (DEMAND, PIN_LOAD, PREFETCH, REASONS, ExpertReadError, IoPool,
                                probe_direct_io)
from daemon.store.slots import SlotArena
from ext.formats.checkpoint import Checkpoint, TensorInfo
from ext.formats.quant import StoredWeight
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout, ExpertLocation

ROOT = Path(__file__).resolve().parents[3]
WAIT = 30  # seconds: a bound on waiting for an event that must happen, not a sleep
DISK_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs"}


def _make(directory: Path) -> Path:
    make_model(directory, arch="qwen3_moe", layers=2, experts=4, top_k=2, hidden=64,
               intermediate=32, dtype="bf16", shard_size=30_000)
    return directory


@pytest.fixture(scope="module")
def shared_model(tmp_path_factory) -> Path:
    """A model the tests only read."""
    return _make(tmp_path_factory.mktemp("io") / "model")


@pytest.fixture
def model(tmp_path) -> Path:
    """A model of this test's own, for tests that damage shards."""
    return _make(tmp_path / "model")


def _open(model_dir: Path) -> tuple[Checkpoint, ExpertLayout]:
    ckpt = Checkpoint(model_dir)
    return ckpt, ExpertLayout(ckpt, load_config(model_dir))


def _expected(ckpt: Checkpoint, layout: ExpertLayout) -> dict[tuple[int, int], list[bytes]]:
    return {(loc.layer, loc.expert): [ckpt.read(i).tobytes() for i in loc.pieces()]
            for loc in layout}


def _direct_or_skip(path: str | Path, direct: bool) -> None:
    if direct and not probe_direct_io(path):
        pytest.skip(f"O_DIRECT does not work on the filesystem of {path}")


def _fs_type(path: Path) -> str:
    """Filesystem type of ``path``: the longest mount point of /proc/self/mounts above it."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            mount, fstype = line.split()[1:3]
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, fstype
    return kind


def _info(name: str, path: str, offset: int, nbytes: int) -> StoredWeight:
    """A bf16 weight [1, nbytes / 2] stored as one tensor at that byte range."""
    return StoredWeight.plain(TensorInfo(name=name, path=path, offset=offset, nbytes=nbytes,
                                         dtype="BF16", shape=(1, nbytes // 2)))


# ----------------------------------------------------------------------------- plans

def test_plan_merges_touching_ranges_in_one_file_only():
    # gate [100, 5100) and up [5100, 10100) in A overlap once widened; down in B stays apart.
    loc = ExpertLocation(0, 3, gate=_info("g", "/m/A", 100, 5000),
                         up=_info("u", "/m/A", 5100, 5000), down=_info("d", "/m/B", 9000, 3000))
    plan = ReadPlan.for_expert(loc, ALIGN)
    assert [(s.path, s.offset, s.length, s.slot_offset, [t.name for t in s.tensors])
            for s in plan.spans] == [("/m/A", 0, 12288, 0, ["g", "u"]),
                                     ("/m/B", 8192, 4096, 12288, ["d"])]
    assert plan.slot_bytes == 12288 + 4096
    assert [(p.span, p.slot_offset) for p in plan.placements] == [
        (0, 100), (0, 5100), (1, 12288 + 9000 - 8192)]
    assert (plan.layer, plan.expert) == (0, 3)


def test_plan_merges_adjacent_aligned_ranges_and_keeps_gaps_apart():
    # up ends inside page 1, gate starts on page 2 -> widened ranges touch: one span.
    # down lies two pages further on in the same file -> its own span.
    loc = ExpertLocation(1, 0, gate=_info("g", "/m/A", 8192, 4000),
                         up=_info("u", "/m/A", 5000, 2000), down=_info("d", "/m/A", 20480, 100))
    plan = ReadPlan.for_expert(loc, ALIGN)
    assert [(s.offset, s.length, [t.name for t in s.tensors]) for s in plan.spans] == [
        (4096, 8192, ["u", "g"]), (20480, 4096, ["d"])]
    assert plan.slot_bytes == 12288
    assert [p.slot_offset for p in plan.placements] == [4096, 904, 8192]
    # A finer alignment gives tighter spans.
    fine = ReadPlan.for_expert(loc, 512)
    assert [(s.offset, s.length) for s in fine.spans] == [(4608, 2560), (8192, 4096), (20480, 512)]
    assert fine.slot_bytes == 2560 + 4096 + 512
    with pytest.raises(ValueError, match="power of two"):
        ReadPlan.for_expert(loc, 3000)


def test_views_alias_the_slot_at_each_tensor_offset():
    loc = ExpertLocation(0, 0, gate=_info("g", "/m/A", 100, 5000),
                         up=_info("u", "/m/A", 5100, 5000), down=_info("d", "/m/B", 9000, 3000))
    plan = ReadPlan.for_expert(loc, ALIGN)
    slot = bytearray(np.arange(plan.slot_bytes, dtype=np.uint32).astype(np.uint8).tobytes())
    weights = plan.views(slot)
    raw = np.frombuffer(slot, dtype=np.uint8)
    for array, placement in zip(weights, plan.placements):
        start = placement.slot_offset
        assert array.tobytes() == bytes(slot[start:start + placement.info.nbytes])
        assert array.shape == placement.info.shape
        assert array.dtype == placement.info.numpy_dtype
        assert array.flags.c_contiguous and not array.flags.writeable
        assert np.shares_memory(array, raw)  # a view, not a copy
    slot[5100] ^= 0xFF
    assert weights.up.view(np.uint8).reshape(-1)[0] == slot[5100]
    with pytest.raises(ValueError, match="smaller than"):
        plan.views(bytearray(plan.slot_bytes - 1))


def test_fp8_pieces_share_a_slot_and_views_are_quantized_weights():
    """Each FP8 projection is two pieces (codes, block scales), here with the scales
    gathered in another region of the file, as the safetensors library lays them out:
    one slot holds all six, the views are QuantizedWeights over it."""
    from ext.kernels._kernels import QuantizedWeight

    def fp8(name, offset, scale_offset):
        return StoredWeight(name=name, shape=(64, 32), format="fp8_e4m3", block=(128, 128), pieces=(
            TensorInfo(name=name, path="/m/A", offset=offset, nbytes=2048, dtype="F8_E4M3",
                       shape=(64, 32)),
            TensorInfo(name=name + "_scale_inv", path="/m/A", offset=scale_offset, nbytes=4,
                       dtype="F32", shape=(1, 1))))

    loc = ExpertLocation(0, 1, gate=fp8("g", 40960, 100), up=fp8("u", 43008, 104),
                         down=fp8("d", 45056, 108))
    plan = ReadPlan.for_expert(loc, ALIGN)
    assert [(s.offset, s.length, [t.name for t in s.tensors]) for s in plan.spans] == [
        (0, 4096, ["g_scale_inv", "u_scale_inv", "d_scale_inv"]), (40960, 8192, ["g", "u", "d"])]
    assert [p.slot_offset for p in plan.placements] == [4096, 100, 6144, 104, 8192, 108]
    slot = bytearray(plan.slot_bytes)
    slot[100:104] = np.float32(0.5).tobytes()
    slot[4096] = 0x38                                    # e4m3 1.0 at gate[0, 0]
    weights = plan.views(slot)
    assert all(isinstance(w, QuantizedWeight) and w.fmt == "fp8_e4m3" for w in weights)
    assert weights.gate.scales[0, 0] == 0.5 and weights.gate.codes.view(np.uint8)[0, 0] == 0x38
    assert np.shares_memory(weights.down.codes, np.frombuffer(slot, np.uint8))


def test_plan_geometry_on_a_sharded_model(shared_model):
    ckpt, layout = _open(shared_model)
    with ckpt:
        plans = plans_for(layout, ALIGN)
        split = merged = 0
        for loc in layout:
            plan = plans[(loc.layer, loc.expert)]
            for span in plan.spans:
                assert span.offset % ALIGN == 0 and span.length % ALIGN == 0
                for t in span.tensors:
                    assert t.path == span.path
                    assert span.offset <= t.offset and t.offset + t.nbytes <= span.offset + span.length
            ordered = sorted(plan.spans, key=lambda s: (s.path, s.offset))
            assert list(plan.spans) == ordered
            for a, b in zip(ordered, ordered[1:]):
                assert a.path != b.path or a.offset + a.length < b.offset  # else they'd merge
            assert plan.slot_bytes == sum(s.length for s in plan.spans)
            assert [s.slot_offset for s in plan.spans] == list(
                np.cumsum([0] + [s.length for s in plan.spans[:-1]]))
            split += len({i.path for i in loc.pieces()}) > 1
            merged += any(len(s.tensors) > 1 for s in plan.spans)
        assert split > 0 and merged > 0  # the fixture exercises both cases
        assert max_slot_bytes(layout) == max(p.slot_bytes for p in plans.values())
        assert max_slot_bytes(layout) >= layout.max_expert_bytes


# ----------------------------------------------------------------------------- probe

def test_probe_finds_direct_io_on_a_disk_filesystem(tmp_path):
    for directory in (tmp_path, Path("/var/tmp"), ROOT):
        if _fs_type(directory) in DISK_FILESYSTEMS and os.access(directory, os.W_OK):
            break
    else:
        pytest.skip("no ext4/xfs/btrfs directory to probe")
    path = directory / f"moed-probe-{os.getpid()}"
    try:
        path.write_bytes(b"\x01" * 10_000)
        assert probe_direct_io(path) is True
    finally:
        path.unlink(missing_ok=True)


def test_probe_is_false_where_o_direct_is_refused(tmp_path):
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no procfs")
    assert probe_direct_io("/proc/self/status") is False  # procfs refuses O_DIRECT
    assert probe_direct_io(tmp_path / "missing") is False


def test_probe_decides_by_a_real_read_not_by_open(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"\x01" * 10_000)
    _direct_or_skip(path, True)
    calls = []
    real_preadv = os.preadv

    def failing_preadv(fd, buffers, offset):
        calls.append((offset, [len(b) for b in buffers],
                      [np.frombuffer(b, np.uint8).ctypes.data % ALIGN for b in buffers]))
        raise OSError(22, "Invalid argument")  # what an O_DIRECT-less filesystem says

    monkeypatch.setattr(os, "preadv", failing_preadv)
    assert probe_direct_io(path) is False  # open() succeeded; the read decides
    assert calls == [(0, [4096], [0])]
    monkeypatch.setattr(os, "preadv", real_preadv)
    assert probe_direct_io(path) is True


# ----------------------------------------------------------------------------- reads

@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_reads_match_checkpoint_load_for_every_expert(shared_model, direct):
    ckpt, layout = _open(shared_model)
    _direct_or_skip(ckpt.shards[0], direct)
    with ckpt:
        expected = _expected(ckpt, layout)
        plans = plans_for(layout)
        # Some span runs past the end of its file: the short read at EOF must be accepted.
        assert any(s.offset + s.length > os.path.getsize(s.path)
                   for p in plans.values() for s in p.spans)
        with SlotArena(len(plans), max_slot_bytes(layout), lock=False) as arena, \
                IoPool(2, direct=direct) as pool:
            assert pool.io_path == ("direct" if direct else "buffered")
            slots = {key: arena.buffer(i) for i, key in enumerate(plans)}
            futures = {key: pool.submit(plans[key], slots[key], DEMAND) for key in plans}
            for key, future in futures.items():
                plan = plans[key]
                assert future.result(WAIT) == sum(
                    min(s.length, os.path.getsize(s.path) - s.offset) for s in plan.spans)
                weights = plan.views(slots[key])
                assert [w.tobytes() for w in weights] == expected[key]
                del weights
            del slots


def _gated_pool(direct: bool = False):
    """A 1-worker pool whose first read waits on ``gate``; ``order`` records every read."""
    started, gate = threading.Event(), threading.Event()
    order: list[tuple[tuple[int, int], str]] = []

    def hook(plan: ReadPlan, reason: str) -> None:
        order.append(((plan.layer, plan.expert), reason))
        if len(order) == 1:
            started.set()
            assert gate.wait(WAIT)

    return IoPool(1, direct=direct, _before_read=hook), started, gate, order


@contextlib.contextmanager
def _queued_behind_a_busy_worker(shared_model, reasons):
    """One worker held on a prefetch of plans[0], then plans[1:] queued with `reasons`.

    Yields (pool, plans, first, futures, gate, order); set `gate` to let the worker go.
    """
    ckpt, layout = _open(shared_model)
    with ckpt:
        plans = list(plans_for(layout).values())
        with SlotArena(len(plans), max_slot_bytes(layout)) as arena:
            pool, started, gate, order = _gated_pool()
            with pool:
                first = pool.submit(plans[0], arena.buffer(0), PREFETCH)
                assert started.wait(WAIT)  # the only worker is busy with plans[0]
                futures = [pool.submit(p, arena.buffer(i + 1), r)
                           for i, (p, r) in enumerate(zip(plans[1:], reasons))]
                yield pool, plans, first, futures, gate, order


def test_demand_reads_overtake_queued_prefetches(shared_model):
    reasons = [PIN_LOAD, PREFETCH, PREFETCH, DEMAND, PIN_LOAD, DEMAND, PREFETCH]
    with _queued_behind_a_busy_worker(shared_model, reasons) as (pool, plans, first, futures,
                                                                 gate, order):
        assert pool.stats().queue_depth == len(reasons)
        assert pool.stats().in_flight == 1
        gate.set()
        for f in [first, *futures]:
            f.result(WAIT)
    key = [(p.layer, p.expert) for p in plans]
    assert order == [(key[0], PREFETCH),
                     (key[4], DEMAND), (key[6], DEMAND),       # demand first, FIFO
                     (key[2], PREFETCH), (key[3], PREFETCH), (key[7], PREFETCH),
                     (key[1], PIN_LOAD), (key[5], PIN_LOAD)]


def test_an_expedited_read_goes_after_the_queued_demand_reads_and_before_the_rest(shared_model):
    reasons = [PIN_LOAD, PIN_LOAD, DEMAND, PREFETCH]
    with _queued_behind_a_busy_worker(shared_model, reasons) as (pool, plans, first, futures,
                                                                 gate, order):
        assert pool.expedite(futures[1]) is True           # a warm start's read a step needs
        assert pool.expedite(first) is False                # started: nothing to do
        gate.set()
        for f in [first, *futures]:
            f.result(WAIT)
    key = [(p.layer, p.expert) for p in plans]
    assert order == [(key[0], PREFETCH), (key[3], DEMAND), (key[2], PIN_LOAD), (key[4], PREFETCH),
                     (key[1], PIN_LOAD)]
    assert pool.stats().bytes_issued[PIN_LOAD] == plans[1].slot_bytes + plans[2].slot_bytes


def test_cancel_pending_drops_only_queued_prefetches(shared_model):
    reasons = [PREFETCH, DEMAND, PREFETCH, PIN_LOAD]
    with _queued_behind_a_busy_worker(shared_model, reasons) as (pool, plans, first, futures,
                                                                 gate, order):
        assert pool.cancel_pending(PREFETCH) == 2
        gate.set()
        assert first.result(WAIT) > 0  # already running: not cancelled
        assert [f.cancelled() for f in futures] == [True, False, True, False]
        for f in (futures[1], futures[3]):
            f.result(WAIT)
    assert [r for _, r in order] == [PREFETCH, DEMAND, PIN_LOAD]
    stats = pool.stats()
    assert stats.cancelled == 2
    assert stats.bytes_issued == {DEMAND: plans[2].slot_bytes,
                                  PREFETCH: plans[0].slot_bytes,
                                  PIN_LOAD: plans[4].slot_bytes}


def test_counters_equal_the_aligned_bytes_issued(shared_model):
    ckpt, layout = _open(shared_model)
    with ckpt:
        plans = list(plans_for(layout).values())
        with SlotArena(len(plans), max_slot_bytes(layout)) as arena, \
                IoPool(3, direct=False) as pool:
            reasons = [REASONS[i % len(REASONS)] for i in range(len(plans))]
            futures = [pool.submit(p, arena.buffer(i), r)
                       for i, (p, r) in enumerate(zip(plans, reasons))]
            for f in futures:
                f.result(WAIT)
            stats = pool.stats()
        want = {r: sum(p.slot_bytes for p, pr in zip(plans, reasons) if pr == r) for r in REASONS}
        assert stats.bytes_issued == want
        assert sum(want.values()) == sum(s.length for p in plans for s in p.spans)
        assert stats.reads_completed == {r: reasons.count(r) for r in REASONS}
        assert (stats.read_errors, stats.retries_succeeded, stats.bytes_retried) == (0, 0, 0)
        assert stats.queue_depth == 0 and stats.in_flight == 0
        assert stats.read_seconds_buckets[-1] == (float("inf"), len(plans))
        assert len(stats.recent_read_seconds) == len(plans)
        assert stats.read_seconds_total == pytest.approx(sum(stats.recent_read_seconds))
        assert stats.io_path == "buffered" and stats.n_workers == 3


def test_submit_rejects_bad_arguments(shared_model):
    ckpt, layout = _open(shared_model)
    with ckpt:
        plan = next(iter(plans_for(layout).values()))
        with IoPool(1, direct=False) as pool:
            with pytest.raises(ValueError, match="reason"):
                pool.submit(plan, bytearray(plan.slot_bytes), "urgent")
            with pytest.raises(ValueError, match="smaller than"):
                pool.submit(plan, bytearray(plan.slot_bytes - 1), DEMAND)
            with pytest.raises(ValueError, match="read-only"):
                pool.submit(plan, bytes(plan.slot_bytes), DEMAND)
        with pytest.raises(RuntimeError, match="closed"):
            pool.submit(plan, bytearray(plan.slot_bytes), DEMAND)
        if hasattr(os, "O_DIRECT"):
            with IoPool(1, direct=True) as pool:
                unaligned = memoryview(bytearray(plan.slot_bytes + ALIGN + 1))
                address = np.frombuffer(unaligned, np.uint8).ctypes.data
                skew = 1 if address % ALIGN == 0 else 0
                with pytest.raises(ValueError, match="aligned"):
                    pool.submit(plan, unaligned[skew:skew + plan.slot_bytes], DEMAND)


# ----------------------------------------------------------------------------- failures

@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_truncated_shard_fails_only_the_experts_it_cuts(model, direct):
    ckpt, layout = _open(model)
    _direct_or_skip(ckpt.shards[0], direct)
    with ckpt:
        expected = _expected(ckpt, layout)
    plans = plans_for(layout)
    # Cut the file of a single-span expert in the middle of its second tensor.
    victim = next(p for p in plans.values() if len(p.spans) == 1 and len(p.spans[0].tensors) == 3)
    span = victim.spans[0]
    cut = span.tensors[1].offset + 10
    os.truncate(span.path, cut)

    def intact(plan: ReadPlan) -> bool:
        return all(s.path != span.path or s.offset + s.needed_bytes <= cut for s in plan.spans)

    fine = [k for k, p in plans.items() if intact(p)]
    assert any(any(s.path == span.path for s in plans[k].spans) for k in fine)  # same file
    with SlotArena(len(plans), max_slot_bytes(layout)) as arena, \
            IoPool(2, direct=direct) as pool:
        slots = {key: arena.buffer(i) for i, key in enumerate(plans)}
        futures = {key: pool.submit(plans[key], slots[key], DEMAND) for key in plans}
        error = futures[(victim.layer, victim.expert)].exception(WAIT)
        assert isinstance(error, ExpertReadError) and isinstance(error, OSError)
        message = str(error)
        assert span.path in message and f"offset {span.offset}" in message
        assert all(t.name in message for t in span.tensors)
        assert "retry" in message and f"file is {cut} bytes" in message
        assert (error.path, error.offset) == (span.path, span.offset)
        assert error.tensors == tuple(t.name for t in span.tensors)
        for key in fine:
            futures[key].result(WAIT)
            assert [w.tobytes() for w in plans[key].views(slots[key])] == expected[key]
        for key in plans:
            futures[key].exception(WAIT)
        stats = pool.stats()
        # The cut experts stay failing while other experts, of the same file too, read fine.
        # Every expert past the cut fails, on two workers in no fixed order: failing() gives
        # one of their errors.
        errors = {str(f.exception()) for f in futures.values() if f.exception() is not None}
        assert message in errors
        assert pool.failing() in errors
        for key in fine[:3]:
            pool.submit(plans[key], slots[key], DEMAND).result(WAIT)
        assert pool.failing() in errors
        del slots
    failed = [k for k, f in futures.items() if f.exception() is not None]
    assert sorted(failed) == sorted(set(plans) - set(fine))
    assert stats.read_errors == len(failed) and stats.retries_succeeded == 0
    assert sum(stats.reads_completed.values()) == len(fine)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_replaced_shard_is_reopened_and_the_retry_counted(model, direct):
    ckpt, layout = _open(model)
    _direct_or_skip(ckpt.shards[0], direct)
    with ckpt:
        expected = _expected(ckpt, layout)
    plans = plans_for(layout)
    key, plan = next((k, p) for k, p in plans.items() if len(p.spans) == 1)
    path = plan.spans[0].path
    with SlotArena(1, plan.slot_bytes) as arena, IoPool(1, direct=direct) as pool:
        slot = arena.buffer(0)
        assert pool.submit(plan, slot, DEMAND).result(WAIT) > 0  # the pool now holds an fd
        # The shard is rewritten elsewhere and renamed over; the old inode is emptied.
        shutil.copyfile(path, path + ".new")
        old_inode = os.stat(path).st_ino
        os.truncate(path, 0)
        os.replace(path + ".new", path)
        assert os.stat(path).st_ino != old_inode
        arena.release(0)
        assert pool.submit(plan, slot, DEMAND).result(WAIT) > 0
        assert [w.tobytes() for w in plan.views(slot)] == expected[key]
        stats = pool.stats()
        del slot
    assert stats.retries_succeeded == 1 and stats.read_errors == 0
    assert stats.bytes_retried == plan.slot_bytes
    assert stats.bytes_issued[DEMAND] == 2 * plan.slot_bytes


# ----------------------------------------------------------------------------- slot memory

def _vm_locked_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))


def test_slot_arena_geometry_and_release():
    with SlotArena(3, 5000, lock=False) as arena:
        assert arena.slot_bytes == 8192 and arena.nbytes == 3 * 8192 and not arena.locked
        bufs = [arena.buffer(i) for i in range(3)]
        assert all(len(b) == 8192 and not b.readonly for b in bufs)
        addresses = [np.frombuffer(b, np.uint8).ctypes.data for b in bufs]
        assert all(a % ALIGN == 0 for a in addresses)
        assert np.diff(addresses).tolist() == [8192, 8192]
        for i, b in enumerate(bufs):
            b[:] = bytes([i + 1]) * len(b)
        arena.release(1)
        assert bytes(bufs[1]) == bytes(8192)  # pages handed back read as zeros
        assert bytes(bufs[0]) == b"\x01" * 8192 and bytes(bufs[2]) == b"\x03" * 8192
        with pytest.raises(IndexError):
            arena.buffer(3)
        del bufs


def test_locked_arena_is_mlocked_and_release_unlocks_a_slot():
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and soft < (1 << 20):
        pytest.skip("RLIMIT_MEMLOCK too low to lock 256 KiB")
    before = _vm_locked_kib()
    with SlotArena(4, 64 << 10, lock=True) as arena:
        assert arena.locked
        assert _vm_locked_kib() - before == 256
        buf = arena.buffer(2)
        buf[:] = b"\x07" * len(buf)
        arena.release(2)
        assert _vm_locked_kib() - before == 192
        assert bytes(arena.buffer(2)) == bytes(64 << 10)  # buffer() locks the slot again
        assert _vm_locked_kib() - before == 256
        del buf
    assert _vm_locked_kib() == before


MLOCK_REFUSED_SCRIPT = r"""
import ctypes, ctypes.util, json, resource, sys
from telemetry.logs import configure
configure("warning", json=True)
# Drop CAP_IPC_LOCK (root ignores RLIMIT_MEMLOCK while it holds it), then lower the limit.
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]
header, data = Header(0x20080522, 0), (Data * 2)()
CAP_IPC_LOCK = 14
if libc.capget(ctypes.byref(header), data) != 0:
    sys.exit(3)
for field in ("effective", "permitted", "inheritable"):
    setattr(data[0], field, getattr(data[0], field) & ~(1 << CAP_IPC_LOCK))
if libc.capset(ctypes.byref(header), data) != 0:
    sys.exit(3)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (4096, 4096))
from daemon.store.slots import SlotArena
arena = SlotArena(4, 64 << 10, lock=True)
locked = arena.locked
buf = arena.buffer(3)
buf[:] = b"\x05" * len(buf)
ok = bytes(buf) == b"\x05" * len(buf)
arena.release(3)
zero = bytes(buf) == bytes(len(buf))
del buf
arena.close()
print(json.dumps({"locked": locked, "usable": ok, "released": zero}))
"""


def test_mlock_refused_by_rlimit_falls_back_with_a_warning():
    proc = subprocess.run([sys.executable, "-c", MLOCK_REFUSED_SCRIPT], cwd=ROOT,
                          capture_output=True, text=True, timeout=WAIT)
    if proc.returncode == 3:
        pytest.skip("cannot drop CAP_IPC_LOCK here")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"locked": False, "usable": True, "released": True}
    [warning] = [json.loads(line) for line in proc.stderr.splitlines()]
    assert (warning["event"], warning["level"], warning["logger"]) == (
        "slot_arena_mlock_refused", "warning", "moed.io")
    assert (warning["bytes"], warning["rlimit_memlock"]) == (262144, "4096/4096")


# ----------------------------------------------------------------------------- live resizing

class _Readers:
    """An IoPool ``_before_read`` hook: records the thread of every read; while ``barrier``
    is set each read waits at it (n parties pass only when n workers read at once), then
    every read waits for ``gate``."""

    def __init__(self):
        self.threads: list[threading.Thread] = []
        self.barrier: threading.Barrier | None = None
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, plan: ReadPlan, reason: str) -> None:
        self.threads.append(threading.current_thread())
        if self.barrier is not None:
            self.barrier.wait(WAIT)
        assert self.gate.wait(WAIT)


def _hold_reads(pool, arena, plans, readers) -> list:
    """Submit `plans` (one per worker) and return once every worker is inside its read;
    the reads stay held until ``readers.gate`` is set. Their futures."""
    readers.barrier, readers.gate = threading.Barrier(len(plans) + 1), threading.Event()
    futures = [pool.submit(p, arena.buffer(i), DEMAND) for i, p in enumerate(plans)]
    readers.barrier.wait(WAIT)
    readers.barrier = None
    return futures


def _read_all(pool, arena, plans, expected) -> None:
    """Submit `plans` into slots 0.. and check every expert's bytes."""
    futures = [pool.submit(p, arena.buffer(i), DEMAND) for i, p in enumerate(plans)]
    for i, (p, f) in enumerate(zip(plans, futures)):
        f.result(WAIT)
        weights = p.views(arena.buffer(i))
        assert [w.tobytes() for w in weights] == expected[(p.layer, p.expert)]
        del weights


def test_set_workers_grows_at_once_and_shrinks_after_the_reads_in_hand(shared_model):
    ckpt, layout = _open(shared_model)
    with ckpt:
        expected = _expected(ckpt, layout)
        plans = list(plans_for(layout).values())
        readers = _Readers()
        with SlotArena(len(plans), max_slot_bytes(layout)) as arena, \
                IoPool(1, direct=False, _before_read=readers) as pool:
            # Growing: three reads that can only finish together need three workers now.
            pool.set_workers(3)
            assert pool.stats().n_workers == 3
            readers.barrier = threading.Barrier(3)
            _read_all(pool, arena, plans[:3], expected)
            first = {t.name: t for t in readers.threads}
            assert set(first) == {"moed-io-0", "moed-io-1", "moed-io-2"}

            # Shrinking while all three hold a read: each read still completes.
            futures = _hold_reads(pool, arena, plans[:3], readers)   # all three inside a read
            pool.set_workers(1)
            assert pool.stats().n_workers == 1
            readers.gate.set()
            assert [f.result(WAIT) for f in futures] == [
                sum(min(s.length, os.path.getsize(s.path) - s.offset) for s in p.spans)
                for p in plans[:3]]
            for name in ("moed-io-1", "moed-io-2"):   # the surplus workers leave
                first[name].join(WAIT)
                assert not first[name].is_alive()
            assert first["moed-io-0"].is_alive()
            del readers.threads[:]
            _read_all(pool, arena, plans[3:], expected)
            assert readers.threads == [first["moed-io-0"]] * len(plans[3:])

            # Growing again: four workers read at once, the leavers replaced by new threads.
            pool.set_workers(4)
            del readers.threads[:]
            readers.barrier = threading.Barrier(4)
            _read_all(pool, arena, plans[:4], expected)
            again = {t.name: t for t in readers.threads}
            assert set(again) == {f"moed-io-{i}" for i in range(4)}
            assert again["moed-io-0"] is first["moed-io-0"]
            assert again["moed-io-1"] is not first["moed-io-1"]
        everyone = list(first.values()) + list(again.values())
    assert not any(t.is_alive() for t in everyone)   # close() joined them all


def test_set_workers_shrunk_and_regrown_before_the_surplus_left_keeps_its_threads(shared_model):
    ckpt, layout = _open(shared_model)
    with ckpt:
        expected = _expected(ckpt, layout)
        plans = list(plans_for(layout).values())
        readers = _Readers()
        with SlotArena(len(plans), max_slot_bytes(layout)) as arena, \
                IoPool(3, direct=False, _before_read=readers) as pool:
            futures = _hold_reads(pool, arena, plans[:3], readers)
            pool.set_workers(1)
            pool.set_workers(3)                     # before workers 1 and 2 could leave
            readers.gate.set()
            for f in futures:
                f.result(WAIT)
            held = set(readers.threads)
            del readers.threads[:]
            readers.barrier = threading.Barrier(3)
            _read_all(pool, arena, plans[3:6], expected)
            assert set(readers.threads) == held     # the same three threads, no extra ones
            assert pool.stats().n_workers == 3


def test_set_workers_refuses_a_count_below_one_and_a_closed_pool():
    pool = IoPool(2, direct=False)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="n_workers must be > 0"):
            pool.set_workers(bad)
    assert pool.stats().n_workers == 2
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.set_workers(3)
    assert pool.stats().n_workers == 2


def test_expediting_costs_nothing_like_the_queue_length(shared_model):
    # a warm start queues a whole cache of reads; a step may expedite layers x top_k of
    # them: a scan of the queue per expedite (under the lock the io workers take jobs
    # with) made 400 expedites of a 20000-read queue take seconds
    with _queued_behind_a_busy_worker(shared_model, [PIN_LOAD]) as (pool, plans, first, futures, gate, order):
        buffer = bytearray(plans[1].slot_bytes)
        queued = [pool.submit(plans[1], buffer, PREFETCH if i < 19600 else PIN_LOAD) for i in range(20000)]
        started = time.perf_counter()
        assert all(pool.expedite(f) for f in queued[-400:])
        took = time.perf_counter() - started
        assert pool.stats().queue_depth == 20001
        assert pool.cancel_pending(PREFETCH) == 19600
        assert pool.stats().queue_depth == 401
        gate.set()
        for f in [first, *futures, *queued[-400:]]:
            f.result(WAIT)
    assert took < 0.2
    assert [r for _, r in order] == [PREFETCH] + [PIN_LOAD] * 401
