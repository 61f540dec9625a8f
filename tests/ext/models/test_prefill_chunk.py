"""The prefill chunk (Model's `prefill_chunk`, the serving key `prefill_chunk`): any chunk
gives a prompt the same logits, bit for bit, in every numerics mode; the step buffers and
forward_step's limit follow it; "auto" grows it when the experts stream."""
from __future__ import annotations

import numpy as np
import pytest

from daemon.service.loading import auto_prefill_chunk, workspace_bytes
from ext.models.config import load_config
from ext.models.model import PREFILL_CHUNK, RESIDENT_PREFILL_CHUNK, STREAMING_PREFILL_CHUNK, Model
from repacked_models import make_in_format

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(530)]     # crosses 512, 64 and 7


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunk")
    shape = dict(arch="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64, intermediate=32, seed=9,
                 initializer_range=0.2)
    int4 = make_in_format(root / "int4", "int4", **shape)
    return {"int4": int4, "bf16": root / "int4-bf16"}


def _logits(model_dir, numerics, chunk):
    model = Model.load(model_dir, n_threads=2, numerics=numerics, prefill_chunk=chunk)
    try:
        assert model.prefill_chunk == chunk and model.ws.x.shape[0] == chunk
        return model.forward(model.new_sequence(len(PROMPT)), PROMPT, all_logits=True)
    finally:
        model.close()


@pytest.mark.parametrize("dtype, numerics", [("bf16", "exact"), ("int4", "fast"), ("bf16", "fast-bf16")])
def test_chunkings_1_7_64_and_512_give_the_same_bits(dirs, dtype, numerics):
    want = _logits(dirs[dtype], numerics, 64)
    for chunk in (1, 7, 512):
        got = _logits(dirs[dtype], numerics, chunk)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), chunk


def test_forward_step_takes_at_most_the_chunk(dirs):
    model = Model.load(dirs["bf16"], n_threads=1, prefill_chunk=8)
    try:
        with pytest.raises(ValueError, match="forward_step takes at most 8 tokens in all, got 9"):
            model.forward_step([model.new_sequence()], [list(range(1, 10))])
        model.forward_step([model.new_sequence()], [list(range(1, 9))])
    finally:
        model.close()
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1, got 0"):
        Model.load(dirs["bf16"], prefill_chunk=0)


def test_the_chunk_moves_below_the_step_buffers_without_changing_a_bit(dirs):
    want = _logits(dirs["int4"], "fast", 64)
    model = Model.load(dirs["int4"], n_threads=2, numerics="fast", prefill_chunk=64)
    try:
        assert model.step_capacity == 64
        for chunk in (7, 64, 1):
            model.set_prefill_chunk(chunk)
            got = model.forward(model.new_sequence(len(PROMPT)), PROMPT, all_logits=True)
            assert model.prefill_chunk == chunk and model.ws.x.shape[0] == 64
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), chunk
        for bad in (0, 65, True, 7.0):
            with pytest.raises(ValueError, match=r"prefill_chunk must be an int in 1\.\.64 \(the step "
                                                 r"buffers' rows\), got"):
                model.set_prefill_chunk(bad)
        assert model.prefill_chunk == 1
    finally:
        model.close()


def test_auto_chunk_grows_when_experts_stream_within_a_quarter_of_the_cache(dirs):
    config = load_config(dirs["bf16"])
    kw = dict(threads=2, context=4096, sequences=4)
    assert auto_prefill_chunk(config, cache_bytes=None, **kw) == RESIDENT_PREFILL_CHUNK
    assert auto_prefill_chunk(config, cache_bytes=1 << 40, **kw) == STREAMING_PREFILL_CHUNK
    base = workspace_bytes(config, **kw)
    extra = {c: workspace_bytes(config, chunk=c, **kw) - base for c in (128, 256, 512, 1024)}
    # a cache whose quarter holds 256 tokens' buffers and not 512's
    cache = 4 * (extra[256] + extra[512]) // 2
    assert auto_prefill_chunk(config, cache_bytes=cache, **kw) == 256
    assert auto_prefill_chunk(config, cache_bytes=4 * extra[128] - 8, **kw) == PREFILL_CHUNK
    assert workspace_bytes(config, chunk=1024, **kw) > workspace_bytes(config, **kw)


def test_a_larger_chunk_is_taken_only_when_its_plan_keeps_everything_else():
    from types import SimpleNamespace as NS

    from daemon.service.loading import _plan_for_chunk
    from scheduler.planner import MemoryPlanError

    def serving(stream=False, context=8192, sequences=4):
        return NS(stream=stream, context=context, plan=NS(max_concurrent_sequences=sequences))
    base = serving()
    same = serving()
    assert _plan_for_chunk(lambda c: same, base, 512) == (same, 512)
    for worse in (serving(stream=True), serving(context=4096), serving(sequences=2)):
        assert _plan_for_chunk(lambda c, w=worse: w, base, 512) == (base, PREFILL_CHUNK)

    def refuse(chunk):
        raise MemoryPlanError("no room")
    assert _plan_for_chunk(refuse, base, 1024) == (base, PREFILL_CHUNK)
