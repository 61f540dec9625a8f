"""The streaming provider's learning at work: pins from the first session, the referee's
decisions applied live (and undone), learned state kept across sessions, and output
unchanged throughout."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from daemon.store import adaptive
from daemon.store.plans import plans_for
from daemon.store.state import StateStore
from daemon.store.streaming import (StreamingExpertProvider, StreamingOptions, flush_usage,
                                    load_usage_state)
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from ext.models.model import Model
from scheduler import referee

LAYERS, EXPERTS, TOP_K = 3, 16, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("adapt") / "m", arch="qwen3_moe", layers=LAYERS,
                      experts=EXPERTS, top_k=TOP_K, hidden=64, intermediate=32, dtype="bf16",
                      seed=5, initializer_range=0.2)


def _provider(model_dir, slots, counts=None, learned=None, **options):
    config = load_config(model_dir)
    layout = ExpertLayout(Checkpoint(model_dir), config)
    slot = max(p.slot_bytes for p in plans_for(layout).values())
    return StreamingExpertProvider(layout, config, StreamingOptions(cache_bytes=slots * slot, **options),
                                   usage_counts=counts, learned=learned)


def _decode_step(provider, routing, hint_for=None):
    """One decode step driven as the model drives it: routing [layer] -> experts."""
    provider.phase = "decode"
    provider.begin_step(1)
    for layer, experts in enumerate(routing):
        if hint_for is not None and provider.wants_hints:
            provider.hint(layer, hint_for(layer), 0)
        provider.observe_routing(layer, np.asarray([experts], np.int32))
        provider.acquire(layer, experts)
        provider.release(layer, experts)


def _periodic(rng, t, hot):
    """Each layer: one expert of `hot` in turn, plus one from the cold rest."""
    cold = [e for e in range(EXPERTS) if e not in hot]
    return [[hot[t % len(hot)], int(rng.choice(cold))] for _ in range(LAYERS)]


def test_a_first_session_pins_its_recurring_experts_within_a_few_hundred_tokens(model_dir):
    """No saved usage: the pinned tier starts empty and fills as the learner validates it."""
    rng = np.random.default_rng(0)
    # Steps here cost no compute, so any learning exceeds a share of their time: no budget.
    # LRU in force throughout: whether the referee keeps the predictive policy (which
    # learns this period too, leaving pins less to win) depends on its measured cost.
    provider = _provider(model_dir, slots=12, prefetch=False, learner_time_share=float("inf"),
                         policy="lru")
    try:
        assert provider.cache.pinned_slots == 0
        hot = [0, 1, 2, 3, 4]                        # each returns every 5 steps: LRU of 4 loses it
        pinned_at = None
        for t in range(320):
            _decode_step(provider, _periodic(rng, t, hot))
            if pinned_at is None and provider.cache.pins:
                pinned_at = t
        assert pinned_at is not None and pinned_at <= 200
        assert provider.cache.pinned_slots >= 3
        assert {e for _, e in provider.cache.pins} <= set(hot)
        learned = provider.learned_state()
        assert learned["pin_share"] > 0 and learned["pin_source"] in ("long", "recent")
        report = provider.adaptation.report()
        assert report["against_naive"]["hit_rate"] > report["against_naive"]["naive_hit_rate"]
    finally:
        provider.close()


class _SteppedClock:
    """A clock that moves 1 us at every read, and `step_s` more at each `step()` (called
    before each decode step): steps that look like real compute."""

    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now

    def step(self) -> None:
        self.now += self.step_s


@pytest.mark.parametrize("step_s, evaluates", [(0.0, False), (0.05, True)])
def test_the_pin_learner_keeps_to_its_share_of_the_decode_time(model_dir, step_s, evaluates):
    """Its evaluation (estimated before the first) waits until it fits in
    learner_time_share of the decode time so far: with steps of no compute it never
    runs; with 50 ms steps it runs when due (64 tokens of routing)."""
    clock = _SteppedClock(step_s)
    config = load_config(model_dir)
    layout = ExpertLayout(Checkpoint(model_dir), config)
    slot = max(p.slot_bytes for p in plans_for(layout).values())
    provider = StreamingExpertProvider(layout, config, StreamingOptions(cache_bytes=12 * slot, prefetch=False),
                                       clock=clock)
    rng = np.random.default_rng(0)
    try:
        for t in range(160):
            clock.step()
            _decode_step(provider, _periodic(rng, t, [0, 1, 2, 3, 4]))
        pins = provider.adaptation.report()["pin_learning"]
        assert pins["time_budget"] == StreamingOptions.learner_time_share
        assert (pins["evaluations"] > 0) == evaluates
        assert (pins["over_budget_steps"] > 0) != evaluates
        assert pins["time_share"] <= StreamingOptions.learner_time_share or not evaluates
    finally:
        provider.close()


def _first_session(model_dir, tmp_path, seed: int, steps: int, policy: str = "lru"):
    """(state store, fingerprint, provider) after `steps` periodic decode steps."""
    fingerprint = Checkpoint(model_dir).fingerprint()
    store = StateStore(tmp_path, fingerprint)
    rng = np.random.default_rng(seed)
    # LRU in force (as in the first-session test above): the learner's verdict on these
    # periods must not hang on whether the referee keeps predictive, which learns them too.
    first = _provider(model_dir, slots=12, prefetch=False, learner_time_share=float("inf"), policy=policy)
    for t in range(steps):
        _decode_step(first, _periodic(rng, t, [0, 1, 2, 3, 4]))
    return store, fingerprint, first


def test_the_learned_share_is_saved_with_the_usage_and_a_second_session_starts_pinned(model_dir, tmp_path):
    store, fingerprint, first = _first_session(model_dir, tmp_path, 1, 320)
    share = first.learned_state()["pin_share"]
    flush_usage(store, first.usage, fingerprint, first.learned_state())
    first.close()
    counts, learned = load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, 2048.0)
    assert learned["pin_share"] == share > 0
    second = _provider(model_dir, slots=12, counts=counts, learned=learned, prefetch=False)
    try:
        assert second.cache.pinned_slots > 0 and len(second.cache.pins) == second.cache.pinned_slots
    finally:
        second.close()
    # without usage counts a saved share is not used: there is nothing to pin from
    third = _provider(model_dir, slots=12, learned=learned, prefetch=False)
    assert third.cache.pinned_slots == 0
    third.close()


def test_the_referee_turns_off_guesses_that_never_pay_and_probes_them_again(model_dir, monkeypatch):
    """Every guess names experts the step will not use: prefetch saves nothing and costs
    its time, so it is turned off — its staging slots go back to the layers — and after
    the back-off it is probed, with staging restored. (Policy LRU: no policy probe
    takes the probing turn meanwhile.)"""
    monkeypatch.setattr(adaptive, "WINDOW_STEPS", 4)
    rng = np.random.default_rng(2)
    provider = _provider(model_dir, slots=14, idle_prefetch_min_precision=1.0,
                         prefetch_min_precision=0.0, policy="lru")
    try:
        staging = provider.cache.staging_slots
        assert staging == 1 and provider.wants_hints

        def wrong_guess(layer):                       # high scores only for experts 12..15
            logits = np.zeros((1, EXPERTS), np.float32)
            logits[0, 12:] = 10.0
            return logits
        routing = lambda: [[int(e) for e in rng.choice(12, TOP_K, replace=False)] for _ in range(LAYERS)]
        steps = 0
        while provider.wants_hints and steps < 64:
            _decode_step(provider, routing(), wrong_guess)
            steps += 1
        assert not provider.wants_hints and steps <= 4 * (referee.PATIENCE + 1)
        assert provider.cache.staging_slots == 0
        assert sum(provider.cache.dynamic_slots(l) for l in range(LAYERS)) == 14 - provider.cache.pinned_slots
        decisions = provider.adaptation.report()["referee"]["recent_decisions"]
        assert {"mechanism": "prefetch", "on": False} in [
            {k: d[k] for k in ("mechanism", "on")} for d in decisions]
        backoff = provider.adaptation.referee.states["prefetch"].backoff   # windows, loss-scaled
        assert referee.BACKOFF_START <= backoff <= referee.BACKOFF_MAX
        for _ in range(4 * (backoff + 1)):
            _decode_step(provider, routing(), wrong_guess)
            if provider.wants_hints:
                break
        assert provider.wants_hints and provider.cache.staging_slots == staging   # the probe
    finally:
        provider.close()


def _run(model, prompt, steps):
    seq = model.new_sequence()
    logits = model.forward(seq, prompt)
    out = [logits]
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits = model.forward(seq, [tokens[-1]])
        out.append(logits)
    return tokens, out


def test_tokens_and_logits_identical_while_mechanisms_switch_every_window(model_dir, monkeypatch):
    """Windows of one step, no patience and no back-off: prefetch, staging, the second
    guess and the policy flip on and off between steps, pins are learned and re-tiered —
    and every logit equals the memory-mapped reference's."""
    monkeypatch.setattr(adaptive, "WINDOW_STEPS", 1)
    monkeypatch.setattr(referee, "PATIENCE", 1)
    monkeypatch.setattr(referee, "BACKOFF_START", 1)
    monkeypatch.setattr(referee, "PROBE_WINDOWS", 1)
    monkeypatch.setattr(referee, "PROBE_BUDGET", float("inf"))     # no loss-scaled back-off
    monkeypatch.setattr(referee, "WARMUP_WINDOWS", 0)
    monkeypatch.setattr(referee, "TOLERANCE", -1.0)     # every mechanism "pays" too little...
    prompt = [3, 9, 27, 81, 243, 100, 7, 1, 2, 3] * 4
    want = _run(Model.load(model_dir, n_threads=2), prompt, 40)
    config = load_config(model_dir)
    checkpoint = Checkpoint(model_dir)
    layout = ExpertLayout(checkpoint, config)
    slot = max(p.slot_bytes for p in plans_for(layout).values())
    provider = StreamingExpertProvider(layout, config, StreamingOptions(cache_bytes=14 * slot,
                                                                        prefetch_min_precision=0.0))
    provider.adaptation.learner.window_tokens = 4
    model = Model(config, checkpoint, layout, provider, 2)
    got = _run(model, prompt, 40)
    assert got[0] == want[0]
    assert all(np.array_equal(a, b) for a, b in zip(got[1], want[1]))
    assert sum(provider.adaptation.decision_counts().values()) >= 4
    model.close()


def test_the_policy_s_next_step_statistics_are_saved_and_seed_the_next_session(model_dir, tmp_path):
    """What the predictive policy learned of which expert follows which goes into the
    state file with the usage counts, and the next session's policies start from it;
    a reset forgets it."""
    store, fingerprint, first = _first_session(model_dir, tmp_path, 3, 64, policy="default")
    exported = first.cache.transitions()
    assert all(n.sum() > 0 for _, n in exported)
    flush_usage(store, first.usage, fingerprint, first.learned_state())
    first.close()
    counts, learned = load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, 2048.0)
    assert learned["transitions"]["encoding"] == "u8-rows-base64"
    second = _provider(model_dir, slots=12, counts=counts, learned=learned, prefetch=False)
    try:
        for (t1, n1), (t2, n2) in zip(exported, second.cache.transitions()):
            np.testing.assert_allclose(n2, n1, atol=1e-3)
            p1, p2 = (t / np.where(n > 0, n, 1)[:, None] for t, n in ((t1, n1), (t2, n2)))
            np.testing.assert_allclose(p2, p1, atol=0.5 / 255 + 1e-6)
        second.reset_learning()
        assert "transitions" not in second.learned_state()
    finally:
        second.close()


def test_a_probe_not_yet_judged_is_saved_as_the_state_before_it(model_dir):
    provider = _provider(model_dir, slots=14, prefetch=False)
    try:
        referee_ = provider.adaptation.referee
        referee_.set_states({"policy": False})
        referee_._turn("policy", True, "probe")
        referee_.states["policy"].probing = referee.PROBE_WINDOWS
        assert referee_.is_on("policy")
        assert provider.learned_state()["mechanisms"]["policy"] is False
        referee_.states["policy"].probing = 0                    # judged, and it paid
        assert provider.learned_state()["mechanisms"]["policy"] is True
    finally:
        provider.close()


def test_a_window_carries_a_reads_service_time_and_the_io_workers_busy_share(model_dir, monkeypatch):
    """The referee prices an unused read's device time from the io pool's own totals: the
    mean service time of this window's reads and the share of the workers' time spent
    reading (scheduler.referee)."""
    monkeypatch.setattr(adaptive, "WINDOW_STEPS", 4)
    rng = np.random.default_rng(3)
    provider = _provider(model_dir, slots=14, prefetch=False)
    try:
        for _ in range(12):
            _decode_step(provider, [[int(e) for e in rng.choice(EXPERTS, TOP_K, replace=False)]
                                    for _ in range(LAYERS)])
        verdict = provider.adaptation.referee.verdict
        stats = provider.io.stats()
        assert verdict.windows >= 2
        assert verdict.read_s is not None and 0.0 < verdict.read_s <= stats.read_seconds_total
        assert verdict.io_busy is not None and 0.0 < verdict.io_busy <= 1.0
    finally:
        provider.close()


def test_time_between_steps_counts_in_no_window(model_dir, monkeypatch):
    """With step_ends (what the model calls once a step's layers ran), a pause between
    steps — a daemon idle between requests — adds neither to a window's time nor to the
    io workers' capacity the busy share is taken over."""
    monkeypatch.setattr(adaptive, "WINDOW_STEPS", 4)
    rng = np.random.default_rng(4)
    now = [0.0]
    provider = _provider(model_dir, slots=14, prefetch=False)
    try:
        provider.adaptation.clock = lambda: now[0]
        windows = []
        real_close = provider.adaptation._close_window

        def close():
            windows.append(provider.adaptation._tally.wall_s)
            return real_close()
        provider.adaptation._close_window = close
        for _ in range(12):
            _decode_step(provider, [[int(e) for e in rng.choice(EXPERTS, TOP_K, replace=False)]
                                    for _ in range(LAYERS)])
            now[0] += 0.01                        # the step's own time
            provider.end_step()
            now[0] += 5.0                         # idle until the next request
        assert windows and all(w == pytest.approx(0.01 * 4) for w in windows[1:])
        assert windows[0] == pytest.approx(0.01 * min(4, adaptive.FIRST_WINDOW_STEPS))
        assert provider.adaptation.decode_wall_s == pytest.approx(0.01 * 12)
    finally:
        provider.close()


def test_the_pin_learner_time_after_a_decode_step_counts_in_its_window(model_dir, monkeypatch):
    """The learner observes a step's routing once its layers ran (at the next step's
    begin): that time is moed's, so it counts in the window's time as well as in
    learner_s (which the naive estimate takes out again); after a prefill step it counts
    in neither, as the step itself does not."""
    monkeypatch.setattr(adaptive, "WINDOW_STEPS", 4)
    rng = np.random.default_rng(5)
    now = [0.0]
    provider = _provider(model_dir, slots=14, prefetch=False)
    try:
        a = provider.adaptation
        assert a.learner is not None
        a.clock = lambda: now[0]
        real_observe = a.learner.observe

        def observe(row):
            now[0] += 0.002                       # the learner's time per row
            return real_observe(row)
        a.learner.observe = observe
        monkeypatch.setattr(a, "pin_decision_due", lambda: False)
        tallies = []
        real_close = a._close_window

        def close():
            tallies.append((a._tally.steps, a._tally.wall_s, a._tally.learner_s))
            return real_close()
        a._close_window = close

        def routing():
            return [[int(e) for e in rng.choice(EXPERTS, TOP_K, replace=False)] for _ in range(LAYERS)]
        provider.phase = "prefill"                # a 3-row prefill step first
        provider.begin_step(3)
        for layer in range(LAYERS):
            ids = np.asarray([rng.choice(EXPERTS, TOP_K, replace=False)] * 3, np.int32)   # 3 rows, one set
            provider.observe_routing(layer, ids)
            experts = sorted({int(e) for e in ids.ravel()})
            provider.acquire(layer, experts)
            provider.release(layer, experts)
        now[0] += 0.05
        provider.end_step()
        for _ in range(13):
            _decode_step(provider, routing())
            now[0] += 0.01                        # the step's own time
            provider.end_step()
        assert len(tallies) >= 2
        for steps, wall, learner in tallies:
            assert learner == pytest.approx(0.002 * steps)
            assert wall == pytest.approx(0.012 * steps)
        assert a.decode_wall_s == pytest.approx(0.01 * 13 + 0.002 * 12)   # the 13th step's is to come
        assert a.learner_spent_s == pytest.approx(0.002 * (3 + 12))
    finally:
        provider.close()


def test_a_session_that_does_not_manage_a_mechanism_keeps_what_an_earlier_one_saved(model_dir):
    """A --no-prefetch session (prefetch not managed) saves the earlier session's prefetch
    state and back-off as they were, so the next session with prefetch does not start over."""
    learned = {"mechanisms": {"prefetch": False, "idle_prefetch": False, "policy": True},
               "mechanism_backoff": {"prefetch": 64, "idle_prefetch": 32, "policy": 4}}
    provider = _provider(model_dir, slots=14, prefetch=False, learned=learned)
    try:
        saved = provider.learned_state()
        assert saved["mechanisms"]["prefetch"] is False and saved["mechanism_backoff"]["prefetch"] == 64
        assert saved["mechanisms"]["idle_prefetch"] is False and saved["mechanism_backoff"]["idle_prefetch"] == 32
        assert saved["mechanisms"]["policy"] is True      # managed here: this session's
    finally:
        provider.close()
    again = _provider(model_dir, slots=14, learned=saved)
    try:
        states = again.adaptation.referee.states
        assert not states["prefetch"].on and states["prefetch"].backoff == 64
    finally:
        again.close()
    # Without a referee nothing is managed: everything saved carries over.
    plain = _provider(model_dir, slots=14, referee=False, learned=learned)
    try:
        assert plain.learned_state()["mechanism_backoff"] == learned["mechanism_backoff"]
    finally:
        plain.close()


def _warm_started(model_dir):
    """A provider whose earlier session used experts 3 and 7 of every layer (warm-started
    with them), nothing pinned, no prefetch."""
    counts = np.zeros((LAYERS, EXPERTS))
    counts[:, [3, 7]] = [5.0, 9.0]
    return _provider(model_dir, slots=4 * LAYERS, counts=counts, prefetch=False, learn_pins=False,
                     pin_fraction=0.0)


def test_the_policy_s_lru_yardstick_starts_from_the_warm_start_and_naive_starts_cold(model_dir):
    """A warm-started cache holds the experts an earlier session used most before its
    first step: LRU over moed's tiers (what the eviction policy is credited against)
    holds them too, so the policy is not credited with the misses the warm start
    avoided; the naive cache, like the naive mode, starts empty."""
    p = _warm_started(model_dir)
    try:
        a = p.adaptation
        assert p.warm_loads == 2 * LAYERS and a.lru_pins is not None
        _decode_step(p, [[3, 7]] * LAYERS)
        assert a.totals["naive_misses"] == 2 * LAYERS          # cold: every expert a miss
        assert a.totals["lru_pins_misses"] == 0                # warm, as the real cache was
    finally:
        p.close()
    cold = _provider(model_dir, slots=4 * LAYERS, counts=None, prefetch=False, learn_pins=False,
                     pin_fraction=0.0)
    try:
        assert cold.warm_loads == 0 and cold.adaptation.lru_pins is None   # nothing to differ
    finally:
        cold.close()


def test_the_warm_yardstick_is_dropped_once_it_misses_as_the_naive_cache_does(model_dir):
    """Nothing pinned: once LRU over moed's tiers has forgotten the warm start (each
    layer saw its capacity of distinct experts since), it is the naive cache again and
    one replay stands for both; the misses counted stay those of two replays."""
    p = _warm_started(model_dir)
    try:
        a = p.adaptation
        assert a.lru_pins is not None
        twin = a.lru_pins.copy()
        rng = np.random.default_rng(1)
        merged_at = None
        naive_total = pins_total = 0
        for step in range(200):
            routing = [sorted(rng.choice(EXPERTS, TOP_K, replace=False).tolist()) for _ in range(LAYERS)]
            _decode_step(p, routing)
            for li, experts in enumerate(routing):
                pins_total += twin.access(li, experts)       # what lru_pins would have missed
            naive_total = a.totals["naive_misses"]
            if merged_at is None and a.lru_pins is None:
                merged_at = step
        assert merged_at is not None and merged_at < 100
        assert a.totals["lru_pins_misses"] == pins_total    # merged without changing a count
        assert pins_total < naive_total                     # the warm start did save misses
    finally:
        p.close()
