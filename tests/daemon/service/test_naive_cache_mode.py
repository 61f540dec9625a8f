"""expert_cache_mode = "naive": the baseline `moed demo` compares moed's cache against —
LRU, no pins, no prefetch, no referee, and no state directory read or written."""
from __future__ import annotations

import numpy as np
import pytest

from daemon.service import loading
from daemon.service.config import ServeConfig
from daemon.store.plans import plans_for
from daemon.store.session import open_model
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("naive") / "m", arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=5)


def _slot(model_dir) -> int:
    layout = ExpertLayout(Checkpoint(model_dir), load_config(model_dir))
    return max(p.slot_bytes for p in plans_for(layout).values())


class _Opened(Exception):
    pass


@pytest.mark.parametrize("mode, expected", [
    ("naive", dict(baseline=True)),
    ("moed", dict(baseline=False, prefetch=True, pin_fraction=0.5)),
])
def test_the_mode_picks_the_cache_options(model_dir, monkeypatch, mode, expected):
    seen = {}

    def fake_open_model(model_dir, **kw):
        seen.update(kw)
        raise _Opened

    monkeypatch.setattr(loading, "open_model", fake_open_model)
    config = ServeConfig(model=str(model_dir), expert_cache_bytes=8 * _slot(model_dir),
                         expert_cache_mode=mode)
    with pytest.raises(_Opened):
        loading.load_for_serving(config, {})
    assert {k: seen.get(k) for k in expected} == expected


def test_the_naive_cache_learns_nothing_and_saves_nothing(model_dir, tmp_path):
    model, session = open_model(model_dir, threads=1, cache_bytes=5 * _slot(model_dir),
                                state_dir=tmp_path, prefetch=True, pin_fraction=0.5,
                                baseline=True)
    try:
        assert session.store is None
        cache = session.provider.cache
        assert cache.policy_name == "lru" and cache.pinned_slots == 0 and cache.staging_slots == 0
        seq = model.new_sequence()
        logits = model.forward(seq, [1, 2, 3])
        for _ in range(6):
            logits = model.forward(seq, [int(np.argmax(logits[-1]))])
        assert session.provider.cache.snapshot().hit_rate < 1.0    # it streamed experts
        assert session.flush() is False                  # what a daemon does on SIGTERM
        session.rebuild(cache_bytes=6 * _slot(model_dir), pin_fraction=1.0, prefetch=True)
        cache = session.provider.cache                   # a new budget, still naive
        assert cache.policy_name == "lru" and cache.pinned_slots == 0 and cache.staging_slots == 0
        assert (session.options.cache_bytes, session.options.prefetch) == (6 * _slot(model_dir), False)
    finally:
        model.close()
    assert list(tmp_path.iterdir()) == []
