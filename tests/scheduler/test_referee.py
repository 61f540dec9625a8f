"""scheduler.referee.Referee: mechanisms valued in seconds per window, turned off when they
do not pay, probed again with a growing back-off."""
from __future__ import annotations

import dataclasses
import math

import pytest

from scheduler.referee import (BACKOFF_MAX, BACKOFF_START, FAST_LOSS, PATIENCE, PROBE_BUDGET, PROBE_WINDOWS,
                               WARMUP_WINDOWS, Referee, Window)

BASE = Window(steps=16, layer_steps=128, lookups=512, wall_s=0.16, stall_s=0.032, hint_s=0.0,
              idle_hint_s=0.0, early_hint_s=0.0, bookkeeping_s=0.0128, learner_s=0.0,
              shadow_s=0.0, misses=160, inflight_hits=0, reads=160, pin_loads=0, read_cpu_s=5e-5,
              prefetch_used=0, prefetch_wasted=0, idle_used=0, idle_wasted=0, early_used=0,
              early_wasted=0, naive_misses=240, lru_pins_misses=240, policy="predictive")
COSTS = {"lru": 1e-5, "predictive": 1e-4}


def _window(**changes):
    return dataclasses.replace(BASE, **changes)


def test_the_valuation_in_seconds():
    """miss cost = stall / misses = 0.2 ms; prefetch: 40 used guesses save 8 ms, 20 ms of
    guessing and 40 unused reads cost 22 ms; policy: 40 misses fewer than LRU over the
    same tiers (less the 40 prefetch saved... here 0) against its extra bookkeeping."""
    referee = Referee(COSTS, "predictive")
    w = _window(misses=120, stall_s=0.024, hint_s=0.02, prefetch_used=40, prefetch_wasted=40,
                lru_pins_misses=200, naive_misses=220)
    v = referee.value(w)
    assert v.miss_cost_s == pytest.approx(0.0002)
    prefetch = v.values["prefetch"]
    assert prefetch["saved"] == pytest.approx(40 * 0.0002 / 16)
    assert prefetch["cost"] == pytest.approx((0.02 + 40 * 5e-5) / 16)
    policy = v.values["policy"]
    assert policy["saved"] == pytest.approx((200 - 120 - 40) * (0.0002 + 5e-5) / 16)
    assert policy["cost"] == pytest.approx((0.0128 - 1e-5 * 128) / 16)
    assert v.values["pins"]["saved"] == pytest.approx(20 * (0.0002 + 5e-5) / 16)
    naive = (0.16 - 0.024 - 0.02 - (0.0128 - 1e-5 * 128) + 220 * 0.0002 + (220 - 160) * 5e-5)
    assert v.estimated_speedup == pytest.approx(naive / 0.16)
    assert v.naive_hit_rate == pytest.approx(1 - 220 / 512)


def test_the_slot_work_of_the_misses_a_policy_avoids_is_credited_to_it():
    """With 2 us of bookkeeping per miss, the policy's 12.8 ms over 128 layer steps and 120
    misses are 0.24 ms for its misses and a fixed 98.1 us per layer step, which smoothed
    into its calibrated 100 us gives its live figure; LRU's fixed part is a tenth of that
    (calibrated 10 us against 100 us), and LRU over the same tiers had 200 misses: the
    policy's cost is what it spent beyond LRU's fixed part and LRU's misses' part."""
    referee = Referee(COSTS, "predictive", miss_bookkeeping_s=2e-6)
    w = _window(misses=120, lru_pins_misses=200, naive_misses=240)
    v = referee.value(w)
    keep = 2.0 ** (-1.0 / 2.0)
    live = keep * 1e-4 + (1 - keep) * (0.0128 - 2e-6 * 120) / 128
    assert referee.policy_step_s["predictive"] == pytest.approx(live)
    lru_fixed = live * 1e-5 / 1e-4
    assert v.values["policy"]["cost"] == pytest.approx((0.0128 - (lru_fixed * 128 + 2e-6 * 200)) / 16)
    miss = 0.032 / 120
    naive = (0.16 - 0.032 - (0.0128 - (lru_fixed * 128 + 2e-6 * 240)) + 240 * miss + (240 - 160) * 5e-5)
    assert v.estimated_speedup == pytest.approx(naive / 0.16)
    referee.value(_window(policy="lru", misses=200, lru_pins_misses=200, bookkeeping_s=128 * 1e-5 + 200 * 2e-6))
    assert referee.policy_step_s["lru"] == pytest.approx(1e-5)   # learned net of its misses' part
    assert referee.report()["miss_bookkeeping_s"] == 2e-6


def test_an_unused_read_costs_device_time_in_proportion_to_how_busy_the_io_workers_are():
    """The same guesses (40 used, 40 unused, 3 ms reads) on an idle disk pay — an unused
    read costs its CPU only — and on a disk the workers keep busy 90 % of the time they
    cost 0.9 x 3 ms more per unused read: the referee turns prefetch off there."""
    guesses = dict(misses=120, stall_s=0.024, prefetch_used=40, prefetch_wasted=40, read_s=0.003)
    idle, busy = Referee(COSTS, "predictive"), Referee(COSTS, "predictive")
    v = idle.value(_window(io_busy=0.0, **guesses))
    assert v.values["prefetch"]["cost"] == pytest.approx(40 * 5e-5 / 16)
    assert v.values["prefetch"]["net"] > 0 and v.io_busy == 0.0
    v = busy.value(_window(io_busy=0.9, **guesses))
    assert v.values["prefetch"]["cost"] == pytest.approx(40 * (5e-5 + 0.9 * 0.003) / 16)
    assert v.values["prefetch"]["net"] < 0 and v.read_s == pytest.approx(0.003)
    assert [d.mechanism for d in Referee(COSTS, "predictive").close_window(
        _window(io_busy=0.9, **guesses))] == ["prefetch"]
    assert Referee(COSTS, "predictive").close_window(_window(io_busy=0.0, **guesses)) == []
    # Out-of-range shares are clipped; no measured reads leave the cost at CPU only.
    assert Referee(COSTS, "predictive").value(_window(io_busy=7.0, **guesses)).io_busy == 1.0
    v = Referee(COSTS, "predictive").value(_window(**{**guesses, "read_s": 0.0}, io_busy=0.9))
    assert v.values["prefetch"]["cost"] == pytest.approx(40 * 5e-5 / 16)


def test_a_small_loss_is_turned_off_then_probed_with_growing_backoff():
    """Windows of 10 ms per token: guessing costs 3.2 ms a window and saves nothing, a loss
    of 2 % of the time: above TOLERANCE, below FAST_LOSS. The first window a mechanism is
    judged in decides alone."""
    referee = Referee(COSTS, "predictive")
    losing = _window(hint_s=0.0032)
    decisions = referee.close_window(losing)
    assert [(d.mechanism, d.on) for d in decisions] == [("prefetch", False)]
    assert not referee.is_on("prefetch")
    assert referee.states["prefetch"].backoff == BACKOFF_START   # 2 x 2 % / PROBE_BUDGET = 2 < 4
    off = _window(hint_s=0.0)
    for _ in range(BACKOFF_START - 1):
        assert referee.close_window(off) == []
    probe = referee.close_window(off)
    assert [(d.mechanism, d.on, d.reason) for d in probe] == [("prefetch", True, "probe")]
    for _ in range(PROBE_WINDOWS - 1):
        assert referee.close_window(losing) == []
    assert [(d.mechanism, d.on) for d in referee.close_window(losing)] == [("prefetch", False)]
    assert referee.states["prefetch"].backoff == 2 * BACKOFF_START


def test_after_its_first_window_a_small_loss_must_last_patience_windows():
    referee = Referee(COSTS, "predictive")
    paying = _window(misses=80, stall_s=0.016, hint_s=0.002, prefetch_used=80, prefetch_wasted=4)
    assert referee.close_window(paying) == []
    losing = _window(hint_s=0.0032)
    decisions = []
    for _ in range(8):
        decisions = referee.close_window(losing)
        if decisions:
            break
    assert [(d.mechanism, d.on) for d in decisions] == [("prefetch", False)]
    assert referee.states["prefetch"].judged > PATIENCE      # smoothing, then patience


def test_a_large_loss_is_turned_off_at_once_and_probed_no_more_than_the_budget_allows():
    """A loss of 14 % of the window's time (20 ms of guesses, 60 unused reads, 2 used):
    off after one window; the next probe waits PROBE_WINDOWS x 0.14 / PROBE_BUDGET windows."""
    referee = Referee(COSTS, "predictive")
    losing = _window(hint_s=0.02, prefetch_used=2, prefetch_wasted=60)
    decisions = referee.close_window(losing)
    assert [(d.mechanism, d.on) for d in decisions] == [("prefetch", False)]
    loss = -referee.states["prefetch"].net / (BASE.wall_s / BASE.steps)
    assert loss > FAST_LOSS
    backoff = referee.states["prefetch"].backoff
    assert backoff == math.ceil(PROBE_WINDOWS * loss / PROBE_BUDGET) > 2 * BACKOFF_START
    off = _window(hint_s=0.0)
    for _ in range(backoff - 1):
        assert referee.close_window(off) == []
    assert [d.reason for d in referee.close_window(off)] == ["probe"]
    # The probe's first window loses as much again: it ends there, not after PROBE_WINDOWS.
    assert [(d.mechanism, d.on, d.reason) for d in referee.close_window(losing)] == [
        ("prefetch", False, "probe did not pay")]
    assert referee.states["prefetch"].backoff >= backoff


def test_one_mechanism_is_probed_at_a_time():
    referee = Referee(COSTS, "predictive")
    referee.set_states({"prefetch": False, "policy": False})
    reasons = []
    for _ in range(BACKOFF_START + PROBE_WINDOWS + 1):
        reasons.append([(d.mechanism, d.reason) for d in referee.close_window(_window())])
    probes = [r for r in reasons if r]
    assert probes[0] == [("prefetch", "probe")]
    assert probes[1] == [("policy", "probe")]
    first, second = (reasons.index(p) for p in probes[:2])
    assert second - first == PROBE_WINDOWS + 1        # the window after the first was judged


def test_the_policy_is_not_judged_while_the_cache_warms():
    referee = Referee(COSTS, "predictive")
    worse = _window(lru_pins_misses=100)              # LRU would have missed 60 fewer
    for _ in range(WARMUP_WINDOWS):
        assert referee.close_window(worse) == []
    assert referee.is_on("policy")
    decisions = []
    for _ in range(PATIENCE):
        decisions += referee.close_window(worse)
    assert [(d.mechanism, d.on) for d in decisions] == [("policy", False)]


def test_staging_misses_are_charged_to_prefetch_not_to_the_policy():
    """LRU over the tiers without the staging slots misses 30 more than over all of them:
    the policy is compared with the former, prefetch pays for the difference."""
    referee = Referee(COSTS, "predictive")
    w = _window(misses=120, stall_s=0.024, lru_pins_misses=170, lru_dynamic_misses=200,
                naive_misses=220, prefetch_used=40, hint_s=0.01)
    v = referee.value(w)
    cost = 0.0002 + 5e-5
    assert v.values["policy"]["saved"] == pytest.approx((200 - 120 - 40) * cost / 16)
    assert v.values["prefetch"]["cost"] == pytest.approx((0.01 + 30 * cost) / 16)


def test_a_probe_that_pays_keeps_the_mechanism_on():
    referee = Referee(COSTS, "predictive")
    referee.set_states({"prefetch": False})
    for _ in range(BACKOFF_START):
        referee.close_window(_window())
    assert referee.is_on("prefetch")
    paying = _window(misses=80, stall_s=0.016, hint_s=0.002, prefetch_used=80, prefetch_wasted=4)
    for _ in range(PROBE_WINDOWS + 3):
        assert referee.close_window(paying) == []
    assert referee.is_on("prefetch") and referee.states["prefetch"].net > 0


def test_a_policy_that_costs_more_than_it_saves_steps_down_the_ladder_to_lrfu_then_lru():
    """The configured policy, then lrfu, then LRU: each judged against LRU over the same
    tiers once it has been in force WARMUP_WINDOWS windows."""
    costs = {**COSTS, "lrfu": 3e-5}
    referee = Referee(costs, "predictive")
    expensive = _window(bookkeeping_s=0.05, lru_pins_misses=161)
    for _ in range(WARMUP_WINDOWS):
        assert referee.close_window(expensive) == []
    decisions = referee.close_window(expensive)       # a loss of 30 %: off at once
    assert [(d.mechanism, d.on) for d in decisions] == [("policy", False)]
    assert referee.policy == "lrfu"
    assert referee.policy_step_s["predictive"] > COSTS["predictive"]    # measured live
    fallback = _window(policy="lrfu", bookkeeping_s=0.03, lru_pins_misses=161)
    for _ in range(WARMUP_WINDOWS):                   # lrfu just came into force
        assert referee.close_window(fallback) == []
    decisions = referee.close_window(fallback)
    assert [(d.mechanism, d.on) for d in decisions] == [("lrfu", False)]
    assert referee.policy == "lru" and referee.verdict.values["lrfu"]["net"] < 0


def test_lrfu_that_pays_stays_in_force():
    referee = Referee({**COSTS, "lrfu": 3e-5}, "predictive")
    referee.set_states({"policy": False}, {"policy": BACKOFF_MAX})      # no probe of it here
    assert referee.policy == "lrfu"
    paying = _window(policy="lrfu", bookkeeping_s=0.004, lru_pins_misses=200)   # 40 misses fewer
    for _ in range(WARMUP_WINDOWS + 4):
        decisions = referee.close_window(paying)
        assert all(d.mechanism != "lrfu" for d in decisions)
    assert referee.policy == "lrfu" and referee.states["lrfu"].net > 0
    assert Referee(COSTS, "lrfu").managed.isdisjoint({"lrfu"})          # lrfu configured: no fallback


def test_mechanisms_the_operator_turned_off_are_never_probed():
    referee = Referee(COSTS, "predictive", enabled=("policy",))
    for _ in range(3 * BACKOFF_START):
        assert referee.close_window(_window()) == []
    assert not referee.is_on("prefetch")
    assert referee.report()["mechanisms"]["prefetch"]["managed"] is False
    assert Referee(COSTS, "lru").policy == "lru"


def test_a_back_off_learned_earlier_delays_the_first_probe():
    """A mechanism an earlier session turned off, with the back-off it had reached, is
    not probed before that many windows (clipped to [BACKOFF_START, BACKOFF_MAX])."""
    first = Referee(COSTS, "predictive")
    first.close_window(_window(hint_s=0.02, prefetch_used=2, prefetch_wasted=60))
    saved = first.backoffs()
    assert not first.is_on("prefetch") and saved["prefetch"] > BACKOFF_START
    second = Referee(COSTS, "predictive")
    second.set_states({"prefetch": False}, saved)
    windows = 0
    while not second.is_on("prefetch"):
        second.close_window(_window())
        windows += 1
    assert windows == saved["prefetch"]
    third = Referee(COSTS, "predictive")
    third.set_states({"prefetch": False}, {"prefetch": 10 ** 6, "unknown": 3})
    assert third.states["prefetch"].backoff == BACKOFF_MAX


def test_a_policy_s_probe_budget_counts_the_windows_it_runs_unjudged():
    """A policy probed again runs WARMUP_WINDOWS windows before it is judged, then
    PROBE_WINDOWS: its back-off keeps the cost of all of them at PROBE_BUDGET."""
    referee = Referee(COSTS, "predictive")
    expensive = _window(bookkeeping_s=0.05, lru_pins_misses=161)
    for _ in range(WARMUP_WINDOWS):
        referee.close_window(expensive)
    assert [(d.mechanism, d.on) for d in referee.close_window(expensive)] == [("policy", False)]
    loss = -referee.states["policy"].net / (BASE.wall_s / BASE.steps)
    windows = PROBE_WINDOWS + WARMUP_WINDOWS
    assert referee.states["policy"].backoff == min(BACKOFF_MAX, math.ceil(windows * loss / PROBE_BUDGET))
    assert referee.states["policy"].backoff > math.ceil(PROBE_WINDOWS * loss / PROBE_BUDGET)
