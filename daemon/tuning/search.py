"""The tuner's search on a loaded model: A/B windows one knob at a time, output checked.

`scheduler.tuner` decides; this module measures and applies. `check_tokens` runs a fixed
check prompt greedily; a candidate that changes those tokens is a bug: the tuner rejects
it and an error is logged (`check_candidates`). `tune` runs the search to the end in the
foreground (`moed tune`); `daemon.tuning.live` feeds the same tuner from live traffic.
`replay_cache_split` chooses the cache budget and pinned share by replaying routing.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from daemon.store.streaming import minimum_cache_bytes
from daemon.tuning.knobs import LiveKnobs, snap_to
from daemon.tuning.workload import Workload
from ext.models.model import Model
from scheduler.tuner import NOISE_PAIRS, CacheChoice, Knob, OnlineTuner, choose_cache_split
from telemetry.logs import get_logger

log = get_logger("tuning")

WINDOW_STEPS = 16
CHECK_TOKENS = 16
PIN_FRACTIONS = (0.0, 0.125, 0.25, 0.375, 0.5)   # of all slots, as scheduler.replay counts them


def check_tokens(model: Model, prompt: list[int], n: int = CHECK_TOKENS) -> list[int]:
    """Greedy tokens of the check prompt (a fresh sequence; prompt and n cut to fit the
    model's context). Its expert use is not counted as usage: pins follow real traffic."""
    context = model.config.max_position_embeddings
    prompt = prompt[: max(1, context // 2)]
    n = max(1, min(n, context - len(prompt) - 1))
    provider = model.experts
    observing = getattr(provider, "observe_usage", None)
    if observing is not None:
        provider.observe_usage = False
    try:
        seq = model.new_sequence(capacity=len(prompt) + n + 1)
        logits = model.forward(seq, prompt)
        out = []
        for _ in range(n):
            out.append(int(np.argmax(logits[-1])))
            if len(out) < n:
                logits = model.forward(seq, [out[-1]])
        return out
    finally:
        if observing is not None:
            provider.observe_usage = observing

def check_candidates(model: Model, tuner: OnlineTuner, check_prompt: list[int],
                     reference: list[int], checked: set[tuple[str, Any]]) -> None:
    """Run the check prompt under each candidate not checked yet (once each): one that
    changes its tokens from `reference` is a bug — logged as an error and rejected —
    and the next candidate is checked, until one passes or the search ends."""
    live = LiveKnobs(model)
    while not tuner.done:
        candidate = tuner.candidate()
        if candidate is None or candidate in checked:
            return
        checked.add(candidate)
        live.apply({**tuner.incumbent, candidate[0]: candidate[1]})
        got = check_tokens(model, check_prompt)
        if got == reference:
            return
        log.error("tuner_candidate_changed_output", knob=candidate[0], value=candidate[1],
                  tokens=got, expected_tokens=reference,
                  effect="rejected: placement must never change output, this is a bug")
        tuner.reject("changed the tokens of the check prompt")

def tune(model: Model, knobs: list[Knob], workload: Workload, check_prompt: list[int], *,
         window_steps: int = WINDOW_STEPS, pairs: int = 4, min_gain: float = 0.03,
         max_rounds: int = 3, progress: Callable[[str], None] | None = None,
         proposals: list[tuple[str, Any]] = (), noise_pairs: int = NOISE_PAIRS) -> OnlineTuner:
    """Run the A/B tuner to the end on `workload`; the model is left at the winners.

    noise_pairs A-vs-A pairs of `window_steps`-step windows come first; the trials' windows
    are then as many times longer as that noise needs (scheduler.tuner.window_multiplier)."""
    live = LiveKnobs(model)
    start = live.current()
    start = {k.name: snap_to(k, start[k.name]) for k in knobs}
    live.apply(start)
    reference = check_tokens(model, check_prompt)
    tuner = OnlineTuner(knobs, start, pairs=pairs, min_gain=min_gain, max_rounds=max_rounds,
                        proposals=proposals, noise_pairs=noise_pairs)
    checked: set[tuple[str, Any]] = set()
    while True:
        if not tuner.calibrating:
            check_candidates(model, tuner, check_prompt, reference, checked)
        if tuner.done:
            break
        trial = tuner.trial
        live.apply(tuner.settings())
        calibrating = tuner.calibrating
        tuner.observe(workload.window(window_steps * tuner.window_multiplier), batch_size=1)
        if progress and calibrating and not tuner.calibrating:
            progress(f"A-vs-A noise {100 * tuner.noise:.1f} % per pair of {window_steps}-step "
                     f"windows: windows of {window_steps * tuner.window_multiplier} steps "
                     f"resolve a {100 * min_gain:.0f} % effect")
        if progress and trial is not None and trial.outcome is not None:
            progress(f"{trial.knob} {trial.a} -> {trial.b}: {trial.outcome} "
                     f"(gains {', '.join(f'{100 * g:+.1f} %' for g in trial.gains)})")
    live.apply(tuner.incumbent)
    return tuner

def replay_cache_split(session, tokens: list[list[list[int]]],
                       budget_bytes: int) -> tuple[dict[str, Any], CacheChoice]:
    """The cache budget and pin share for `session` chosen by replaying recorded routing
    (scheduler.tuner.choose_cache_split, against the share in use now), as the
    {"cache_bytes", "pin_fraction"} settings of ExpertSession.rebuild, and the choice.
    budget_bytes: the most the cache may use (configured or planned)."""
    provider, model = session.provider, session.model
    config = model.config
    n_layers = len(provider.moe_layers)
    slot = provider.slot_bytes
    max_slots = min(budget_bytes // slot // n_layers, config.num_experts)
    minimum = minimum_cache_bytes(model.layout, config) // slot
    all_slots = max_slots * n_layers
    current = int((all_slots - minimum) * session.options.pin_fraction) / all_slots
    choice = choose_cache_split(tokens, config.num_experts, config.top_k, max_slots,
                                PIN_FRACTIONS, slot, current_fraction=current)
    total = choice.slots_per_layer * n_layers
    kept_budget = choice.slots_per_layer == max_slots       # nothing to give back
    return ({"cache_bytes": budget_bytes if kept_budget else total * slot,
             "pin_fraction": (session.options.pin_fraction if choice.pin_fraction == current
                              else replay_fraction_to_streaming(choice.pin_fraction, total, minimum))},
            choice)

def replay_fraction_to_streaming(fraction: float, total_slots: int, minimum_slots: int) -> float:
    """scheduler.replay's pin fraction (of all slots) as StreamingOptions.pin_fraction
    (of the slots above the minimum): the share whose int(spare x share) pins as many."""
    spare = total_slots - minimum_slots
    if spare <= 0:
        return 0.0
    pinned = min(round(fraction * total_slots), spare)
    share = pinned / spare
    while int(spare * share) < pinned:          # 13 / 23 * 23 is 12.999...: one slot short
        share = float(np.nextafter(share, 2.0))
    return min(1.0, share)
