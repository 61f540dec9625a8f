"""The prefill chunk from measured throughput (daemon/tuning/prefill.py): the candidates,
the interleaved measurement, the rule that keeps the incumbent unless another chunk
clearly wins, and `moed serve` taking the chunk `moed tune` saved under
prefill_chunk = auto (within its memory plan), never over a configured one or in the
naive cache mode."""
from __future__ import annotations

import numpy as np
import pytest

from daemon.machine.memory import MemoryReading
from daemon.service import loading
from daemon.service.config import ServeConfig
from daemon.tuning.prefill import (PREFILL_CANDIDATES, choose_prefill_chunk, measure_prefill_chunks,
                                   prefill_candidates, prefill_prompt)
from daemon.tuning.saved import PREFILL_CHUNK_SETTING, TunedStore, hardware_facts
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.model import RESIDENT_PREFILL_CHUNK, Model
from log_contract import Lines


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("prefill-tune") / "m", arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=3)


@pytest.mark.parametrize("capacity, want", [
    (1024, [64, 128, 256, 512, 1024]),
    (700, [64, 128, 256, 512, 700]),      # the buffers' own size, between two candidates
    (64, [64]),
    (32, [32]),                           # below every candidate: itself
    (4096, [64, 128, 256, 512, 1024]),    # above them: no larger prompt is measured
])
def test_candidates_are_the_standard_chunks_up_to_the_step_buffers(capacity, want):
    assert prefill_candidates(capacity) == want
    assert PREFILL_CANDIDATES == (64, 128, 256, 512, 1024)


def test_a_step_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match="step capacity must be >= 1, got 0"):
        prefill_candidates(0)


def test_the_prompt_is_the_workload_prompts_repeated_to_length():
    ids = prefill_prompt([[1, 2, 3], [4]], 10)
    assert ids.dtype == np.int64 and ids.tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    with pytest.raises(ValueError, match="need prompt ids and tokens >= 1"):
        prefill_prompt([[]], 10)
    with pytest.raises(ValueError, match="need prompt ids and tokens >= 1"):
        prefill_prompt([[1]], 0)


@pytest.mark.parametrize("runs, incumbent, want", [
    ({64: [100, 100, 100], 512: [120, 121, 119]}, 512, 512),      # the incumbent is fastest
    ({64: [130, 131, 129], 512: [120, 121, 119]}, 512, 64),       # 8 % faster in every round
    ({64: [130, 118, 129], 512: [120, 121, 119]}, 512, 512),      # one round lost: the noise
    ({64: [122, 123, 121], 512: [120, 121, 119]}, 512, 512),      # under 3 %: not worth a change
    ({64: [130, 131, 129], 128: [140, 139, 150], 512: [120, 121, 119]}, 512, 128),  # the fastest
    ({256: [50.0], 512: [40.0]}, 512, 256),                        # one round: that round decides
])
def test_the_incumbent_stays_unless_a_chunk_wins_every_round_by_three_percent(runs, incumbent, want):
    assert choose_prefill_chunk(runs, incumbent) == want


def test_an_unmeasured_incumbent_is_refused():
    with pytest.raises(ValueError, match="the incumbent chunk 512 was not measured"):
        choose_prefill_chunk({64: [1.0]}, 512)


def test_the_measurement_interleaves_rotates_and_restores_the_models_chunk(model_dir):
    model = Model.load(model_dir, n_threads=1, prefill_chunk=256)
    try:
        model.set_prefill_chunk(128)
        seen: list[int] = []
        runs = measure_prefill_chunks(model, prefill_prompt([[5, 6, 7]], 300), [64, 128, 256], 3,
                                      before_run=lambda: seen.append(model.prefill_chunk))
        assert seen == [64, 128, 256, 128, 256, 64, 256, 64, 128]
        assert {c: len(v) for c, v in runs.items()} == {64: 3, 128: 3, 256: 3}
        assert all(x > 0 for v in runs.values() for x in v)
        assert model.prefill_chunk == 128
        with pytest.raises(ValueError, match=r"chunks \[512\] exceed the step buffers \(256 rows\)"):
            measure_prefill_chunks(model, prefill_prompt([[5]], 10), [64, 512], 1)
        with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
            measure_prefill_chunks(model, prefill_prompt([[5]], 10), [64], 0)
        assert model.prefill_chunk == 128
    finally:
        model.close()


def _save_chunk(model_dir, state_dir, chunk):
    store = TunedStore(state_dir, Checkpoint(model_dir).fingerprint(), hardware_facts(model_dir))
    store.save({PREFILL_CHUNK_SETTING: chunk})


def _served_chunk(model_dir, monkeypatch, **config) -> tuple[int, Lines]:
    monkeypatch.setattr(loading, "read_memory", lambda: MemoryReading(64 << 30, ()))
    log = Lines()
    monkeypatch.setattr(loading, "log", log)
    loaded = loading.load_for_serving(ServeConfig(model=str(model_dir), tuner="off", threads=1,
                                                  prefix_cache_bytes=0, **config), {})
    try:
        return loaded.engine.model.prefill_chunk, log
    finally:
        loaded.close()


def test_serve_takes_the_measured_chunk_under_auto(model_dir, tmp_path, monkeypatch):
    state = tmp_path / "state"
    chunk, log = _served_chunk(model_dir, monkeypatch, state_dir=str(state))
    assert chunk == RESIDENT_PREFILL_CHUNK                              # never tuned: the rule
    [(_, fields)] = log.named("prefill_chunk")
    assert fields["measured"] is None
    _save_chunk(model_dir, state, 128)
    chunk, log = _served_chunk(model_dir, monkeypatch, state_dir=str(state))
    assert chunk == 128
    [(_, fields)] = log.named("prefill_chunk")
    assert (fields["tokens"], fields["measured"], fields["configured"]) == (128, 128, "auto")
    # a configured chunk and the naive cache (which reads no state) keep their own
    assert _served_chunk(model_dir, monkeypatch, state_dir=str(state), prefill_chunk=32)[0] == 32
    slot = loading.plan_serving_memory(model_dir, max_concurrent_sequences=4, pin_fraction=0,
                                       threads=1, reading=MemoryReading(64 << 30, ())).plan.slot_bytes
    naive, _ = _served_chunk(model_dir, monkeypatch, state_dir=str(state), expert_cache_mode="naive",
                             expert_cache_bytes=4 * slot)
    assert naive == loading.auto_prefill_chunk(Model.load(model_dir).config, cache_bytes=4 * slot,
                                               threads=1, context=loading.PLANNED_CONTEXT,
                                               sequences=ServeConfig().max_concurrent_sequences)


def test_a_measured_chunk_never_exceeds_what_a_streaming_cache_allows(model_dir, tmp_path, monkeypatch):
    state = tmp_path / "state"
    _save_chunk(model_dir, state, 4096)
    slot = loading.plan_serving_memory(model_dir, max_concurrent_sequences=4, pin_fraction=0,
                                       threads=1, reading=MemoryReading(64 << 30, ())).plan.slot_bytes
    model = Model.load(model_dir)
    rule = loading.auto_prefill_chunk(model.config, cache_bytes=4 * slot, threads=1,
                                      context=loading.PLANNED_CONTEXT,
                                      sequences=ServeConfig().max_concurrent_sequences)
    model.close()
    chunk, _ = _served_chunk(model_dir, monkeypatch, state_dir=str(state), expert_cache_bytes=4 * slot)
    assert chunk == rule < 4096
    _save_chunk(model_dir, state, 16)
    assert _served_chunk(model_dir, monkeypatch, state_dir=str(state), expert_cache_bytes=4 * slot)[0] == 16


def test_an_unreadable_state_directory_leaves_the_rule_with_a_warning(model_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    chunk, log = _served_chunk(model_dir, monkeypatch, state_dir=str(blocker / "state"))
    assert chunk == RESIDENT_PREFILL_CHUNK
    [(level, fields)] = log.named("tuned_settings_unavailable")
    assert level == "warning" and fields["setting"] == PREFILL_CHUNK_SETTING
