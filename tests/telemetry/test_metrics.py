"""telemetry.metrics in-process: the families, their label sets, zeros before anything
happened, promtool, and label values that stay in their closed sets whatever comes in.

The per-phase lookup counts of the expert cache (the source of
moed_expert_lookups_total{phase}) are checked here too.
"""
from __future__ import annotations

import random
import string

import pytest
from metrics_scrape import TYPES, expected_series, parse, promtool_check, series, total, value

from daemon.store.reads import READ_SECONDS_BUCKETS
from scheduler.cache import ExpertCache
from telemetry.metrics import DaemonMetrics, ExpertCounters, Snapshot

LAYERS = (1, 3, 5)            # MoE layer ids (not 0..L-1: a model with dense layers between)
BUILD = {"version": "9.9.9", "model_type": "qwen3_moe", "quantization": "fp8_e4m3", "numerics": "fast"}


def metrics(source=lambda: None) -> DaemonMetrics:
    return DaemonMetrics(**BUILD, moe_layers=LAYERS, read_seconds_buckets=READ_SECONDS_BUCKETS,
                         source=source)


def busy_snapshot() -> Snapshot:
    """A snapshot where every number is distinct and non-zero."""
    lookups = {(l, o, p): 100 * i + 10 * j + k for i, l in enumerate(LAYERS)
               for j, o in enumerate(("hit", "prefetch_hit", "miss"))
               for k, p in enumerate(("prefill", "decode"), 1)}
    buckets = tuple((b, min(i, 7)) for i, b in enumerate(READ_SECONDS_BUCKETS))
    experts = ExpertCounters(lookups=lookups, bytes_read={"demand": 4096, "prefetch": 8192,
                                                          "pin_load": 12288},
                             read_errors=2, read_seconds_buckets=buckets, read_seconds_sum=0.125,
                             evictions={"pinned": 3, "dynamic": 44}, pin_swaps=5,
                             prefetch_issued=9, prefetch_used=6, prefetch_wasted_bytes=8192)
    return Snapshot(requests_running=2, requests_waiting=7, decode_steps=11, prompt_tokens=13,
                    generation_tokens=17, io_wait_seconds=0.5, compute_seconds=1.5, experts=experts,
                    expert_cache_bytes={"pinned": 4096, "dynamic": 8192},
                    expert_cache_capacity_bytes={"pinned": 40960, "dynamic": 81920},
                    pinned_experts=1, compute_threads=4, io_workers=2, memory_budget_bytes=1 << 30,
                    memory_available_bytes=1 << 32, model_load_seconds=3.25, state_saves=19,
                    state_save_errors=1, tuner_trials=23, tuner_accepted=2)


def test_every_family_and_label_combination_is_there_at_zero_before_any_snapshot():
    types, samples = parse(metrics().render().decode())
    assert {n: types.get(n) for n in TYPES} == TYPES
    assert set(samples) == expected_series(LAYERS, BUILD)
    assert len([k for k in samples if k[0] == "moed_expert_lookups_total"]) == len(LAYERS) * 3 * 2
    moed = {k: v for k, v in samples.items() if k[0].startswith("moed_")}
    assert {k: v for k, v in moed.items() if v != 0} == {series("moed_build_info", **BUILD): 1.0}


def test_the_snapshot_numbers_are_what_is_exported():
    snap = busy_snapshot()
    _, samples = parse(metrics(lambda: snap).render().decode())
    for (layer, outcome, phase), n in snap.experts.lookups.items():
        assert value(samples, "moed_expert_lookups_total", layer=str(layer), outcome=outcome,
                     phase=phase) == n
    assert total(samples, "moed_expert_lookups_total", phase="decode") == snap.experts.lookups_where(
        phase="decode")
    assert value(samples, "moed_expert_bytes_read_total", reason="pin_load") == 12288
    assert value(samples, "moed_expert_evictions_total", tier="dynamic") == 44
    assert value(samples, "moed_expert_cache_capacity_bytes", tier="pinned") == 40960
    assert value(samples, "moed_expert_read_seconds_bucket", le="1e-05") == 0
    assert value(samples, "moed_expert_read_seconds_bucket", le="2.5e-05") == 1
    assert value(samples, "moed_expert_read_seconds_bucket", le="+Inf") == 7
    assert value(samples, "moed_expert_read_seconds_count") == 7
    assert value(samples, "moed_expert_read_seconds_sum") == 0.125
    plain = {"moed_requests_running": 2, "moed_requests_waiting": 7, "moed_decode_steps_total": 11,
             "moed_prompt_tokens_total": 13, "moed_generation_tokens_total": 17,
             "moed_io_wait_seconds_total": 0.5, "moed_compute_seconds_total": 1.5,
             "moed_expert_read_errors_total": 2, "moed_pinned_experts": 1, "moed_pin_swaps_total": 5,
             "moed_prefetch_issued_total": 9, "moed_prefetch_used_total": 6,
             "moed_prefetch_wasted_bytes_total": 8192, "moed_compute_threads": 4,
             "moed_io_workers": 2, "moed_memory_budget_bytes": 1 << 30,
             "moed_memory_available_bytes": 1 << 32, "moed_model_load_seconds": 3.25,
             "moed_state_saves_total": 19, "moed_state_save_errors_total": 1,
             "moed_tuner_trials_total": 23, "moed_tuner_accepted_total": 2}
    assert {name: value(samples, name) for name in plain} == plain


@pytest.mark.tools("promtool")
def test_promtool_accepts_a_scrape_with_traffic():
    snap = busy_snapshot()
    m = metrics(lambda: snap)
    m.response("completions", 200)
    m.request_finished("length", 0.01, 0.2, 1.5)
    m.token_gap(0.05)
    m.decode_step_done(0.04)
    result = promtool_check(m.render().decode())
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@pytest.mark.tools("promtool")
def test_promtool_is_not_fooled_a_gauge_named_total_fails():
    """The check above means something: promtool flags what the module avoids."""
    text = "# HELP x_total a gauge\n# TYPE x_total gauge\nx_total 1.0\n"
    result = promtool_check(text)
    assert result.returncode != 0 and "x_total" in result.stdout + result.stderr


def test_events_are_observed_into_the_families():
    m = metrics()
    m.response("chat_completions", 429)
    m.response(None, 404)                      # an unmatched path: no route name
    m.request_finished("stop", 0.002, None, 0.003)     # ended before any token
    m.request_finished("length", 0.004, 0.3, 2.0)
    for gap in (0.01, 0.02, 0.03):
        m.token_gap(gap)
    m.decode_step_done(0.007)
    _, samples = parse(m.render().decode())
    assert value(samples, "moed_requests_total", endpoint="chat_completions", status="429") == 1
    assert value(samples, "moed_requests_total", endpoint="other", status="404") == 1
    assert value(samples, "moed_requests_finished_total", finish_reason="stop") == 1
    assert value(samples, "moed_request_queue_seconds_count") == 2
    assert value(samples, "moed_request_queue_seconds_sum") == pytest.approx(0.006)
    assert value(samples, "moed_time_to_first_token_seconds_count") == 1
    assert value(samples, "moed_time_to_first_token_seconds_bucket", le="0.25") == 0
    assert value(samples, "moed_time_to_first_token_seconds_bucket", le="0.5") == 1
    assert value(samples, "moed_inter_token_latency_seconds_count") == 3
    assert value(samples, "moed_inter_token_latency_seconds_bucket", le="0.025") == 2
    assert value(samples, "moed_request_duration_seconds_sum") == pytest.approx(2.003)
    assert value(samples, "moed_decode_step_seconds_bucket", le="0.01") == 1


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.printable + "é€😀\u202e") for _ in range(rng.randint(0, n)))


def test_ten_thousand_random_inputs_add_no_series():
    """Client input (route names, statuses, finish reasons, an unknown layer or reason in
    a snapshot) never becomes a label value: the series stay the same."""
    rng = random.Random(5)
    snap = busy_snapshot()
    m = metrics(lambda: snap)
    before = set(parse(m.render().decode())[1])
    for _ in range(10_000):
        m.response(rng.choice([_random_text(rng, 30), None, "completions"]), rng.randint(100, 999))
        m.request_finished(_random_text(rng, 10), rng.random(), rng.random(), rng.random())
    snap = Snapshot(experts=ExpertCounters(lookups={(99, "hit", "decode"): 1, (1, "x", "decode"): 2},
                                           bytes_read={"bogus": 5}, evictions={"warm": 1}),
                    expert_cache_bytes={"other": 3})
    after = parse(m.render().decode())[1]
    assert set(after) == before
    assert total(after, "moed_requests_total") == 10_000
    assert total(after, "moed_requests_total", endpoint="other", status="other") > 0


def test_registering_does_not_read_the_snapshot_source():
    def source():
        raise AssertionError("read before the first scrape")
    m = metrics(source)                  # auto_describe uses describe(), not the source
    with pytest.raises(AssertionError, match="before the first scrape"):
        m.render()


def test_expert_counters_add_up_across_a_replaced_cache():
    a = busy_snapshot().experts
    b = ExpertCounters(lookups={(1, "hit", "decode"): 1000}, bytes_read={"demand": 1},
                       read_seconds_buckets=tuple((x, 1) for x in READ_SECONDS_BUCKETS),
                       read_seconds_sum=1.0, evictions={"dynamic": 1}, prefetch_issued=1)
    c = a + b
    assert c.lookups[(1, "hit", "decode")] == a.lookups[(1, "hit", "decode")] + 1000
    assert c.lookups[(3, "miss", "prefill")] == a.lookups[(3, "miss", "prefill")]
    assert c.bytes_read == {"demand": 4097, "prefetch": 8192, "pin_load": 12288}
    assert c.read_seconds_buckets[-1] == (float("inf"), 8)
    assert c.read_seconds_sum == 1.125 and c.evictions["dynamic"] == 45
    assert c.prefetch_issued == 10 and c.pin_swaps == 5
    assert ExpertCounters() + a == a
    with pytest.raises(ValueError, match="bounds"):
        a + ExpertCounters(read_seconds_buckets=((1.0, 0), (float("inf"), 0)))


# ---------------------------------------------------------------------- the cache's phases


def test_the_cache_counts_lookups_per_phase_and_wasted_prefetch_bytes():
    sizes = [[4096 * (1 + e) for e in range(8)], [8192] * 8]
    cache = ExpertCache([0, 2], num_experts=8, top_k=2, total_slots=6, expert_bytes=sizes)
    for a in cache.request(0, [1, 2], token=0, phase="prefill"):
        cache.loaded(a.slot)
    cache.release(0, [1, 2])
    cache.request(0, [1, 3], token=1, phase="decode")          # hit 1, miss 3
    cache.loaded(cache.slot_of(0, 3))
    cache.release(0, [1, 3])
    slot = cache.prefetch(2, 5, token=1, score=1.0)            # layer 2 has 3 dynamic slots
    cache.request(2, [5, 6], token=1)                          # default phase: decode
    cache.loaded(slot)
    cache.loaded(cache.slot_of(2, 6))
    cache.release(2, [5, 6])
    wasted = cache.prefetch(0, 7, token=2, score=1.0)         # layer 0: read, never used...
    cache.loaded(wasted)
    for a in cache.request(0, [4, 6], token=3, phase="prefill"):   # ...and evicted
        cache.loaded(a.slot)
    snap = cache.snapshot()
    assert snap.hits_by_phase == {"prefill": (0, 0), "decode": (1, 0)}
    assert snap.prefetch_hits_by_phase == {"prefill": (0, 0), "decode": (0, 1)}
    assert snap.misses_by_phase == {"prefill": (4, 0), "decode": (1, 1)}
    assert (snap.hits, snap.prefetch_hits, snap.misses) == ((1, 0), (0, 1), (5, 1))
    assert cache.totals() == (2, 6)
    assert snap.prefetches_wasted == (1, 0)
    assert snap.prefetches_wasted_bytes == (4096 * 8, 0)
    with pytest.raises(ValueError, match="phase"):
        cache.request(0, [1], token=4, phase="warmup")
    with pytest.raises(ValueError, match="expert_bytes"):
        ExpertCache([0, 2], num_experts=8, top_k=2, total_slots=6, expert_bytes=[[1] * 8])
