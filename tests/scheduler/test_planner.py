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
    # KV 100 MiB a sequence: 25 KiB a token x 4096 tokens
    args = dict(dense_bytes=2 * GiB, kv_bytes_per_token=25 * 1024, max_concurrent_sequences=4,
                context_tokens=4096, runtime_bytes=300 * MiB, margin_bytes=100 * MiB,
                slot_bytes=10 * MiB, min_dynamic_slots=16, pin_fraction=0.5)
    args.update(overrides)
    return plan_memory(available, **args)


def test_plan_follows_the_formula():
    p = plan(4 * GiB)
    # 4096 - 2048 - 400 - 300 - 100 = 1248 MiB -> 124 slots of 10 MiB, half pinned
    assert (p.kv_bytes, p.margin_bytes, p.total_slots, p.pinned_slots) == (400 * MiB, 100 * MiB, 124, 62)
    assert (p.expert_cache_bytes, p.pinned_bytes, p.dynamic_bytes) == (1240 * MiB, 620 * MiB, 620 * MiB)
    assert p.available_bytes == 4 * GiB and p.dense_bytes == 2 * GiB
    assert (p.context_tokens, p.max_concurrent_sequences, p.prefix_cache_bytes) == (4096, 4, 0)
    # the minimum to start: one sequence at the 2048-token floor, the expert cache's floor
    assert p.minimum_bytes == 2048 * MiB + 300 * MiB + 100 * MiB + 50 * MiB + 160 * MiB


def test_margin_fraction_and_pins_yield_to_the_dynamic_floor():
    p = plan(4 * GiB, margin_bytes=0, margin_fraction=0.25, pin_fraction=1.0)
    # margin 1024 MiB: 4096 - 2048 - 400 - 300 - 1024 = 324 MiB -> 32 slots, 16 kept dynamic
    assert (p.margin_bytes, p.total_slots, p.pinned_slots) == (GiB, 32, 16)
    assert p.dynamic_bytes == 16 * 10 * MiB
    assert plan(4 * GiB, margin_bytes=GiB // 2, margin_fraction=0.01).margin_bytes == GiB // 2


def test_the_context_is_cut_to_what_fits_down_to_the_floor():
    # base = 2048 + 300 + 100 + 160 = 2608 MiB. 2908 MiB leave 300 MiB: 4 x 4096 tokens
    # (400 MiB) do not fit; 4 x 2048 (the floor) take 200 MiB, and the KV gets half of the
    # 100 MiB above that: 250 MiB = 4 x 2560 tokens of 25 KiB; the expert cache the rest
    p = plan(2908 * MiB)
    assert p.context_tokens == 2560 and p.kv_bytes == 250 * MiB
    assert p.total_slots == 16 + 5
    # 350 MiB: 200 + 75 MiB = 2816 tokens, a multiple of 256; 360 MiB: 2867 -> 2816
    assert plan(2958 * MiB).context_tokens == 2816
    assert plan(2968 * MiB).context_tokens == 2816
    # the whole wanted context fits: no share taken from the expert cache
    assert plan(3008 * MiB).context_tokens == 4096
    # a model whose own context is below the floor keeps it whole
    small = plan(2608 * MiB + 4 * 1000 * 25 * 1024, context_tokens=1000)
    assert small.context_tokens == 1000


def test_below_the_floor_context_the_sequences_are_cut_then_refused_if_fixed():
    at_floor = 2608 * MiB + 4 * 2048 * 25 * 1024      # 4 sequences at 2048 tokens: 200 MiB
    assert plan(at_floor).context_tokens == 2048
    # 199.99 MiB hold 3 sequences at the floor (150 MiB), and half the rest gives them
    # 2389 tokens each, cut to 2304
    p = plan(at_floor - 1)
    assert (p.max_concurrent_sequences, p.context_tokens) == (3, 2304)
    assert plan(2608 * MiB + 60 * MiB).max_concurrent_sequences == 1
    # the operator set max_concurrent_sequences: refuse, naming the key and the amount
    with pytest.raises(MemoryPlanError) as error:
        plan(at_floor - 1, sequences_fixed=True)
    message = str(error.value)
    assert "lower max_concurrent_sequences by 1, from 4 to 3" in message
    assert "1 B more than available" in message and "prefix_cache_bytes is not the cause" in message
    for number in (2 * GiB, 300 * MiB, 100 * MiB, 160 * MiB, 25 * 1024, 2048, 200 * MiB, at_floor):
        assert str(number) in message


def test_a_context_the_operator_set_is_never_cut():
    # 4 x 4096 tokens need 400 MiB; 300 MiB hold 3 such sequences, or 4 of 3072 tokens
    p = plan(2908 * MiB, context_fixed=True)
    assert (p.max_concurrent_sequences, p.context_tokens) == (3, 4096)
    with pytest.raises(MemoryPlanError) as error:
        plan(2908 * MiB, context_fixed=True, sequences_fixed=True)
    message = str(error.value)
    assert "lower max_concurrent_sequences by 1, from 4 to 3" in message
    assert "or lower max_context_tokens by 1024, from 4096 to 3072" in message


def test_below_one_sequence_at_the_floor_refuses_with_every_number():
    minimum = 2608 * MiB + 50 * MiB
    assert plan(minimum, max_concurrent_sequences=1).context_tokens == 2048
    with pytest.raises(MemoryPlanError) as error:
        plan(minimum - 4096, max_concurrent_sequences=1)
    message = str(error.value)
    assert f"needs at least {minimum} B to start" in message
    assert "4096 B more than available" in message
    # 25 KiB a token: a context below the 2048 tokens counted lowers it
    assert "no key lowers" not in message
    assert (f"max_context_tokens 1792 (the context counted: 2048 tokens) lowers it by "
            f"{256 * 25 * 1024} B, enough") in message
    assert "prefix_cache_bytes does not" in message
    for number in (2 * GiB, 300 * MiB, 100 * MiB, 160 * MiB, 16, 10 * MiB):
        assert str(number) in message


def test_the_refusal_says_no_key_lowers_it_only_when_none_does():
    """No KV (an attention-free toy) and one sequence: nothing the operator sets lowers the
    minimum. With the runtime's share per token of context and per sequence given, the
    refusal names each key with its bytes, and whether it is enough alone."""
    base = 2048 * MiB + 300 * MiB + 100 * MiB + 160 * MiB     # dense, runtime, margin, experts
    with pytest.raises(MemoryPlanError, match="no key lowers that"):
        plan(base - 4096, max_concurrent_sequences=1, kv_bytes_per_token=0)
    minimum = base + 50 * MiB                                  # and 2048 tokens of KV
    with pytest.raises(MemoryPlanError) as error:     # 1 MiB short; 4 sequences counted
        plan(minimum - MiB, runtime_bytes_per_context_token=16,
             runtime_bytes_per_sequence=MiB // 2)
    message = str(error.value)
    assert "no key lowers" not in message
    # 2048 tokens of KV at 25 KiB and 4096 of runtime at 16 B: 1 MiB is saved at 2007
    # tokens (41 x 25 KiB + 2089 x 16 B), rounded down to 1792
    assert (f"max_context_tokens 1792 lowers" in message.replace(
        " (the context counted: 2048 tokens)", ""))
    assert f"lowers it by {256 * 25 * 1024 + (4096 - 1792) * 16} B, enough" in message
    assert f"max_concurrent_sequences 1 (from 4) lowers it by {3 * MiB // 2} B, enough" in message
    with pytest.raises(MemoryPlanError) as error:     # 60 MiB short: neither alone, not both
        plan(minimum - 60 * MiB, runtime_bytes_per_sequence=MiB)
    message = str(error.value)
    assert f"lowers it by at most {2047 * 25 * 1024} B (at 1 token), " in message
    assert f"max_concurrent_sequences 1 (from 4) lowers it by {3 * MiB} B, " in message
    both = 2047 * 25 * 1024 + 3 * MiB
    assert f"both together lower it by at most {both} B, {60 * MiB - both} B short" in message


def test_the_prefix_cache_takes_a_share_of_what_is_left_never_a_refusal():
    # 4 GiB: 4096 - 2048 - 300 - 100 - 160 - 400 = 1088 MiB beyond the minimum; a quarter
    # is 272 MiB, so a 512 MiB prefix cache gets 272 MiB and the experts the rest
    p = plan(4 * GiB, prefix_cache_bytes=512 * MiB)
    assert p.prefix_cache_bytes == 272 * MiB and p.context_tokens == 4096
    assert p.total_slots == (1248 - 272) // 10
    assert plan(4 * GiB, prefix_cache_bytes=64 * MiB).prefix_cache_bytes == 64 * MiB
    # at the floor nothing is left: the prefix cache gets 0 B and the plan still starts
    at_floor = plan(2608 * MiB + 200 * MiB, prefix_cache_bytes=512 * MiB)
    assert at_floor.prefix_cache_bytes == 0 and at_floor.total_slots == 16
    # when every expert fits, the prefix cache may have what they leave over
    roomy = plan(16 * GiB, prefix_cache_bytes=512 * MiB, all_experts_bytes=320 * MiB)
    assert roomy.prefix_cache_bytes == 512 * MiB
    assert roomy.expert_cache_bytes >= 320 * MiB


def test_the_700_mib_cgroup_of_the_report():
    """The report's checkpoint: 2.2 GB of experts, 45056 B of KV a token, ~70 MB dense,
    in a 700 MiB cgroup of which the interpreter already holds ~100 MiB. The old plan
    (512 MiB runtime + 512 MiB prefix cache + 4 x 4096 tokens of KV) asked for 1.92 GB;
    now it starts: 3 sequences of 2304 tokens, the prefix cache out of what is left."""
    available = 600 * MiB
    slot = 4_329_472                                  # 3 x 1024 x 704 x 2 B, in pages
    p = plan_memory(available, dense_bytes=70_000_000, kv_bytes_per_token=45_056,
                    max_concurrent_sequences=4, context_tokens=4096,
                    runtime_bytes=40_000_000, slot_bytes=slot, min_dynamic_slots=4 * 8,
                    prefix_cache_bytes=512 * MiB, all_experts_bytes=512 * slot,
                    margin_fraction=0.05)
    # 4 sequences at the 2048-token floor (369 MB) do not fit beside the rest: 3 do, with
    # half of what is left above the floors: 2304 tokens each; the experts 38 slots
    assert (p.max_concurrent_sequences, p.context_tokens) == (3, 2304)
    assert p.kv_bytes == 3 * 2304 * 45_056
    assert p.total_slots == 38 and 0 < p.prefix_cache_bytes < 16 * MiB
    used = (p.dense_bytes + p.runtime_bytes + p.margin_bytes + p.kv_bytes + p.prefix_cache_bytes
            + p.expert_cache_bytes)
    assert available - slot < used <= available
    # the minimum to start: 70 MB + 40 MB + 31.5 MB + 138.5 MB + 2048 x 45056 B = 372 MB
    assert p.minimum_bytes == 372_275_072 < available
    # --max-concurrent-sequences 1 (the old plan still asked 828 MB): the whole context
    one = plan_memory(available, dense_bytes=70_000_000, kv_bytes_per_token=45_056,
                      max_concurrent_sequences=1, context_tokens=4096, runtime_bytes=40_000_000,
                      slot_bytes=slot, min_dynamic_slots=32, prefix_cache_bytes=512 * MiB,
                      all_experts_bytes=512 * slot, margin_fraction=0.05, sequences_fixed=True)
    assert (one.context_tokens, one.total_slots) == (4096, 60)


@pytest.mark.parametrize("bad", [dict(slot_bytes=0), dict(pin_fraction=1.5),
                                 dict(dense_bytes=-1), dict(margin_fraction=1.0),
                                 dict(max_concurrent_sequences=0), dict(context_tokens=0),
                                 dict(prefix_cache_bytes=-1)])
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
