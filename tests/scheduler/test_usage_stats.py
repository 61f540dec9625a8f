"""scheduler.usage: decay math, deltas and merging, payload validation."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from scheduler.usage import (FORMAT_VERSION, UsageFormatError, UsageStats, decay,
                             merge_counts)

LAYERS = [1, 3, 5]   # MoE layer ids (layers 0, 2, 4 dense)
E = 4


def test_a_count_halves_after_one_half_life():
    stats = UsageStats(LAYERS, E, half_life_tokens=10)
    stats.observe(3, [2])
    stats.advance(10)
    assert stats.counts()[1, 2] == pytest.approx(0.5)
    stats.advance(20)
    assert stats.counts()[1, 2] == pytest.approx(0.125)
    assert stats.counts().sum() == pytest.approx(0.125)   # nothing leaked elsewhere


def test_decay_is_per_token_and_matches_the_pure_function():
    stats = UsageStats(LAYERS, E, half_life_tokens=7)
    stats.observe(1, [0, 1], tokens=[3, 1])
    for _ in range(5):
        stats.advance(1)
    expected = decay(np.array([3.0, 1.0]), 5, 7)
    assert stats.counts()[0, :2] == pytest.approx(expected)
    assert expected[0] == pytest.approx(3 * 2 ** (-5 / 7))


def test_observe_counts_tokens_per_expert_and_repeats():
    stats = UsageStats(LAYERS, E, half_life_tokens=100)
    stats.observe(5, np.array([0, 3]), tokens=np.array([4, 2]))
    stats.observe(5, [3, 3])                      # a repeated id counts each time
    assert stats.counts()[2].tolist() == [4.0, 0.0, 0.0, 4.0]
    stats.observe(1, [1], tokens=0)
    assert stats.counts()[0].sum() == 0.0


@pytest.mark.parametrize("call, error", [
    (lambda s: s.observe(2, [0]), KeyError),                  # dense layer
    (lambda s: s.observe(1, [E]), ValueError),
    (lambda s: s.observe(1, [-1]), ValueError),
    (lambda s: s.observe(1, [0, 1], tokens=[1]), ValueError),
    (lambda s: s.observe(1, [0], tokens=[-1]), ValueError),
    (lambda s: s.observe(1, [0], tokens=-1), ValueError),
    (lambda s: s.observe(1, [0], tokens=[math.nan]), ValueError),
    (lambda s: s.advance(-1), ValueError),
])
def test_bad_observations_raise(call, error):
    stats = UsageStats(LAYERS, E, half_life_tokens=10)
    with pytest.raises(error):
        call(stats)
    assert stats.counts().sum() == 0.0


def test_a_list_of_ints_counts_exactly_as_an_array_does():
    # The decode path passes Python ints; any other form takes the array path.
    rng = np.random.default_rng(0)
    fast, general = UsageStats(LAYERS, E, half_life_tokens=9), UsageStats(LAYERS, E, half_life_tokens=9)
    for step in range(200):
        layer = LAYERS[step % 3]
        ids = rng.integers(0, E, size=rng.integers(1, 4)).tolist()     # repeats too
        fast.observe(layer, ids)
        general.observe(layer, np.array(ids), tokens=np.ones(len(ids)))
        fast.advance(1)
        general.advance(1)
    assert np.array_equal(fast.counts(), general.counts())
    assert np.array_equal(fast.take_delta()[0], general.take_delta()[0])
    assert np.array_equal(fast.layer_counts(3), fast.counts()[1])


def test_renormalisation_keeps_values_exact_over_many_half_lives():
    stats = UsageStats([0], 2, half_life_tokens=1)
    stats.observe(0, [0])
    for _ in range(300):                          # 2 ** -300: far past one renormalisation
        stats.advance(1)
        stats.observe(0, [1])
    counts = stats.counts()
    assert np.all(np.isfinite(counts))
    assert counts[0, 0] == pytest.approx(2.0 ** -300, rel=1e-9)
    assert counts[0, 1] == pytest.approx(sum(2.0 ** -k for k in range(300)), rel=1e-12)   # ~2


def test_take_delta_returns_what_was_gathered_since_the_last_take_and_resets():
    stats = UsageStats(LAYERS, E, half_life_tokens=10)
    stats.observe(1, [0], tokens=4)
    stats.advance(10)
    delta, tokens = stats.take_delta()
    assert tokens == 10 and delta[0, 0] == pytest.approx(2.0)
    stats.observe(1, [1])
    stats.advance(10)
    delta, tokens = stats.take_delta()
    assert tokens == 10
    assert delta[0].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0])   # the first count is not in it
    delta, tokens = stats.take_delta()
    assert tokens == 0 and delta.sum() == 0.0


def test_merge_with_one_process_reproduces_its_own_counts():
    """merged = decay(file, tokens) + delta: a single writer's file equals its counts()."""
    rng = np.random.default_rng(0)
    stats = UsageStats(LAYERS, E, half_life_tokens=25)
    file_counts = np.zeros((len(LAYERS), E))
    for _flush in range(4):
        for _ in range(int(rng.integers(5, 40))):
            for layer in LAYERS:
                stats.observe(layer, rng.choice(E, size=2, replace=False))
            stats.advance(1)
        delta, tokens = stats.take_delta()
        file_counts = merge_counts(file_counts, tokens, delta, 25)
        np.testing.assert_allclose(file_counts, stats.counts(), rtol=1e-12)


def test_two_processes_merge_without_counting_twice():
    h = 10.0
    a = UsageStats([0], 2, h)
    b = UsageStats([0], 2, h)
    a.observe(0, [0], tokens=8)
    b.observe(0, [1], tokens=4)
    a.advance(10)
    b.advance(10)
    file_counts = np.zeros((1, 2))
    delta, tokens = a.take_delta()                # A flushes: [4, 0]
    file_counts = merge_counts(file_counts, tokens, delta, h)
    delta, tokens = b.take_delta()                # B flushes: file decays by B's 10 tokens
    file_counts = merge_counts(file_counts, tokens, delta, h)
    assert file_counts[0].tolist() == pytest.approx([2.0, 2.0])
    delta, tokens = a.take_delta()                # A again, nothing new: only decay
    assert delta.sum() == 0.0 and tokens == 0
    assert merge_counts(file_counts, tokens, delta, h)[0].tolist() == pytest.approx([2.0, 2.0])


def test_merge_rejects_shape_mismatch_and_negative_tokens():
    with pytest.raises(ValueError, match="shape"):
        merge_counts(np.zeros((2, 3)), 1, np.zeros((3, 2)), 10)
    with pytest.raises(ValueError):
        decay(np.zeros(2), -1, 10)


def test_payload_round_trips_through_json():
    stats = UsageStats(LAYERS, E, half_life_tokens=12)
    stats.observe(3, [1, 2], tokens=[5, 1])
    stats.advance(6)
    payload = json.loads(json.dumps(stats.to_dict(fingerprint="abc")))
    assert payload["version"] == FORMAT_VERSION and payload["moe_layers"] == LAYERS
    loaded = UsageStats.from_dict(payload, moe_layers=LAYERS, num_experts=E, fingerprint="abc")
    np.testing.assert_allclose(loaded.counts(), stats.counts())
    assert loaded.half_life_tokens == 12 and loaded.tokens_observed == 6
    assert loaded.take_delta()[0].sum() == 0.0      # loaded counts are not a new delta


def _payload(**changes):
    stats = UsageStats(LAYERS, E, half_life_tokens=12)
    stats.observe(1, [0])
    payload = stats.to_dict(fingerprint="abc")
    payload.update(changes)
    return payload


@pytest.mark.parametrize("payload, field", [
    ([1, 2], "<root>"),
    (_payload(format="other"), "format"),
    (_payload(version=2), "version"),
    (_payload(version=True), "version"),
    (_payload(fingerprint="xyz"), "fingerprint"),
    (_payload(moe_layers=[1, 3, 7]), "moe_layers"),      # unknown layer 7
    (_payload(moe_layers=[1, 3]), "moe_layers"),         # layer 5 missing
    (_payload(moe_layers="1,3,5"), "moe_layers"),
    (_payload(num_experts=5), "num_experts"),
    (_payload(half_life_tokens=0), "half_life_tokens"),
    (_payload(tokens_observed=-3), "tokens_observed"),
    (_payload(counts=[[0.0] * E] * 2), "counts"),        # wrong shape
    (_payload(counts=[[0.0] * E, [math.nan] + [0.0] * (E - 1), [0.0] * E]), "counts"),
    (_payload(counts=[[0.0] * E, [-1.0] + [0.0] * (E - 1), [0.0] * E]), "counts"),
    (_payload(counts=[["a"] * E] * 3), "counts"),
    (_payload(counts=[["1"] * E] * 3), "counts"),                  # numpy would parse these
    (_payload(counts=[[10 ** 400] * E] * 3), "counts"),            # JSON integer beyond a float
    (_payload(half_life_tokens=10 ** 400), "half_life_tokens"),
    (_payload(learned={"pin_share": 10 ** 400}), "learned.pin_share"),
    (_payload(learned={"mechanism_backoff": {"prefetch": 0}}), "learned.mechanism_backoff"),
    (_payload(learned={"mechanism_backoff": {"prefetch": 10 ** 9}}), "learned.mechanism_backoff"),
    (_payload(learned={"mechanism_backoff": {"prefetch": True}}), "learned.mechanism_backoff"),
    (_payload(learned={"mechanism_backoff": [4]}), "learned.mechanism_backoff"),
])
def test_bad_payloads_name_the_field(payload, field):
    with pytest.raises(UsageFormatError) as info:
        UsageStats.from_dict(payload, moe_layers=LAYERS, num_experts=E, fingerprint="abc")
    assert info.value.field == field
    assert repr(field) in str(info.value)


def test_constructor_validates():
    with pytest.raises(ValueError):
        UsageStats([], E, 10)
    with pytest.raises(ValueError):
        UsageStats([1, 1], E, 10)
    with pytest.raises(ValueError):
        UsageStats(LAYERS, E, 0)
