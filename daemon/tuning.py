"""The self-tuner at work on a loaded model: live knobs, a built-in workload, persistence.

`scheduler.tuner` decides; this module measures and applies:

* `LiveKnobs` applies a settings dict between decode steps without reloading anything:
  compute threads (`Model.n_threads`), io workers (`IoPool.set_workers`) and prefetch
  width (`StreamingExpertProvider.set_prefetch`, 0 = off). None of them changes output.
* `Workload` is the built-in workload: one sequence decoding with seeded sampling
  (temperature 0.7) from fixed prompts; a window is `steps` decode steps and its cost is
  the median seconds per step (batch size 1, so the per-sequence cost is the step time).
  Every step's routing is recorded (`RoutingRecorder`) for the cache-split replay.
* `check_tokens` runs a fixed check prompt greedily; a candidate that changes those
  tokens is a bug: the tuner rejects it and an error is logged.
* `TunedStore` keeps the winners per (model, hardware) fingerprint in the state
  directory (``tuned-<model fingerprint[:16]>.json``, written like the usage file: atomic,
  locked). A file written on other hardware (`hardware_facts` differ) is ignored with a
  warning; another model has another file.
* `run_tune` is `moed tune`: defaults measured, the tuner run, the cache split chosen by
  replay, tuned vs default measured interleaved, the winners saved.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from daemon.state import StateStore
from ext.model import Model
from ext.sampling import Sampler, SamplingParams
from scheduler.tuner import CacheChoice, Knob, OnlineTuner, choose_cache_split

log = logging.getLogger("moed.tuning")

THREADS, IO_WORKERS, PREFETCH_WIDTH = "threads", "io_workers", "prefetch_width"
TUNED_VERSION = 1
WINDOW_STEPS = 16
CHECK_TOKENS = 16
TEMPERATURE = 0.7
RECORD_TOKENS = 2048            # routing kept for the replay (most recent tokens)
MIN_REPLAY_TOKENS = 256         # fewer recorded tokens: the live tuner leaves the split alone
PIN_FRACTIONS = (0.0, 0.125, 0.25, 0.375, 0.5)   # of all slots, as scheduler.replay counts them


# ----------------------------------------------------------------------- hardware
def hardware_facts(model_dir: str | os.PathLike) -> dict[str, Any]:
    """What tuned settings depend on: CPU model and usable CPUs, RAM, the model's disk."""
    from daemon.iobench import block_device

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_total = next(int(line.split()[1]) * 1024 for line in
                         Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        mem_total = None
    return {"cpu": cpu, "cpus": len(os.sched_getaffinity(0)), "mem_total_bytes": mem_total,
            "machine": platform.machine(), "disk": block_device(model_dir)}


def hardware_fingerprint(facts: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


SETTING_RANGES = {THREADS: (1, 1024), IO_WORKERS: (1, 1024), PREFETCH_WIDTH: (0, 1 << 16),
                  "cache_bytes": (1, 1 << 62)}


def valid_settings(settings: Mapping[str, Any], path: Path | str) -> dict[str, Any]:
    """The saved settings that are usable: whole numbers (not booleans) in range for the
    known knobs, pin_fraction a number in [0, 1]. Each other one is dropped with a warning."""
    kept: dict[str, Any] = {}
    for name, value in settings.items():
        if name in SETTING_RANGES:
            lo, hi = SETTING_RANGES[name]
            ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
        elif name == "pin_fraction":
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and 0.0 <= value <= 1.0)
        else:
            ok = False
        if ok:
            kept[name] = value
        else:
            log.warning("tuned_setting_ignored path=%s setting=%s value=%r: not a usable value",
                        path, str(name)[:64], value if len(repr(value)) < 80 else "<long>")
    return kept


class TunedStore:
    """The tuner's winners for one model on this hardware, in the state directory.

    Raises OSError when the state directory cannot be created (like StateStore).
    """

    def __init__(self, state_dir: Path, model_fingerprint: str, facts: Mapping[str, Any]):
        self.store = StateStore(Path(state_dir), model_fingerprint, kind="tuned")
        self.facts = dict(facts)
        self.hardware = hardware_fingerprint(facts)

    @property
    def path(self) -> Path:
        return self.store.path

    def load(self) -> dict[str, Any] | None:
        """The saved settings, or None: no file, a bad one (set aside), or one written on
        other hardware (ignored, with a warning naming what changed)."""
        payload = self.store.load()
        if payload is None:
            return None
        if payload.get("version") != TUNED_VERSION or not isinstance(payload.get("settings"), dict):
            log.warning("tuned_settings_ignored path=%s reason=unknown payload version or shape",
                        self.path)
            return None
        if payload.get("hardware") != self.hardware:
            before = payload.get("hardware_facts")
            before = before if isinstance(before, dict) else {}
            changed = sorted(str(k) for k in set(before) | set(self.facts)
                             if before.get(k) != self.facts.get(k))
            log.warning("tuned_settings_invalidated path=%s reason=hardware changed (%s); "
                        "the defaults apply until the tuner runs again", self.path,
                        ", ".join(changed) or "fingerprint")
            return None
        return valid_settings(payload["settings"], self.path)

    def save(self, settings: Mapping[str, Any], report: Mapping[str, Any] | None = None) -> None:
        """Write the winners (replacing any earlier ones). Raises OSError."""
        payload = {"version": TUNED_VERSION, "hardware": self.hardware,
                   "hardware_facts": self.facts, "settings": dict(settings),
                   "report": dict(report or {})}
        self.store.save(lambda _current: payload)


# --------------------------------------------------------------------- live knobs
class LiveKnobs:
    """Applies tuner settings to a model and its streaming provider, between steps."""

    def __init__(self, model: Model):
        self.model = model

    def current(self) -> dict[str, Any]:
        p = self.model.experts
        return {THREADS: self.model.n_threads, IO_WORKERS: p.io.n_workers,
                PREFETCH_WIDTH: p.width if p.wants_hints else 0}

    def apply(self, settings: Mapping[str, Any]) -> None:
        p = self.model.experts
        if THREADS in settings:
            self.model.n_threads = int(settings[THREADS])
        if IO_WORKERS in settings and settings[IO_WORKERS] != p.io.n_workers:
            p.io.set_workers(int(settings[IO_WORKERS]))
        if PREFETCH_WIDTH in settings and settings[PREFETCH_WIDTH] != self.current()[PREFETCH_WIDTH]:
            p.set_prefetch(int(settings[PREFETCH_WIDTH]))   # a change drops pending predictions


def default_knobs(top_k: int, cpus: int) -> list[Knob]:
    """Threads 1..cpus, io workers 1..16 (doubling), prefetch width 0 (off), top_k,
    top_k + top_k/2, 2 top_k."""
    widths = sorted({0, top_k, top_k + max(1, top_k // 2), 2 * top_k})
    return [Knob(THREADS, tuple(range(1, max(1, cpus) + 1))),
            Knob(IO_WORKERS, (1, 2, 4, 8, 16)),
            Knob(PREFETCH_WIDTH, tuple(widths))]


def saved_probe(state_dir: Path | None, model_dir: str | Path) -> dict | None:
    """The saved storage probe report of the disk holding the model's shards, or None."""
    from daemon.iobench import block_device, report_path
    if state_dir is None:
        return None
    try:
        shard = next(p for p in sorted(Path(model_dir).iterdir()) if p.suffix == ".safetensors")
        report = json.loads(report_path(state_dir, block_device(shard)).read_text())
        return report if isinstance(report, dict) else None
    except (OSError, ValueError, StopIteration):
        return None


def probe_rows(report: dict) -> list[dict]:
    """The well-formed results of a storage probe report on the io path it chose
    (queue depth a whole number in [1, 1024], GB/s a number >= 0); [] when malformed."""
    try:
        return [r for r in report["results"] if r["mode"] == report["io_path"]
                and type(r["queue_depth"]) is int and 1 <= r["queue_depth"] <= 1024
                and type(r["gb_per_s"]) in (int, float) and r["gb_per_s"] >= 0]
    except (KeyError, TypeError, AttributeError):
        return []


def probe_io_workers(state_dir: Path | None, model_dir: str | Path, share: float = 0.95) -> int | None:
    """The io worker count the saved storage probe (`moed iobench`, or the daemon's probe
    after READY) suggests: the smallest queue depth reaching `share` of the best GB/s on
    the io path it found. None without a usable saved probe for the model's disk."""
    report = saved_probe(state_dir, model_dir)
    rows = probe_rows(report) if report is not None else []
    if not rows:
        return None
    best = max(float(r["gb_per_s"]) for r in rows)
    return min(r["queue_depth"] for r in rows if r["gb_per_s"] >= share * best)


def probe_summary(state_dir: Path | None, model_dir: str | Path, io_workers: int) -> dict | None:
    """The saved probe in brief, for `moed bench`: io path, device, GB/s at `io_workers`
    and the best queue depth. None without a usable saved probe."""
    report = saved_probe(state_dir, model_dir)
    rows = probe_rows(report) if report is not None else []
    if not rows:
        return None
    at = [r["gb_per_s"] for r in rows if r["queue_depth"] == io_workers]
    best = max(rows, key=lambda r: r["gb_per_s"])
    return {"io_path": report["io_path"], "device": report.get("device"),
            "gb_per_s_at_io_workers": at[0] if at else None,
            "best_gb_per_s": best["gb_per_s"], "best_queue_depth": best["queue_depth"]}


def probe_proposals(knobs: list[Knob], state_dir: Path | None,
                    model_dir: str | Path) -> list[tuple[str, Any]]:
    """[(IO_WORKERS, n)] when a saved storage probe suggests n io workers (snapped to the
    knob's values) and io workers are tuned; else []. The tuner tests it against the start."""
    io_knob = next((k for k in knobs if k.name == IO_WORKERS), None)
    probed = probe_io_workers(state_dir, model_dir)
    if io_knob is None or probed is None:
        return []
    return [(IO_WORKERS, snap_to(io_knob, probed))]


def snap_to(knob: Knob, value: Any) -> Any:
    """The candidate of `knob` closest to `value` (a start value off the grid)."""
    return min(knob.values, key=lambda v: (abs(v - value), v))


# ----------------------------------------------------------------------- workload
class RoutingRecorder:
    """Routing of single-token decode steps: [token][moe layer] -> expert ids, the
    most recent `limit` tokens (the replay input of `choose_cache_split`)."""

    def __init__(self, n_moe_layers: int, limit: int = RECORD_TOKENS):
        self.n = n_moe_layers
        self.limit = limit
        self.tokens: list[list[list[int]]] = []
        self._current: list[list[int]] = []

    def observe(self, layer_index: int, experts) -> None:
        self._current.append(sorted(int(e) for e in experts))
        if len(self._current) == self.n:
            self.tokens.append(self._current)
            self._current = []
            if len(self.tokens) > self.limit:
                del self.tokens[: len(self.tokens) - self.limit]

    def abandon_step(self) -> None:
        self._current = []


class Workload:
    """One sequence decoding from fixed prompts with seeded sampling; restarts when full.

    prompts: token id lists. Costs are seconds per decode step (batch 1).
    """

    def __init__(self, model: Model, prompts: list[list[int]], capacity: int = 512,
                 seed: int = 0, clock: Callable[[], float] = time.perf_counter):
        self.model = model
        self.capacity = min(capacity, model.config.max_position_embeddings)
        self.prompts = [p[: max(1, self.capacity // 2)] for p in prompts]
        self.clock = clock
        self.sampler = Sampler(SamplingParams(temperature=TEMPERATURE, seed=seed))
        self._i = 0
        self.seq = None
        self.token = 0

    def _restart(self) -> None:
        prompt = self.prompts[self._i % len(self.prompts)]
        self._i += 1
        self.seq = self.model.new_sequence(capacity=self.capacity)
        self.token = self.sampler.sample(self.model.forward(self.seq, prompt)[-1])

    def window(self, steps: int, on_step: Callable[[float, int], None] | None = None) -> float:
        """Run `steps` decode steps; the median seconds per step. on_step(seconds, 1) is
        called after each (the live tuner's feed when the daemon is idle)."""
        times = []
        for _ in range(steps):
            if self.seq is None or self.seq.length + 1 >= self.capacity:
                self._restart()
            t0 = self.clock()
            logits = self.model.forward(self.seq, [self.token])
            times.append(self.clock() - t0)
            if on_step is not None:
                on_step(times[-1], 1)
            self.token = self.sampler.sample(logits[-1])
        return statistics.median(times)


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
        log.error("tuner_candidate_changed_output knob=%s value=%r: the check prompt gave %s "
                  "instead of %s; placement must never change output — this is a bug, the "
                  "candidate is rejected", candidate[0], candidate[1], got, reference)
        tuner.reject("changed the tokens of the check prompt")


def tune(model: Model, knobs: list[Knob], workload: Workload, check_prompt: list[int], *,
         window_steps: int = WINDOW_STEPS, pairs: int = 4, min_gain: float = 0.03,
         max_rounds: int = 3, progress: Callable[[str], None] | None = None,
         proposals: list[tuple[str, Any]] = ()) -> OnlineTuner:
    """Run the A/B tuner to the end on `workload`; the model is left at the winners."""
    live = LiveKnobs(model)
    start = live.current()
    start = {k.name: snap_to(k, start[k.name]) for k in knobs}
    live.apply(start)
    reference = check_tokens(model, check_prompt)
    tuner = OnlineTuner(knobs, start, pairs=pairs, min_gain=min_gain, max_rounds=max_rounds,
                        proposals=proposals)
    checked: set[tuple[str, Any]] = set()
    while True:
        check_candidates(model, tuner, check_prompt, reference, checked)
        if tuner.done:
            break
        trial = tuner.trial
        live.apply(tuner.settings())
        tuner.observe(workload.window(window_steps), batch_size=1)
        if progress and trial is not None and trial.outcome is not None:
            progress(f"{trial.knob} {trial.a} -> {trial.b}: {trial.outcome} "
                     f"(gains {', '.join(f'{100 * g:+.1f} %' for g in trial.gains)})")
    live.apply(tuner.incumbent)
    return tuner


# ------------------------------------------------------------------- moed tune
CODE_PROMPTS = ("def ", "class ", "import ", "    def __init__(self", "for i in range(")


@dataclass(frozen=True)
class TuneConfig:
    """What `moed tune` runs (see its --help)."""

    model: str
    cache_bytes: int
    state_dir: Path
    threads: int = 2
    io_workers: int = 2
    window_steps: int = WINDOW_STEPS
    pairs: int = 4
    compare_tokens: int = 64
    compare_repeats: int = 3
    seed: int = 0


def workload_prompts(model_dir: str | Path, vocab_size: int) -> list[list[int]]:
    """Code prompts through the model's tokenizer; fixed ids for a model without one."""
    from ext.tokenizer import Tokenizer, TokenizerFilesError
    try:
        tok = Tokenizer.from_model_dir(model_dir)
        return [tok.encode(p, add_special_tokens=False) for p in CODE_PROMPTS]
    except (TokenizerFilesError, OSError):
        return [[1 + (i * 37 + j * 101) % (vocab_size - 1) for i in range(16)] for j in range(4)]


def replay_cache_split(session, tokens: list[list[list[int]]],
                       budget_bytes: int) -> tuple[dict[str, Any], CacheChoice]:
    """The cache budget and pin share for `session` chosen by replaying recorded routing
    (scheduler.tuner.choose_cache_split, against the share in use now), as the
    {"cache_bytes", "pin_fraction"} settings of ExpertSession.rebuild, and the choice.
    budget_bytes: the most the cache may use (configured or planned)."""
    from daemon.streaming import minimum_cache_bytes

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


def compare_settings(session, model: Model, prompts, settings_of: dict[str, dict], cfg: TuneConfig,
                     progress=None) -> dict:
    """Tokens/s of each named settings dict: fresh cache (pins from learned usage) per run,
    page cache dropped, runs interleaved (a b a b ...); medians and the per-run figures."""
    from daemon.bench import drop_page_cache

    runs: dict[str, list[float]] = {name: [] for name in settings_of}
    for r in range(cfg.compare_repeats):
        for name, s in settings_of.items():
            session.rebuild(cache_bytes=s["cache_bytes"], pin_fraction=s["pin_fraction"])
            LiveKnobs(model).apply(s)
            drop_page_cache(model.checkpoint.shards)
            work = Workload(model, prompts, capacity=max(len(p) for p in prompts) + cfg.compare_tokens + 2,
                            seed=cfg.seed)
            t0 = time.perf_counter()
            work.window(cfg.compare_tokens)
            runs[name].append(cfg.compare_tokens / (time.perf_counter() - t0))
            if progress:
                progress(f"compare run {r + 1}/{cfg.compare_repeats} {name}: "
                         f"{runs[name][-1]:.2f} tokens/s")
    return {name: {"tokens_per_second": statistics.median(v), "runs": [round(x, 3) for x in v]}
            for name, v in runs.items()}


def run_tune(cfg: TuneConfig, progress: Callable[[str], None] | None = None) -> dict:
    """`moed tune`: tune threads, io workers and prefetch width by A/B on the built-in
    workload, the cache split by replay, compare tuned vs default, save the winners.
    Returns the JSON report. Raises the model's load errors and CacheBudgetError."""
    from daemon.session import open_model

    model, session = open_model(cfg.model, threads=cfg.threads, cache_bytes=cfg.cache_bytes,
                                io_workers=cfg.io_workers, state_dir=cfg.state_dir)
    try:
        if session is None:
            raise ValueError("moed tune needs an expert cache budget")
        config = model.config
        provider = session.provider
        n_layers = len(provider.moe_layers)
        prompts = workload_prompts(cfg.model, config.vocab_size)
        recorder = RoutingRecorder(n_layers)
        facts = hardware_facts(cfg.model)
        try:      # fail now, not after minutes of tuning, when the winners cannot be saved
            store = TunedStore(cfg.state_dir, model.checkpoint.fingerprint(), facts)
            store.load()
        except OSError as e:
            raise OSError(f"the state directory {cfg.state_dir} cannot hold the tuned "
                          f"settings: {e}") from None
        knobs = default_knobs(config.top_k, facts["cpus"])
        default = {THREADS: cfg.threads, IO_WORKERS: cfg.io_workers, PREFETCH_WIDTH: config.top_k,
                   "cache_bytes": cfg.cache_bytes, "pin_fraction": session.options.pin_fraction}
        workload = Workload(model, prompts, seed=cfg.seed)
        proposals = probe_proposals(knobs, cfg.state_dir, cfg.model)
        if proposals and progress:
            progress(f"the saved storage probe suggests {proposals[0][1]} io workers: "
                     "testing that first")
        provider.routing_recorder = recorder
        if progress:
            progress("warming the cache and learning usage (4 windows)")
        for _ in range(4):
            workload.window(cfg.window_steps)
        tuner = tune(model, knobs, workload, prompts[0], window_steps=cfg.window_steps,
                     pairs=cfg.pairs, progress=progress, proposals=proposals)
        # The cache split: replay what the workload routed.
        split, choice = replay_cache_split(session, recorder.tokens, cfg.cache_bytes)
        provider.routing_recorder = None
        tuned = {**tuner.incumbent, **split}
        if progress:
            progress(f"cache split by replay of {len(recorder.tokens)} tokens: "
                     f"{choice.slots_per_layer} slots per layer, {choice.pin_fraction:.3f} of them "
                     f"pinned, hit rate {100 * choice.hit_rate:.1f} %")
        compared = compare_settings(session, model, prompts, {"default": default, "tuned": tuned}, cfg, progress)
        report = {
            "model": str(cfg.model), "hardware": facts, "default": default, "tuned": tuned,
            "tokens_per_second": {
                **{k: round(v["tokens_per_second"], 3) for k, v in compared.items()},
                "ratio": round(compared["tuned"]["tokens_per_second"]
                               / compared["default"]["tokens_per_second"], 3),
                "runs": {k: v["runs"] for k, v in compared.items()}},
            "tuner": tuner.report(),
            "cache_split": {"slots_per_layer": choice.slots_per_layer,
                            "pin_fraction_of_slots": choice.pin_fraction,
                            "replay_hit_rate": round(choice.hit_rate, 4),
                            "replayed_tokens": len(recorder.tokens),
                            "table": [{"slots_per_layer": s, "pin_fraction_of_slots": f,
                                       "hit_rate": round(h, 4)} for s, f, h in choice.table]},
        }
        store.save(tuned, {"tokens_per_second": report["tokens_per_second"]})
        report["saved_to"] = str(store.path)
        try:
            session.flush()                 # the usage it learned, for the next start
        except OSError as e:
            log.warning("usage_state_not_saved: %s", e)
        return report
    finally:
        model.close()


# ------------------------------------------------------------------ live tuning
TUNER_MODES = ("off", "live", "live+idle")


class LiveTuner:
    """The tuner on live traffic: fed every decode step by the engine, on its thread.

    A window is `window_steps` consecutive decode steps at one batch size (a change of
    batch size starts the window again); its cost is the median step time divided by the
    batch size, i.e. seconds per decode step per sequence. Between windows the next
    settings are applied (placement only: output cannot change). A candidate is first
    checked on `check_prompt` (a private sequence, greedy): if its tokens differ from
    the incumbent's, it is rejected and an error logged. When the search ends the
    winners stay applied and `on_done(tuner)` is called (the daemon saves them).
    """

    def __init__(self, model: Model, knobs: list[Knob], start: Mapping[str, Any],
                 check_prompt: list[int], *, window_steps: int = WINDOW_STEPS, pairs: int = 4,
                 on_done: Callable[[OnlineTuner], None] | None = None, session=None,
                 budget_bytes: int | None = None, proposals: list[tuple[str, Any]] = ()):
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
        self.tuner = OnlineTuner(knobs, start, pairs=pairs, proposals=proposals)
        self.reference: list[int] | None = None
        self._checked: set[tuple[str, Any]] = set()
        self._times: list[float] = []
        self._batch: int | None = None
        self.finished = False
        self._prepare()

    def _prepare(self) -> None:
        """Check the candidate under trial (once) and apply the next window's settings."""
        if self.reference is None and not self.tuner.done:     # the incumbent's tokens, once
            self.live.apply(self.tuner.incumbent)
            self.reference = check_tokens(self.model, self.check_prompt)
        if self.reference is not None:
            check_candidates(self.model, self.tuner, self.check_prompt, self.reference,
                             self._checked)
        self.live.apply(self.tuner.settings())
        if self.tuner.done and not self.finished:
            self.finished = True
            self._choose_split()
            log.info("tuner_finished settings=%s cache_split=%s trials=%d", self.tuner.incumbent,
                     self.split or "unchanged", len(self.tuner.trials))
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
            log.info("tuner_cache_split_skipped recorded_tokens=%d (fewer than %d single-"
                     "sequence decode steps)", len(tokens), MIN_REPLAY_TOKENS)
            return
        split, choice = replay_cache_split(self.session, tokens, self.budget_bytes)
        if (split["cache_bytes"] != self.session.options.cache_bytes
                or split["pin_fraction"] != self.session.options.pin_fraction):
            self.session.rebuild(cache_bytes=split["cache_bytes"], pin_fraction=split["pin_fraction"])
            self.split = split
            log.info("tuner_cache_split_applied cache_bytes=%d pin_fraction=%.3f replay_hit_rate=%.4f",
                     split["cache_bytes"], split["pin_fraction"], choice.hit_rate)

    def stop(self, reason: str, keep: set[str] = frozenset()) -> None:
        """End the search now (engine thread): the incumbent's settings are applied, except
        the knobs in `keep` (which someone else just set), and nothing is saved."""
        if self.finished:
            return
        self.finished = True
        if self.recorder is not None:
            self.session.provider.routing_recorder = None
        self.live.apply({k: v for k, v in self.tuner.incumbent.items() if k not in keep})
        log.info("tuner_stopped reason=%s settings=%s", reason, self.tuner.incumbent)

    def step_done(self, seconds: float, batch_size: int) -> None:
        """One decode step of `batch_size` sequences took `seconds` (engine thread)."""
        if self.finished or seconds <= 0:
            return
        if batch_size != self._batch:
            self._times, self._batch = [], batch_size
        self._times.append(seconds)
        if len(self._times) < self.window_steps:
            return
        cost = statistics.median(self._times) / batch_size
        self._times = []
        trial = self.tuner.trial
        self.tuner.observe(cost, batch_size)
        if trial is not None and trial.outcome is not None:
            log.info("tuner_trial knob=%s a=%r b=%r outcome=%s gains=%s", trial.knob, trial.a,
                     trial.b, trial.outcome, [round(g, 4) for g in trial.gains])
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
            log.warning("tuned_settings_unavailable: %s", e)
    start = LiveKnobs(model).current()
    for knob in knobs:
        if knob.name in saved and saved[knob.name] in knob.values:
            start[knob.name] = saved[knob.name]
    if saved:
        log.info("tuned_settings_loaded settings=%s", {k.name: start[k.name] for k in knobs})
    if not knobs:
        return None

    budget = session.options.cache_bytes           # configured or planned: the ceiling
    split = {k: saved[k] for k in ("cache_bytes", "pin_fraction") if k in saved}
    if split and split.get("cache_bytes", budget) <= budget:
        session.rebuild(cache_bytes=split.get("cache_bytes"), pin_fraction=split.get("pin_fraction"))
        log.info("tuned_cache_split_loaded %s", split)
    holder: list[LiveTuner] = []

    def done(tuner: OnlineTuner) -> None:
        if store is None:
            return
        try:
            store.save({**valid_settings(saved, store.path), **tuner.incumbent,
                        **(holder[0].split if holder else {})},
                       {"trials": len(tuner.trials)})
        except (OSError, ValueError) as e:
            log.warning("tuned_settings_not_saved: %s", e)

    prompts = workload_prompts(model_dir, model.config.vocab_size)
    proposals = [] if saved else probe_proposals(knobs, state_dir, model_dir)
    tuner = LiveTuner(model, knobs, {**start}, prompts[0], on_done=done, session=session,
                      budget_bytes=budget, proposals=proposals)
    holder.append(tuner)
    return tuner
