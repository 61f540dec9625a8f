"""The tuner on live traffic: the daemon's engine feeds it every decode step.

`start_live_tuning` builds it for `moed serve` (tuner = live / live+idle): saved winners
for this model and hardware first, a search from them, the new winners saved when it
ends. Knobs the operator set are never tuned.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from daemon.tuning.knobs import LiveKnobs, default_knobs, probe_proposals, snap_to
from daemon.tuning.saved import TunedStore, hardware_facts, valid_settings
from daemon.tuning.search import WINDOW_STEPS, check_candidates, check_tokens, replay_cache_split
from daemon.tuning.workload import RoutingRecorder, workload_prompts
from ext.models.model import Model
from scheduler.tuner import NOISE_PAIRS, Knob, OnlineTuner
from telemetry.logs import get_logger

log = get_logger("tuning")

MIN_REPLAY_TOKENS = 256         # fewer recorded tokens: the live tuner leaves the split alone
TUNER_MODES = ("off", "live", "live+idle")


class LiveTuner:
    """The tuner on live traffic: fed every decode step by the engine, on its thread.

    A window is `window_steps` consecutive decode steps at one batch size (a change of
    batch size starts the window again), times the tuner's window multiplier once its
    `noise_pairs` A-vs-A pairs have measured the noise; its cost is the median step time divided by the
    batch size, i.e. seconds per decode step per sequence. Between windows the next
    settings are applied (placement only: output cannot change). A candidate is first
    checked on `check_prompt` (a private sequence, greedy): if its tokens differ from
    the incumbent's, it is rejected and an error logged. When the search ends the
    winners stay applied and `on_done(tuner)` is called (the daemon saves them).
    """

    def __init__(self, model: Model, knobs: list[Knob], start: Mapping[str, Any],
                 check_prompt: list[int], *, window_steps: int = WINDOW_STEPS, pairs: int = 4,
                 on_done: Callable[[OnlineTuner], None] | None = None, session=None,
                 budget_bytes: int | None = None, proposals: list[tuple[str, Any]] = (),
                 noise_pairs: int = NOISE_PAIRS):
        self.model = model
        self.session = session
        self.budget_bytes = budget_bytes
        self.split: dict[str, Any] = {}         # the cache split chosen by replay, if any
        self.recorder: RoutingRecorder | None = None
        if session is not None and budget_bytes is not None:
            self.recorder = RoutingRecorder(len(session.provider.moe_layers))
            session.provider.routing_recorder = self.recorder
        self.live = LiveKnobs(model)
        self.window_steps = window_steps
        self.check_prompt = check_prompt
        self.on_done = on_done
        start = {k.name: snap_to(k, start[k.name]) for k in knobs}
        self.live.apply(start)
        self.tuner = OnlineTuner(knobs, start, pairs=pairs, proposals=proposals,
                                 noise_pairs=noise_pairs)
        self.reference: list[int] | None = None
        self._checked: set[tuple[str, Any]] = set()
        self._times: list[float] = []
        self._batch: int | None = None
        self.finished = False
        self._prepare()

    def _prepare(self) -> None:
        """Check the candidate under trial (once) and apply the next window's settings.

        A check prompt that cannot run — an expert it routes to has broken weights (NaN)
        or unreadable bytes — stops the search (`stop`, a warning naming the error): the
        model serves as it would without a tuner, and the failure is the model's to report
        (/health), never the tuner's to make fatal (this runs while the daemon loads)."""
        try:
            if self.reference is None and not self.tuner.done:     # the incumbent's tokens, once
                self.live.apply(self.tuner.incumbent)
                self.reference = check_tokens(self.model, self.check_prompt)
            if self.reference is not None and not self.tuner.calibrating:
                check_candidates(self.model, self.tuner, self.check_prompt, self.reference,
                                 self._checked)
        except (OSError, ValueError) as e:
            log.warning("tuner_check_failed", error=str(e))
            self.stop(f"the check prompt failed: {e}")
            return
        self.live.apply(self.tuner.settings())
        if self.tuner.done and not self.finished:
            self.finished = True
            self._choose_split()
            log.info("tuner_finished", settings=self.tuner.incumbent,
                     cache_split=self.split or "unchanged", trials=len(self.tuner.trials))
            if self.on_done is not None:
                self.on_done(self.tuner)

    def _choose_split(self) -> None:
        """The cache budget and pinned share by replaying the routing recorded while the
        A/B search ran (single-sequence decode steps); applied when they changed."""
        if self.recorder is None:
            return
        tokens = self.recorder.tokens
        self.session.provider.routing_recorder = None
        if len(tokens) < MIN_REPLAY_TOKENS:
            log.info("tuner_cache_split_skipped", recorded_tokens=len(tokens),
                     needed_tokens=MIN_REPLAY_TOKENS,
                     reason="too few single-sequence decode steps recorded")
            return
        split, choice = replay_cache_split(self.session, tokens, self.budget_bytes)
        if (split["cache_bytes"] != self.session.options.cache_bytes
                or split["pin_fraction"] != self.session.options.pin_fraction):
            self.session.rebuild(cache_bytes=split["cache_bytes"], pin_fraction=split["pin_fraction"])
            self.split = split
            log.info("tuner_cache_split_applied", cache_bytes=split["cache_bytes"],
                     pin_fraction=round(split["pin_fraction"], 3),
                     replay_hit_rate=round(choice.hit_rate, 4))

    def stop(self, reason: str, keep: set[str] = frozenset()) -> None:
        """End the search now (engine thread): the incumbent's settings are applied, except
        the knobs in `keep` (which someone else just set), and nothing is saved."""
        if self.finished:
            return
        self.finished = True
        if self.recorder is not None:
            self.session.provider.routing_recorder = None
        self.live.apply({k: v for k, v in self.tuner.incumbent.items() if k not in keep})
        log.info("tuner_stopped", reason=reason, settings=self.tuner.incumbent)

    def step_done(self, seconds: float, batch_size: int) -> None:
        """One decode step of `batch_size` sequences took `seconds` (engine thread)."""
        if self.finished or seconds <= 0:
            return
        if batch_size != self._batch:
            self._times, self._batch = [], batch_size
        self._times.append(seconds)
        if len(self._times) < self.window_steps * self.tuner.window_multiplier:
            return
        cost = statistics.median(self._times) / batch_size
        self._times = []
        trial = self.tuner.trial
        self.tuner.observe(cost, batch_size)
        if trial is not None and trial.outcome is not None:
            log.info("tuner_trial", knob=trial.knob, a=trial.a, b=trial.b, outcome=trial.outcome,
                     gains=[round(g, 4) for g in trial.gains])
        self._prepare()

def start_live_tuning(model: Model, session, mode: str, fixed: set[str],
                      state_dir: Path | None, model_dir: str | Path) -> LiveTuner | None:
    """The daemon's live tuner (None when `mode` is "off" or nothing is left to tune).

    session: the ExpertSession (streamed experts; None: nothing to tune). fixed: knobs
    the operator set explicitly (THREADS, IO_WORKERS, PREFETCH_WIDTH), never tuned. Saved
    winners for this model and hardware are applied first and the search starts from
    them; the new winners are saved when it ends (a failed save is a warning).
    """
    if mode == "off" or session is None:
        return None
    facts = hardware_facts(model_dir)
    knobs = [k for k in default_knobs(model.config.top_k, facts["cpus"]) if k.name not in fixed]
    store = None
    saved: dict[str, Any] = {}
    if state_dir is not None:
        try:
            store = TunedStore(state_dir, model.checkpoint.fingerprint(), facts)
            saved = store.load() or {}
        except (OSError, ValueError) as e:
            log.warning("tuned_settings_unavailable", error=str(e))
    start = LiveKnobs(model).current()
    for knob in knobs:
        if knob.name in saved and saved[knob.name] in knob.values:
            start[knob.name] = saved[knob.name]
    if saved:
        log.info("tuned_settings_loaded", settings={k.name: start[k.name] for k in knobs})
    if not knobs:
        return None

    budget = session.options.cache_bytes           # configured or planned: the ceiling
    split = {k: saved[k] for k in ("cache_bytes", "pin_fraction") if k in saved}
    if split and split.get("cache_bytes", budget) <= budget:
        session.rebuild(cache_bytes=split.get("cache_bytes"), pin_fraction=split.get("pin_fraction"))
        log.info("tuned_cache_split_loaded", **split)
    holder: list[LiveTuner] = []

    def done(tuner: OnlineTuner) -> None:
        if store is None or not store.writable:   # read-only: the session said so once
            return
        try:
            store.save({**valid_settings(saved, store.path), **tuner.incumbent,
                        **(holder[0].split if holder else {})},
                       {"trials": len(tuner.trials)})
        except (OSError, ValueError) as e:
            log.warning("tuned_settings_not_saved", error=str(e))

    prompts = workload_prompts(model_dir, model.config.vocab_size)
    proposals = [] if saved else probe_proposals(knobs, state_dir, model_dir)
    tuner = LiveTuner(model, knobs, {**start}, prompts[0], on_done=done, session=session,
                      budget_bytes=budget, proposals=proposals)
    holder.append(tuner)
    return tuner
