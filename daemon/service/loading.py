"""What `moed serve` loads before it is READY, and the memory plan that sizes it.

`load_for_serving` opens the model, tokenizer, learned state, expert cache and engine a
`ServeConfig` describes (in a worker thread: the loop keeps answering /health) and
returns them as one `Loaded`. Without `expert_cache_bytes`, `plan_serving_memory` sizes
the expert cache from one reading of the machine (daemon/machine/memory.py) through the
memory planner (scheduler/planner.py); with one larger than the plan leaves the expert
cache, it is clamped to the plan's (an OOM kill otherwise, as the mlocked slots fill),
and `reload_expert_cache_bytes` does the same on SIGHUP. The plan's runtime reserves the
grammar compile workers (`compile_reserve_bytes`); `grammar_room_bytes` says how much of
the memory is free for them, which caps their address space (daemon/workers/grammar.py).
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from daemon.machine.memory import MemoryReading, read_memory
from daemon.service.config import DEFAULT_SOURCE, ServeConfig
from daemon.engine.engine import Engine, RequestHandle
from daemon.workers.grammar import DEFAULT_MEMORY_BYTES, DEFAULT_WORKERS, Grammars, compile_reserve_bytes
from daemon.engine.prefix_store import PrefixStore
from daemon.workers.templates import TemplateWorkers
from daemon.store.plans import plans_for
from daemon.store.probe import probe_memory_bytes
from daemon.store.session import open_model
from daemon.store.state import default_state_dir
from daemon.tuning.knobs import IO_WORKERS, PREFETCH_WIDTH, THREADS
from daemon.tuning.live import start_live_tuning
from daemon.tuning.saved import PREFILL_CHUNK_SETTING, TunedStore, hardware_facts
from daemon.tuning.workload import Workload, workload_prompts
from ext.formats.checkpoint import Checkpoint
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from ext.models.families import kv_bytes_per_token, unused_tensors
from ext.models.model import PREFILL_CHUNK, RESIDENT_PREFILL_CHUNK, STREAMING_PREFILL_CHUNK
from ext.tokenizer import Tokenizer, stop_token_ids
from scheduler.planner import MemoryPlanError, available_bytes, plan_memory
from telemetry.logs import get_logger

log = get_logger("server")


@dataclass
class Loaded:
    """What startup builds once the model is in memory."""

    engine: Engine
    model_names: tuple[str, ...]
    stop_ids: frozenset[int]
    context: int
    session: object | None      # daemon.store.session.ExpertSession (streamed experts), else None
    model_type: str
    tuner: object | None = None  # daemon.tuning.live.LiveTuner (tuner = live / live+idle)
    workload: object | None = None  # daemon.tuning.workload.Workload for live+idle
    grammars: Grammars | None = None  # response_format's compiles (their worker processes)
    weight_formats: dict = field(default_factory=dict)  # ext.models.model.Model.weight_formats()
    templates: TemplateWorkers | None = None   # the chat template's render processes
    prefix_store: PrefixStore | None = None     # the prefix cache's file (None: cannot be kept)
    prefix_saved_version: int = 0               # PrefixCache.version when last saved or read
    prefix_save_failed: bool = False            # the last save failed: only flushes try again

    def close(self) -> None:
        """Release what the load holds: the model's files, the render and compile processes."""
        self.engine.model.close()
        if self.templates is not None:
            self.templates.close()
        if self.grammars is not None:
            self.grammars.close()


def request_finished(handle: RequestHandle, telemetry=None) -> None:
    """The canonical log line of one request, and the same numbers into the request
    histograms of `telemetry` (a DaemonMetrics, or None). Called on the engine thread."""
    s = handle.stats
    if telemetry is not None:
        telemetry.request_finished(handle.finish_reason, s.queue_s, s.time_to_first_token_s,
                                   s.duration_s)
    log.info("request_finished", request_id=handle.request.request_id, endpoint=handle.endpoint,
             finish_reason=handle.finish_reason, prompt_tokens=s.prompt_tokens,
             cached_tokens=s.cached_tokens,
             completion_tokens=s.completion_tokens, queue_seconds=round(s.queue_s, 6),
             time_to_first_token_seconds=None if s.time_to_first_token_s is None
             else round(s.time_to_first_token_s, 6),
             duration_seconds=round(s.duration_s, 6), decode_steps=s.decode_steps,
             decode_steps_after_cancel=s.steps_after_cancel, expert_hits=s.expert_hits,
             expert_misses=s.expert_misses, expert_bytes_read=s.expert_bytes_read)


def load_for_serving(config: ServeConfig, environ: Mapping[str, str], telemetry=None) -> Loaded:
    """Open the model, tokenizer, learned state and engine that `config` describes.

    telemetry: the daemon's DaemonMetrics, fed by the engine's hooks (or None)."""
    model_dir = config.require_model()
    templates = TemplateWorkers(config.chat_template_max_chars, config.chat_template_timeout_s)
    tokenizer = Tokenizer.from_model_dir(model_dir, renderer=templates.render)
    stop_ids = frozenset(stop_token_ids(model_dir))
    cache_bytes = config.expert_cache_bytes
    prefix_bytes, context = config.prefix_cache_bytes, config.max_context_tokens
    sequences = config.max_concurrent_sequences
    margin_bytes = None              # the plan's margin and compile workers' reserve, if planned
    planned = None
    auto_chunk = config.prefill_chunk == "auto"
    chunk = PREFILL_CHUNK if auto_chunk else config.prefill_chunk

    def plan(chunk: int) -> ServingPlan:
        return plan_serving_memory(model_dir, max_concurrent_sequences=config.max_concurrent_sequences,
                                   pin_fraction=config.pin_fraction,
                                   prefix_cache_bytes=config.prefix_cache_bytes,
                                   max_context_tokens=config.max_context_tokens,
                                   threads=config.threads,
                                   grammar_compile_memory_bytes=config.grammar_compile_memory_bytes,
                                   sequences_fixed=config.sources.get(
                                       "max_concurrent_sequences", DEFAULT_SOURCE) != DEFAULT_SOURCE,
                                   prefill_chunk=chunk)
    if cache_bytes is None or _memory_bound_known():   # raises MemoryPlanError
        planned = plan(chunk)
    if cache_bytes is not None and planned is not None:
        # an explicit budget larger than what the plan leaves the expert cache would be
        # OOM-killed while its slots fill (they are mlocked): clamped to the plan's
        if cache_bytes > planned.plan.expert_cache_bytes:
            log.warning("expert_cache_bytes_clamped", key="expert_cache_bytes",
                        asked_bytes=cache_bytes, granted_bytes=planned.plan.expert_cache_bytes,
                        available_bytes=planned.plan.available_bytes,
                        reason="the memory left after the dense weights, KV cache, runtime "
                               "and margin holds no more")
            cache_bytes = None       # the plan's, below
        else:                        # it fits: the configured numbers stand, and the compile
            # workers get what the plan keeps for them (the reading after the load, less
            # the caches' budgets, may leave them too little to start)
            margin_bytes = planned.plan.margin_bytes + planned.grammar_bytes
            planned = None
    # under auto, the chunk `moed tune` measured fastest on this machine and model, if it
    # ran (within what the rule's memory bounds allow); else the rule's. The naive cache
    # reads no state.
    measured = (tuned_prefill_chunk(model_dir, config.state_dir, environ)
                if auto_chunk and config.expert_cache_mode != "naive" else None)
    if cache_bytes is None and auto_chunk and planned.stream:
        # the experts stream: a larger step reads each routed expert once for more prompt
        # tokens; its buffers come out of the expert cache (at most a quarter of it)
        chunk = auto_prefill_chunk(load_config(model_dir), cache_bytes=planned.plan.expert_cache_bytes,
                                   threads=config.threads or len(os.sched_getaffinity(0)),
                                   context=planned.context,
                                   sequences=planned.plan.max_concurrent_sequences)
        chunk = min(chunk, measured or chunk)
        if chunk > PREFILL_CHUNK:
            planned, chunk = _plan_for_chunk(plan, planned, chunk)
    elif cache_bytes is None and auto_chunk:           # every expert in memory
        chunk = measured or RESIDENT_PREFILL_CHUNK
        if chunk > PREFILL_CHUNK:
            planned, chunk = _plan_for_chunk(plan, planned, chunk)
    elif cache_bytes is not None and auto_chunk:       # a budget the operator set
        chunk = auto_prefill_chunk(load_config(model_dir), cache_bytes=cache_bytes,
                                   threads=config.threads or len(os.sched_getaffinity(0)),
                                   context=context or PLANNED_CONTEXT, sequences=sequences)
        chunk = min(chunk, measured or chunk)
    if cache_bytes is None:          # the memory planner decides
        p = planned.plan
        log.info("memory_plan", available_bytes=p.available_bytes, dense_bytes=p.dense_bytes,
                 runtime_bytes=p.runtime_bytes, margin_bytes=p.margin_bytes,
                 grammar_compile_reserve_bytes=planned.grammar_bytes,
                 kv_bytes=p.kv_bytes, kv_bytes_per_token=p.kv_bytes_per_token,
                 kv_context_tokens=p.context_tokens,
                 max_concurrent_sequences=p.max_concurrent_sequences,
                 prefix_cache_bytes=p.prefix_cache_bytes,
                 prefix_cache_configured_bytes=config.prefix_cache_bytes,
                 expert_cache_bytes=p.expert_cache_bytes, slot_bytes=p.slot_bytes,
                 expert_cache_minimum_bytes=p.min_dynamic_slots * p.slot_bytes,
                 minimum_bytes=p.minimum_bytes, all_experts_bytes=planned.all_experts_bytes,
                 experts="streamed" if planned.stream else "memory-mapped (they all fit)")
        if planned.stream or config.expert_cache_bytes is not None:   # clamped: still a cache
            cache_bytes = p.expert_cache_bytes
        prefix_bytes, context = p.prefix_cache_bytes, p.context_tokens
        sequences = p.max_concurrent_sequences
        margin_bytes = p.margin_bytes + planned.grammar_bytes   # the workers' reserve, too
    model, session = open_model(model_dir, threads=config.threads, cache_bytes=cache_bytes,
                                io_workers=config.io_workers, prefetch=config.prefetch,
                                pin_fraction=config.pin_fraction,
                                half_life_tokens=config.half_life_tokens, mlock=True,
                                state_dir=config.state_dir, environ=environ,
                                record_trace=config.record_trace, numerics=config.numerics,
                                baseline=config.expert_cache_mode == "naive", prefill_chunk=chunk)
    log.info("prefill_chunk", tokens=chunk, configured=config.prefill_chunk,
             measured=measured, experts="streamed" if cache_bytes is not None else "in memory")
    engine = Engine(model, tokenizer, max_concurrent_sequences=sequences,
                    max_queue=config.max_queue, prefix_cache_bytes=prefix_bytes,
                    context_tokens=min(context or model.config.max_position_embeddings,
                                       model.config.max_position_embeddings),
                    prefill_step_ratio=config.prefill_step_ratio,
                    on_finish=lambda handle: request_finished(handle, telemetry),
                    on_decode_step=telemetry.decode_step_done if telemetry is not None else None,
                    on_token_gap=telemetry.token_gap if telemetry is not None else None)
    prefix_store = restore_prefix_cache(config, engine, environ)
    tuner = workload = None
    if session is not None and config.tuner != "off":
        fixed = {knob for key, knob in (("threads", THREADS), ("io_workers", IO_WORKERS))
                 if config.sources.get(key, DEFAULT_SOURCE) != DEFAULT_SOURCE}
        if not config.prefetch or config.sources.get("prefetch", DEFAULT_SOURCE) != DEFAULT_SOURCE:
            fixed.add(PREFETCH_WIDTH)
        state_dir = session.store.state_dir if session.store is not None else None
        tuner = start_live_tuning(model, session, config.tuner, fixed, state_dir, model_dir)
        if tuner is not None:
            engine.step_observers.append(tuner.step_done)
            if config.tuner == "live+idle":
                workload = Workload(model, workload_prompts(model_dir, model.config.vocab_size))
    try:
        grammars = Grammars(tokenizer, model.config.vocab_size, stop_ids,
                            timeout_s=config.grammar_compile_timeout_s,
                            memory_bytes=config.grammar_compile_memory_bytes,
                            memory_room_bytes=grammar_room_bytes(
                                margin_bytes, (cache_bytes or 0) + (prefix_bytes or 0)))
    except ValueError as e:       # llguidance cannot read this tokenizer: text only
        log.warning("grammar_unavailable", error=str(e))
        grammars = None
    if tokenizer.chat_template is not None:
        templates.start()
    path = Path(model_dir).resolve()
    names = (path.name, str(model_dir), str(path))
    return Loaded(engine=engine, model_names=tuple(dict.fromkeys(names)), stop_ids=stop_ids,
                  context=engine.context_tokens, session=session,
                  model_type=model.config.model_type, tuner=tuner, workload=workload,
                  grammars=grammars, weight_formats=model.weight_formats(),
                  templates=templates, prefix_store=prefix_store,
                  prefix_saved_version=engine.prefix_cache.version)


def restore_prefix_cache(config: ServeConfig, engine: Engine,
                         environ: Mapping[str, str]) -> PrefixStore | None:
    """The prefix cache's file (daemon/engine/prefix_store.py) and the blocks it held
    put back in the engine's empty prefix cache. The store is opened whenever the cache
    could be kept, with prefix_cache_persist_bytes as its budget: at 0 nothing is read
    or written until a reload raises it. None when it cannot be kept (no prefix cache, the
    naive cache, which reads no state) or the state directory cannot be used (a warning
    when the budget asked for a file)."""
    cache = engine.prefix_cache
    if cache.capacity_bytes == 0 or config.expert_cache_mode == "naive":
        return None
    model = engine.model
    B = cache.block_tokens
    template = model.attention.new_cache(B, B)
    layout = [(tuple(a.shape[:-2]) + (B, a.shape[-1]), str(a.dtype)) for layer in template.layers for a in layer]
    started = time.monotonic()
    try:
        store = PrefixStore(Path(config.state_dir) if config.state_dir else default_state_dir(environ),
                            model.checkpoint.fingerprint(), numerics=model.numerics_in_force(),
                            block_tokens=B, layout=layout, budget_bytes=config.prefix_cache_persist_bytes)
        blocks = store.load(cache.capacity_blocks) if store.budget_bytes else []
    except OSError as e:
        if config.prefix_cache_persist_bytes:
            log.warning("prefix_cache_not_persisted", error=str(e),
                        effect="the prefix cache lives in memory only")
        return None
    try:
        restored = cache.restore(blocks)
    except ValueError as e:          # blocks the store passed that the cache cannot hold together
        cache.clear()
        log.warning("prefix_cache_not_restored", path=str(store.path), error=str(e))
        restored = 0
    if restored:
        log.info("prefix_cache_restored", path=str(store.path), blocks=restored, tokens=restored * B,
                 bytes=restored * cache.block_bytes, seconds=round(time.monotonic() - started, 3))
    return store


def _memory_bound_known() -> bool:
    """Whether `read_memory()` knows any bound (MemAvailable or a cgroup limit)."""
    reading = read_memory()
    try:
        available_bytes(reading.mem_available_bytes, reading.cgroup_limits)
    except ValueError:
        return False
    return True


def promised_bytes(loaded: Loaded) -> int:
    """What a running daemon has promised but may not hold yet, in bytes: the KV cache of
    max_concurrent_sequences sequences at the engine's context (counted whole: what the
    running ones hold is in a reading too, so this errs high), the prefix cache's
    capacity less what it holds, and the grammar compile workers' share
    (`Grammars.reserve_bytes`; they start on demand)."""
    engine = loaded.engine
    kv = (engine.model.attention.kv_bytes_per_token(engine.model.config)
          * engine.context_tokens * engine.max_concurrent_sequences)
    prefix = max(0, engine.prefix_cache.capacity_bytes - engine.prefix_cache.stats().bytes)
    grammar = loaded.grammars.reserve_bytes() if loaded.grammars is not None else 0
    return kv + prefix + grammar


def reload_expert_cache_bytes(asked_bytes: int, current_bytes: int, reserved_bytes: int,
                              slot_bytes: int, reading: MemoryReading | None = None) -> int:
    """The expert cache budget a SIGHUP may grant for `asked_bytes`, in bytes.

    The planner's arithmetic on a running daemon: the dense weights, the runtime and what
    the caches already hold are in the reading (default: `read_memory()`, now); the
    rebuild frees the current cache (`current_bytes`) before it allocates the new one
    (daemon/store/session.py `ExpertSession.rebuild`); `reserved_bytes` is what is promised
    but not yet taken (`promised_bytes`); MARGIN_FRACTION of the
    memory stays free. Returns min(asked_bytes, that room in whole slots of `slot_bytes`),
    but never less than min(asked_bytes, current_bytes): the cache the plan or an earlier
    grant gave stays (the memory watcher shrinks it under pressure), it only grows as far
    as the memory allows; asked_bytes when no bound is known.
    """
    reading = reading or read_memory()
    try:
        available = available_bytes(reading.mem_available_bytes, reading.cgroup_limits)
    except ValueError:              # MemoryPlanError: nothing known
        return asked_bytes
    room = available + current_bytes
    room -= int(MARGIN_FRACTION * room) + reserved_bytes
    return min(asked_bytes, max(current_bytes, room // slot_bytes * slot_bytes))


def grammar_room_bytes(margin_bytes: int | None, unfilled_bytes: int,
                       reading: MemoryReading | None = None) -> int | None:
    """The memory free for the grammar compile workers, all together, in bytes (None:
    no bound is known).

    With a memory plan (margin_bytes given): what it reserved for the compile workers in
    its runtime (`ServingPlan.grammar_bytes`) and its margin, the memory the plan leaves
    free under the tightest of MemAvailable and the cgroup limits (MARGIN_FRACTION of
    it); the caller passes their sum. Everything else the plan gives away to the daemon
    (the expert cache takes the rest): in a 400 MiB cgroup, two workers of
    grammar_compile_memory_bytes (1 GiB) could take what the daemon was planned to have.
    Without one (no memory bound was known when the load planned; an expert_cache_bytes
    that fits still has the plan's): what the reading (default: `read_memory()`,
    now, after the load) leaves, less `unfilled_bytes` (the expert and prefix caches'
    budgets, which fill as requests come: counted whole, so the room errs low).
    """
    if margin_bytes is not None:
        return margin_bytes
    reading = reading or read_memory()
    try:
        available = available_bytes(reading.mem_available_bytes, reading.cgroup_limits)
    except ValueError:             # MemoryPlanError: nothing known
        return None
    return max(0, available - unfilled_bytes)


PLANNED_CONTEXT = 8192          # tokens of context wanted per sequence (at most the model's)
# What loading the model adds to the process besides the dense weights, the KV cache, the
# expert and prefix caches and the workspaces below: the interpreter's and libraries'
# allocations at load, the io workers, one chat-template render process (its own RSS),
# the allocator's slack. Measured on a served make-model daemon (vocabulary 512) in a
# memory cgroup: the group's RSS after serving, minus its usage when it planned, the dense
# weights and both caches, was 23 MB; rounded up to 32 MiB.
LOAD_BASE_BYTES = 32 << 20
# Per vocabulary token: llguidance's token index (measured: 11 MB more at 32000 tokens than
# at 512, 350 B a token) and the tokenizer's tables, rounded up (151936 tokens: 74 MiB).
LOAD_BYTES_PER_VOCAB_TOKEN = 512
MARGIN_FRACTION = 0.05          # of the available memory, kept free
LOGIT_COPIES = 4                # per logits row: the logits, the sampler's probabilities,
                                # its order and its mask


ATTENTION_ROWS = 8              # query rows per attention work item: scores scratch rows a thread
PREFILL_CHUNK_CACHE_SHARE = 4   # auto: a streaming step's extra buffers <= 1/4 of the expert cache


def expert_slot_bytes(layout: ExpertLayout) -> tuple[int, int]:
    """(bytes of one expert cache slot, bytes of every routed expert in its slot): the
    largest expert's load plan (daemon/store/plans.py), times the experts."""
    slots = [p.slot_bytes for p in plans_for(layout).values()]
    return max(slots), max(slots) * len(slots)


def tuned_prefill_chunk(model_dir: str | os.PathLike, state_dir: str | os.PathLike | None,
                        environ: Mapping[str, str]) -> int | None:
    """The prefill chunk `moed tune` saved for this model on this hardware
    (daemon/tuning/saved.py, in `state_dir`, else the default state directory of
    `environ`), or None: never tuned, tuned on other hardware, a bad file (set aside, with
    a warning), or a state directory that cannot be read (a warning)."""
    try:
        store = TunedStore(Path(state_dir) if state_dir else default_state_dir(environ),
                           Checkpoint(model_dir).fingerprint(), hardware_facts(model_dir))
        saved = store.load() or {}
    except (OSError, ValueError) as e:
        log.warning("tuned_settings_unavailable", error=str(e), setting=PREFILL_CHUNK_SETTING)
        return None
    return saved.get(PREFILL_CHUNK_SETTING)


def _plan_for_chunk(plan, planned: ServingPlan, chunk: int) -> tuple[ServingPlan, int]:
    """(the plan made again for a prompt step of `chunk` tokens, chunk) when it keeps
    what `planned` (made for PREFILL_CHUNK) gives: the experts in memory or streamed
    alike, the context and the concurrent sequences; else (planned, PREFILL_CHUNK): larger
    step buffers never cost context, sequences or experts in memory."""
    try:
        again = plan(chunk)
    except MemoryPlanError:
        return planned, PREFILL_CHUNK
    if (again.stream, again.context, again.plan.max_concurrent_sequences) != (
            planned.stream, planned.context, planned.plan.max_concurrent_sequences):
        return planned, PREFILL_CHUNK
    return again, chunk


def workspace_bytes(config, *, threads: int, context: int, sequences: int,
                    chunk: int = PREFILL_CHUNK) -> int:
    """The forward pass's buffers for `chunk` tokens (ext/models/model.py _Workspace,
    the attention kind's projections, rope tables), the attention scores scratch
    ([threads, ATTENTION_ROWS x context] f32, each call's own) and LOGIT_COPIES logits
    rows of the vocabulary per sequence (f32), in bytes. An upper bound: each attention
    buffer is counted at the widest query width of the model's attention kind."""
    H, E, K = config.hidden_size, config.num_experts, config.num_experts_per_tok
    mlp_i = max(config.moe_intermediate_size, config.intermediate_size,
                config.shared_expert_intermediate_size)
    floats = chunk * (6 * H + 2 * E + 2 * K) + K * H + 2 * chunk * K * H + chunk * K * mlp_i
    nH = config.num_attention_heads
    if config.mla is not None:
        m = config.mla
        q_width = nH * max(m.qk_head_dim, m.kv_lora_rank + m.qk_rope_head_dim, m.v_head_dim)
        kv_width = m.kv_lora_rank + m.qk_rope_head_dim + (m.q_lora_rank or 1)
    else:
        q_width = nH * config.head_dim
        kv_width = config.num_key_value_heads * config.head_dim
    floats += chunk * (4 * q_width + 2 * kv_width + H + config.head_dim)
    floats += threads * ATTENTION_ROWS * context
    floats += LOGIT_COPIES * config.vocab_size * sequences
    return 4 * floats


def auto_prefill_chunk(config, *, cache_bytes: int | None, threads: int, context: int,
                       sequences: int) -> int:
    """`prefill_chunk = "auto"`: RESIDENT_PREFILL_CHUNK when every expert is in memory (no
    expert cache: cache_bytes None; the caller checks that the plan still fits it); when
    they stream through a cache of cache_bytes, the largest
    of STREAMING_PREFILL_CHUNK and its halvings whose step buffers take at most
    1 / PREFILL_CHUNK_CACHE_SHARE of that cache beyond PREFILL_CHUNK's (PREFILL_CHUNK at
    least). A chunk reads each
    expert it routes to once, so a larger one reads fewer bytes per prompt token."""
    if cache_bytes is None:
        return RESIDENT_PREFILL_CHUNK
    base = workspace_bytes(config, threads=threads, context=context, sequences=sequences)
    chunk = STREAMING_PREFILL_CHUNK
    while chunk > PREFILL_CHUNK and (workspace_bytes(config, threads=threads, context=context,
                                                     sequences=sequences, chunk=chunk) - base
                                     > cache_bytes // PREFILL_CHUNK_CACHE_SHARE):
        chunk //= 2
    return max(chunk, PREFILL_CHUNK)


def runtime_bytes(config, *, threads: int, context: int, sequences: int, slot_bytes: int,
                  grammar_bytes: int = 0, chunk: int = PREFILL_CHUNK) -> int:
    """What the process adds to itself besides the dense weights, KV and caches:
    LOAD_BASE_BYTES + LOAD_BYTES_PER_VOCAB_TOKEN x vocabulary + `workspace_bytes` + the
    idle storage probe's buffers and workers over expert slots of `slot_bytes`
    (daemon/store/probe.py `probe_memory_bytes`; the daemon runs it after READY when the
    experts stream, with every cache already full) + `grammar_bytes`, the grammar compile
    workers' reserve (daemon/workers/grammar.py `compile_reserve_bytes`). The
    interpreter and the libraries imported before the plan are in the memory reading
    already."""
    return (LOAD_BASE_BYTES + LOAD_BYTES_PER_VOCAB_TOKEN * config.vocab_size
            + workspace_bytes(config, threads=threads, context=context, sequences=sequences,
                              chunk=chunk)
            + probe_memory_bytes(slot_bytes) + grammar_bytes)


@dataclass(frozen=True)
class ServingPlan:
    """The memory plan of `moed serve` for one model (bytes).

    plan: scheduler.planner.MemoryPlan; all_experts_bytes: every routed expert in its
    cache slot; stream: whether the experts must stream (the plan's cache holds fewer than
    all of them); context: tokens of context allowed per sequence (the plan's
    context_tokens: the wanted context, or less when memory is tight); grammar_bytes: what
    the plan's runtime reserves for the grammar compile workers.
    """

    plan: object
    all_experts_bytes: int
    stream: bool
    context: int
    grammar_bytes: int = 0


def plan_serving_memory(model_dir: str | os.PathLike, *, max_concurrent_sequences: int,
                        pin_fraction: float, reading: MemoryReading | None = None,
                        prefix_cache_bytes: int = 0, max_context_tokens: int | None = None,
                        threads: int | None = None, sequences_fixed: bool = False,
                        grammar_compile_memory_bytes: int = DEFAULT_MEMORY_BYTES,
                        prefill_chunk: int = PREFILL_CHUNK) -> ServingPlan:
    """Plan `moed serve`'s memory for the model in `model_dir` from one reading of the
    machine (default: `read_memory()`), through scheduler.planner.plan_memory:

      dense     every tensor that is not a routed expert, nor of a multi-token-prediction
                layer the decoder does not use;
      runtime   `runtime_bytes`: a measured base, a share per vocabulary token, the
                workspaces, sized from the config, the idle storage probe's buffers, and
                the grammar compile workers (`compile_reserve_bytes` of
                grammar_compile_memory_bytes, the vocabulary and tokenizer.json's size;
                dropped, grammar_bytes 0, when only the plan without it fits: the daemon
                then serves text only and says so, `Grammars`' grammar_unavailable);
      KV        f32, in the layout of the model's attention kind, every layer, for
                max_concurrent_sequences sequences of the context allowed: the wanted
                context (max_context_tokens, else PLANNED_CONTEXT; at most the model's),
                cut to what fits down to scheduler.planner.CONTEXT_FLOOR_TOKENS;
      prefix    the prefix cache: at most prefix_cache_bytes, out of what is left;
      margin    MARGIN_FRACTION of the available memory;

    the expert cache gets the rest. When even the floor context does not fit
    max_concurrent_sequences sequences, the plan lowers that number (to 1 at least) unless
    sequences_fixed (the operator set it); a max_context_tokens given is never cut.
    threads: compute threads (default: the CPUs available); prefill_chunk: the model's
    step size, which sizes the workspaces. Raises MemoryPlanError (a
    ValueError naming what to lower and giving every number) when even the minimum does not
    fit or a fixed number would have to be lowered, and the model loaders' errors.
    """
    config = load_config(model_dir)
    with Checkpoint(model_dir) as checkpoint:
        layout = ExpertLayout(checkpoint, config)
        expert_bytes = sum(loc.nbytes for loc in layout)
        slot, all_experts = expert_slot_bytes(layout)
        unused = sum(checkpoint.info(n).nbytes for n in unused_tensors(config, checkpoint.tensors))
        dense = checkpoint.total_bytes - expert_bytes - unused
    reading = reading or read_memory()
    available = available_bytes(reading.mem_available_bytes, reading.cgroup_limits)
    wanted = min(max_context_tokens or PLANNED_CONTEXT, config.max_position_embeddings)
    threads = threads or len(os.sched_getaffinity(0))
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    grammar = compile_reserve_bytes(grammar_compile_memory_bytes, config.vocab_size,
                                    tokenizer_file.stat().st_size if tokenizer_file.exists() else 0,
                                    DEFAULT_WORKERS)
    def plan_with(grammar_bytes: int):
        return plan_memory(
            available, dense_bytes=dense, kv_bytes_per_token=kv_bytes_per_token(config),
            max_concurrent_sequences=max_concurrent_sequences, context_tokens=wanted,
            runtime_bytes=runtime_bytes(config, threads=threads, context=wanted,
                                        sequences=max_concurrent_sequences, slot_bytes=slot,
                                        grammar_bytes=grammar_bytes, chunk=prefill_chunk),
            slot_bytes=slot, min_dynamic_slots=config.top_k * sum(config.moe_layers),
            prefix_cache_bytes=prefix_cache_bytes, all_experts_bytes=all_experts,
            pin_fraction=pin_fraction, margin_fraction=MARGIN_FRACTION,
            sequences_fixed=sequences_fixed, context_fixed=max_context_tokens is not None,
            runtime_bytes_per_context_token=4 * ATTENTION_ROWS * threads,
            runtime_bytes_per_sequence=4 * LOGIT_COPIES * config.vocab_size)
    try:
        plan = plan_with(grammar)
    except MemoryPlanError:          # text only rather than not at all: Grammars warns
        plan, grammar = plan_with(0), 0
    return ServingPlan(plan=plan, all_experts_bytes=all_experts,
                       stream=plan.expert_cache_bytes < all_experts, context=plan.context_tokens,
                       grammar_bytes=grammar)
