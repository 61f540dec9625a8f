"""Benchmark: time to first token of a long prompt when the routed experts stream from disk
into a small cache, against the same prompt with every expert resident in RAM.

    python bench/prefill_streaming.py --model DIR [--prompt 2000] [--cache-fraction 0.25]
        [--rounds 5] [--threads 2] [--numerics auto] [--prefill-chunk auto|N]

Each round runs, in alternating order, (a) a model whose experts were read into RAM
before the clock starts (`experts="resident"`) and (b) a model whose experts stream
through moed's expert cache (`StreamingExpertProvider`, its default options) with a
budget of --cache-fraction of all routed experts' bytes, the shards' unmapped pages
dropped from the page cache first (`drop_page_cache`: POSIX_FADV_DONTNEED; the resident
model holds its experts in its own memory, not in the page cache). Both prefill the same --prompt token ids in one
`Model.forward` call (the model chunks it, `prefill_chunk` tokens a step: with
--prefill-chunk auto, what `moed serve` would choose, `daemon.service.loading.
auto_prefill_chunk`: RESIDENT_PREFILL_CHUNK for the resident model, up to
STREAMING_PREFILL_CHUNK for the streaming one; or N for both) and the time to first token is that call's time:
the first token's logits are its last row. The
streaming model is built fresh each round, after the clock stops for the other, and no
usage is learned beforehand (a cold start).

Printed as one JSON object: both times per round, medians and spreads, the ratio
streaming / resident per round (its median, min and max: the issue's goal is <= 1.3),
the bytes read from disk per prompt token and per prompt, the expert cache's hit rate,
the budget in bytes and slots, the numerics in force, the kernels' build (SIMD path),
and the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.commands.bench_runs import _counters  # noqa: E402
from daemon.service.loading import auto_prefill_chunk  # noqa: E402
from daemon.store.plans import plans_for  # noqa: E402
from daemon.store.reads import drop_page_cache, probe_direct_io  # noqa: E402
from daemon.store.streaming import StreamingExpertProvider, StreamingOptions  # noqa: E402
from ext.formats.checkpoint import Checkpoint  # noqa: E402
from ext.kernels import _kernels  # noqa: E402
from ext.models.config import load_config  # noqa: E402
from ext.models.experts import ExpertLayout  # noqa: E402
from ext.models.model import Model  # noqa: E402
from scheduler.cache import PHASE_PREFILL  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, metavar="DIR")
    p.add_argument("--prompt", type=int, default=2000, help="prompt tokens (default 2000)")
    p.add_argument("--cache-fraction", type=float, default=0.25,
                   help="expert cache budget as a fraction of all routed experts' bytes (default 0.25)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--numerics", default="auto")
    p.add_argument("--prefill-chunk", default="auto",
                   help="tokens a forward step takes: auto (as moed serve chooses) or N for both")
    args = p.parse_args(argv)
    if not 0 < args.cache_fraction <= 1:
        p.error("--cache-fraction: in (0, 1]")

    config = load_config(args.model)
    checkpoint = Checkpoint(args.model)
    layout = ExpertLayout(checkpoint, config)
    plans = plans_for(layout)
    expert_bytes = sum(plan.slot_bytes for plan in plans.values())
    slot = max(plan.slot_bytes for plan in plans.values())
    cache_bytes = max(int(args.cache_fraction * expert_bytes) // slot, config.top_k * sum(config.moe_layers)) * slot
    direct = probe_direct_io(checkpoint.shards[0])
    ids = [1 + (i * 7919) % (config.vocab_size - 1) for i in range(args.prompt)]
    if args.prefill_chunk == "auto":
        chunk_resident = auto_prefill_chunk(config, cache_bytes=None, threads=args.threads,
                                            context=args.prompt, sequences=1)
        chunk_streaming = auto_prefill_chunk(config, cache_bytes=cache_bytes, threads=args.threads,
                                             context=args.prompt, sequences=1)
    else:
        chunk_resident = chunk_streaming = int(args.prefill_chunk)
    resident = Model.load(args.model, n_threads=args.threads, experts="resident", numerics=args.numerics,
                          prefill_chunk=chunk_resident)
    resident.forward(resident.new_sequence(len(ids)), ids[:64])            # warm-up

    def streaming_run() -> dict:
        drop_page_cache(checkpoint.shards)
        provider = StreamingExpertProvider(layout, config, StreamingOptions(cache_bytes=cache_bytes,
                                                                            direct=direct))
        model = Model(config, checkpoint, layout, provider, args.threads, numerics=args.numerics,
                      prefill_chunk=chunk_streaming)
        try:
            provider.phase = PHASE_PREFILL
            before = _counters(provider)
            t0 = time.perf_counter()
            model.forward(model.new_sequence(len(ids)), ids)
            seconds = time.perf_counter() - t0
            after = _counters(provider)
        finally:
            provider.close()
        d = {k: after[k] - before[k] for k in after}
        lookups = d["hits"] + d["prefetch_hits"] + d["misses"]
        return {"seconds": seconds, "bytes_read": d["bytes_read"],
                "hit_rate": (d["hits"] + d["prefetch_hits"]) / lookups if lookups else 0.0,
                "numerics": model.numerics_in_force()}

    def resident_run() -> dict:
        t0 = time.perf_counter()
        resident.forward(resident.new_sequence(len(ids)), ids)
        return {"seconds": time.perf_counter() - t0}

    load_before = os.getloadavg()
    rounds = []
    for r in range(args.rounds):
        order = [("resident", resident_run), ("streaming", streaming_run)]
        row = {}
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            row[name] = fn()
        rounds.append(row)
        print(f"round {r + 1}/{args.rounds}: resident {row['resident']['seconds']:.2f} s, "
              f"streaming {row['streaming']['seconds']:.2f} s", file=sys.stderr, flush=True)
    res = [r["resident"]["seconds"] for r in rounds]
    st = [r["streaming"]["seconds"] for r in rounds]
    ratios = [s / t for s, t in zip(st, res)]
    read = [r["streaming"]["bytes_read"] for r in rounds]
    print(json.dumps({
        "model": args.model, "prompt_tokens": args.prompt,
        "prefill_chunk": {"configured": args.prefill_chunk, "resident": chunk_resident,
                          "streaming": chunk_streaming},
        "threads": args.threads, "numerics": rounds[0]["streaming"]["numerics"],
        "numerics_configured": args.numerics,
        "expert_bytes": expert_bytes, "cache_bytes": cache_bytes,
        "cache_fraction": round(cache_bytes / expert_bytes, 4), "cache_slots": cache_bytes // slot,
        "io_path": "direct" if direct else "buffered",
        "build": {k: _kernels.build_info()[k] for k in ("simd", "fast", "fast_bf16")
                  if k in _kernels.build_info()},
        "ttft_resident_s": {"median": round(statistics.median(res), 3), "min": round(min(res), 3),
                            "max": round(max(res), 3)},
        "ttft_streaming_s": {"median": round(statistics.median(st), 3), "min": round(min(st), 3),
                             "max": round(max(st), 3)},
        "streaming_over_resident": {"median": round(statistics.median(ratios), 3),
                                    "min": round(min(ratios), 3), "max": round(max(ratios), 3),
                                    "by_round": [round(x, 3) for x in ratios]},
        "bytes_read_per_prompt": int(statistics.median(read)),
        "bytes_read_per_prompt_token": int(statistics.median(read) / args.prompt),
        "expert_bytes_per_prompt_token_if_each_chunk_read_all": int(expert_bytes / chunk_streaming),
        "hit_rate": round(statistics.median(r["streaming"]["hit_rate"] for r in rounds), 4),
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
    }, indent=1))
    resident.close()
    checkpoint.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
