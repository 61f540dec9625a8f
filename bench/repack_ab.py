"""Benchmark: one routing-skewed model as bf16, FP8 and its int4 repack, streamed at one budget.

    python bench/repack_ab.py [--dir DIR] [--expert-cache-bytes 384M] [--rounds 5]
        [--tokens 64] [--threads 2] [--dense-int8] [--naive]

Writes (once, into --dir, default ./bench-repack) a `moed make-model --routing-skew 1`
Qwen3-MoE checkpoint in bf16 (8 layers, 64 experts of top_k 8, hidden 1024,
moe_intermediate 512: 1.6 GB of bf16 experts, 4.2x a 384 MiB budget), the FP8 checkpoint
of the same seed (`--dtype fp8`), and the bf16 one repacked to int4 by `moed repack`'s
writer (groups of 32 with a minimum, searched scales; with --dense-int8 also a copy with
int8 attention). Then runs bench/formats_ab.py on them: every model once per round, from
a cold cache with its shards' pages dropped, pins learned in a warm-up run, moed's
defaults. Prints formats_ab's JSON: per model the median decode tokens/s with spread, the
ratio to bf16 (of medians and round by round), bytes read and needed per token, hit rate.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import formats_ab  # noqa: E402

from ext.formats.repacked import QuantScheme  # noqa: E402
from ext.makemodel import make_model  # noqa: E402
from ext.quant.repack import RepackSpec, repack  # noqa: E402

SIZES = dict(arch="qwen3_moe", layers=8, experts=64, top_k=8, hidden=1024, intermediate=512,
             routing_skew=1.0, seed=0)


def checkpoints(root: Path, dense_int8: bool) -> dict[str, Path]:
    """name -> directory of every model compared, written if missing."""
    out = {"bf16": root / "bf16", "fp8": root / "fp8", "int4": root / "int4"}
    for name in ("bf16", "fp8"):
        if not (out[name] / "config.json").exists():
            print(f"writing {out[name]} ...", file=sys.stderr)
            make_model(out[name], dtype=name, overwrite=True, **SIZES)
    repacks = {"int4": None}
    if dense_int8:
        out["int4+dense-int8"] = root / "int4-dense-int8"
        repacks["int4+dense-int8"] = QuantScheme("int8", 32)
    for name, dense in repacks.items():
        if not (out[name] / "config.json").exists():
            print(f"repacking {out['bf16']} into {out[name]} ...", file=sys.stderr)
            repack(out["bf16"], out[name], RepackSpec(QuantScheme("int4", 32, True), dense=dense),
                   overwrite=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="bench-repack", type=Path, help="where the models live")
    parser.add_argument("--expert-cache-bytes", default="384M")
    parser.add_argument("--rounds", default="5")
    parser.add_argument("--tokens", default="64")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--dense-int8", action="store_true", help="also int4 with int8 attention")
    parser.add_argument("--naive", action="store_true", help="also each model's naive mode")
    args = parser.parse_args()
    models = checkpoints(args.dir, args.dense_int8)
    argv = [a for name, path in models.items() for a in ("--model", f"{name}={path}")]
    argv += ["--expert-cache-bytes", args.expert_cache_bytes, "--rounds", args.rounds,
             "--tokens", args.tokens, "--threads", args.threads] + (["--naive"] if args.naive else [])
    return formats_ab.main(argv)


if __name__ == "__main__":
    sys.exit(main())
