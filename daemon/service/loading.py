"""What `moed serve` loads before it is READY, and the memory plan that sizes it.

`load_for_serving` opens the model, tokenizer, learned state, expert cache and engine a
`ServeConfig` describes (in a worker thread: the loop keeps answering /health) and
returns them as one `Loaded`. Without `expert_cache_bytes`, `plan_serving_memory` sizes
the expert cache from one reading of the machine (daemon/machine/memory.py) through the
memory planner (scheduler/planner.py).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from daemon.machine.memory import MemoryReading, read_memory
from daemon.service.config import DEFAULT_SOURCE, ServeConfig
from daemon.service.engine import Engine, RequestHandle
from daemon.service.grammar import Grammars
from daemon.service.templates import TemplateWorkers
from daemon.store.plans import plans_for
from daemon.store.session import open_model
from daemon.tuning.knobs import IO_WORKERS, PREFETCH_WIDTH, THREADS
from daemon.tuning.live import start_live_tuning
from daemon.tuning.workload import Workload, workload_prompts
from ext.formats.checkpoint import Checkpoint
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from ext.models.families import kv_bytes_per_token, unused_tensors
from ext.tokenizer import Tokenizer, stop_token_ids
from scheduler.planner import available_bytes, plan_memory
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
    if cache_bytes is None:          # the memory planner decides (raises MemoryPlanError)
        planned = plan_serving_memory(model_dir, max_concurrent_sequences=config.max_concurrent_sequences,
                                      pin_fraction=config.pin_fraction,
                                      prefix_cache_bytes=config.prefix_cache_bytes)
        p = planned.plan
        log.info("memory_plan", available_bytes=p.available_bytes, dense_bytes=p.dense_bytes,
                 kv_bytes=p.kv_bytes, kv_context_tokens=planned.context,
                 prefix_cache_bytes=config.prefix_cache_bytes,
                 runtime_bytes=p.runtime_bytes, margin_bytes=p.margin_bytes,
                 expert_cache_bytes=p.expert_cache_bytes, all_experts_bytes=planned.all_experts_bytes,
                 experts="streamed" if planned.stream else "memory-mapped (they all fit)")
        if planned.stream:
            cache_bytes = p.expert_cache_bytes
    model, session = open_model(model_dir, threads=config.threads, cache_bytes=cache_bytes,
                                io_workers=config.io_workers, prefetch=config.prefetch,
                                pin_fraction=config.pin_fraction,
                                half_life_tokens=config.half_life_tokens, mlock=True,
                                state_dir=config.state_dir, environ=environ,
                                record_trace=config.record_trace, numerics=config.numerics)
    engine = Engine(model, tokenizer, max_concurrent_sequences=config.max_concurrent_sequences,
                    max_queue=config.max_queue, prefix_cache_bytes=config.prefix_cache_bytes,
                    prefill_step_ratio=config.prefill_step_ratio,
                    on_finish=lambda handle: request_finished(handle, telemetry),
                    on_decode_step=telemetry.decode_step_done if telemetry is not None else None,
                    on_token_gap=telemetry.token_gap if telemetry is not None else None)
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
                            memory_bytes=config.grammar_compile_memory_bytes)
    except ValueError as e:       # llguidance cannot read this tokenizer: text only
        log.warning("grammar_unavailable", error=str(e))
        grammars = None
    if tokenizer.chat_template is not None:
        templates.start()
    path = Path(model_dir).resolve()
    names = (path.name, str(model_dir), str(path))
    return Loaded(engine=engine, model_names=tuple(dict.fromkeys(names)), stop_ids=stop_ids,
                  context=model.config.max_position_embeddings, session=session,
                  model_type=model.config.model_type, tuner=tuner, workload=workload,
                  grammars=grammars, weight_formats=model.weight_formats(),
                  templates=templates)


PLANNED_CONTEXT = 8192          # tokens of KV cache planned per sequence (at most the model's)
RUNTIME_BYTES = 512 << 20       # interpreter, numpy, workspaces, io buffers
MARGIN_FRACTION = 0.05          # of the available memory, kept free


@dataclass(frozen=True)
class ServingPlan:
    """The memory plan of `moed serve` for one model (bytes).

    plan: scheduler.planner.MemoryPlan; all_experts_bytes: every routed expert in its
    cache slot; stream: whether the experts must stream (the plan's cache holds fewer than
    all of them); context: tokens of KV cache planned per sequence.
    """

    plan: object
    all_experts_bytes: int
    stream: bool
    context: int


def plan_serving_memory(model_dir: str | os.PathLike, *, max_concurrent_sequences: int,
                        pin_fraction: float, reading: MemoryReading | None = None,
                        prefix_cache_bytes: int = 0) -> ServingPlan:
    """Plan `moed serve`'s memory for the model in `model_dir` from one reading of the
    machine (default: `read_memory()`): dense weights (every tensor that is not a routed
    expert, nor of a multi-token-prediction layer the decoder does not use), KV cache (f32,
    in the layout of the model's attention kind, every layer, PLANNED_CONTEXT or the model's
    context if smaller, per sequence), RUNTIME_BYTES plus the prefix cache's
    prefix_cache_bytes (the plan's runtime_bytes holds both), a MARGIN_FRACTION margin; the
    expert cache gets the rest (scheduler.planner.plan_memory). Raises MemoryPlanError (a ValueError
    giving every number) when the dense part does not fit, and the model loaders' errors.
    """
    config = load_config(model_dir)
    with Checkpoint(model_dir) as checkpoint:
        layout = ExpertLayout(checkpoint, config)
        expert_bytes = sum(loc.nbytes for loc in layout)
        slots = [p.slot_bytes for p in plans_for(layout).values()]
        unused = sum(checkpoint.info(n).nbytes for n in unused_tensors(config, checkpoint.tensors))
        dense = checkpoint.total_bytes - expert_bytes - unused
    reading = reading or read_memory()
    available = available_bytes(reading.mem_available_bytes, reading.cgroup_limits)
    context = min(PLANNED_CONTEXT, config.max_position_embeddings)
    kv = kv_bytes_per_token(config) * context
    slot = max(slots)
    plan = plan_memory(available, dense_bytes=dense, kv_bytes_per_sequence=kv,
                       max_concurrent_sequences=max_concurrent_sequences,
                       runtime_bytes=RUNTIME_BYTES + prefix_cache_bytes, slot_bytes=slot,
                       min_dynamic_slots=config.top_k * sum(config.moe_layers),
                       pin_fraction=pin_fraction, margin_fraction=MARGIN_FRACTION)
    all_experts = slot * len(slots)
    return ServingPlan(plan=plan, all_experts_bytes=all_experts,
                       stream=plan.expert_cache_bytes < all_experts, context=context)
