"""The expert cache's working set kept across restarts (daemon/store/working_set.py): its
file, and the warm start that reads it first (daemon/store/streaming.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from daemon.store.plans import plans_for
from daemon.store.streaming import StreamingExpertProvider, StreamingOptions
from daemon.store.working_set import WorkingSet, load_working_set, save_working_set, working_set_store
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout

LAYERS, EXPERTS, TOP_K = 3, 16, 2
FP = "ab" * 32
SAVED = WorkingSet(((3, 1, 2), (), (15,)), ((0, 4), (2, 9)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("ws") / "m", arch="qwen3_moe", layers=LAYERS,
                      experts=EXPERTS, top_k=TOP_K, hidden=64, intermediate=32, dtype="bf16", seed=5)


def _provider(model_dir, dynamic_per_layer, counts=None, working_set=None, **options):
    """No prefetch (no staging tier), nothing pinned unless asked: each layer's dynamic tier
    has `dynamic_per_layer` slots."""
    config = load_config(model_dir)
    layout = ExpertLayout(Checkpoint(model_dir), config)
    slot = max(p.slot_bytes for p in plans_for(layout).values())
    options = dict(dict(prefetch=False, learn_pins=False, pin_fraction=0.0, referee=False), **options)
    p = StreamingExpertProvider(layout, config, StreamingOptions(cache_bytes=dynamic_per_layer * LAYERS * slot,
                                                                 **options),
                                usage_counts=counts, working_set=working_set)
    p._quiesce()                                        # the warm reads land
    return p


def _step(provider, routing):
    provider.begin_step(1)
    for layer, experts in enumerate(routing):
        provider.acquire(layer, experts)
        provider.release(layer, experts)


def test_the_working_set_round_trips_through_its_file(tmp_path):
    store = working_set_store(tmp_path, FP, LAYERS, EXPERTS)
    assert load_working_set(store, LAYERS, EXPERTS) is None          # none saved yet
    save_working_set(store, SAVED)
    assert store.path.name == f"experts-{FP[:16]}.json"
    assert load_working_set(store, LAYERS, EXPERTS) == SAVED


@pytest.mark.parametrize("payload", [
    b"{\"version\": 1, \"fingerp",                                  # torn
    {"layers": [[1], [2]], "pins": []},                              # two layers, not three
    {"layers": [[1], [2], [16]], "pins": []},                        # no expert 16
    {"layers": [[1, 1], [2], [3]], "pins": []},                      # a repeat
    {"layers": [[1], [2], [3]], "pins": [[3, 1]]},                   # no MoE layer 3
    {"layers": [[1], [2], [True]], "pins": []},                      # not an id
])
def test_a_file_that_does_not_fit_is_set_aside_and_not_trusted(tmp_path, payload):
    store = working_set_store(tmp_path, FP, LAYERS, EXPERTS)
    if isinstance(payload, dict):
        save_working_set(store, SAVED)
        doc = json.loads(store.path.read_text())
        doc["payload"] = payload
        payload = json.dumps(doc).encode()
    store.path.write_bytes(payload)
    assert load_working_set(store, LAYERS, EXPERTS) is None
    assert not store.path.exists()
    assert [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]


def test_a_file_of_another_model_is_set_aside_as_foreign(tmp_path):
    save_working_set(working_set_store(tmp_path, FP[:16] + "cd" * 24, LAYERS, EXPERTS), SAVED)
    store = working_set_store(tmp_path, FP, LAYERS, EXPERTS)         # same file name, other model
    assert load_working_set(store, LAYERS, EXPERTS) is None
    assert [p.name for p in tmp_path.iterdir() if ".foreign-" in p.name]


def test_a_restart_holds_the_working_set_the_session_before_ended_with(model_dir):
    """What a session's dynamic tiers held, in recency order, is what the next one holds
    before its first step, in the same order; the step that ended the session then hits."""
    first = _provider(model_dir, 4)
    routing = [[[0, 1], [2, 3], [4, 5], [6, 7], [2, 3]][t] for t in range(5)]
    for experts in routing:
        _step(first, [experts] * LAYERS)
    saved = first.working_set()
    first.close()
    assert all(len(row) == 4 and row[:2] in ((2, 3), (3, 2)) for row in saved.layers)   # the latest first
    counts = np.zeros((LAYERS, EXPERTS))
    counts[:, 8:12] = 100.0                     # what the counts alone would choose
    second = _provider(model_dir, 4, counts=counts, working_set=saved)
    try:
        assert second.working_set() == saved
        _step(second, [[2, 3]] * LAYERS)
        assert sum(second.cache.snapshot().misses) == 0
    finally:
        second.close()


def test_steps_not_counted_as_usage_leave_the_saved_working_set_as_traffic_left_it(model_dir):
    """A tuner's check prompt or built-in workload runs with observe_usage off: what is
    saved until traffic comes back is what traffic left (the next session serves traffic)."""
    p = _provider(model_dir, 2)
    try:
        _step(p, [[0, 1]] * LAYERS)
        served = p.working_set()
        p.observe_usage = False
        _step(p, [[4, 5]] * LAYERS)
        _step(p, [[6, 7]] * LAYERS)
        assert p.working_set() == served
        p.observe_usage = True
        _step(p, [[1, 2]] * LAYERS)
        assert all(set(row) == {1, 2} for row in p.working_set().layers)
    finally:
        p.close()


def test_a_smaller_cache_takes_the_most_recent_and_a_bigger_one_tops_up_from_the_counts(model_dir):
    saved = WorkingSet(((5, 6, 7, 8),) * LAYERS)
    counts = np.zeros((LAYERS, EXPERTS))
    counts[:, [1, 6, 2]] = [30.0, 20.0, 10.0]
    smaller = _provider(model_dir, 2, counts=counts, working_set=saved)
    bigger = _provider(model_dir, 6, counts=counts, working_set=saved)
    without = _provider(model_dir, 2, counts=counts)                 # no file: the most used
    try:
        assert smaller.working_set().layers == ((5, 6),) * LAYERS
        assert bigger.working_set().layers == ((5, 6, 7, 8, 1, 2),) * LAYERS
        assert without.working_set().layers == ((1, 6),) * LAYERS
    finally:
        for p in (smaller, bigger, without):
            p.close()


def test_saved_pins_are_pinned_again_the_others_topped_up_from_the_counts(model_dir):
    counts = np.zeros((LAYERS, EXPERTS))
    counts[:, 0] = 50.0
    saved = WorkingSet(((),) * LAYERS, ((1, 9),))
    p = _provider(model_dir, 4, counts=counts, working_set=saved, pin_fraction=0.5)  # 3 of 6 spare slots
    try:
        assert p.cache.pinned_slots == 3
        assert p.cache.pins == {(1, 9), (0, 0), (1, 0)}
        assert p.working_set().pins[-1] == (1, 9)                   # the least used last
    finally:
        p.close()
