"""Replay a recorded expert-routing trace through the expert cache's own policy objects.

Trace format (JSON Lines, ../shared/traces/README.md; `moed serve --record-trace` and
`moed generate --record-trace` write it): one line per generated token,
`{"tok": n, "layers": [[top_k expert ids], ... one list per MoE layer]}` (other keys are
ignored). The trace's layer lists are numbered 0..L-1 here (they are MoE layers only).

Protocol (issue 3, "Evaluation on real routing"; issue 17, "Fair replay"): the tokens
before warm_tokens W (default half the trace) are phase 1, the rest phase 2; hit rate =
hits / (tokens x layers x top_k) over phase 2 only. Every policy gets an `ExpertCache`
of slots_per_layer x L slots, driven exactly as the engine drives it — request, loaded
for each miss, release — so a token's top_k experts are resident together. Two starts:
  warm  every cache (LRU's and Belady's too) runs through phase 1 uncounted, so all start
        phase 2 with the same warm-up;
  cold  every cache starts phase 2 empty; phase 1 is only observed, as a previous
        session would have been (moed's policies start from the next-step statistics a
        cache of theirs learned over phase 1, as the daemon's saved ones).
moed's own policies (`MOED_POLICIES`: default, predictive, lrfu) learn their pins as the
daemon does (scheduler.pinlearn.PinLearner, from the first token it sees: share 0 at
first, a share and set kept only when they win on the newest traffic); with `cold` the
learner has observed phase 1 and the cache starts phase 2 with its pins loaded. The
standard policies (lru, lfu, slru, arc, s3fifo) and belady (Belady's MIN,
scheduler.eviction.BeladyPolicy, the offline optimum) run without pins. A fixed
`pin_fraction` (a share of all slots, chosen from phase-1 usage) replaces the learning
for moed's policies (the cache-split replay of the tuner uses it). `reads` counts the
reads a policy made in phase 2: its misses plus pin loads.

Measured on kimi_linear_decode/trace_kimi_300.jsonl (W = 150; hit rates in %, warm
start, pins learned; `moed replay-trace` prints both starts):

    slots/layer        lru    lfu   slru    arc  s3fifo   lrfu  default  belady
    see tests/scheduler/test_trace_replay.py for the figures this code gives.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scheduler.cache import OUTCOME_HIT, ExpertCache
from scheduler.eviction import BeladyPolicy
from scheduler.pinlearn import PinLearner
from scheduler.pins import pins_to_layer_ids, select_pins
from scheduler.shadow import ShadowPolicyCache
from scheduler.usage import UsageStats

# The largest share of the slots above the minimum that the pin learner may pin (as the
# streaming cache's pin_fraction default).
DEFAULT_MAX_PIN_SHARE = 0.5
# Half-life of the usage statistics (the learner's long-term counts), in tokens.
DEFAULT_USAGE_HALF_LIFE = 1000.0
MOED_POLICIES = ("default", "predictive", "lrfu")   # learn pins; every other policy runs plain
STARTS = ("warm", "cold")


MAX_EXPERTS = 1 << 16  # ids at or above this are a corrupt trace, not a model


class TraceFormatError(ValueError):
    """A trace line that is not `{"tok": n, "layers": [[ids], ...]}` (message has the line)."""


def load_trace(path: str | Path, top_k: int | None = None) -> list[list[list[int]]]:
    """Read a JSON Lines routing trace: [tokens][layers][top_k] expert ids.

    top_k: the expected ids per layer (default: the first line's). Blank lines are
    skipped. Raises TraceFormatError naming the line for bad JSON, a missing "layers",
    a layer count that changes, a list of the wrong length or repeated / negative ids;
    and for an empty trace.
    """
    tokens: list[list[list[int]]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                layers = json.loads(line)["layers"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise TraceFormatError(f"{path}:{lineno}: not a trace line ({exc!r})") from None
            if not isinstance(layers, list) or not layers:
                raise TraceFormatError(f"{path}:{lineno}: 'layers' must be a non-empty list")
            if tokens and len(layers) != len(tokens[0]):
                raise TraceFormatError(f"{path}:{lineno}: {len(layers)} layers, earlier lines have {len(tokens[0])}")
            if top_k is None:
                top_k = len(layers[0]) if isinstance(layers[0], list) else 0
                if top_k < 1:
                    raise TraceFormatError(f"{path}:{lineno}: layer 0 lists no expert ids")
            for i, ids in enumerate(layers):
                ok = (isinstance(ids, list) and len(ids) == top_k and len(set(ids)) == top_k
                      and all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < MAX_EXPERTS
                              for e in ids))
                if not ok:
                    raise TraceFormatError(f"{path}:{lineno}: layer {i} must list {top_k} distinct expert ids "
                                           f"in [0, {MAX_EXPERTS}), got {ids!r}")
            tokens.append(layers)
    if not tokens:
        raise TraceFormatError(f"{path}: empty trace")
    return tokens


def replay_trace(path: str | Path, slots_per_layer: int, policies: Sequence[str],
                 warm_tokens: int | None = None, top_k: int | None = None,
                 pin_fraction: float | None = None, num_experts: int | None = None,
                 usage_half_life_tokens: float = DEFAULT_USAGE_HALF_LIFE,
                 start: str = "warm", max_pin_share: float = DEFAULT_MAX_PIN_SHARE) -> dict[str, Any]:
    """Hit rates of `policies` on a routing trace (see the module docstring for the rules).

    slots_per_layer: cache size, in expert slots per MoE layer (>= top_k).
    policies: names of scheduler.eviction.POLICIES, "default", "belady".
    warm_tokens: length of phase 1 (default len(trace) // 2). top_k: ids per layer
    (default: the trace's). pin_fraction: None (default) — moed's policies learn their
    pins; a number in [0, 1) — a fixed share of all slots pinned from phase-1 usage.
    num_experts: default max id + 1. start: "warm" or "cold". max_pin_share: the largest
    share of the slots above the minimum the learner may pin.
    Returns {"policies": {name: {"hit_rate", "hits", "lookups", "reads", "pinned_slots",
    ["pin_share", "pin_decisions"]}}, "start", "slots_per_layer", "warm_tokens", "tokens"
    (phase-2 tokens), "trace_tokens", "layers", "top_k", "num_experts", "pin_fraction"}.
    Raises TraceFormatError for a bad trace, ValueError for warm_tokens outside
    [0, len(trace)), an unknown policy or start or bad sizes, CacheBudgetError when
    slots_per_layer < top_k.
    """
    return replay_tokens(load_trace(path, top_k), slots_per_layer, policies, warm_tokens,
                         pin_fraction, num_experts, usage_half_life_tokens, start, max_pin_share)


def replay_tokens(trace: list[list[list[int]]], slots_per_layer: int, policies: Sequence[str],
                  warm_tokens: int | None = None, pin_fraction: float | None = None,
                  num_experts: int | None = None,
                  usage_half_life_tokens: float = DEFAULT_USAGE_HALF_LIFE,
                  start: str = "warm", max_pin_share: float = DEFAULT_MAX_PIN_SHARE) -> dict[str, Any]:
    """`replay_trace` on routing already in memory: trace[token][moe layer] -> top_k ids
    (every token the same number of layers and ids; see `load_trace` for the checks a
    file gets). Same arguments, result and errors as `replay_trace`."""
    if not trace or not trace[0] or not trace[0][0]:
        raise ValueError("the routing record is empty")
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, got {start!r}")
    n_tokens, n_layers, k = len(trace), len(trace[0]), len(trace[0][0])
    warm = n_tokens // 2 if warm_tokens is None else int(warm_tokens)
    if not 0 <= warm < n_tokens:
        raise ValueError(f"warm_tokens must be in [0, {n_tokens}), got {warm}")
    if pin_fraction is not None and not 0.0 <= pin_fraction < 1.0:
        raise ValueError(f"pin_fraction must be in [0, 1), got {pin_fraction}")
    max_id = max(e for layers in trace for ids in layers for e in ids)
    num_experts = max_id + 1 if num_experts is None else num_experts
    if max_id >= num_experts:
        raise ValueError(f"trace uses expert {max_id} but num_experts is {num_experts}")
    moe_layers = list(range(n_layers))
    slots_per_layer = min(slots_per_layer, num_experts)  # more slots than experts is waste
    total_slots = slots_per_layer * n_layers
    ExpertCache(moe_layers, num_experts, k, total_slots)   # CacheBudgetError before any work

    usage = UsageStats(moe_layers, num_experts, usage_half_life_tokens)
    for layers in trace[:warm]:                                   # phase 1, as observed
        for layer, ids in enumerate(layers):
            usage.observe(layer, ids)
        usage.advance(1)
    fixed_pins: frozenset = frozenset()
    fixed_slots = 0
    if pin_fraction is not None:
        fixed_slots = min(int(round(pin_fraction * total_slots)), max(0, total_slots - k * n_layers))
        fixed_pins = pins_to_layer_ids(select_pins(usage.counts(), 1, fixed_slots), moe_layers)

    results: dict[str, dict[str, Any]] = {}
    for name in policies:
        learner = None
        if name == "belady":
            uses = [dict[int, list[int]]() for _ in range(n_layers)]
            offset = 0 if start == "warm" else warm
            for t, layers in enumerate(trace[offset:]):
                for layer, ids in enumerate(layers):
                    for e in ids:
                        uses[layer].setdefault(e, []).append(t)
            cache = ExpertCache(moe_layers, num_experts, k, total_slots, 0, policy=_belady_factory(uses))
        elif name not in MOED_POLICIES:
            cache = ExpertCache(moe_layers, num_experts, k, total_slots, 0, policy=name)
        elif pin_fraction is not None:          # the pins are loaded where phase 2 starts
            cache = ExpertCache(moe_layers, num_experts, k, total_slots, fixed_slots, policy=name)
        else:
            cache = ExpertCache(moe_layers, num_experts, k, total_slots, 0, policy=name)
            # The check replays this policy (from its statistics so far), as the daemon's does.
            learner = PinLearner(n_layers, num_experts, k, total_slots, max_share=max_pin_share,
                                 check_shadow=lambda layers, caps, pins, c=cache, n=name: ShadowPolicyCache(
                                     layers, caps, num_experts, k, n, pins,
                                     transitions=c.transitions(layers)))
        run = _Run(cache, learner, UsageStats(moe_layers, num_experts, usage_half_life_tokens))
        if start == "warm":
            run.drive(trace[:warm], counted=False)
        elif learner is not None:
            run.observe_only(trace[:warm])
            # ... and the policy starts from the next-step statistics phase 1 taught it,
            # as a daemon's next session starts from the saved ones.
            previous = ExpertCache(moe_layers, num_experts, k, total_slots, 0, policy=name)
            _Run(previous, None, UsageStats(moe_layers, num_experts, usage_half_life_tokens)).drive(
                trace[:warm], counted=False)
            cache.seed_transitions(previous.transitions())
        if pin_fraction is not None and name in MOED_POLICIES:
            for load in cache.set_pins(fixed_pins):
                cache.loaded(load.slot)
        hits, reads = run.drive(trace[warm:], counted=True)
        lookups = (n_tokens - warm) * n_layers * k
        results[name] = {"hit_rate": hits / lookups if lookups else 0.0, "hits": hits,
                         "lookups": lookups, "reads": reads, "pinned_slots": cache.pinned_slots}
        if learner is not None:
            results[name].update(pin_share=learner.share, pin_decisions=learner.evaluations)
    return {"policies": results, "start": start, "slots_per_layer": slots_per_layer,
            "warm_tokens": warm, "tokens": n_tokens - warm, "trace_tokens": n_tokens,
            "layers": n_layers, "top_k": k, "num_experts": num_experts, "pin_fraction": pin_fraction}


def simulate_hit_rate(trace: list[list[list[int]]], num_experts: int, slots_per_layer: int,
                      pin_fraction: float, policy: str = "default") -> float:
    """Phase-2 hit rate of moed's `policy` on in-memory routing with a fixed share of all
    slots pinned from what the first half taught (cold start), as `replay_tokens`
    computes it."""
    result = replay_tokens(trace, slots_per_layer, [policy], pin_fraction=pin_fraction,
                           num_experts=num_experts, start="cold")
    return result["policies"][policy]["hit_rate"]


def summarise(results: dict[str, dict[str, Any]], policy: str = "default") -> dict[str, Any]:
    """`policy` against LRU and Belady in each start's results ({start: replay result}):
    its hit rate minus LRU's (points) and the share of the LRU-to-Belady gap it closes."""
    out = {}
    for start, result in results.items():
        rates = {name: r["hit_rate"] for name, r in result["policies"].items()}
        if not {policy, "lru", "belady"} <= set(rates):
            continue
        gap = rates["belady"] - rates["lru"]
        out[start] = {"over_lru_points": round(100 * (rates[policy] - rates["lru"]), 2),
                      "gap_closed": round((rates[policy] - rates["lru"]) / gap, 3) if gap > 0 else None}
    return out


class _Run:
    """One policy's cache driven through tokens as the engine drives it, with the pin
    learner (if any) fed and obeyed between tokens."""

    def __init__(self, cache: ExpertCache, learner: PinLearner | None, usage: UsageStats):
        self.cache, self.learner, self.usage = cache, learner, usage
        self.t = 0
        self.pin_loads = 0

    def observe_only(self, tokens: list[list[list[int]]]) -> None:
        """Phase 1 of a cold start: the learner and usage see it, no cache does."""
        for layers in tokens:
            self._learn(layers, apply=False)
        if self.learner is not None and self.learner.pins:
            self._apply(self.learner.pinned_slots_for(self.learner.share), self.learner.pins)

    def drive(self, tokens: list[list[list[int]]], counted: bool) -> tuple[int, int]:
        """(READY hits, reads) over `tokens`."""
        cache = self.cache
        hits = reads = 0
        loads_before = self.pin_loads
        for layers in tokens:
            for layer, ids in enumerate(layers):
                for access in cache.request(layer, ids, token=self.t):
                    if access.outcome == OUTCOME_HIT:
                        hits += 1
                    else:
                        cache.loaded(access.slot)
                        reads += 1
                cache.release(layer, ids)
            self._learn(layers, apply=True)
        reads += self.pin_loads - loads_before
        return (hits, reads) if counted else (0, 0)

    def _learn(self, layers: list[list[int]], apply: bool) -> None:
        self.t += 1
        if self.learner is None:
            return
        for layer, ids in enumerate(layers):
            self.usage.observe(layer, ids)
        self.usage.advance(1)
        self.learner.observe(layers)
        if self.learner.due():
            decision = self.learner.decide(self.usage.counts())
            if apply:
                self._apply(decision.pinned_slots, decision.pins)

    def _apply(self, pinned_slots: int, pins) -> None:
        """The pinned tier resized to `pinned_slots` and holding `pins` (layer = index)."""
        cache = self.cache
        keep = frozenset(p for p in cache.pins if p in pins)
        if len(keep) > pinned_slots:
            keep = frozenset(sorted(keep)[:pinned_slots])
        cache.set_pins(keep)
        cache.set_tiers(pinned_slots, cache.staging_slots)
        for load in cache.set_pins(pins):
            cache.loaded(load.slot)
            self.pin_loads += 1


def _belady_factory(uses: list[dict[int, list[int]]]):
    def factory(layer_index: int, capacity: int) -> BeladyPolicy:
        return BeladyPolicy(uses[layer_index])
    factory.name = "belady"
    return factory
