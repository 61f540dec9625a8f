"""An explicit expert_cache_bytes larger than the memory holds is clamped, with a warning
naming the key, the bytes asked and the bytes granted: at start to what the memory plan
leaves the expert cache (before, the slots filled until the kernel OOM-killed the daemon),
and on SIGHUP to what the memory available now holds (never below the cache it has: it only
grows as far as memory allows). The machine's memory is faked
through the function the planner reads it with (`loading.read_memory`)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from daemon.machine.memory import MemoryReading
from daemon.service import daemon as daemon_module
from daemon.service import loading
from daemon.service.config import ServeConfig
from daemon.service.daemon import Daemon
from daemon.service.sdnotify import Notifier
from log_contract import Lines
from ext.makemodel import make_model
from scheduler.planner import CgroupLimit

ASKED = 100 << 30               # expert_cache_bytes = "100G"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 2 layers x 16 experts of 3 x 256 x 256 bf16 (384 KiB a slot)
    return make_model(tmp_path_factory.mktemp("clamp") / "m", arch="qwen3_moe", layers=2,
                      experts=16, top_k=2, hidden=256, intermediate=256, dtype="bf16", seed=5)


def _cgroup(limit: int, usage: int = 0) -> MemoryReading:
    return MemoryReading(64 << 30, (CgroupLimit("/fake", 1, limit, usage, 0),))


def _tight_reading(model_dir) -> MemoryReading:
    """A cgroup whose plan streams the experts through a cache of about 8 slots."""
    roomy = loading.plan_serving_memory(model_dir, max_concurrent_sequences=4, pin_fraction=0,
                                        threads=1, reading=MemoryReading(64 << 30, ()))
    p = roomy.plan
    fixed = p.dense_bytes + p.kv_bytes + p.runtime_bytes
    return _cgroup(int((fixed + 8 * p.slot_bytes) / (1 - loading.MARGIN_FRACTION)) + 1)


def test_an_oversized_cache_is_clamped_at_start_and_on_reload(model_dir, monkeypatch):
    reading = _tight_reading(model_dir)
    monkeypatch.setattr(loading, "read_memory", lambda: reading)
    start_log, reload_log = Lines(), Lines()
    monkeypatch.setattr(loading, "log", start_log)
    monkeypatch.setattr(daemon_module, "log", reload_log)
    config = ServeConfig(model=str(model_dir), tuner="off", threads=1, prefix_cache_bytes=0,
                         expert_cache_bytes=ASKED)
    planned = loading.plan_serving_memory(model_dir, max_concurrent_sequences=4, pin_fraction=0,
                                          threads=1, reading=reading).plan
    assert planned.expert_cache_bytes < planned.slot_bytes * 32      # the experts stream
    loaded = loading.load_for_serving(config, {})
    try:
        assert loaded.session.options.cache_bytes == planned.expert_cache_bytes
        [(level, fields)] = start_log.named("expert_cache_bytes_clamped")
        assert level == "warning"
        assert fields["key"] == "expert_cache_bytes"
        assert fields["asked_bytes"] == ASKED
        assert fields["granted_bytes"] == planned.expert_cache_bytes

        # SIGHUP with the file edited to 100G: what the cgroup holds now plus the cache the
        # rebuild frees first, less the margin and what is promised and not yet held (the
        # KV of 4 sequences, counted whole; the compile workers' share)
        slot = loaded.session.provider.slot_bytes
        current = loaded.session.options.cache_bytes
        engine = loaded.engine
        promised = loading.promised_bytes(loaded)
        kv = (engine.model.attention.kv_bytes_per_token(engine.model.config)
              * engine.context_tokens * engine.max_concurrent_sequences)
        assert promised == kv + loaded.grammars.reserve_bytes() and kv > 0
        free = promised + 64 * slot
        now = _cgroup(1 << 30, (1 << 30) - free)
        monkeypatch.setattr(loading, "read_memory", lambda: now)
        room = free + current
        granted = (room - int(loading.MARGIN_FRACTION * room) - promised) // slot * slot
        assert current < granted < current + 64 * slot
        asked = [config]
        d = Daemon(config, load=None, reload=lambda: asked[0], listener=None,
                   notifier=Notifier({}))
        d.state.config = ServeConfig(model=str(model_dir), tuner="off", threads=1,
                                     prefix_cache_bytes=0, expert_cache_bytes=current)
        d.state.loaded = loaded
        loaded.engine.start()
        try:
            asyncio.run(d.reload())
            [(level, fields)] = reload_log.named("expert_cache_bytes_clamped")
            assert (level, fields["asked_bytes"], fields["granted_bytes"]) == ("warning", ASKED,
                                                                              granted)
            assert loaded.session.options.cache_bytes == granted
            assert d.state.config.expert_cache_bytes == granted
            assert reload_log.named("reloaded") and not reload_log.named("reload_failed")

            # a prefix cache of 1 GiB promised as well (it takes its capacity first): no room
            # to grow into; the cache keeps what it has, and says so
            d.state.config = replace(d.state.config, expert_cache_bytes=2 * granted)
            asked[0] = replace(config, prefix_cache_bytes=1 << 30)
            asyncio.run(d.reload())
        finally:
            loaded.engine.stop()
        assert engine.prefix_cache.capacity_bytes == 1 << 30
        [_, (level, fields)] = reload_log.named("expert_cache_bytes_clamped")
        assert (fields["asked_bytes"], fields["granted_bytes"]) == (ASKED, granted)
        assert loaded.session.options.cache_bytes == granted
        assert not reload_log.named("reload_failed")
    finally:
        loaded.close()
