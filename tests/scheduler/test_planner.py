"""scheduler/planner.py: the tightest bound, and the split of the budget."""
from __future__ import annotations

import pytest

from scheduler.planner import (CacheSqueeze, CgroupLimit, MemoryPlanError, SqueezePolicy,
                               available_bytes, default_squeeze_policy, plan_memory)

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


# ------------------------------------------------------------------- the live squeeze
MI = 1 << 20
SQUEEZE = SqueezePolicy(low_water_bytes=100 * MI, high_water_bytes=200 * MI,
                        grow_step_bytes=10 * MI, shrink_step_bytes=20 * MI, calm_readings=3)


def squeeze() -> CacheSqueeze:
    return CacheSqueeze(SQUEEZE, minimum_bytes=8 * MI, maximum_bytes=100 * MI, slot_bytes=MI)


def test_squeeze_shrinks_by_the_deficit_plus_half_the_gap():
    s = squeeze()
    assert s.target(100 * MI, 90 * MI) == 100 * MI - 10 * MI - 50 * MI
    assert s.target(100 * MI, 0) == 8 * MI                       # never below the floor
    assert s.target(8 * MI, 0) == 8 * MI


def test_squeeze_shrinks_under_pressure_even_with_memory_available():
    s = squeeze()
    assert s.target(100 * MI, 150 * MI, pressure_avg10=25.0) == 80 * MI
    assert s.target(100 * MI, 150 * MI, pressure_avg10=2.0) == 100 * MI


def test_squeeze_grows_slowly_and_only_after_calm_readings():
    s = squeeze()
    got = [s.target(50 * MI, 1000 * MI) for _ in range(3)]
    assert got == [50 * MI, 50 * MI, 60 * MI]                   # third calm reading: +10 MiB
    assert s.target(95 * MI, 1000 * MI) == 100 * MI               # capped at the budget
    s.target(50 * MI, 150 * MI)                                   # between the marks: calm reset
    assert s.target(50 * MI, 50 * MI) < 50 * MI                   # low again: shrinks at once
    assert [s.target(50 * MI, 205 * MI) for _ in range(3)][-1] == 55 * MI   # grows by the surplus


def test_squeeze_ignores_an_unknown_reading_and_refuses_bad_settings():
    assert squeeze().target(70 * MI, None) == 70 * MI
    with pytest.raises(ValueError, match="below low_water_bytes"):
        SqueezePolicy(low_water_bytes=2, high_water_bytes=1, grow_step_bytes=1, shrink_step_bytes=1)
    with pytest.raises(ValueError, match="below minimum_bytes"):
        CacheSqueeze(SQUEEZE, minimum_bytes=2, maximum_bytes=1, slot_bytes=1)
    policy = default_squeeze_policy(1 << 30, 16 << 30)
    assert policy.low_water_bytes == (16 << 30) // 20 and policy.high_water_bytes == 2 * policy.low_water_bytes
