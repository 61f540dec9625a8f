"""Hostile, corrupt and extreme next-step statistics (payload "learned.transitions") in the
usage state file: a file that does not fit is set aside naming the field and learning
starts fresh; values that fit but are extreme change nothing but placement; policy
switches, rebuilds, resets and two writers never lose or resurrect what was learned. A
file larger than any this model's state can be is set aside unread."""
from __future__ import annotations

import base64
import json
import logging
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from daemon.store.plans import plans_for
from daemon.store.session import open_model
from daemon.store.state import StateStore
from daemon.store.streaming import (StreamingExpertProvider, StreamingOptions, flush_usage,
                                    load_usage_state)
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from ext.models.model import Model
from scheduler.usage import UsageStats, encode_transitions, max_state_file_bytes

LAYERS, EXPERTS, TOP_K = 3, 16, 2
HALF_LIFE = 2048.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("hostile") / "m", arch="qwen3_moe", layers=LAYERS,
                      experts=EXPERTS, top_k=TOP_K, hidden=64, intermediate=32, dtype="bf16",
                      seed=5, initializer_range=0.2)


@pytest.fixture(scope="module")
def fingerprint(model_dir) -> str:
    return Checkpoint(model_dir).fingerprint()


def _slot_bytes(model_dir) -> int:
    layout = ExpertLayout(Checkpoint(model_dir), load_config(model_dir))
    return max(p.slot_bytes for p in plans_for(layout).values())


def _provider(model_dir, slots=12, counts=None, learned=None, **options):
    config = load_config(model_dir)
    layout = ExpertLayout(Checkpoint(model_dir), config)
    return StreamingExpertProvider(layout, config, StreamingOptions(
        cache_bytes=slots * _slot_bytes(model_dir), **options), usage_counts=counts, learned=learned)


def _decode_step(provider, routing):
    provider.phase = "decode"
    provider.begin_step(1)
    for layer, experts in enumerate(routing):
        provider.observe_routing(layer, np.asarray([experts], np.int32))
        provider.acquire(layer, experts)
        provider.release(layer, experts)


def _drive(provider, steps, seed=0):
    rng = np.random.default_rng(seed)
    for t in range(steps):
        _decode_step(provider, [[t % 5, int(rng.integers(5, EXPERTS))] for _ in range(LAYERS)])


def _good_layer(e=EXPERTS) -> dict:
    return encode_transitions([(np.eye(e), np.ones(e))])["layers"][0]


def _write(store: StateStore, fingerprint: str, transitions) -> None:
    """A state file whose payload is valid but for `transitions` (written raw, as a
    hand edit would be: NaN and huge integers included)."""
    stats = UsageStats(list(range(LAYERS)), EXPERTS, HALF_LIFE)
    stats.observe(0, [1, 2])
    payload = stats.to_dict(fingerprint)
    payload["learned"] = {"pin_share": 0.25, "transitions": transitions}
    doc = {"version": 1, "fingerprint": fingerprint, "written_unix": 1.0, "tokens": 1,
           "payload": payload}
    store.path.write_text(json.dumps(doc))


def _layers(*layers) -> dict:
    return {"encoding": "u8-rows-base64", "layers": list(layers)}


HOSTILE = {
    "a number": (7, "learned.transitions"),
    "too few layers": (_layers(_good_layer(), None), "learned.transitions"),
    "too many layers": (_layers(*[_good_layer()] * (LAYERS + 1)), "learned.transitions"),
    "another expert count": (_layers(_good_layer(EXPERTS - 1), None, None), "layers[0].totals"),
    "NaN totals": (_layers({**_good_layer(), "totals": [float("nan")] * EXPERTS}, None, None),
                   "layers[0].totals"),
    "infinite totals": (_layers({**_good_layer(), "totals": [float("inf")] * EXPERTS}, None, None),
                        "layers[0].totals"),
    "negative totals": (_layers(None, {**_good_layer(), "totals": [-1.0] * EXPERTS}, None),
                        "layers[1].totals"),
    "an integer too large for a float": (
        _layers({**_good_layer(), "totals": [10 ** 400] * EXPERTS}, None, None), "layers[0].totals"),
    "totals as strings": (_layers({**_good_layer(), "totals": ["1"] * EXPERTS}, None, None),
                          "layers[0].totals"),
    "totals as booleans": (_layers({**_good_layer(), "totals": [True] * EXPERTS}, None, None),
                           "layers[0].totals"),
    "next of the wrong length": (
        _layers(None, None, {**_good_layer(), "next": base64.b64encode(bytes(EXPERTS)).decode()}),
        "layers[2].next"),
    "next not base64": (_layers({**_good_layer(), "next": "*" * 344}, None, None), "layers[0].next"),
    "next with line breaks": (
        _layers({**_good_layer(), "next": _good_layer()["next"][:76] + "\n" + _good_layer()["next"][76:]},
                None, None), "layers[0].next"),
    "next null": (_layers({**_good_layer(), "next": None}, None, None), "layers[0].next"),
    "next a number": (_layers({**_good_layer(), "next": 1234}, None, None), "layers[0].next"),
    "next 100 MB": (_layers({**_good_layer(), "next": "A" * 100_000_000}, None, None), "layers[0].next"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_transitions_field_sets_the_file_aside_naming_it_and_serving_goes_on(
        model_dir, fingerprint, tmp_path, log_records, case):
    transitions, field = HOSTILE[case]
    store = StateStore(tmp_path, fingerprint, max_bytes=1 << 30)   # the field's check, not the size's
    _write(store, fingerprint, transitions)
    written = store.path.read_bytes()
    records = log_records("moed.state")
    assert load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, HALF_LIFE) is None
    # set aside intact (for a look), not left to be overwritten by the next flush
    assert not store.path.exists()
    [aside] = tmp_path.glob(f"{store.path.name}.corrupt-*")
    assert aside.read_bytes() == written
    [warning] = [r for r in records if r["event"] == "state_file_set_aside"]
    assert "learned.transitions" in warning["reason"] and field in warning["reason"]
    # learning starts fresh: a provider without learned state serves and saves
    provider = _provider(model_dir, prefetch=False)
    try:
        _drive(provider, 20)
        flush_usage(store, provider.usage, fingerprint, provider.learned_state())
    finally:
        provider.close()
    counts, learned = load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, HALF_LIFE)
    assert counts.sum() > 0 and learned["transitions"]["encoding"] == "u8-rows-base64"


def test_a_written_time_too_large_for_a_float_is_corrupt_not_a_crash(fingerprint, tmp_path):
    store = StateStore(tmp_path, fingerprint)
    store.path.write_text(json.dumps({"version": 1, "fingerprint": fingerprint,
                                      "written_unix": 10 ** 400, "tokens": 0, "payload": {}}))
    assert store.load() is None
    assert len(list(tmp_path.glob(f"{store.path.name}.corrupt-*"))) == 1


def test_a_flush_over_a_file_another_writer_broke_sets_it_aside_and_writes_its_own(
        model_dir, fingerprint, tmp_path, log_records):
    """Between this process's load and its flush, the file is replaced by one whose
    transitions do not fit: the flush does not crash, keeps the broken file aside and
    writes what this process has."""
    store = StateStore(tmp_path, fingerprint)
    provider = _provider(model_dir, prefetch=False)
    try:
        _drive(provider, 30)
        _write(store, fingerprint, _layers({**_good_layer(), "totals": [10 ** 400] * EXPERTS}, None, None))
        records = log_records("moed.state")
        flush_usage(store, provider.usage, fingerprint, provider.learned_state())
    finally:
        provider.close()
    assert [r["event"] for r in records] == ["state_file_set_aside"]
    assert len(list(tmp_path.glob(f"{store.path.name}.corrupt-*"))) == 1
    counts, learned = load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, HALF_LIFE)
    np.testing.assert_allclose(counts, provider.usage.counts())
    assert learned["transitions"]["layers"][0] is not None


def test_null_layers_everywhere_and_extra_keys_are_accepted_as_nothing_learned(
        model_dir, fingerprint, tmp_path):
    store = StateStore(tmp_path, fingerprint)
    _write(store, fingerprint, {**_layers(None, None, None), "comment": "hand edited",
                                "layers_extra": [1, 2]})
    counts, learned = load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, HALF_LIFE)
    provider = _provider(model_dir, counts=counts, learned=learned, prefetch=False)
    try:
        assert provider.cache.prior_weights() == [None] * LAYERS
        _drive(provider, 10)
    finally:
        provider.close()


def _extreme(totals: float) -> dict:
    """Every layer: totals `totals`, "next" all 255 (every expert follows every expert)."""
    layer = {"totals": [totals] * EXPERTS, "next": base64.b64encode(b"\xff" * EXPERTS ** 2).decode()}
    return _layers(*[layer] * LAYERS)


def _greedy(model, prompt, steps):
    seq = model.new_sequence()
    logits = model.forward(seq, prompt)
    tokens, out = [], [logits]
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits = model.forward(seq, [tokens[-1]])
        out.append(logits)
    return tokens, out


@pytest.mark.parametrize("totals", [1e300, 1.7e308, 5e-324])
def test_extreme_but_valid_transitions_change_placement_only(model_dir, fingerprint, tmp_path, totals):
    """Totals near the float limits with every probability 1: the prior is seeded, the
    predictor's values stay finite, every logit equals the memory-mapped reference's, and
    what is saved afterwards is finite and loads again."""
    store = StateStore(tmp_path, fingerprint)
    _write(store, fingerprint, _extreme(totals))
    counts, learned = load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, HALF_LIFE)
    prompt = [3, 9, 27, 81, 243, 100, 7, 1, 2, 3] * 3
    want = _greedy(Model.load(model_dir, n_threads=2), prompt, 24)
    config = load_config(model_dir)
    checkpoint = Checkpoint(model_dir)
    layout = ExpertLayout(checkpoint, config)
    provider = StreamingExpertProvider(layout, config, StreamingOptions(
        cache_bytes=12 * _slot_bytes(model_dir), prefetch_min_precision=0.0),
        usage_counts=counts, learned=learned)
    model = Model(config, checkpoint, layout, provider, 2)
    try:
        assert all(w is not None for w in provider.cache.prior_weights())
        got = _greedy(model, prompt, 24)
        assert got[0] == want[0]
        assert all(np.array_equal(a, b) for a, b in zip(got[1], want[1]))
        weights = provider.cache.prior_weights()
        assert all(0.0 <= w <= 1.0 for w in weights), weights
        for policy in provider.cache._policies:
            if hasattr(policy, "p_next"):
                assert np.all(np.isfinite(policy.p_next()))
        for t, n in provider.cache.transitions():
            assert np.all(np.isfinite(t)) and np.all(np.isfinite(n))
        flush_usage(store, provider.usage, fingerprint, provider.learned_state())
    finally:
        model.close()
    assert load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, HALF_LIFE) is not None
    assert list(tmp_path.glob("*.corrupt-*")) == []


def _learned_mass(provider) -> float:
    return float(sum(n.sum() for t in provider.cache.transitions() if t is not None for _, n in [t]))


def test_the_policy_switched_off_and_on_keeps_its_next_step_statistics(model_dir):
    """The referee's "policy" off (its fallback: lrfu, or LRU with "lrfu" off too) and on
    again, many times: the fallback holds the statistics to hand on, the predictive policy
    takes them back as a prior, nothing is lost beyond the decay and the weights stay in
    [0, 1]."""
    provider = _provider(model_dir, prefetch=False, referee=False)
    try:
        _drive(provider, 60)
        learned = _learned_mass(provider)
        assert learned > 0
        for i in range(12):
            if i % 4 == 0:                                # the fallback itself on and off
                provider._set_mechanism("lrfu", i % 8 == 0)
            provider._set_mechanism("policy", i % 2 == 1)
            _drive(provider, 3, seed=i)
            off = "lrfu" if i % 8 < 4 else "lru"
            assert provider.cache.policy_name == (off if i % 2 == 0 else provider.options.policy)
            assert _learned_mass(provider) >= learned * 0.5
            assert "transitions" in provider.learned_state()
            assert all(w is None or 0.0 <= w <= 1.0 for w in provider.cache.prior_weights())
        provider.reset_learning()
        assert _learned_mass(provider) == 0.0
        provider._set_mechanism("policy", False)
        assert "transitions" not in provider.learned_state()
    finally:
        provider.close()


def test_a_reset_while_lru_holds_transitions_then_a_flush_leaves_none_in_the_file(
        model_dir, fingerprint, tmp_path):
    store = StateStore(tmp_path, fingerprint)
    provider = _provider(model_dir, prefetch=False)
    try:
        _drive(provider, 40)
        flush_usage(store, provider.usage, fingerprint, provider.learned_state())
        assert "transitions" in load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint,
                                                 HALF_LIFE)[1]
        provider._set_mechanism("policy", False)             # LRU now holds them
        provider.reset_learning()
        flush_usage(store, provider.usage, fingerprint, provider.learned_state())
        provider._set_mechanism("policy", True)
        assert _learned_mass(provider) == 0.0
    finally:
        provider.close()
    _, learned = load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, HALF_LIFE)
    assert "transitions" not in learned


def test_a_rebuild_while_lru_holds_transitions_carries_them_and_a_reset_clears_the_file(
        model_dir, tmp_path):
    model, session = open_model(model_dir, threads=2, cache_bytes=12 * _slot_bytes(model_dir),
                                state_dir=tmp_path, prefetch=False)
    try:
        _drive(session.provider, 40)
        session.provider._set_mechanism("policy", False)
        before = _learned_mass(session.provider)
        session.rebuild(cache_bytes=14 * _slot_bytes(model_dir))
        assert _learned_mass(session.provider) == pytest.approx(before, rel=1e-9)
        assert session.flush()
        assert "transitions" in json.loads(session.store.path.read_text())["payload"]["learned"]
        session.reset()
        assert "transitions" not in json.loads(session.store.path.read_text())["payload"].get("learned", {})
        assert session.flush()
        assert "transitions" not in json.loads(session.store.path.read_text())["payload"].get("learned", {})
    finally:
        model.close()


def test_two_writers_one_with_transitions_one_without_take_turns_without_crashing(
        model_dir, fingerprint, tmp_path):
    """The learned section is the last writer's: a writer without transitions over a file
    with them, and one with them over a file without, both flush and both files load."""
    store = StateStore(tmp_path, fingerprint)
    learner = _provider(model_dir, prefetch=False)
    plain = _provider(model_dir, prefetch=False, policy="lru", referee=False, learn_pins=False)
    try:
        _drive(learner, 30)
        _drive(plain, 30, seed=1)
        assert "transitions" not in plain.learned_state()
        for writer, has in [(learner, True), (plain, False), (learner, True), (plain, False)]:
            flush_usage(store, writer.usage, fingerprint, writer.learned_state())
            _, learned = load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, HALF_LIFE)
            assert ("transitions" in learned) == has
        _drive(plain, 5)
        flush_usage(store, plain.usage, fingerprint, None)      # None keeps what the file has
        _, learned = load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, HALF_LIFE)
        assert "transitions" not in learned
    finally:
        learner.close()
        plain.close()
    assert list(tmp_path.glob("*.corrupt-*")) == []


def test_in_a_read_only_directory_a_hostile_file_is_ignored_naming_the_field_and_left_alone(
        fingerprint, tmp_path, log_records):
    store = StateStore(tmp_path, fingerprint)
    _write(store, fingerprint, _layers(None, {**_good_layer(), "totals": [10 ** 400] * EXPERTS}, None))
    written = store.path.read_bytes()
    store.writable = False                   # as a read-only mount leaves it (root ignores modes)
    records = log_records("moed.state")
    assert load_usage_state(store, list(range(LAYERS)), EXPERTS, fingerprint, HALF_LIFE) is None
    [warning] = records
    assert warning["event"] == "state_file_ignored" and "layers[1].totals" in warning["reason"]
    assert store.path.read_bytes() == written and list(tmp_path.glob("*.corrupt-*")) == []


def test_a_state_file_that_is_a_fifo_is_set_aside_without_blocking(fingerprint, tmp_path, caplog):
    """A FIFO (or socket, device) where the state file belongs: opening it for reading
    would block until a writer came; it is set aside as corrupt and learning starts fresh."""
    store = StateStore(tmp_path, fingerprint)
    os.mkfifo(store.path)
    with caplog.at_level(logging.WARNING):
        assert store.load() is None
    assert not store.path.exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(store.path.name + ".corrupt-")]
    assert len(aside) == 1 and stat.S_ISFIFO(aside[0].lstat().st_mode)
    assert "not a regular file" in caplog.text
    store.save(lambda old: {"written_after": old is None}, tokens=1)   # a regular file again
    assert store.load() == {"written_after": True}


def test_a_state_file_larger_than_the_model_allows_is_set_aside_unread(
        model_dir, fingerprint, tmp_path, log_records):
    """A valid state file padded past the model's bound (as `truncate -s 3G` makes one, but
    small enough to be harmless if it were read): open_model sets it aside without reading
    it, with a warning naming the file and its size, and starts fresh; a real file of this
    model, every layer's transitions learned, stays far below the bound."""
    bound = max_state_file_bytes(LAYERS, EXPERTS)
    store = StateStore(tmp_path, fingerprint, max_bytes=bound)
    provider = _provider(model_dir, prefetch=False)
    try:
        _drive(provider, 200)
        flush_usage(store, provider.usage, fingerprint, provider.learned_state())
    finally:
        provider.close()
    real = store.path.read_bytes()
    assert all(layer is not None for layer in json.loads(real)["payload"]["learned"]["transitions"]["layers"])
    assert len(real) < bound // 4
    padded = real + b" " * (bound + 1 - len(real))          # still valid JSON
    store.path.write_bytes(padded)
    records = log_records("moed.state")
    model, session = open_model(model_dir, threads=1, cache_bytes=12 * _slot_bytes(model_dir),
                                state_dir=tmp_path)
    try:
        assert session.provider.usage.counts().sum() == 0          # learning starts fresh
    finally:
        model.close()
    [warning] = [r for r in records if r["event"] == "state_file_set_aside"]
    assert warning["path"] == str(store.path)
    assert f"{bound + 1} bytes, more than the {bound}" in warning["reason"]
    [aside] = tmp_path.glob(f"{store.path.name}.corrupt-*")
    assert aside.read_bytes() == padded


def test_a_state_file_that_grows_past_the_bound_while_read_is_set_aside(
        fingerprint, tmp_path, monkeypatch):
    """fstat saw a size under the bound, but the file grew before the read: the read stops
    one byte past the bound and the file is set aside."""
    store = StateStore(tmp_path, fingerprint, max_bytes=100)
    store.save(lambda old: {"a": 1}, tokens=1)
    store.path.write_bytes(store.path.read_bytes() + b" " * 200)
    real = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((*real(fd)[:6], 50, *real(fd)[7:])))
    assert store.load() is None
    monkeypatch.undo()
    assert len(list(tmp_path.glob(f"{store.path.name}.corrupt-*"))) == 1
