"""What `moed bench` runs (daemon/commands/bench.py is the command): decode speed of the
streaming cache against its naive mode and the roofline.

One run = a fresh provider (empty cache), the same prompt, sampling and seed, N new
tokens. Modes:
    naive  LRU eviction, nothing pinned, nothing prefetched; a layer's misses are all
           issued at once. Same io path, io workers and compute threads as moed.
    moed   the default eviction policy, pins learned in an earlier session (a warm-up
           run of the same workload, not counted), prefetch from next-layer routing
           (likely candidates at once, less likely ones into idle io workers).
Runs alternate (naive, moed, naive, ...) and each mode reports the median run. Before
every run the shards' pages are dropped from the page cache (POSIX_FADV_DONTNEED), so
buffered reads start cold too.

Figures (decode phase only, prefill excluded; per generated token):
    tokens_per_second       (N - 1) / (t_N - t_1)
    hit_rate                needed experts found ready / all needed experts
    bytes_read_per_token    issued aligned read lengths, demand + prefetch + pin loads
    prefetch_recall         needs a prefetch covered / (those + demand misses)
    prefetch_precision      prefetches used / prefetches issued
    prefetch_wasted_bytes   bytes of prefetches evicted or left unused
    io_wait_share           time the engine waited on reads / decode time
    bytes_needed_per_token  experts needed and not ready at their step's start (demand
                            misses + prefetches used) x slot bytes: what had to be read
    roofline_tokens_per_second
                            1 / max(bytes_needed_per_token / disk bandwidth,
                                    flops_per_token / kernel throughput), both measured in
                            this run: bandwidth with expert-sized reads through an io pool
                            of the same workers, throughput with the expert FFN kernel on
                            the model's own experts in their stored format.
The model's experts: expert_format (bf16, fp8_e4m3, mxfp4, ...), expert_bytes (the
largest expert's pieces: weights and scales), slot_bytes (the aligned read of one expert,
what a miss costs), expert_bytes_total.
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from daemon.commands.args import UsageError
from daemon.commands.figures import compare, spread
from daemon.store.plans import max_slot_bytes, plans_for
from daemon.store.reads import IoPool, drop_page_cache, probe_direct_io
from daemon.store.slots import SlotArena
from daemon.store.streaming import StreamingExpertProvider, StreamingOptions
from ext.formats.checkpoint import Checkpoint
from ext.models.config import ModelConfig, load_config
from ext.models.experts import ExpertLayout, expert_weights
from ext.models.families import family_of
from ext.models.model import Model
from ext.models.weights import read_weight
from ext.sampling import Sampler, SamplingParams
from scheduler.cache import PHASE_DECODE, PHASE_PREFILL


@dataclass
class BenchConfig:
    """What to run: model, budget, workload and machine knobs (see `moed bench --help`)."""

    model: str
    cache_bytes: int
    tokens: int = 64
    prompt_ids: tuple[int, ...] = ()
    temperature: float = 0.7
    seed: int = 0
    threads: int = 2
    io_workers: int = 2
    repeats: int = 3
    direct: bool | None = None
    prefetch_width: int | None = None
    prefetch: bool = True
    prefetch_min_precision: float = StreamingOptions.prefetch_min_precision
    idle_prefetch: bool = True
    pin_fraction: float = StreamingOptions.pin_fraction
    referee: bool = True
    numerics: str = "auto"          # the setting; the report gives it and the mode it resolved to


def measure_disk_bandwidth(layout: ExpertLayout, io_workers: int, direct: bool,
                           seconds: float = 1.5, seed: int = 0) -> float:
    """Bytes/s of random expert reads through an io pool of `io_workers` (2 in flight each)."""
    plans = list(plans_for(layout).values())
    drop_page_cache({s.path for p in plans for s in p.spans})
    slot = max(p.slot_bytes for p in plans)
    depth = 2 * io_workers
    rng = np.random.default_rng(seed)
    with SlotArena(depth, slot) as arena, IoPool(io_workers, direct) as pool:
        t0 = time.perf_counter()
        pending = [pool.submit(plans[rng.integers(len(plans))], arena.buffer(i), "demand")
                   for i in range(depth)]
        done = 0
        i = 0
        while time.perf_counter() - t0 < seconds or i < depth:
            done += pending[i % depth].result()
            pending[i % depth] = pool.submit(plans[rng.integers(len(plans))],
                                             arena.buffer(i % depth), "demand")
            i += 1
        for f in pending:
            done += f.result()
        return done / (time.perf_counter() - t0)


def measure_kernel_flops(config: ModelConfig, checkpoint: Checkpoint, layout: ExpertLayout,
                         threads: int, seconds: float = 0.5) -> float:
    """FLOP/s of the expert FFN kernel on one token through top_k of the model's own
    experts (their stored format: bf16, FP8, MXFP4, ...), read into RAM, computed by the
    family's expert kind (the compute term)."""
    H, I, K = config.hidden_size, config.moe_intermediate_size, config.top_k
    experts = [expert_weights(loc.projections(), lambda w: read_weight(checkpoint, w))
               for loc in itertools.islice(layout, K)]
    family = family_of(config.model_type)
    ffn = family.experts(config, layout.transposed)
    resident = ffn.load(family.tensors.moe(next(iter(layout)).layer),
                        lambda name, shape, f32=False: np.zeros(shape, np.float32))
    ids = list(range(len(experts)))
    x = np.ones((len(experts), H), np.float32)
    hbuf, y = np.empty((len(experts), I), np.float32), np.empty((len(experts), H), np.float32)
    starts = np.arange(len(experts) + 1, dtype=np.int64)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ffn(resident, ids, experts, x, starts, hbuf, y, threads)
        n += 1
    return n * len(experts) * 3 * 2 * H * I / (time.perf_counter() - t0)


def flops_per_token(config: ModelConfig) -> float:
    """Multiply-adds x 2 of one decode step's weight matrices (attention as the family's
    attention kind computes it, router, top_k experts, shared expert, dense MLPs,
    lm_head); attention over the cache is small at bench lengths and left out."""
    attn = family_of(config.model_type).attention.weights_per_token(config)
    H = config.hidden_size
    total = 0
    for is_moe in config.moe_layers:
        total += attn
        if is_moe:
            total += config.num_experts * H + config.top_k * 3 * H * config.moe_intermediate_size
            total += 3 * H * config.shared_expert_intermediate_size
        else:
            total += 3 * H * config.intermediate_size
    total += config.vocab_size * H
    return 2.0 * total


def bench_prompt(config: ModelConfig, prompt_ids=()) -> list[int]:
    """`prompt_ids`, or the fixed 16-token pattern every bench run uses by default."""
    return list(prompt_ids) or [1 + (i * 37) % (config.vocab_size - 1) for i in range(16)]


@dataclass(frozen=True)
class Learned:
    """What an earlier session leaves the next one: usage counts [MoE layers, experts] and
    the pin learner's and referee's state (StreamingExpertProvider's `learned=`)."""

    counts: np.ndarray
    state: dict


def learned_usage(model: Model, prompt: list[int], bench: BenchConfig) -> Learned:
    """The earlier session moed's runs start from: `bench`'s workload run once on `model`
    (then closed)."""
    timed_run(model, prompt, bench)
    learned = Learned(model.experts.usage.counts(), model.experts.learned_state())
    model.experts.close()
    return learned


def timed_run(model: Model, prompt: list[int], bench: BenchConfig) -> dict:
    """One timed generation on `model` (a fresh streaming provider); decode-phase figures."""
    provider: StreamingExpertProvider = model.experts
    sampler = Sampler(SamplingParams(temperature=bench.temperature, seed=bench.seed))
    seq = model.new_sequence(capacity=len(prompt) + bench.tokens)
    provider.phase = PHASE_PREFILL
    logits = model.forward(seq, prompt)
    provider.phase = PHASE_DECODE
    token = sampler.sample(logits[-1])
    before = _counters(provider)
    t_first = time.perf_counter()
    for _ in range(bench.tokens - 1):
        logits = model.forward(seq, [token])
        token = sampler.sample(logits[-1])
    elapsed = time.perf_counter() - t_first
    after = _counters(provider)
    d = {k: after[k] - before[k] for k in after}
    steps = bench.tokens - 1
    lookups = d["hits"] + d["prefetch_hits"] + d["misses"]
    covered = d["prefetches_used"]
    needed = (d["misses"] + covered) * provider.slot_bytes  # reads no policy could avoid here
    return {
        "tokens_per_second": steps / elapsed,
        "hit_rate": d["hits"] / lookups if lookups else 0.0,
        "bytes_read_per_token": d["bytes_read"] / steps,
        "bytes_needed_per_token": needed / steps,
        "prefetch_recall": covered / (covered + d["misses"]) if covered + d["misses"] else 0.0,
        "prefetch_precision": covered / d["prefetches_issued"] if d["prefetches_issued"] else 0.0,
        "prefetch_wasted_bytes": d["prefetches_wasted"] * provider.slot_bytes,
        "io_wait_share": d["io_wait_s"] / elapsed,
        "decode_seconds": elapsed,
    }


def adaptation_summary(p: StreamingExpertProvider) -> dict:
    """Where a run's learning ended: the cache's tiers, the pin learner's share, and the
    referee's mechanism states and latest estimate of the speed-up over naive."""
    cache = p.cache
    out = {"pinned_slots": cache.pinned_slots, "staging_slots": cache.staging_slots,
           "pinned_experts": len(cache.pins), "policy": cache.policy_name}
    a = p.adaptation
    if a is not None:
        if a.learner is not None:
            out["pin_share"] = a.learner.share
        if a.referee is not None:
            out["mechanisms"] = {m: s.on for m, s in a.referee.states.items() if m in a.referee.managed}
            out["referee_estimated_speedup"] = a.referee.verdict.estimated_speedup
    return out


def _counters(p: StreamingExpertProvider) -> dict:
    snap = p.cache.snapshot()
    io = p.io.stats()
    return {"hits": sum(snap.hits), "prefetch_hits": sum(snap.prefetch_hits),
            "misses": sum(snap.misses), "prefetches_used": sum(snap.prefetches_used),
            "prefetches_issued": sum(snap.prefetches_issued),
            "prefetches_wasted": sum(snap.prefetches_wasted) + sum(snap.prefetches_unused),
            "bytes_read": sum(io.bytes_issued.values()), "io_wait_s": p.io_wait_s}


def run_bench(bench: BenchConfig, progress=None) -> dict:
    """Warm-up, then alternating naive/moed runs; returns the JSON report (a dict)."""
    config = load_config(bench.model)
    checkpoint = Checkpoint(bench.model)
    layout = ExpertLayout(checkpoint, config)
    shards = checkpoint.shards
    direct = probe_direct_io(shards[0]) if bench.direct is None else bench.direct
    prompt = bench_prompt(config, bench.prompt_ids)

    def model_for(mode: str, learned: Learned | None) -> Model:
        moed = mode == "moed"
        opts = StreamingOptions(cache_bytes=bench.cache_bytes, io_workers=bench.io_workers,
                                direct=direct, prefetch=moed and bench.prefetch,
                                policy="default" if moed else "lru",
                                prefetch_width=bench.prefetch_width,
                                prefetch_min_precision=bench.prefetch_min_precision,
                                idle_prefetch_min_precision=(
                                    StreamingOptions.idle_prefetch_min_precision
                                    if bench.idle_prefetch else 1.0),
                                pin_fraction=bench.pin_fraction if moed else 0.0,
                                learn_pins=moed, referee=moed and bench.referee)
        provider = StreamingExpertProvider(layout, config, opts,
                                           usage_counts=learned.counts if learned else None,
                                           learned=learned.state if learned else None)
        return Model(config, checkpoint, layout, provider, bench.threads, bench.numerics)

    if progress:
        progress.note("warm-up: learning expert usage for moed's pins")
    learned = learned_usage(model_for("moed", None), prompt, bench)

    runs: dict[str, list[dict]] = {"naive": [], "moed": []}
    tiers: dict[str, dict] = {}
    ends: dict[str, dict] = {}
    for r in range(bench.repeats):
        for mode in ("naive", "moed"):
            drop_page_cache(shards)
            model = model_for(mode, learned if mode == "moed" else None)
            cache = model.experts.cache
            tiers[mode] = {"pinned_slots": cache.pinned_slots, "staging_slots": cache.staging_slots,
                           "dynamic_slots": sum(map(cache.dynamic_slots, cache.moe_layers))}
            runs[mode].append(timed_run(model, prompt, bench))
            ends[mode] = adaptation_summary(model.experts)
            numerics = model.numerics_in_force()
            model.experts.close()
            if progress:
                progress(r * 2 + (mode == "moed") + 1, 2 * bench.repeats)
    if progress:
        progress.note("measuring disk bandwidth and kernel throughput for the roofline")
    bandwidth = measure_disk_bandwidth(layout, bench.io_workers, direct)
    flops = measure_kernel_flops(config, checkpoint, layout, bench.threads)
    fpt = flops_per_token(config)

    def summary(mode: str) -> dict:
        rs = runs[mode]
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        med["roofline_tokens_per_second"] = 1.0 / max(med["bytes_needed_per_token"] / bandwidth,
                                                      fpt / flops)
        med["tokens_per_second_runs"] = [round(r["tokens_per_second"], 3) for r in rs]
        med["tokens_per_second_spread"] = spread([r["tokens_per_second"] for r in rs])
        med["io_path"] = "direct" if direct else "buffered"
        med["cache_slots"] = tiers[mode]
        med["at_end_of_last_run"] = ends[mode]
        return med

    moed, naive = summary("moed"), summary("naive")
    versus = compare([r["tokens_per_second"] for r in runs["moed"]],
                     [r["tokens_per_second"] for r in runs["naive"]], "moed", "naive")
    report = {**moed, "naive": naive,
              "speedup_vs_naive": moed["tokens_per_second"] / naive["tokens_per_second"],
              "speedup_vs_naive_pairs": versus["pair_ratios"],
              "speedup_vs_naive_significant": versus["significant"],
              "speedup_vs_naive_verdict": versus["verdict"],
              "fraction_of_roofline": moed["tokens_per_second"] / moed["roofline_tokens_per_second"],
              "disk_bytes_per_second": bandwidth, "kernel_flops_per_second": flops,
              "flops_per_token": fpt, "expert_cache_bytes": bench.cache_bytes,
              "expert_bytes_total": sum(loc.nbytes for loc in layout),
              "expert_format": layout.format, "expert_bytes": layout.max_expert_bytes,
              "slot_bytes": max_slot_bytes(layout),
              "tokens": bench.tokens, "repeats": bench.repeats, "threads": bench.threads,
              "numerics": numerics, "numerics_configured": bench.numerics,
              "io_workers": bench.io_workers, "temperature": bench.temperature,
              "prefetch": bench.prefetch, "idle_prefetch": bench.prefetch and bench.idle_prefetch,
              "model": str(Path(bench.model))}
    checkpoint.close()
    return report


def prompt_ids(model_dir: str, text: str = "", path: str | None = None, max_tokens: int = 256,
               new_tokens: int = 64) -> tuple[int, ...]:
    """The prompt's token ids: `text`, or the file at `path` cut to `max_tokens` tokens and
    to what the context leaves for `new_tokens`; () for neither. Raises UsageError naming
    a file that cannot be read as UTF-8 text."""
    from ext.tokenizer import Tokenizer

    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {path}: {e}") from None
    if not text:
        return ()
    ids = Tokenizer.from_model_dir(model_dir).encode(text)
    room = load_config(model_dir).max_position_embeddings - new_tokens - 1
    return tuple(ids[: max(1, min(max_tokens, room))]) if path is not None else tuple(ids)
