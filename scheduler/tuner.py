"""The self-tuner's decisions: one knob at a time, interleaved A/B, keep only clear wins.

Pure policy (docs/design.md, "Self-tuner"): the caller applies `OnlineTuner.settings()`, runs
one measurement window with them, and reports the window's cost with `observe`. The
cost is seconds per decode step per sequence (lower is better), and windows are compared
only at equal batch size: a window run at another batch size than the trial's first is
dropped and run again.

A trial compares the incumbent A with one candidate B (a neighbour of A's value on one
knob) over `pairs` interleaved pairs, their order alternating — A B, B A, A B, B A — so
neither arm always runs first and a steady drift (a cache warming up) cancels out
(windows of one arm never run in a block, A A B B). When the traffic keeps another batch
size for more than MAX_DROPPED_WINDOWS x pairs windows, the trial starts again there. B wins a trial when it is cheaper in every pair and the median of
the per-pair gains (cost_A - cost_B) / cost_A is at least `min_gain`. A win is confirmed
by a second trial of the same pair; only then is B kept. Otherwise A stays.

Search: coordinate descent. For each knob in order, step up while steps win; if the first
step up lost, step down while steps win. A round visits every knob; rounds repeat until
one keeps nothing or `max_rounds` is reached. Before it, `proposals` — values suggested
from elsewhere, such as the io-worker count the storage probe found best — are each tried
against the start by the same A/B rule, so a suggestion is kept only when it wins. A
candidate the caller refuses (`reject`, e.g. because it changed the tokens of the check
prompt) is skipped for the rest of the run.

Window length: a trial can only resolve an effect larger than the noise of one window.
With `noise_pairs`, the tuner first runs that many A-vs-A pairs (the start settings in
both arms), measures the noise of a pair's relative difference, and sets
`window_multiplier` (`window_multiplier()`) so that a MIN_GAIN effect is resolvable; the
caller lengthens its windows by it.

Cache budget and pinned share are not tuned here by A/B (a short window cannot warm a
cache); `choose_cache_split` picks them by replaying recorded routing.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.replay import simulate_hit_rate

PAIRS = 4
MIN_GAIN = 0.03
MAX_ROUNDS = 3
NOISE_PAIRS = 4           # A-vs-A pairs measured before the search (0: none)
MAX_WINDOW_MULTIPLIER = 16
MAX_DROPPED_WINDOWS = 2   # x pairs: then the trial restarts at the batch size now seen
ARM_A, ARM_B = "A", "B"


@dataclass(frozen=True)
class Knob:
    """One setting and its candidate values, in increasing order (e.g. threads 1..4)."""

    name: str
    values: tuple[Any, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError(f"knob {self.name!r} has no values")
        if len(set(self.values)) != len(self.values):
            raise ValueError(f"knob {self.name!r} repeats a value: {self.values}")


@dataclass
class Trial:
    """One A/B comparison (or its confirmation) of `knob` from `a` to `b`.

    costs_a / costs_b: window costs in seconds per step per sequence, pair i at index i.
    gains: per-pair (cost_A - cost_B) / cost_A. outcome: None while running, then
    "win" (kept after confirmation), "loss", "unconfirmed" or "rejected: <why>".
    """

    knob: str
    a: Any
    b: Any
    confirming: bool = False
    proposal: bool = False
    batch_size: int | None = None
    costs_a: list[float] = field(default_factory=list)
    costs_b: list[float] = field(default_factory=list)
    dropped_windows: int = 0
    outcome: str | None = None

    @property
    def gains(self) -> list[float]:
        return [(a - b) / a for a, b in zip(self.costs_a, self.costs_b)]

    def to_dict(self) -> dict:
        return {"knob": self.knob, "a": self.a, "b": self.b, "confirming": self.confirming,
                "proposal": self.proposal,
                "batch_size": self.batch_size, "costs_a": [round(c, 6) for c in self.costs_a],
                "costs_b": [round(c, 6) for c in self.costs_b],
                "gains": [round(g, 4) for g in self.gains], "dropped_windows": self.dropped_windows,
                "outcome": self.outcome}


def window_multiplier(noise: float, min_gain: float = MIN_GAIN,
                      maximum: int = MAX_WINDOW_MULTIPLIER) -> int:
    """How many times longer a window must be for a `min_gain` effect to be resolvable.

    noise: the root mean square of the relative differences (cost_a - cost_b) / cost_a
    of A-vs-A pairs — windows of the same settings — at the base window length. A gain
    of min_gain wins a pair when it exceeds that pair's noise; with per-pair noise at
    min_gain / 2 a real min_gain effect wins each pair with probability ~0.98 and all
    PAIRS with ~0.9. Noise of independent steps falls as 1 / sqrt(steps), so the window
    grows by (noise / (min_gain / 2)) ** 2, rounded up, between 1 and `maximum`.
    """
    target = min_gain / 2.0
    if not noise > target:
        return 1
    return int(min(maximum, math.ceil((noise / target) ** 2)))


def wins(gains: Sequence[float], min_gain: float = MIN_GAIN) -> bool:
    """B beats A: better in every pair, and the median gain is at least min_gain."""
    return bool(gains) and all(g > 0 for g in gains) and statistics.median(gains) >= min_gain


class OnlineTuner:
    """Coordinate-descent A/B tuner over `knobs` from the settings `start`.

    Raises ValueError when `start` lacks a knob or holds a value not among its candidates.
    """

    def __init__(self, knobs: Sequence[Knob], start: Mapping[str, Any], *, pairs: int = PAIRS,
                 min_gain: float = MIN_GAIN, max_rounds: int = MAX_ROUNDS,
                 proposals: Sequence[tuple[str, Any]] = (), noise_pairs: int = 0):
        if pairs < 1:
            raise ValueError(f"pairs must be >= 1, got {pairs}")
        for knob in knobs:
            if knob.name not in start:
                raise ValueError(f"start settings lack knob {knob.name!r}")
            if start[knob.name] not in knob.values:
                raise ValueError(f"start value {start[knob.name]!r} of knob {knob.name!r} is not "
                                 f"among its values {knob.values}")
        self.knobs = list(knobs)
        self.incumbent = dict(start)
        self.pairs = pairs
        self.min_gain = min_gain
        self.max_rounds = max_rounds
        self.trials: list[Trial] = []
        self.rejected: set[tuple[str, Any]] = set()
        self.rounds = 0                 # rounds completed
        self.trial: Trial | None = None
        self.done = False
        self._kept_this_round = False
        self._knob_index = 0
        self._direction = +1
        self._visit_start: Any = None   # the knob's value when this visit began
        # Values suggested from elsewhere (the storage probe's queue depth), each A/B-tested
        # against the start before the neighbour search: a suggestion is kept only if it wins.
        values = {k.name: k.values for k in self.knobs}
        self._proposals = [(k, v) for k, v in proposals
                           if k in values and v in values[k] and v != self.incumbent[k]]
        # A-vs-A first: `noise_pairs` pairs of windows at the start settings measure the
        # noise, which sets `window_multiplier` (the caller lengthens its windows by it).
        self.noise_pairs = noise_pairs
        self.noise_costs: list[float] = []
        self.noise: float | None = None
        self.window_multiplier = 1
        if noise_pairs:
            self.calibrating = True
        else:
            self.calibrating = False
            self._next_proposal_or_search()

    def _next_proposal_or_search(self) -> None:
        if self._proposals:
            knob, value = self._proposals.pop(0)
            if value != self.incumbent[knob]:
                self.trial = Trial(knob, self.incumbent[knob], value, proposal=True)
                return
            self._next_proposal_or_search()
            return
        self._visit_knob()

    # ----------------------------------------------------------------- the caller's API
    def settings(self) -> dict[str, Any]:
        """The settings to run the next window with."""
        if self.trial is None or self.calibrating:
            return dict(self.incumbent)
        return {**self.incumbent, self.trial.knob: self._arm_value()}

    @property
    def arm(self) -> str | None:
        """ARM_A or ARM_B for the next window; None when tuning is over. Pairs alternate
        their order, A B B A A B ..., so a steady drift (a cache warming up) favours
        neither arm."""
        if self.trial is None:
            return None
        n_a, n_b = len(self.trial.costs_a), len(self.trial.costs_b)
        if n_a != n_b:
            return ARM_A if n_a < n_b else ARM_B
        return ARM_A if n_a % 2 == 0 else ARM_B

    def candidate(self) -> tuple[str, Any] | None:
        """(knob, value) under trial, so the caller can check it before measuring."""
        return None if self.trial is None else (self.trial.knob, self.trial.b)

    def observe(self, cost: float, batch_size: int) -> None:
        """Report the cost (seconds per decode step per sequence) of the window just run
        with `settings()`, at `batch_size` sequences. Raises ValueError for a cost that is
        not a positive finite number."""
        if not (cost > 0 and cost != float("inf")):
            raise ValueError(f"a window cost must be a positive finite number, got {cost!r}")
        if self.calibrating:
            self._calibrate(cost)
            return
        trial = self.trial
        if trial is None:
            return
        if trial.batch_size is None:
            trial.batch_size = batch_size
        elif batch_size != trial.batch_size:
            trial.dropped_windows += 1        # not comparable: run this arm again
            if trial.dropped_windows > MAX_DROPPED_WINDOWS * self.pairs:
                # the traffic moved to another batch size for good: start the trial again there
                trial.costs_a, trial.costs_b = [], []
                trial.batch_size, trial.dropped_windows = batch_size, 0
            else:
                return
        (trial.costs_a if self.arm == ARM_A else trial.costs_b).append(cost)
        if len(trial.costs_a) == len(trial.costs_b) == self.pairs:
            self._finish(trial)

    def reject(self, why: str) -> None:
        """Refuse the candidate under trial (it will not be tried again in this run)."""
        trial = self.trial
        if trial is None:
            return
        trial.outcome = f"rejected: {why}"
        self.rejected.add((trial.knob, trial.b))
        self.trials.append(trial)
        if trial.proposal:
            self._next_proposal_or_search()
        elif not self._step():                     # the next value the same way, if any
            self._after_loss()

    def _calibrate(self, cost: float) -> None:
        self.noise_costs.append(cost)
        if len(self.noise_costs) < 2 * self.noise_pairs:
            return
        a, b = self.noise_costs[0::2], self.noise_costs[1::2]
        self.noise = math.sqrt(statistics.fmean(((x - y) / x) ** 2 for x, y in zip(a, b)))
        self.window_multiplier = window_multiplier(self.noise, self.min_gain)
        self.calibrating = False
        self._next_proposal_or_search()

    # -------------------------------------------------------------------- the search
    def _arm_value(self) -> Any:
        return self.trial.a if self.arm == ARM_A else self.trial.b

    def _finish(self, trial: Trial) -> None:
        self.trials.append(trial)
        if not wins(trial.gains, self.min_gain):
            trial.outcome = "unconfirmed" if trial.confirming else "loss"
            if trial.proposal:
                self._next_proposal_or_search()
            else:
                self._after_loss()
        elif not trial.confirming:
            trial.outcome = "win, confirming"
            self.trial = Trial(trial.knob, trial.a, trial.b, confirming=True,
                               proposal=trial.proposal)
        elif trial.proposal:
            trial.outcome = "win"
            self.incumbent[trial.knob] = trial.b
            self._next_proposal_or_search()
        else:
            trial.outcome = "win"
            self.incumbent[trial.knob] = trial.b
            self._kept_this_round = True
            if not self._step():                   # keep going the same way
                self._next_knob()

    def _after_loss(self) -> None:
        knob = self.knobs[self._knob_index]
        if self._direction > 0 and self.incumbent[knob.name] == self._visit_start:
            self._direction = -1                   # up lost at once: try down
            if self._step():
                return
        self._next_knob()

    def _step(self) -> bool:
        """Set up the trial one step from the incumbent in the current direction
        (skipping rejected values); False when there is none."""
        knob = self.knobs[self._knob_index]
        current = self.incumbent[knob.name]
        i = knob.values.index(current) + self._direction
        while 0 <= i < len(knob.values) and (knob.name, knob.values[i]) in self.rejected:
            i += self._direction
        if not 0 <= i < len(knob.values):
            self.trial = None
            return False
        self.trial = Trial(knob.name, current, knob.values[i])
        return True

    def _next_knob(self) -> None:
        self._knob_index += 1
        self._visit_knob()

    def _visit_knob(self) -> None:
        """Start the first trial of the knob at _knob_index, moving on past knobs with
        nothing to try and closing rounds; sets done when the search is over."""
        while True:
            if self._knob_index >= len(self.knobs):
                self.rounds += 1
                if (not self._kept_this_round or self.rounds >= self.max_rounds
                        or len(self.knobs) == 1):   # one knob: a second round re-tries losers
                    self.trial, self.done = None, True
                    return
                self._knob_index, self._kept_this_round = 0, False
            knob = self.knobs[self._knob_index]
            self._visit_start = self.incumbent[knob.name]
            self._direction = +1
            if self._step():
                return
            self._direction = -1
            if self._step():
                return
            self._knob_index += 1

    def report(self) -> dict:
        """What was tried and kept (JSON-ready)."""
        return {"settings": dict(self.incumbent), "rounds": self.rounds, "done": self.done,
                "noise": None if self.noise is None else round(self.noise, 4),
                "noise_costs": [round(c, 6) for c in self.noise_costs],
                "window_multiplier": self.window_multiplier,
                "trials": [t.to_dict() for t in self.trials]}


# ------------------------------------------------------------- cache budget by replay
@dataclass(frozen=True)
class CacheChoice:
    """The cache split chosen by replay: hit rate of each candidate, the winner."""

    slots_per_layer: int
    pin_fraction: float
    hit_rate: float
    table: tuple[tuple[int, float, float], ...]   # (slots_per_layer, pin_fraction, hit_rate)


def choose_cache_split(tokens: list[list[list[int]]], num_experts: int, top_k: int,
                       max_slots_per_layer: int, pin_fractions: Sequence[float],
                       slot_bytes: int, current_fraction: float, min_gain: float = 0.01,
                       min_dynamic_per_layer: int | None = None,
                       min_gain_per_mib: float = 0.0) -> CacheChoice:
    """Pick slots per layer (cache budget) and the pinned share by replaying `tokens`.

    tokens: recorded routing, [token][moe layer] -> top_k expert ids (the replay format).
    pin_fractions: candidate shares of all slots pinned (scheduler.replay's measure);
    current_fraction: the share in use now, always a candidate. Each is replayed at
    `max_slots_per_layer` (the planner's bound); another share replaces the current one
    only when its hit rate is at least `min_gain` higher (a replay of a few hundred
    tokens cannot tell smaller differences from luck), and no share may leave fewer than
    `min_dynamic_per_layer` dynamic slots per layer (default 1.5 x top_k: the dynamic
    tier also holds what prefetch reads ahead, which the replay does not model). The
    budget is then lowered one slot per layer at a time while the hit rate falls by less
    than `min_gain_per_mib` per MiB saved (0: only while it does not fall at all).
    Raises ValueError for fewer than top_k slots per layer or fewer than 2 tokens.
    """
    if max_slots_per_layer < top_k:
        raise ValueError(f"max_slots_per_layer {max_slots_per_layer} is below top_k {top_k}")
    if len(tokens) < 2:
        raise ValueError("the routing record needs at least 2 tokens")
    layers = len(tokens[0])
    floor = (3 * top_k + 1) // 2 if min_dynamic_per_layer is None else min_dynamic_per_layer
    total = max_slots_per_layer * layers

    def room(fraction: float) -> bool:
        pinned = min(int(round(fraction * total)), max(0, total - top_k * layers))
        return total - pinned >= min(floor, max_slots_per_layer) * layers

    table = []
    current = simulate_hit_rate(tokens, num_experts, max_slots_per_layer, current_fraction)
    table.append((max_slots_per_layer, current_fraction, current))
    best = (max_slots_per_layer, current_fraction, current)
    for fraction in pin_fractions:
        if fraction == current_fraction or not room(fraction):
            continue
        rate = simulate_hit_rate(tokens, num_experts, max_slots_per_layer, fraction)
        table.append((max_slots_per_layer, fraction, rate))
        if rate >= current + min_gain and rate > best[2]:
            best = (max_slots_per_layer, fraction, rate)
    slots, fraction, rate = best
    while slots > top_k:
        smaller = simulate_hit_rate(tokens, num_experts, slots - 1, fraction)
        table.append((slots - 1, fraction, smaller))
        saved_mib = layers * slot_bytes / 2**20
        if rate - smaller > min_gain_per_mib * saved_mib or min_gain_per_mib == 0.0 and smaller < rate:
            break
        slots, rate = slots - 1, smaller
    return CacheChoice(slots, fraction, rate, tuple(table))
