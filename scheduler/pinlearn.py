"""Learning the pin set and its share while serving: chosen on older traffic, kept only
when it wins on the newest.

Conventions (the whole module): L MoE layers (layer *indices* 0..L-1), E experts per
layer, K = top_k. Routing arrives one decode step at a time as L lists of expert ids (the
union of a batched step's rows). Time is counted in those steps; nothing reads a clock.
Pins are (layer index, expert) pairs; `share` is the share of the slots above the cache's
minimum (top_k per layer) that the pinned tier takes, as `StreamingOptions.pin_fraction`
counts it.

What `PinLearner` does (docs/design.md "Usage statistics and pin set", issue 17):
  - It keeps the routing of the last `history_windows` windows of `window_tokens` steps.
  - At evaluation points (after 2 windows, then at window counts doubling up to every
    `max_interval_windows`, back to often when a decision changes) it scores candidates:
    share 0; each share of `shares` up to `max_share` with the pin set chosen
    (`select_pins`) from the long-term counts (the caller's usage statistics, which carry
    earlier sessions) or from the recent counts (this history only); and the incumbent.
  - Choose: each candidate replays the older windows (all but the newest) through a
    `ShadowLRU` of the cache's own tiers (pinned slots, staging left out, the rest split
    over the layers) from cold, counting hits. The best is the challenger.
  - Check (skipped when the challenger is the incumbent: nothing changes, and the check
    is most of an evaluation's cost): challenger and incumbent replay the window before the newest (warm-up) and
    the newest (counted), with pin sets chosen from counts that exclude the newest
    window. The challenger replaces the incumbent only when it wins there by a margin:
    `min_gain` of the lookups, and a paired sign test — of the lookups only one of the two
    hit, the challenger's exceed the incumbent's by Z_WIN standard errors (McNemar's
    test) — so a win of a few lookups in a short window is not taken for a real one;
    otherwise the incumbent stays. Stale pins (a workload that moved)
    lose to the recent set or to no pins this way, and are dropped.
  - Between evaluations the caller re-evaluates the set with hysteresis
    (scheduler.pins.PinPolicy) from the counts of the chosen source (`counts_for`).
The replay models the dynamic tier as LRU (cheap, a few dictionary operations per
expert); the policy that really runs is usually better than LRU, which changes neither
side of the comparison much.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from scheduler.pins import select_pins
from scheduler.shadow import ShadowLRU, even_split

PIN_SHARES = (0.125, 0.25, 0.375, 0.5)
WINDOW_TOKENS = 32
HISTORY_WINDOWS = 8
MIN_GAIN = 0.01           # of the newest window's lookups
MAX_INTERVAL_WINDOWS = 16
CHECK_LAYERS = 8          # layers the check replays through the running policy
Z_WIN = 2.0               # standard errors of the paired sign test a challenger must clear
SOURCES = ("long", "recent")

Pin = tuple[int, int]


@dataclass(frozen=True)
class PinDecision:
    """What the pinned tier should hold: `pinned_slots` slots, the set `pins` (layer index,
    expert), chosen from `source` counts at `share`. validation: the newest window's hit
    rates of the incumbent and the challenger; table: every candidate's choose-stage rate."""

    pinned_slots: int
    pins: frozenset[Pin]
    share: float
    source: str
    changed: bool
    validation: dict = field(default_factory=dict)
    table: tuple = ()


def _rounded(rate: float | None) -> float | None:
    return None if rate is None else round(rate, 4)


class PinLearner:
    """Chooses the pin share and set from the routing it observes (see the module doc).

    n_layers, num_experts, top_k: the model. total_slots: the cache's slots;
    staging_slots: its staging tier (left out of the replayed dynamic tiers).
    max_share: the largest share tried (the configured pin_fraction). start_share /
    start_source: the incumbent at construction (a share saved by an earlier session).
    check_shadow: (layer indices, their dynamic capacities, pins of those layers) -> a
    shadow with `access` and `access_hits` (scheduler.shadow.ShadowPolicyCache of the
    cache's own policy) for the check stage, which then replays `check_layers` (at most
    CHECK_LAYERS, spread over the model); None: ShadowLRU over every layer, which models
    the dynamic tier as LRU and so overrates pins next to a policy that already keeps the
    frequent experts.
    Raises ValueError for shares outside [0, 1] or a window below 1 step.
    """

    def __init__(self, n_layers: int, num_experts: int, top_k: int, total_slots: int, *,
                 staging_slots: int = 0, max_share: float = 0.5, shares: Sequence[float] = PIN_SHARES,
                 window_tokens: int = WINDOW_TOKENS, history_windows: int = HISTORY_WINDOWS,
                 min_gain: float = MIN_GAIN, max_interval_windows: int = MAX_INTERVAL_WINDOWS,
                 start_share: float = 0.0, start_source: str = "long", check_shadow=None):
        if not 0.0 <= max_share <= 1.0 or not all(0.0 < s <= 1.0 for s in shares):
            raise ValueError(f"shares must be in (0, 1] and max_share in [0, 1], got {shares}, {max_share}")
        if window_tokens < 1 or history_windows < 2:
            raise ValueError("window_tokens must be >= 1 and history_windows >= 2")
        if start_source not in SOURCES:
            raise ValueError(f"start_source must be one of {SOURCES}, got {start_source!r}")
        self.n_layers, self.num_experts, self.top_k = n_layers, num_experts, top_k
        self.total_slots, self.staging_slots = total_slots, staging_slots
        self.check_shadow = check_shadow
        # The layers the check replays through check_shadow: at most CHECK_LAYERS, spread
        # over the model (the real policy costs tens of microseconds per layer step).
        n = min(n_layers, CHECK_LAYERS)
        self.check_layers = sorted({round(i * (n_layers - 1) / max(1, n - 1)) for i in range(n)})
        self.spare = max(0, total_slots - staging_slots - top_k * n_layers)
        self.shares = tuple(s for s in shares if s <= max_share + 1e-12)
        self.window_tokens, self.min_gain = window_tokens, min_gain
        self.max_interval = max_interval_windows
        self.share = min(float(start_share), 1.0)      # the incumbent may exceed max_share
        self.source = start_source
        self.prior = self.share > 0                    # an earlier session's choice
        self.pins: frozenset[Pin] = frozenset()
        self._windows: deque[list[list[list[int]]]] = deque(maxlen=history_windows)
        self._window_counts: deque[np.ndarray] = deque(maxlen=history_windows)
        self._current: list[list[list[int]]] = []
        self.windows_seen = 0
        self._next_eval = 2
        self._interval = 1
        self.evaluations = 0
        self.last: PinDecision | None = None

    # -- feeding ------------------------------------------------------------------------
    def observe(self, step: Sequence[Sequence[int]]) -> None:
        """One decode step's routing: for each layer, the expert ids it needed."""
        self._current.append([list(map(int, experts)) for experts in step])
        if len(self._current) >= self.window_tokens:
            # A window's counts at once (one bincount, not one update per layer and step).
            E = self.num_experts
            flat = [li * E + e for ids in self._current for li, experts in enumerate(ids)
                    for e in set(experts)]
            counts = np.bincount(np.asarray(flat, dtype=np.int64), minlength=self.n_layers * E)
            self._windows.append(self._current)
            self._window_counts.append(counts.reshape(self.n_layers, E).astype(np.float64))
            self._current = []
            self.windows_seen += 1

    def due(self) -> bool:
        """An evaluation point has been reached (see the module doc)."""
        return self.windows_seen >= self._next_eval and len(self._windows) >= 2

    def pinned_slots_for(self, share: float) -> int:
        return int(self.spare * share)

    def recent_counts(self, exclude_newest: bool = False) -> np.ndarray:
        """[L, E] uses over the kept windows (optionally without the newest)."""
        counts = list(self._window_counts)[: -1 if exclude_newest else None]
        return np.sum(counts, axis=0) if counts else np.zeros((self.n_layers, self.num_experts))

    def counts_for(self, source: str, long_counts: np.ndarray) -> np.ndarray:
        """The counts pins are chosen from for `source` ("long": the caller's usage)."""
        return long_counts if source == "long" else self.recent_counts()

    # -- deciding -----------------------------------------------------------------------
    def decide(self, long_counts: np.ndarray) -> PinDecision:
        """Evaluate now (call when `due`): the decision, applied to this learner's state.

        long_counts: [L, E] the long-term usage counts (including the newest window's
        steps, which are taken out for the check). Raises ValueError on a wrong shape.
        """
        long_counts = np.asarray(long_counts, dtype=np.float64)
        if long_counts.shape != (self.n_layers, self.num_experts):
            raise ValueError(f"long_counts shape {long_counts.shape}, expected "
                             f"{(self.n_layers, self.num_experts)}")
        windows = list(self._windows)
        older, newest = windows[:-1], windows[-1]
        long_before = np.maximum(long_counts - self._window_counts[-1], 0.0)
        recent_before = self.recent_counts(exclude_newest=True)
        sources = {"long": long_before, "recent": recent_before}
        candidates: list[tuple[float, str]] = [(0.0, "long")]
        candidates += [(share, source) for share in self.shares for source in SOURCES]
        incumbent = (self.share, self.source)
        if incumbent not in candidates:
            candidates.append(incumbent)

        def pins_of(share: float, source: str) -> frozenset[Pin]:
            slots = self.pinned_slots_for(share)
            if slots == 0:
                return frozenset()
            return select_pins(sources[source], 1, slots)

        chosen = {c: pins_of(*c) for c in candidates}
        steps_older = [step for w in older for step in w]
        table = []
        for c in candidates:
            hits = self._replay(chosen[c], self.pinned_slots_for(c[0]), [], steps_older)
            table.append((c[0], c[1], hits))
        best = max(table, key=lambda row: (row[2], -row[0], row[1] == incumbent[1]))
        challenger = (best[0], best[1])
        warm = older[-1]
        if challenger == incumbent:
            # Nothing to check: the incumbent stays (the check is most of the cost).
            outcomes, val = {}, {incumbent: None}
            only_c = only_i = 0
        else:
            outcomes = {c: self._outcomes(chosen[c], self.pinned_slots_for(c[0]), warm, newest)
                        for c in (challenger, incumbent)}
            val = {c: sum(o) / max(1, len(o)) for c, o in outcomes.items()}   # (check_layers only)
            # A win by a margin: min_gain of the lookups, and a paired sign test (McNemar)
            # on the lookups only one of the two hit, at Z_WIN standard errors.
            only_c = sum(a > b for a, b in zip(outcomes[challenger], outcomes[incumbent]))
            only_i = sum(b > a for a, b in zip(outcomes[challenger], outcomes[incumbent]))
        if challenger == incumbent:
            changed = False
        elif self.evaluations == 0 and self.prior:
            # The incumbent is an earlier session's choice, never checked on this traffic:
            # the better of the two on the newest window wins, without a margin.
            changed = challenger != incumbent and val[challenger] > val[incumbent]
        else:
            changed = (challenger != incumbent and val[challenger] >= val[incumbent] + self.min_gain
                       and only_c - only_i >= Z_WIN * (only_c + only_i) ** 0.5)
        if changed:
            self.share, self.source = challenger
            self._interval = 1                         # the workload moves: look again soon
        else:
            self._interval = min(self.max_interval, 2 * self._interval)
        self._next_eval = self.windows_seen + self._interval
        self.evaluations += 1
        # The set itself follows the chosen source's counts up to now.
        now_counts = {"long": long_counts, "recent": self.recent_counts()}[self.source]
        slots = self.pinned_slots_for(self.share)
        self.pins = select_pins(now_counts, 1, slots) if slots else frozenset()
        lookups_older = sum(len(ids) for step in steps_older for ids in step) or 1
        self.last = PinDecision(
            pinned_slots=slots, pins=self.pins, share=self.share, source=self.source, changed=changed,
            validation={"incumbent": {"share": incumbent[0], "source": incumbent[1],
                                      "hit_rate": _rounded(val[incumbent])},
                        "challenger": {"share": challenger[0], "source": challenger[1],
                                       "hit_rate": _rounded(val[challenger])},
                        "window_tokens": len(newest)},
            table=tuple((s, src, round(h / lookups_older, 4)) for s, src, h in table))
        return self.last

    def _shadow(self, pins: frozenset[Pin], pinned_slots: int, warm: list) -> ShadowLRU:
        capacities = even_split(self.total_slots - self.staging_slots - pinned_slots, self.n_layers)
        shadow = ShadowLRU(capacities, pins)
        for step in warm:
            for li, ids in enumerate(step):
                shadow.access(li, ids)
        return shadow

    def _replay(self, pins: frozenset[Pin], pinned_slots: int, warm: list, counted: list) -> int:
        """Hits of a ShadowLRU with these pins over `counted`, after replaying `warm`."""
        shadow = self._shadow(pins, pinned_slots, warm)
        hits = 0
        for step in counted:
            for li, ids in enumerate(step):
                hits += len(ids) - shadow.access(li, ids)
        return hits

    def _outcomes(self, pins: frozenset[Pin], pinned_slots: int, warm: list, counted: list) -> list[int]:
        """As `_replay`, one 1 (hit) or 0 per lookup of `counted`, in order — through
        `check_shadow` (the policy that really runs) when the learner has one."""
        if self.check_shadow is None:
            shadow = self._shadow(pins, pinned_slots, warm)
        else:
            layers = self.check_layers
            split = even_split(self.total_slots - self.staging_slots - pinned_slots, self.n_layers)
            shadow = self.check_shadow(layers, [split[li] for li in layers],
                                       {p for p in pins if p[0] in set(layers)})
            for step in warm:
                for li in layers:
                    shadow.access(li, step[li])
            return [hit for step in counted for li in layers for hit in shadow.access_hits(li, step[li])]
        out: list[int] = []
        for step in counted:
            for li, ids in enumerate(step):
                present = shadow.resident(li)
                out += [int(e in present) for e in ids]
                shadow.access(li, ids)
        return out
