"""scheduler/planner.py: the tightest bound, and the split of the budget."""
from __future__ import annotations

import pytest

from scheduler.planner import CgroupLimit, MemoryPlanError, available_bytes, plan_memory

GiB = 2**30
MiB = 2**20


def cgroup(limit, usage=0, inactive_file=0):
    return CgroupLimit("/fake", 2, limit, usage, inactive_file)


def test_available_is_the_tightest_bound():
    assert available_bytes(10 * GiB, [], None) == 10 * GiB
    assert available_bytes(10 * GiB, [], 3 * GiB) == 3 * GiB
    assert available_bytes(10 * GiB, [cgroup(8 * GiB, 2 * GiB)], None) == 6 * GiB
    # nested: the parent's headroom is the tighter one
    assert available_bytes(10 * GiB, [cgroup(8 * GiB, GiB), cgroup(4 * GiB, 3 * GiB)], None) == GiB
    assert available_bytes(GiB // 2, [cgroup(8 * GiB)], 3 * GiB) == GiB // 2


def test_available_nets_out_reclaimable_page_cache():
    assert available_bytes(10 * GiB, [cgroup(8 * GiB, 7 * GiB, 5 * GiB)], None) == 6 * GiB
    # inactive_file never counts for more than the usage it is part of
    assert available_bytes(10 * GiB, [cgroup(8 * GiB, GiB, 3 * GiB)], None) == 8 * GiB


def test_available_never_negative_and_unlimited_or_unknown_ignored():
    assert cgroup(GiB, 2 * GiB).headroom_bytes() == 0
    assert available_bytes(10 * GiB, [cgroup(GiB, 2 * GiB)], None) == 0
    assert available_bytes(10 * GiB, [cgroup(None, 50 * GiB)], None) == 10 * GiB
    assert available_bytes(None, [CgroupLimit("/x", 1, 2 * GiB, None, None)], None) == 2 * GiB
    with pytest.raises(MemoryPlanError, match="no memory bound"):
        available_bytes(None, [cgroup(None)], None)


def plan(available, **overrides):
    args = dict(dense_bytes=2 * GiB, kv_bytes_per_sequence=100 * MiB, max_concurrent_sequences=4,
                runtime_bytes=300 * MiB, margin_bytes=100 * MiB, slot_bytes=10 * MiB,
                min_dynamic_slots=16, pin_fraction=0.5)
    args.update(overrides)
    return plan_memory(available, **args)


def test_plan_follows_the_formula():
    p = plan(4 * GiB)
    # 4096 - 2048 - 400 - 300 - 100 = 1248 MiB -> 124 slots of 10 MiB, half pinned
    assert (p.kv_bytes, p.margin_bytes, p.total_slots, p.pinned_slots) == (400 * MiB, 100 * MiB, 124, 62)
    assert (p.expert_cache_bytes, p.pinned_bytes, p.dynamic_bytes) == (1240 * MiB, 620 * MiB, 620 * MiB)
    assert p.available_bytes == 4 * GiB and p.dense_bytes == 2 * GiB


def test_margin_fraction_and_pins_yield_to_the_dynamic_floor():
    p = plan(4 * GiB, margin_bytes=0, margin_fraction=0.25, pin_fraction=1.0)
    # margin 1024 MiB: 4096 - 2048 - 400 - 300 - 1024 = 324 MiB -> 32 slots, 16 kept dynamic
    assert (p.margin_bytes, p.total_slots, p.pinned_slots) == (GiB, 32, 16)
    assert p.dynamic_bytes == 16 * 10 * MiB
    assert plan(4 * GiB, margin_bytes=GiB // 2, margin_fraction=0.01).margin_bytes == GiB // 2


def test_dense_part_that_does_not_fit_refuses_with_the_numbers():
    with pytest.raises(MemoryPlanError) as error:
        plan(2 * GiB)
    message = str(error.value)
    assert "dense part does not fit" in message
    for number in (2 * GiB, 400 * MiB, 300 * MiB, 100 * MiB, 2 * GiB + 800 * MiB, 800 * MiB):
        assert str(number) in message


def test_expert_cache_below_the_minimum_refuses():
    # 2048 + 400 + 300 + 100 = 2848 MiB fixed; 2848 + 150 leaves 15 slots < 16
    with pytest.raises(MemoryPlanError, match="expert cache does not fit") as error:
        plan(2848 * MiB + 150 * MiB)
    assert str(16 * 10 * MiB) in str(error.value)
    assert plan(2848 * MiB + 160 * MiB).total_slots == 16  # exactly the minimum is fine


@pytest.mark.parametrize("bad", [dict(slot_bytes=0), dict(pin_fraction=1.5),
                                 dict(dense_bytes=-1), dict(margin_fraction=1.0)])
def test_invalid_inputs(bad):
    with pytest.raises(ValueError):
        plan(4 * GiB, **bad)
