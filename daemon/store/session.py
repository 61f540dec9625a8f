"""A model opened with the expert provider a command asks for, and its learned state.

`open_model` is shared by `moed generate` (in-process) and `moed serve`: with an expert
cache budget, routed experts stream from the shards through a `StreamingExpertProvider`
whose usage counts are loaded from, and flushed to, the state directory (keyed by the
model's fingerprint); without one, they are memory-mapped (or read into RAM).

`ExpertSession` methods that touch the provider must run on the thread that drives the
model (the engine thread in the daemon).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from daemon.store.state import StateStore, default_state_dir
from daemon.store.trace import RecordingProvider, TraceWriter
from daemon.store.streaming import (StreamingExpertProvider, StreamingOptions, check_cache_budget,
                                    expert_counters, flush_usage, load_usage_state)
from daemon.store.working_set import load_working_set, save_working_set, working_set_store
from ext.models.model import PREFILL_CHUNK, Model
from scheduler.usage import max_state_file_bytes
from telemetry.logs import get_logger
from telemetry.metrics import ExpertCounters

log = get_logger("session")


class ExpertSession:
    """The streaming provider of a model plus its state file (usage learned across runs).

    store is None when the state directory is unusable (learning then lasts one run).
    working_set_store: where the cache's working set is saved with each flush
    (daemon/store/working_set.py; None: not saved).
    state_saves / state_save_errors: writes of the state file that succeeded / failed.
    retired: the expert totals of the providers `rebuild` replaced (so totals never
    go back when the cache is rebuilt). baseline: the naive cache (`BASELINE_OPTIONS`),
    which a rebuild keeps naive: only its budget changes.
    """

    def __init__(self, model: Model, provider: StreamingExpertProvider, store: StateStore | None,
                 fingerprint: str, options: StreamingOptions, baseline: bool = False,
                 working_set_store: StateStore | None = None):
        self.model = model
        self.provider = provider
        self.store = store
        self.working_set_store = working_set_store
        self.fingerprint = fingerprint
        self.options = options
        self.baseline = baseline
        self.state_saves = 0
        self.state_save_errors = 0
        self.retired = ExpertCounters()

    def flush(self) -> bool:
        """Merge the usage observed since the last flush into the state file, and save
        the cache's working set (what the next start reads first) beside it.

        Returns False when there is no usable state directory, or it is read-only (the
        learned usage was read from it and is used; open_model said so). Raises OSError
        when the write fails (the caller logs it; the counts stay in memory for the next try).
        """
        if self.store is None or not self.store.writable:
            return False

        def write():
            flush_usage(self.store, self.provider.usage, self.fingerprint, self.provider.learned_state())
            self._save_working_set()
        self._save(write)
        return True

    def _save_working_set(self) -> None:
        """The cache's working set into its file (part of one save of the state)."""
        if self.working_set_store is not None and self.working_set_store.writable:
            save_working_set(self.working_set_store, self.provider.working_set())

    def _save(self, write) -> None:
        """Run one write of the state file, counting it as a save or a save error."""
        try:
            write()
        except OSError:
            self.state_save_errors += 1
            raise
        self.state_saves += 1

    def reset(self) -> int:
        """Forget learned usage and drop the pin set, in memory and in the state file.

        Returns the number of pins dropped. Raises OSError when the state file cannot
        be written.
        """
        dropped = self.provider.reset_learning()
        if self.store is not None and self.store.writable:
            usage = self.provider.usage

            def write():
                self.store.save(lambda _current: usage.to_dict(self.fingerprint), tokens=0)
                self._save_working_set()                  # without the pins dropped
            self._save(write)
        return dropped

    def rebuild(self, cache_bytes: int | None = None, pin_fraction: float | None = None,
                prefetch: bool | None = None, pinned_slots: int | None = None) -> None:
        """Swap in a provider with a new budget / pin share / prefetch switch (between steps).

        The learned counts and state carry over, and the new cache reads the old one's
        working set first, the most recent as far as it has room; it starts from the pins they
        give (`pinned_slots` of them when given: the squeezer keeps the pinned tier while
        the dynamic one gives way). The io worker count and (unless `prefetch` is given)
        the prefetch width of the old provider carry over too: the live tuner may have
        changed them.
        The old provider is closed (its slot memory freed) before the new one allocates
        its own, so a rebuild never needs both budgets at once: a shrink under memory
        pressure must not be what pushes the process over its limit. Should the new
        provider fail to start (OSError from its memory), one with the old options takes
        its place and the error is raised.
        Raises CacheBudgetError (a ValueError) for a budget below the minimum, before
        anything is closed; the old provider then stays in place.
        """
        if self.baseline:
            pin_fraction = prefetch = None
        changes = {k: v for k, v in (("cache_bytes", cache_bytes), ("pin_fraction", pin_fraction),
                                     ("prefetch", prefetch)) if v is not None}
        options = replace(self.options, **changes)
        old = self.provider
        check_cache_budget(options.cache_bytes, self.model.layout, self.model.config)
        # Everything the new provider starts from, taken before the old one is closed.
        carried = dict(usage_counts=old.usage.counts(), learned=old.learned_state(),
                       working_set=old.working_set())
        transitions = old.cache.transitions()           # unrounded, not the saved form
        workers, width = old.io.n_workers, old.prefetch_width
        recorder, writer = old.routing_recorder, old.trace_writer
        old.trace_writer = None                          # moves to the new provider, open
        old.close()
        self.retired = self.retired + expert_counters(old)
        try:
            provider = StreamingExpertProvider(self.model.layout, self.model.config, options,
                                               pinned_slots=pinned_slots, **carried)
        except OSError:
            options = self.options
            provider = StreamingExpertProvider(self.model.layout, self.model.config, options, **carried)
            self._install(provider, options, workers, width, transitions, recorder, writer)
            raise
        self._install(provider, options, workers, None if prefetch is not None else width,
                      transitions, recorder, writer)
        log.info("expert_cache_rebuilt", cache_bytes=options.cache_bytes,
                 pin_fraction=round(options.pin_fraction, 3), prefetch=options.prefetch)

    def _install(self, provider: StreamingExpertProvider, options: StreamingOptions, workers: int,
                 width: int | None, transitions, recorder, writer) -> None:
        """Make `provider` the session's: what the live tuner set on the old one (io
        workers, prefetch width unless None) and what it learned carry over."""
        if provider.io.n_workers != workers:
            provider.io.set_workers(workers)
        if width is not None:
            provider.set_prefetch(width)
        provider.cache.seed_transitions(transitions)
        provider.routing_recorder = recorder
        provider.trace_writer = writer
        self.model.experts = provider
        self.provider, self.options = provider, options

    def summary(self) -> dict:
        snap = self.provider.cache.snapshot()
        io = self.provider.io.stats()
        return {"hit_rate": round(snap.hit_rate, 4), "hits": sum(snap.hits),
                "prefetch_hits": sum(snap.prefetch_hits), "misses": sum(snap.misses),
                "bytes_read": sum(io.bytes_issued.values()), "io_wait_s": round(self.provider.io_wait_s, 3),
                "io_path": io.io_path}


# The naive cache moed is measured against (`moed bench`, `moed demo`): LRU, no pins, no
# prefetch, no referee, nothing learned.
BASELINE_OPTIONS = dict(prefetch=False, pin_fraction=0.0, policy="lru", learn_pins=False,
                        referee=False)


def open_model(model_dir: str | Path, *, threads: int | None, cache_bytes: int | None,
               experts: str = "mmap", io_workers: int = 2, prefetch: bool = True,
               pin_fraction: float = StreamingOptions.pin_fraction,
               half_life_tokens: float = StreamingOptions.half_life_tokens, mlock: bool = False,
               state_dir: str | Path | None = None,
               environ: Mapping[str, str] = {},
               record_trace: str | Path | None = None, numerics: str = "exact",
               baseline: bool = False, prefill_chunk: int = PREFILL_CHUNK,
               **streaming_options) -> tuple[Model, ExpertSession | None]:
    """Load `model_dir`; (model, session) — session is None without a cache budget.

    experts: without cache_bytes, "mmap" or "resident". state_dir: where learned usage
    lives (None: $STATE_DIRECTORY, else ~/.local/state/moed, from `environ`). An
    unusable state directory is a warning, never an error: learning is only speed.
    record_trace: a file the decode routing is appended to, in the replay format
    (daemon/store/trace.py). numerics: "auto", "exact", "fast" or "fast-bf16", and
    prefill_chunk: the most prompt tokens a forward step takes (`Model.load`). baseline: the
    naive cache (`BASELINE_OPTIONS`, overriding prefetch and pin_fraction); no state
    directory is read or written (it starts cold and leaves nothing behind), and a
    rebuild keeps it naive.
    streaming_options: other StreamingOptions fields.
    Raises the model's load errors (ConfigError / CheckpointError, naming the file,
    tensor or field), CacheBudgetError (message gives the minimum) and OSError when
    record_trace cannot be opened.
    """
    if cache_bytes is None:
        model = Model.load(model_dir, n_threads=threads, experts=experts, numerics=numerics,
                           prefill_chunk=prefill_chunk)
        if record_trace is not None:
            moe = [l for l, m in enumerate(model.config.moe_layers) if m]
            model.experts = RecordingProvider(model.experts, TraceWriter(record_trace, len(moe))).bind(moe)
        return model, None
    if baseline:
        streaming_options = {**streaming_options, **BASELINE_OPTIONS}
    else:
        streaming_options = dict(streaming_options, prefetch=prefetch, pin_fraction=pin_fraction)
    options = StreamingOptions(cache_bytes=cache_bytes, io_workers=io_workers,
                               half_life_tokens=half_life_tokens, mlock=mlock, **streaming_options)
    built: list[tuple[StreamingExpertProvider, StateStore | None, StateStore | None, str]] = []

    def streaming(checkpoint, layout, config):
        fingerprint = checkpoint.fingerprint()
        moe_layers = [l for l, m in enumerate(config.moe_layers) if m]
        counts, learned, store, ws_store, saved = None, None, None, None, None
        if baseline:
            provider = StreamingExpertProvider(layout, config, options)
            built.append((provider, None, None, fingerprint))
            return provider
        try:
            store = StateStore(Path(state_dir) if state_dir else default_state_dir(environ), fingerprint,
                               max_bytes=max_state_file_bytes(len(moe_layers), config.num_experts))
            state = load_usage_state(store, moe_layers, config.num_experts, fingerprint,
                                     options.half_life_tokens)
            if state is not None:
                counts, learned = state
            ws_store = working_set_store(store.state_dir, fingerprint, len(moe_layers), config.num_experts)
            saved = load_working_set(ws_store, len(moe_layers), config.num_experts)
            if not store.writable:
                log.warning("state_dir_read_only", state_dir=str(store.state_dir),
                            learned_usage_loaded=counts is not None,
                            effect="learned usage is read and used; what is learned now is "
                                   "not saved")
        except OSError as e:
            log.warning("state_dir_unusable", error=str(e),
                        effect="expert usage will not be learned across runs")
            store = ws_store = None
        provider = StreamingExpertProvider(layout, config, options, usage_counts=counts,
                                           learned=learned, working_set=saved)
        log.info("expert_cache_warm_start", working_set=saved is not None, usage_counts=counts is not None,
                 experts_read=provider.warm_loads)
        built.append((provider, store, ws_store, fingerprint))
        return provider

    model = Model.load(model_dir, n_threads=threads, experts=streaming, numerics=numerics,
                       prefill_chunk=prefill_chunk)
    provider, store, ws_store, fingerprint = built[0]
    if record_trace is not None:
        try:
            provider.trace_writer = TraceWriter(record_trace, len(provider.moe_layers))
        except OSError:
            model.close()
            raise
    return model, ExpertSession(model, provider, store, fingerprint, options, baseline=baseline,
                                working_set_store=ws_store)

