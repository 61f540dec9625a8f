"""The live squeeze: a simulated memory feed shrinks the expert cache, RSS falls, tokens stay.

`MemoryWatcher` runs here without a daemon: its engine-thread runner is a direct call
(nothing else drives the model), and its feed is a list of readings the test controls.
"""
from __future__ import annotations

import pytest

from daemon.machine.memory import read_memory_pressure
from daemon.machine.squeeze import MemoryFeed, MemoryWatcher
from daemon.store.session import open_model
from daemon.store.streaming import minimum_cache_bytes
from ext.makemodel import make_model
from ext.sampling import Sampler, SamplingParams
from scheduler.planner import SqueezePolicy

GIB = 1 << 30
MIB = 1 << 20
BUDGET = 64 * MIB
# low water 100 MiB, high 120 MiB: a reading 40 MiB short cuts 40 + 10 MiB
POLICY = SqueezePolicy(low_water_bytes=100 * MIB, high_water_bytes=120 * MIB,
                       grow_step_bytes=BUDGET // 16, shrink_step_bytes=BUDGET // 8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("squeeze") / "model"
    # 4 layers x 32 experts of 3 x 256 x 512 bf16 = 768 KiB each: 96 MiB of experts
    make_model(path, arch="qwen3_moe", layers=4, experts=32, top_k=2, hidden=256,
               intermediate=512, routing_skew=1.0, seed=5)
    return path


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def generate(model, n: int, seed: int = 7) -> list[int]:
    sampler = Sampler(SamplingParams(temperature=0.7, seed=seed))
    seq = model.new_sequence(capacity=n + 8)
    logits = model.forward(seq, [1, 2, 3, 4])
    out = []
    for _ in range(n):
        out.append(sampler.sample(logits[-1]))
        logits = model.forward(seq, [out[-1]])
    return out


class Feed:
    """A simulated availability feed: the test sets `available`; every reading is kept."""

    def __init__(self, available: int):
        self.available = available
        self.readings = 0

    def __call__(self) -> MemoryFeed:
        self.readings += 1
        return MemoryFeed(self.available, None)


def test_the_cache_shrinks_rss_falls_and_tokens_stay(model_dir, tmp_path):
    budget = BUDGET
    reference_model, _ = open_model(model_dir, threads=1, cache_bytes=None, experts="resident")
    expected = generate(reference_model, 96)
    reference_model.close()

    model, session = open_model(model_dir, threads=1, cache_bytes=budget, state_dir=tmp_path)
    try:
        minimum = minimum_cache_bytes(model.layout, model.config)
        feed = Feed(available=8 * GIB)
        watcher = MemoryWatcher(session, budget, minimum, run_on_engine=lambda fn: fn(),
                                feed=feed, policy=POLICY)
        assert generate(model, 96) == expected             # every slot has been filled
        assert watcher.check() is None                     # plenty available: no change
        before = rss_bytes()

        feed.available = 60 * MIB                          # the machine needs memory back
        shrunk = watcher.check()
        slot = session.provider.slot_bytes
        assert shrunk == (budget - 50 * MIB) // slot * slot
        assert session.options.cache_bytes == shrunk >= minimum
        after = rss_bytes()
        assert before - after >= (budget - shrunk) // 2, (before, after, budget, shrunk)
        assert generate(model, 96) == expected             # requests go on, same tokens

        feed.available = 8 * GIB                           # memory returns: slowly
        sizes = [session.options.cache_bytes]
        for _ in range(40):
            watcher.check()
            sizes.append(session.options.cache_bytes)
        assert sizes[1] == sizes[0]                        # not at the first calm reading
        assert sizes[-1] == budget // slot * slot          # back to the configured budget
        steps = [b - a for a, b in zip(sizes, sizes[1:]) if b != a]
        assert len(steps) >= 2 and max(steps) <= budget // 16 + session.provider.slot_bytes
        assert generate(model, 96) == expected
        assert (watcher.shrinks, watcher.grows) == (1, len(steps))
    finally:
        model.close()


def test_the_pins_go_last(model_dir, tmp_path):
    # learn usage first, so the second session starts with pins
    model, session = open_model(model_dir, threads=1, cache_bytes=BUDGET, state_dir=tmp_path)
    generate(model, 64)
    session.flush()
    model.close()
    model, session = open_model(model_dir, threads=1, cache_bytes=BUDGET, state_dir=tmp_path)
    try:
        minimum = minimum_cache_bytes(model.layout, model.config)
        session.rebuild(pinned_slots=12)          # as if the learner had kept 12 pins
        pinned = session.provider.cache.pinned_slots
        assert pinned == 12 and len(session.provider.cache.pins) == 12
        feed = Feed(available=8 * GIB)
        watcher = MemoryWatcher(session, BUDGET, minimum, run_on_engine=lambda fn: fn(),
                                feed=feed, policy=POLICY)
        feed.available = 95 * MIB               # cut 15 MiB: the dynamic tier absorbs it
        watcher.check()
        assert session.options.cache_bytes < BUDGET
        assert session.provider.cache.pinned_slots == pinned
        feed.available = 0                      # squeezed to the floor: no room for pins
        watcher.check()
        assert session.options.cache_bytes == minimum
        assert session.provider.cache.pinned_slots == 0
        feed.available = 8 * GIB                # memory returns: the pins come back too
        for _ in range(60):
            watcher.check()
        slot = session.provider.slot_bytes
        assert session.options.cache_bytes == BUDGET // slot * slot
        assert session.provider.cache.pinned_slots == pinned
    finally:
        model.close()


def test_pressure_is_read_where_the_kernel_has_it(tmp_path):
    (tmp_path / "proc" / "pressure").mkdir(parents=True)
    (tmp_path / "proc" / "pressure" / "memory").write_text(
        "some avg10=12.50 avg60=3.00 avg300=1.00 total=123\nfull avg10=1.00 avg60=0 avg300=0 total=5\n")
    assert read_memory_pressure(tmp_path) == 12.5
    (tmp_path / "proc" / "pressure" / "memory").write_text("garbage\n")
    assert read_memory_pressure(tmp_path) is None
    assert read_memory_pressure(tmp_path / "nowhere") is None


class FakeSession:
    """What MemoryWatcher touches of an ExpertSession: the budget, pins and rebuild."""

    class _Options:
        def __init__(self, cache_bytes):
            self.cache_bytes, self.pin_fraction = cache_bytes, 0.0

    def __init__(self, cache_bytes: int, slot: int):
        self.options = self._Options(cache_bytes)
        cache = type("Cache", (), {"pinned_slots": 0})()
        self.provider = type("Provider", (), {"slot_bytes": slot, "cache": cache})()

    def rebuild(self, cache_bytes, pinned_slots):
        self.options.cache_bytes = cache_bytes


def test_the_prefix_cache_gives_way_first_and_grows_back_last():
    """A shrink comes off the prefix cache's capacity first (its blocks are evicted); only
    what it did not hold comes off the expert cache; back to calm, the expert cache grows
    back to its budget before the prefix cache does."""
    from daemon.engine.prefix_cache import PrefixCache
    from ext.models.kvcache import KVCache

    prefix = PrefixCache(kv_bytes_per_token=64 * 1024, capacity_bytes=32 * MIB)   # 1 MiB blocks
    kv = KVCache([(((1, 64),) * 2)] * 128, 16 * 32, 16 * 32)   # 128 layers x K, V of 64 floats
    assert kv.shapes and prefix.block_bytes == MIB
    tokens = list(range(16 * 32))
    kv.length = len(tokens)
    assert prefix.store(tokens, kv) == 32                       # 32 MiB held: all it may
    session = FakeSession(BUDGET, MIB)
    feed = Feed(available=8 * GIB)
    watcher = MemoryWatcher(session, BUDGET, 8 * MIB, run_on_engine=lambda fn: fn(), feed=feed,
                            policy=POLICY, prefix_cache=prefix)
    assert watcher.check() is None
    feed.available = 90 * MIB                  # 10 short of low water: cut 10 + 10 MiB
    assert watcher.check() is None             # the prefix cache covered it
    assert (prefix.capacity_bytes, prefix.stats().bytes) == (12 * MIB, 12 * MIB)
    assert session.options.cache_bytes == BUDGET
    feed.available = 80 * MIB                  # cut 30 MiB: 12 from the prefix, 18 from experts
    assert watcher.check() == BUDGET - 18 * MIB
    assert prefix.capacity_bytes == 0 and (watcher.prefix_shrinks, watcher.shrinks) == (2, 1)
    feed.available = 8 * GIB
    sizes = []
    for _ in range(30):
        watcher.check()
        sizes.append((session.options.cache_bytes, prefix.capacity_bytes))
    grown = [i for i, (_, capacity) in enumerate(sizes) if capacity > 0]
    assert grown and sizes[grown[0]][0] == BUDGET     # the experts were back first
    assert sizes[-1] == (BUDGET, 32 * MIB)
    assert watcher.report()["prefix_cache"]["maximum_bytes"] == 32 * MIB
