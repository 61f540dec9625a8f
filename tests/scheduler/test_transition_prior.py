"""The predictive policy's next-step statistics carried from one session to the next:
the prior is mixed by how well it predicts this session, exported with what this session
learned, kept across a policy switch, and saved in the usage payload (issue 17,
"learning from the first session")."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from scheduler.cache import OUTCOME_HIT, OUTCOME_MISS, ExpertCache
from scheduler.eviction import PredictivePolicy
from scheduler.usage import (UsageFormatError, UsageStats, decode_transitions,
                             encode_transitions)

E, K = 16, 2


def markov_routing(seed: int, steps: int, shift: int) -> list[list[int]]:
    """Routing where step t+1's experts follow from step t's by a fixed random map
    (expert e -> next[e]), with a little noise: a workload whose successor statistics
    predict the next step and recency does not (the map is a permutation with no
    short cycles)."""
    rng = np.random.default_rng(seed)
    nxt = (np.arange(E) * 5 + shift) % E
    cur = [0, 7]
    out = []
    for _ in range(steps):
        out.append(sorted(set(cur)))
        cur = [int(nxt[e]) if rng.random() > 0.1 else int(rng.integers(E)) for e in cur]
        if cur[0] == cur[1]:
            cur[1] = (cur[1] + 1) % E
    return out


def drive(policy: PredictivePolicy, steps: list[list[int]], start: int = 0) -> None:
    for t, ids in enumerate(steps):
        policy.step(start + t, ids)


def hits(cache: ExpertCache, steps: list[list[int]], start: int) -> int:
    n = 0
    for t, ids in enumerate(steps):
        for a in cache.request(0, ids, start + t):
            n += a.outcome == OUTCOME_HIT
            if a.outcome == OUTCOME_MISS:
                cache.loaded(a.slot)
        cache.release(0, ids)
    return n


def test_a_prior_that_fits_keeps_its_weight_and_predicts_from_the_first_step():
    first = PredictivePolicy(E, 6)
    steps = markov_routing(0, 200, shift=3)
    drive(first, steps)
    second = PredictivePolicy(E, 6)
    second.seed_prior(*first.transitions())
    second.step(0, steps[0])
    p = second.p_next()                       # before any transition of this session
    assert set(np.argsort(-p)[:2]) == set(steps[1])
    drive(second, steps[1:100], start=1)
    assert second._prior_weight > 0.5


def test_a_prior_from_other_traffic_loses_its_weight():
    first = PredictivePolicy(E, 6)
    drive(first, markov_routing(0, 200, shift=3))
    second = PredictivePolicy(E, 6)
    second.seed_prior(*first.transitions())
    drive(second, markov_routing(1, 120, shift=8))     # another successor map
    assert second._prior_weight < 0.05
    lone = PredictivePolicy(E, 6)
    drive(lone, markov_routing(1, 120, shift=8))
    # with the prior's weight gone the prediction is (nearly) the session's own
    assert np.abs(second.p_next() - lone.p_next()).max() < 0.05


def test_transitions_export_the_session_plus_the_decayed_prior():
    a = PredictivePolicy(E, 6, transition_half_life=50.0)
    drive(a, markov_routing(0, 60, shift=3))
    t_a, n_a = a.transitions()
    assert n_a.sum() > 0 and np.all(t_a <= n_a[:, None] + 1e-9)
    b = PredictivePolicy(E, 6, transition_half_life=50.0)
    b.seed_prior(t_a, n_a)
    steps = markov_routing(2, 51, shift=3)
    drive(b, steps)                                    # tokens 0..50: the prior is 50 tokens old
    t_b, n_b = b.transitions()
    live = PredictivePolicy(E, 6, transition_half_life=50.0)
    drive(live, steps)
    t_l, n_l = live.transitions()
    np.testing.assert_allclose(n_b, n_l + 0.5 * n_a, rtol=1e-9)
    np.testing.assert_allclose(t_b, t_l + 0.5 * t_a, rtol=1e-9)
    b.forget_transitions()
    assert b.transitions()[1].sum() == 0


def successor_routing(seed: int, steps: int, map_seed: int, n_experts: int = 32) -> list[list[int]]:
    """Two chains of experts, each step's expert followed by one of two successors drawn
    once from `map_seed` (else, 1 time in 10, any expert): a workload of another map
    seed is another kind of traffic."""
    succ = np.random.default_rng(map_seed).integers(0, n_experts, (n_experts, 2))
    rng = np.random.default_rng(seed)
    cur, out = [0, 1], []
    for _ in range(steps):
        out.append(sorted(set(cur)))
        cur = [int(succ[e, rng.integers(2)]) if rng.random() > 0.1 else int(rng.integers(n_experts))
               for e in cur]
        if cur[0] == cur[1]:
            cur[1] = (cur[1] + 1) % n_experts
    return out


def test_a_seeded_cache_hits_more_on_the_same_workload_and_no_less_on_another():
    steps, other = successor_routing(0, 200, map_seed=5), successor_routing(1, 200, map_seed=6)
    first = ExpertCache([0], 32, K, 8, policy="predictive")
    cold = hits(first, steps, 0)
    second = ExpertCache([0], 32, K, 8, policy="predictive")
    assert second.seed_transitions(first.transitions())
    assert hits(second, steps, 200) >= cold + 0.015 * len(steps) * K     # measured: 213 -> 221 of 400
    fresh = hits(ExpertCache([0], 32, K, 8, policy="predictive"), other, 0)
    third = ExpertCache([0], 32, K, 8, policy="predictive")
    third.seed_transitions(first.transitions())
    assert hits(third, other, 200) >= fresh - 0.005 * len(steps) * K


def test_the_cache_holds_transitions_across_a_policy_switch():
    cache = ExpertCache([0, 1], E, K, 12, policy="predictive")
    for t, ids in enumerate(markov_routing(0, 50, shift=3)):
        for layer in (0, 1):
            for a in cache.request(layer, ids, t):
                if a.outcome == OUTCOME_MISS:
                    cache.loaded(a.slot)
            cache.release(layer, ids)
    before = cache.transitions()
    cache.set_policy("lru")
    held = cache.transitions()
    assert all(np.array_equal(h[1], b[1]) for h, b in zip(held, before))
    cache.set_policy("predictive")                     # handed back as the prior
    after = cache.transitions()
    assert all(np.allclose(x[1], b[1]) for x, b in zip(after, before))
    with pytest.raises(ValueError, match="3 layers of transitions for 2"):
        cache.seed_transitions([None] * 3)
    cache.forget_transitions()
    assert all(t[1].sum() == 0 for t in cache.transitions())


@pytest.mark.parametrize("bad, match", [
    ((np.zeros((E, E + 1)), np.zeros(E)), "shapes"),
    ((np.full((E, E), np.nan), np.ones(E)), "finite"),
    ((np.zeros((E, E)), -np.ones(E)), "finite"),
])
def test_seed_prior_refuses_bad_counts(bad, match):
    with pytest.raises(ValueError, match=match):
        PredictivePolicy(E, 6).seed_prior(*bad)


def test_the_payload_round_trip_keeps_probabilities_to_1_in_255():
    p = PredictivePolicy(E, 6)
    drive(p, markov_routing(0, 200, shift=3))
    t, n = p.transitions()
    stats = UsageStats([1, 3], E, 100.0)
    stats.learned = {"transitions": encode_transitions([(t, n), None])}
    back = UsageStats.from_dict(json.loads(json.dumps(stats.to_dict("fp"))), [1, 3], E, "fp")
    (t2, n2), none = decode_transitions(back.learned["transitions"], 2, E)
    assert none is None
    np.testing.assert_allclose(n2, n, atol=1e-4)
    prob = t / np.where(n > 0, n, 1)[:, None]
    np.testing.assert_allclose(t2 / np.where(n2 > 0, n2, 1)[:, None], prob, atol=0.5 / 255 + 1e-6)


def _payload(transitions) -> dict:
    stats = UsageStats([1, 3], E, 100.0)
    out = stats.to_dict("fp")
    out["learned"] = {"transitions": transitions}
    return out


def _good() -> dict:
    return encode_transitions([(np.eye(E), np.ones(E)), None])


@pytest.mark.parametrize("mutate, match", [
    (lambda v: {"encoding": "f32", "layers": v["layers"]}, "encoding"),
    (lambda v: {**v, "layers": v["layers"][:1]}, "expected 2 layers"),
    (lambda v: {**v, "layers": [7, None]}, r"layers\[0\].*object or null"),
    (lambda v: {**v, "layers": [{**v["layers"][0], "totals": [1.0] * (E - 1)}, None]}, r"totals"),
    (lambda v: {**v, "layers": [{**v["layers"][0], "totals": [float("nan")] * E}, None]}, r"totals"),
    (lambda v: {**v, "layers": [{**v["layers"][0], "totals": [-1.0] * E}, None]}, r"totals"),
    (lambda v: {**v, "layers": [{**v["layers"][0], "next": "***"}, None]}, r"next.*base64"),
    (lambda v: {**v, "layers": [{**v["layers"][0], "next": base64.b64encode(b"ab").decode()}, None]},
     r"next.*2 bytes"),
])
def test_a_bad_transitions_field_is_refused_naming_it(mutate, match):
    with pytest.raises(UsageFormatError, match=match) as info:
        UsageStats.from_dict(_payload(mutate(_good())), [1, 3], E, "fp")
    assert info.value.field.startswith("learned.transitions")
