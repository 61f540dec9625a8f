"""The prefix cache across restarts (daemon/engine/prefix_store.py): blocks saved in the
state directory and read back at start, whole chains only, within the budget, with the
same bits; a corrupt or foreign file is set aside, never used; and through `moed serve`:
a prompt's second request after SIGTERM and after kill -9 reuses the prefix the first
one left (cached_tokens) and answers with the same tokens."""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from daemon_proc import Daemon, short_dir

from daemon.engine.prefix_cache import PrefixCache
from daemon.engine.prefix_store import PrefixStore
from ext.makemodel import make_model
from ext.models.kvcache import KVCache

B = 4
SHAPES = [((2, 3), (2, 3))]           # one layer: K and V of 2 heads x 3
LAYOUT = [((2, B, 3), "float32"), ((2, B, 3), "float32")]


def _kv(tokens: int, seed: int) -> KVCache:
    kv = KVCache(SHAPES, tokens, tokens)
    rng = np.random.default_rng(seed)
    kv.write(0, [rng.standard_normal((2, tokens, 3), dtype=np.float32) for _ in range(2)])
    return kv


def _store(path: Path, budget: int = 1 << 20, **kw) -> PrefixStore:
    args = dict(numerics="exact", block_tokens=B, layout=LAYOUT, budget_bytes=budget)
    args.update(kw)
    return PrefixStore(path, "f" * 64, **args)


def _filled() -> tuple[PrefixCache, dict]:
    cache = PrefixCache(2 * 2 * 3 * 4, 1 << 20, block_tokens=B)
    a = list(range(1, 13))                    # 3 blocks
    b = a[:4] + [50, 51, 52, 53, 54]          # shares the first block, then 1 of its own
    c = list(range(100, 108))                 # salted: 2 blocks
    kvs = {"a": _kv(12, 1), "b": _kv(9, 2), "c": _kv(8, 3)}
    own = kvs["b"].read(4, 9)
    kvs["b"].write(0, kvs["a"].read(0, 4))    # the shared block's values are a's
    kvs["b"].write(4, own)
    cache.store(a, kvs["a"])
    cache.store(b, kvs["b"])
    cache.store(c, kvs["c"], salt=("uid", 1000))
    return cache, {"a": a, "b": b, "c": c, **{"kv_" + k: v for k, v in kvs.items()}}


def _loaded(cache: PrefixCache, tokens, salt=None) -> tuple[int, list]:
    kv = KVCache(SHAPES, len(tokens), len(tokens))
    n = cache.load(tokens, kv, salt)
    return n, kv.read(0, n)


def test_a_saved_cache_comes_back_with_the_same_chains_bits_and_order(tmp_path):
    cache, t = _filled()
    store = _store(tmp_path)
    assert store.save(cache.snapshot()) == 6
    again = PrefixCache(2 * 2 * 3 * 4, 1 << 20, block_tokens=B)
    assert again.restore(store.load(again.capacity_blocks)) == 6
    for name, salt in (("a", None), ("b", None), ("c", ("uid", 1000))):
        want = _loaded(cache, t[name] + [0], salt)
        got = _loaded(again, t[name] + [0], salt)
        assert got[0] == want[0] > 0
        assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(got[1], want[1]))
    assert _loaded(again, t["c"] + [0])[0] == 0                  # another salt finds nothing
    # recency kept: the least recent block (a's last) goes first when the cache shrinks
    again.resize(5 * again.block_bytes)
    assert _loaded(again, t["a"] + [0])[0] == 8 and _loaded(again, t["b"] + [0])[0] == 8


def test_the_budget_keeps_the_most_recent_blocks_and_whole_chains(tmp_path):
    cache, t = _filled()
    block = 2 * 2 * B * 3 * 4
    store = _store(tmp_path, budget=3 * block)
    assert store.save(cache.snapshot()) == 3                      # c's two blocks, then b's...
    again = PrefixCache(2 * 2 * 3 * 4, 1 << 20, block_tokens=B)
    again.restore(store.load(100))
    assert _loaded(again, t["c"] + [0], ("uid", 1000))[0] == 8
    # b's own block needs a's first block, the most recent of the others: a chain is kept
    # from its start or not at all
    n_a, n_b = _loaded(again, t["a"] + [0])[0], _loaded(again, t["b"] + [0])[0]
    assert (n_a, n_b) in ((4, 4), (4, 8))
    assert store.load(2) and len(store.load(2)) == 2               # a smaller cache reads fewer


@pytest.mark.parametrize("change, kind", [
    (dict(numerics="fast"), "foreign"),
    (dict(block_tokens=8, layout=[((2, 8, 3), "float32")] * 2), "foreign"),
    (dict(layout=[((2, B, 4), "float32")] * 2), "foreign"),
])
def test_a_file_of_another_mode_or_layout_is_set_aside(tmp_path, change, kind, log_records):
    records = log_records("moed.state")
    cache, _ = _filled()
    _store(tmp_path).save(cache.snapshot())
    other = _store(tmp_path, **change)
    assert other.load(100) == []
    assert not other.path.exists()
    assert [p.name for p in tmp_path.iterdir() if f".{kind}-" in p.name]
    assert any(r.get("event") == "state_file_set_aside" and r.get("kind") == kind for r in records)


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "header", "extra"])
def test_a_damaged_file_is_corrupt_and_set_aside(tmp_path, damage):
    cache, _ = _filled()
    store = _store(tmp_path)
    store.save(cache.snapshot())
    raw = bytearray(store.path.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0x40
    elif damage == "truncate":
        raw = raw[:-7]
    elif damage == "magic":
        raw[:4] = b"JUNK"
    elif damage == "header":
        raw[20] = ord("{")
    else:
        raw += b"\0"
    store.path.write_bytes(bytes(raw))
    assert store.load(100) == []
    assert [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert not store.path.exists()


def test_a_forged_file_repeating_a_block_is_corrupt(tmp_path):
    cache, _ = _filled()
    store = _store(tmp_path)
    blocks = cache.snapshot()
    root = next(i for i, b in enumerate(blocks) if b.parent < 0 and b.salt is None)
    child = next(b for b in blocks if b.parent == root)
    twice = blocks[:root + 1] + [child, child]
    store.save([b if b is not child else type(b)(root, None, b.tokens, b.data) for b in twice])
    assert store.load(100) == []
    assert [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]


def test_a_fifo_or_a_directory_in_its_place_is_set_aside_without_waiting(tmp_path):
    store = _store(tmp_path)
    os.mkfifo(store.path)
    started = time.monotonic()
    assert store.load(100) == [] and time.monotonic() - started < 5
    assert not store.path.exists()
    store.path.mkdir()
    assert store.load(100) == []
    assert len([p for p in tmp_path.iterdir() if ".corrupt-" in p.name]) == 2


def test_a_header_larger_than_the_blocks_it_may_hold_is_not_parsed(tmp_path):
    store = _store(tmp_path, budget=2 * 2 * 2 * B * 3 * 4)              # two blocks
    store.path.write_bytes(b"MOEDKV1\n" + (1 << 20).to_bytes(8, "little") + b" " * (1 << 20))
    assert store.load(2) == []
    assert [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]


def test_temp_files_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    dead = tmp_path / ".prefix-ffffffffffffffff.kv.tmp-4194303"        # above pid_max's default
    live = tmp_path / f".prefix-ffffffffffffffff.kv.tmp-{os.getpid()}"
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    _store(tmp_path)
    assert not dead.exists() and live.exists()


def test_a_save_is_atomic_and_leaves_no_temp_file(tmp_path, monkeypatch):
    cache, _ = _filled()
    store = _store(tmp_path)
    store.save(cache.snapshot())
    before = store.path.read_bytes()

    class Boom(Exception):
        pass

    def fail(*a, **k):
        raise Boom
    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(Boom):
        store.save(cache.snapshot()[:2])
    assert store.path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [store.path.name]


# ------------------------------------------------------------------ through moed serve

PROMPT_WORDS = 160


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("persist") / "model", arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=14)


def _ask(d: Daemon) -> dict:
    prompt = " ".join(f"w{i}" for i in range(PROMPT_WORDS))
    status, body = d.json("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    return body


@pytest.mark.parametrize("how", ["sigterm", "kill -9"])
def test_a_prompt_after_a_restart_reuses_what_the_previous_process_cached(model_dir, how):
    work = short_dir()
    state = os.path.join(work, "state-kept")
    first = Daemon(model_dir, short_dir(), "--threads", "1", state_dir=state)
    try:
        cold = _ask(first)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        if how == "sigterm":
            assert first.stop() == 0
            saved = [e for e in first.events if e.get("event") == "prefix_cache_saved"]
            assert saved and saved[-1]["blocks"] > 0
        else:                                    # saved once idle; then killed, unwarned
            _wait_saved(first)
            first.kill()                         # SIGKILL
    finally:
        first.cleanup()
    second = Daemon(model_dir, short_dir(), "--threads", "1", state_dir=state)
    try:
        restored = [e for e in second.events if e.get("event") == "prefix_cache_restored"]
        assert restored and restored[0]["blocks"] > 0
        warm = _ask(second)
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= warm["usage"]["prompt_tokens"] - 16 and cached % 16 == 0
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert second.stop() == 0
    finally:
        second.cleanup()


def _wait_saved(d: Daemon, timeout: float = 30.0) -> None:
    """The save that follows the request once the engine is idle (PREFIX_SAVE_IDLE_S)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e.get("event") == "prefix_cache_saved" for e in d.events):
            return
        time.sleep(0.2)
    raise AssertionError("no prefix_cache_saved within the flush interval")


def test_a_foreign_file_in_the_state_directory_is_set_aside_at_start(model_dir):
    work = short_dir()
    state = Path(work) / "state-foreign"
    state.mkdir(parents=True)
    from ext.formats.checkpoint import Checkpoint
    path = state / f"prefix-{Checkpoint(model_dir).fingerprint()[:16]}.kv"
    path.write_bytes(b"MOEDKV1\n" + (5).to_bytes(8, "little") + b'{"a":')
    d = Daemon(model_dir, short_dir(), "--threads", "1", state_dir=str(state))
    try:
        assert [e for e in d.events if e.get("event") == "state_file_set_aside"]
        assert _ask(d)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert d.stop() == 0
    finally:
        d.cleanup()
    assert [p.name for p in state.iterdir() if ".corrupt-" in p.name]


def test_a_failed_save_is_said_once_and_left_to_the_flushes(model_dir):
    """The state directory gone (a file in its place) after the start: the idle save fails
    with one warning and is not retried on every idle moment after that."""
    work = short_dir()
    state = Path(work) / "state-gone"
    d = Daemon(model_dir, short_dir(), "--threads", "1", state_dir=str(state))
    try:
        shutil.rmtree(state)
        state.write_text("not a directory")
        _ask(d)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not _named(d, "prefix_cache_save_failed"):
            time.sleep(0.2)
        assert len(_named(d, "prefix_cache_save_failed")) == 1
        d.json("POST", "/v1/completions", {"prompt": "other words here " * 8, "max_tokens": 2})
        time.sleep(4)                                 # two idle periods
        assert len(_named(d, "prefix_cache_save_failed")) == 1
        assert d.json("GET", "/health")[0] == 200
    finally:
        d.kill()
        d.cleanup()


def _named(d: Daemon, event: str) -> list[dict]:
    return [e for e in d.events if e.get("event") == event]


def test_sighup_turns_keeping_the_prefix_cache_off_and_on(model_dir):
    """prefix_cache_persist_bytes is applied by a reload: at 0 from the start nothing is
    written; raised by SIGHUP, the next idle save writes the cache, which the next start
    reads; lowered to 0 again, shutdown saves nothing."""
    workdir, kept = short_dir(), short_dir()
    state = os.path.join(kept, "state-hup")      # outlives each daemon's workdir
    config = Path(kept) / "moed.toml"
    config.write_text("prefix_cache_persist_bytes = 0\n")
    d = Daemon(model_dir, workdir, "--threads", "1", state_dir=state, env={"MOED_CONFIG": str(config)})
    try:
        _ask(d)
        time.sleep(3)                                  # past one idle save period
        assert not _named(d, "prefix_cache_saved")
        mark = d.mark()
        config.write_text('prefix_cache_persist_bytes = "64M"\n')
        d.signal(signal.SIGHUP)
        assert "prefix_cache_persist_bytes" in d.wait_event("reloaded", from_index=mark)["applied"]
        _wait_saved(d)
        assert d.stop() == 0
    finally:
        d.cleanup()
    again = Daemon(model_dir, short_dir(), "--threads", "1", state_dir=state)
    try:
        assert _named(again, "prefix_cache_restored")
        assert _ask(again)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again.stop() == 0
    finally:
        again.cleanup()
    files = sorted(p.name for p in Path(state).glob("prefix-*.kv"))
    assert len(files) == 1
    before = (Path(state) / files[0]).stat().st_mtime_ns
    config.write_text("prefix_cache_persist_bytes = 0\n")
    off = Daemon(model_dir, short_dir(), "--threads", "1", state_dir=state, env={"MOED_CONFIG": str(config)})
    try:
        assert not _named(off, "prefix_cache_restored")
        _ask(off)
        assert off.stop() == 0
        assert not _named(off, "prefix_cache_saved")
    finally:
        off.cleanup()
    assert (Path(state) / files[0]).stat().st_mtime_ns == before


def test_saves_asked_while_one_runs_wait_for_it(tmp_path):
    # the idle saver, the minute's flush and a SIGHUP's re-save each call save_prefix_cache;
    # two at once wrote one temp file (named by the pid) from two threads: a torn file
    import asyncio
    import concurrent.futures
    import threading
    from types import SimpleNamespace

    from daemon.service.serving import ServingState

    cache, _ = _filled()
    store, inside, most = _store(tmp_path), [0], [0]
    real_save, lock = store.save, threading.Lock()

    def slow_save(blocks):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.2)
        try:
            return real_save(blocks)
        finally:
            with lock:
                inside[0] -= 1

    def call(fn):
        done = concurrent.futures.Future()
        done.set_result(fn())
        return done

    store.save = slow_save
    state = ServingState(None, None)
    state.loaded = SimpleNamespace(prefix_store=store, prefix_saved_version=-1, prefix_save_failed=False,
                                   engine=SimpleNamespace(prefix_cache=cache, call=call))

    async def main():
        await asyncio.gather(*(state.save_prefix_cache() for _ in range(3)))

    asyncio.run(main())
    assert most[0] == 1
    assert len(_store(tmp_path).load(100)) == 6


def test_a_budget_reloaded_during_a_save_is_saved_again(tmp_path):
    # SIGHUP sets the budget and asks for a save (prefix_saved_version -1) while one runs:
    # the running save, at the old budget, must not mark the cache saved
    import asyncio
    import concurrent.futures
    from types import SimpleNamespace

    from daemon.service.serving import ServingState

    cache, _ = _filled()
    store = _store(tmp_path)
    store.budget_bytes = 2 * store.block_bytes               # two of the six blocks
    real_save = store.save
    state = ServingState(None, None)

    def reloaded_save(blocks):
        n = real_save(blocks)
        store.budget_bytes *= 3                            # what reload does, meanwhile
        state.loaded.prefix_saved_version = -1
        return n

    def call(fn):
        done = concurrent.futures.Future()
        done.set_result(fn())
        return done

    store.save = reloaded_save
    state.loaded = SimpleNamespace(prefix_store=store, prefix_saved_version=-1, prefix_save_failed=False,
                                   engine=SimpleNamespace(prefix_cache=cache, call=call))
    asyncio.run(state.save_prefix_cache())
    assert state.loaded.prefix_saved_version == -1
    store.save = real_save
    asyncio.run(state.save_prefix_cache())
    assert len(_store(tmp_path).load(100)) == 6
