"""The self-tuner at work on a loaded model (daemon/tuning/): the tuned-settings file,
live knobs, the routing recorder, the A/B driver and `moed tune`.

Placement never changes output: tokens and logits generated while prefetch width, io
workers and compute threads are switched between decode steps are bit-identical to a
run with the defaults. The A/B driver runs on a real tiny streamed model with a fake
clock (a known cost surface over the live settings), so its decisions are exact.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import daemon.tuning.search as search
from daemon.commands.cli import main
from daemon.store.plans import plans_for
from daemon.store.session import open_model
from daemon.store.state import StateStore
from daemon.store.streaming import StreamingExpertProvider, StreamingOptions
from daemon.tuning.knobs import IO_WORKERS, PREFETCH_WIDTH, THREADS, LiveKnobs
from daemon.tuning.saved import TunedStore, hardware_facts, hardware_fingerprint
from daemon.tuning.search import check_tokens, tune
from daemon.tuning.workload import RoutingRecorder, Workload
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from ext.models.model import Model
from scheduler.tuner import Knob

PROMPT = [5, 17, 3, 99, 42, 7, 250, 31]
LAYERS, EXPERTS, TOP_K = 3, 8, 2
FP = "0123456789abcdef" + "f" * 48      # a sha256-sized model fingerprint
FACTS = {"cpu": "Test CPU 9000", "cpus": 2, "mem_total_bytes": 8 << 30, "machine": "x86_64",
         "disk": "nvme0n1"}
SETTINGS = {THREADS: 2, IO_WORKERS: 4, PREFETCH_WIDTH: 3, "cache_bytes": 196608,
            "pin_fraction": 0.25}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("tuning") / "m", arch="qwen3_moe", layers=LAYERS,
                      experts=EXPERTS, top_k=TOP_K, hidden=64, intermediate=32, dtype="bf16",
                      shard_size=40_000, seed=11, initializer_range=0.2, routing_skew=1.0)


@pytest.fixture(scope="module")
def slot_bytes(model_dir) -> int:
    model, session = open_model(model_dir, threads=1, cache_bytes=10**9,
                                state_dir=model_dir.parent / "state")
    try:
        return session.provider.slot_bytes
    finally:
        model.close()


def _greedy(model: Model, steps: int, before_step=None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decode of PROMPT; before_step(i) runs before decode step i."""
    seq = model.new_sequence()
    logits = model.forward(seq, PROMPT)
    tokens, all_logits = [], [logits.copy()]
    for i in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        if before_step is not None:
            before_step(i)
        logits = model.forward(seq, [tokens[-1]])
        all_logits.append(logits.copy())
    return tokens, all_logits


def _streamed(model_dir: Path, cache_bytes: int, n_threads: int = 2, **options) -> Model:
    """A streamed model built by hand (for options open_model does not take)."""
    config = load_config(model_dir)
    checkpoint = Checkpoint(model_dir)
    layout = ExpertLayout(checkpoint, config)
    provider = StreamingExpertProvider(layout, config,
                                       StreamingOptions(cache_bytes=cache_bytes, **options))
    return Model(config, checkpoint, layout, provider, n_threads)


# ------------------------------------------------------------------ the tuned file

def test_state_file_kinds_have_separate_files_and_unknown_kinds_are_refused(tmp_path):
    usage = StateStore(tmp_path, FP)
    tuned = StateStore(tmp_path, FP, kind="tuned")
    assert usage.path == tmp_path / f"usage-{FP[:16]}.json"
    assert tuned.path == tmp_path / f"tuned-{FP[:16]}.json"
    assert tuned.lock_path != usage.lock_path
    tuned.save(lambda _current: {"settings": 1})
    assert usage.load() is None                 # the usage file is untouched
    assert tuned.load() == {"settings": 1}
    with pytest.raises(ValueError, match="'usage', 'tuned' or 'experts', got 'cache'"):
        StateStore(tmp_path, FP, kind="cache")


def test_tuned_settings_round_trip_per_model(tmp_path):
    TunedStore(tmp_path, FP, FACTS).save(SETTINGS, {"tokens_per_second": {"ratio": 1.2}})
    store = TunedStore(tmp_path, FP, dict(FACTS))
    assert store.path == tmp_path / f"tuned-{FP[:16]}.json"
    assert store.load() == SETTINGS
    payload = json.loads(store.path.read_text())["payload"]
    assert payload["hardware_facts"] == FACTS      # what a later load names when it changed
    assert payload["report"] == {"tokens_per_second": {"ratio": 1.2}}
    other_model = "fedcba9876543210" + "0" * 48
    assert TunedStore(tmp_path, other_model, FACTS).load() is None
    assert StateStore(tmp_path, FP).load() is None      # nothing in the usage file


@pytest.mark.parametrize("fact, value", [("cpus", 8), ("disk", "sda"), ("mem_total_bytes", 4 << 30)])
def test_settings_from_other_hardware_are_ignored_with_a_warning_naming_the_change(
        tmp_path, log_records, fact, value):
    TunedStore(tmp_path, FP, FACTS).save(SETTINGS)
    records = log_records("moed.tuning")
    assert TunedStore(tmp_path, FP, {**FACTS, fact: value}).load() is None
    [warning] = [r for r in records if r["event"] == "tuned_settings_invalidated"]
    assert warning["level"] == "warning"
    assert warning["reason"] == "hardware changed" and warning["changed"] == [fact]
    # Ignored, not destroyed: the hardware it was tuned on still gets it.
    assert TunedStore(tmp_path, FP, FACTS).load() == SETTINGS


def test_a_corrupt_tuned_file_is_set_aside_and_load_returns_none(tmp_path, log_records):
    store = TunedStore(tmp_path, FP, FACTS)
    store.path.write_bytes(b'{"version": 1, "fingerpr')
    records = log_records("moed.state")
    assert store.load() is None
    assert not store.path.exists()
    assert len(list(tmp_path.glob(f"tuned-{FP[:16]}.json.corrupt-*"))) == 1
    assert any(r["event"] == "state_file_set_aside" for r in records)
    store.save(SETTINGS)                        # and the next save starts afresh
    assert store.load() == SETTINGS


def test_hardware_facts_describe_this_machine_and_are_stable(model_dir):
    facts = hardware_facts(model_dir)
    assert set(facts) == {"cpu", "cpus", "mem_total_bytes", "machine", "disk"}
    assert facts["cpus"] == len(os.sched_getaffinity(0))
    assert facts["mem_total_bytes"] > 0 and facts["cpu"] and facts["disk"]
    assert hardware_fingerprint(hardware_facts(model_dir)) == hardware_fingerprint(facts)
    assert hardware_fingerprint({**facts, "cpus": facts["cpus"] + 1}) != hardware_fingerprint(facts)


# ------------------------------------------------------------------ live knobs

def test_live_knobs_report_and_apply_each_knob_on_a_loaded_model(model_dir, slot_bytes, tmp_path):
    model, session = open_model(model_dir, threads=1, io_workers=2, cache_bytes=12 * slot_bytes,
                                state_dir=tmp_path)
    try:
        live, provider = LiveKnobs(model), session.provider
        assert live.current() == {THREADS: 1, IO_WORKERS: 2, PREFETCH_WIDTH: TOP_K}
        live.apply({THREADS: 2})
        assert live.current() == {THREADS: 2, IO_WORKERS: 2, PREFETCH_WIDTH: TOP_K}
        live.apply({IO_WORKERS: 4, PREFETCH_WIDTH: 0})
        assert live.current() == {THREADS: 2, IO_WORKERS: 4, PREFETCH_WIDTH: 0}
        assert provider.io.stats().n_workers == 4 and provider.wants_hints is False
        live.apply({PREFETCH_WIDTH: 2 * TOP_K})
        assert provider.wants_hints is True and provider.width == 2 * TOP_K
        assert live.current()[PREFETCH_WIDTH] == 2 * TOP_K
        with pytest.raises(ValueError, match="prefetch width must be >= 0"):
            provider.set_prefetch(-1)
        with pytest.raises(ValueError, match="n_workers must be > 0"):
            live.apply({IO_WORKERS: 0})
        assert live.current() == {THREADS: 2, IO_WORKERS: 4, PREFETCH_WIDTH: 2 * TOP_K}
    finally:
        model.close()


def test_prefetch_width_zero_reads_nothing_ahead_and_each_width_keeps_its_calibration(
        model_dir, slot_bytes):
    # A precision floor of 0 lets every candidate be read ahead.
    model = _streamed(model_dir, 12 * slot_bytes, prefetch_min_precision=0.0)
    provider = model.experts
    seq = model.new_sequence()
    token = int(np.argmax(model.forward(seq, PROMPT)[-1]))

    def step() -> None:
        nonlocal token
        token = int(np.argmax(model.forward(seq, [token])[-1]))

    try:
        provider.set_prefetch(2 * TOP_K)
        for _ in range(4):
            step()
        wide = provider.calibration
        assert wide[(True, 1)].max_rank == 2 * TOP_K and wide[(True, 1)].observations > 0
        assert provider.bytes_submitted["prefetch"] > 0
        seen = wide[(True, 1)].observations

        provider.set_prefetch(0)
        read_ahead = provider.bytes_submitted["prefetch"]
        for _ in range(4):
            step()
        assert provider.bytes_submitted["prefetch"] == read_ahead

        provider.set_prefetch(2 * TOP_K)
        step()                                  # predictions of width 2 top_k now pending
        provider.set_prefetch(TOP_K)
        step()
        narrow = provider.calibration
        assert narrow[(True, 1)].max_rank == TOP_K
        # The wide predictions still pending were dropped, not credited to either width.
        assert narrow[(True, 1)].observations == 0
        assert wide[(True, 1)].observations == seen
        provider.set_prefetch(2 * TOP_K)
        assert provider.calibration is wide     # switching back keeps what it learned
    finally:
        model.close()


# Each entry is applied before one decode step, in turn: every value of every knob is
# live for some steps, and the combinations change under a running sequence.
SCHEDULE = [{PREFETCH_WIDTH: 0}, {IO_WORKERS: 4}, {THREADS: 1}, {PREFETCH_WIDTH: 2 * TOP_K},
            {IO_WORKERS: 1}, {PREFETCH_WIDTH: TOP_K}, {THREADS: 2}]
STEPS = 3 * len(SCHEDULE)


@pytest.mark.parametrize("slots", [LAYERS * TOP_K, 12], ids=["minimum", "half"])
def test_placement_never_changes_output_with_knobs_switched_live(model_dir, slot_bytes, tmp_path,
                                                                 slots):
    model, _session = open_model(model_dir, threads=2, cache_bytes=slots * slot_bytes,
                                 state_dir=tmp_path)
    try:
        want_tokens, want_logits = _greedy(model, STEPS)
    finally:
        model.close()
    assert len(set(want_tokens)) > 1            # a constant output would prove nothing

    model = _streamed(model_dir, slots * slot_bytes, prefetch_min_precision=0.0)
    live, seen = LiveKnobs(model), []

    def switch(i: int) -> None:
        live.apply(SCHEDULE[i % len(SCHEDULE)])
        seen.append(live.current())

    try:
        tokens, logits = _greedy(model, STEPS, before_step=switch)
        assert tokens == want_tokens
        for got, want in zip(logits, want_logits, strict=True):
            assert np.array_equal(got, want)
        if slots > LAYERS * TOP_K:              # at the minimum no slot is free to read ahead
            assert model.experts.bytes_submitted["prefetch"] > 0
    finally:
        model.close()
    assert {s[PREFETCH_WIDTH] for s in seen} == {0, TOP_K, 2 * TOP_K}
    assert {s[IO_WORKERS] for s in seen} == {1, 2, 4}     # 2: the default, at first
    assert {s[THREADS] for s in seen} == {1, 2}


# ------------------------------------------------------------------ routing recorder

def test_routing_recorder_drops_an_abandoned_step_and_keeps_the_most_recent_tokens():
    recorder = RoutingRecorder(2, limit=3)
    recorder.observe(0, [3, 1])
    recorder.abandon_step()                     # that step failed half way
    recorder.observe(0, np.array([5, 4]))
    recorder.observe(1, [2, 0])
    assert recorder.tokens == [[[4, 5], [0, 2]]]
    assert all(type(e) is int for e in recorder.tokens[0][0])
    for t in range(3):
        recorder.observe(0, [t, 7])
        recorder.observe(1, [6, t])
    assert recorder.tokens == [[[t, 7], [t, 6]] for t in range(3)]


def test_routing_recorder_on_the_provider_records_each_decode_step_per_moe_layer(
        model_dir, slot_bytes, tmp_path, monkeypatch):
    model, session = open_model(model_dir, threads=1, cache_bytes=12 * slot_bytes,
                                state_dir=tmp_path)
    provider = session.provider
    acquired: list[tuple[int, list[int]]] = []
    real_acquire = provider._acquire            # under acquire and acquire_in_order

    def spy(layer, experts, in_order):
        acquired.append((layer, [int(e) for e in experts]))
        return real_acquire(layer, experts, in_order)

    monkeypatch.setattr(provider, "_acquire", spy)
    recorder = RoutingRecorder(LAYERS)
    provider.routing_recorder = recorder
    try:
        seq = model.new_sequence()
        logits = model.forward(seq, PROMPT)     # prefill: not a decode step, not recorded
        assert acquired and recorder.tokens == []
        want = []
        for _ in range(5):
            del acquired[:]
            logits = model.forward(seq, [int(np.argmax(logits[-1]))])
            assert [layer for layer, _ in acquired] == provider.moe_layers
            want.append([sorted(ids) for _, ids in acquired])
        assert recorder.tokens == want
        assert all(len(set(ids)) == TOP_K for token in want for ids in token)
        provider.routing_recorder = None
        model.forward(seq, [1])
        assert len(recorder.tokens) == 5
    finally:
        model.close()


# ------------------------------------------------------------------ the A/B driver

def test_check_tokens_are_the_greedy_continuation_of_the_check_prompt(model_dir):
    model = Model.load(model_dir, n_threads=1)
    assert check_tokens(model, PROMPT, 6) == _greedy(model, 6)[0]


# Seconds per decode step by setting (multiplied): threads 2 and io workers 4 and 8 are
# faster; prefetch width makes no difference.
COST = {THREADS: {1: 1.0, 2: 0.8}, IO_WORKERS: {1: 1.2, 2: 1.0, 4: 0.7, 8: 0.9},
        PREFETCH_WIDTH: {0: 1.0, 2: 1.0, 4: 1.0}}
KNOBS = [Knob(name, tuple(costs)) for name, costs in COST.items()]


class SurfaceClock:
    """A Workload clock: each decode step lasts the COST of the settings live on the model
    (calls alternate: step start, step end); `steps` records those settings."""

    def __init__(self, model: Model):
        self.live = LiveKnobs(model)
        self.steps: list[dict] = []
        self._started = False

    def __call__(self) -> float:
        self._started = not self._started
        if self._started:
            return 0.0
        settings = self.live.current()
        self.steps.append(settings)
        return float(np.prod([COST[k][v] for k, v in settings.items()]))


def test_tune_rejects_a_candidate_that_changes_output_and_keeps_the_real_wins(
        model_dir, slot_bytes, tmp_path, monkeypatch, log_records):
    model, _session = open_model(model_dir, threads=1, io_workers=2, cache_bytes=12 * slot_bytes,
                                 state_dir=tmp_path)
    real_check = search.check_tokens

    def check_with_a_bug_at_4_io_workers(model, prompt, n=search.CHECK_TOKENS):
        tokens = real_check(model, prompt, n)
        if LiveKnobs(model).current()[IO_WORKERS] == 4:
            tokens[-1] = (tokens[-1] + 1) % model.config.vocab_size
        return tokens

    monkeypatch.setattr(search, "check_tokens", check_with_a_bug_at_4_io_workers)
    records = log_records("moed.tuning")
    clock, progress = SurfaceClock(model), []
    try:
        tuner = tune(model, KNOBS, Workload(model, [PROMPT, [7, 8, 9]], clock=clock), PROMPT,
                     window_steps=2, pairs=2, progress=progress.append)
        assert tuner.done
        # io workers 4 would be fastest but changes output: rejected, never measured;
        # 8 is the best of the rest.
        assert tuner.incumbent == {THREADS: 2, IO_WORKERS: 8, PREFETCH_WIDTH: 2}
        assert LiveKnobs(model).current() == tuner.incumbent     # left at the winners
    finally:
        model.close()
    assert not [s for s in clock.steps if s[IO_WORKERS] == 4]
    [rejected] = [t for t in tuner.trials if t.outcome.startswith("rejected")]
    assert (rejected.knob, rejected.a, rejected.b) == (IO_WORKERS, 2, 4)
    assert rejected.outcome == "rejected: changed the tokens of the check prompt"
    assert rejected.costs_a == rejected.costs_b == []
    [error] = [r for r in records if r["level"] == "error"]
    assert (error["event"], error["knob"], error["value"]) == ("tuner_candidate_changed_output", IO_WORKERS, 4)
    wins = [(t.knob, t.a, t.b) for t in tuner.trials if t.outcome == "win"]
    assert wins == [(THREADS, 1, 2), (IO_WORKERS, 2, 8)]
    assert "threads 1 -> 2: win (gains +20.0 %, +20.0 %)" in progress
    # The A-vs-A pairs first (no noise on this clock: windows stay 2 steps), then every
    # measured window is window_steps steps of one arm's settings.
    assert tuner.noise == 0.0 and tuner.window_multiplier == 1
    calibration = 2 * tuner.noise_pairs * 2
    assert all(s == {THREADS: 1, IO_WORKERS: 2, PREFETCH_WIDTH: 2} for s in clock.steps[:calibration])
    measured = [t for t in tuner.trials if not t.outcome.startswith("rejected")]
    assert len(clock.steps) == calibration + 2 * 2 * 2 * len(measured)


# ------------------------------------------------------------------ moed tune

def test_moed_tune_prints_a_report_and_saves_the_winners(model_dir, slot_bytes, tmp_path, capsys):
    budget = 12 * slot_bytes
    state_dir = tmp_path / "state"
    assert main(["tune", "--model", str(model_dir), "--expert-cache-bytes", str(budget),
                 "--state-dir", str(state_dir), "--threads", "1", "--window-steps", "4",
                 "--pairs", "2", "--compare-tokens", "8", "--compare-repeats", "1",
                 "--prefill-tokens", "160", "--prefill-rounds", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"default", "tuned", "tokens_per_second", "tuner", "cache_split",
            "saved_to", "prefill_chunk", "numerics"} <= set(report)
    assert report["default"] == {THREADS: 1, IO_WORKERS: 2, PREFETCH_WIDTH: TOP_K,
                                 "cache_bytes": budget, "pin_fraction": 0.5}
    tuned, speed, split = report["tuned"], report["tokens_per_second"], report["cache_split"]
    assert set(tuned) == set(report["default"])
    assert {k: tuned[k] for k in (THREADS, IO_WORKERS, PREFETCH_WIDTH)} == report["tuner"]["settings"]
    assert report["tuner"]["done"] is True and report["tuner"]["trials"]
    assert speed["default"] > 0 and speed["tuned"] > 0
    assert speed["ratio"] == pytest.approx(speed["tuned"] / speed["default"], abs=0.01)
    assert TOP_K <= split["slots_per_layer"] <= budget // slot_bytes // LAYERS
    assert tuned["cache_bytes"] == split["slots_per_layer"] * LAYERS * slot_bytes <= budget
    assert 0.0 <= tuned["pin_fraction"] <= 1.0
    assert split["replayed_tokens"] >= 2
    fingerprint = Checkpoint(model_dir).fingerprint()
    assert report["saved_to"] == str(state_dir / f"tuned-{fingerprint[:16]}.json")
    assert Path(report["saved_to"]).exists()
    assert (state_dir / f"usage-{fingerprint[:16]}.json").exists()    # its own file
    # what is saved is what the final comparison confirmed: the tuned settings, or else
    # the defaults it started from (one pair here: it confirms only a win in that pair)
    # and the prefill chunk it measured (a 160-token prompt, every chunk the cache allows)
    prefill = report["prefill_chunk"]
    assert prefill["prompt_tokens"] == 160 and prefill["rounds"] == 1
    assert prefill["candidates"][0] == 64 and prefill["incumbent"] == prefill["candidates"][-1]
    assert set(prefill["tokens_per_second"]) == {str(c) for c in prefill["candidates"]}
    assert all(v["median"] > 0 for v in prefill["tokens_per_second"].values())
    assert prefill["chosen"] in prefill["candidates"]
    saved = dict(report["saved"])
    assert saved.pop("prefill_chunk") == prefill["chosen"]
    assert saved == (tuned if report["confirmed"] else report["default"])
    assert report["confirmed"] == (tuned != report["default"] and speed["pair_ratios"][0] > 1.0)
    assert TunedStore(state_dir, fingerprint, hardware_facts(model_dir)).load() == report["saved"]


def test_moed_tune_without_the_prefill_measurement_keeps_the_chunk_saved_before(
        model_dir, slot_bytes, tmp_path, capsys):
    state_dir = tmp_path / "state"
    store = TunedStore(state_dir, Checkpoint(model_dir).fingerprint(), hardware_facts(model_dir))
    store.save({"prefill_chunk": 128})
    args = ["tune", "--model", str(model_dir), "--expert-cache-bytes", str(12 * slot_bytes),
            "--state-dir", str(state_dir), "--threads", "1", "--window-steps", "4", "--pairs", "2",
            "--compare-tokens", "8", "--compare-repeats", "1"]
    assert main(args + ["--prefill-tokens", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prefill_chunk"] is None and report["saved"]["prefill_chunk"] == 128
    assert store.load()["prefill_chunk"] == 128
    with pytest.raises(SystemExit) as e:
        main(args + ["--prefill-tokens", "-1"])
    assert e.value.code == 2
    assert "--prefill-tokens must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("default, tuned, same, want", [
    ([10, 10, 10, 10, 10], [11, 11, 11, 11, 9.5], False, True),    # 4 of 5 pairs, median won
    ([10, 10, 10, 10, 10], [11, 11, 9.9, 9.9, 11], False, False),  # two pairs lost: the noise
    ([10, 10, 10], [9, 9.5, 12], False, False),                    # the median pair lost
    ([10, 10, 10], [12, 12, 12], True, False),                     # the defaults themselves
])
def test_the_final_comparison_confirms_only_a_clear_win(default, tuned, same, want):
    from daemon.commands.figures import compare
    from daemon.commands.tune_runs import confirms
    assert confirms(compare(tuned, default, "tuned", "default")["pair_ratios"], same) is want


@pytest.mark.parametrize("total, fraction", [(26, 0.5), (24, 0.375), (30, 0.125)])
def test_the_replay_pin_share_becomes_as_many_pinned_slots_in_the_streaming_cache(
        tmp_path, total, fraction):
    """scheduler.replay pins round(fraction x all slots); the converted share must pin as
    many in StreamingExpertProvider (which counts a share of the slots above the minimum)."""
    model_dir = make_model(tmp_path / "m", arch="qwen3_moe", layers=3, experts=10, top_k=1,
                           hidden=64, intermediate=32, shard_size=40_000)
    config = load_config(model_dir)
    layout = ExpertLayout(Checkpoint(model_dir), config)
    minimum = config.top_k * 3
    share = search.replay_fraction_to_streaming(fraction, total, minimum)
    slot = max(p.slot_bytes for p in plans_for(layout).values())
    counts = np.arange(30, dtype=float).reshape(3, 10)          # every expert has been used
    provider = StreamingExpertProvider(layout, config, StreamingOptions(
        cache_bytes=total * slot, pin_fraction=share, learn_pins=False), usage_counts=counts)
    try:
        assert provider.cache.pinned_slots == round(fraction * total)
    finally:
        provider.close()
