"""The streaming provider's own CPU per decode step, naive mode against moed's defaults,
with no model compute in between: what moed's bookkeeping costs, measured quietly.

    python bench/provider_overhead.py --model DIR --expert-cache-bytes SIZE
        [--prompt-file F] [--tokens 512] [--rounds 9] [--options JSON]

A generation records the routing: --tokens tokens sampled (temperature 0.7, seed 0) after
the prompt (the first 256 tokens of --prompt-file, or a fixed 16-token pattern), every
expert resident. Its first half is one session of moed's defaults (what a later session
learns from: usage counts, pins, the referee's states). Then, in alternating rounds, a
fresh provider of each mode — naive (LRU, nothing pinned, no prefetch, no referee) and
moed's defaults starting from that session (--options: StreamingOptions fields changed
from the defaults there and in the learning session, e.g. '{"warm_start": false}', to
see what one mechanism costs) — replays the second half's routing as the
model drives a decode step (begin_step; per MoE layer observe_routing, acquire in read
order, release; end_step), reading every miss from the shards through the io pool
(buffered, so the page cache serves them and the disk's noise stays out). No hints are
offered (the model computes them; prefetch is judged by `moed bench`). Figures are the
main thread's CPU seconds per step (time.thread_time: waits for reads are not CPU),
medians over the rounds with their spread; `difference_us_per_step` is the median of the
per-round differences (moed - naive). On a small-expert model this cost is what decides
whether moed's defaults can be faster than its naive mode: a miss costs the main thread
about as much CPU as it waits for the read. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.commands.args import size                               # noqa: E402
from daemon.commands.bench_runs import bench_prompt, prompt_ids          # noqa: E402
from daemon.commands.figures import spread                          # noqa: E402
from daemon.service.config import resolve_model_alias               # noqa: E402
from daemon.store.streaming import StreamingExpertProvider, StreamingOptions   # noqa: E402
from daemon.store.trace import TraceWriter                           # noqa: E402
from ext.formats.checkpoint import Checkpoint                       # noqa: E402
from ext.models.config import load_config                           # noqa: E402
from ext.models.experts import ExpertLayout                         # noqa: E402
from ext.models.model import Model                                  # noqa: E402
from ext.sampling import Sampler, SamplingParams                    # noqa: E402
from scheduler.cache import PHASE_DECODE, PHASE_PREFILL, CacheBudgetError   # noqa: E402
from scheduler.replay import load_trace                              # noqa: E402

NAIVE = dict(prefetch=False, policy="lru", pin_fraction=0.0, learn_pins=False, referee=False)
Step = list[tuple[int, list[int]]]        # (MoE layer id, its experts) in layer order


def record_routing(model_dir: str, prompt: list[int], tokens: int) -> list[Step]:
    """The routing of `tokens` sampled decode steps after `prompt`, recorded as
    `--record-trace` records it (daemon.store.trace) and read back (scheduler.replay)."""
    config = load_config(model_dir)
    checkpoint = Checkpoint(model_dir)
    layout = ExpertLayout(checkpoint, config)
    total = sum(p.nbytes for loc in layout for p in loc.pieces()) * 2
    provider = StreamingExpertProvider(layout, config, StreamingOptions(cache_bytes=max(total, 1 << 20), **NAIVE))
    model = Model(config, checkpoint, layout, provider, 1)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "routing.jsonl"
        try:
            seq = model.new_sequence(capacity=len(prompt) + tokens + 1)
            provider.phase = PHASE_PREFILL
            logits = model.forward(seq, prompt)
            provider.phase = PHASE_DECODE
            provider.trace_writer = TraceWriter(trace, len(provider.moe_layers))
            sampler = Sampler(SamplingParams(temperature=0.7, seed=0))
            for _ in range(tokens):
                logits = model.forward(seq, [sampler.sample(logits[-1])])
        finally:
            model.close()                    # closes the trace writer with the provider
        moe_layers = list(provider.moe_layers)
        return [list(zip(moe_layers, layers)) for layers in load_trace(trace)]


def replay(provider: StreamingExpertProvider, steps: list[Step]) -> float:
    """Drive `provider` through `steps` as the model does; main-thread CPU s per step."""
    provider.phase = PHASE_DECODE
    t0 = time.thread_time()
    for step in steps:
        provider.begin_step(1)
        for layer, experts in step:
            provider.observe_routing(layer, np.asarray([experts], np.int32))
            for _ in provider.acquire_in_order(layer, experts):
                pass
            provider.release(layer, experts)
        provider.end_step()
    return (time.thread_time() - t0) / len(steps)


def run(model_dir: str, cache_bytes: int, prompt: list[int], tokens: int, rounds: int,
        options: dict | None = None) -> dict:
    steps = record_routing(model_dir, prompt, tokens)
    if len(steps) < 4:
        raise SystemExit(f"only {len(steps)} decode steps recorded; use more --tokens")
    half = len(steps) // 2
    config = load_config(model_dir)
    checkpoint = Checkpoint(model_dir)
    layout = ExpertLayout(checkpoint, config)

    def provider(options: dict, counts=None, learned=None) -> StreamingExpertProvider:
        return StreamingExpertProvider(layout, config,
                                       StreamingOptions(cache_bytes=cache_bytes, direct=False, **options),
                                       usage_counts=counts, learned=learned)

    options = dict(options or {})
    first = provider(options)
    replay(first, steps[:half])
    counts, learned = first.usage.counts(), first.learned_state()
    first.close()
    out: dict[str, list[float]] = {"naive": [], "moed": []}
    hits: dict[str, float] = {}
    for _ in range(rounds):
        for mode in ("naive", "moed"):
            p = provider(NAIVE) if mode == "naive" else provider(options, counts, learned)
            try:
                out[mode].append(replay(p, steps[half:]) * 1e6)
                h, m = p.cache.totals()
                hits[mode] = h / max(1, h + m)
            finally:
                p.close()
    diffs = [b - a for a, b in zip(out["naive"], out["moed"])]
    return {"model": model_dir, "expert_cache_bytes": cache_bytes, "options": options,
            "steps_replayed": len(steps) - half,
            "moe_layers": int(sum(config.moe_layers)), "rounds": rounds,
            "naive_us_per_step": spread(out["naive"]), "moed_us_per_step": spread(out["moed"]),
            "difference_us_per_step": statistics.median(diffs),
            "difference_share_of_naive": statistics.median(diffs) / statistics.median(out["naive"]),
            "hit_rate": hits, "load_average": os.getloadavg()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--expert-cache-bytes", type=size, required=True)
    ap.add_argument("--prompt-file", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--options", type=json.loads, default={},
                    help="StreamingOptions fields for moed's mode, as a JSON object")
    args = ap.parse_args(argv)
    model_dir = resolve_model_alias(args.model)
    ids = prompt_ids(model_dir, "", args.prompt_file, 256, args.tokens)
    prompt = bench_prompt(load_config(model_dir), ids)
    try:
        report = run(model_dir, args.expert_cache_bytes, prompt, args.tokens, args.rounds, args.options)
    except CacheBudgetError as e:
        raise SystemExit(f"--expert-cache-bytes: {e}") from None
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
