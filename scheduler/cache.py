"""The expert cache's slot policy: which expert sits in which slot, and what to evict.

Conventions (the whole module):
  L = len(moe_layers) MoE layers, E = num_experts, K = top_k. `layer` arguments are model
  layer ids (entries of `moe_layers`). `token` is the decode step, passed in (time is in
  tokens; nothing here reads a clock), non-decreasing.
  Slots are ints in [0, total_slots). The daemon owns the memory: slot s is its s-th
  buffer, each sized for the largest expert, living as long as the cache. This object
  only says which (layer, expert) a slot holds and when it may be reused.

Tiers. *Pinned* slots (pinned_slots of them, shared by all layers) hold the pin set
(`set_pins`) and are never evicted by traffic or prefetch. *Staging* slots (staging_slots,
shared by all layers; 0 turns the tier off) hold prefetched guesses: a guess read there
evicts nobody's expert, and when a step uses it, it moves into its layer's dynamic tier
in place of the policy's victim (no read, no copy: the two slots swap tiers) — the
eviction a demand miss would have made. A guess never used is simply dropped, so a wrong
guess costs a read and never a resident. *Dynamic* slots belong to one layer each —
(total_slots - pinned_slots - staging_slots) split evenly, the first layers taking the
remainder, at least K per layer — and are evicted by the layer's policy
(scheduler/eviction.py). Slots change tiers only by swapping (`set_pins`, promotion of a
used guess), so the per-layer dynamic count never changes.

Slot states. FREE; LOADING: reserved for a read in flight — never handed out to another
expert, never evicted, until `loaded` (-> READY) or `failed` (-> FREE); READY. Each
slot also has a user count: slots returned by `request` are in use until `release`, and
an in-use slot is never evicted.

Phases. Each demand lookup is counted under the phase the caller names: "prefill" (a
prompt chunk) or "decode" (one new token per sequence); the totals are their sums.

Guarantee: a demand `request` succeeds whenever the layer has enough dynamic slots that
are FREE or READY and not in use. Without a staging tier, prefetches never hold more than
(dynamic slots of the layer - K) slots LOADING, so K dynamic slots always remain for
demand; with one, prefetches never hold dynamic slots at all.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from scheduler.eviction import EvictionPolicy, PolicyFactory, policy_factory

OUTCOME_HIT = "hit"            # READY: use it
OUTCOME_INFLIGHT = "inflight"  # LOADING (prefetch or pin load): wait for that read
OUTCOME_MISS = "miss"          # slot reserved LOADING: the caller issues the read

PHASE_PREFILL, PHASE_DECODE = "prefill", "decode"
PHASES = (PHASE_PREFILL, PHASE_DECODE)


class SlotState(IntEnum):
    FREE = 0
    LOADING = 1
    READY = 2


class Tier(IntEnum):
    PINNED = 0
    DYNAMIC = 1
    STAGING = 2


class CacheBudgetError(ValueError):
    """The slot budget cannot hold top_k experts per MoE layer (message gives the minimum)."""


class CacheFullError(RuntimeError):
    """A demand request needs more slots than the layer has FREE or evictable."""


@dataclass(frozen=True)
class Access:
    """One expert of a demand request: its slot and what the caller must do with it."""
    expert: int
    slot: int
    outcome: str   # OUTCOME_HIT | OUTCOME_INFLIGHT | OUTCOME_MISS


@dataclass(frozen=True)
class PinLoad:
    """A read to issue for the pinned tier: `layer`'s `expert` into `slot`; then loaded/failed."""
    slot: int
    layer: int
    expert: int


@dataclass(frozen=True)
class CacheSnapshot:
    """Counters and occupancy at one instant; per-layer tuples are in moe_layers order.

    hits: needed experts found READY. prefetch_hits: found LOADING (a prefetch or pin read
    already in flight). misses: needed experts that had to be read on demand. Each is the
    sum over PHASES of the matching `*_by_phase[phase]` tuple.
    evictions_dynamic: experts evicted from the layer's dynamic slots (traffic or
    prefetch). evictions_pinned: pinned experts dropped from the pin set and freed.
    prefetches_wasted: prefetched experts evicted or failed before any use;
    prefetches_unused: prefetched experts resident now, not used yet (the issue's
    "wasted" is the sum of the two). prefetches_wasted_bytes: the `expert_bytes` of the
    wasted ones (0 when the cache was given no sizes). resident_staging: guesses held in
    the staging tier (READY or LOADING), per layer.
    """
    policy: str
    moe_layers: tuple[int, ...]
    pinned_slots: int
    dynamic_slots: tuple[int, ...]
    hits: tuple[int, ...]
    prefetch_hits: tuple[int, ...]
    misses: tuple[int, ...]
    evictions_dynamic: tuple[int, ...]
    evictions_pinned: tuple[int, ...]
    resident_dynamic: tuple[int, ...]
    resident_pinned: tuple[int, ...]
    loading: tuple[int, ...]
    prefetches_issued: tuple[int, ...]
    prefetches_used: tuple[int, ...]
    prefetches_wasted: tuple[int, ...]
    prefetches_unused: tuple[int, ...]
    hits_by_phase: dict[str, tuple[int, ...]]
    prefetch_hits_by_phase: dict[str, tuple[int, ...]]
    misses_by_phase: dict[str, tuple[int, ...]]
    prefetches_wasted_bytes: tuple[int, ...]
    staging_slots: int = 0
    resident_staging: tuple[int, ...] = ()

    @property
    def lookups(self) -> int:
        return sum(self.hits) + sum(self.prefetch_hits) + sum(self.misses)

    @property
    def hit_rate(self) -> float:
        """READY hits over all lookups (0.0 before the first lookup)."""
        return sum(self.hits) / self.lookups if self.lookups else 0.0


class ExpertCache:
    """Slot bookkeeping and eviction for the expert cache (policy only, no buffers).

    moe_layers: the model's MoE layer ids. num_experts: routed experts per layer.
    top_k: experts per token per layer. total_slots: the byte budget in slots.
    pinned_slots: slots of the pinned tier (global). staging_slots: slots of the staging
    tier for prefetched guesses (global; 0: prefetches take dynamic slots). policy: a name of
    scheduler.eviction.POLICIES or "default", or a factory (layer_index, capacity) ->
    EvictionPolicy (offline evaluation, e.g. Belady). expert_bytes: optional [L][E]
    bytes read per expert (its aligned read length), used only to count wasted prefetch
    bytes.
    Raises CacheBudgetError when total_slots < top_k * L (the message gives that minimum)
    or pinned_slots + staging_slots leave fewer than top_k dynamic slots per layer;
    ValueError on other bad arguments.
    """

    def __init__(self, moe_layers: Sequence[int], num_experts: int, top_k: int, total_slots: int,
                 pinned_slots: int = 0, policy: str | PolicyFactory = "default",
                 expert_bytes: Sequence[Sequence[int]] | None = None, staging_slots: int = 0):
        moe_layers = [int(x) for x in moe_layers]
        if not moe_layers or len(set(moe_layers)) != len(moe_layers):
            raise ValueError(f"moe_layers must be non-empty and distinct, got {moe_layers}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
        if pinned_slots < 0:
            raise ValueError(f"pinned_slots must be >= 0, got {pinned_slots}")
        if staging_slots < 0:
            raise ValueError(f"staging_slots must be >= 0, got {staging_slots}")
        n_layers = len(moe_layers)
        minimum = top_k * n_layers
        if total_slots < minimum:
            raise CacheBudgetError(f"expert cache of {total_slots} slots is below the minimum of {minimum} "
                                   f"(top_k {top_k} x {n_layers} MoE layers)")
        per_layer, extra = divmod(total_slots - pinned_slots - staging_slots, n_layers)
        if per_layer < top_k:
            raise CacheBudgetError(f"{pinned_slots} pinned and {staging_slots} staging slots leave {per_layer} "
                                   f"dynamic slots per layer; at least top_k={top_k} are needed, so "
                                   f"pinned_slots + staging_slots <= {total_slots - minimum}")
        self.moe_layers = tuple(moe_layers)
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.total_slots = int(total_slots)
        self.pinned_slots = int(pinned_slots)
        self.staging_slots = int(staging_slots)
        self._index = {layer: i for i, layer in enumerate(moe_layers)}
        self._dyn_count = [per_layer + (1 if i < extra else 0) for i in range(n_layers)]

        if isinstance(policy, str):
            self.policy_name = policy
            factory = policy_factory(policy, num_experts)
        else:
            self.policy_name = getattr(policy, "name", "custom")
            factory = policy
        self._policies: list[EvictionPolicy] = [factory(i, n) for i, n in enumerate(self._dyn_count)]
        self._held_transitions: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # for a policy without

        # Per-slot state. Initial layout: pinned tier, staging tier, each layer's dynamic slots.
        n = self.total_slots
        self._state = [SlotState.FREE] * n
        self._tier = ([Tier.PINNED] * pinned_slots + [Tier.STAGING] * staging_slots
                      + [Tier.DYNAMIC] * (n - pinned_slots - staging_slots))
        self._owner = [-1] * n                          # layer index of a dynamic slot
        self._key: list[tuple[int, int] | None] = [None] * n   # (layer_index, expert) held
        self._users = [0] * n
        self._prefetched = [False] * n                  # holds a prefetch not yet used
        self._prefetch_loading = [False] * n            # dynamic, LOADING for a prefetch
        self._where: dict[tuple[int, int], int] = {}    # (layer_index, expert) -> slot
        self._used = [0] * n                            # when the slot's expert was last used or admitted
        self._uses = 0                                  # ... counted in uses (strictly increasing)
        self._pin_slots = set(range(pinned_slots))
        self._free_pin = set(range(pinned_slots))
        self._stage_slots = set(range(pinned_slots, pinned_slots + staging_slots))
        self._free_stage = set(self._stage_slots)
        # A staged guess: (token it was made at, its score, stale: its layer's step passed
        # without using it). Recycled stale first, then oldest, then least likely.
        self._guess: dict[int, tuple[int, float, bool]] = {}
        self._dyn_slots: list[set[int]] = []
        start = pinned_slots + staging_slots
        for i, count in enumerate(self._dyn_count):
            slots = set(range(start, start + count))
            for s in slots:
                self._owner[s] = i
            self._dyn_slots.append(slots)
            start += count
        self._free_dyn = [set(s) for s in self._dyn_slots]
        self._prefetch_inflight = [0] * n_layers
        self._pins: set[tuple[int, int]] = set()
        self._now = 0

        zeros = lambda: [0] * n_layers  # noqa: E731
        self._hits = {p: zeros() for p in PHASES}
        self._prefetch_hits = {p: zeros() for p in PHASES}
        self._misses = {p: zeros() for p in PHASES}
        if expert_bytes is not None and (len(expert_bytes) != n_layers
                                         or any(len(row) != num_experts for row in expert_bytes)):
            raise ValueError(f"expert_bytes must be [{n_layers}][{num_experts}]")
        self._expert_bytes = expert_bytes
        self._prefetches_wasted_bytes = zeros()
        self._evictions_dynamic, self._evictions_pinned = zeros(), zeros()
        self._prefetches_issued, self._prefetches_used, self._prefetches_wasted = zeros(), zeros(), zeros()

    # -- demand ------------------------------------------------------------------------
    def request(self, layer: int, experts: Sequence[int], token: int,
                phase: str = PHASE_DECODE) -> list[Access]:
        """Slots for the experts one step of `layer` needs now, in the order given.

        experts: distinct expert ids (top_k of them for one token; a prefill chunk may
        pass the union of its tokens' experts). Every returned slot is in use (never
        evicted) until `release(layer, experts)`. For each "miss" a slot was reserved
        LOADING: the caller reads the expert into it, then calls `loaded` or `failed`.
        phase: PHASE_PREFILL or PHASE_DECODE, the step's kind (counted per phase).
        Raises CacheFullError — before changing anything — when the misses outnumber the
        layer's dynamic slots that are FREE or READY and not in use (split the chunk);
        KeyError for an unknown layer; ValueError for bad or repeated expert ids or an
        unknown phase.
        """
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        li = self._layer_index(layer)
        experts = self._check_experts(experts, distinct=True)
        self._now = max(self._now, token)
        misses = [e for e in experts if (li, e) not in self._where]
        if misses:
            wanted = set(experts)
            available = len(self._free_dyn[li]) + sum(
                1 for s in self._dyn_slots[li]
                if self._state[s] == SlotState.READY and self._users[s] == 0 and self._key[s][1] not in wanted)
            if len(misses) > available:
                raise CacheFullError(f"layer {layer}: {len(misses)} experts to read but only {available} of "
                                     f"{self._dyn_count[li]} dynamic slots are free or evictable "
                                     "(the others are being read or in use)")
        policy = self._policies[li]
        policy.step(token, experts)
        slot_of: dict[int, tuple[int, str]] = {}
        staged: list[int] = []                # guesses used now: they join the dynamic tier
        for e in experts:                     # resident ones first: pin them before evicting
            s = self._where.get((li, e))
            if s is None:
                continue
            self._users[s] += 1
            self._touch(s)
            if self._state[s] == SlotState.READY:
                slot_of[e] = (s, OUTCOME_HIT)
                self._hits[phase][li] += 1
            else:
                slot_of[e] = (s, OUTCOME_INFLIGHT)
                self._prefetch_hits[phase][li] += 1
            if self._prefetched[s]:
                self._prefetched[s] = False
                self._prefetches_used[li] += 1
            if self._tier[s] == Tier.DYNAMIC:
                policy.hit(e, token)
            elif self._tier[s] == Tier.STAGING:
                staged.append(e)
        for e in misses:
            s = self._take_dynamic_slot(li, token, incoming=e)
            self._reserve(s, li, e, users=1, prefetch=False)
            policy.admit(e, token, demand=True)
            slot_of[e] = (s, OUTCOME_MISS)
            self._misses[phase][li] += 1
        for e in staged:
            self._promote(li, e, token)
        if self._guess:
            self._mark_stale(li)
        return [Access(e, *slot_of[e]) for e in experts]

    def release(self, layer: int, experts: Sequence[int]) -> None:
        """End the use of `experts` begun by `request` (their slots become evictable).

        Experts no longer resident (their read failed) are skipped. Raises ValueError when
        a resident expert is not in use (release without request).
        """
        li = self._layer_index(layer)
        for e in self._check_experts(experts, distinct=True):
            s = self._where.get((li, e))
            if s is None:
                continue
            if self._users[s] == 0:
                raise ValueError(f"layer {layer} expert {e} (slot {s}) is released but not in use")
            self._users[s] -= 1

    # -- reads -------------------------------------------------------------------------
    def loaded(self, slot: int) -> None:
        """The read into `slot` completed: LOADING -> READY. ValueError if not LOADING."""
        self._check_loading(slot)
        self._state[slot] = SlotState.READY
        self._clear_prefetch_loading(slot)

    def failed(self, slot: int) -> None:
        """The read into `slot` failed: the slot becomes FREE; nothing else changes.

        The expert is no longer resident (a pinned one leaves the pin set until the next
        `set_pins`); a prefetch that failed unused counts as wasted. ValueError if the
        slot is not LOADING.
        """
        self._check_loading(slot)
        li, e = self._key[slot]
        if self._prefetched[slot]:
            self._waste(li, e)
        self._clear_prefetch_loading(slot)
        if self._tier[slot] == Tier.DYNAMIC:
            self._policies[li].drop(e)
        elif self._tier[slot] == Tier.PINNED:
            self._pins.discard((li, e))
        self._free(slot)

    # -- prefetch ----------------------------------------------------------------------
    def prefetch(self, layer: int, expert: int, token: int, score: float) -> int | None:
        """Reserve a slot for a prefetch read of `layer`'s `expert`, or None.

        score: the prefetcher's estimate that the expert is needed (probability of use,
        0..1, the scale of EvictionPolicy.value). None when the expert is resident or in
        flight. With a staging tier the slot is a staging slot: a FREE one, else a READY
        guess nobody uses that is stale (its layer's step passed without it) or, failing
        that, less likely than `score` — the stale first, then the oldest, then the least
        likely; None when there is none. Without one it is a dynamic slot of `layer`:
        None when the layer already has (dynamic slots - top_k) prefetches in flight, or
        when there is no FREE slot and the policy's victim — never pinned, in use or
        LOADING — has a value above `score`. On success the slot is LOADING: the caller
        reads the expert, then calls `loaded` or `failed`.
        """
        li = self._layer_index(layer)
        (expert,) = self._check_experts([expert], distinct=True)
        self._now = max(self._now, token)
        if (li, expert) in self._where:
            return None
        if self.staging_slots:
            s = self._take_staging_slot(score)
            if s is None:
                return None
            self._reserve(s, li, expert, users=0, prefetch=True)
            self._guess[s] = (token, float(score), False)
            self._prefetches_issued[li] += 1
            return s
        if self._prefetch_inflight[li] >= self._dyn_count[li] - self.top_k:
            return None
        policy = self._policies[li]
        if not self._free_dyn[li]:
            victim = policy.victim(token, self._evictable(li), incoming=expert)
            if victim is None or policy.value(victim, token) > score:
                return None
        s = self._take_dynamic_slot(li, token, incoming=expert)
        self._reserve(s, li, expert, users=0, prefetch=True)
        policy.admit(expert, token, demand=False, score=score)
        self._prefetches_issued[li] += 1
        return s

    def warm(self, layer: int, expert: int, token: int) -> int | None:
        """Reserve a FREE dynamic slot of `layer` for a warm-start read of `expert` (what an
        earlier session used most), or None: no FREE slot (nothing is evicted for it) or
        the expert is resident or in flight. The slot is LOADING: the caller reads the
        expert, then calls `loaded` or `failed`. It joins the layer's policy as an
        admission that is not a use."""
        li = self._layer_index(layer)
        (expert,) = self._check_experts([expert], distinct=True)
        if (li, expert) in self._where or not self._free_dyn[li]:
            return None
        self._now = max(self._now, token)
        s = self._take_dynamic_slot(li, token, incoming=expert)
        self._reserve(s, li, expert, users=0, prefetch=False)
        self._policies[li].admit(expert, token, demand=False)
        return s

    # -- pins --------------------------------------------------------------------------
    def set_pins(self, pins: Iterable[tuple[int, int]]) -> list[PinLoad]:
        """Make the pinned tier hold `pins` ((layer id, expert) pairs); returns reads to issue.

        1. A pinned expert no longer in `pins` is demoted to its layer's dynamic tier when
           that layer has a FREE dynamic slot (no read); else it is freed — or, while in
           use or being read, demoted in place of the layer's policy victim. If neither is
           possible it stays until a later call.
        2. A new pin resident in a dynamic or staging slot moves to the pinned tier without
           a read (slot tiers are swapped); the others get a FREE pinned slot, LOADING, and a
           PinLoad the caller must read and then report with `loaded` / `failed`.
        Pins that find no pinned slot this time are left out; `pins` tells what is held.
        Raises ValueError for more pins than pinned_slots or bad ids; KeyError for an
        unknown layer.
        """
        target = {(self._layer_index(layer), e) for layer, e in pins}
        for _, e in target:
            self._check_experts([e], distinct=True)
        if len(target) > self.pinned_slots:
            raise ValueError(f"{len(target)} pins exceed the {self.pinned_slots} pinned slots")
        now = self._now
        for s in sorted(self._pin_slots):
            key = self._key[s]
            if key is None or key in target:
                continue
            li, e = key
            self._pins.discard(key)
            busy = self._users[s] > 0 or self._state[s] == SlotState.LOADING
            if not self._free_dyn[li] and busy:
                victim = self._policies[li].victim(now, self._evictable(li), incoming=e)
                if victim is not None:
                    self._evict(self._where[(li, victim)])
            if self._free_dyn[li]:
                self._swap_tiers(s, min(self._free_dyn[li]))    # s joins the dynamic tier
                self._policies[li].admit(e, now, demand=False)
            elif not busy:
                self._evictions_pinned[li] += 1
                if self._prefetched[s]:
                    self._waste(li, e)
                self._free(s)
        loads = []
        for key in sorted(target - self._pins):
            li, e = key
            s = self._where.get(key)
            if s is not None and self._tier[s] == Tier.PINNED:
                self._pins.add(key)
                continue
            if not self._free_pin:
                continue
            p = min(self._free_pin)
            if s is not None:                     # resident in a dynamic or staging slot: no read
                if self._tier[s] == Tier.DYNAMIC:
                    self._policies[li].drop(e)
                else:
                    self._guess.pop(s, None)
                self._swap_tiers(p, s)
            else:
                self._reserve(p, li, e, users=0, prefetch=False)
                loads.append(PinLoad(p, self.moe_layers[li], e))
            self._pins.add(key)
        return loads

    # -- policy ------------------------------------------------------------------------
    def set_policy(self, policy: str) -> None:
        """Switch every layer's dynamic tier to `policy` (a name of POLICIES or "default").

        Residents stay where they are; the new policy learns them least valuable first
        (by the old policy's value), so LRU, say, starts with the old policy's victims at
        its old end. Raises ValueError for an unknown name.
        """
        factory = policy_factory(policy, self.num_experts)
        now = self._now
        new = [factory(i, n) for i, n in enumerate(self._dyn_count)]
        for li, old in enumerate(self._policies):
            residents = [self._key[s][1] for s in self._dyn_slots[li] if self._key[s] is not None]
            ranked = sorted(residents, key=lambda e, o=old: (o.value(e, now), e))
            for e in ranked:
                new[li].admit(e, now, demand=True)
        transitions = self.transitions()
        self._policies = new
        self.policy_name = policy
        self.seed_transitions(transitions)

    def seed_transitions(self, transitions: Sequence[tuple[np.ndarray, np.ndarray] | None],
                         as_counts: bool = False) -> bool:
        """Give each layer's policy an earlier session's next-step statistics (one (T [E, E],
        N [E]) or None per layer, as `transitions` returns them). Policies that do not
        predict (all but predictive) keep them to hand on. as_counts: the policy takes them
        as its own counts, not as a prior to weigh (a shadow replaying the running cache).
        Returns whether the current policy uses them. Raises ValueError for a wrong layer
        count or shapes."""
        if len(transitions) != len(self._policies):
            raise ValueError(f"{len(transitions)} layers of transitions for {len(self._policies)} MoE layers")
        used = False
        for li, prior in enumerate(transitions):
            if prior is None:
                continue
            policy = self._policies[li]
            if hasattr(policy, "seed_prior"):
                (policy.seed_counts if as_counts else policy.seed_prior)(*prior)
                used = True
            else:
                self._held_transitions[li] = prior
        return used

    def transitions(self, layers: Iterable[int] | None = None) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """Per layer (of the layer indices `layers`, default all), what its policy learned of
        which expert follows which (predictive's `transitions`), or what was seeded and
        held, or None."""
        chosen = range(len(self._policies)) if layers is None else layers
        return [self._policies[li].transitions() if hasattr(self._policies[li], "transitions")
                else self._held_transitions.get(li) for li in chosen]

    def prior_weights(self) -> list[float | None]:
        """Per layer, the weight its policy gives an earlier session's next-step
        statistics now (0..1), or None (no prior, or a policy that does not predict)."""
        return [p.prior_weight() if hasattr(p, "prior_weight") else None for p in self._policies]

    def forget_transitions(self) -> None:
        """Drop every layer's learned and seeded next-step statistics."""
        self._held_transitions.clear()
        for p in self._policies:
            if hasattr(p, "forget_transitions"):
                p.forget_transitions()

    # -- tiers -------------------------------------------------------------------------
    def set_tiers(self, pinned_slots: int, staging_slots: int,
                  dynamic_slots: Sequence[int] | None = None) -> None:
        """Re-divide the slots between the tiers, keeping what each tier still has room for.

        pinned_slots / staging_slots: the new sizes of the global tiers. dynamic_slots:
        the new dynamic size of each layer (moe_layers order; default the rest split
        evenly, the first layers taking the remainder, as at construction), each >= top_k,
        summing to total_slots - pinned_slots - staging_slots.
        Residents keep their slots (no read, no copy): a slot only changes tier. A layer
        whose dynamic tier shrinks evicts its policy's victims (counted as evictions);
        staging keeps its freshest guesses, the others are dropped (unused: wasted); the
        pinned tier keeps the pin set, and a pinned-tier slot that holds no pin any more
        joins its layer's dynamic tier as a resident. Call it between steps: raises
        ValueError when a slot is being read or in use, when the pin set does not fit the
        new pinned tier (shrink it with `set_pins` first), or for sizes that leave a layer
        fewer than top_k dynamic slots; CacheBudgetError like the constructor.
        """
        n_layers = len(self.moe_layers)
        if pinned_slots < 0 or staging_slots < 0:
            raise ValueError(f"tier sizes must be >= 0, got pinned {pinned_slots}, staging {staging_slots}")
        rest = self.total_slots - pinned_slots - staging_slots
        if dynamic_slots is None:
            per_layer, extra = divmod(rest, n_layers)
            counts = [per_layer + (1 if i < extra else 0) for i in range(n_layers)]
        else:
            counts = [int(c) for c in dynamic_slots]
            if len(counts) != n_layers or sum(counts) != rest:
                raise ValueError(f"dynamic_slots must give {n_layers} layers {rest} slots in all, got {counts}")
        if min(counts) < self.top_k:
            raise CacheBudgetError(f"{pinned_slots} pinned and {staging_slots} staging slots leave a layer "
                                   f"{min(counts)} dynamic slots; at least top_k={self.top_k} are needed")
        if any(st == SlotState.LOADING for st in self._state) or any(self._users):
            raise ValueError("set_tiers needs every read finished and every slot released")
        if len(self._pins) > pinned_slots:
            raise ValueError(f"{len(self._pins)} pins do not fit {pinned_slots} pinned slots; "
                             "shrink the pin set first")
        now = self._now
        # What each group keeps: pins; the freshest guesses; each layer's best residents.
        keep_pin = [self._where[key] for key in sorted(self._pins)]
        for s in sorted(self._pin_slots):                   # a pinned slot holding no pin
            key = self._key[s]
            if key is not None and key not in self._pins:
                self._tier[s], self._owner[s] = Tier.DYNAMIC, key[0]
                self._dyn_slots[key[0]].add(s)
                self._policies[key[0]].admit(key[1], now, demand=False)
        guesses = sorted((s for s in self._stage_slots if self._key[s] is not None),
                         key=lambda s: (self._guess.get(s, (0, 0.0, True))[2],
                                        -self._guess.get(s, (0, 0.0, True))[0], s))
        for s in guesses[staging_slots:]:
            li, e = self._key[s]
            if self._prefetched[s]:
                self._waste(li, e)
            self._free(s)
        keep_stage = guesses[:staging_slots]
        keep_dyn: list[list[int]] = []
        for li in range(n_layers):
            residents = {self._key[s][1]: s for s in self._dyn_slots[li] if self._key[s] is not None}
            while len(residents) > counts[li]:
                victim = self._policies[li].victim(now, lambda e, r=residents: e in r)
                self._evict(residents.pop(victim))
            keep_dyn.append(sorted(residents.values()))
        # Relabel: kept slots stay in their group, FREE slots fill the groups' remaining room.
        free = sorted(s for s in range(self.total_slots) if self._key[s] is None)
        self._pin_slots, self._stage_slots = set(keep_pin), set(keep_stage)
        self._free_pin = set(free[:pinned_slots - len(keep_pin)])
        free = free[pinned_slots - len(keep_pin):]
        self._free_stage = set(free[:staging_slots - len(keep_stage)])
        free = free[staging_slots - len(keep_stage):]
        self._pin_slots |= self._free_pin
        self._stage_slots |= self._free_stage
        for s in self._pin_slots:
            self._tier[s], self._owner[s] = Tier.PINNED, -1
        for s in self._stage_slots:
            self._tier[s], self._owner[s] = Tier.STAGING, -1
        self._dyn_slots, self._free_dyn = [], []
        for li in range(n_layers):
            room = counts[li] - len(keep_dyn[li])
            mine, free = free[:room], free[room:]
            self._dyn_slots.append(set(keep_dyn[li]) | set(mine))
            self._free_dyn.append(set(mine))
            for s in self._dyn_slots[li]:
                self._tier[s], self._owner[s] = Tier.DYNAMIC, li
            if counts[li] != self._dyn_count[li]:
                self._policies[li].resize(counts[li])
        assert not free
        self._guess = {s: g for s, g in self._guess.items() if s in self._stage_slots}
        self._dyn_count = counts
        self.pinned_slots, self.staging_slots = int(pinned_slots), int(staging_slots)

    @property
    def pins(self) -> frozenset[tuple[int, int]]:
        """The pins held now (resident or loading), as (layer id, expert)."""
        return frozenset((self.moe_layers[li], e) for li, e in self._pins)

    # -- inspection --------------------------------------------------------------------
    def slot_of(self, layer: int, expert: int) -> int | None:
        """The slot holding (or loading) `layer`'s `expert`, or None."""
        return self._where.get((self._layer_index(layer), expert))

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def tier(self, slot: int) -> Tier:
        return self._tier[slot]

    def users(self, slot: int) -> int:
        return self._users[slot]

    def held(self, slot: int) -> tuple[int, int] | None:
        """(layer id, expert) held by `slot`, or None when FREE."""
        key = self._key[slot]
        return None if key is None else (self.moe_layers[key[0]], key[1])

    def value(self, layer: int, expert: int, token: int) -> float | None:
        """The layer policy's value of a dynamically cached expert (None when not there).

        Same scale as `prefetch`'s score: a prefetch only evicts a victim whose value is
        <= its score.
        """
        li = self._layer_index(layer)
        s = self._where.get((li, expert))
        if s is None or self._tier[s] != Tier.DYNAMIC:
            return None
        return self._policies[li].value(expert, token)

    def totals(self) -> tuple[int, int]:
        """(hits + prefetch_hits, misses) over all layers: the cheap part of `snapshot`."""
        return (sum(map(sum, self._hits.values())) + sum(map(sum, self._prefetch_hits.values())),
                sum(map(sum, self._misses.values())))

    def loading_dynamic_slots(self, layer: int) -> list[int]:
        """`layer`'s dynamic slots under a read and not in use: the ones a `request` that
        raised CacheFullError can have once those reads land (`loaded` / `failed`)."""
        li = self._layer_index(layer)
        return sorted(s for s in self._dyn_slots[li]
                      if self._state[s] == SlotState.LOADING and self._users[s] == 0)

    def dynamic_slots(self, layer: int) -> int:
        return self._dyn_count[self._layer_index(layer)]

    def working_set(self, layer: int) -> list[int]:
        """The experts `layer`'s dynamic tier holds (resident or being read), the most
        recently used (or admitted, for one never used since) first."""
        li = self._layer_index(layer)
        held = [s for s in self._dyn_slots[li] if self._key[s] is not None]
        return [self._key[s][1] for s in sorted(held, key=lambda s: -self._used[s])]

    def snapshot(self) -> CacheSnapshot:
        """The counters and per-tier occupancy now (a plain, immutable copy)."""
        n_layers = len(self.moe_layers)
        res_dyn, res_pin, res_stage, loading, unused = ([0] * n_layers for _ in range(5))
        by_tier = {Tier.DYNAMIC: res_dyn, Tier.PINNED: res_pin, Tier.STAGING: res_stage}
        for (li, _), s in self._where.items():
            by_tier[self._tier[s]][li] += 1
            loading[li] += self._state[s] == SlotState.LOADING
            unused[li] += self._prefetched[s]
        by_phase = lambda counts: {p: tuple(counts[p]) for p in PHASES}  # noqa: E731
        total = lambda counts: tuple(map(sum, zip(*counts.values())))  # noqa: E731
        return CacheSnapshot(
            policy=self.policy_name, moe_layers=self.moe_layers, pinned_slots=self.pinned_slots,
            dynamic_slots=tuple(self._dyn_count), hits=total(self._hits),
            prefetch_hits=total(self._prefetch_hits), misses=total(self._misses),
            evictions_dynamic=tuple(self._evictions_dynamic), evictions_pinned=tuple(self._evictions_pinned),
            resident_dynamic=tuple(res_dyn), resident_pinned=tuple(res_pin), loading=tuple(loading),
            prefetches_issued=tuple(self._prefetches_issued), prefetches_used=tuple(self._prefetches_used),
            prefetches_wasted=tuple(self._prefetches_wasted), prefetches_unused=tuple(unused),
            hits_by_phase=by_phase(self._hits), prefetch_hits_by_phase=by_phase(self._prefetch_hits),
            misses_by_phase=by_phase(self._misses),
            prefetches_wasted_bytes=tuple(self._prefetches_wasted_bytes),
            staging_slots=self.staging_slots, resident_staging=tuple(res_stage))

    # -- internals ---------------------------------------------------------------------
    def _layer_index(self, layer: int) -> int:
        try:
            return self._index[layer]
        except KeyError:
            raise KeyError(f"layer {layer} is not a MoE layer {list(self.moe_layers)}") from None

    def _check_experts(self, experts: Sequence[int], distinct: bool) -> list[int]:
        ids = [int(e) for e in experts]
        bad = [e for e in ids if not 0 <= e < self.num_experts]
        if bad:
            raise ValueError(f"expert ids {bad} outside [0, {self.num_experts})")
        if distinct and len(set(ids)) != len(ids):
            raise ValueError(f"expert ids must be distinct, got {ids}")
        return ids

    def _check_loading(self, slot: int) -> None:
        if not 0 <= slot < self.total_slots or self._state[slot] != SlotState.LOADING:
            state = self._state[slot].name if 0 <= slot < self.total_slots else "out of range"
            raise ValueError(f"slot {slot} has no read in flight ({state})")

    def _evictable(self, li: int):
        def evictable(expert: int) -> bool:
            s = self._where[(li, expert)]
            return self._state[s] == SlotState.READY and self._users[s] == 0
        return evictable

    def _take_dynamic_slot(self, li: int, token: int, incoming: int) -> int:
        """A FREE dynamic slot of layer li, evicting the policy's victim if needed."""
        if not self._free_dyn[li]:
            victim = self._policies[li].victim(token, self._evictable(li), incoming=incoming)
            if victim is None:
                raise CacheFullError(f"layer {self.moe_layers[li]}: no dynamic slot is free or evictable")
            self._evict(self._where[(li, victim)])
        s = min(self._free_dyn[li])
        self._free_dyn[li].discard(s)
        return s

    def _evict(self, slot: int) -> None:
        """Evict the READY, unused expert of dynamic `slot`; the slot becomes FREE."""
        li, e = self._key[slot]
        assert self._tier[slot] == Tier.DYNAMIC and self._state[slot] == SlotState.READY
        assert self._users[slot] == 0
        self._evictions_dynamic[li] += 1
        if self._prefetched[slot]:
            self._waste(li, e)
        self._policies[li].evict(e, self._now)
        self._free(slot)

    def _waste(self, li: int, expert: int) -> None:
        """A prefetched expert leaves (evicted, freed or failed) before any use."""
        self._prefetches_wasted[li] += 1
        if self._expert_bytes is not None:
            self._prefetches_wasted_bytes[li] += int(self._expert_bytes[li][expert])

    def _free(self, slot: int) -> None:
        del self._where[self._key[slot]]
        self._key[slot] = None
        self._state[slot] = SlotState.FREE
        self._users[slot] = 0
        self._prefetched[slot] = False
        self._guess.pop(slot, None)
        self._free_set(slot).add(slot)

    def _reserve(self, slot: int, li: int, expert: int, users: int, prefetch: bool) -> None:
        self._touch(slot)
        self._free_pin.discard(slot)
        self._free_stage.discard(slot)
        self._state[slot] = SlotState.LOADING
        self._key[slot] = (li, expert)
        self._where[(li, expert)] = slot
        self._users[slot] = users
        self._prefetched[slot] = prefetch
        if prefetch and self._tier[slot] == Tier.DYNAMIC:
            self._prefetch_loading[slot] = True
            self._prefetch_inflight[li] += 1

    def _touch(self, slot: int) -> None:
        """The slot's expert is used (or admitted) now: the most recent of the cache."""
        self._uses += 1
        self._used[slot] = self._uses

    def _clear_prefetch_loading(self, slot: int) -> None:
        if self._prefetch_loading[slot]:
            self._prefetch_loading[slot] = False
            self._prefetch_inflight[self._owner[slot]] -= 1

    def _members(self, slot: int) -> set[int]:
        """The slots of `slot`'s tier (of its layer, for a dynamic slot)."""
        tier = self._tier[slot]
        if tier == Tier.DYNAMIC:
            return self._dyn_slots[self._owner[slot]]
        return self._pin_slots if tier == Tier.PINNED else self._stage_slots

    def _free_set(self, slot: int) -> set[int]:
        """The FREE slots of `slot`'s tier (of its layer, for a dynamic slot)."""
        tier = self._tier[slot]
        if tier == Tier.DYNAMIC:
            return self._free_dyn[self._owner[slot]]
        return self._free_pin if tier == Tier.PINNED else self._free_stage

    def _swap_tiers(self, a: int, b: int) -> None:
        """Swap the tiers (and dynamic owners) of slots a and b.

        Contents, states and users stay with the slots (no read, no copy); a FREE slot
        stays FREE in its new tier. A dynamic slot's prefetch in flight stops counting
        against its layer's prefetch limit.
        """
        self._clear_prefetch_loading(a)
        self._clear_prefetch_loading(b)
        members_a, members_b = self._members(a), self._members(b)
        free_a, free_b = self._free_set(a), self._free_set(b)
        a_free, b_free = a in free_a, b in free_b
        for members, free, slot in ((members_a, free_a, a), (members_b, free_b, b)):
            members.discard(slot)
            free.discard(slot)
        self._tier[a], self._tier[b] = self._tier[b], self._tier[a]
        self._owner[a], self._owner[b] = self._owner[b], self._owner[a]
        members_b.add(a)
        members_a.add(b)
        if a_free:
            free_b.add(a)
        if b_free:
            free_a.add(b)

    def _take_staging_slot(self, score: float) -> int | None:
        """A FREE staging slot, else one freed by recycling a READY guess nobody uses: a
        stale one, or one less likely than `score`; stale first, then oldest, then least
        likely. None when there is none."""
        if self._free_stage:
            s = min(self._free_stage)
            self._free_stage.discard(s)
            return s
        best, best_key = None, None
        for s, (token, guess_score, stale) in self._guess.items():
            if self._state[s] != SlotState.READY or self._users[s] or not (stale or guess_score < score):
                continue
            key = (not stale, token, guess_score, s)
            if best_key is None or key < best_key:
                best, best_key = s, key
        if best is None:
            return None
        li, e = self._key[best]
        if self._prefetched[best]:
            self._waste(li, e)
        self._free(best)
        self._free_stage.discard(best)
        return best

    def _promote(self, li: int, expert: int, token: int) -> None:
        """A staged guess of layer li is used now: it takes the place of one of the layer's
        dynamic slots — a FREE one, else the policy's victim, evicted as a demand miss
        would have evicted it. With no dynamic slot free or evictable it stays staged."""
        s = self._where[(li, expert)]
        if not self._free_dyn[li]:
            victim = self._policies[li].victim(token, self._evictable(li), incoming=expert)
            if victim is None:
                return
            self._evict(self._where[(li, victim)])
        self._guess.pop(s, None)
        self._swap_tiers(s, min(self._free_dyn[li]))
        self._policies[li].admit(expert, token, demand=True)

    def _mark_stale(self, li: int) -> None:
        """Layer li's step took what it needed: its staged guesses left unused are stale."""
        for s, (token, score, stale) in self._guess.items():
            if not stale and self._key[s][0] == li and not self._users[s]:
                self._guess[s] = (token, score, True)
