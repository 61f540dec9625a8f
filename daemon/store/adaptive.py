"""The streaming provider's learning at work: pins learned while serving, the do-no-harm
referee, and what they measure per window of decode steps.

`Adaptation` is owned by one `StreamingExpertProvider` and called on its thread at the
provider's own hook points (a step begins, a layer acquires, a guess is made, a read is
issued). Decisions are made by scheduler/ (`PinLearner`, `Referee`); this module times
the work (the provider's clock), keeps the two shadow caches (`ShadowLRU`: the naive
mode's cache, and LRU over moed's own tiers) fed, and hands the provider the changes to
apply between steps. Nothing here touches the slot buffers: every change is placement.

`policy_step_costs` measures, once per process and cache shape, what one layer step of
the cache's bookkeeping costs under each policy on this machine (the referee's prior;
live windows refine the policy in force).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
import numpy as np

from scheduler.cache import OUTCOME_HIT, OUTCOME_INFLIGHT, OUTCOME_MISS, ExpertCache
from scheduler.pinlearn import PinDecision, PinLearner
from scheduler.referee import FALLBACK_POLICY, MECHANISMS, Decision, Referee, Window
from scheduler.shadow import ShadowLRU, ShadowPolicyCache, even_split
from telemetry.logs import get_logger

log = get_logger("adaptive")

MERGE_CHECK_LAYER_STEPS = 64      # how often a warm-started lru_pins is compared with naive
WINDOW_STEPS = 16                 # decode steps per referee window
# The first window is shorter: a mechanism that loses much (prefetch of small experts
# whose reads cost less than its guesses) is judged after a quarter of the steps.
FIRST_WINDOW_STEPS = 4
# The pin learner may spend at most a share of the decode time so far
# (StreamingOptions.learner_time_share: its routing bookkeeping and its evaluations; an
# evaluation waits until the budget holds its last cost, estimated before the first).
# Measured on the embedded default model at 25 % cache, 256 tokens, one thread:
# unbudgeted evaluations took 0.28-0.40 ms per token (12-16 % of the time) and pinned
# nothing; on a disk-bound model a token takes tens of milliseconds, so the budget lets
# the first evaluation run as soon as it is due.
CALIBRATION_STEPS = 32            # synthetic steps per pass in `_measure`
CALIBRATION_ROUNDS = 3            # passes; the fastest counts
_calibrated: dict[tuple, float] = {}
GUESS_LIKELY, GUESS_IDLE, GUESS_EARLY = "likely", "idle", "early"


def _measure(policy: str, n_layers: int, num_experts: int, top_k: int, slots_per_layer: int,
             clock: Callable[[], float], with_prior: bool = False) -> tuple[float, float]:
    """(seconds, misses) per layer step of ExpertCache bookkeeping (request, loaded,
    release) under `policy` on seeded Zipf routing (memoized per process and shape for
    time.thread_time). with_prior: the cache starts with next-step statistics learned on
    the same routing, as a later session's does (predictive then scores and mixes two
    predictors per step: on a 64-expert layer 10 us per step against 3 us without)."""
    key = (policy, n_layers, num_experts, top_k, slots_per_layer, with_prior)
    if key in _calibrated and clock is time.thread_time:
        return _calibrated[key]
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, num_experts + 1)
    p /= p.sum()
    steps = [[rng.choice(num_experts, top_k, replace=False, p=p).tolist() for _ in range(n_layers)]
             for _ in range(CALIBRATION_STEPS)]

    def new_cache() -> ExpertCache:
        return ExpertCache(list(range(n_layers)), num_experts, top_k,
                           max(slots_per_layer, top_k) * n_layers, policy=policy)

    def serve(cache: ExpertCache, first_token: int) -> int:
        """Every step through `cache` as the engine serves it; returns the misses."""
        misses = 0
        for t, step in enumerate(steps):
            for li, ids in enumerate(step):
                for a in cache.request(li, ids, first_token + t):
                    if a.outcome == OUTCOME_MISS:
                        misses += 1
                        cache.loaded(a.slot)
                cache.release(li, ids)
        return misses

    cache = new_cache()
    if with_prior:
        serve(cache, 0)                         # untimed: what an earlier session learned
        learned = cache.transitions()
        cache = new_cache()
        if any(t is not None for t in learned):
            cache.seed_transitions(learned)
    # The fastest of CALIBRATION_ROUNDS passes over the steps (the next ones continue the
    # first's state): on a shared machine a single pass's time moved by half.
    layer_steps = CALIBRATION_STEPS * n_layers
    best, misses = math.inf, 0
    for r in range(CALIBRATION_ROUNDS):
        t0 = clock()
        pass_misses = serve(cache, r * CALIBRATION_STEPS)
        seconds = clock() - t0
        if seconds < best:
            best, misses = seconds, pass_misses
    result = (best / layer_steps, misses / layer_steps)
    if clock is time.thread_time:              # another clock: not this machine's figure
        _calibrated[key] = result
    return result


def policy_step_costs(policies: Sequence[str], n_layers: int, num_experts: int, top_k: int,
                      slots_per_layer: int, clock: Callable[[], float] = time.thread_time) -> dict[str, float]:
    """{policy: CPU seconds of ExpertCache bookkeeping (request, loaded, release) per layer
    step}, measured on seeded Zipf routing (memoized per process and shape)."""
    return {policy: _measure(policy, n_layers, num_experts, top_k, slots_per_layer, clock)[0]
            for policy in policies}


def bookkeeping_costs(policies: Sequence[str], n_layers: int, num_experts: int, top_k: int,
                      slots_per_layer: int, clock: Callable[[], float] = time.thread_time,
                      with_prior: bool = False) -> tuple[dict[str, float], float]:
    """The referee's prior for the cache's bookkeeping: ({policy: CPU seconds per layer
    step beyond its misses'}, CPU seconds per miss).

    A miss costs the cache more than a hit (a slot taken, a victim evicted), so a policy
    that misses less also spends less there; the per-miss part is measured with LRU at
    every expert resident (only the first uses miss) and at top_k slots (nearly every
    use a miss) and taken as common to all policies: cost = fixed * layer steps +
    per_miss * misses. (Two sizes close together differ by a fraction of a miss per
    layer step on Zipf routing: too little to tell the per-miss cost from the noise.)
    """
    slots = max(slots_per_layer, top_k)
    wide, wide_misses = _measure("lru", n_layers, num_experts, top_k, num_experts, clock)
    narrow, narrow_misses = _measure("lru", n_layers, num_experts, top_k, top_k, clock)
    per_miss = 0.0
    if narrow_misses > wide_misses:
        per_miss = max(0.0, (narrow - wide) / (narrow_misses - wide_misses))
    fixed = {}
    for policy in policies:
        seconds, misses = _measure(policy, n_layers, num_experts, top_k, slots, clock, with_prior)
        fixed[policy] = max(0.0, seconds - per_miss * misses)
    return fixed, per_miss


def cpu_clock_for(clock: Callable[[], float]) -> Callable[[], float]:
    """The clock that times bookkeeping beside `clock` (the wall clock of the steps): the
    calling thread's CPU time (time.thread_time) for the real clock, else `clock` itself
    (a test's clock). Bookkeeping is main-thread work: by the wall clock it would also
    count the waits for the GIL while io workers run, which any policy pays alike — on
    the Perl model LRU's live layer step measured 66-82 us by the wall clock against
    43-45 us calibrated quietly, and that difference was charged to the policy."""
    return time.thread_time if clock is time.perf_counter else clock


_TIME_FIELDS = {what: f"{what}_s" for what in ("hint", "idle_hint", "early_hint", "bookkeeping", "stall")}


class _Tally:
    """One window's sums (see scheduler.referee.Window)."""

    def __init__(self) -> None:
        self.steps = self.layer_steps = self.lookups = 0
        self.wall_s = self.stall_s = self.hint_s = self.idle_hint_s = self.early_hint_s = 0.0
        self.bookkeeping_s = self.learner_s = self.shadow_s = 0.0
        self.io_cpu_s = self.io_read_s = 0.0    # the io pool's, during decode steps only
        self.io_reads = 0
        self.misses = self.inflight_hits = self.reads = self.pin_loads = 0
        self.prefetch_used = self.prefetch_wasted = self.idle_used = self.idle_wasted = 0
        self.early_used = self.early_wasted = 0
        self.naive_misses = self.lru_pins_misses = self.lru_dynamic_misses = 0


class Adaptation:
    """Pins learned live and the referee, for one provider (see the module docstring).

    n_layers, num_experts, top_k: the model. cache: the provider's ExpertCache (its tiers
    are read, never changed here). learn_pins: the pin share is learned (else fixed by
    the caller). max_pin_share: the most the learner may pin. referee: value the
    mechanisms and turn off what does not pay. mechanisms: those the options turned on.
    learned: what an earlier session saved ({"pin_share", "pin_source", "mechanisms",
    "mechanism_backoff"}).
    learner_time_share: the most of the decode time the pin learner may take.
    """

    def __init__(self, n_layers: int, num_experts: int, top_k: int, cache: ExpertCache, *,
                 learn_pins: bool, max_pin_share: float, referee: bool, mechanisms: tuple[str, ...],
                 policy: str, staging_slots: int, learned: dict | None = None,
                 clock: Callable[[], float] = time.perf_counter, learner_time_share: float = 0.03,
                 cpu_clock: Callable[[], float] | None = None):
        self.n_layers, self.num_experts, self.top_k = n_layers, num_experts, top_k
        self.learner_time_share = learner_time_share
        self.cache = cache
        self.clock = clock
        self.cpu_clock = cpu_clock or cpu_clock_for(clock)
        self.staging_default = staging_slots
        learned = learned or {}
        self.transitions_learned_before = "transitions" in learned
        total = cache.total_slots
        self.learner: PinLearner | None = None
        if learn_pins and max_pin_share > 0 and total > top_k * n_layers + staging_slots:
            # An earlier session's recent counts are gone: its share starts from the long
            # ones (which hold them), until this session's first evaluation.
            self.learner = PinLearner(n_layers, num_experts, top_k, total, staging_slots=staging_slots,
                                      max_share=max_pin_share, start_share=learned.get("pin_share", 0.0),
                                      start_source="long", check_shadow=self._check_shadow)
        # The shadows: the naive cache; LRU over moed's pinned tier and every other slot,
        # from the cache's warm start (None while nothing is pinned and the cache was not
        # warm-started: it is then the naive cache); LRU over the tiers
        # the layers really have, the staging tier left out (None without staging: it is
        # then lru_pins) — the policy is compared with it, and what it misses beyond
        # lru_pins is staging's cost. Each is replayed only while it differs.
        self.naive = ShadowLRU(even_split(total, n_layers))
        self.lru_pins: ShadowLRU | None = None
        self.lru_dynamic: ShadowLRU | None = None
        self._shadow_pins: set = set()
        self._warm = False                       # the cache was warm-started (warm_started)
        self._merge_countdown = MERGE_CHECK_LAYER_STEPS
        self._retier(cache.pinned_slots, cache.staging_slots)
        self.referee: Referee | None = None
        if referee:
            slots = max(top_k, total // n_layers)
            costs, per_miss = bookkeeping_costs(sorted({"lru", FALLBACK_POLICY, policy}), n_layers,
                                                num_experts, top_k, slots, self.cpu_clock,
                                                with_prior="transitions" in learned)
            self.referee = Referee(costs, policy, enabled=mechanisms, miss_bookkeeping_s=per_miss)
            self.referee.set_states(learned.get("mechanisms") or {}, learned.get("mechanism_backoff"))
        # What an earlier session saved of mechanisms this one does not manage (turned off
        # by the operator here, or no referee): kept as it was for the sessions that do.
        managed = self.referee.managed if self.referee is not None else set()
        self._carried = {key: {m: v for m, v in (learned.get(key) or {}).items()
                               if m in MECHANISMS and m not in managed}
                         for key in ("mechanisms", "mechanism_backoff")}
        self._tally = _Tally()
        self._rows: list[list | None] = [None] * n_layers   # this step's routing, [T][K] ints
        self._step_start: float | None = None
        self._step_decode = False
        self._guesses: dict[tuple[int, int], str] = {}
        self._io_at_step: tuple[float, int, float, int] | None = None   # io totals at step start
        self._io_workers = 1
        self._step_ended = False
        self.windows = 0
        # Decode totals since this provider started (the shadows' side of "do no harm").
        self.totals = {"lookups": 0, "misses": 0, "naive_misses": 0, "lru_pins_misses": 0}
        self.last_pin_decision: PinDecision | None = None
        self.decode_wall_s = 0.0                 # decode steps' time since start
        self.learner_spent_s = 0.0               # the pin learner's time since start
        self._decide_cost_s = 0.0                # the last evaluation's time (estimated first)
        if self.learner is not None:
            # Before the first evaluation its cost is estimated: the check replays two
            # windows twice (challenger and incumbent) through the real policy.
            step = policy_step_costs([policy], n_layers, num_experts, top_k,
                                     max(top_k, total // n_layers), self.cpu_clock)[policy]
            self._decide_cost_s = 4 * self.learner.window_tokens * len(self.learner.check_layers) * step
        self.deferred_evaluations = 0            # steps an evaluation was due but over budget
        self.pin_changes = 0
        self.decisions: list[dict] = []          # the latest mechanism decisions (most recent last)

    def _check_shadow(self, layers: list[int], capacities: list[int], pins) -> ShadowPolicyCache:
        """The pin learner's check replays the cache's own policy (its next-step
        statistics as they are now), not LRU: against a policy that keeps frequent experts
        anyway, LRU overrates what pins add (measured: pins chosen that way cost 0.3-0.8
        points of hit rate on two trained models and on the Kimi trace)."""
        return ShadowPolicyCache(layers, capacities, self.num_experts, self.top_k, self.cache.policy_name,
                                 pins, transitions=self.cache.transitions(layers))

    # ------------------------------------------------------------- the provider's hooks
    def step_begins(self, decode: bool, learn: bool,
                    io_totals: Callable[[], tuple[float, int, float, int]]) -> tuple[Decision, ...]:
        """A step is about to run (decode: one token per sequence). Closes the previous
        step: its routing feeds the learner (when `learn`), its time the window; a full
        window goes to the referee, whose changes are returned for the provider to apply
        before this step. io_totals: () -> the io pool's totals (read CPU seconds, reads,
        read service seconds, workers)."""
        now = self.clock()
        io = io_totals()
        t = self._tally
        mechanisms: tuple[Decision, ...] = ()
        if self._step_start is not None and self._step_decode:
            t.steps += 1
            if not self._step_ended:             # (no step_ends: timed up to this step)
                self._time_step(now, io)
            for kind in self._guesses.values():
                t.idle_wasted += kind == GUESS_IDLE
                t.early_wasted += kind == GUESS_EARLY
                t.prefetch_wasted += 1
        if learn and self.learner is not None and all(x is not None for x in self._rows):
            t0 = self.clock()                  # every row of the step, prompt ones too
            for row in zip(*self._rows):
                self.learner.observe(row)
            spent = self.clock() - t0
            self.learner_spent_s += spent
            if self._step_start is not None and self._step_decode:
                # Time the decode step cost after its layers ran: moed's time (the
                # window's), and an overhead the naive estimate takes out again.
                t.learner_s += spent
                t.wall_s += spent
                self.decode_wall_s += spent
        self._guesses.clear()
        if t.steps >= (WINDOW_STEPS if self.windows else min(WINDOW_STEPS, FIRST_WINDOW_STEPS)):
            mechanisms = self._close_window()
        self._io_at_step = io
        self._step_ended = False
        self._rows = [None] * self.n_layers
        self._step_decode = decode
        self._step_start = self.clock()
        return mechanisms

    def step_ends(self, io_totals: Callable[[], tuple[float, int, float, int]]) -> None:
        """The step begun last has run its layers: its time (and the io pool's reads that
        finished in it) ends here, not at the next step, so that time between steps — the
        daemon idle between requests — counts in no window."""
        if self._step_start is not None and self._step_decode and not self._step_ended:
            self._time_step(self.clock(), io_totals())

    def _time_step(self, now: float, io: tuple[float, int, float, int]) -> None:
        t = self._tally
        t.wall_s += now - self._step_start
        self.decode_wall_s += now - self._step_start
        if self._io_at_step is not None:         # the reads that finished during the step
            t.io_cpu_s += io[0] - self._io_at_step[0]
            t.io_reads += io[1] - self._io_at_step[1]
            t.io_read_s += io[2] - self._io_at_step[2]
            self._io_workers = io[3]
        self._step_ended = True

    def pin_decision_due(self) -> bool:
        """An evaluation is due and the learner's time budget (`learner_time_share` of
        the decode time so far) holds one more at the last one's cost."""
        if self.learner is None or not self.learner.due():
            return False
        if self.learner_spent_s + self._decide_cost_s > self.learner_time_share * self.decode_wall_s:
            self.deferred_evaluations += 1
            return False
        return True

    def decide_pins(self, long_counts: np.ndarray) -> PinDecision:
        t0 = self.clock()
        decision = self.learner.decide(long_counts)
        spent = self.clock() - t0
        if self._step_decode:                    # inside this decode step's time already
            self._tally.learner_s += spent
        self.learner_spent_s += spent
        self._decide_cost_s = spent
        self.last_pin_decision = decision
        if decision.changed:
            self.pin_changes += 1
            log.info("pins_learned", share=decision.share, source=decision.source,
                     pinned_slots=decision.pinned_slots, **{
                         f"{k}_hit_rate": v["hit_rate"] for k, v in decision.validation.items()
                         if isinstance(v, dict)})
        return decision

    def acquired(self, layer_index: int, experts: Sequence[int], outcomes: Sequence[str],
                 decode: bool, layer: int) -> None:
        """A layer's acquire of `experts` (their cache outcomes) completed."""
        if not decode:
            self._shadows(layer_index, experts)
            return
        t = self._tally
        t.layer_steps += 1
        t.lookups += len(experts)
        misses = outcomes.count(OUTCOME_MISS)
        inflight = outcomes.count(OUTCOME_INFLIGHT)
        t.misses += misses
        t.inflight_hits += inflight
        if self._guesses:                  # (prefetch on: guesses of this step to match)
            for e, outcome in zip(experts, outcomes):
                kind = self._guesses.pop((layer, int(e)), None)
                if kind is not None and outcome in (OUTCOME_HIT, OUTCOME_INFLIGHT):
                    t.prefetch_used += 1
                    t.idle_used += kind == GUESS_IDLE
                    t.early_used += kind == GUESS_EARLY
        naive, lru_pins, lru_dynamic = self._shadows(layer_index, experts)
        if self._warm:
            self._merge_countdown -= 1
            if self._merge_countdown <= 0:
                self._merge_countdown = MERGE_CHECK_LAYER_STEPS
                self._merge_warm_shadow()
        t.naive_misses += naive
        t.lru_pins_misses += lru_pins
        t.lru_dynamic_misses += lru_dynamic
        totals = self.totals
        totals["lookups"] += len(experts)
        totals["misses"] += misses + inflight
        totals["naive_misses"] += naive
        totals["lru_pins_misses"] += lru_pins

    def routed(self, layer_index: int, ids: np.ndarray) -> None:
        """A layer's routing this step: ids [T, K], a row per position (copied, as lists)."""
        self._rows[layer_index] = np.asarray(ids).tolist()

    def _shadows(self, layer_index: int, experts: Sequence[int]) -> tuple[int, int, int]:
        t0 = self.cpu_clock()
        ids = [int(e) for e in experts]
        naive = self.naive.access(layer_index, ids)
        lru_pins = naive if self.lru_pins is None else self.lru_pins.access(layer_index, ids)
        lru_dynamic = lru_pins if self.lru_dynamic is None else self.lru_dynamic.access(layer_index, ids)
        self._tally.shadow_s += self.cpu_clock() - t0
        return naive, lru_pins, lru_dynamic

    def guessed(self, layer: int, expert: int, kind: str) -> None:
        """A prefetch read of (layer, expert) was issued (kind: likely or idle)."""
        self._guesses[(layer, int(expert))] = kind

    def add_time(self, what: str, seconds: float) -> None:
        """Add measured seconds of this step to `what` (hint, idle_hint, early_hint,
        bookkeeping, stall)."""
        if self._step_decode:
            self._tally.__dict__[_TIME_FIELDS[what]] += seconds

    def read_issued(self, reason: str) -> None:
        if self._step_decode:
            self._tally.reads += 1
            self._tally.pin_loads += reason == "pin_load"

    def pins_changed(self, pins_by_index, pinned_slots: int) -> None:
        """The cache's pinned tier now holds `pins_by_index` in `pinned_slots` slots."""
        self._shadow_pins = set(pins_by_index)
        self._retier(pinned_slots, self.cache.staging_slots)

    def _retier(self, pinned_slots: int, staging_slots: int) -> None:
        """Give lru_pins and lru_dynamic the tiers the cache has now (a shadow that comes
        to differ from the one it stood for starts as a copy of it)."""
        pins, total = self._shadow_pins, self.cache.total_slots
        if pinned_slots == 0 and not pins and not self._warm:
            self.lru_pins = None
        else:
            if self.lru_pins is None:
                self.lru_pins = self.naive.copy()
            self.lru_pins.set_pins(pins, even_split(total - pinned_slots, self.n_layers))
        if staging_slots == 0:
            self.lru_dynamic = None
        else:
            if self.lru_dynamic is None:
                self.lru_dynamic = (self.lru_pins or self.naive).copy()
            self.lru_dynamic.set_pins(pins, even_split(max(self.n_layers, total - pinned_slots - staging_slots),
                                                       self.n_layers))

    def warm_started(self, layer_index: int, experts: Sequence[int]) -> None:
        """The cache's warm start read `experts` into the layer's empty dynamic tier, the
        last the most recent. LRU over moed's tiers (the eviction policy's yardstick)
        starts from the same contents, so the misses the warm start avoids are not
        credited to the policy; the naive cache starts cold, as the naive mode does (they
        are moed's, against naive). Counts no access."""
        if not self._warm:
            self._warm = True
            self._retier(self.cache.pinned_slots, self.cache.staging_slots)
        for shadow in (self.lru_pins, self.lru_dynamic):
            if shadow is not None:
                for e in experts:
                    shadow.access(layer_index, [int(e)])

    def _merge_warm_shadow(self) -> None:
        """Drop lru_pins once it stands for the naive cache again: with nothing pinned
        and the same slots, an LRU forgets where it started once every layer has seen
        its capacity of distinct experts, and from then on the two shadows miss alike —
        one replay instead of two."""
        if (self.lru_pins is not None and not self._shadow_pins and self.cache.pinned_slots == 0
                and self.lru_pins.same_state(self.naive)):
            self.lru_pins, self._warm = None, False

    def staging_changed(self, staging_slots: int) -> None:
        self._retier(self.cache.pinned_slots, staging_slots)
        if self.learner is not None:
            self.learner.staging_slots = staging_slots

    # ----------------------------------------------------------------- windows
    def _close_window(self) -> tuple[Decision, ...]:
        t = self._tally
        # Per read and busy share from the reads that finished during the window's decode
        # steps: time between steps (idle, prompts) would dilute the share.
        read_cpu = t.io_cpu_s / t.io_reads if t.io_reads > 0 else 0.0
        read_s = t.io_read_s / t.io_reads if t.io_reads > 0 else 0.0
        capacity = t.wall_s * max(1, self._io_workers)
        io_busy = min(1.0, t.io_read_s / capacity) if capacity > 0 else 0.0
        self._tally = _Tally()
        self.windows += 1
        if self.referee is None:
            return ()
        window = Window(steps=t.steps, layer_steps=t.layer_steps, lookups=t.lookups, wall_s=t.wall_s,
                        stall_s=t.stall_s, hint_s=t.hint_s, idle_hint_s=t.idle_hint_s,
                        early_hint_s=t.early_hint_s, early_used=t.early_used,
                        early_wasted=t.early_wasted,
                        bookkeeping_s=t.bookkeeping_s, learner_s=t.learner_s, shadow_s=t.shadow_s,
                        misses=t.misses, inflight_hits=t.inflight_hits, reads=t.reads,
                        pin_loads=t.pin_loads, read_cpu_s=read_cpu, prefetch_used=t.prefetch_used,
                        prefetch_wasted=t.prefetch_wasted, idle_used=t.idle_used,
                        idle_wasted=t.idle_wasted, naive_misses=t.naive_misses,
                        lru_pins_misses=t.lru_pins_misses, policy=self.cache.policy_name,
                        lru_dynamic_misses=t.lru_dynamic_misses, read_s=read_s, io_busy=io_busy)
        decisions = tuple(self.referee.close_window(window))
        verdict = self.referee.verdict
        for d in decisions:
            record = {"window": self.windows, "mechanism": d.mechanism, "on": d.on, "reason": d.reason,
                      "net_s_per_token": d.net_s_per_token}
            self.decisions = (self.decisions + [record])[-16:]
            log.info("mechanism_turned_on" if d.on else "mechanism_turned_off", mechanism=d.mechanism,
                     reason=d.reason, net_s_per_token=d.net_s_per_token, window=self.windows,
                     estimated_speedup=verdict.estimated_speedup)
        return decisions

    # ----------------------------------------------------------------- reporting
    def learned(self) -> dict:
        """What the next session starts from (saved with the usage counts)."""
        out: dict = {}
        if self.learner is not None:
            out.update(pin_share=self.learner.share, pin_source=self.learner.source)
        states, backoffs = dict(self._carried["mechanisms"]), dict(self._carried["mechanism_backoff"])
        if self.referee is not None:
            # A mechanism on only for a probe not yet judged is saved as it was before it.
            states.update({m: self.referee.is_on(m) and not self.referee.states[m].probing
                           for m in MECHANISMS if m in self.referee.managed})
            backoffs.update(self.referee.backoffs())
        if states:
            out["mechanisms"] = states
        if backoffs:
            out["mechanism_backoff"] = backoffs
        return out

    def decision_counts(self) -> dict[str, int]:
        """Mechanism -> times turned on or off; "pins" -> learned changes."""
        out = {"pins": self.pin_changes}
        if self.referee is not None:
            out.update({m: st.decisions for m, st in self.referee.states.items()})
        return out

    def gauges(self) -> tuple[dict[str, int], dict[str, float], float]:
        """(mechanism -> 1/0, mechanism -> smoothed net seconds per token, the latest
        estimated speed-up over naive or 0.0) for the metrics."""
        enabled: dict[str, int] = {}
        net: dict[str, float] = {}
        if self.learner is not None:
            enabled["pins"] = int(self.learner.share > 0)
        if self.referee is not None:
            for m, st in self.referee.states.items():
                enabled[m] = int(st.on)
                if st.net is not None:
                    net[m] = st.net
            pins = self.referee.verdict.values.get("pins")
            if pins is not None:
                net["pins"] = pins["net"]
        speedup = self.referee.verdict.estimated_speedup if self.referee is not None else None
        return enabled, net, speedup or 0.0

    def report(self) -> dict:
        """JSON-ready state for /v1/moed/stats."""
        pins = None
        if self.learner is not None:
            d = self.last_pin_decision
            pins = {"share": self.learner.share, "source": self.learner.source,
                    "evaluations": self.learner.evaluations,
                    "time_share": (round(self.learner_spent_s / self.decode_wall_s, 4)
                                   if self.decode_wall_s > 0 else None),
                    "time_budget": self.learner_time_share,
                    "over_budget_steps": self.deferred_evaluations,
                    "last": None if d is None else {"changed": d.changed, "validation": d.validation}}
        n = self.totals["lookups"]
        shadows = {"decode_lookups": n,
                   "hit_rate": None if not n else round(1 - self.totals["misses"] / n, 4),
                   "naive_hit_rate": None if not n else round(1 - self.totals["naive_misses"] / n, 4),
                   "lru_with_pins_hit_rate": None if not n else round(1 - self.totals["lru_pins_misses"] / n, 4)}
        weights = [w for w in self.cache.prior_weights() if w is not None]
        prior = {"from_earlier_session": self.transitions_learned_before, "weighted_layers": len(weights),
                 "mean_weight": round(sum(weights) / len(weights), 4) if weights else None}
        return {"windows": self.windows, "window_steps": WINDOW_STEPS, "pin_learning": pins,
                "next_expert_prior": prior,
                "against_naive": shadows,
                "referee": None if self.referee is None else {**self.referee.report(),
                                                              "recent_decisions": self.decisions}}
