"""Do no harm, measured live: what each adaptive mechanism costs and saves on this workload.

Conventions (the whole module): seconds are measured by the caller (the streaming
provider reads its clock; nothing here does) and passed in per window of decode steps;
counts are experts (one per step, MoE layer and distinct expert). A miss is a needed
expert that was not resident: it is read on demand and the step waits for it.

The caller runs, beside the real cache, two `scheduler.shadow.ShadowLRU` replays of the
same routing, which cost no IO: the naive mode's cache (LRU over every slot, no pins, no
prefetch) and LRU over moed's own pinned and dynamic tiers. Per window the referee gets
(`Window`) moed's measured figures and the shadows' misses, and values in seconds:

  miss cost     the stall one miss costs here: this window's io wait over its misses
                (and waits for reads still in flight), smoothed (half-life SMOOTHING
                windows); a read also costs CPU (`read_cpu_s`, measured by the io
                workers), which a 2-core machine takes from the compute threads.
  device time   a read occupies an io worker for `read_s` (its service time); while
                the workers are busy a share `io_busy` of the time (smoothed), a read
                nobody needed delays the demand reads queued behind it by that share of
                its service time. On a disk that is the bottleneck, wasted guesses cost
                nearly a miss each; on a fast or page-cached one, almost nothing.
  prefetch      saves the stalls of the misses its used guesses replaced (a guess
                still in flight when needed saves half); costs the time spent making
                guesses (`hint_s`) and, per unused read, its CPU and device time.
  idle_prefetch the share of that made by the less likely guesses read into idle io
                workers, valued alone.
  early_hints   the share made by the second guess of each layer, from its own router
                before its attention (its router and norm included in its time).
  policy        the eviction policy against LRU over the same tiers: saves the misses
                LRU would have had beyond moed's (less the prefetch's), at a miss's
                stall plus a read's CPU; costs its bookkeeping (main-thread CPU)
                beyond what LRU's would have been with LRU's misses (a fixed part
                per layer step, `policy_step_s`, and a part per miss,
                `miss_bookkeeping_s`, both measured).
  lrfu          the same, for lrfu in force in the configured policy's place (see
                FALLBACK_POLICY).
  pins          (reported, decided by scheduler.pinlearn): the naive cache's misses
                beyond LRU-with-pins (which starts from the cache's warm start, as the
                LRU shadows do: what an earlier session's usage brings), less the pin
                loads (warm-start reads included), against the learner's time.
  naive         the estimated time of the naive mode on this window: the measured time,
                less moed's stall and overheads (its bookkeeping beyond LRU's with the
                naive cache's misses), plus those misses at the miss cost and their
                read CPU. `estimated_speedup` = naive / measured.

Decisions: a mechanism whose smoothed net value (saved - cost) stays below
-TOLERANCE of the window's time for PATIENCE windows in a row (one, in the first window
a guessing mechanism is judged in: one that does not pay on this workload should cost
little, and a wrong first verdict costs a probe BACKOFF_START windows later; a policy's
first verdicts, on statistics still young, always wait PATIENCE), or falls below
-FAST_LOSS of it in one window, is turned off (prefetch off returns the staging tier to
the layers; policy off is LRU). An off mechanism is turned back on for a probe after `backoff`
windows; it stays on when the probe's windows pay. The back-off starts at BACKOFF_START,
doubles while probes fail (to BACKOFF_MAX), and is never shorter than what keeps the
expected cost of probing at PROBE_BUDGET of the time: a mechanism that lost a share f of
each window's time is probed again after W * f / PROBE_BUDGET windows at the soonest, W
the windows a probe runs (`probe_windows`: PROBE_WINDOWS, plus a policy's
WARMUP_WINDOWS). One mechanism is probed at a time (two probes in the same windows would be
judged on each other's effects). A policy is not judged in its first WARMUP_WINDOWS
windows in force: the cache is still filling or its statistics are empty (measured on the
embedded default model: the predictive policy lost 0.1-0.6 ms per token against LRU in
windows 1-2 and won 0.04-0.19 ms in each later one). Nothing here changes output: every
mechanism is placement.

Prefetch's staging tier takes slots from the layers' dynamic tiers: the misses LRU over
the tiers without it has beyond LRU over all of them (`lru_dynamic_misses` -
`lru_pins_misses`) are a cost of prefetch, and the policy is compared with LRU over the
dynamic tiers it really has.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

MECHANISMS = ("prefetch", "idle_prefetch", "early_hints", "policy", "lrfu")
# The eviction policy is a ladder: the configured policy ("policy"), else lrfu ("lrfu":
# judged only while "policy" is off), else LRU. Measured with the three held fixed
# (prefetch, pins and referee off, fresh state, 128 sampled tokens x 5, one thread):
# lrfu had the predictive policy's hit rate (0.665 / 0.666 on a skewed checkpoint, 0.652
# / 0.665 on a second trained model, 0.639 / 0.638 disk-bound) at a fraction of its
# bookkeeping: 1.09x / 1.03x LRU's tokens/s on the skewed checkpoint, 1.03x / 0.98x on
# the second model, 0.99x / 0.91x on the embedded default model. The predictive policy's
# own gain is what it learns across sessions (next-expert statistics).
FALLBACK_POLICY = "lrfu"
POLICY_MECHANISMS = ("policy", "lrfu")

SMOOTHING = 2.0          # windows: half-life of the smoothed values
TOLERANCE = 0.01         # of a window's time: a net value above -this is not a loss
PATIENCE = 2             # windows in a row below it before a mechanism is turned off
PROBE_WINDOWS = 2        # windows a re-enabled mechanism runs before it is judged
BACKOFF_START = 4        # windows off before the first probe
BACKOFF_MAX = 64
FAST_LOSS = 0.10         # of a window's time: a loss this large turns a mechanism off at once
PROBE_BUDGET = 0.02      # of the time: what probing a losing mechanism may cost, expected
WARMUP_WINDOWS = 2       # windows before the policy is judged


def probe_windows(mechanism: str) -> int:
    """Windows a probe of `mechanism` runs at its cost: PROBE_WINDOWS, after the
    WARMUP_WINDOWS a policy runs unjudged (its statistics fill) first."""
    return PROBE_WINDOWS + (WARMUP_WINDOWS if mechanism in POLICY_MECHANISMS else 0)


def ladder_policy(configured: str, policy_on: bool, lrfu_on: bool) -> str:
    """The eviction policy in force: the configured one while "policy" is on, else lrfu
    while "lrfu" is on, else LRU."""
    if policy_on:
        return configured
    return FALLBACK_POLICY if lrfu_on else "lru"


@dataclass(frozen=True)
class Window:
    """One window of decode steps as the provider measured it (seconds and counts).

    steps: decode steps; layer_steps: MoE layer steps (steps x MoE layers); lookups:
    experts needed. wall_s: time of the steps (the pin learner's included, part of it
    spent after a step's layers ran); stall_s: time waiting for reads;
    hint_s: making guesses (routers' scores to reads), idle_hint_s / early_hint_s: its
    idle-worker part and its second-guess part;
    bookkeeping_s: the cache's request/release and shadow_s: the shadows, both in the
    main thread's CPU seconds (a wait for the GIL is no policy's cost); learner_s: the
    pin learner. misses: demand reads; inflight_hits: needed experts still being read
    (a prefetch or pin load); reads: every read issued (demand, prefetch, pin loads);
    pin_loads; read_cpu_s: CPU seconds of one read (io workers, this window); read_s:
    service seconds of one read (first byte requested to last received, queue wait
    excluded); io_busy: the io workers' time spent reading over their time (0..1).
    prefetch_used / prefetch_wasted: guesses used by the step they were made for /
    not; idle_used / idle_wasted, early_used / early_wasted: those of the idle-worker
    guesses and of the second guesses.
    naive_misses / lru_pins_misses / lru_dynamic_misses: the shadows' misses (the naive
    cache; LRU over moed's pinned tier and every other slot; LRU over the pinned and
    dynamic tiers, the staging tier left out). policy: the policy in force.
    """

    steps: int
    layer_steps: int
    lookups: int
    wall_s: float
    stall_s: float
    hint_s: float
    idle_hint_s: float
    early_hint_s: float
    bookkeeping_s: float
    learner_s: float
    shadow_s: float
    misses: int
    inflight_hits: int
    reads: int
    pin_loads: int
    read_cpu_s: float
    prefetch_used: int
    prefetch_wasted: int
    idle_used: int
    idle_wasted: int
    early_used: int
    early_wasted: int
    naive_misses: int
    lru_pins_misses: int
    policy: str
    lru_dynamic_misses: int | None = None     # None: no staging tier (= lru_pins_misses)
    read_s: float = 0.0
    io_busy: float = 0.0


@dataclass
class _State:
    on: bool = True
    below: int = 0                 # windows in a row below -TOLERANCE
    off_for: int = 0               # windows since turned off
    backoff: int = BACKOFF_START
    probing: int = 0               # probe windows left
    net: float | None = None       # smoothed net value per window, seconds
    saved: float | None = None
    cost: float | None = None
    decisions: int = 0
    judged: int = 0                # windows valued while on, this session


@dataclass(frozen=True)
class Decision:
    """A change the caller applies before the next window: `mechanism` turned on or off."""

    mechanism: str
    on: bool
    reason: str
    net_s_per_token: float | None


@dataclass
class Verdict:
    """The latest window's valuation (JSON-ready via `to_dict`)."""

    windows: int = 0
    estimated_speedup: float | None = None
    miss_cost_s: float | None = None
    read_cpu_s: float | None = None
    read_s: float | None = None
    io_busy: float | None = None
    moed_hit_rate: float | None = None
    naive_hit_rate: float | None = None
    moed_reads_per_token: float | None = None
    naive_reads_per_token: float | None = None
    values: dict = field(default_factory=dict)     # mechanism -> {saved, cost, net} s/token

    def to_dict(self) -> dict:
        return asdict(self)


class Referee:
    """Values moed's mechanisms per window and turns off those that do not pay.

    policy_step_s: {policy name: CPU seconds of the cache's bookkeeping per layer step
    beyond its misses'}, measured by the caller (a calibration at start); updated from
    live windows. miss_bookkeeping_s: the bookkeeping one miss adds (the cache takes a
    slot and evicts), common to every policy. LRU's bookkeeping in a window is taken as
    the policy in force's live fixed part times LRU's calibrated share of it, plus this
    times LRU's misses: a policy is charged what it spends beyond that and credited the
    slot work of the misses it avoids.
    default_policy: the policy the mechanism "policy" stands for when on.
    enabled: mechanisms that start on (the others are off and never probed: the
    operator turned them off).
    """

    def __init__(self, policy_step_s: dict[str, float], default_policy: str,
                 enabled: tuple[str, ...] = MECHANISMS, miss_bookkeeping_s: float = 0.0):
        self.policy_step_s = dict(policy_step_s)
        self._calibrated_step = dict(policy_step_s)
        self.miss_bookkeeping_s = float(miss_bookkeeping_s)
        self.default_policy = default_policy
        self.states = {m: _State(on=m in enabled) for m in MECHANISMS}
        self.managed = set(enabled)
        if default_policy == "lru":
            self.managed.discard("policy")
            self.states["policy"].on = False
        if default_policy in ("lru", FALLBACK_POLICY):
            self.managed.discard("lrfu")
            self.states["lrfu"].on = False
        self._policy_seen: str | None = None   # the policy of the last window
        self._policy_age = 0                    # windows it has been in force
        self.verdict = Verdict()
        self._miss_cost: float | None = None
        self._read_cpu: float | None = None
        self._read_s: float | None = None
        self._io_busy: float | None = None

    def is_on(self, mechanism: str) -> bool:
        return self.states[mechanism].on

    @property
    def policy(self) -> str:
        """The eviction policy the states call for: the configured one, lrfu, or LRU."""
        return ladder_policy(self.default_policy, self.states["policy"].on,
                             "lrfu" in self.managed and self.states["lrfu"].on)

    # ------------------------------------------------------------------ valuing
    def _smooth(self, old: float | None, new: float) -> float:
        if old is None:
            return new
        keep = 2.0 ** (-1.0 / SMOOTHING)
        return keep * old + (1.0 - keep) * new

    def value(self, w: Window) -> Verdict:
        """This window's valuation (updates the smoothed miss and read costs)."""
        waited_for = w.misses + w.inflight_hits
        if waited_for:
            self._miss_cost = self._smooth(self._miss_cost, w.stall_s / waited_for)
        if w.read_cpu_s > 0:
            self._read_cpu = self._smooth(self._read_cpu, w.read_cpu_s)
        if w.read_s > 0:
            self._read_s = self._smooth(self._read_s, w.read_s)
            self._io_busy = self._smooth(self._io_busy, min(1.0, max(0.0, w.io_busy)))
        if w.layer_steps and w.bookkeeping_s > 0:
            step = max(0.0, w.bookkeeping_s - self.miss_bookkeeping_s * w.misses) / w.layer_steps
            self.policy_step_s[w.policy] = self._smooth(self.policy_step_s.get(w.policy), step)
        miss = self._miss_cost or 0.0
        cpu = self._read_cpu or 0.0
        wasted = cpu + (self._io_busy or 0.0) * (self._read_s or 0.0)   # one unused read
        steps = max(1, w.steps)
        values: dict[str, dict] = {}

        def put(name: str, saved: float, cost: float) -> None:
            values[name] = {"saved": saved / steps, "cost": cost / steps, "net": (saved - cost) / steps}

        lru_dynamic = w.lru_pins_misses if w.lru_dynamic_misses is None else w.lru_dynamic_misses
        staging_misses = max(0, lru_dynamic - w.lru_pins_misses)
        if self.states["prefetch"].on:
            saved = (w.prefetch_used - 0.5 * w.inflight_hits) * miss
            put("prefetch", max(0.0, saved),
                w.hint_s + w.prefetch_wasted * wasted + staging_misses * (miss + cpu))
            if self.states["idle_prefetch"].on:
                put("idle_prefetch", w.idle_used * miss, w.idle_hint_s + w.idle_wasted * wasted)
            if self.states["early_hints"].on:
                put("early_hints", w.early_used * miss, w.early_hint_s + w.early_wasted * wasted)
        if w.policy != "lru":
            avoided = lru_dynamic - w.misses - w.prefetch_used
            name = "lrfu" if w.policy == FALLBACK_POLICY and "lrfu" in self.managed else "policy"
            put(name, avoided * (miss + cpu), w.bookkeeping_s - self._lru_bookkeeping(w, lru_dynamic))
        put("pins", (w.naive_misses - w.lru_pins_misses - w.pin_loads) * (miss + cpu), w.learner_s)
        naive_s = (w.wall_s - w.stall_s - w.hint_s - w.learner_s - w.shadow_s
                   - (w.bookkeeping_s - self._lru_bookkeeping(w, w.naive_misses))
                   + w.naive_misses * miss + (w.naive_misses - w.reads) * cpu)
        lookups = max(1, w.lookups)
        self.verdict = Verdict(
            windows=self.verdict.windows + 1,
            estimated_speedup=naive_s / w.wall_s if w.wall_s > 0 else None,
            miss_cost_s=self._miss_cost, read_cpu_s=self._read_cpu, read_s=self._read_s,
            io_busy=self._io_busy,
            moed_hit_rate=1.0 - (w.misses + w.inflight_hits) / lookups,
            naive_hit_rate=1.0 - w.naive_misses / lookups,
            moed_reads_per_token=w.reads / steps, naive_reads_per_token=w.naive_misses / steps,
            values=values)
        return self.verdict

    def _lru_bookkeeping(self, w: Window, misses: int) -> float:
        """LRU's bookkeeping over the window's layer steps with `misses` misses: its fixed
        part is the policy in force's live one scaled by their calibrated ratio (the
        calibration runs quietly on warm CPU caches; live, between layers that compute,
        every policy's layer step costs more, LRU's too)."""
        live = self.policy_step_s.get(w.policy, 0.0)
        calibrated_policy = self._calibrated_step.get(w.policy, 0.0)
        if w.policy == "lru" or calibrated_policy <= 0 or "lru" not in self._calibrated_step:
            fixed = self.policy_step_s.get("lru", 0.0)
        else:
            fixed = live * self._calibrated_step["lru"] / calibrated_policy
        return fixed * w.layer_steps + self.miss_bookkeeping_s * misses

    # ----------------------------------------------------------------- deciding
    def close_window(self, w: Window) -> list[Decision]:
        """Value the window and decide; returns the changes to apply (maybe none)."""
        verdict = self.value(w)
        per_token = w.wall_s / max(1, w.steps)
        tolerance = TOLERANCE * per_token
        decisions: list[Decision] = []
        probing = any(st.probing for st in self.states.values())
        if w.policy != self._policy_seen:
            self._policy_seen, self._policy_age = w.policy, 0
        self._policy_age += 1
        for name in MECHANISMS:
            if name not in self.managed:
                continue
            if name in ("idle_prefetch", "early_hints") and not self.states["prefetch"].on:
                continue                 # part of prefetch; judged only while prefetch runs
            if name == "lrfu" and self.states["policy"].on:
                continue                 # the fallback; judged only while the policy is off
            s = self.states[name]
            v = verdict.values.get(name)
            if s.on and name in POLICY_MECHANISMS and self._policy_age <= WARMUP_WINDOWS:
                continue                 # a policy just in force: its statistics are empty
            if s.on and v is not None:
                s.net, s.saved, s.cost = (self._smooth(s.net, v["net"]), self._smooth(s.saved, v["saved"]),
                                          self._smooth(s.cost, v["cost"]))
                big_loss = s.net < -FAST_LOSS * per_token
                s.judged += 1
                if s.probing:
                    s.probing -= 1
                    if s.probing == 0 or big_loss:
                        if s.net >= -tolerance:
                            s.probing, s.backoff = 0, BACKOFF_START
                        else:
                            s.probing = 0
                            s.backoff = min(BACKOFF_MAX, 2 * s.backoff)
                            decisions.append(self._turn(name, False, "probe did not pay", per_token))
                    continue
                s.below = s.below + 1 if s.net < -tolerance else 0
                first = s.judged == 1 and name not in POLICY_MECHANISMS
                if s.below >= PATIENCE or big_loss or (s.below and first):
                    decisions.append(self._turn(name, False, "costs more than it saves", per_token))
            elif not s.on:
                s.off_for += 1
                if s.off_for >= s.backoff and not probing:
                    decisions.append(self._turn(name, True, "probe"))
                    s.probing = PROBE_WINDOWS
                    probing = True
        return decisions

    def _turn(self, name: str, on: bool, reason: str, per_token: float = 0.0) -> Decision:
        s = self.states[name]
        s.on, s.below, s.off_for, s.decisions = on, 0, 0, s.decisions + 1
        if on:
            s.net = s.saved = s.cost = None          # judge the probe on its own windows
        elif s.net is not None and per_token > 0:
            # Probing again costs its windows at this loss — PROBE_WINDOWS, and for a
            # policy the WARMUP_WINDOWS before it is judged as well: keep that expected
            # cost at PROBE_BUDGET of the time.
            loss = max(0.0, -s.net) / per_token
            windows = probe_windows(name)
            s.backoff = min(BACKOFF_MAX, max(s.backoff, math.ceil(windows * loss / PROBE_BUDGET)))
        return Decision(name, on, reason, s.net)

    def set_states(self, states: dict[str, bool], backoffs: dict[str, int] | None = None) -> None:
        """Start from states learned in an earlier session (managed mechanisms only): on
        or off, and the back-off (windows) an off one waits before its first probe here —
        a mechanism that did not pay then is not probed at once again (clipped to
        [BACKOFF_START, BACKOFF_MAX])."""
        for name, on in states.items():
            if name in self.managed:
                self.states[name].on = bool(on)
        for name, windows in (backoffs or {}).items():
            if name in self.managed:
                self.states[name].backoff = min(BACKOFF_MAX, max(BACKOFF_START, int(windows)))

    def backoffs(self) -> dict[str, int]:
        """{managed mechanism: its back-off in windows} (saved for the next session)."""
        return {name: self.states[name].backoff for name in MECHANISMS if name in self.managed}

    def report(self) -> dict:
        """JSON-ready: each mechanism's state and smoothed values, the latest verdict."""
        return {"mechanisms": {name: {"on": s.on, "managed": name in self.managed,
                                      "net_s_per_token": s.net, "saved_s_per_token": s.saved,
                                      "cost_s_per_token": s.cost, "decisions": s.decisions,
                                      "probing": s.probing > 0, "backoff_windows": s.backoff}
                               for name, s in self.states.items()},
                "policy": self.policy, "policy_step_s": dict(self.policy_step_s),
                "miss_bookkeeping_s": self.miss_bookkeeping_s,
                "latest": self.verdict.to_dict()}
