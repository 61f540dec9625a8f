"""The streaming expert provider: routed experts read from the shards into a RAM slot cache.

This is where policy (scheduler/: which slot, what to evict, what to pin, usage) meets
mechanism (daemon/store/: slot buffers, io worker threads, preadv). It implements
`ext.experts.ExpertProvider`, so the forward pass is unchanged:

    acquire(layer, experts)  demand: hits are used in place, misses are read now (demand
                             reads go ahead of every queued prefetch), reads already in
                             flight are waited for (one still queued — a prefetch, a
                             pin load, a warm start's — goes ahead as a demand read);
                             returns read-only views into slots.
    hint(layer, logits, ahead)
                             prefetch: a later MoE layer's router (`ahead` MoE layers
                             on, 1 or up to `prefetch_depth`) applied to the current
                             hidden state; its top candidates (usage priors break ties)
                             that are neither resident nor in flight are read in the
                             background — into the staging tier, or into slots whose
                             occupants are colder. Likely candidates are read at once;
                             less likely ones only into idle io workers once this
                             layer's own reads are done (the disk would otherwise idle
                             while the layer computes), nearer layers first.
    begin_step(tokens)       time moves on (usage decay, pin re-evaluation).
    phase                    "prefill" or "decode" (set by the engine before a forward):
                             the cache counts each lookup under it.

All cache bookkeeping happens on the calling (engine) thread; io threads only fill
buffers and resolve futures, whose completion the engine notices on its next call.
Placement never changes output: the bytes in a slot are the bytes of the shard.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from daemon.store.adaptive import GUESS_EARLY, GUESS_IDLE, GUESS_LIKELY, Adaptation, cpu_clock_for
from daemon.store.plans import ReadPlan, plans_for
from daemon.store.reads import DEMAND, PIN_LOAD, PREFETCH, ExpertReadError, IoPool, probe_direct_io
from daemon.store.slots import SlotArena
from daemon.store.working_set import WorkingSet
from ext.models.config import ModelConfig
from ext.models.experts import ExpertLayout, ExpertProvider, ExpertWeights
from scheduler.cache import (OUTCOME_HIT, OUTCOME_INFLIGHT, OUTCOME_MISS, PHASE_DECODE, CacheBudgetError,
                             CacheFullError, ExpertCache)
from scheduler.pinlearn import PinDecision
from scheduler.pins import PinPolicy, pins_to_layer_ids, select_pins
from scheduler.prefetch import RankCalibration
from scheduler.referee import FALLBACK_POLICY, POLICY_MECHANISMS, ladder_policy
from scheduler.usage import UsageStats, decode_transitions, encode_transitions
from telemetry.logs import get_logger
from telemetry.metrics import OUTCOMES, PHASES, ExpertCounters

log = get_logger("streaming")

DEFAULT_HALF_LIFE_TOKENS = 2048.0
PIN_REEVALUATE_TOKENS = 256


@dataclass(frozen=True)
class StreamingOptions:
    """Knobs of the streaming cache (all placement: none changes output).

    cache_bytes: the expert cache's byte budget, cut into slots of the largest expert's
        aligned size. pin_fraction: share of the slots above the minimum (top_k per MoE
        layer) the pinned tier may take: with learn_pins (default) the most the pin
        learner tries (scheduler.pinlearn: the share, 0 included, and the set are chosen
        on older decode windows and kept only when they win on the newest, from the first
        session on); without, the share the pinned tier always has. prefetch: read
        predicted experts ahead. referee: value every mechanism live against a shadow of
        the naive mode and turn off what does not pay (scheduler.referee).
    prefetch_width: candidates per layer and step (default top_k: on a disk-bound
        Zipf-1 checkpoint top_k + 2 read 13 % more bytes for 1 % more hits). io_workers:
        reader threads. direct: O_DIRECT (None: probe with a real aligned read).
    policy: the dynamic tier's eviction policy name (scheduler.eviction).
    prefetch_min_precision: a candidate is read only when the predictor's measured
        precision at its rank (scheduler.prefetch.RankCalibration) is at least this,
        and it may only evict a resident whose policy value (probability of use per
        token) is at most that precision. Default 0.9, measured with `moed bench` on a
        disk-bound Zipf-1 checkpoint (3.2 GB of experts, 768 MiB cache, 64 tokens x 3):
        0.5 read 179 MB/token (1.17x naive), 0.8 151 MB (1.12x), 0.9 144 MB (1.23x),
        0.95 143 MB (1.09x) — a wrong prefetch costs a read and the slot it evicted.
    idle_prefetch_min_precision: candidates below prefetch_min_precision but at least
        this precise are read only when the current layer's reads are done and io
        workers are idle, at most one per idle worker; the same no-hotter-victim rule
        applies. 1.0 turns this off. Default 0.4, measured with `moed bench` on the same
        checkpoint, 64 tokens x 3, interleaved with naive: off 1.13x naive (144.8 MB/token,
        prefetch recall 0.19), 0.2 1.33x, 0.4 1.37x (175 MB/token, recall 0.52), 0.55
        1.17x; 0.4 again in later runs 1.31x, 1.26x, 1.24x (the disk's own spread is about
        ±10 %). The disk idles while a layer computes, so a likely-but-unsure read there
        costs a slot, not bandwidth. Queueing every such candidate instead (behind all
        other reads, cancelled at its layer's turn) read 183-186 MB/token and measured
        1.13x-1.20x: guesses then hold workers when the next demand read arrives.
    prefetch_depth: how many MoE layers ahead the routers are applied (1 or 2); each
        distance has its own precision calibration. Default 1: on the checkpoint above
        (3 interleaved rounds, 8 staging slots) depth 2 read 5 MB/token more for no
        fewer needed reads and measured 0.91-0.96x depth 1 round by round. Its precision
        is not the problem (0.78 at rank 3 against 0.90 one layer ahead); the extra
        reads hold io workers when the next layer's demand reads arrive.
    staging_slots: slots of the budget set aside for prefetched guesses (the cache's
        staging tier, scheduler/cache.py): a guess read there evicts no resident, and
        joins its layer's dynamic tier only when a step uses it. 0: guesses take dynamic
        slots, evicting residents colder than their precision. None (default): 3/4 of
        top_k. Used only with prefetch on and a budget below all experts; taken from the
        slots above the minimum that are not pinned, and never more than half of those
        above the minimum. Measured on
        the checkpoint above, 3 interleaved rounds: without staging a wrong guess's
        victim cost 10 MB/token of extra needed reads (151 against 141 MB with prefetch
        off). Tokens/s against no staging, round by round: 2 slots 0.88-1.02x (recall
        falls from 0.50 to 0.36), 4 slots 0.99-1.21x, 6 slots 1.05-1.19x, 8 slots
        1.04-1.25x. Each staging slot is one the cache loses: needed reads were 141.8,
        142.8, 144.0 and 145.0 MB/token at 2, 4, 6 and 8 slots.
    half_life_tokens: usage decay. mlock: lock the slot memory when allowed.
    warm_start: a session that starts with what an earlier one saved reads it into its
        empty cache at once (in the background, behind demand reads): each layer's
        working set — what its dynamic tier held at the last flush, the most recent as
        far as there is room (daemon/store/working_set.py) — then its most used experts,
        and the saved pins. An empty cache evicts nothing, so this costs reads, never hits.
    learner_time_share: the most of the decode time the pin learner may take (its
        routing bookkeeping and its evaluations: an evaluation that is due waits until it
        fits; daemon/store/adaptive.py). Default 0.03: unbudgeted, its evaluations took
        12-16 % of the time on the embedded default model at 25 % cache and pinned nothing.
    early_hints: guess each MoE layer's experts a second time, from its own router
        applied to its input before its attention (ahead=0; the first MoE layer's only
        guess). compute_in_read_order: a decode step computes cached experts at once and
        the others as their reads land, summed in rank order after (acquire_in_order).
    """

    cache_bytes: int
    pin_fraction: float = 0.5
    prefetch: bool = True
    prefetch_width: int | None = None
    io_workers: int = 2
    direct: bool | None = None
    policy: str = "default"
    half_life_tokens: float = DEFAULT_HALF_LIFE_TOKENS
    mlock: bool = False
    prefetch_min_precision: float = 0.9
    idle_prefetch_min_precision: float = 0.4
    staging_slots: int | None = None
    prefetch_depth: int = 1
    learn_pins: bool = True
    referee: bool = True
    early_hints: bool = True
    compute_in_read_order: bool = True
    warm_start: bool = True
    learner_time_share: float = 0.03

    def __post_init__(self) -> None:
        if not 0.0 <= self.pin_fraction <= 1.0:  # also rejects NaN
            raise ValueError(f"pin_fraction must be in [0, 1], got {self.pin_fraction}")
        if self.io_workers < 1:
            raise ValueError(f"io_workers must be >= 1, got {self.io_workers}")
        if not 0.0 <= self.prefetch_min_precision <= 1.0:
            raise ValueError(f"prefetch_min_precision must be in [0, 1], got {self.prefetch_min_precision}")
        if not 0.0 <= self.idle_prefetch_min_precision <= 1.0:
            raise ValueError("idle_prefetch_min_precision must be in [0, 1], "
                             f"got {self.idle_prefetch_min_precision}")
        if self.prefetch_depth not in (1, 2):
            raise ValueError(f"prefetch_depth must be 1 or 2, got {self.prefetch_depth}")
        if self.staging_slots is not None and self.staging_slots < 0:
            raise ValueError(f"staging_slots must be >= 0, got {self.staging_slots}")
        if not self.half_life_tokens > 0:
            raise ValueError(f"half_life_tokens must be > 0, got {self.half_life_tokens}")
        if not self.learner_time_share > 0:
            raise ValueError(f"learner_time_share must be > 0, got {self.learner_time_share}")


def minimum_cache_bytes(layout: ExpertLayout, config: ModelConfig) -> int:
    """Smallest budget the cache accepts: top_k slots per MoE layer."""
    slot = max(p.slot_bytes for p in plans_for(layout).values())
    return config.top_k * sum(config.moe_layers) * slot


def check_cache_budget(cache_bytes: int, layout: ExpertLayout, config: ModelConfig) -> None:
    """Raise CacheBudgetError (naming the minimum in bytes) when `cache_bytes` holds fewer
    than top_k slots per MoE layer — what StreamingExpertProvider refuses."""
    slot = max(p.slot_bytes for p in plans_for(layout).values())
    _check_budget(cache_bytes, slot, config.top_k, sum(config.moe_layers))


def _check_budget(cache_bytes: int, slot_bytes: int, top_k: int, moe_layers: int) -> None:
    total_slots, minimum = cache_bytes // slot_bytes, top_k * moe_layers
    if total_slots < minimum:
        raise CacheBudgetError(
            f"expert cache of {cache_bytes} bytes holds {total_slots} experts; the "
            f"minimum is top_k {top_k} x {moe_layers} MoE layers = {minimum} "
            f"slots of {slot_bytes} bytes = {minimum * slot_bytes} bytes")


class StreamingExpertProvider(ExpertProvider):
    """Experts streamed from disk into a byte-budget slot cache with pins and prefetch.

    Raises CacheBudgetError when options.cache_bytes is below `minimum_cache_bytes`
    (the message gives the minimum in bytes).
    """

    def __init__(self, layout: ExpertLayout, config: ModelConfig, options: StreamingOptions,
                 usage_counts: np.ndarray | None = None,
                 clock: Callable[[], float] = time.perf_counter, learned: dict | None = None,
                 pinned_slots: int | None = None, working_set: WorkingSet | None = None):
        """usage_counts: [MoE layers, experts] counts learned earlier (None: a first
        session). learned: what that session's pin learner and referee settled on
        (`learned_state()`; its "pin_share" is used only with usage_counts).
        pinned_slots: the pinned tier's size to start with, instead of the learned share's
        (a rebuild that keeps the pins while the dynamic tier shrinks). working_set: what
        the cache of the session before held (`working_set()`; its layer count and ids
        checked by the caller), read at start by the warm start."""
        self.config = config
        self.options = options
        self.clock = clock
        self.cpu_clock = cpu_clock_for(clock)       # times the cache's bookkeeping
        self.moe_layers = [l for l, is_moe in enumerate(config.moe_layers) if is_moe]
        self._row = {layer: i for i, layer in enumerate(self.moe_layers)}  # layer -> usage row
        self.plans: dict[tuple[int, int], ReadPlan] = plans_for(layout)
        self.slot_bytes = max(p.slot_bytes for p in self.plans.values())
        _check_budget(options.cache_bytes, self.slot_bytes, config.top_k, len(self.moe_layers))
        total_slots = options.cache_bytes // self.slot_bytes
        minimum = config.top_k * len(self.moe_layers)
        total_slots = min(total_slots, len(self.plans))  # more slots than experts is waste
        spare = max(0, total_slots - minimum)
        learned = dict(learned or {})
        if usage_counts is None:
            learned.pop("pin_share", None)                # nothing to pin from yet
        wanted = 0
        if options.prefetch and total_slots < len(self.plans):
            wanted = (3 * config.top_k // 4 if options.staging_slots is None else options.staging_slots)
        keep = pinned_slots
        if options.learn_pins:
            staging_slots = min(wanted, spare // 2)
            share = min(float(learned.get("pin_share", 0.0)), options.pin_fraction)
            pinned_slots = int((spare - staging_slots) * share)
            if keep is not None and usage_counts is not None:
                pinned_slots = min(keep, spare - staging_slots)
                learned["pin_share"] = pinned_slots / max(1, spare - staging_slots)
        else:                        # a fixed share, from the first session on
            pinned_slots = int(spare * options.pin_fraction) if keep is None else min(keep, spare)
            staging_slots = min(wanted, spare - pinned_slots, spare // 2)
        expert_bytes = [[self.plans[(l, e)].slot_bytes for e in range(config.num_experts)]
                        for l in self.moe_layers]
        self.cache = ExpertCache(self.moe_layers, config.num_experts, config.top_k, total_slots,
                                 pinned_slots=pinned_slots, policy=options.policy,
                                 expert_bytes=expert_bytes, staging_slots=staging_slots)
        self.staging_default = staging_slots
        self.usage = UsageStats(self.moe_layers, config.num_experts, options.half_life_tokens)
        if usage_counts is not None:
            self.usage.set_counts(usage_counts)
        first_shard = next(iter(self.plans.values())).spans[0].path
        direct = probe_direct_io(first_shard) if options.direct is None else options.direct
        self.arena = SlotArena(total_slots, self.slot_bytes, lock=options.mlock)
        self.io = IoPool(options.io_workers, direct)
        self._hints_on = options.prefetch
        self._prefetch_allowed = True                    # the referee's say
        self._idle_allowed = True
        self._early_allowed = True
        self.hint_depth = options.prefetch_depth
        self.width = options.prefetch_width or config.top_k
        # The predictor's precision by rank, for single-token steps and for prefill chunks
        # and per distance ahead, kept per width (the tuner switches widths back and forth).
        self._calibrations: dict[int, dict[tuple[bool, int], RankCalibration]] = {}
        self.calibration = self._calibration_for(self.width)
        # (layer, ahead) -> [ranked, decode, needed (None until the layer runs)]
        self._predicted: dict[tuple[int, int], list] = {}
        # [(ahead, -precision, rank, layer, expert)]: the hinted layers' less likely
        # candidates, read into idle io workers once the current layer has its experts.
        self._idle_candidates: list[tuple[int, float, int, int, int]] = []
        self.pin_policy = PinPolicy(self.slot_bytes)
        self.token = 0
        self.step_tokens = 0                             # positions in the current step
        self.routing_recorder = None                     # daemon.tuning.workload.RoutingRecorder
        self.trace_writer = None                         # daemon.store.trace.TraceWriter
        self.observe_usage = True                        # False: a synthetic workload runs
        self._served_set: WorkingSet | None = None       # the working set before one ran
        self.phase = PHASE_DECODE
        self.pin_swaps = 0                               # experts pinned by re-evaluation
        self._inflight: dict[int, Future] = {}           # slot -> read in flight
        self._prefetch_layer: dict[int, int] = {}        # slot -> layer, prefetches in flight
        self._views: dict[int, tuple[tuple[int, int], ExpertWeights, tuple]] = {}   # slot -> (key, views, signature)
        self.io_wait_s = 0.0
        self.bytes_submitted = {DEMAND: 0, PREFETCH: 0, PIN_LOAD: 0}  # aligned lengths
        self.read_failures = 0
        self.demand_rereads = 0                          # failed background reads read again
        mechanisms = tuple(m for m, on in (
            ("prefetch", options.prefetch),
            ("idle_prefetch", options.prefetch and options.idle_prefetch_min_precision < 1.0),
            ("early_hints", options.prefetch and options.early_hints),
            ("policy", options.policy != "lru"),
            ("lrfu", options.policy not in ("lru", FALLBACK_POLICY))) if on)
        # "policy" and "lrfu" (its fallback) as the referee last set them.
        self._policy_states = {"policy": options.policy != "lru", "lrfu": "lrfu" in mechanisms}
        self.adaptation: Adaptation | None = None
        if options.referee or options.learn_pins:
            self.adaptation = Adaptation(
                len(self.moe_layers), config.num_experts, config.top_k, self.cache,
                learn_pins=options.learn_pins, max_pin_share=options.pin_fraction,
                referee=options.referee, mechanisms=mechanisms, policy=options.policy,
                staging_slots=staging_slots, learned=learned, clock=clock, cpu_clock=self.cpu_clock,
                learner_time_share=options.learner_time_share)
            referee = self.adaptation.referee
            if referee is not None:                      # start where the last session ended
                for name in mechanisms:
                    if not referee.is_on(name):
                        self._set_mechanism(name, False)
        if pinned_slots and usage_counts is not None:
            self._apply_pins(self._start_pins(pinned_slots, working_set if options.warm_start else None))
        if "transitions" in learned:                     # checked when the file was read
            self.cache.seed_transitions(decode_transitions(learned["transitions"], len(self.moe_layers),
                                                           config.num_experts))
        self.warm_loads = 0
        if options.warm_start and (usage_counts is not None or working_set is not None):
            self._warm_start(working_set)
        log.info("expert_cache_built", slots=total_slots, slot_bytes=self.slot_bytes,
                 pinned_slots=pinned_slots, staging_slots=staging_slots, io_path=self.io.io_path,
                 io_workers=options.io_workers, prefetch=options.prefetch,
                 pins="learned" if options.learn_pins else "fixed share")

    @property
    def wants_hints(self) -> bool:
        """Whether the forward pass should call `hint` (prefetch on and allowed)."""
        return self._hints_on and self._prefetch_allowed

    @property
    def prefetch_width(self) -> int:
        """The prefetch width set (`set_prefetch`; 0: off), whatever the referee decides."""
        return self.width if self._hints_on else 0

    # ------------------------------------------------------------ provider API

    def max_acquire(self, layer: int) -> int:
        """Demand can always get this layer's dynamic slots minus its prefetches in flight
        (prefetches into the staging tier hold none)."""
        if self.cache.staging_slots:
            return self.cache.dynamic_slots(layer)
        loading = sum(1 for s in self._prefetch_layer.values() if s == layer)
        return max(self.config.top_k, self.cache.dynamic_slots(layer) - loading)

    def end_step(self) -> None:
        """The step's layers have run: its time ends here for the referee's windows."""
        if self.adaptation is not None:
            self.adaptation.step_ends(self._io_totals)

    def begin_step(self, tokens: int) -> None:
        """`tokens` new positions are about to run through the model."""
        before = self.token
        if self.trace_writer is not None:
            self.trace_writer.end_step()
        for (_, ahead), (ranked, decode, needed) in self._predicted.items():
            if needed is not None:          # the layer ran (a failed step may stop short)
                self.calibration[(decode, ahead)].observe(ranked, needed)
        self._predicted.clear()
        self._idle_candidates = []
        self.step_tokens = tokens
        if self.routing_recorder is not None:
            self.routing_recorder.abandon_step()
        self.token += tokens
        if self.observe_usage:
            self.usage.advance(tokens)
            self._served_set = None
        elif self._served_set is None:
            self._served_set = self._live_working_set()
        a = self.adaptation
        if a is not None:
            decisions = a.step_begins(self.phase == PHASE_DECODE, self.observe_usage, self._io_totals)
            for d in decisions:
                self._set_mechanism(d.mechanism, d.on)
            if self.observe_usage and a.pin_decision_due():
                self._apply_pin_decision(a.decide_pins(self.usage.counts()))
        if self.cache.pinned_slots and before // PIN_REEVALUATE_TOKENS != self.token // PIN_REEVALUATE_TOKENS:
            self._reevaluate_pins()

    def acquire(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        out: list[ExpertWeights | None] = [None] * len(experts)
        for positions, weights in self._acquire(layer, experts, in_order=False):
            for i, w in zip(positions, weights):
                out[i] = w
        return out

    def acquire_in_order(self, layer: int, experts: Sequence[int]):
        """Cached experts at once, then each read as it lands (in the order they were
        issued, any already done first): the caller computes while the rest are read."""
        if not self.options.compute_in_read_order:
            yield from super().acquire_in_order(layer, experts)
            return
        yield from self._acquire(layer, experts, in_order=True)

    def _acquire(self, layer: int, experts: Sequence[int], in_order: bool):
        """The demand path: request, issue the misses, then yield (positions, weights)
        as experts become usable (everything at the end unless `in_order`). A failed
        read releases the layer's experts and raises ExpertReadError."""
        t_start = self.cpu_clock()
        self._reap()
        try:
            accesses = self.cache.request(layer, experts, self.token, phase=self.phase)
        except CacheFullError:
            # Reads in flight hold some of the layer's dynamic slots (a pin load demoted
            # by re-evaluation, a prefetch): let them land, then ask again.
            t0 = self.clock()
            self._finish_reads(self.cache.loading_dynamic_slots(layer))
            self.io_wait_s += self.clock() - t0
            accesses = self.cache.request(layer, experts, self.token, phase=self.phase)
        if self.adaptation is not None:
            # The cache's bookkeeping only: submitting a read is a read's cost, which LRU
            # (the policy's yardstick, calibrated without reads) pays per miss as well.
            self.adaptation.add_time("bookkeeping", self.cpu_clock() - t_start)
        for a in accesses:
            if a.outcome == OUTCOME_MISS:
                self._submit(layer, a.expert, a.slot, DEMAND)
        pending = [i for i, a in enumerate(accesses) if a.outcome in (OUTCOME_MISS, OUTCOME_INFLIGHT)]
        futures = {i: self._inflight.pop(accesses[i].slot) for i in pending}
        for i in pending:
            self._prefetch_layer.pop(accesses[i].slot, None)
            if accesses[i].outcome == OUTCOME_INFLIGHT and not futures[i].done():
                self.io.expedite(futures[i])     # a warm start's queue may be long
        if in_order:
            ready = [i for i, a in enumerate(accesses) if a.outcome == OUTCOME_HIT]
            if ready:
                yield ready, [self._weights(layer, accesses[i].expert, accesses[i].slot) for i in ready]
        waited = 0.0
        error: ExpertReadError | None = None
        while pending:
            done = [i for i in pending if futures[i].done()] or pending[:1]   # else wait for the first
            t0 = self.clock()
            for i in done:
                error = self._land(layer, accesses[i], futures[i]) or error
            waited += self.clock() - t0
            pending = [i for i in pending if i not in done]
            if in_order and error is None:
                yield done, [self._weights(layer, accesses[i].expert, accesses[i].slot) for i in done]
        self.io_wait_s += waited
        if error is not None:
            self.cache.release(layer, experts)
            raise error
        self._acquired(layer, experts, accesses, waited)
        if not in_order:
            yield list(range(len(accesses))), [self._weights(layer, a.expert, a.slot) for a in accesses]

    def _land(self, layer: int, a, future: Future) -> ExpertReadError | None:
        """Wait for the read of access `a`; mark its slot loaded, or failed (returned)."""
        try:
            try:
                future.result()
            except ExpertReadError as e:
                if a.outcome == OUTCOME_MISS:
                    raise
                # A background read (prefetch, pin load) of an expert this step
                # needs failed: one demand read decides, as if it had missed.
                self.read_failures += 1
                self.demand_rereads += 1
                log.warning("expert_reread_on_demand", error=str(e))
                self._submit(layer, a.expert, a.slot, DEMAND)
                self._inflight.pop(a.slot).result()
            self.cache.loaded(a.slot)
        except ExpertReadError as e:
            self.cache.failed(a.slot)
            self.read_failures += 1
            return e
        return None

    def _acquired(self, layer: int, experts: Sequence[int], accesses, waited: float) -> None:
        """A layer has every expert it needs: learning, recording, idle-worker guesses."""
        if self.adaptation is not None:
            self.adaptation.add_time("stall", waited)
            self.adaptation.acquired(self._row[layer], experts, [a.outcome for a in accesses],
                                     self.phase == PHASE_DECODE, layer)
        if self.observe_usage:
            self.usage.observe(layer, list(experts))
        if self.routing_recorder is not None and self.step_tokens == 1:
            self.routing_recorder.observe(self._row[layer], experts)
        for ahead in range(0, self.hint_depth + 1):
            predicted = self._predicted.get((layer, ahead))
            if predicted is not None:
                predicted[2] = (predicted[2] or set()) | {int(e) for e in experts}
        if self._idle_candidates:
            t1 = self.clock()
            self._prefetch_into_idle_workers(layer)
            if self.adaptation is not None:
                spent = self.clock() - t1
                self.adaptation.add_time("hint", spent)
                self.adaptation.add_time("idle_hint", spent)

    def release(self, layer: int, experts: Sequence[int]) -> None:
        t0 = self.cpu_clock()
        self.cache.release(layer, experts)
        if self.adaptation is not None:
            self.adaptation.add_time("bookkeeping", self.cpu_clock() - t0)

    @property
    def early_hints(self) -> bool:
        """Guess each MoE layer's experts again before its attention (ahead=0)."""
        return self.options.early_hints and self._early_allowed

    @property
    def wants_routing(self) -> bool:
        """The pin learner or a trace writer wants every row's routing."""
        learner = self.adaptation.learner if self.adaptation is not None else None
        return learner is not None or self.trace_writer is not None

    def observe_routing(self, layer: int, ids: np.ndarray) -> None:
        if self.adaptation is not None:
            self.adaptation.routed(self._row[layer], ids)
        if self.trace_writer is not None and self.phase == PHASE_DECODE:
            self.trace_writer.routed(self._row[layer], ids)

    def hint(self, layer: int, router_logits, ahead: int = 1) -> None:
        if not self.wants_hints or ahead > self.hint_depth or (ahead == 0 and not self.early_hints):
            return
        t0 = self.clock()
        self._hint(layer, router_logits() if callable(router_logits) else router_logits, ahead)
        if self.adaptation is not None:
            spent = self.clock() - t0
            self.adaptation.add_time("hint", spent)
            if ahead == 0:
                self.adaptation.add_time("early_hint", spent)

    def _hint(self, layer: int, router_logits: np.ndarray, ahead: int) -> None:
        self._reap()
        decode = router_logits.shape[0] == 1
        if decode:
            score = router_logits[0]            # one token: softmax keeps the order
        else:
            z = router_logits - router_logits.max(axis=1, keepdims=True)
            probs = np.exp(z)
            probs /= probs.sum(axis=1, keepdims=True)
            score = probs.max(axis=0)                              # [E] best over the tokens
        prior = self.usage.layer_counts(layer)
        ranked = np.lexsort((np.arange(score.size), -prior, -score))[: self.width].tolist()
        self._predicted[(layer, ahead)] = [ranked, decode, None]
        calibration = self.calibration[(decode, ahead)]
        if ahead == 1:
            self._idle_candidates = []      # the nearest hint starts a new layer's list
        kind = GUESS_EARLY if ahead == 0 else GUESS_LIKELY
        for rank, e in enumerate(ranked):
            precision = calibration.precision(rank)
            if precision >= self.options.prefetch_min_precision:
                self._prefetch(layer, e, precision, kind)
            elif self._idle_allowed and precision >= self.options.idle_prefetch_min_precision:
                self._idle_candidates.append((ahead, -precision, rank, layer, e))
        if ahead == 0 and self._idle_candidates:
            # the layer before has its experts: the disk idles during this attention
            self._prefetch_into_idle_workers(-1)

    def _prefetch(self, layer: int, expert: int, precision: float, kind: str) -> bool:
        """Read `expert` of `layer` in the background if the cache gives it a slot."""
        slot = self.cache.prefetch(layer, expert, self.token, precision)
        if slot is None:
            return False
        self._submit(layer, expert, slot, PREFETCH)
        self._prefetch_layer[slot] = layer
        if self.adaptation is not None:
            self.adaptation.guessed(layer, expert, kind)
        return True

    def _prefetch_into_idle_workers(self, current: int) -> None:
        """Read the hinted layers' less likely candidates — nearest layer first, then most
        likely first — one per io worker with nothing to do (reads of ours not yet
        finished keep their workers busy); candidates of `current` are past use."""
        candidates = sorted(c for c in self._idle_candidates if c[3] != current)
        self._idle_candidates = []
        idle = self.io.n_workers - sum(not f.done() for f in self._inflight.values())
        for _, neg_precision, _, layer, e in candidates:
            if idle <= 0:
                break
            idle -= self._prefetch(layer, e, -neg_precision, GUESS_IDLE)

    def _calibration_for(self, width: int) -> dict[tuple[bool, int], RankCalibration]:
        """{(decode, ahead): calibration} for `width` candidates per layer."""
        if width not in self._calibrations:
            self._calibrations[width] = {(decode, ahead): RankCalibration(width)
                                         for decode in (True, False) for ahead in (0, 1, 2)}
        return self._calibrations[width]

    def set_prefetch(self, width: int) -> None:
        """Prefetch `width` candidates per layer and step from the next step on (0: no
        prefetch). Placement only. Raises ValueError for a negative width."""
        if width < 0:
            raise ValueError(f"prefetch width must be >= 0, got {width}")
        self._predicted.clear()             # observations of the old width are not this one's
        self._idle_candidates = []
        self._hints_on = width > 0
        if width:
            self.width = width
            self.calibration = self._calibration_for(width)

    def reset_learning(self) -> int:
        """Forget the learned usage and drop every pin (experts stay cached); pins dropped."""
        dropped = len(self.cache.pins)
        self.usage.set_counts(np.zeros_like(self.usage.counts()))
        self.usage.take_delta()
        self.cache.set_pins([])
        self.cache.forget_transitions()
        if self.adaptation is not None:
            if self.adaptation.learner is not None:
                self.adaptation.learner.share, self.adaptation.learner.pins = 0.0, frozenset()
            self.adaptation.pins_changed(set(), self.cache.pinned_slots)
        return dropped

    def counters(self) -> tuple[int, int, int]:
        """(needed experts found resident or in flight, demand misses, bytes submitted) so far."""
        hits, misses = self.cache.totals()
        return hits, misses, sum(self.bytes_submitted.values())

    def close(self) -> None:
        if self.trace_writer is not None:
            self.trace_writer.close()
        self.io.close()
        self._reap()
        self._views.clear()
        self.arena.close()

    # ------------------------------------------------------------ internals

    def _submit(self, layer: int, expert: int, slot: int, reason: str) -> None:
        """Queue the read of (layer, expert) into `slot`; count its aligned bytes."""
        plan = self.plans[(layer, expert)]
        self._inflight[slot] = self.io.submit(plan, self.arena.buffer(slot), reason)
        self.bytes_submitted[reason] += plan.slot_bytes
        if self.adaptation is not None:
            self.adaptation.read_issued(reason)

    def _weights(self, layer: int, expert: int, slot: int) -> ExpertWeights:
        """The kernels' weights of the expert the slot holds: views over the slot, built
        once per slot and layout — a slot read anew with an expert laid out as the one
        before (`ReadPlan.view_signature`) keeps its views, which see the new bytes (on
        small experts building them cost more CPU than the read)."""
        key = (layer, expert)
        cached = self._views.get(slot)
        if cached is None or cached[0] != key:
            plan = self.plans[key]
            if cached is not None and cached[2] == plan.view_signature:
                cached = (key, cached[1], cached[2])
            else:
                cached = (key, plan.views(self.arena.buffer(slot)), plan.view_signature)
            self._views[slot] = cached
        return cached[1]

    def _finish_reads(self, slots: Sequence[int]) -> None:
        """Wait for the reads into `slots` (those still ours) and mark them loaded or failed."""
        for slot in slots:
            future = self._inflight.pop(slot, None)
            if future is None:
                continue
            self._prefetch_layer.pop(slot, None)
            if future.exception() is None:      # waits
                self.cache.loaded(slot)
            else:
                self.cache.failed(slot)
                self.read_failures += 1
                log.warning("expert_read_failed", reason="background", error=str(future.exception()))

    def _reap(self) -> None:
        """Mark finished background reads (prefetch, pin loads) loaded or failed."""
        self._finish_reads([s for s, f in self._inflight.items() if f.done()])

    def _apply_pins(self, pins) -> None:
        """Make the pinned tier hold `pins` ((layer index, expert)); issue the loads."""
        for load in self.cache.set_pins(pins_to_layer_ids(pins, self.moe_layers)):
            self._submit(load.layer, load.expert, load.slot, PIN_LOAD)
        if self.adaptation is not None:
            self.adaptation.pins_changed({(self._row[l], e) for l, e in self.cache.pins},
                                         self.cache.pinned_slots)

    def _start_pins(self, pinned_slots: int, saved: WorkingSet | None) -> frozenset:
        """The pins a session starts with ((MoE layer index, expert)): the saved working
        set's pins that fit, the most used first, topped up with those the counts choose."""
        counts = self._pin_counts()
        chosen = select_pins(counts, self.slot_bytes, pinned_slots * self.slot_bytes)
        if saved is None or not saved.pins:
            return chosen
        kept = list(saved.pins[:pinned_slots])
        rest = sorted(set(chosen) - set(kept), key=lambda p: (-counts[p], p))
        return frozenset(kept + rest[:pinned_slots - len(kept)])

    def _warm_start(self, saved: WorkingSet | None) -> None:
        """Fill each layer's dynamic tier with the experts a session before had there: the
        saved working set, the most recent first as far as the tier has room (its pins
        not pinned now after them), then — room left, or no working set saved — the
        experts it used most. Reads in the background, behind every demand read and
        prefetch; the most recent is read and admitted last (the most recent for the
        policy). An empty cache evicts nothing, so a session whose traffic differs loses
        no hit to it, only reads."""
        counts = self.usage.counts()
        pinned = set(self.cache.pins)
        for layer in self.moe_layers:
            row, room = counts[self._row[layer]], self.cache.dynamic_slots(layer)
            order: list[int] = []
            if saved is not None:
                order = list(saved.layers[self._row[layer]]) + [e for r, e in saved.pins if r == self._row[layer]]
            order += [int(e) for e in np.argsort(-row, kind="stable") if row[e] > 0]
            chosen = [e for e in dict.fromkeys(order) if (layer, e) not in pinned][:room]
            warmed = []
            for e in reversed(chosen):                  # the first last: the most recent
                slot = self.cache.warm(layer, e, self.token)
                if slot is not None:
                    self._submit(layer, e, slot, PIN_LOAD)
                    self.warm_loads += 1
                    warmed.append(e)
            if self.adaptation is not None and warmed:
                self.adaptation.warm_started(self._row[layer], warmed)

    def working_set(self) -> WorkingSet:
        """What the cache holds now, for the next session's warm start: each layer's dynamic
        tier, the most recently used first, and the pins, the most used first. While steps
        not counted as usage run (a tuner's check prompt or built-in workload), and until
        a counted step follows, what it held before them: the next session serves traffic."""
        return self._served_set if self._served_set is not None else self._live_working_set()

    def _live_working_set(self) -> WorkingSet:
        counts = self.usage.counts()
        pins = sorted(((self._row[l], e) for l, e in self.cache.pins), key=lambda p: (-counts[p], p))
        return WorkingSet(tuple(tuple(self.cache.working_set(l)) for l in self.moe_layers), tuple(pins))

    def _pin_counts(self) -> np.ndarray:
        """The counts pins follow: the learner's chosen source, else the usage counts."""
        learner = self.adaptation.learner if self.adaptation is not None else None
        counts = self.usage.counts()
        return counts if learner is None else learner.counts_for(learner.source, counts)

    def _reevaluate_pins(self) -> None:
        current = {(self._row[l], e) for l, e in self.cache.pins}
        add, remove = self.pin_policy.reevaluate(current, self._pin_counts(),
                                                 self.cache.pinned_slots * self.slot_bytes)
        if add or remove:
            self._apply_pins((current - set(remove)) | set(add))
            self.pin_swaps += len(add)

    def _quiesce(self) -> None:
        """Let every read in flight land (a tier change needs every slot settled)."""
        t0 = self.clock()
        self._finish_reads(list(self._inflight))
        self.io_wait_s += self.clock() - t0

    def _apply_pin_decision(self, decision: PinDecision) -> None:
        """The pin learner's choice: resize the pinned tier and load the new set."""
        current = {(self._row[l], e) for l, e in self.cache.pins}
        if decision.pinned_slots == self.cache.pinned_slots and set(decision.pins) == current:
            return
        self._quiesce()
        wanted = pins_to_layer_ids(decision.pins, self.moe_layers)
        keep = sorted(p for p in self.cache.pins if p in wanted)[: decision.pinned_slots]
        self.cache.set_pins(keep)
        self.cache.set_tiers(decision.pinned_slots, self.cache.staging_slots)
        self._apply_pins(decision.pins)
        self.pin_swaps += len(set(decision.pins) - current)

    def _set_mechanism(self, name: str, on: bool) -> None:
        """Apply a referee decision (between steps): prefetch on/off with its staging
        tier, idle-worker prefetch on/off, the eviction policy, lrfu or LRU."""
        if name == "prefetch":
            self._prefetch_allowed = on
            self._predicted.clear()
            self._idle_candidates = []
            staging = self.staging_default if on else 0
            if staging != self.cache.staging_slots:
                self._quiesce()
                self.cache.set_tiers(self.cache.pinned_slots, staging)
                if self.adaptation is not None:
                    self.adaptation.staging_changed(staging)
        elif name == "idle_prefetch":
            self._idle_allowed = on
            self._idle_candidates = []
        elif name == "early_hints":
            self._early_allowed = on
        elif name in POLICY_MECHANISMS:
            self._policy_states[name] = on
            policy = ladder_policy(self.options.policy, self._policy_states["policy"],
                                   self._policy_states["lrfu"])
            if policy != self.cache.policy_name:
                self.cache.set_policy(policy)

    def _io_totals(self) -> tuple[float, int, float, int]:
        """(read CPU seconds, reads, read service seconds, io workers): the pool's totals."""
        return self.io.totals()

    def learned_state(self) -> dict:
        """What the next session should start from (saved beside the usage counts): the
        pin learner's and referee's state, and the eviction policy's next-step statistics
        (scheduler.usage.encode_transitions) when it has learned any."""
        out = {} if self.adaptation is None else self.adaptation.learned()
        transitions = self.cache.transitions()
        if any(t is not None and np.any(t[1] > 0) for t in transitions):   # not all zeros (a reset)
            out["transitions"] = encode_transitions(transitions)
        return out


# ---------------------------------------------------------------- persistence


def load_usage_state(store, moe_layers: Sequence[int], num_experts: int, fingerprint: str,
                     half_life_tokens: float) -> tuple[np.ndarray, dict] | None:
    """(learned counts [L, E], learned state) from the state file, or None (absent, set
    aside, unusable). The state is what the pin learner and the referee settled on
    (StreamingExpertProvider's `learned=`).

    store: a daemon.store.state.StateStore. A payload that does not fit this model
    (UsageStats.from_dict refuses it, naming the field) is set aside as corrupt with a
    warning (ignored, in a read-only directory), never trusted.
    """
    def parse(payload: dict) -> UsageStats:
        return UsageStats.from_dict(payload, moe_layers, num_experts, fingerprint, half_life_tokens)

    payload = store.load(check=parse)
    if payload is None:
        return None
    stats = parse(payload)
    return stats.counts(), stats.learned


def load_usage_counts(store, moe_layers: Sequence[int], num_experts: int, fingerprint: str,
                      half_life_tokens: float) -> np.ndarray | None:
    """The counts of `load_usage_state` (None when it has none)."""
    state = load_usage_state(store, moe_layers, num_experts, fingerprint, half_life_tokens)
    return None if state is None else state[0]


def flush_usage(store, usage: UsageStats, fingerprint: str, learned: dict | None = None) -> None:
    """Merge what this process observed since its last flush into the state file.

    Under the store's lock: file counts decayed by our tokens since the last flush,
    plus our delta (scheduler.usage.merge_counts), so two processes serving the same
    model add up instead of overwriting each other. The merged counts become ours. A file
    whose payload does not fit is set aside (as by `load_usage_state`) and ours written.
    learned: this process's pin learner and referee state, written as the file's
    (the latest writer's word; None keeps what the file has).
    """
    from scheduler.usage import merge_counts

    delta, tokens = usage.take_delta()
    merged_counts: list[np.ndarray] = []

    def parse(payload: dict) -> UsageStats:
        return UsageStats.from_dict(payload, usage.moe_layers, usage.num_experts, fingerprint)

    def merge(current: dict | None) -> dict:     # current: None, or one `parse` accepted
        counts = usage.counts()
        kept_learned = {}
        if current is not None:
            on_disk = parse(current)
            counts = merge_counts(on_disk.counts(), tokens, delta, usage.half_life_tokens)
            kept_learned = on_disk.learned
        merged_counts.append(counts)
        payload = usage.to_dict(fingerprint)
        payload["counts"] = counts.tolist()
        state = kept_learned if learned is None else learned
        if state:
            payload["learned"] = dict(state)
        return payload

    store.save(merge, tokens=tokens, check=parse)
    usage.set_counts(merged_counts[-1])


_CACHE_KEYS = {"hit": "hits_by_phase", "prefetch_hit": "prefetch_hits_by_phase",
               "miss": "misses_by_phase"}
assert tuple(_CACHE_KEYS) == OUTCOMES


def expert_counters(provider, cache_snapshot=None, io_stats=None) -> ExpertCounters:
    """The additive totals of a StreamingExpertProvider (its cache's and io pool's).

    cache_snapshot / io_stats: readings already taken (default: read them now).
    """
    snap = cache_snapshot or provider.cache.snapshot()
    io = io_stats or provider.io.stats()
    a = provider.adaptation
    shadow = ({} if a is None else dict(shadow_lookups=a.totals["lookups"],
                                        shadow_naive_misses=a.totals["naive_misses"],
                                        mechanism_decisions=a.decision_counts()))
    lookups = {(layer, outcome, phase): getattr(snap, key)[phase][i]
               for i, layer in enumerate(snap.moe_layers)
               for outcome, key in _CACHE_KEYS.items() for phase in PHASES}
    return ExpertCounters(
        lookups=lookups, bytes_read=dict(io.bytes_issued), read_errors=io.read_errors,
        read_seconds_buckets=io.read_seconds_buckets, read_seconds_sum=io.read_seconds_total,
        evictions={"pinned": sum(snap.evictions_pinned), "dynamic": sum(snap.evictions_dynamic)},
        pin_swaps=provider.pin_swaps, prefetch_issued=sum(snap.prefetches_issued),
        prefetch_used=sum(snap.prefetches_used),
        prefetch_wasted_bytes=sum(snap.prefetches_wasted_bytes), **shadow)
