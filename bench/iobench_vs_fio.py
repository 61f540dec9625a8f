"""Benchmark: `moed iobench` (O_DIRECT) against fio with a matching job, interleaved.

    python bench/iobench_vs_fio.py --model DIR [--rounds 3] [--seconds 5]

For each queue depth QD in 1, 2, 4, 8, 16 and each round: one moed pass (O_DIRECT, QD io
workers, random expert-sized reads of the model's experts, `daemon.iobench.run_iobench`
with that single queue depth), then one fio job over the same shard files —
``--rw=randread --direct=1 --ioengine=psync --numjobs=QD --bs=<moed's block, rounded up to
4 KiB> --time_based --runtime=S --group_reporting``. Rounds alternate moed, fio, moed,
fio... Prints one JSON object: per QD the median GB/s of each, the spread, and
moed / fio. Needs fio on PATH.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from daemon.store.probe import model_target, run_iobench

QUEUE_DEPTHS = (1, 2, 4, 8, 16)


def fio_gb_per_s(files, block: int, qd: int, seconds: float) -> float:
    out = subprocess.run(
        ["fio", "--name=moed-match", f"--filename={':'.join(files)}", "--rw=randread",
         "--direct=1", "--ioengine=psync", f"--numjobs={qd}", f"--bs={block}",
         "--time_based", f"--runtime={seconds}", "--group_reporting",
         "--output-format=json"], check=True, capture_output=True, text=True).stdout
    job = json.loads(out)["jobs"][0]
    return job["read"]["bw_bytes"] / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    target = model_target(args.model)
    block = -(-target.block_bytes // 4096) * 4096
    results = []
    for qd in QUEUE_DEPTHS:
        moed, fio = [], []
        for r in range(args.rounds):
            report = run_iobench(target, seconds=args.seconds, repeats=2, queue_depths=(qd,),
                                 direct=True)
            moed.append(next(x["gb_per_s"] for x in report["results"] if x["mode"] == "direct"))
            fio.append(fio_gb_per_s(target.files, block, qd, args.seconds / 2))
            print(f"qd {qd} round {r + 1}: moed {moed[-1]:.3f} GB/s, fio {fio[-1]:.3f} GB/s",
                  file=sys.stderr, flush=True)
        m, f = statistics.median(moed), statistics.median(fio)
        results.append({"queue_depth": qd, "moed_gb_per_s": round(m, 4), "fio_gb_per_s": round(f, 4),
                        "moed_over_fio": round(m / f, 3),
                        "moed_runs": [round(x, 4) for x in moed], "fio_runs": [round(x, 4) for x in fio]})
    print(json.dumps({"model": args.model, "block_bytes": target.block_bytes, "fio_bs": block,
                      "rounds": args.rounds, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
