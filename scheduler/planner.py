"""Memory planner: how many bytes moed may use, and how they split between its parts.

Conventions (the whole module):
  Every size is a plain int in bytes. Nothing here reads the system: daemon/machine/memory.py
  reads /proc and the cgroup tree and hands the numbers in (docs/design.md "Memory planner",
  "Folders": scheduler/ is pure policy).

Two steps, each one function:
  available = available_bytes(MemAvailable, cgroup limits, configured cap)
      the tightest of MemAvailable; each cgroup's headroom
      limit - (usage - inactive_file), never below 0, for this process's cgroup and each
      ancestor; and the configured cap.
  plan = plan_memory(available, dense, runtime, KV per token, sequences, context, ...)
      base = dense + runtime + margin + the expert cache's floor (top_k slots per MoE layer,
      the floor of ExpertCache); the minimum to start is base + one sequence's KV at the
      floor context (CONTEXT_FLOOR_TOKENS, or the model's context if smaller). The context,
      then the sequences, are cut until their KV fits (unless the operator fixed them: then
      the plan refuses, naming the key and by how much to lower it) — a cut context's KV takes
      at most KV_SHARE of what is left above the floors; the prefix cache takes
      at most PREFIX_SHARE of what is left; the expert cache the rest, rounded down to
      whole slots and split into a pinned and a dynamic tier.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class MemoryPlanError(ValueError):
    """The model cannot run in the memory available; the message gives every number."""


@dataclass(frozen=True)
class CgroupLimit:
    """The memory limit and usage of one cgroup, as read from its files.

    path: the cgroup's directory (for messages; the planner does not read it).
    version: 1 or 2, the cgroup hierarchy it was read from.
    limit_bytes: the tighter of v2 memory.max / memory.high, or of v1
      memory.limit_in_bytes / hierarchical_memory_limit; None = no limit ("max" or >= 2**62).
    usage_bytes: v2 memory.current, v1 memory.usage_in_bytes; None = unknown (taken as 0).
    inactive_file_bytes: page cache the kernel reclaims before it OOM-kills — v2
      memory.stat inactive_file, v1 total_inactive_file; None = unknown (taken as 0).
    """

    path: str
    version: int
    limit_bytes: int | None
    usage_bytes: int | None = None
    inactive_file_bytes: int | None = None

    def headroom_bytes(self) -> int | None:
        """limit - (usage - inactive_file), never below 0; None when there is no limit.

        An unknown usage counts as 0 and unknown inactive_file as 0, so the limit is then
        still an upper bound on what this cgroup lets moed add.
        """
        if self.limit_bytes is None:
            return None
        usage = self.usage_bytes or 0
        reclaimable = min(self.inactive_file_bytes or 0, usage)
        return max(0, self.limit_bytes - (usage - reclaimable))


def available_bytes(mem_available: int | None, cgroup_limits: Iterable[CgroupLimit] = (),
                    configured_cap: int | None = None) -> int:
    """The bytes moed may still use: the tightest of all the bounds that are known.

    mem_available: /proc/meminfo MemAvailable in bytes; None = unknown.
    cgroup_limits: this process's cgroup and its ancestors; each contributes
      `CgroupLimit.headroom_bytes()` = limit - (usage - inactive_file), >= 0, when it has
      a limit.
    configured_cap: the operator's cap in bytes; None = no cap.

    Returns the minimum of those bounds (>= 0). Raises MemoryPlanError when none is known
    (no MemAvailable, no cgroup limit, no cap): moed will not guess.
    """
    bounds = [b for b in (mem_available, configured_cap) if b is not None]
    bounds += [h for h in (c.headroom_bytes() for c in cgroup_limits) if h is not None]
    if not bounds:
        raise MemoryPlanError("no memory bound is known: no MemAvailable, no cgroup limit "
                              "and no configured cap")
    return max(0, min(bounds))


CONTEXT_FLOOR_TOKENS = 2048     # the context a sequence keeps however tight memory is
CONTEXT_STEP_TOKENS = 256       # a cut context is a multiple of this (above the floor)
KV_SHARE = 0.5                  # a cut context: of the memory beyond the floors, the KV's share
PREFIX_SHARE = 0.25             # of the memory beyond the minimum, the most the prefix cache gets


@dataclass(frozen=True)
class MemoryPlan:
    """Where the available bytes go. All fields are bytes unless named *_slots, *_tokens or
    max_concurrent_sequences.

    kv_bytes = kv_bytes_per_token x context_tokens x max_concurrent_sequences.
    expert_cache_bytes = pinned_bytes + dynamic_bytes = total_slots x slot_bytes.
    total_slots and pinned_slots are what ExpertCache takes; prefix_cache_bytes is the
    prefix cache's capacity (at most what was asked for); minimum_bytes is what moed needs
    to start at all (one sequence at the floor context, no prefix cache, the expert
    cache's minimum).
    """

    available_bytes: int
    dense_bytes: int
    kv_bytes: int
    runtime_bytes: int
    margin_bytes: int
    slot_bytes: int
    min_dynamic_slots: int
    total_slots: int
    pinned_slots: int
    expert_cache_bytes: int
    pinned_bytes: int
    dynamic_bytes: int
    kv_bytes_per_token: int = 0
    max_concurrent_sequences: int = 1
    context_tokens: int = 0
    prefix_cache_bytes: int = 0
    minimum_bytes: int = 0


def _nonnegative(**values: int | float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def _minimum_levers(deficit: int, *, kv_bytes_per_token: int, floor: int, context_tokens: int,
                    sequences: int, runtime_bytes_per_context_token: int,
                    runtime_bytes_per_sequence: int) -> str:
    """The keys that lower the minimum to start, each with by how much, for a refusal
    `deficit` bytes short ("" when none does).

    The minimum counts the KV of one sequence at `floor` tokens and a runtime sized for
    `context_tokens` of context and `sequences` sequences: max_context_tokens t < floor
    saves kv_bytes_per_token x (floor - t) + runtime_bytes_per_context_token x
    (context_tokens - t); max_concurrent_sequences 1 saves runtime_bytes_per_sequence x
    (sequences - 1).
    """
    def context_saving(t: int) -> int:      # falls as t grows
        return (kv_bytes_per_token * max(0, floor - t)
                + runtime_bytes_per_context_token * (context_tokens - t))

    def enough(saved: int, short: str = " alone") -> str:
        return "enough" if saved >= deficit else f"{deficit - saved} B short{short}"

    levers = []
    context_best = context_saving(1)
    if context_best > 0:
        t, high = 0, context_tokens - 1       # the largest t that saves the deficit (0: none)
        while t < high:
            middle = (t + high + 1) // 2
            t, high = (middle, high) if context_saving(middle) >= deficit else (t, middle - 1)
        if t >= CONTEXT_STEP_TOKENS:
            t = t // CONTEXT_STEP_TOKENS * CONTEXT_STEP_TOKENS
        if t >= 1:
            levers.append(f"max_context_tokens {t} (the context counted: {floor} tokens) "
                          f"lowers it by {context_saving(t)} B, enough")
        else:
            levers.append(f"max_context_tokens lowers it by at most {context_best} B (at 1 "
                          f"token), {enough(context_best)}")
    sequences_saving = runtime_bytes_per_sequence * (sequences - 1)
    if sequences_saving > 0:
        levers.append(f"max_concurrent_sequences 1 (from {sequences}) lowers it by "
                      f"{sequences_saving} B, {enough(sequences_saving)}")
    if context_best and sequences_saving and max(context_best, sequences_saving) < deficit:
        both = context_best + sequences_saving
        levers.append(f"both together lower it by at most {both} B, {enough(both, '')}")
    return "; ".join(levers)


def plan_memory(available: int, *, dense_bytes: int, kv_bytes_per_token: int,
                max_concurrent_sequences: int, context_tokens: int, runtime_bytes: int,
                slot_bytes: int, min_dynamic_slots: int,
                min_context_tokens: int = CONTEXT_FLOOR_TOKENS, prefix_cache_bytes: int = 0,
                prefix_share: float = PREFIX_SHARE, all_experts_bytes: int | None = None,
                sequences_fixed: bool = False, context_fixed: bool = False,
                pin_fraction: float = 0.0, margin_bytes: int = 0,
                margin_fraction: float = 0.0, runtime_bytes_per_context_token: int = 0,
                runtime_bytes_per_sequence: int = 0) -> MemoryPlan:
    """Split `available` bytes between the dense weights, runtime, KV cache, prefix cache
    and expert cache.

    available: bytes moed may use (`available_bytes`).
    dense_bytes: resident weights (embeddings, attention, norms, routers, shared experts).
    kv_bytes_per_token: what one token adds to one sequence's KV cache (f32), bytes.
    max_concurrent_sequences: sequences decoded together (each holds its KV cache); the
      plan may lower it (never below 1) unless sequences_fixed.
    context_tokens: the context wanted per sequence (the model's, or less); the plan may
      cut it, down to floor = min(min_context_tokens, context_tokens), unless
      context_fixed.
    sequences_fixed, context_fixed: the operator set that number: the plan refuses (naming
      the key and by how much to lower it) rather than lower it.
    runtime_bytes: what the process adds besides the parts above (workspaces, logits,
      scores, libraries' allocations at load).
    slot_bytes: one expert-cache slot (the largest expert), > 0.
    min_dynamic_slots: top_k x MoE layers — ExpertCache's floor for the dynamic tier.
    prefix_cache_bytes: the prefix cache's configured capacity: a ceiling, never a reason
      to refuse.
    prefix_share: of the bytes beyond the minimum (dense + runtime + margin + KV + the
      expert cache's minimum), the most the prefix cache takes; the expert cache takes the
      rest. When all_experts_bytes (every expert in its slot) is given and the experts all
      fit, the prefix cache may also take what they leave over.
    pin_fraction: the share of slots for the pinned tier, in [0, 1]; it yields to the
      dynamic floor.
    margin_bytes, margin_fraction: a safety margin; margin = max(margin_bytes,
      floor(margin_fraction x available)).
    runtime_bytes_per_context_token, runtime_bytes_per_sequence: how much of runtime_bytes
      grows with each token of context_tokens and each of max_concurrent_sequences (for
      a refusal: by how much max_context_tokens and max_concurrent_sequences lower the
      minimum).

    Steps: base = dense + runtime + margin + min_dynamic_slots x slot; the minimum to start
      is base + the KV of one sequence at the floor. Cuts, in this order, until the KV fits
      beside base: the context (context_tokens itself when it fits whole) to the largest
      multiple of CONTEXT_STEP_TOKENS whose KV takes at most KV_SHARE of what the KV at
      the floor and base leave (the rest stays for the expert cache, which the floors
      alone would leave at its minimum), not below the floor; then the sequences, to as
      many as fit at the floor, not below 1. spare = available - base - KV; prefix = min(prefix_cache_bytes, prefix_share x spare, or
      what all experts leave); total_slots = (available - dense - runtime - margin - KV -
      prefix) // slot_bytes; pinned_slots = min(floor(total_slots x pin_fraction),
      total_slots - min_dynamic_slots); the rest are dynamic.

    Raises MemoryPlanError (a ValueError; the message names what to lower, by how much, and
    lists every number; "no key lowers that" only when none does) when the minimum to
    start does not fit, or a number the operator
    fixed would have to be lowered. ValueError on negative or out-of-range inputs.
    """
    _nonnegative(available=available, dense_bytes=dense_bytes,
                 kv_bytes_per_token=kv_bytes_per_token, runtime_bytes=runtime_bytes,
                 min_dynamic_slots=min_dynamic_slots, margin_bytes=margin_bytes,
                 margin_fraction=margin_fraction, prefix_cache_bytes=prefix_cache_bytes,
                 prefix_share=prefix_share,
                 runtime_bytes_per_context_token=runtime_bytes_per_context_token,
                 runtime_bytes_per_sequence=runtime_bytes_per_sequence)
    if slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
    if max_concurrent_sequences < 1 or context_tokens < 1 or min_context_tokens < 1:
        raise ValueError(f"max_concurrent_sequences, context_tokens and min_context_tokens must "
                         f"be >= 1, got {max_concurrent_sequences}, {context_tokens}, "
                         f"{min_context_tokens}")
    if not 0.0 <= pin_fraction <= 1.0:
        raise ValueError(f"pin_fraction must be in [0, 1], got {pin_fraction}")
    if margin_fraction >= 1.0 or prefix_share > 1.0:
        raise ValueError(f"margin_fraction must be < 1 and prefix_share <= 1, got "
                         f"{margin_fraction} and {prefix_share}")

    n = max_concurrent_sequences
    margin = max(margin_bytes, int(margin_fraction * available))
    experts_min = min_dynamic_slots * slot_bytes
    base = dense_bytes + runtime_bytes + margin + experts_min
    floor = min(min_context_tokens, context_tokens)
    minimum = base + kv_bytes_per_token * floor
    lowest = context_tokens if context_fixed else floor    # the context the cuts stop at
    one_sequence = kv_bytes_per_token * lowest
    needed = base + n * one_sequence
    numbers = (f"available {available} B; dense {dense_bytes} B + runtime {runtime_bytes} B "
               f"+ margin {margin} B + expert cache minimum {min_dynamic_slots} slots x "
               f"{slot_bytes} B = {experts_min} B + KV {kv_bytes_per_token} B/token x "
               f"{lowest} tokens x {n} sequences = {n * one_sequence} B = {needed} B; the "
               f"minimum to start, one sequence at {floor} tokens: {minimum} B; prefix cache "
               f"0 B (it takes only what is left)")
    if minimum > available:
        levers = _minimum_levers(minimum - available, kv_bytes_per_token=kv_bytes_per_token,
                                 floor=floor, context_tokens=context_tokens,
                                 sequences=max_concurrent_sequences,
                                 runtime_bytes_per_context_token=runtime_bytes_per_context_token,
                                 runtime_bytes_per_sequence=runtime_bytes_per_sequence)
        keys = (f"the keys that lower it: {levers}; prefix_cache_bytes does not (counted at "
                f"0 already); or" if levers else
                f"no key lowers that (max_concurrent_sequences 1, the context at {floor} "
                f"tokens and prefix_cache_bytes 0 are counted already):")
        raise MemoryPlanError(
            f"moed does not fit: it needs at least {minimum} B to start (one sequence at "
            f"{floor} tokens), {minimum - available} B more than available; {keys} give it "
            f"{minimum - available} B more memory or serve a smaller model ({numbers})")
    room = available - base
    fits = room // one_sequence if one_sequence else n
    if fits < n and (sequences_fixed or fits == 0):
        advice = []
        if sequences_fixed and fits >= 1:
            advice.append(f"lower max_concurrent_sequences by {n - fits}, from {n} to {fits} "
                          f"(each sequence holds {one_sequence} B)")
        if context_fixed:
            cut = room // (kv_bytes_per_token * n)
            cut = cut if cut < CONTEXT_STEP_TOKENS else cut // CONTEXT_STEP_TOKENS * CONTEXT_STEP_TOKENS
            if cut >= 1:
                advice.append(f"lower max_context_tokens by {context_tokens - cut}, from "
                              f"{context_tokens} to {cut}")
            else:
                advice.append(f"lower max_context_tokens from {context_tokens} to at most "
                              f"{room // kv_bytes_per_token} and max_concurrent_sequences to 1")
        raise MemoryPlanError(
            f"the KV cache of {n} sequences of {lowest} tokens does not fit: needs {needed} "
            f"B, {needed - available} B more than available; {' or '.join(advice)}, or give "
            f"moed {needed - available} B more memory; prefix_cache_bytes is not the cause "
            f"({numbers})")
    n = min(n, fits)
    if kv_bytes_per_token == 0 or room >= kv_bytes_per_token * context_tokens * n:
        context = context_tokens
    else:      # the KV above the floor gets at most KV_SHARE of what is above the minima
        at_lowest = kv_bytes_per_token * lowest * n
        fit = int(at_lowest + (room - at_lowest) * KV_SHARE) // (kv_bytes_per_token * n)
        context = max(lowest, min(context_tokens, fit // CONTEXT_STEP_TOKENS * CONTEXT_STEP_TOKENS))
    kv_bytes = kv_bytes_per_token * context * n
    spare = available - base - kv_bytes
    prefix_room = int(spare * prefix_share)
    if all_experts_bytes is not None:
        prefix_room = max(prefix_room, spare - max(0, all_experts_bytes - experts_min))
    prefix = min(prefix_cache_bytes, prefix_room)
    total_slots = (available - dense_bytes - runtime_bytes - margin - kv_bytes - prefix) // slot_bytes
    pinned_slots = min(int(total_slots * pin_fraction), total_slots - min_dynamic_slots)
    return MemoryPlan(
        available_bytes=available, dense_bytes=dense_bytes, kv_bytes=kv_bytes,
        runtime_bytes=runtime_bytes, margin_bytes=margin, slot_bytes=slot_bytes,
        min_dynamic_slots=min_dynamic_slots, total_slots=total_slots, pinned_slots=pinned_slots,
        expert_cache_bytes=total_slots * slot_bytes, pinned_bytes=pinned_slots * slot_bytes,
        dynamic_bytes=(total_slots - pinned_slots) * slot_bytes,
        kv_bytes_per_token=kv_bytes_per_token, max_concurrent_sequences=n,
        context_tokens=context, prefix_cache_bytes=prefix, minimum_bytes=minimum)


# ------------------------------------------------------------------- the live squeeze
@dataclass(frozen=True)
class SqueezePolicy:
    """When the expert cache gives memory back, and how fast it takes it again.

    low_water_bytes: below this much available memory the cache shrinks (by the deficit
      plus half the gap to high_water, so one step usually suffices).
    high_water_bytes: above this much it may grow, by at most grow_step_bytes per
      reading and only after calm_readings readings in a row without pressure.
    pressure_avg10: PSI "some avg10" (percent of time stalled on memory over 10 s) at or
      above which the cache shrinks by shrink_step_bytes even when availability looks fine.
    """

    low_water_bytes: int
    high_water_bytes: int
    grow_step_bytes: int
    shrink_step_bytes: int
    calm_readings: int = 3
    pressure_avg10: float = 10.0

    def __post_init__(self) -> None:
        _nonnegative(low_water_bytes=self.low_water_bytes, grow_step_bytes=self.grow_step_bytes,
                     shrink_step_bytes=self.shrink_step_bytes, calm_readings=self.calm_readings)
        if self.high_water_bytes < self.low_water_bytes:
            raise ValueError(f"high_water_bytes {self.high_water_bytes} is below "
                             f"low_water_bytes {self.low_water_bytes}")


LOW_WATER_FRACTION = 0.05        # of the room: the memory moed may use at most
LOW_WATER_FLOOR_BYTES = 16 << 20


def default_squeeze_policy(maximum_cache_bytes: int, room_bytes: int) -> SqueezePolicy:
    """Water marks relative to the room moed runs in — the tightest cgroup limit over
    it, else the host's MemTotal: low water 5 % of it (at least 16 MiB), high water twice
    that; grow by 1/16 of the configured budget per reading, shrink under pressure by 1/8.
    (A 640 MiB cgroup: 32 and 64 MiB; a 24 GiB host without a limit: 1.2 and 2.4 GiB.)"""
    low = max(LOW_WATER_FLOOR_BYTES, int(room_bytes * LOW_WATER_FRACTION))
    return SqueezePolicy(low_water_bytes=low, high_water_bytes=2 * low,
                         grow_step_bytes=max(1, maximum_cache_bytes // 16),
                         shrink_step_bytes=max(1, maximum_cache_bytes // 8))


class CacheSqueeze:
    """Decides the expert cache budget from one memory reading at a time.

    minimum_bytes / maximum_bytes: the cache's floor (top_k slots per MoE layer) and the
    configured budget; slot_bytes: budgets are whole slots. Pure: readings are passed in.
    """

    def __init__(self, policy: SqueezePolicy, *, minimum_bytes: int, maximum_bytes: int,
                 slot_bytes: int):
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
        if maximum_bytes < minimum_bytes:
            raise ValueError(f"maximum_bytes {maximum_bytes} is below minimum_bytes {minimum_bytes}")
        self.policy = policy
        self.minimum = minimum_bytes
        self.maximum = maximum_bytes
        self.slot = slot_bytes
        self.calm = 0
        self.last_available: int | None = None
        self.last_cut = 0     # bytes the last reading asked back (0: none), before clamping

    def target(self, current_bytes: int, available: int | None,
               pressure_avg10: float | None = None) -> int:
        """The budget to run with after this reading (== current_bytes: no change).

        available: bytes of memory that can still be had without taking page cache
        back from anyone — the tightest of MemAvailable and each cgroup's limit minus
        its usage net of page cache (None: unknown, no change). Page cache filling a
        cgroup is not pressure: the kernel takes it back first. pressure_avg10: PSI some
        avg10 in percent, or None where PSI does not exist.
        Shrinks only on real pressure: PSI at or above the policy's threshold, available
        below low water, or available falling — between the marks, by more than half
        their gap since the previous reading — by what was lost. Grows after
        calm_readings readings above high water without pressure. `last_cut` keeps the
        bytes a shrink asked for before rounding and the floor (0 when none): what a
        cache that gives way first (the prefix cache) may cover instead.
        """
        p = self.policy
        self.last_cut = 0
        if available is None:
            return current_bytes
        last, self.last_available = self.last_available, available
        pressured = pressure_avg10 is not None and pressure_avg10 >= p.pressure_avg10
        gap = p.high_water_bytes - p.low_water_bytes
        falling = (last is not None and available < p.high_water_bytes
                   and last - available > gap // 2)
        if available < p.low_water_bytes or pressured or falling:
            self.calm = 0
            cut = 0
            if available < p.low_water_bytes:
                cut = (p.low_water_bytes - available) + gap // 2
            elif falling:
                cut = last - available
            if pressured:
                cut = max(cut, p.shrink_step_bytes)
            self.last_cut = cut
            return self._clamp(current_bytes - max(cut, self.slot))
        if available > p.high_water_bytes and current_bytes < self.maximum:
            self.calm += 1
            if self.calm < p.calm_readings:
                return current_bytes
            grow = min(p.grow_step_bytes, available - p.high_water_bytes)
            grown = self._clamp(current_bytes + grow)
            return grown if grown > current_bytes else current_bytes
        self.calm = 0 if available <= p.high_water_bytes else self.calm
        return current_bytes

    def _clamp(self, budget: int) -> int:
        budget = max(self.minimum, min(self.maximum, budget))
        return max(self.minimum, budget // self.slot * self.slot)
