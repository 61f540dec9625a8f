"""The live tuner: fed decode-step times by the engine, it applies, checks and keeps settings.

The unit tests drive `LiveTuner.step_done` with a fake clock surface on a real tiny
streamed model (the check prompt really runs); the daemon test runs `moed serve` with
``tuner = live`` and reads the tuner's state from /v1/moed/stats.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from daemon_proc import Daemon, short_dir

from daemon.store.session import open_model
from daemon.tuning.knobs import IO_WORKERS, PREFETCH_WIDTH, THREADS, LiveKnobs
from daemon.tuning.live import LiveTuner, start_live_tuning
from daemon.tuning.saved import TunedStore, hardware_facts
from ext.makemodel import make_model
from scheduler.tuner import Knob


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("live") / "model"
    make_model(path, arch="qwen3_moe", layers=3, experts=8, top_k=2, hidden=64,
               intermediate=32, routing_skew=1.0, seed=3)
    return path


@pytest.fixture
def streamed(model_dir, tmp_path):
    model, session = open_model(model_dir, threads=2, cache_bytes=10**9, state_dir=tmp_path)
    model_cache = session.provider.slot_bytes * 8   # 8 of 24 experts
    session.rebuild(cache_bytes=model_cache)
    yield model, session
    model.close()


def feed(tuner: LiveTuner, cost_of, batch_size=1, limit=20_000) -> None:
    n = 0
    while not tuner.finished:
        tuner.step_done(cost_of(LiveKnobs(tuner.model).current()) * batch_size, batch_size)
        n += 1
        assert n < limit


def test_the_live_tuner_keeps_what_wins_and_saves_it(streamed, tmp_path):
    model, session = streamed
    knobs = [Knob(THREADS, (1, 2)), Knob(IO_WORKERS, (1, 2, 4)), Knob(PREFETCH_WIDTH, (0, 2, 3, 4))]
    done = []
    tuner = LiveTuner(model, knobs, {THREADS: 2, IO_WORKERS: 2, PREFETCH_WIDTH: 2}, [1, 2, 3],
                      window_steps=4, on_done=done.append)
    best = {THREADS: 1, IO_WORKERS: 4, PREFETCH_WIDTH: 2}
    feed(tuner, lambda s: 0.01 * (1 + 0.2 * sum(s[k] != v for k, v in best.items())))
    assert done and done[0] is tuner.tuner
    assert tuner.tuner.incumbent == best
    assert LiveKnobs(model).current() == best                      # left applied
    assert session.provider.io.n_workers == 4 and model.n_threads == 1


def test_windows_are_per_sequence_at_one_batch_size(streamed):
    model, _ = streamed
    tuner = LiveTuner(model, [Knob(THREADS, (1, 2))], {THREADS: 1}, [1, 2, 3], window_steps=4,
                       noise_pairs=0)
    for seconds, batch in [(0.04, 4)] * 3 + [(0.01, 1)] * 4:      # the batch changed mid-window
        tuner.step_done(seconds, batch)
    trial = tuner.tuner.trial
    assert trial.costs_a == [0.01] and trial.batch_size == 1
    for _ in range(4):
        tuner.step_done(0.04, 4)                                    # another batch size: dropped
    assert trial.costs_b == [] and trial.dropped_windows == 1


def test_a_candidate_that_changes_output_is_rejected_loudly(streamed, monkeypatch, log_records):
    model, _ = streamed
    import daemon.tuning.search as search
    real = search.check_tokens

    def check(m, prompt, n=search.CHECK_TOKENS):
        tokens = real(m, prompt, n)
        return tokens[:-1] + [tokens[-1] + 1] if m.n_threads == 2 else tokens   # a "bug"
    monkeypatch.setattr(search, "check_tokens", check)
    records = log_records("moed.tuning")
    tuner = LiveTuner(model, [Knob(THREADS, (1, 2))], {THREADS: 1}, [1, 2, 3], window_steps=2,
                       noise_pairs=0)
    assert tuner.finished and tuner.tuner.incumbent == {THREADS: 1}
    assert tuner.tuner.trials[0].outcome == "rejected: changed the tokens of the check prompt"
    [error] = [r for r in records if r["event"] == "tuner_candidate_changed_output"]
    assert error["level"] == "error" and error["knob"] == THREADS and error["value"] == 2


def test_saved_winners_are_the_start_and_fixed_knobs_are_left_alone(streamed, model_dir, tmp_path):
    model, session = streamed
    store = TunedStore(tmp_path, model.checkpoint.fingerprint(), hardware_facts(model_dir))
    store.save({THREADS: 1, IO_WORKERS: 4, PREFETCH_WIDTH: 4})
    tuner = start_live_tuning(model, session, "live", {THREADS}, tmp_path, model_dir)
    assert [k.name for k in tuner.tuner.knobs] == [IO_WORKERS, PREFETCH_WIDTH]
    assert tuner.tuner.incumbent == {IO_WORKERS: 4, PREFETCH_WIDTH: 4}
    assert model.n_threads == 2                                     # fixed: as configured
    assert start_live_tuning(model, session, "off", set(), tmp_path, model_dir) is None
    assert start_live_tuning(model, None, "live", set(), tmp_path, model_dir) is None


def run_daemon(model_dir, tuner: str) -> tuple[str, dict, list[str]]:
    """(completion text, /v1/moed/stats, files in the state directory) of one daemon."""
    d = Daemon(model_dir, short_dir(), "--expert-cache-bytes", "200K", env={"MOED_TUNER": tuner})
    try:
        status, answer = d.json("POST", "/v1/completions",
                                {"prompt": "x", "max_tokens": 200, "temperature": 0.7, "seed": 1})
        assert status == 200, answer
        status, stats = d.json("GET", "/v1/moed/stats")
        assert d.stop() == 0
        return answer["choices"][0]["text"], stats, sorted(os.listdir(d.state_dir))
    finally:
        d.cleanup()


def test_serve_with_the_live_tuner_gives_the_same_text(model_dir):
    text, stats, _ = run_daemon(model_dir, "live")
    assert stats["tuner"]["mode"] == "live"
    # 200 decode steps of 16-step windows: the A-vs-A pairs have measured the noise, which
    # sets the trials' window length
    assert not stats["tuner"]["calibrating"] and stats["tuner"]["noise"] >= 0.0
    assert stats["tuner"]["window_steps"] >= 16 and stats["tuner"]["window_steps"] % 16 == 0
    assert set(stats["tuner"]["settings"]) == {THREADS, IO_WORKERS, PREFETCH_WIDTH}
    text_off, stats_off, _ = run_daemon(model_dir, "off")
    assert stats_off["tuner"] == {"mode": "off"}
    assert text == text_off


@pytest.mark.slow     # ~13 s: a daemon waits to be idle, then probes the disk
def test_the_daemon_probes_storage_once_when_idle_after_ready(model_dir):
    d = Daemon(model_dir, short_dir(), "--expert-cache-bytes", "200K")
    try:
        event = d.wait_event("storage_probe_saved", timeout=60)
        ready = d.wait_event("ready")
        assert event["io_path"] in ("direct", "buffered")
        report = json.loads(Path(event["path"]).read_text())
        assert {r["queue_depth"] for r in report["results"]} == {1, 2, 4, 8, 16}
        assert report["budget_seconds"] <= 5
        assert d.stop() == 0
        # the next start finds the result and does not probe again
        again = Daemon(model_dir, short_dir(), "--expert-cache-bytes", "200K",
                       state_dir=d.state_dir)
        try:
            status, _ = again.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4})
            assert status == 200

            time.sleep(2.5)
            assert not [e for e in again.events if e.get("event") == "storage_probe_saved"]
            assert again.stop() == 0
        finally:
            again.cleanup()
        assert ready
    finally:
        d.cleanup()


def test_a_request_stops_the_storage_probe_and_goes_first(model_dir):
    d = Daemon(model_dir, short_dir(), "--expert-cache-bytes", "200K")
    try:
        d.wait_event("storage_probe_started", timeout=60)
        status, _ = d.json("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4})
        assert status == 200
        deferred = d.wait_event("storage_probe_deferred", timeout=30)
        assert deferred["reason"] == "a request arrived"
        saved = d.wait_event("storage_probe_saved", timeout=60)     # later, when idle again
        order = [e.get("event") for e in d.events]
        assert order.index("storage_probe_deferred") < order.index("request_finished") \
            < order.index("storage_probe_saved")
        assert json.loads(Path(saved["path"]).read_text())["budget_seconds"] <= 5
        assert d.stop() == 0
    finally:
        d.cleanup()


def test_the_saved_storage_probe_gives_the_starting_io_workers(streamed, model_dir, tmp_path):
    from daemon.store.probe import block_device, probe_io_workers, report_path

    model, session = streamed
    rows = [{"mode": "direct", "queue_depth": qd, "gb_per_s": gb}
            for qd, gb in ((1, 0.3), (2, 0.6), (4, 0.98), (8, 1.0), (16, 1.0))]
    rows += [{"mode": "buffered", "queue_depth": 1, "gb_per_s": 9.0}]
    path = report_path(tmp_path, block_device(model_dir / "model.safetensors"))
    path.write_text(json.dumps({"io_path": "direct", "results": rows}))
    assert probe_io_workers(tmp_path, model_dir) == 4          # 0.98 >= 95 % of 1.0
    tuner = start_live_tuning(model, session, "live", set(), tmp_path, model_dir)
    assert tuner.tuner.incumbent[IO_WORKERS] == 2                # the start is unchanged ...
    assert tuner.tuner.calibrating and tuner.tuner.candidate() is None   # A-vs-A pairs first
    for _ in range(2 * tuner.tuner.noise_pairs * tuner.window_steps):
        tuner.step_done(0.01, 1)                                 # no noise: windows stay short
    assert tuner.tuner.noise == 0.0 and tuner.tuner.window_multiplier == 1
    assert tuner.tuner.candidate() == (IO_WORKERS, 4)            # ... the probe's 4 is tried first
    assert tuner.tuner.trial.proposal
    hostile = rows + [{"mode": "direct", "queue_depth": q, "gb_per_s": 5.0}
                      for q in (float("inf"), 3000, 0, True, "8")]
    path.write_text(json.dumps({"io_path": "direct", "results": hostile}))
    assert probe_io_workers(tmp_path, model_dir) == 4          # the nonsense rows are ignored
    path.write_text("{not json")
    assert probe_io_workers(tmp_path, model_dir) is None
    assert probe_io_workers(None, model_dir) is None


def test_hostile_saved_settings_are_dropped_with_a_warning(model_dir, tmp_path, log_records):
    from daemon.store.state import StateStore
    from daemon.tuning.saved import TUNED_VERSION, hardware_fingerprint
    records = log_records("moed.tuning")
    facts = hardware_facts(model_dir)
    fingerprint = "f" * 64
    raw = StateStore(tmp_path, fingerprint, kind="tuned")
    # another machine's file whose facts are not even a mapping: ignored, no crash
    raw.save(lambda _c: {"version": TUNED_VERSION, "hardware": "other", "hardware_facts": [1],
                         "settings": {THREADS: 2}})
    store = TunedStore(tmp_path, fingerprint, facts)
    assert store.load() is None
    assert any(r["event"] == "tuned_settings_invalidated" for r in records)
    # this machine's file with nonsense values: only the usable ones are kept
    raw.save(lambda _c: {"version": TUNED_VERSION, "hardware": store.hardware,
                         "hardware_facts": facts, "settings": {
                             THREADS: True, IO_WORKERS: 2**70,
                             PREFETCH_WIDTH: 4, "cache_bytes": "lots", "pin_fraction": 0.25,
                             "unknown": 1}})
    assert store.load() == {PREFETCH_WIDTH: 4, "pin_fraction": 0.25}
    dropped = [r["setting"] for r in records if r["event"] == "tuned_setting_ignored"]
    assert sorted(dropped) == sorted([THREADS, IO_WORKERS, "cache_bytes", "unknown"])
    assert hardware_fingerprint(facts) == store.hardware


def test_a_rebuilt_cache_keeps_the_tuned_io_workers_and_prefetch_width(streamed):
    model, session = streamed
    LiveKnobs(model).apply({IO_WORKERS: 4, PREFETCH_WIDTH: 3})
    session.rebuild(cache_bytes=session.options.cache_bytes + session.provider.slot_bytes)
    assert LiveKnobs(model).current()[IO_WORKERS] == 4
    assert LiveKnobs(model).current()[PREFETCH_WIDTH] == 3
    session.rebuild(prefetch=False)                       # the operator's word wins
    assert LiveKnobs(model).current()[PREFETCH_WIDTH] == 0


def test_the_check_prompt_is_not_counted_as_usage_and_stop_applies_the_incumbent(streamed):
    from daemon.tuning.search import check_tokens
    model, session = streamed
    before = session.provider.usage.counts().copy()
    check_tokens(model, [1, 2, 3])
    assert (session.provider.usage.counts() == before).all()
    assert session.provider.observe_usage is True
    tuner = LiveTuner(model, [Knob(THREADS, (1, 2))], {THREADS: 1}, [1, 2, 3], window_steps=2,
                       noise_pairs=0)
    tuner.step_done(0.01, 1)
    tuner.step_done(0.01, 1)                              # A done: B (2 threads) is applied
    assert model.n_threads == 2
    tuner.stop("test")
    assert tuner.finished and model.n_threads == 1


def test_the_live_tuner_picks_the_cache_split_by_replay_when_its_search_ends(streamed):
    from daemon.tuning.live import MIN_REPLAY_TOKENS
    model, session = streamed
    session.rebuild(cache_bytes=18 * session.provider.slot_bytes, pin_fraction=0.0)  # 6 per layer
    budget = session.options.cache_bytes
    tuner = LiveTuner(model, [Knob(THREADS, (1, 2))], {THREADS: 1}, [1, 2, 3], window_steps=2,
                      noise_pairs=0,
                      session=session, budget_bytes=budget)
    assert session.provider.routing_recorder is tuner.recorder
    # recorded routing where the same two experts per layer serve every token: top_k slots
    # per layer hit as often as six, so the budget goes back
    tuner.recorder.tokens = [[[0, 1], [2, 3], [4, 5]] for _ in range(MIN_REPLAY_TOKENS)]
    feed(tuner, lambda s: 0.01)
    assert tuner.finished and session.provider.routing_recorder is None
    assert tuner.split and tuner.split["cache_bytes"] < budget          # memory given back
    assert session.options.cache_bytes == tuner.split["cache_bytes"]


def test_too_little_recorded_routing_leaves_the_split_alone(streamed):
    model, session = streamed
    before = (session.options.cache_bytes, session.options.pin_fraction)
    tuner = LiveTuner(model, [Knob(THREADS, (1, 2))], {THREADS: 1}, [1, 2, 3], window_steps=2,
                      noise_pairs=0,
                      session=session, budget_bytes=session.options.cache_bytes)
    feed(tuner, lambda s: 0.01)
    assert tuner.split == {} and (session.options.cache_bytes, session.options.pin_fraction) == before


def test_a_saved_cache_split_is_applied_at_start_within_the_budget(streamed, model_dir, tmp_path):
    model, session = streamed
    budget = session.options.cache_bytes
    slot = session.provider.slot_bytes
    store = TunedStore(tmp_path, model.checkpoint.fingerprint(), hardware_facts(model_dir))
    store.save({THREADS: 2, "cache_bytes": budget - slot, "pin_fraction": 0.25})
    start_live_tuning(model, session, "live", set(), tmp_path, model_dir)
    assert (session.options.cache_bytes, session.options.pin_fraction) == (budget - slot, 0.25)
    store.save({THREADS: 2, "cache_bytes": budget * 4, "pin_fraction": 0.75})   # over budget
    start_live_tuning(model, session, "live", set(), tmp_path, model_dir)
    assert session.options.cache_bytes == budget - slot                   # left alone
