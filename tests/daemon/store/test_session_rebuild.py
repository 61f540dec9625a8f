"""ExpertSession.rebuild: the old cache's memory is freed before the new one is taken (a
shrink under memory pressure must not need both budgets at once), what was learned carries
over, and a failed rebuild leaves a working provider."""
from __future__ import annotations

import numpy as np
import pytest

from daemon.store import session as session_mod
from daemon.store.plans import plans_for
from daemon.store.session import open_model
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from scheduler.cache import CacheBudgetError

LAYERS, EXPERTS, TOP_K = 3, 16, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("rebuild") / "m", arch="qwen3_moe", layers=LAYERS,
                      experts=EXPERTS, top_k=TOP_K, hidden=64, intermediate=32, dtype="bf16", seed=3)


def _slot(model_dir) -> int:
    layout = ExpertLayout(Checkpoint(model_dir), load_config(model_dir))
    return max(p.slot_bytes for p in plans_for(layout).values())


def _generate(model, steps=12):
    seq = model.new_sequence()
    logits = model.forward(seq, [1, 2, 3, 4])
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(logits[-1])))
        logits = model.forward(seq, [out[-1]])
    return out


def test_a_shrink_frees_the_old_slots_before_the_new_cache_allocates(model_dir, tmp_path, monkeypatch):
    model, session = open_model(model_dir, threads=1, cache_bytes=12 * _slot(model_dir), state_dir=tmp_path)
    try:
        before = _generate(model)
        old = session.provider
        usage = old.usage.counts().copy()
        seen = []
        real = session_mod.StreamingExpertProvider

        def recording(*args, **kwargs):
            seen.append(old.arena._mmap.closed)        # the old slots, when the new ones are taken
            return real(*args, **kwargs)
        monkeypatch.setattr(session_mod, "StreamingExpertProvider", recording)
        session.rebuild(cache_bytes=8 * _slot(model_dir))
        assert seen == [True]
        assert session.provider is not old and model.experts is session.provider
        assert session.provider.cache.total_slots == 8
        np.testing.assert_array_equal(session.provider.usage.counts(), usage)
        model.reset_cache() if hasattr(model, "reset_cache") else None
        assert _generate(model) == before               # placement only
    finally:
        model.close()


def test_a_budget_below_the_minimum_is_refused_before_anything_is_closed(model_dir, tmp_path):
    model, session = open_model(model_dir, threads=1, cache_bytes=12 * _slot(model_dir), state_dir=tmp_path)
    try:
        old = session.provider
        with pytest.raises(CacheBudgetError, match="minimum is top_k 2 x 3 MoE layers"):
            session.rebuild(cache_bytes=5 * _slot(model_dir))
        assert session.provider is old and not old.arena._mmap.closed
        assert len(_generate(model, 4)) == 4
    finally:
        model.close()


def test_a_new_cache_that_cannot_get_its_memory_gives_way_to_one_of_the_old_budget(
        model_dir, tmp_path, monkeypatch):
    model, session = open_model(model_dir, threads=1, cache_bytes=12 * _slot(model_dir), state_dir=tmp_path)
    try:
        before = _generate(model)
        real = session_mod.StreamingExpertProvider
        calls = []

        def failing_once(*args, **kwargs):
            calls.append(args[2].cache_bytes)
            if len(calls) == 1:
                raise OSError(12, "Cannot allocate memory")
            return real(*args, **kwargs)
        monkeypatch.setattr(session_mod, "StreamingExpertProvider", failing_once)
        with pytest.raises(OSError, match="Cannot allocate memory"):
            session.rebuild(cache_bytes=20 * _slot(model_dir))
        assert calls == [20 * _slot(model_dir), 12 * _slot(model_dir)]
        assert session.options.cache_bytes == 12 * _slot(model_dir)
        assert model.experts is session.provider and session.provider.cache.total_slots == 12
        assert _generate(model) == before
    finally:
        model.close()
