"""The daemon's Prometheus metrics: one registry, the moed_* families, closed label sets.

One registry per daemon, owned by it (`DaemonMetrics.registry`); `/metrics` on the Unix
socket and on `metrics_address` render the same registry. `_created` series are
disabled (Prometheus 2.42 would store each as a series).

Two kinds of sources, as in client_python's own `ProcessCollector`:
  - statistics the daemon already keeps (engine counters, the expert cache's and the io
    pool's counters, memory readings) arrive as a plain `Snapshot`, read at scrape time
    by `SnapshotCollector` from a callable the daemon passes in (it returns the latest
    snapshot, or None while the model loads: every family is then at zero);
  - per-event latencies (queue, time to first token, inter-token, duration, decode step)
    and the HTTP response count are observed as they happen, through `DaemonMetrics`
    methods (thread-safe: the engine thread and the event loop both call them).

Conventions: names `moed_*` in base units (seconds, bytes), counters end in `_total`
(custom collectors export them as `CounterMetricFamily`), labels only from the closed
sets below — `layer` is a model layer id of a MoE layer (a string), never an expert id,
a client's model name or a prompt. Every family and every combination of its label
values is present from the first scrape, at zero where nothing has happened yet.
This module imports only prometheus_client (and the standard library): the daemon
converts its own objects into a `Snapshot`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

prometheus_client.disable_created_metrics()

# ------------------------------------------------------------------ closed label sets

ENDPOINTS = ("health", "models", "completions", "chat_completions", "messages",
             "responses", "metrics", "stats", "pins",
             "pins_reset", "other")                 # route names of daemon.service.app.HttpApp.application
# Statuses moed answers with; 499: the client closed the connection before the answer ended.
STATUSES = ("200", "400", "401", "403", "404", "405", "408", "413", "429", "499", "500", "503",
            "other")
LISTENERS = ("socket", "tcp", "metrics")            # daemon.service.connections listeners
FINISH_REASONS = ("stop", "length", "timeout", "cancelled", "error")
OUTCOMES = ("hit", "prefetch_hit", "miss")
PHASES = ("prefill", "decode")
REASONS = ("demand", "prefetch", "pin_load")
TIERS = ("pinned", "dynamic")                       # tiers that evict
# The adaptive mechanisms the do-no-harm referee values (scheduler.referee.MECHANISMS) and
# the learned pins (scheduler.pinlearn).
MECHANISMS = ("prefetch", "idle_prefetch", "early_hints", "policy", "lrfu", "pins")
CACHE_TIERS = ("pinned", "dynamic", "staging")      # tiers that hold slots (staging: guesses)

# ------------------------------------------------------------------ buckets (seconds)

# Per token: a decode step, the first token, the gap between tokens: 1 ms - 60 s.
TOKEN_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                         5.0, 10.0, 30.0, 60.0)
# Per request: time in the queue, time from submit to the end: 1 ms - 10 min.
REQUEST_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                           30.0, 60.0, 120.0, 300.0, 600.0)


def endpoint_label(route_name: str | None) -> str:
    """The `endpoint` label of a route name ("other" for no name or an unknown one)."""
    return route_name if route_name in ENDPOINTS else "other"


def status_label(status: int) -> str:
    """The `status` label of an HTTP status code ("other" outside STATUSES)."""
    text = str(status)
    return text if text in STATUSES else "other"


# ------------------------------------------------------------------ what the daemon reports


@dataclass(frozen=True)
class ExpertCounters:
    """The expert cache's and io pool's totals (additive: a replaced cache's totals are
    carried over by adding them to the new one's).

    lookups: (layer id, outcome, phase) -> needed experts (one per step, layer and
    distinct expert). bytes_read: reason -> aligned bytes of the reads the io workers
    started. read_seconds_buckets: cumulative (upper bound, count) pairs of successful
    read latencies ending at +inf; read_seconds_sum their sum. evictions: tier -> experts
    evicted. pin_swaps: experts that entered the pin set while serving.
    prefetch_issued / prefetch_used: prefetch reads issued / whose expert was then
    needed; prefetch_wasted_bytes: bytes of prefetched experts that left unused.
    shadow_lookups / shadow_naive_misses: decode lookups the shadow of the naive mode
    replayed and its misses (scheduler.shadow). mechanism_decisions: mechanism -> times
    the referee turned it on or off (the pin learner's changes under "pins").
    """

    lookups: Mapping[tuple[int, str, str], int] = field(default_factory=dict)
    bytes_read: Mapping[str, int] = field(default_factory=dict)
    read_errors: int = 0
    read_seconds_buckets: tuple[tuple[float, int], ...] = ()
    read_seconds_sum: float = 0.0
    evictions: Mapping[str, int] = field(default_factory=dict)
    pin_swaps: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted_bytes: int = 0
    shadow_lookups: int = 0
    shadow_naive_misses: int = 0
    mechanism_decisions: Mapping[str, int] = field(default_factory=dict)

    def __add__(self, other: ExpertCounters) -> ExpertCounters:
        def add(a: Mapping, b: Mapping) -> dict:
            return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}
        buckets = self.read_seconds_buckets or other.read_seconds_buckets
        if self.read_seconds_buckets and other.read_seconds_buckets:
            if [b for b, _ in self.read_seconds_buckets] != [b for b, _ in other.read_seconds_buckets]:
                raise ValueError("read_seconds_buckets of different bounds cannot be added")
            buckets = tuple((b, n + m) for (b, n), (_, m) in zip(self.read_seconds_buckets,
                                                                 other.read_seconds_buckets))
        return ExpertCounters(
            lookups=add(self.lookups, other.lookups), bytes_read=add(self.bytes_read, other.bytes_read),
            read_errors=self.read_errors + other.read_errors, read_seconds_buckets=buckets,
            read_seconds_sum=self.read_seconds_sum + other.read_seconds_sum,
            evictions=add(self.evictions, other.evictions), pin_swaps=self.pin_swaps + other.pin_swaps,
            prefetch_issued=self.prefetch_issued + other.prefetch_issued,
            prefetch_used=self.prefetch_used + other.prefetch_used,
            prefetch_wasted_bytes=self.prefetch_wasted_bytes + other.prefetch_wasted_bytes,
            shadow_lookups=self.shadow_lookups + other.shadow_lookups,
            shadow_naive_misses=self.shadow_naive_misses + other.shadow_naive_misses,
            mechanism_decisions=add(self.mechanism_decisions, other.mechanism_decisions))

    def lookups_where(self, outcome: str | None = None, phase: str | None = None) -> int:
        """Sum of `lookups` over every layer, restricted to an outcome and/or a phase."""
        return sum(n for (_, o, p), n in self.lookups.items()
                   if outcome in (None, o) and phase in (None, p))


@dataclass(frozen=True)
class Snapshot:
    """Everything the collector exports, read at one instant (defaults: nothing yet).

    Engine: requests_running / requests_waiting (now); decode_steps, prompt_tokens,
    generation_tokens (totals); io_wait_seconds / compute_seconds: the time of decode
    steps spent waiting for expert reads / the rest. experts: ExpertCounters.
    Gauges: expert_cache_bytes / expert_cache_capacity_bytes per tier, pinned_experts,
    compute_threads, io_workers, memory_budget_bytes, memory_available_bytes,
    model_load_seconds. Daemon totals: state_saves, state_save_errors, tuner_trials,
    tuner_accepted. Prefill: prefill_tokens (prompt tokens computed, the others came from
    the prefix cache); prefix_cache_queries / _hits / _reused_tokens / _evicted_blocks
    (totals), prefix_cache_bytes / _capacity_bytes (gauges). Do no harm: mechanism_enabled
    (1/0) and mechanism_net_seconds (the referee's smoothed saving minus cost, seconds per
    token) per mechanism, naive_estimated_speedup (the referee's latest estimate; 0: none
    yet), pin_share.
    """

    requests_running: int = 0
    requests_waiting: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    io_wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    experts: ExpertCounters = ExpertCounters()
    expert_cache_bytes: Mapping[str, int] = field(default_factory=dict)
    expert_cache_capacity_bytes: Mapping[str, int] = field(default_factory=dict)
    pinned_experts: int = 0
    compute_threads: int = 0
    io_workers: int = 0
    memory_budget_bytes: int = 0
    memory_available_bytes: int = 0
    model_load_seconds: float = 0.0
    state_saves: int = 0
    state_save_errors: int = 0
    tuner_trials: int = 0
    tuner_accepted: int = 0
    prefill_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_reused_tokens: int = 0
    prefix_cache_bytes: int = 0
    prefix_cache_capacity_bytes: int = 0
    prefix_cache_evicted_blocks: int = 0
    mechanism_enabled: Mapping[str, int] = field(default_factory=dict)
    mechanism_net_seconds: Mapping[str, float] = field(default_factory=dict)
    naive_estimated_speedup: float = 0.0
    pin_share: float = 0.0


# ------------------------------------------------------------------ the collector


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _labelled(family, label: str, keys: Sequence[str], values: Mapping[str, float]):
    for key in keys:
        family.add_metric([key], values.get(key, 0))
    return family


class SnapshotCollector(prometheus_client.registry.Collector):
    """Exports a `Snapshot` at scrape time (the pattern of client_python's ProcessCollector).

    moe_layers: the model's MoE layer ids (the `layer` label's closed set).
    read_seconds_buckets: the upper bounds (seconds, ending at +inf) of the io pool's
    read-latency buckets, so that `moed_expert_read_seconds` has its buckets before the
    first snapshot. source: () -> the latest Snapshot, or None (all at zero).
    """

    def __init__(self, moe_layers: Sequence[int], read_seconds_buckets: Sequence[float],
                 source: Callable[[], Snapshot | None]):
        self.layers = tuple(str(int(l)) for l in moe_layers)
        self._layer_ids = tuple(int(l) for l in moe_layers)
        self.read_bounds = tuple(float(b) for b in read_seconds_buckets)
        if not self.read_bounds or self.read_bounds[-1] != float("inf"):
            raise ValueError("read_seconds_buckets must end at +inf")
        self._source = source

    def collect(self) -> Iterable:
        return self._families(self._source() or Snapshot())

    def describe(self) -> Iterable:
        """The families at zero (the registry's name check; `source` is not called)."""
        return self._families(Snapshot())

    def _families(self, s: Snapshot) -> Iterable:
        x = s.experts
        yield _gauge("moed_requests_running", "Requests being decoded now.", s.requests_running)
        yield _gauge("moed_requests_waiting", "Requests queued for a place in the batch.",
                     s.requests_waiting)
        yield _counter("moed_prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens)
        yield _counter("moed_prefill_tokens", "Prompt tokens computed by prefill (the rest "
                       "came from the prefix cache).", s.prefill_tokens)
        yield _counter("moed_prefix_cache_queries", "Prefix cache lookups, one per admitted "
                       "request.", s.prefix_cache_queries)
        yield _counter("moed_prefix_cache_hits", "Prefix cache lookups that reused at least "
                       "one block.", s.prefix_cache_hits)
        yield _counter("moed_prefix_cache_reused_tokens", "Prompt tokens whose KV came from "
                       "the prefix cache.", s.prefix_cache_reused_tokens)
        yield _counter("moed_prefix_cache_evicted_blocks", "Prefix cache blocks evicted "
                       "(least recently used first).", s.prefix_cache_evicted_blocks)
        yield _gauge("moed_prefix_cache_bytes", "Bytes of KV blocks held by the prefix cache.",
                     s.prefix_cache_bytes)
        yield _gauge("moed_prefix_cache_capacity_bytes", "Byte budget of the prefix cache "
                     "(prefix_cache_bytes).", s.prefix_cache_capacity_bytes)
        yield _counter("moed_generation_tokens", "Tokens generated, including those of requests cancelled before "
                       "they were delivered.",
                       s.generation_tokens)

        lookups = CounterMetricFamily(
            "moed_expert_lookups", "Routed experts needed, one per step, MoE layer and distinct "
            "expert: found ready in the cache (hit; a prefetch that completed in time counts here, see "
            "moed_prefetch_used_total), found still being read by a prefetch or pin load "
            "(prefetch_hit), or read on demand (miss).",
            labels=["layer", "outcome", "phase"])
        for layer, layer_id in zip(self.layers, self._layer_ids):
            for outcome in OUTCOMES:
                for phase in PHASES:
                    lookups.add_metric([layer, outcome, phase], x.lookups.get((layer_id, outcome, phase), 0))
        yield lookups
        yield _labelled(CounterMetricFamily(
            "moed_expert_bytes_read", "Bytes of expert reads started by the io workers (aligned "
            "lengths), by reason.", labels=["reason"]), "reason", REASONS, x.bytes_read)
        yield self._read_seconds(x)
        yield _counter("moed_expert_read_errors", "Expert reads that failed after a retry.",
                       x.read_errors)
        yield _labelled(GaugeMetricFamily(
            "moed_expert_cache_bytes", "Bytes of expert cache slots holding (or loading) an "
            "expert, by tier.", labels=["tier"]), "tier", CACHE_TIERS, s.expert_cache_bytes)
        yield _labelled(GaugeMetricFamily(
            "moed_expert_cache_capacity_bytes", "Bytes of expert cache slots, by tier.",
            labels=["tier"]), "tier", CACHE_TIERS, s.expert_cache_capacity_bytes)
        yield _gauge("moed_pinned_experts", "Experts in the pin set.", s.pinned_experts)
        yield _counter("moed_pin_swaps", "Experts that entered the pin set while serving.",
                       x.pin_swaps)
        yield _labelled(CounterMetricFamily(
            "moed_expert_evictions", "Experts evicted from the cache, by tier.", labels=["tier"]),
            "tier", TIERS, x.evictions)

        yield _counter("moed_prefetch_issued", "Prefetch reads issued.", x.prefetch_issued)
        yield _counter("moed_prefetch_used", "Prefetched experts that were then needed.",
                       x.prefetch_used)
        yield _counter("moed_prefetch_wasted_bytes", "Bytes of prefetched experts evicted or "
                       "failed before any use.", x.prefetch_wasted_bytes)

        yield _labelled(GaugeMetricFamily(
            "moed_mechanism_enabled", "1 while an adaptive mechanism is on (the do-no-harm "
            "referee turns off what does not pay and probes it again later; pins: a share "
            "above 0 is learned).", labels=["mechanism"]), "mechanism", MECHANISMS,
            s.mechanism_enabled)
        yield _labelled(GaugeMetricFamily(
            "moed_mechanism_net_seconds_per_token", "A mechanism's measured saving minus its "
            "cost on the current traffic, smoothed over windows of decode steps.",
            labels=["mechanism"]), "mechanism", MECHANISMS, s.mechanism_net_seconds)
        yield _labelled(CounterMetricFamily(
            "moed_mechanism_decisions", "Times a mechanism was turned on or off (pins: the "
            "learned share or set changed).", labels=["mechanism"]), "mechanism", MECHANISMS,
            x.mechanism_decisions)
        yield _gauge("moed_naive_estimated_speedup", "The referee's estimate of decode speed "
                     "over the naive mode (LRU, no pins, no prefetch) on the latest window; "
                     "0 before the first.", s.naive_estimated_speedup)
        yield _counter("moed_shadow_lookups", "Decode lookups replayed by the shadow of the "
                       "naive mode's cache.", x.shadow_lookups)
        yield _counter("moed_shadow_naive_misses", "Misses the naive mode's cache would have "
                       "had on those lookups.", x.shadow_naive_misses)
        yield _gauge("moed_pin_share", "Share of the cache above its minimum the learned pins "
                     "take.", s.pin_share)

        yield _counter("moed_decode_steps", "Batched decode steps.", s.decode_steps)
        yield _counter("moed_io_wait_seconds", "Time of decode steps spent waiting for expert "
                       "reads.", s.io_wait_seconds)
        yield _counter("moed_compute_seconds", "Time of decode steps not spent waiting for "
                       "expert reads.", s.compute_seconds)
        yield _gauge("moed_compute_threads", "Threads of the compute kernels.", s.compute_threads)
        yield _gauge("moed_io_workers", "Expert reader threads.", s.io_workers)

        yield _gauge("moed_memory_budget_bytes", "Memory budget of the expert cache.",
                     s.memory_budget_bytes)
        yield _gauge("moed_memory_available_bytes",
                     "Memory moed may still add: MemAvailable, bounded by its cgroups' headroom.",
                     s.memory_available_bytes)
        yield _counter("moed_tuner_trials", "Settings the self-tuner tried.", s.tuner_trials)
        yield _counter("moed_tuner_accepted", "Settings the self-tuner kept.", s.tuner_accepted)

        yield _gauge("moed_model_load_seconds", "Time the model took to load.", s.model_load_seconds)
        yield _counter("moed_state_saves", "Writes of the learned state file.", s.state_saves)
        yield _counter("moed_state_save_errors", "Writes of the learned state file that failed.",
                       s.state_save_errors)

    def _read_seconds(self, x: ExpertCounters) -> HistogramMetricFamily:
        counts = dict(x.read_seconds_buckets)
        buckets, last = [], 0
        for bound in self.read_bounds:
            last = counts.get(bound, last)       # cumulative: a missing bound repeats the last
            buckets.append((floatToGoString(bound), last))
        return HistogramMetricFamily("moed_expert_read_seconds", "Latency of successful expert "
                                     "reads (first preadv to last, queue wait excluded).",
                                     buckets=buckets, sum_value=x.read_seconds_sum)


# ------------------------------------------------------------------ the daemon's registry


class DaemonMetrics:
    """The registry of one daemon and the metrics it observes as events happen.

    version / model_type / quantization / numerics: the `moed_build_info` labels
    (quantization: "none" for weights in plain floats, else the quantised weights' format,
    e.g. "fp8_e4m3", "mxfp4": a closed set, ext.formats.quant.formats(); "unknown" when
    config.json could not be read; numerics: "exact", "fast" or "fast-bf16", the numerics mode of the
    quantised kernels in force: the configured setting resolved, never "auto"). moe_layers, read_seconds_buckets, source: as `SnapshotCollector`.
    Methods are thread-safe.
    """

    def __init__(self, *, version: str, model_type: str, moe_layers: Sequence[int],
                 read_seconds_buckets: Sequence[float], quantization: str = "none",
                 numerics: str = "exact", source: Callable[[], Snapshot | None] = lambda: None):
        self.registry = registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=registry)
        Info("moed_build", "moed version, the served model's architecture, the format of "
             "its quantised weights ('none': plain floats) and the numerics mode in force "
             "('exact' or 'fast')", registry=registry).info(
            {"version": version, "model_type": model_type, "quantization": quantization,
             "numerics": numerics})
        self.collector = SnapshotCollector(moe_layers, read_seconds_buckets, source)
        registry.register(self.collector)
        self.requests = Counter("moed_requests", "HTTP responses, by route name and status.",
                                ["endpoint", "status"], registry=registry)
        for endpoint in ENDPOINTS:
            for status in STATUSES:
                self.requests.labels(endpoint, status)
        self.refused = Counter("moed_connections_refused", "Connections answered 503 at once "
                               "because their listener held max_connections open connections.",
                               ["listener"], registry=registry)
        self.peer_refused = Counter(
            "moed_connections_refused_per_peer", "Connections answered 503 at once because "
            "their peer held max_connections_per_peer open connections to their listener.",
            ["listener"], registry=registry)
        for listener in LISTENERS:
            self.refused.labels(listener)
            self.peer_refused.labels(listener)
        self.finished = Counter("moed_requests_finished", "Generation requests ended, by "
                                "finish reason.", ["finish_reason"], registry=registry)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        self.queue_seconds = Histogram(
            "moed_request_queue_seconds", "Time from submission to admission into the batch.",
            buckets=REQUEST_SECONDS_BUCKETS, registry=registry)
        self.time_to_first_token = Histogram(
            "moed_time_to_first_token_seconds", "Time from submission to the first token.",
            buckets=TOKEN_SECONDS_BUCKETS, registry=registry)
        self.inter_token = Histogram(
            "moed_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
            buckets=TOKEN_SECONDS_BUCKETS, registry=registry)
        self.duration = Histogram(
            "moed_request_duration_seconds", "Time from submission to the end of a request.",
            buckets=REQUEST_SECONDS_BUCKETS, registry=registry)
        self.decode_step = Histogram(
            "moed_decode_step_seconds", "Time of one batched decode step.",
            buckets=TOKEN_SECONDS_BUCKETS, registry=registry)

    def response(self, route_name: str | None, status: int) -> None:
        """Count one HTTP response (unknown routes and statuses map to "other")."""
        self.requests.labels(endpoint_label(route_name), status_label(status)).inc()

    def connection_refused(self, listener: str, key: str = "max_connections") -> None:
        """Count one connection refused at accept (a listener of LISTENERS) by the cap of
        configuration key `key`: "max_connections" or "max_connections_per_peer"."""
        counter = self.peer_refused if key == "max_connections_per_peer" else self.refused
        counter.labels(listener if listener in LISTENERS else "socket").inc()

    def request_finished(self, finish_reason: str, queue_s: float,
                         time_to_first_token_s: float | None, duration_s: float) -> None:
        """Observe one ended generation request (time_to_first_token_s None: no token)."""
        if finish_reason in FINISH_REASONS:
            self.finished.labels(finish_reason).inc()
        self.queue_seconds.observe(queue_s)
        if time_to_first_token_s is not None:
            self.time_to_first_token.observe(time_to_first_token_s)
        self.duration.observe(duration_s)

    def token_gap(self, seconds: float) -> None:
        """Observe the time between two consecutive tokens of one request."""
        self.inter_token.observe(seconds)

    def decode_step_done(self, seconds: float) -> None:
        """Observe one batched decode step."""
        self.decode_step.observe(seconds)

    def render(self) -> bytes:
        """The text exposition of the whole registry (what /metrics answers)."""
        return prometheus_client.generate_latest(self.registry)

