"""Tests for ext.sampling: greedy, temperature, top-k, top-p and seeded draws."""

import numpy as np
import pytest

from ext.sampling import Sampler, SamplingParams, _sort_descending


def _draws(params: SamplingParams, logits: np.ndarray, n: int) -> list[int]:
    sampler = Sampler(params)
    return [sampler.sample(logits) for _ in range(n)]


def _reference(logits: np.ndarray, temperature: float, seed: int, n: int,
               top_k: int = 0, top_p: float = 1.0) -> list[int]:
    """The documented algorithm, written independently and slowly."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        order = order[:top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    if top_p < 1.0:
        mass, keep = 0.0, 0
        while keep < len(p) and mass < top_p:
            mass += p[keep]
            keep += 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    rng = np.random.Generator(np.random.PCG64(seed))
    out = []
    for _ in range(n):
        u = rng.random()
        out.append(int(order[min(np.searchsorted(np.cumsum(p), u, side="right"), len(p) - 1)]))
    return out


def test_greedy_is_argmax_and_ties_go_to_lower_id():
    logits = np.array([1.0, 3.0, -np.inf, 3.0, 2.0], dtype=np.float32)
    assert Sampler(SamplingParams()).sample(logits) == 1
    assert Sampler(SamplingParams()).sample(np.array([0.5, -1.0, 7.25], np.float32)) == 2


def test_greedy_does_not_consume_randomness():
    logits = np.array([0.0, 0.1, 0.2], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, seed=5))
    assert [sampler.sample(logits) for _ in range(3)] == [2, 2, 2]


def test_same_seed_same_tokens_different_seed_differs():
    logits = np.linspace(-1.0, 1.0, 50, dtype=np.float32)
    a = _draws(SamplingParams(temperature=1.0, seed=7), logits, 64)
    b = _draws(SamplingParams(temperature=1.0, seed=7), logits, 64)
    c = _draws(SamplingParams(temperature=1.0, seed=8), logits, 64)
    assert a == b
    assert a != c
    assert len(set(a)) > 10  # really sampling, not stuck on one token


@pytest.mark.parametrize("kwargs", [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.6),
    dict(temperature=1.0, top_k=20, top_p=0.8),
])
def test_draws_follow_documented_inverse_cdf(kwargs):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(40).astype(np.float32)
    logits[[3, 17]] = logits[9]  # ties must order by id
    got = _draws(SamplingParams(seed=123, **kwargs), logits, 200)
    assert got == _reference(logits, seed=123, n=200, **kwargs)


def test_top_k_one_equals_greedy_even_with_ties():
    logits = np.array([0.0, 2.0, 1.0, 2.0], dtype=np.float32)
    for seed in range(20):
        assert Sampler(SamplingParams(temperature=1.5, top_k=1, seed=seed)).sample(logits) == 1


def test_tiny_top_p_equals_greedy():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(100).astype(np.float32)
    best = int(np.argmax(logits))
    assert _draws(SamplingParams(temperature=2.0, top_p=1e-9, seed=3), logits, 50) == [best] * 50


def test_distribution_matches_softmax_chi_square():
    probs = np.array([0.5, 0.25, 0.15, 0.1])
    logits = np.log(probs).astype(np.float32)
    n = 20000
    counts = np.bincount(_draws(SamplingParams(temperature=1.0, seed=2024), logits, n), minlength=4)
    chi2 = float((((counts - n * probs) ** 2) / (n * probs)).sum())
    assert chi2 < 16.27  # df = 3, p = 0.001
    assert counts.sum() == n


def test_top_k_and_top_p_restrict_and_renormalise():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    n = 6000
    for params in (SamplingParams(temperature=1.0, top_k=2, seed=9),
                   SamplingParams(temperature=1.0, top_p=0.7, seed=9)):  # 0.5 < 0.7 <= 0.8
        counts = np.bincount(_draws(params, logits, n), minlength=4)
        assert counts[2] == 0 and counts[3] == 0
        expected = n * np.array([0.625, 0.375])
        chi2 = float((((counts[:2] - expected) ** 2) / expected).sum())
        assert chi2 < 10.83  # df = 1, p = 0.001


def test_low_temperature_sharpens():
    logits = np.array([1.0, 0.0], dtype=np.float32)
    n = 4000
    hot = np.bincount(_draws(SamplingParams(temperature=1.0, seed=4), logits, n), minlength=2)
    cold = np.bincount(_draws(SamplingParams(temperature=0.25, seed=4), logits, n), minlength=2)
    # P(0) = sigmoid(1) = 0.731 at T=1 and sigmoid(4) = 0.982 at T=0.25.
    assert abs(hot[0] / n - 0.731) < 0.03
    assert abs(cold[0] / n - 0.982) < 0.01


def test_masked_tokens_never_drawn():
    logits = np.full(10, -np.inf, dtype=np.float32)
    logits[[2, 7]] = 0.0
    assert set(_draws(SamplingParams(temperature=1.0, seed=0), logits, 300)) == {2, 7}


def test_tiny_temperature_does_not_overflow():
    logits = np.array([1e4, 1e4 - 1.0, -1e4], dtype=np.float32)
    assert _draws(SamplingParams(temperature=1e-30, seed=1), logits, 5) == [0] * 5


def test_seed_none_is_recorded_and_replayable():
    logits = np.linspace(0.0, 1.0, 30, dtype=np.float32)
    first = Sampler(SamplingParams(temperature=1.0))
    assert isinstance(first.seed, int)
    draws = [first.sample(logits) for _ in range(30)]
    assert _draws(SamplingParams(temperature=1.0, seed=first.seed), logits, 30) == draws


@pytest.mark.parametrize("field, kwargs", [
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-1)),
    ("top_k", dict(top_k=2.5)),
    ("seed", dict(seed=-3)),
])
def test_invalid_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("logits, message", [
    (np.zeros((2, 3), np.float32), "1-D"),
    (np.zeros(0, np.float32), "1-D"),
    (np.array([0.0, np.nan], np.float32), "NaN"),
    (np.array([-np.inf, -np.inf], np.float32), "-inf"),
])
def test_invalid_logits_raise(logits, message):
    with pytest.raises(ValueError, match=message):
        Sampler(SamplingParams(temperature=1.0, seed=0)).sample(logits)


def test_sort_descending_equals_stable_argsort_with_ties():
    rng = np.random.default_rng(5)
    z = np.round(rng.standard_normal(5000) * 3).astype(np.float64)  # many ties
    ids = np.flatnonzero(rng.random(5000) < 0.7)
    expected = ids[np.argsort(-z[ids], kind="stable")]
    np.testing.assert_array_equal(_sort_descending(z, ids), expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_greedy_shortcut_picks_and_refuses_as_the_general_path(dtype):
    """Greedy with nothing to add or mask takes one pass over the logits; a logit_bias of
    0 sends the same logits through the general path, which must agree token and error."""
    rng = np.random.default_rng(7)
    cases = [rng.standard_normal(257).astype(dtype) for _ in range(20)]
    tie = rng.standard_normal(64).astype(dtype)
    tie[[9, 40]] = tie.max() + 1                              # first of two maxima wins
    cases.append(tie)
    for bad, where in [(np.nan, 3), (np.inf, 5), (-np.inf, None)]:
        row = rng.standard_normal(32).astype(dtype)
        row[where if where is not None else slice(None)] = bad
        cases.append(row)
    both = rng.standard_normal(32).astype(dtype)
    both[[4, 11]] = [np.inf, np.nan]                          # +inf before a NaN
    cases.append(both)
    for z in cases:
        shortcut = Sampler(SamplingParams(temperature=0))
        general = Sampler(SamplingParams(temperature=0, logit_bias=((0, 0.0),)))
        outcomes = []
        for sampler in (shortcut, general):
            try:
                outcomes.append(sampler.sample(z))
            except ValueError as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1], (z, outcomes)
    assert Sampler(SamplingParams(temperature=0)).sample(tie) == 9


@pytest.mark.parametrize("spread", [0.3, 1.0, 4.0])
@pytest.mark.parametrize("kwargs", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9),
                                    dict(temperature=1.2, top_p=0.5)])
def test_a_vocabulary_larger_than_the_sorted_head_draws_as_documented(spread, kwargs):
    """Over a vocabulary of 3000 (more than the 256 tokens sorted first) the draws still
    follow the documented inverse CDF over the whole sorted order: flat logits (spread
    0.3) send most draws past the head, peaked ones (4.0) keep them in it."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(3000) * spread).astype(np.float32)
    logits[[5, 600, 2900]] = logits[1234]                   # ties order by id
    got = _draws(SamplingParams(seed=99, **kwargs), logits, 300)
    assert got == _reference(logits, seed=99, n=300, **kwargs)
    assert len(set(got)) > 1                                # really sampling
