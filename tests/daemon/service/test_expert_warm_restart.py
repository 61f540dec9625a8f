"""`moed serve` restarts with the expert cache its previous session ended with: the working
set saved at SIGTERM is what the new cache holds before any request; after a kill -9 the
restart falls back to the last flush's (daemon/store/working_set.py)."""
from __future__ import annotations

import shutil

import pytest
from daemon_proc import Daemon, short_dir

from daemon.store.plans import plans_for
from daemon.store.working_set import load_working_set, working_set_store
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout

LAYERS, EXPERTS = 2, 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("warm") / "model", arch="qwen3_moe", layers=LAYERS,
                      experts=EXPERTS, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=3,
                      routing_skew=1.0)


def _start(model_dir, state, cache_bytes):
    return Daemon(model_dir, short_dir(), "--expert-cache-bytes", str(cache_bytes), "--no-prefetch",
                  "--prefix-cache-bytes", "0", state_dir=state)


def _warm_event(d: Daemon) -> dict:
    (event,) = [e for e in d.events if e.get("event") == "expert_cache_warm_start"]
    return event


def _complete(d: Daemon) -> None:
    status, answer = d.json("POST", "/v1/completions", {"prompt": "a b c", "max_tokens": 48, "ignore_eos": True,
                                                        "temperature": 0.8, "seed": 1})
    assert status == 200, answer


@pytest.mark.slow     # ~9 s: four daemons
def test_a_restart_holds_the_previous_working_set_and_a_kill_falls_back_to_the_last_flush(model_dir):
    config = load_config(model_dir)
    slot = max(p.slot_bytes for p in plans_for(ExpertLayout(Checkpoint(model_dir), config)).values())
    cache_bytes = 12 * slot                      # 12 of 32 experts
    state = short_dir("moedstate")
    store = working_set_store(state, Checkpoint(model_dir).fingerprint(), LAYERS, EXPERTS)
    daemons = []
    try:
        d = _start(model_dir, state, cache_bytes)
        daemons.append(d)
        assert _warm_event(d)["working_set"] is False                # a first start: cold
        _complete(d)
        assert d.stop() == 0
        saved = load_working_set(store, LAYERS, EXPERTS)
        assert saved is not None and all(saved.layers)

        d = _start(model_dir, state, cache_bytes)                    # stopped before any request:
        daemons.append(d)                                            # it saves what it holds
        event = _warm_event(d)
        assert event["working_set"] is True and event["experts_read"] >= sum(map(len, saved.layers))
        assert d.stop() == 0
        held = load_working_set(store, LAYERS, EXPERTS)
        for before, now in zip(saved.layers, held.layers):
            assert now[:len(before)] == before                       # in the same order
        assert set(held.pins) == set(saved.pins)
        kept = store.path.read_bytes()

        d = _start(model_dir, state, cache_bytes)                    # killed before its first flush
        daemons.append(d)
        _complete(d)
        d.kill()
        assert store.path.read_bytes() == kept

        d = _start(model_dir, state, cache_bytes)
        daemons.append(d)
        event = _warm_event(d)
        assert event["working_set"] is True and event["experts_read"] > 0
        _complete(d)
        assert d.stop() == 0
    finally:
        for d in daemons:
            d.cleanup()
        shutil.rmtree(state, ignore_errors=True)
