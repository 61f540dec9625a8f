"""One reading of the daemon's statistics, feeding `/metrics`, `/v1/moed/stats` and STATUS.

`collect` reads the engine, the expert cache and the io pool once and returns both the
`telemetry.metrics.Snapshot` the Prometheus collector exports and the JSON document of
`moed stats` built from that same snapshot, so the two never disagree (the systemd
STATUS line is formatted from the document, `status_line`). It must run on the engine
thread, between steps (`Engine.call`): the cache's bookkeeping is not locked.

Totals survive a provider swap (SIGHUP with a new cache budget): `ExpertSession.rebuild`
adds the old provider's final `expert_counters` to `ExpertSession.retired`, and
`collect` adds the live provider's on top.
"""
from __future__ import annotations

from daemon.store.streaming import expert_counters
from telemetry.metrics import OUTCOMES, PHASES, ExpertCounters, Snapshot


def collect(engine, session, *, memory_budget_bytes: int, memory_available_bytes: int | None,
            model_load_seconds: float, rss_bytes: int | None = None) -> tuple[Snapshot, dict]:
    """(the metrics snapshot, the `moed stats` document) from one reading.

    engine: daemon.engine.engine.Engine. session: its ExpertSession, or None (experts not
    streamed). memory_available_bytes: what the daemon may still add — MemAvailable bounded
    by its cgroups' headroom (daemon.machine.memory.read_available_bytes; None when
    unreadable: 0 in metrics).
    rss_bytes: the daemon's resident memory (in the document only: /metrics has
    process_resident_memory_bytes).
    """
    e = engine.stats()
    provider = engine.model.experts
    cache = getattr(provider, "cache", None)
    experts = session.retired if session is not None else ExpertCounters()
    gauges: dict = {}
    document: dict = {"hit_rate": None, "cache": None, "expert_provider": type(provider).__name__}
    if cache is not None:
        snap, io, slot = cache.snapshot(), provider.io.stats(), provider.slot_bytes
        experts = experts + expert_counters(provider, snap, io)
        gauges = dict(
            expert_cache_bytes={"pinned": sum(snap.resident_pinned) * slot,
                                "dynamic": sum(snap.resident_dynamic) * slot,
                                "staging": sum(snap.resident_staging) * slot},
            expert_cache_capacity_bytes={"pinned": snap.pinned_slots * slot,
                                         "dynamic": sum(snap.dynamic_slots) * slot,
                                         "staging": snap.staging_slots * slot},
            pinned_experts=len(cache.pins), io_workers=io.n_workers)
        adaptation = getattr(provider, "adaptation", None)
        if adaptation is not None:
            enabled, net, speedup = adaptation.gauges()
            learner = adaptation.learner
            gauges.update(mechanism_enabled=enabled, mechanism_net_seconds=net,
                          naive_estimated_speedup=speedup,
                          pin_share=learner.share if learner is not None else 0.0)
        document = {"cache": {
            "slot_bytes": slot,
            "pinned": {"slots": snap.pinned_slots, "bytes": snap.pinned_slots * slot,
                       "resident_slots": sum(snap.resident_pinned), "reserved_slots": 0},
            "dynamic": {"slots": sum(snap.dynamic_slots), "bytes": sum(snap.dynamic_slots) * slot,
                        "resident_slots": sum(snap.resident_dynamic),
                        "reserved_slots": sum(snap.loading)},
            "staging": {"slots": snap.staging_slots, "bytes": snap.staging_slots * slot,
                        "resident_slots": sum(snap.resident_staging)},
            "policy": snap.policy}, "io_path": io.io_path,
            "adaptation": adaptation.report() if adaptation is not None else None}
    s = Snapshot(
        requests_running=e.running, requests_waiting=e.waiting, decode_steps=e.decode_steps,
        prompt_tokens=e.prompt_tokens, generation_tokens=e.completion_tokens,
        io_wait_seconds=e.decode_io_wait_seconds, compute_seconds=e.decode_compute_seconds,
        prefill_tokens=e.prefill_tokens, prefix_cache_queries=e.prefix_cache.queries,
        prefix_cache_hits=e.prefix_cache.hits, prefix_cache_reused_tokens=e.prefix_cache.tokens_reused,
        prefix_cache_bytes=e.prefix_cache.bytes, prefix_cache_capacity_bytes=e.prefix_cache.capacity_bytes,
        prefix_cache_evicted_blocks=e.prefix_cache.blocks_evicted,
        experts=experts, compute_threads=engine.model.n_threads,
        memory_budget_bytes=memory_budget_bytes,
        memory_available_bytes=memory_available_bytes or 0, model_load_seconds=model_load_seconds,
        state_saves=session.state_saves if session is not None else 0,
        state_save_errors=session.state_save_errors if session is not None else 0, **gauges)
    out = _document(s, e, document)
    out["memory"]["rss_bytes"] = rss_bytes
    return s, out


def _document(s: Snapshot, e, extra: dict) -> dict:
    """The `moed stats` JSON: the snapshot's numbers plus limits and rates."""
    x = s.experts
    out = {"requests": {"running": s.requests_running, "waiting": s.requests_waiting,
                        "total": e.requests_total, "prompt_tokens": s.prompt_tokens,
                        "completion_tokens": s.generation_tokens,
                        "max_concurrent_sequences": e.max_concurrent_sequences,
                        "max_queue": e.max_queue, "prefill_tokens": s.prefill_tokens},
           "prefix_cache": {"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits,
                            "reused_tokens": s.prefix_cache_reused_tokens,
                            "bytes": s.prefix_cache_bytes,
                            "capacity_bytes": s.prefix_cache_capacity_bytes,
                            "evicted_blocks": s.prefix_cache_evicted_blocks},
           "tokens_per_second": e.tokens_per_second, "decode_steps": s.decode_steps,
           "generated_tokens": e.generated_tokens, "io_wait_seconds": s.io_wait_seconds,
           "compute_seconds": s.compute_seconds, "compute_threads": s.compute_threads,
           "model_load_seconds": s.model_load_seconds,
           "memory": {"budget_bytes": s.memory_budget_bytes,
                      "available_bytes": s.memory_available_bytes},
           "state": {"saves": s.state_saves, "save_errors": s.state_save_errors}}
    if extra.get("cache") is None:
        out.update(hit_rate=None, cache=None, expert_provider=extra["expert_provider"])
        return out
    cache = extra["cache"]
    cache.update(pinned_experts=s.pinned_experts, pin_swaps=x.pin_swaps,
                 evictions={t: x.evictions.get(t, 0) for t in ("pinned", "dynamic")})
    lookups = x.lookups_where()
    out["cache"] = cache
    out["hit_rate"] = x.lookups_where("hit") / lookups if lookups else 0.0
    out["experts"] = {
        "hits": x.lookups_where("hit"), "prefetch_hits": x.lookups_where("prefetch_hit"),
        "misses": x.lookups_where("miss"),
        "lookups": {p: {o: x.lookups_where(o, p) for o in OUTCOMES} for p in PHASES},
        "bytes_read": sum(x.bytes_read.values()), "bytes_read_by_reason": dict(x.bytes_read),
        "read_errors": x.read_errors, "io_path": extra["io_path"], "io_workers": s.io_workers,
        "prefetches_issued": x.prefetch_issued, "prefetches_used": x.prefetch_used,
        "prefetch_wasted_bytes": x.prefetch_wasted_bytes}
    out["adaptation"] = extra.get("adaptation")
    return out


def status_line(document: dict) -> str:
    """The systemd STATUS= text of a `moed stats` document."""
    rate = f"{document['tokens_per_second']:.1f} tokens/s"
    hit = document.get("hit_rate")
    return rate if hit is None else f"{rate}, hit rate {hit:.3f}"
