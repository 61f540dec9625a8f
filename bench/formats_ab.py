"""Benchmark: the same model in several stored formats at one expert cache budget, interleaved.

    python bench/formats_ab.py --model NAME=DIR --model NAME=DIR [...]
        --expert-cache-bytes SIZE [--rounds 5] [--tokens 64] [--threads 2] [--naive]

The point of a smaller format is fewer bytes per expert: more experts fit the budget and
a miss reads less. This runs moed's streaming cache (its defaults: pins learned in a
warm-up run of the same workload, prefetch) on each checkpoint — e.g. the bf16, FP8 and
MXFP4 versions `moed make-model --dtype ...` writes from one seed, or a repacked one —
round by round (every model once per round, each from a cold cache with its shards'
pages dropped), timing the decode phase as `moed bench` does. `--naive` adds each
model's naive mode (LRU, no pins, no prefetch) to every round. Prints one JSON object:
per model its experts' format and bytes (expert_bytes: one expert's pieces; slot_bytes:
its aligned read), the budget as a share of its experts, the runs, the median tokens/s
with its spread, the ratio of medians to the first model and the per-round ratios,
bytes read and needed per token and the hit rate (medians).

example: python bench/formats_ab.py --model bf16=./bench-bf16 --model fp8=./bench-fp8
    --expert-cache-bytes 384M --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass

from daemon.commands.args import size
from daemon.commands.bench_runs import BenchConfig, bench_prompt, learned_usage, timed_run
from daemon.store.plans import max_slot_bytes
from daemon.store.reads import drop_page_cache, probe_direct_io
from daemon.store.streaming import StreamingExpertProvider, StreamingOptions
from ext.formats.checkpoint import Checkpoint
from ext.kernels._kernels import build_info
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from ext.models.model import Model

NAIVE = {"policy": "lru", "prefetch": False, "pin_fraction": 0.0}


@dataclass
class Subject:
    """One checkpoint under test, opened once."""

    name: str
    path: str
    bench: BenchConfig
    direct: bool

    def __post_init__(self):
        self.config = load_config(self.path)
        self.checkpoint = Checkpoint(self.path)
        self.layout = ExpertLayout(self.checkpoint, self.config)
        self.prompt = bench_prompt(self.config)
        self.learned = None

    def model(self, learned, options: dict) -> Model:
        """learned: daemon.commands.bench_runs.Learned of an earlier session, or None."""
        opts = StreamingOptions(cache_bytes=self.bench.cache_bytes, direct=self.direct, **options)
        provider = StreamingExpertProvider(self.layout, self.config, opts,
                                           usage_counts=learned.counts if learned else None,
                                           learned=learned.state if learned else None)
        return Model(self.config, self.checkpoint, self.layout, provider, self.bench.threads)

    def run(self, naive: bool) -> dict:
        drop_page_cache(self.checkpoint.shards)
        m = self.model(None, NAIVE) if naive else self.model(self.learned, {})
        try:
            return timed_run(m, self.prompt, self.bench)
        finally:
            m.experts.close()


def _model_arg(text: str) -> tuple[str, str]:
    name, _, path = text.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"--model {text!r}: give NAME=DIR")
    return name, path


def _summary(runs: list[dict], first: list[dict] | None) -> dict:
    tps = [r["tokens_per_second"] for r in runs]
    out = {"tokens_per_second": statistics.median(tps), "runs": [round(x, 3) for x in tps],
           "spread": [round(min(tps), 3), round(max(tps), 3)],
           "bytes_read_per_token": statistics.median(r["bytes_read_per_token"] for r in runs),
           "bytes_needed_per_token": statistics.median(r["bytes_needed_per_token"] for r in runs),
           "hit_rate": statistics.median(r["hit_rate"] for r in runs),
           "io_wait_share": statistics.median(r["io_wait_share"] for r in runs)}
    if first is not None:
        base = [r["tokens_per_second"] for r in first]
        out["over_first"] = out["tokens_per_second"] / statistics.median(base)
        out["over_first_by_round"] = [round(a / b, 3) for a, b in zip(tps, base)]
    return out


def main(argv=None) -> int:
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(
        description=doc[0] + "\n\n" + doc[2], epilog=doc[3],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=_model_arg, action="append", required=True,
                        metavar="NAME=DIR", help="a checkpoint and its name (repeat; the first "
                                                 "is the one the others are compared with)")
    parser.add_argument("--expert-cache-bytes", type=size, required=True, metavar="SIZE",
                        help="expert cache budget, bytes or with a K/M/G suffix (e.g. 384M)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per run (default: 64)")
    parser.add_argument("--threads", type=int, default=2, help="compute threads (default: 2)")
    parser.add_argument("--naive", action="store_true", help="also run each model's naive mode")
    args = parser.parse_args(argv)

    subjects = []
    for name, path in args.model:
        bench = BenchConfig(model=path, cache_bytes=args.expert_cache_bytes, tokens=args.tokens,
                            threads=args.threads)
        shard = Checkpoint(path).shards[0]
        subjects.append(Subject(name, path, bench, probe_direct_io(shard)))
    for s in subjects:
        s.learned = learned_usage(s.model(None, {}), s.prompt, s.bench)

    modes = ["moed", "naive"] if args.naive else ["moed"]
    runs = {(s.name, mode): [] for s in subjects for mode in modes}
    for r in range(args.rounds):
        for s in subjects:
            for mode in modes:
                runs[(s.name, mode)].append(s.run(naive=mode == "naive"))
                print(f"round {r + 1}/{args.rounds} {s.name} {mode}: "
                      f"{runs[(s.name, mode)][-1]['tokens_per_second']:.2f} tokens/s", file=sys.stderr)

    report = {"expert_cache_bytes": args.expert_cache_bytes, "tokens": args.tokens,
              "rounds": args.rounds, "threads": args.threads, "kernels": build_info(), "models": {}}
    first = subjects[0].name
    for s in subjects:
        total = sum(loc.nbytes for loc in s.layout)
        entry = {"path": s.path, "expert_format": s.layout.format,
                 "expert_bytes": s.layout.max_expert_bytes, "slot_bytes": max_slot_bytes(s.layout),
                 "expert_bytes_total": total, "budget_share_of_experts": args.expert_cache_bytes / total,
                 "io_path": "direct" if s.direct else "buffered"}
        for mode in modes:
            base = runs[(first, mode)] if s.name != first else None
            entry[mode] = _summary(runs[(s.name, mode)], base)
        report["models"][s.name] = entry
        s.checkpoint.close()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
