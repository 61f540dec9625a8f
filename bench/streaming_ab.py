"""Benchmark: variants of the streaming cache's options against each other and naive, interleaved.

    python bench/streaming_ab.py --model DIR --expert-cache-bytes SIZE [--rounds 4]
        [--tokens 64] --variant NAME=KEY:VALUE[,KEY:VALUE...] [--variant ...]

`moed bench` compares moed's defaults with the naive mode; this compares several settings
of `daemon.store.streaming.StreamingOptions` (e.g. ``idle_prefetch_min_precision``,
``prefetch_min_precision``, ``pin_fraction``, ``staging_slots``) in the same run, so the
disk's drift hits them all alike. A warm-up run learns the usage that moed's variants pin
from (as `moed bench` does); then every round runs each variant once, then naive (LRU,
no pins, no prefetch), each from a cold cache with the shards' pages dropped, and times
the decode phase as `moed bench` does. Prints one JSON object: per variant the runs, the
median tokens/s, median / naive's median, and the per-round ratios to naive.

example: python bench/streaming_ab.py --model ./bench-model --expert-cache-bytes 768M
    --variant default= --variant idle0.55=idle_prefetch_min_precision:0.55
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from daemon.commands.args import size
from daemon.commands.bench_runs import BenchConfig, bench_prompt, learned_usage, timed_run
from daemon.store.reads import drop_page_cache, probe_direct_io
from daemon.store.streaming import StreamingExpertProvider, StreamingOptions
from ext.formats.checkpoint import Checkpoint
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from ext.models.model import Model

NAIVE = {"policy": "lru", "prefetch": False, "pin_fraction": 0.0}


def parse_variant(text: str) -> tuple[str, dict]:
    """'name=key:value,key:value' -> (name, options). A value is read as JSON (0.55,
    4, true, null) or else kept as text; StreamingOptions checks the result."""
    name, _, spec = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"variant {text!r}: give NAME=KEY:VALUE,...")
    options = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition(":")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    try:
        StreamingOptions(cache_bytes=1, **options)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"variant {name}: {e}") from None
    return name, options


def main(argv=None) -> int:
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(
        description=doc[0] + "\n\n" + doc[2], epilog=doc[3],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="checkpoint directory (config.json + safetensors shards)")
    parser.add_argument("--expert-cache-bytes", type=size, required=True, metavar="SIZE",
                        help="expert cache budget, bytes or with a K/M/G suffix (e.g. 768M)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds; each runs every variant once, then naive (default: 4)")
    parser.add_argument("--tokens", type=int, default=64,
                        help="tokens generated per run (default: 64)")
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        metavar="NAME=KEY:VALUE,...",
                        help="a named setting of StreamingOptions fields, values as JSON; "
                             "'default=' is moed's defaults (repeatable)")
    args = parser.parse_args(argv)

    bench = BenchConfig(model=args.model, cache_bytes=args.expert_cache_bytes, tokens=args.tokens)
    config = load_config(bench.model)
    checkpoint = Checkpoint(bench.model)
    layout = ExpertLayout(checkpoint, config)
    direct = probe_direct_io(checkpoint.shards[0])
    prompt = bench_prompt(config)

    def model(learned, options: dict) -> Model:
        """learned: daemon.commands.bench_runs.Learned of an earlier session, or None."""
        opts = StreamingOptions(cache_bytes=bench.cache_bytes, direct=direct, **options)
        provider = StreamingExpertProvider(layout, config, opts,
                                           usage_counts=learned.counts if learned else None,
                                           learned=learned.state if learned else None)
        return Model(config, checkpoint, layout, provider, bench.threads)

    learned = learned_usage(model(None, {}), prompt, bench)

    variants = dict(args.variant)
    variants["naive"] = NAIVE
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, options in variants.items():
            drop_page_cache(checkpoint.shards)
            m = model(None if name == "naive" else learned, options)
            runs[name].append(timed_run(m, prompt, bench))
            m.experts.close()
            print(f"round {r + 1}/{args.rounds} {name}: "
                  f"{runs[name][-1]['tokens_per_second']:.2f} tokens/s", file=sys.stderr)
    naive = [x["tokens_per_second"] for x in runs["naive"]]
    report = {"model": args.model, "expert_cache_bytes": args.expert_cache_bytes,
              "tokens": args.tokens, "rounds": args.rounds, "io_path": "direct" if direct else "buffered",
              "variants": {}}
    for name, rs in runs.items():
        tps = [x["tokens_per_second"] for x in rs]
        report["variants"][name] = {
            "options": variants[name],
            "tokens_per_second": statistics.median(tps),
            "runs": [round(x, 3) for x in tps],
            "over_naive": statistics.median(tps) / statistics.median(naive),
            "over_naive_by_round": [round(a / b, 3) for a, b in zip(tps, naive)],
            "bytes_read_per_token": statistics.median(x["bytes_read_per_token"] for x in rs),
            "hit_rate": statistics.median(x["hit_rate"] for x in rs),
        }
    checkpoint.close()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
