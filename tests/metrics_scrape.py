"""Reading a /metrics scrape in tests, and the series moed must export (issue 5, "Metrics").

`parse(text)` -> (types, samples): `types` maps each `# TYPE` name to its type,
`samples` maps (sample name, frozenset of label pairs) to the value. `expected_series`
lists every series a scrape must hold, label combinations included, for a model with
the given MoE layer ids — written out from the issue's list, not from the code under test.
"""
from __future__ import annotations

import subprocess

import tools

TYPES = {
    # requests
    "moed_requests_total": "counter", "moed_requests_running": "gauge",
    "moed_requests_waiting": "gauge", "moed_request_queue_seconds": "histogram",
    "moed_time_to_first_token_seconds": "histogram",
    "moed_inter_token_latency_seconds": "histogram",
    "moed_request_duration_seconds": "histogram", "moed_prompt_tokens_total": "counter",
    "moed_generation_tokens_total": "counter", "moed_requests_finished_total": "counter",
    # prefill and the prefix cache
    "moed_prefill_tokens_total": "counter", "moed_prefix_cache_queries_total": "counter",
    "moed_prefix_cache_hits_total": "counter", "moed_prefix_cache_reused_tokens_total": "counter",
    "moed_prefix_cache_evicted_blocks_total": "counter", "moed_prefix_cache_bytes": "gauge",
    "moed_prefix_cache_capacity_bytes": "gauge",
    "moed_connections_refused_total": "counter",
    "moed_connections_refused_per_peer_total": "counter",
    # experts
    "moed_expert_lookups_total": "counter", "moed_expert_bytes_read_total": "counter",
    "moed_expert_read_seconds": "histogram", "moed_expert_read_errors_total": "counter",
    "moed_expert_cache_bytes": "gauge", "moed_expert_cache_capacity_bytes": "gauge",
    "moed_pinned_experts": "gauge", "moed_pin_swaps_total": "counter",
    "moed_expert_evictions_total": "counter",
    # prefetch
    "moed_prefetch_issued_total": "counter", "moed_prefetch_used_total": "counter",
    "moed_prefetch_wasted_bytes_total": "counter",
    # engine
    "moed_decode_steps_total": "counter", "moed_decode_step_seconds": "histogram",
    "moed_io_wait_seconds_total": "counter", "moed_compute_seconds_total": "counter",
    "moed_compute_threads": "gauge", "moed_io_workers": "gauge",
    # do no harm: the referee and the learned pins (issue 17)
    "moed_mechanism_enabled": "gauge", "moed_mechanism_net_seconds_per_token": "gauge",
    "moed_mechanism_decisions_total": "counter", "moed_naive_estimated_speedup": "gauge",
    "moed_shadow_lookups_total": "counter", "moed_shadow_naive_misses_total": "counter",
    "moed_pin_share": "gauge",
    # memory and tuning
    "moed_memory_budget_bytes": "gauge", "moed_memory_available_bytes": "gauge",
    "moed_tuner_trials_total": "counter", "moed_tuner_accepted_total": "counter",
    # process and build
    "moed_build_info": "gauge", "moed_model_load_seconds": "gauge",
    "moed_state_saves_total": "counter", "moed_state_save_errors_total": "counter",
    "process_cpu_seconds_total": "counter", "process_resident_memory_bytes": "gauge",
    "process_virtual_memory_bytes": "gauge", "process_start_time_seconds": "gauge",
    "process_open_fds": "gauge", "process_max_fds": "gauge",
}
MECHANISMS = ("prefetch", "idle_prefetch", "early_hints", "policy", "lrfu", "pins")
ENDPOINTS = ("health", "models", "completions", "chat_completions", "messages",
             "responses", "metrics", "stats", "pins",
             "pins_reset", "other")
STATUSES = ("200", "400", "401", "403", "404", "405", "408", "413", "429", "499", "500", "503",
            "other")
LABELS = {
    "moed_requests_total": [{"endpoint": e, "status": s} for e in ENDPOINTS for s in STATUSES],
    "moed_connections_refused_total": [{"listener": x} for x in ("socket", "tcp", "metrics")],
    "moed_connections_refused_per_peer_total": [{"listener": x}
                                                for x in ("socket", "tcp", "metrics")],
    "moed_requests_finished_total": [{"finish_reason": r} for r in
                                     ("stop", "length", "timeout", "cancelled", "error")],
    "moed_expert_bytes_read_total": [{"reason": r} for r in ("demand", "prefetch", "pin_load")],
    "moed_expert_cache_bytes": [{"tier": t} for t in ("pinned", "dynamic", "staging")],
    "moed_expert_cache_capacity_bytes": [{"tier": t} for t in ("pinned", "dynamic", "staging")],
    "moed_expert_evictions_total": [{"tier": t} for t in ("pinned", "dynamic")],
    **{name: [{"mechanism": m} for m in MECHANISMS]
       for name in ("moed_mechanism_enabled", "moed_mechanism_net_seconds_per_token",
                    "moed_mechanism_decisions_total")},
}
# Buckets chosen for the quantity: token latencies 1 ms - 60 s, SSD reads 10 us - 1 s.
TOKEN_BUCKETS = ("0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0",
                 "2.5", "5.0", "10.0", "30.0", "60.0", "+Inf")
REQUEST_BUCKETS = ("0.001", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5",
                   "5.0", "10.0", "30.0", "60.0", "120.0", "300.0", "600.0", "+Inf")
READ_BUCKETS = ("1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025",
                "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "+Inf")
BUCKETS = {"moed_request_queue_seconds": REQUEST_BUCKETS,
           "moed_request_duration_seconds": REQUEST_BUCKETS,
           "moed_time_to_first_token_seconds": TOKEN_BUCKETS,
           "moed_inter_token_latency_seconds": TOKEN_BUCKETS,
           "moed_decode_step_seconds": TOKEN_BUCKETS, "moed_expert_read_seconds": READ_BUCKETS}
# Families whose value is configuration or a reading of the host, not an event count.
NOT_ZERO_AT_START = {"moed_build_info", "moed_expert_cache_capacity_bytes", "moed_compute_threads",
                     "moed_io_workers", "moed_memory_budget_bytes", "moed_memory_available_bytes",
                     "moed_model_load_seconds", "moed_expert_cache_bytes",
                     "moed_prefix_cache_capacity_bytes", "moed_mechanism_enabled"}

Series = tuple[str, frozenset]


def parse(text: str) -> tuple[dict[str, str], dict[Series, float]]:
    """(TYPE of each family, value of each sample) of a text-format scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"series {key} appears twice"
            samples[key] = s.value
    return types, samples


def series(name: str, **labels: str) -> Series:
    return name, frozenset(labels.items())


def expected_series(moe_layers, build_labels: dict[str, str]) -> set[Series]:
    """Every series a scrape of a daemon serving a model with these MoE layer ids holds."""
    out = set()
    for name, kind in TYPES.items():
        if kind == "histogram":
            out |= {series(f"{name}_bucket", le=le) for le in BUCKETS[name]}
            out |= {series(f"{name}_count"), series(f"{name}_sum")}
        elif name == "moed_expert_lookups_total":
            out |= {series(name, layer=str(l), outcome=o, phase=p) for l in moe_layers
                    for o in ("hit", "prefetch_hit", "miss") for p in ("prefill", "decode")}
        elif name == "moed_build_info":
            out.add(series(name, **build_labels))
        else:
            out |= {series(name, **labels) for labels in LABELS.get(name, [{}])}
    return out


def value(samples: dict[Series, float], name: str, **labels: str) -> float:
    return samples[series(name, **labels)]


def total(samples: dict[Series, float], name: str, **match: str) -> float:
    """Sum of the samples of `name` whose labels include `match`."""
    return sum(v for (n, labels), v in samples.items()
               if n == name and set(match.items()) <= labels)


def promtool_check(text: str) -> subprocess.CompletedProcess:
    """`promtool check metrics` on a scrape (the test declares @pytest.mark.tools("promtool"))."""
    return subprocess.run([tools.path("promtool"), "check", "metrics"], input=text,
                          capture_output=True, text=True, timeout=60)
