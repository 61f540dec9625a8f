"""The streaming expert provider: placement changes speed, never output.

Greedy tokens and every step's logits must be bit-identical to the memory-mapped
reference at every cache size moed accepts, with prefetch and pins on and off, with
1 or 2 compute threads and 1 or 4 io workers, for bf16 experts and for the low-bit
formats (FP8 with block scales, MXFP4: several pieces per expert in one slot); usage
learned in one session is pinned in the next.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from repacked_models import REPACKED, make_in_format

from daemon.store import streaming
from daemon.store.plans import plans_for
from daemon.store.reads import PIN_LOAD, PREFETCH, ExpertReadError, IoPool
from daemon.store.state import StateStore
from daemon.store.streaming import (StreamingExpertProvider, StreamingOptions, flush_usage,
                                    load_usage_counts, minimum_cache_bytes)
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from ext.models.model import Model
from scheduler.cache import CacheBudgetError

PROMPT = [5, 17, 3, 99, 42, 7, 250, 31]
STEPS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("stream") / "m", arch="qwen3_moe", layers=3,
                      experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16",
                      shard_size=40_000, seed=11, initializer_range=0.2)


def _run(model: Model, prompt=PROMPT, steps=STEPS) -> tuple[list[int], list[np.ndarray]]:
    seq = model.new_sequence()
    logits = model.forward(seq, prompt)
    tokens, all_logits = [], [logits]
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits = model.forward(seq, [tokens[-1]])
        all_logits.append(logits)
    return tokens, all_logits


def _streaming(model_dir: Path, n_threads=2, counts=None, numerics="exact", **options) -> Model:
    config = load_config(model_dir)
    checkpoint = Checkpoint(model_dir)
    layout = ExpertLayout(checkpoint, config)
    provider = StreamingExpertProvider(layout, config, StreamingOptions(**options), usage_counts=counts)
    return Model(config, checkpoint, layout, provider, n_threads, numerics)


@pytest.fixture(scope="module")
def reference(model_dir):
    return _run(Model.load(model_dir, n_threads=2, experts="mmap", numerics="exact"))


def _slot_bytes(model_dir: Path) -> int:
    config = load_config(model_dir)
    layout = ExpertLayout(Checkpoint(model_dir), config)
    return max(p.slot_bytes for p in plans_for(layout).values())


# A floor of 0 makes every candidate a prefetch, read at once ("eager") or only into idle
# io workers after the layer before has its experts ("idle"): the riskiest placements.
# "staged": every candidate of the next two layers, into a staging tier of 3 slots. The
# referee is off so that they run every step (it would soon turn such guesses off; the
# referee's own switching is checked in test_adaptive).
PREFETCH_MODES = {"off": dict(prefetch=False),
                  "eager": dict(prefetch=True, prefetch_min_precision=0.0, referee=False),
                  "idle": dict(prefetch=True, prefetch_min_precision=1.0,
                               idle_prefetch_min_precision=0.0, referee=False),
                  "staged": dict(prefetch=True, prefetch_min_precision=0.0, staging_slots=3,
                                 prefetch_depth=2, referee=False)}


@pytest.mark.parametrize("slots", ["min", "quarter", "half", "all"])
@pytest.mark.parametrize("prefetch", sorted(PREFETCH_MODES))
@pytest.mark.parametrize("n_threads,io_workers", [(1, 1), (2, 4)])
def test_tokens_and_logits_identical_at_every_placement(model_dir, reference, slots, prefetch,
                                                        n_threads, io_workers):
    _check_placement(model_dir, reference, slots, prefetch, n_threads, io_workers)


LOWBIT = ("fp8", "mxfp4", *REPACKED)
# The low-bit formats run the same grid; by default a diagonal through it (every cache
# size, every prefetch mode, both thread/io settings), the rest with -m slow.
_DIAGONAL = {("min", "eager", 1), ("quarter", "idle", 2), ("half", "staged", 1),
             ("all", "off", 2), ("half", "eager", 2), ("min", "staged", 2)}
LOWBIT_PLACEMENTS = [
    pytest.param(dtype, slots, prefetch, n_threads, io_workers,
                 id=f"{dtype}-{slots}-{prefetch}-t{n_threads}-io{io_workers}",
                 marks=() if (slots, prefetch, n_threads) in _DIAGONAL else pytest.mark.slow)
    for dtype in LOWBIT for slots in ("min", "quarter", "half", "all")
    for prefetch in sorted(PREFETCH_MODES) for n_threads, io_workers in ((1, 1), (2, 4))]


@pytest.fixture(scope="module")
def lowbit(tmp_path_factory):
    """get(dtype) -> (model dir, mmap reference run) of the fixture model in that format."""
    cache = {}

    def get(dtype: str):
        if dtype not in cache:
            d = make_in_format(tmp_path_factory.mktemp(f"stream-{dtype}") / "m", dtype,
                               arch="qwen3_moe", layers=3, experts=8, top_k=2, hidden=64,
                               intermediate=32, shard_size=20_000, seed=11, initializer_range=0.2)
            cache[dtype] = d, _run(Model.load(d, n_threads=2, experts="mmap", numerics="exact"))
        return cache[dtype]

    return get


@pytest.mark.parametrize("dtype, slots, prefetch, n_threads, io_workers", LOWBIT_PLACEMENTS)
def test_lowbit_tokens_and_logits_identical_at_every_placement(lowbit, dtype, slots, prefetch,
                                                               n_threads, io_workers):
    model_dir, reference = lowbit(dtype)
    _check_placement(model_dir, reference, slots, prefetch, n_threads, io_workers)


# Fast numerics (int8 activations) changes the bits of these formats, never their
# independence from placement: the same grid in fast mode, against a fast mmap run.
FAST = ("mxfp4", *REPACKED)
FAST_PLACEMENTS = [p for p in LOWBIT_PLACEMENTS if p.values[0] in FAST]


@pytest.fixture(scope="module")
def lowbit_fast(lowbit):
    """get(dtype) -> (model dir, fast mmap reference run), and that run differs from
    exact numerics' (so the fast path really ran)."""
    cache = {}

    def get(dtype: str):
        if dtype not in cache:
            d, exact = lowbit(dtype)
            fast = _run(Model.load(d, n_threads=2, experts="mmap", numerics="fast"))
            assert any(not np.array_equal(a, b) for a, b in zip(fast[1], exact[1]))
            cache[dtype] = d, fast
        return cache[dtype]

    return get


@pytest.mark.parametrize("dtype, slots, prefetch, n_threads, io_workers", FAST_PLACEMENTS)
def test_fast_numerics_tokens_and_logits_identical_at_every_placement(lowbit_fast, dtype, slots,
                                                                      prefetch, n_threads, io_workers):
    model_dir, reference = lowbit_fast(dtype)
    _check_placement(model_dir, reference, slots, prefetch, n_threads, io_workers, numerics="fast")


@pytest.mark.parametrize("dtype", LOWBIT)
def test_lowbit_slots_hold_every_piece_and_are_smaller(model_dir, lowbit, dtype):
    """A low-bit expert's slot holds its weights and scales (one plan, aligned spans) and
    is smaller than the bf16 expert's: the bytes a miss costs follow the format."""
    d, _ = lowbit(dtype)
    layout, config = _layout_config(d)
    loc = layout[(1, 5)]
    pieces = {"fp8": 6, "mxfp4": 6, "int4": 9, "int8": 6}[dtype]          # int4: codes, scale, min
    assert len(loc.pieces()) == pieces
    assert layout.format == {"fp8": "fp8_e4m3", "mxfp4": "mxfp4"}.get(dtype, dtype)
    plan = plans_for(layout)[(1, 5)]
    assert [p.info for p in plan.placements] == list(loc.pieces())
    assert plan.slot_bytes == sum(s.length for s in plan.spans)
    bf16 = _layout_config(model_dir)[0][(1, 5)].nbytes
    assert loc.nbytes == {"fp8": bf16 // 2 + 3 * 4, "mxfp4": bf16 // 4 + 3 * 32 * 2,
                          "int4": bf16 // 4 + 3 * 2 * 128, "int8": bf16 // 2 + 3 * 128}[dtype]
    if dtype in REPACKED:      # one expert, one aligned span
        assert len(plan.spans) == 1 and plan.spans[0].offset % 4096 == 0
    assert minimum_cache_bytes(layout, config) == 2 * 3 * _slot_bytes(d)


def _check_placement(model_dir, reference, slots, prefetch, n_threads, io_workers, numerics="exact"):
    slot = _slot_bytes(model_dir)
    n = {"min": 2 * 3, "quarter": 3 * 8 // 4, "half": 3 * 8 // 2, "all": 3 * 8}[slots]
    model = _streaming(model_dir, n_threads=n_threads, cache_bytes=n * slot, numerics=numerics,
                       io_workers=io_workers, **PREFETCH_MODES[prefetch])
    tokens, logits = _run(model)
    assert tokens == reference[0]
    for got, want in zip(logits, reference[1]):
        assert np.array_equal(got, want)
    snap = model.experts.cache.snapshot()
    assert snap.lookups > 0
    # Staging needs slots above the minimum and below all experts: only "half" has them
    # (default: 3/4 of top_k 2 = 1 slot).
    staging = 0 if slots != "half" or prefetch == "off" else 3 if prefetch == "staged" else 1
    assert snap.staging_slots == staging
    if slots == "all" and not prefetch:
        assert sum(snap.misses) <= 3 * 8  # each expert read at most once
    model.close()


@pytest.mark.parametrize("dtype", ["bf16", *LOWBIT])
def test_pins_on_and_long_prefill_in_batches(model_dir, lowbit, dtype):
    """Learned pins and a prompt whose chunk touches more experts than the cache holds."""
    if dtype != "bf16":
        model_dir, _ = lowbit(dtype)
    counts = np.zeros((3, 8))
    counts[:, :3] = [30.0, 20.0, 10.0]
    slot = _slot_bytes(model_dir)
    long_prompt = list(range(1, 80))
    want = _run(Model.load(model_dir, n_threads=2, numerics="exact"), long_prompt, 4)
    model = _streaming(model_dir, counts=counts, cache_bytes=10 * slot, pin_fraction=1.0,
                       learn_pins=False)
    assert (model.experts.cache.pinned_slots, model.experts.cache.staging_slots) == (4, 0)
    got = _run(model, long_prompt, 4)
    assert got[0] == want[0]
    assert all(np.array_equal(a, b) for a, b in zip(got[1], want[1]))
    assert model.experts.cache.pins <= {(l, e) for l in range(3) for e in range(3)}
    model.close()


def test_budget_below_minimum_is_refused_with_the_minimum(model_dir):
    slot = _slot_bytes(model_dir)
    with pytest.raises(CacheBudgetError) as e:
        _streaming(model_dir, cache_bytes=6 * slot - 1)
    assert str(6 * slot) in str(e.value)
    config = load_config(model_dir)
    assert minimum_cache_bytes(ExpertLayout(Checkpoint(model_dir), config), config) == 6 * slot


def test_usage_survives_a_restart_and_the_second_session_hits(model_dir, tmp_path):
    """A restart pins what the previous session learned: its first tokens hit."""
    config = load_config(model_dir)
    fingerprint = Checkpoint(model_dir).fingerprint()
    store = StateStore(tmp_path, fingerprint)
    moe_layers = [0, 1, 2]
    slot = _slot_bytes(model_dir)
    budget = 12 * slot

    first = _streaming(model_dir, cache_bytes=budget, prefetch=False)
    tokens, _ = _run(first)
    first_misses = sum(first.experts.cache.snapshot().misses)
    flush_usage(store, first.experts.usage, fingerprint)
    first.close()

    counts = load_usage_counts(store, moe_layers, config.num_experts, fingerprint, 2048.0)
    assert counts is not None and counts.sum() > 0
    second = _streaming(model_dir, counts=counts, cache_bytes=budget, prefetch=False,
                        pin_fraction=1.0, learn_pins=False)
    # pin loads are reads issued at start; the session's own lookups then hit them
    again, _ = _run(second)
    assert again == tokens
    snap = second.experts.cache.snapshot()
    assert sum(snap.hits) + sum(snap.prefetch_hits) > 0
    assert sum(snap.misses) < first_misses
    second.close()


def test_bytes_read_equal_the_io_workers_count(model_dir):
    """bytes_read = issued aligned lengths, demand plus prefetch, as the io workers count them."""
    slot = _slot_bytes(model_dir)
    model = _streaming(model_dir, cache_bytes=8 * slot, prefetch=True, prefetch_min_precision=0.0)
    _run(model)
    provider = model.experts
    provider.io.close()  # let queued prefetches finish before comparing counters
    stats = provider.io.stats()
    assert stats.read_errors == 0
    for reason in ("demand", "prefetch"):
        assert provider.bytes_submitted[reason] == stats.bytes_issued[reason]
    assert provider.bytes_submitted["demand"] > 0 and provider.bytes_submitted["prefetch"] > 0
    misses = sum(provider.cache.snapshot().misses)
    assert stats.reads_completed["demand"] == misses


@pytest.mark.parametrize("field,value", [("pin_fraction", float("nan")), ("pin_fraction", 1.1),
                                         ("pin_fraction", -0.1), ("io_workers", 0),
                                         ("staging_slots", -1), ("prefetch_depth", 3)])
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        StreamingOptions(cache_bytes=1 << 20, **{field: value})


def test_unusable_state_dir_warns_and_generation_goes_on(model_dir, tmp_path, capsys):
    from daemon.commands.cli import main

    not_a_dir = tmp_path / "afile"
    not_a_dir.write_text("")
    assert main(["generate", "--model", str(model_dir), "--max-tokens", "4",
                 "--expert-cache-bytes", str(10 * _slot_bytes(model_dir)),
                 "--state-dir", str(not_a_dir), "hi"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() != "" or out == "\n"
    assert "state_dir_unusable" in err


@pytest.mark.parametrize("min_precision,expect_prefetches", [(0.0, True), (1.0, False)])
def test_prefetch_is_gated_by_the_predictors_measured_precision(model_dir, reference, min_precision,
                                                               expect_prefetches):
    """Every decode step scores the next-layer prediction; a precision floor of 1 is never
    reached (the Beta prior keeps estimates below 1), so nothing is prefetched."""
    model = _streaming(model_dir, cache_bytes=2 * minimum_cache_bytes(*_layout_config(model_dir)),
                       prefetch_min_precision=min_precision, idle_prefetch_min_precision=1.0,
                       referee=False)
    try:
        tokens, _ = _run(model)
        provider = model.experts
        moe_layers = len(provider.moe_layers)
        # One prediction per MoE layer after the first, per step; the last step's are still open.
        assert provider.calibration[(True, 1)].observations == (STEPS - 1) * (moe_layers - 1)
        assert provider.calibration[(False, 1)].observations == moe_layers - 1   # the prompt
        assert all(0.0 < p < 1.0 for p in provider.calibration[(True, 1)].precisions())
        issued = sum(provider.cache.snapshot().prefetches_issued)
        assert (issued > 0) == expect_prefetches
        assert tokens == reference[0]
    finally:
        model.close()


def _layout_config(model_dir: Path):
    config = load_config(model_dir)
    return ExpertLayout(Checkpoint(model_dir), config), config


def test_prefetch_min_precision_is_validated():
    with pytest.raises(ValueError, match="prefetch_min_precision"):
        StreamingOptions(cache_bytes=1, prefetch_min_precision=1.5)
    with pytest.raises(ValueError, match="idle_prefetch_min_precision"):
        StreamingOptions(cache_bytes=1, idle_prefetch_min_precision=-0.1)


class _HeldPrefetchPool:
    """Stands in for the io pool: demand reads finish at once, prefetches stay in flight."""

    def __init__(self, n_workers: int):
        self.n_workers = n_workers
        self.submitted: list[tuple[int, int, str]] = []

    def submit(self, plan, buffer, reason):
        self.submitted.append((plan.layer, plan.expert, reason))
        future = Future()
        if reason != PREFETCH:
            future.set_result(plan.slot_bytes)
        return future

    def prefetches(self, layer: int) -> list[int]:
        return [e for l, e, r in self.submitted if l == layer and r == PREFETCH]

    def expedite(self, future) -> bool:
        return False                                   # held reads have started

    def close(self):
        pass


def _idle_prefetch_provider(model_dir: Path, idle_min: float, workers: int = 2, depth: int = 1):
    layout, config = _layout_config(model_dir)
    provider = StreamingExpertProvider(
        layout, config, StreamingOptions(cache_bytes=(24 if depth == 1 else 20) * _slot_bytes(model_dir),
                                         prefetch_width=4, prefetch_min_precision=0.9,
                                         idle_prefetch_min_precision=idle_min,
                                         staging_slots=0 if depth == 1 else 5,
                                         prefetch_depth=depth, referee=False, learn_pins=False,
                                         early_hints=False))
    provider.io.close()
    provider.io = _HeldPrefetchPool(workers)
    return provider


def _ranked_logits(order: list[int], experts: int = 8) -> np.ndarray:
    logits = np.zeros((1, experts), np.float32)
    for rank, e in enumerate(order):
        logits[0, e] = 10.0 - rank
    return logits


def test_unsure_candidates_wait_for_the_layers_reads_then_take_only_idle_workers(model_dir):
    """A fresh predictor's precision is 0.5 at every rank: below the 0.9 floor, above 0.4.
    Nothing is read at the hint; after layer 0's experts arrive, the best candidates of
    layer 1 take the two idle workers, and no more."""
    provider = _idle_prefetch_provider(model_dir, idle_min=0.4)
    try:
        provider.begin_step(1)
        provider.hint(1, _ranked_logits([6, 2, 5, 1]))
        assert provider.io.prefetches(1) == []
        provider.acquire(0, [0, 3])
        assert provider.io.prefetches(1) == [6, 2]
        provider.release(0, [0, 3])
        # The next step: both of those reads are still in flight, so no worker is idle.
        provider.begin_step(1)
        provider.hint(1, _ranked_logits([4, 7, 5, 1]))
        provider.acquire(0, [0, 3])
        assert provider.io.prefetches(1) == [6, 2]
    finally:
        provider.close()


def test_idle_prefetch_counts_our_busy_reads_and_respects_its_floor(model_dir):
    provider = _idle_prefetch_provider(model_dir, idle_min=0.4, workers=3)
    try:
        provider.begin_step(1)
        provider._prefetch(2, 7, 0.95, "likely")       # one read of ours keeps a worker busy
        provider.hint(1, _ranked_logits([6, 2, 5, 1]))
        provider.acquire(0, [0, 3])
        assert provider.io.prefetches(1) == [6, 2]
    finally:
        provider.close()
    provider = _idle_prefetch_provider(model_dir, idle_min=0.6)
    try:
        provider.begin_step(1)
        provider.hint(1, _ranked_logits([6, 2, 5, 1]))
        provider.acquire(0, [0, 3])
        assert provider.io.submitted and provider.io.prefetches(1) == []
    finally:
        provider.close()


def test_nearer_layers_candidates_take_idle_workers_first(model_dir):
    """With prefetch_depth 2 the layer after next is hinted too; its candidates take only
    the idle workers the next layer's candidates left, and only at that distance's own
    measured precision (fresh: 0.5, above the 0.4 floor)."""
    provider = _idle_prefetch_provider(model_dir, idle_min=0.4, workers=5, depth=2)
    try:
        provider.begin_step(1)
        provider.hint(1, _ranked_logits([6, 2, 0, 1]), ahead=1)   # width 4
        provider.hint(2, _ranked_logits([3, 4, 5, 6]), ahead=2)
        assert provider.io.submitted == []
        provider.acquire(0, [0, 3])
        assert provider.io.prefetches(1) == [6, 2, 0, 1] and provider.io.prefetches(2) == [3]
        assert sum(provider.cache.snapshot().resident_staging) == 5
        provider.release(0, [0, 3])
        provider.acquire(1, [3, 4])                  # not the guesses: those never land here
        provider.release(1, [3, 4])
        provider.begin_step(1)                                      # the step stopped after layer 1
        assert provider.calibration[(True, 1)].observations == 1
        assert provider.calibration[(True, 2)].observations == 0   # layer 2 never ran
    finally:
        provider.close()
    provider = _idle_prefetch_provider(model_dir, idle_min=0.4, workers=3, depth=1)
    try:
        provider.begin_step(1)
        provider.hint(2, _ranked_logits([3, 4, 5]), ahead=2)      # beyond the depth: ignored
        provider.acquire(0, [0, 3])
        assert provider.io.prefetches(2) == []
    finally:
        provider.close()


class _FailsWhenAwaited(Future):
    """A read still in flight when the engine looks, which then fails."""

    def __init__(self, error: ExpertReadError):
        super().__init__()
        self.error = error

    def done(self):
        return False

    def result(self, timeout=None):
        raise self.error


class _FailingPrefetchPool(_HeldPrefetchPool):
    """Prefetch reads fail once waited for; demand reads succeed while `demand_ok`."""

    def __init__(self):
        super().__init__(n_workers=2)
        self.demand_ok = True

    def submit(self, plan, buffer, reason):
        self.submitted.append((plan.layer, plan.expert, reason))
        error = ExpertReadError("injected", path="x", tensors=("t",), offset=0,
                                layer=plan.layer, expert=plan.expert)
        if reason == PREFETCH:
            return _FailsWhenAwaited(error)
        future = Future()
        if self.demand_ok:
            future.set_result(plan.slot_bytes)
        else:
            future.set_exception(error)
        return future


def test_a_failed_prefetch_of_a_needed_expert_is_read_again_on_demand(model_dir):
    """A prefetch that failed must not fail the step that needs its expert: one demand
    read decides. Only when that read fails too does the step fail; no slot stays LOADING."""
    layout, config = _layout_config(model_dir)
    provider = StreamingExpertProvider(
        layout, config, StreamingOptions(cache_bytes=24 * _slot_bytes(model_dir),
                                         prefetch_min_precision=0.0,
                                         idle_prefetch_min_precision=1.0, referee=False,
                                         learn_pins=False, early_hints=False))
    provider.io.close()
    provider.io = pool = _FailingPrefetchPool()
    try:
        provider.begin_step(1)
        provider.hint(1, _ranked_logits([6, 2]))
        assert pool.prefetches(1) == [6, 2]
        provider.acquire(1, [6, 3])                   # 6 was being prefetched, and that failed
        provider.release(1, [6, 3])
        assert [e for l, e, r in pool.submitted if l == 1 and r == "demand"] == [3, 6]
        assert (provider.demand_rereads, provider.read_failures) == (1, 1)
        snap = provider.cache.snapshot()
        assert snap.loading[1] == 1                   # 2: still "in flight"
        assert snap.resident_dynamic[1] == 3 and snap.prefetch_hits[1] == 1
        provider.begin_step(1)
        provider.hint(1, _ranked_logits([5]))
        pool.demand_ok = False
        with pytest.raises(ExpertReadError, match="injected"):
            provider.acquire(1, [5])
        snap = provider.cache.snapshot()
        assert snap.loading[1] == 1 and snap.resident_dynamic[1] == 3   # 5 freed; 6, 3, 2 stay
        assert (provider.demand_rereads, provider.read_failures) == (2, 3)
    finally:
        provider.close()


class _SlowPinLoads(IoPool):
    """A disk on which pin loads take 0.3 s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._before_read = lambda plan, reason: time.sleep(0.3) if reason == PIN_LOAD else None


def test_a_demoted_pin_still_loading_is_waited_for_not_a_full_cache(model_dir, monkeypatch):
    """Pins re-evaluated while a pin load is in flight: the old pin's slot, still LOADING,
    is demoted into its layer's dynamic tier. A step that then needs every dynamic slot of
    that layer waits for the read instead of failing with CacheFullError."""
    layout, config = _layout_config(model_dir)
    counts = np.zeros((3, 8))
    counts[0, 7] = 100.0
    monkeypatch.setattr(streaming, "IoPool", _SlowPinLoads)
    provider = StreamingExpertProvider(
        layout, config, StreamingOptions(cache_bytes=7 * _slot_bytes(model_dir), pin_fraction=1.0,
                                         prefetch=False, learn_pins=False), usage_counts=counts)
    try:
        assert provider.cache.pinned_slots == 1 and provider.cache.dynamic_slots(0) == 2
        provider._apply_pins({(1, 5)})            # re-evaluated: layer 0's expert 7 is demoted
        loading = provider.cache.loading_dynamic_slots(0)
        assert len(loading) == 1 and provider.cache.held(loading[0]) == (0, 7)
        provider.begin_step(1)
        provider.acquire(0, [0, 1])               # both dynamic slots needed: waits for the read
        provider.release(0, [0, 1])
        assert {provider.cache.held(s) for s in range(7) if provider.cache.held(s)} >= {(0, 0), (0, 1)}
    finally:
        provider.close()


def test_a_slot_read_anew_keeps_its_views_and_they_hold_the_new_expert(model_dir):
    """Views over a slot are built once per layout: after a slot is read again with
    another expert of the same layout, the weights handed out are the same arrays,
    holding that expert's values (as read straight from the checkpoint)."""
    from ext.models.experts import expert_weights
    from ext.models.weights import read_weight
    config = load_config(model_dir)
    checkpoint = Checkpoint(model_dir)
    layout = ExpertLayout(checkpoint, config)
    slots = config.top_k * len(config.moe_layers)            # the minimum: every miss evicts
    provider = StreamingExpertProvider(layout, config, StreamingOptions(
        cache_bytes=slots * _slot_bytes(model_dir), prefetch=False, referee=False,
        learn_pins=False, pin_fraction=0.0))
    locations = {(loc.layer, loc.expert): loc for loc in layout}
    layer = config.moe_layers[0]
    seen: dict[int, list] = {}
    kept = []
    try:
        provider.phase = "decode"
        for experts in ([0, 1], [2, 3], [4, 5], [1, 6]):
            provider.begin_step(1)
            weights = provider.acquire(layer, experts)
            for e, w in zip(experts, weights):
                truth = expert_weights(locations[(layer, e)].projections(),
                                       lambda sw: read_weight(checkpoint, sw))
                for got, want in zip(w, truth):
                    if want is not None:
                        assert np.array_equal(np.asarray(got), np.asarray(want))
                kept.append(w)                 # alive: ids are not recycled
                seen.setdefault(id(w.gate), []).append(e)
            provider.release(layer, experts)
            provider.end_step()
        assert any(len(set(es)) > 1 for es in seen.values())    # views reused across experts
    finally:
        provider.close()


def test_a_failed_state_save_names_the_state_file(model_dir, tmp_path, capsys, monkeypatch):
    """A full disk (ENOSPC) while saving what was learned: generation succeeds and the
    warning names the state file the write was for (the OSError itself names none)."""
    import errno

    from daemon.commands.cli import main
    from daemon.store import session as session_module

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(session_module, "flush_usage", full)
    assert main(["generate", "--model", str(model_dir), "--max-tokens", "2",
                 "--expert-cache-bytes", str(10 * _slot_bytes(model_dir)),
                 "--state-dir", str(tmp_path / "state"), "hi"]) == 0
    err = capsys.readouterr().err
    line = next(l for l in err.splitlines() if "state_save_failed" in l)
    assert str(tmp_path / "state") in line and "No space left on device" in line
