"""What `moed tune` runs (daemon/commands/tune.py is the command): the self-tuner once, in
the foreground, on the built-in workload.

`run_tune`: defaults measured, the A/B search run (daemon/tuning/search.py), the cache
split chosen by replay, tuned vs default measured interleaved from a cold cache, the
prefill chunk measured (daemon/tuning/prefill.py), the winners saved for this model and
hardware (daemon/tuning/saved.py); `moed serve` starts from them.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from daemon.commands.figures import compare, spread
from daemon.service.loading import auto_prefill_chunk, expert_slot_bytes
from daemon.store.reads import drop_page_cache
from daemon.store.session import open_model
from daemon.store.state import StateReadOnlyError
from daemon.tuning.knobs import (IO_WORKERS, PREFETCH_WIDTH, THREADS, LiveKnobs, default_knobs,
                                 probe_proposals)
from daemon.tuning.prefill import (choose_prefill_chunk, measure_prefill_chunks, prefill_candidates,
                                   prefill_prompt)
from daemon.tuning.saved import PREFILL_CHUNK_SETTING, TunedStore, hardware_facts
from daemon.tuning.search import WINDOW_STEPS, replay_cache_split, tune
from daemon.tuning.workload import RoutingRecorder, Workload, workload_prompts
from ext.models.config import load_config
from ext.models.model import RESIDENT_PREFILL_CHUNK, Model
from telemetry.logs import get_logger

log = get_logger("tuning")


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
    compare_repeats: int = 5
    prefill_tokens: int = 1024
    prefill_rounds: int = 3
    numerics: str = "auto"
    seed: int = 0

def compare_settings(session, model: Model, prompts, settings_of: dict[str, dict], cfg: TuneConfig,
                     progress=None) -> dict:
    """Tokens/s of each named settings dict: fresh cache (pins from learned usage) per run,
    page cache dropped, runs interleaved (a b a b ...); medians and the per-run figures."""
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
    return {name: {"tokens_per_second": statistics.median(v), "runs": [round(x, 3) for x in v],
                   "spread": spread(v)} for name, v in runs.items()}

def confirms(pair_ratios: list[float], same: bool) -> bool:
    """Whether the final interleaved comparison confirms the tuned settings, from its
    tuned / default tokens/s pair by pair: not the defaults themselves, faster in the
    median pair and in all pairs but at most one — anything less is within the noise, and
    nothing unconfirmed is saved."""
    if same or not pair_ratios:
        return False
    wins = sum(r > 1.0 for r in pair_ratios)
    return statistics.median(pair_ratios) > 1.0 and wins >= len(pair_ratios) - 1


def run_tune(cfg: TuneConfig, progress: Callable[[str], None] | None = None) -> dict:
    """`moed tune`: tune threads, io workers and prefetch width by A/B on the built-in
    workload, the cache split by replay, compare tuned vs default, measure the prefill
    chunk, save the winners. Returns the JSON report. Raises the model's load errors and
    CacheBudgetError."""
    prefill_tokens = min(cfg.prefill_tokens, load_config(cfg.model).max_position_embeddings - 1)
    # the largest chunk serve's rule allows for this cache: the step buffers are built for
    # it, and the measurement tries the chunks up to it
    capacity = auto_prefill_chunk(load_config(cfg.model), cache_bytes=cfg.cache_bytes,
                                  threads=cfg.threads, context=max(prefill_tokens, 1) + 1, sequences=1)
    model, session = open_model(cfg.model, threads=cfg.threads, cache_bytes=cfg.cache_bytes,
                                io_workers=cfg.io_workers, state_dir=cfg.state_dir,
                                numerics=cfg.numerics, prefill_chunk=capacity)
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
            if not store.writable:
                raise StateReadOnlyError(f"{cfg.state_dir} is read-only")
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
        versus = compare(compared["tuned"]["runs"], compared["default"]["runs"], "tuned", "default")
        confirmed = confirms(versus["pair_ratios"], tuned == default)
        saved = tuned if confirmed else default
        if progress:
            progress(versus["verdict"])
            if not confirmed:
                progress("the final comparison did not confirm the tuned settings "
                         f"(tuned / default by pair: {versus['pair_ratios']}): the defaults are saved")
        prefill = None
        if prefill_tokens > 0:
            # with what is saved in force, from an empty cache and no page cache each run
            LiveKnobs(model).apply(saved)

            def fresh() -> None:
                session.rebuild(cache_bytes=saved["cache_bytes"], pin_fraction=saved["pin_fraction"])
                drop_page_cache(model.checkpoint.shards)

            # the incumbent: serve's rule, the largest chunk its cache allows when the experts
            # stream, RESIDENT_PREFILL_CHUNK when the cache holds them all
            streams = cfg.cache_bytes < expert_slot_bytes(model.layout)[1]
            incumbent = capacity if streams else min(capacity, RESIDENT_PREFILL_CHUNK)
            prefill = tune_prefill_chunk(model, prompts, capacity, incumbent, prefill_tokens,
                                         cfg.prefill_rounds, fresh, progress)
            saved = {**saved, PREFILL_CHUNK_SETTING: prefill["chosen"]}
        else:
            previous = store.load() or {}
            if PREFILL_CHUNK_SETTING in previous:
                saved = {**saved, PREFILL_CHUNK_SETTING: previous[PREFILL_CHUNK_SETTING]}
        report = {
            "model": str(cfg.model), "hardware": facts, "numerics": model.numerics_in_force(),
            "default": default, "tuned": tuned, "confirmed": confirmed, "saved": saved,
            "prefill_chunk": prefill,
            "tokens_per_second": {
                **{k: round(v["tokens_per_second"], 3) for k, v in compared.items()},
                "ratio": round(compared["tuned"]["tokens_per_second"]
                               / compared["default"]["tokens_per_second"], 3),
                "saved_over_default": 1.0 if not confirmed else round(
                    compared["tuned"]["tokens_per_second"] / compared["default"]["tokens_per_second"], 3),
                "runs": {k: v["runs"] for k, v in compared.items()},
                "spread": {k: v["spread"] for k, v in compared.items()},
                "pair_ratios": versus["pair_ratios"], "significant": versus["significant"],
                "verdict": versus["verdict"]},
            "tuner": tuner.report(),
            "cache_split": {"slots_per_layer": choice.slots_per_layer,
                            "pin_fraction_of_slots": choice.pin_fraction,
                            "replay_hit_rate": round(choice.hit_rate, 4),
                            "replayed_tokens": len(recorder.tokens),
                            "table": [{"slots_per_layer": s, "pin_fraction_of_slots": f,
                                       "hit_rate": round(h, 4)} for s, f, h in choice.table]},
        }
        store.save(saved, {"tokens_per_second": report["tokens_per_second"], "confirmed": confirmed})
        report["saved_to"] = str(store.path)
        try:
            session.flush()                 # the usage it learned, for the next start
        except OSError as e:
            log.warning("usage_state_not_saved", error=str(e))
        return report
    finally:
        model.close()



def tune_prefill_chunk(model: Model, prompts, capacity: int, incumbent: int, tokens: int,
                       rounds: int, before_run, progress=None) -> dict:
    """The prefill chunk measurement of `moed tune` (daemon/tuning/prefill.py): every
    candidate up to `capacity` (the model's step buffers) and `incumbent` (serve's fixed
    rule) on one prompt of `tokens` tokens, `rounds` interleaved rounds, each run after
    `before_run`. Returns the report: prompt tokens, candidates, tokens/s per chunk
    (median and spread), the incumbent and the chosen chunk."""
    ids = prefill_prompt(prompts, tokens)
    candidates = sorted(set(prefill_candidates(capacity)) | {incumbent})
    if progress:
        progress(f"prefill chunk: {tokens}-token prompt, chunks {candidates}, {rounds} rounds")
    runs = measure_prefill_chunks(model, ids, candidates, rounds, before_run, progress)
    chosen = choose_prefill_chunk(runs, incumbent)
    if progress:
        progress(f"prefill chunk {chosen} (the rule's {incumbent}: "
                 f"{statistics.median(runs[incumbent]):.1f} tokens/s, chosen "
                 f"{statistics.median(runs[chosen]):.1f})")
    return {"prompt_tokens": tokens, "rounds": rounds, "candidates": candidates,
            "incumbent": incumbent, "chosen": chosen,
            "tokens_per_second": {str(c): spread(v) for c, v in runs.items()}}
