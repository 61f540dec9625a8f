"""What the expert cache learns is keyed by the model's identity, not its path: a model
directory moved, copied or reinstalled elsewhere (an editable reinstall moves the
embedded default model from site-packages into the checkout) finds the state an earlier
run saved, and another model does not (daemon/store/state.py, Checkpoint.fingerprint)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from daemon.store.plans import plans_for
from daemon.store.session import open_model
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout

LAYERS, EXPERTS, TOP_K = 2, 8, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("installed") / "default_model", arch="qwen3_moe",
                      layers=LAYERS, experts=EXPERTS, top_k=TOP_K, hidden=64, intermediate=32,
                      dtype="bf16", seed=5)


def _cache_bytes(model_dir) -> int:
    with Checkpoint(model_dir) as checkpoint:
        layout = ExpertLayout(checkpoint, load_config(model_dir))
        slot = max(p.slot_bytes for p in plans_for(layout).values())
    return 6 * slot


def _learn(model_dir, state_dir) -> np.ndarray:
    """Decode a few tokens with a streamed cache, save what was learned; the counts."""
    model, session = open_model(model_dir, threads=1, cache_bytes=_cache_bytes(model_dir),
                                state_dir=state_dir)
    try:
        seq = model.new_sequence()
        logits = model.forward(seq, [1, 2, 3, 4])
        for _ in range(8):
            logits = model.forward(seq, [int(np.argmax(logits[-1]))])
        assert session.flush()
        return session.provider.usage.counts().copy()
    finally:
        model.close()


def _loaded_counts(model_dir, state_dir) -> np.ndarray:
    model, session = open_model(model_dir, threads=1, cache_bytes=_cache_bytes(model_dir),
                                state_dir=state_dir)
    try:
        return session.provider.usage.counts().copy()
    finally:
        model.close()


def test_a_model_at_another_path_finds_what_was_learned(model_dir, tmp_path):
    state_dir = tmp_path / "state"
    learned = _learn(model_dir, state_dir)
    assert learned.sum() > 0
    elsewhere = tmp_path / "checkout" / "daemon" / "default_model"
    shutil.copytree(model_dir, elsewhere)
    np.testing.assert_allclose(_loaded_counts(elsewhere, state_dir), learned, rtol=1e-6)
    files = sorted(p.name for p in state_dir.glob("usage-*.json"))
    assert len(files) == 1                                  # one model, one state file
    record = json.loads((state_dir / files[0]).read_text())
    with Checkpoint(elsewhere) as checkpoint:
        assert record["fingerprint"] == checkpoint.fingerprint()
    assert str(model_dir) not in (state_dir / files[0]).read_text()


def test_another_model_does_not_take_it(model_dir, tmp_path):
    state_dir = tmp_path / "state"
    _learn(model_dir, state_dir)
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 2   # another model, same tensors
    (other / "config.json").write_text(json.dumps(config))
    assert _loaded_counts(other, state_dir).sum() == 0
