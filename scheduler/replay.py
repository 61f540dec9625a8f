"""Replay a recorded expert-routing trace through the expert cache's own policy objects.

Trace format (JSON Lines, ../shared/traces/README.md): one line per generated token,
`{"tok": n, "layers": [[top_k expert ids], ... one list per MoE layer]}`. The trace's
layer lists are numbered 0..L-1 here (they are MoE layers only).

Protocol (issue 3, "Evaluation on real routing"):
  Phase 1 (tokens before warm_tokens W; default half the trace): nothing is cached or
  counted; `UsageStats` observes, as a previous session would have. At its end the pin
  set is chosen with `select_pins(usage.counts(), 1, pinned_slots)`, where pinned_slots =
  round(pin_fraction * slots_per_layer * L), capped so that top_k dynamic slots per layer
  remain.
  Phase 2 (the rest): every policy gets a fresh `ExpertCache` of slots_per_layer * L slots.
  moed's policies (every name but "lru" and "belady") have the learned pins loaded before
  counting starts; "lru" and "belady" start empty with all slots dynamic. For each token
  and layer the cache is driven exactly as the engine drives it — request, loaded for
  each miss, release — so a token's top_k experts are resident together and nothing
  bypasses the cache. "belady" is Belady's MIN (scheduler.eviction.BeladyPolicy) under the
  same rules. Hit rate = hits / (tokens * layers * top_k) over phase 2.

Measured on kimi_linear_decode/trace_kimi_300.jsonl (W = 150; hit rates in %; moed's
policies with DEFAULT_PIN_FRACTION of the slots pinned):

    slots/layer        lru   slru    arc   lrfu  predictive(default)  belady
    12 (1.5 x top_k)  37.54  41.58  41.66  42.14  42.65                50.11
    16 (2 x top_k)    43.84  46.19  46.13  47.11  47.97                57.50
    24 (3 x top_k)    51.27  52.77  53.20  53.88  54.93                65.72

With W = 75 and W = 225 at 16 slots the default leads LRU by 4.2 and 4.6 points. Without
pins it scores 42.46 / 47.56 / 54.26: pins add about half a point here, and cost points
on a synthetic trace whose popularity flips at W — they are learned, not assumed.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scheduler.cache import OUTCOME_HIT, ExpertCache
from scheduler.eviction import BeladyPolicy
from scheduler.pins import pins_to_layer_ids, select_pins
from scheduler.usage import UsageStats

# Chosen on the Kimi trace: 0.25 was best or within 0.4 points of the best of
# {0, 0.125, 0.25, 0.375, 0.5} at every size and warm-up tried (module docstring).
DEFAULT_PIN_FRACTION = 0.25
# Half-life of the usage statistics while learning phase 1, in tokens.
DEFAULT_USAGE_HALF_LIFE = 1000.0
BASELINES = ("lru", "belady")   # start empty, no pins


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
                 pin_fraction: float = DEFAULT_PIN_FRACTION, num_experts: int | None = None,
                 usage_half_life_tokens: float = DEFAULT_USAGE_HALF_LIFE) -> dict[str, Any]:
    """Hit rates of `policies` on a routing trace (see the module docstring for the rules).

    slots_per_layer: cache size, in expert slots per MoE layer (>= top_k).
    policies: names of scheduler.eviction.POLICIES, "default", "lru", "belady".
    warm_tokens: length of phase 1 (default len(trace) // 2). top_k: ids per layer
    (default: the trace's). pin_fraction: share of all slots given to learned pins for
    moed's policies. num_experts: default max id + 1.
    Returns {"policies": {name: {"hit_rate", "hits", "lookups", "pinned_slots"}},
    "slots_per_layer", "warm_tokens", "tokens" (phase-2 tokens), "trace_tokens",
    "layers", "top_k", "num_experts", "pin_fraction"}.
    Raises TraceFormatError for a bad trace, ValueError for warm_tokens outside
    [0, len(trace)), an unknown policy or bad sizes, CacheBudgetError when
    slots_per_layer < top_k.
    """
    return replay_tokens(load_trace(path, top_k), slots_per_layer, policies, warm_tokens,
                         pin_fraction, num_experts, usage_half_life_tokens)


def replay_tokens(trace: list[list[list[int]]], slots_per_layer: int, policies: Sequence[str],
                  warm_tokens: int | None = None, pin_fraction: float = DEFAULT_PIN_FRACTION,
                  num_experts: int | None = None,
                  usage_half_life_tokens: float = DEFAULT_USAGE_HALF_LIFE) -> dict[str, Any]:
    """`replay_trace` on routing already in memory: trace[token][moe layer] -> top_k ids
    (every token the same number of layers and ids; see `load_trace` for the checks a
    file gets). Same arguments, result and errors as `replay_trace`."""
    if not trace or not trace[0] or not trace[0][0]:
        raise ValueError("the routing record is empty")
    n_tokens, n_layers, k = len(trace), len(trace[0]), len(trace[0][0])
    warm = n_tokens // 2 if warm_tokens is None else int(warm_tokens)
    if not 0 <= warm < n_tokens:
        raise ValueError(f"warm_tokens must be in [0, {n_tokens}), got {warm}")
    if not 0.0 <= pin_fraction < 1.0:
        raise ValueError(f"pin_fraction must be in [0, 1), got {pin_fraction}")
    max_id = max(e for layers in trace for ids in layers for e in ids)
    num_experts = max_id + 1 if num_experts is None else num_experts
    if max_id >= num_experts:
        raise ValueError(f"trace uses expert {max_id} but num_experts is {num_experts}")
    moe_layers = list(range(n_layers))
    slots_per_layer = min(slots_per_layer, num_experts)  # more slots than experts is waste
    total_slots = slots_per_layer * n_layers

    usage = UsageStats(moe_layers, num_experts, usage_half_life_tokens)
    for layers in trace[:warm]:                                   # phase 1: observe only
        for layer, ids in enumerate(layers):
            usage.observe(layer, ids)
        usage.advance(1)
    pinned_slots = min(int(round(pin_fraction * total_slots)), max(0, total_slots - k * n_layers))
    pins = pins_to_layer_ids(select_pins(usage.counts(), 1, pinned_slots), moe_layers)

    measured = trace[warm:]
    results: dict[str, dict[str, Any]] = {}
    for name in policies:
        if name == "belady":
            uses = [dict[int, list[int]]() for _ in range(n_layers)]
            for t, layers in enumerate(measured):
                for layer, ids in enumerate(layers):
                    for e in ids:
                        uses[layer].setdefault(e, []).append(t)
            factory = _belady_factory(uses)
            cache = ExpertCache(moe_layers, num_experts, k, total_slots, 0, policy=factory)
        elif name == "lru":
            cache = ExpertCache(moe_layers, num_experts, k, total_slots, 0, policy="lru")
        else:
            cache = ExpertCache(moe_layers, num_experts, k, total_slots, pinned_slots, policy=name)
            for load in cache.set_pins(pins):
                cache.loaded(load.slot)
        hits = _drive(cache, measured)
        lookups = len(measured) * n_layers * k
        results[name] = {"hit_rate": hits / lookups if lookups else 0.0, "hits": hits, "lookups": lookups,
                         "pinned_slots": cache.pinned_slots}
    return {"policies": results, "slots_per_layer": slots_per_layer, "warm_tokens": warm,
            "tokens": len(measured), "trace_tokens": n_tokens, "layers": n_layers, "top_k": k,
            "num_experts": num_experts, "pin_fraction": pin_fraction}


def simulate_hit_rate(trace: list[list[list[int]]], num_experts: int, slots_per_layer: int,
                      pin_fraction: float, policy: str = "default") -> float:
    """Phase-2 hit rate of moed's `policy` on in-memory routing (first half learns the
    pins, second half is counted), as `replay_tokens` computes it."""
    result = replay_tokens(trace, slots_per_layer, [policy], pin_fraction=pin_fraction,
                           num_experts=num_experts)
    return result["policies"][policy]["hit_rate"]


def _drive(cache: ExpertCache, tokens: list[list[list[int]]]) -> int:
    """Run tokens through the cache as the engine would (no compute); returns READY hits."""
    hits = 0
    for t, layers in enumerate(tokens):
        for layer, ids in enumerate(layers):
            for access in cache.request(layer, ids, token=t):
                if access.outcome == OUTCOME_HIT:
                    hits += 1
                else:
                    cache.loaded(access.slot)
            cache.release(layer, ids)
    return hits


def _belady_factory(uses: list[dict[int, list[int]]]):
    def factory(layer_index: int, capacity: int) -> BeladyPolicy:
        return BeladyPolicy(uses[layer_index])
    factory.name = "belady"
    return factory
