"""/metrics of the real `moed serve`: every series from the first scrape, promtool after
real traffic, numbers that agree with each other, with the request log lines and with
/v1/moed/stats, and no new series whatever clients send.

The model is a tiny random Qwen3-MoE (4 MoE layers, 16 experts, top_k 4). The "numbers
agree" checks that need the engine and the cache alone run in-process with an Engine.
"""
from __future__ import annotations

import asyncio
import json
import random
import string
from pathlib import Path

import aiohttp
import httpx
import pytest
from daemon_proc import Daemon, short_dir
from metrics_scrape import NOT_ZERO_AT_START, expected_series, parse, promtool_check, total, value

from daemon.engine.engine import Engine, EngineRequest
from daemon.service.stats import collect, status_line
from daemon.store.plans import plans_for
from daemon.store.session import open_model
from daemon.store.streaming import (StreamingExpertProvider, StreamingOptions, expert_counters,
                                    minimum_cache_bytes)
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from ext.models.model import Model
from ext.tokenizer import Tokenizer

LAYERS, EXPERTS, TOP_K = 4, 16, 4
MODEL = "model"
ONE_THREAD = ("--threads", "1")
TIMEOUT = httpx.Timeout(120.0)
WORDS = "the expert cache reads every routed weight from disk while a token decodes".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("metrics") / MODEL, arch="qwen3_moe", layers=LAYERS,
                      experts=EXPERTS, top_k=TOP_K, hidden=128, intermediate=64, dtype="bf16",
                      seed=0)


@pytest.fixture(scope="module")
def plans(model_dir) -> dict:
    return plans_for(ExpertLayout(Checkpoint(model_dir), load_config(model_dir)))


@pytest.fixture(scope="module")
def quarter_cache(model_dir, plans) -> int:
    """About a quarter of the experts (at least the cache's minimum): experts stream."""
    config = load_config(model_dir)
    minimum = minimum_cache_bytes(ExpertLayout(Checkpoint(model_dir), config), config)
    return max(minimum, sum(p.slot_bytes for p in plans.values()) // 4)


def start(model_dir: Path, *args: str) -> Daemon:
    return Daemon(model_dir, short_dir(), *ONE_THREAD, *args)


def finish(d: Daemon) -> None:
    d.cleanup()
    d.proc.stdout.close()
    d.proc.stderr.close()


@pytest.fixture(scope="module")
def daemon(model_dir, quarter_cache):
    d = start(model_dir, "--expert-cache-bytes", str(quarter_cache), "--max-queue", "256")
    try:
        yield d
        assert d.stop() == 0
    finally:
        finish(d)


def scrape(d: Daemon) -> tuple[str, dict, dict]:
    status, headers, body = d.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=")
    text = body.decode()
    types, samples = parse(text)
    return text, types, samples


def scrape_tcp(d: Daemon) -> str:
    """The same registry on metrics_address (the daemon logs the port it bound)."""
    address = d.wait_event("metrics_listening")["address"]
    response = httpx.get(f"http://{address}/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    return response.text


def stats(d: Daemon) -> dict:
    status, body = d.json("GET", "/v1/moed/stats")
    assert status == 200
    return body


def complete(d: Daemon, prompt: str, max_tokens: int, **extra) -> tuple[dict, dict]:
    """One completion; (its answer, its request_finished log line)."""
    status, answer = d.json("POST", "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                         "max_tokens": max_tokens, **extra})
    assert status == 200, answer
    return answer, d.wait_event("request_finished", request_id=answer["id"])


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


# ---------------------------------------------------------------------- first scrape


@pytest.mark.tools("promtool")
def test_first_scrape_has_every_series_at_zero(model_dir, quarter_cache):
    d = start(model_dir, "--expert-cache-bytes", str(quarter_cache))
    try:
        text, types, samples = scrape(d)
        build_labels = dict(next(l for (n, l) in samples if n == "moed_build_info"))
        assert build_labels["model_type"] == "qwen3_moe"
        assert set(samples) == expected_series(range(LAYERS), build_labels)
        events = {k: v for k, v in samples.items()
                  if k[0].startswith("moed_") and k[0] not in NOT_ZERO_AT_START}
        assert {k: v for k, v in events.items() if v != 0} == {}
        # the configuration is there from the start too
        s = stats(d)
        assert value(samples, "moed_expert_cache_capacity_bytes", tier="dynamic") == \
            s["cache"]["dynamic"]["bytes"] > 0
        assert value(samples, "moed_memory_budget_bytes") == quarter_cache
        assert value(samples, "moed_io_workers") == 2 and value(samples, "moed_compute_threads") == 1
        assert value(samples, "moed_model_load_seconds") > 0
        # the TCP listener renders the same registry: same series
        assert set(parse(scrape_tcp(d))[1]) == set(samples)
        assert promtool_check(text).returncode == 0
    finally:
        assert d.stop() == 0
        finish(d)


# ---------------------------------------------------------------------- after traffic


@pytest.mark.tools("promtool")
def test_promtool_reports_nothing_after_real_traffic(daemon):
    complete(daemon, "the cache", 5, ignore_eos=True)
    status, _, body = daemon.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "the disk", "max_tokens": 3, "stream": True})
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    status, _ = daemon.json("POST", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]})
    assert status == 200
    assert daemon.json("POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"})[0] == 404
    assert daemon.request("POST", "/v1/completions", b"{not json")[0] == 400
    assert daemon.request("GET", "/no/such/route")[0] == 404
    assert daemon.request("DELETE", "/v1/completions")[0] == 405
    for path in ("/health", "/v1/models", "/v1/moed/stats", "/v1/moed/pins"):
        assert daemon.request("GET", path)[0] == 200
    text, _, samples = scrape(daemon)
    result = promtool_check(text)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    for endpoint, status in (("completions", "200"), ("chat_completions", "200"),
                             ("completions", "404"), ("completions", "400"), ("other", "404"),
                             ("other", "405"), ("health", "200"), ("stats", "200")):
        assert value(samples, "moed_requests_total", endpoint=endpoint, status=status) >= 1, (
            endpoint, status)
    assert total(samples, "moed_expert_bytes_read_total") > 0
    assert value(samples, "moed_expert_read_seconds_count") > 0
    assert value(samples, "moed_inter_token_latency_seconds_count") > 0
    assert total(samples, "moed_expert_lookups_total", phase="prefill") > 0


def test_one_sequence_decode_lookups_are_layers_times_top_k_times_steps(daemon):
    """...and the request's log line carries the same numbers as the metrics' deltas."""
    _, _, before = scrape(daemon)
    answer, line = complete(daemon, "the expert cache reads", 12, ignore_eos=True)
    _, _, after = scrape(daemon)
    steps = delta(after, before, "moed_decode_steps_total")
    assert steps == line["decode_steps"] == 11                       # the first token: prefill
    assert delta(after, before, "moed_expert_lookups_total", phase="decode") == LAYERS * TOP_K * steps
    lookups = delta(after, before, "moed_expert_lookups_total")
    assert line["expert_hits"] + line["expert_misses"] == lookups
    assert line["expert_misses"] == delta(after, before, "moed_expert_lookups_total", outcome="miss")
    assert delta(after, before, "moed_prompt_tokens_total") == line["prompt_tokens"] == \
        answer["usage"]["prompt_tokens"]
    assert delta(after, before, "moed_generation_tokens_total") == line["completion_tokens"] == 12
    assert delta(after, before, "moed_requests_finished_total", finish_reason="length") == 1
    assert delta(after, before, "moed_inter_token_latency_seconds_count") == 11
    assert delta(after, before, "moed_decode_step_seconds_count") == steps
    assert delta(after, before, "moed_time_to_first_token_seconds_sum") == pytest.approx(
        line["time_to_first_token_seconds"], abs=1e-6)
    assert delta(after, before, "moed_request_duration_seconds_sum") == pytest.approx(
        line["duration_seconds"], abs=1e-6)
    assert delta(after, before, "moed_request_queue_seconds_sum") == pytest.approx(
        line["queue_seconds"], abs=1e-6)
    # decode steps split into waiting for reads and the rest
    assert delta(after, before, "moed_io_wait_seconds_total") + delta(
        after, before, "moed_compute_seconds_total") == pytest.approx(
        delta(after, before, "moed_decode_step_seconds_sum"), rel=1e-9, abs=1e-9)
    # bytes: the provider's count at submission (the log line) and the io workers' count
    # (the metric) only differ by prefetches still queued, which are never demand reads
    assert line["expert_bytes_read"] >= delta(after, before, "moed_expert_bytes_read_total",
                                              reason="demand") > 0


def test_stats_and_metrics_show_the_same_numbers(daemon):
    complete(daemon, "pins and slots", 6, ignore_eos=True)
    s = stats(daemon)
    _, _, m = scrape(daemon)                     # idle: nothing moves in between
    x = s["experts"]
    pairs = {
        "moed_requests_running": s["requests"]["running"],
        "moed_requests_waiting": s["requests"]["waiting"],
        "moed_prompt_tokens_total": s["requests"]["prompt_tokens"],
        "moed_generation_tokens_total": s["requests"]["completion_tokens"],
        "moed_decode_steps_total": s["decode_steps"],
        "moed_io_wait_seconds_total": s["io_wait_seconds"],
        "moed_compute_seconds_total": s["compute_seconds"],
        "moed_compute_threads": s["compute_threads"],
        "moed_model_load_seconds": s["model_load_seconds"],
        "moed_memory_budget_bytes": s["memory"]["budget_bytes"],
        "moed_state_saves_total": s["state"]["saves"],
        "moed_state_save_errors_total": s["state"]["save_errors"],
        "moed_expert_read_errors_total": x["read_errors"],
        "moed_io_workers": x["io_workers"],
        "moed_prefetch_issued_total": x["prefetches_issued"],
        "moed_prefetch_used_total": x["prefetches_used"],
        "moed_prefetch_wasted_bytes_total": x["prefetch_wasted_bytes"],
        "moed_pinned_experts": s["cache"]["pinned_experts"],
        "moed_pin_swaps_total": s["cache"]["pin_swaps"],
        "moed_prefill_tokens_total": s["requests"]["prefill_tokens"],
        "moed_prefix_cache_queries_total": s["prefix_cache"]["queries"],
        "moed_prefix_cache_hits_total": s["prefix_cache"]["hits"],
        "moed_prefix_cache_reused_tokens_total": s["prefix_cache"]["reused_tokens"],
        "moed_prefix_cache_bytes": s["prefix_cache"]["bytes"],
        "moed_prefix_cache_capacity_bytes": s["prefix_cache"]["capacity_bytes"],
    }
    assert {name: value(m, name) for name in pairs} == pairs
    assert s["decode_steps"] > 0 and x["misses"] > 0
    for outcome, key in (("hit", "hits"), ("prefetch_hit", "prefetch_hits"), ("miss", "misses")):
        assert total(m, "moed_expert_lookups_total", outcome=outcome) == x[key]
        for phase in ("prefill", "decode"):
            assert total(m, "moed_expert_lookups_total", outcome=outcome, phase=phase) == \
                x["lookups"][phase][outcome]
    assert s["hit_rate"] == x["hits"] / (x["hits"] + x["prefetch_hits"] + x["misses"])
    assert total(m, "moed_expert_bytes_read_total") == x["bytes_read"]
    for reason, n in x["bytes_read_by_reason"].items():
        assert value(m, "moed_expert_bytes_read_total", reason=reason) == n
    slot = s["cache"]["slot_bytes"]
    for tier in ("pinned", "dynamic"):
        assert value(m, "moed_expert_cache_bytes", tier=tier) == s["cache"][tier]["resident_slots"] * slot
        assert value(m, "moed_expert_cache_capacity_bytes", tier=tier) == s["cache"][tier]["bytes"]
        assert value(m, "moed_expert_evictions_total", tier=tier) == s["cache"]["evictions"][tier]
    assert value(m, "moed_expert_evictions_total", tier="dynamic") > 0    # a quarter cache evicts


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits + " é€😀\"\\{}<>")
                   for _ in range(rng.randint(0, n)))


def test_ten_thousand_random_requests_add_no_series(daemon):
    """Random `model` fields and prompts (and paths, methods, bodies): the series of a
    scrape stay the same; only counts move."""
    rng = random.Random(10_000)
    _, _, before = scrape(daemon)
    bodies = []
    for i in range(10_000):
        kind = rng.random()
        prompt = _random_text(rng, 60)
        if i % 100 == 0:                   # a real one, whose prompt is random too
            bodies.append(("POST", "/v1/completions", {"prompt": prompt or "x", "max_tokens": 1}))
        elif kind < 0.80:
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            body = {"model": _random_text(rng, 40), "max_tokens": 1}
            body.update({"prompt": prompt} if path == "/v1/completions" else
                        {"messages": [{"role": "user", "content": prompt}]})
            bodies.append(("POST", path, body))
        elif kind < 0.90:
            bodies.append(("POST", "/v1/completions", _random_text(rng, 30).encode()))
        else:
            bodies.append((rng.choice(["GET", "PUT", "POST"]), "/" + "".join(
                rng.choice(string.ascii_lowercase + "/") for _ in range(rng.randint(1, 20))), None))

    async def run() -> list[int]:
        connector = aiohttp.UnixConnector(path=daemon.socket, limit=16)
        async with aiohttp.ClientSession(connector=connector) as client:
            async def one(method, path, body) -> int:
                content = body if isinstance(body, (bytes, type(None))) else json.dumps(body)
                async with client.request(method, "http://localhost" + path, data=content) as r:
                    await r.read()
                    return r.status
            return await asyncio.gather(*(one(*b) for b in bodies))

    statuses = asyncio.run(run())
    assert statuses.count(200) >= 100 and statuses.count(404) > 5000
    _, _, after = scrape(daemon)
    assert set(after) == set(before)
    assert delta(after, before, "moed_requests_total") >= 10_000
    counted = {str(s) for s in statuses}
    for status in counted:
        assert total(after, "moed_requests_total", status=status) > 0, status


# ---------------------------------------------------------------------- bytes read


def test_a_cache_holding_every_expert_reads_each_once(model_dir, plans):
    """Prefetch off, every expert fits: after every expert was needed, the bytes read are
    the sum of all experts' aligned read lengths — by the metrics, the stats and the
    request log lines (the provider's own count at submission)."""
    slot = max(p.slot_bytes for p in plans.values())
    d = start(model_dir, "--expert-cache-bytes", str(len(plans) * slot), "--no-prefetch")
    try:
        rng = random.Random(3)
        lines = []
        for _ in range(20):
            prompt = " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(60))
            lines.append(complete(d, prompt, 2)[1])
            _, _, m = scrape(d)
            if total(m, "moed_expert_lookups_total", outcome="miss") == len(plans):
                break
        for layer in range(LAYERS):                   # every expert read, none twice
            assert total(m, "moed_expert_lookups_total", layer=str(layer), outcome="miss") == EXPERTS
        expected = sum(p.slot_bytes for p in plans.values())
        assert value(m, "moed_expert_bytes_read_total", reason="demand") == expected
        assert value(m, "moed_expert_bytes_read_total", reason="prefetch") == 0
        assert value(m, "moed_expert_bytes_read_total", reason="pin_load") == 0
        assert stats(d)["experts"]["bytes_read"] == expected
        assert sum(line["expert_bytes_read"] for line in lines) == expected
        assert total(m, "moed_expert_evictions_total") == 0
        assert value(m, "moed_prefetch_issued_total") == 0
    finally:
        assert d.stop() == 0
        finish(d)


def test_in_process_prefetch_counts_agree_with_the_io_workers(model_dir, plans):
    """An Engine over a streaming provider that prefetches every candidate (half the
    experts fit: a cache at its minimum leaves no slot to prefetch into): decode
    lookups are layers x top_k x steps for one sequence; once the reads are drained the
    io workers' bytes (what the metric exports) equal what the provider submitted."""
    config, checkpoint = load_config(model_dir), Checkpoint(model_dir)
    layout = ExpertLayout(checkpoint, config)
    half = len(plans) // 2 * max(p.slot_bytes for p in plans.values())
    provider = StreamingExpertProvider(layout, config, StreamingOptions(
        cache_bytes=half, prefetch=True, prefetch_min_precision=0.0))
    model = Model(config, checkpoint, layout, provider, 1)
    gaps, steps = [], []
    engine = Engine(model, Tokenizer.from_model_dir(model_dir), on_token_gap=gaps.append,
                    on_decode_step=steps.append)
    engine.start()

    async def run(request: EngineRequest):
        handle = engine.submit(request, asyncio.get_running_loop())
        while (await handle.events.get()).finish_reason is None:
            pass
        return handle.stats
    try:
        result = asyncio.run(run(EngineRequest("r", tuple(range(5, 45)), max_tokens=16)))
        snapshot, document = engine.call(lambda: collect(
            engine, None, memory_budget_bytes=half, memory_available_bytes=None,
            model_load_seconds=0.0)).result()
    finally:
        engine.stop()
    x = snapshot.experts
    assert snapshot.decode_steps == result.decode_steps == 15 == len(steps)
    assert len(gaps) == 15
    assert x.lookups_where(phase="decode") == LAYERS * TOP_K * snapshot.decode_steps
    assert x.lookups_where(phase="prefill") >= LAYERS * TOP_K
    assert x.lookups_where() == result.expert_hits + result.expert_misses
    assert x.prefetch_issued > 0 and x.lookups_where("prefetch_hit") + x.prefetch_used > 0
    assert document["experts"]["bytes_read"] == sum(x.bytes_read.values())
    model.close()                                   # drains every queued read
    drained = expert_counters(provider)
    assert drained.bytes_read == provider.bytes_submitted
    assert drained.bytes_read["prefetch"] > 0
    assert drained.prefetch_wasted_bytes <= drained.bytes_read["prefetch"]


def test_totals_survive_a_cache_rebuild_and_state_saves_are_counted(model_dir, plans,
                                                                     quarter_cache, tmp_path):
    """SIGHUP may replace the provider (a new budget): counters must not go back."""
    model, session = open_model(model_dir, threads=1, cache_bytes=quarter_cache, prefetch=False,
                                state_dir=tmp_path)
    engine = Engine(model, Tokenizer.from_model_dir(model_dir))      # not started: inline calls

    def reading():
        return collect(engine, session, memory_budget_bytes=quarter_cache,
                       memory_available_bytes=None, model_load_seconds=1.0)
    try:
        seq = model.new_sequence()
        model.forward(seq, list(range(5, 25)))
        first, _ = reading()
        assert session.flush() and session.flush()
        session.rebuild(cache_bytes=len(plans) // 2 * max(p.slot_bytes for p in plans.values()))
        model.forward(seq, [7])                     # one token: top_k lookups per MoE layer
    finally:
        model.close()                               # drains the reads still queued
    second, document = reading()
    a, b = first.experts, second.experts
    assert b.lookups_where() == a.lookups_where() + LAYERS * TOP_K
    # the new cache pins nothing (20 prompt tokens taught no pin share); its warm start
    # reads the most used experts into the empty dynamic tier, counted as pin loads
    rebuilt = session.provider
    assert rebuilt.cache.pinned_slots == 0 and rebuilt.warm_loads > 0
    assert a.bytes_read.get("pin_load", 0) == 0
    assert b.bytes_read["pin_load"] == rebuilt.bytes_submitted["pin_load"] > 0
    assert a.lookups_where("miss") <= b.lookups_where("miss") <= a.lookups_where("miss") + LAYERS * TOP_K
    assert sum(b.bytes_read.values()) > sum(a.bytes_read.values()) > 0
    assert b.evictions["dynamic"] >= a.evictions["dynamic"] > 0
    assert (second.state_saves, second.state_save_errors) == (2, 0)
    assert document["state"] == {"saves": 2, "save_errors": 0}
    assert document["experts"]["misses"] == b.lookups_where("miss")
    assert status_line(document) == f"0.0 tokens/s, hit rate {document['hit_rate']:.3f}"
