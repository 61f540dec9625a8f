"""`moed repack`: write an int4 / int8 copy of a model whose routed experts stream faster."""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from daemon.commands.args import (ExamplesFormatter, Parents, Progress, UsageError,
                                  check_model_dir, cpu_threads, nonempty, positive_int,
                                  read_text_file, size)

DEFAULT_GROUP_SIZE = 32
DEFAULT_CALIBRATION_TOKENS = 32768


def register(sub, parents: Parents) -> None:
    """`moed repack` and its options."""
    r = sub.add_parser(
        "repack", parents=[parents.common, parents.machine],
        description="Quantise the routed experts of --model into moed's int4 or int8 group "
                    "format and write a new model directory that moed serves like any other "
                    "(config.json with moed's quantization_config, tokenizer and generation "
                    "files copied, shards laid out so each expert is one aligned read). Dense "
                    "weights stay as they are unless --dense int8. This is lossy: measure what "
                    "it costs with 'moed eval --model OUT --reference MODEL --text FILE' on text "
                    "the model was not calibrated on. With --calibration-text the quantiser "
                    "pushes each weight's rounding error where that text's activations show it "
                    "matters least (GPTQ); without it, each group's scale and min are searched "
                    "for least error.",
        epilog="examples:\n"
               "  moed repack --model ./Qwen3-30B-A3B --scheme int4 --out ./Qwen3-30B-A3B-int4 \\\n"
               "      --calibration-text wiki.txt\n"
               "  moed repack --model default --scheme int8 --out ./default-int8",
        formatter_class=ExamplesFormatter)
    r.add_argument("--model", required=True, metavar="DIR", type=nonempty,
                   help='model directory to repack ("default": the embedded default model)')
    r.add_argument("--scheme", required=True, choices=["int4", "int8"],
                   help="routed experts' format: int4 (about 5 bits per weight) or int8 (8.5)")
    r.add_argument("--out", required=True, metavar="DIR", type=nonempty,
                   help="directory to write (must not exist or be empty, unless --force)")
    r.add_argument("--force", action="store_true",
                   help="replace an existing --out that a previous repack wrote (never "
                        "anything else, nor a directory containing --model)")
    r.add_argument("--group-size", type=int, choices=[32, 64, 128], default=DEFAULT_GROUP_SIZE,
                   help=f"weights per scale along a row (default: {DEFAULT_GROUP_SIZE})")
    r.add_argument("--symmetric", action="store_true",
                   help="int4 without a per-group minimum: (code - 8) x scale, 0.5 bit per "
                        "weight less, lower quality")
    r.add_argument("--method", choices=["auto", "rtn", "search", "gptq"], default="auto",
                   help="how codes are chosen: rtn (round to nearest), search (least-error "
                        "scale and min per group), gptq (error feedback from calibration text); "
                        "auto (default): gptq with --calibration-text, else search")
    r.add_argument("--calibration-text", action="append", default=[], metavar="FILE",
                   help="UTF-8 text whose activations guide the quantiser (repeatable; use text "
                        "like what the model will serve, not the text you evaluate on)")
    r.add_argument("--calibration-tokens", type=positive_int, default=DEFAULT_CALIBRATION_TOKENS,
                   metavar="N", help=f"tokens of calibration text used (default: "
                                     f"{DEFAULT_CALIBRATION_TOKENS})")
    r.add_argument("--dense", choices=["keep", "int8"], default="keep",
                   help="attention projections, shared experts and dense MLPs: keep as stored "
                        "(default) or int8 in groups of --group-size")
    r.add_argument("--lm-head", choices=["keep", "int8"], default="keep",
                   help="the output projection (lm_head, when not tied to the embeddings): keep "
                        "as stored (default) or int8 like the dense weights (needs --dense int8), "
                        "as llama.cpp's k-quant mixes quantise output.weight")
    r.add_argument("--shard-size", type=size, default=size("2G"), metavar="SIZE",
                   help="largest shard, e.g. 512M or 2G (default: 2G)")
    r.set_defaults(func=run)


MOMENT_MEMORY_SHARE = 0.25   # of the memory available, for GPTQ's second moments at once


def _calibration(args, model, method: str):
    """Statistics of `model` over --calibration-text, and their provenance: column
    importances, plus for GPTQ second moments gathered a few layers at a time within
    MOMENT_MEMORY_SHARE of the memory available (scheduler.planner's reading)."""
    from daemon.machine.memory import read_memory
    from ext.evaluate import token_stream
    from ext.quant.importance import LayerwiseMoments, gather
    from ext.tokenizer import Tokenizer
    from scheduler.planner import available_bytes

    texts = [read_text_file(path, "--calibration-text") for path in args.calibration_text]
    tokenizer = Tokenizer.from_model_dir(args.model)
    context = min(512, model.config.max_position_embeddings)
    stream = token_stream(tokenizer, "\n".join(texts), tokens=args.calibration_tokens,
                          context=context)
    windows = [inputs for inputs, _ in stream.windows()]
    progress = Progress("calibration windows")
    if method == "gptq":
        reading = read_memory()
        budget = int(MOMENT_MEMORY_SHARE * available_bytes(reading.mem_available_bytes,
                                                           reading.cgroup_limits))
        stats = LayerwiseMoments(model, windows, budget, progress)
    else:
        stats = gather(model, windows, progress)
    digest = hashlib.sha256("\0".join(texts).encode("utf-8")).hexdigest()
    return stats, {"calibration": {"files": [Path(p).name for p in args.calibration_text],
                                   "sha256": digest, "tokens": sum(len(w) for w in windows)}}


def run(args: argparse.Namespace) -> int:
    from ext.formats.repacked import QuantScheme
    from ext.models.model import Model
    from ext.quant.repack import RepackSpec, check_out_dir, repack
    from telemetry.logs import get_logger

    log = get_logger("repack")
    check_model_dir(args.model)
    if args.symmetric and args.scheme != "int4":
        raise UsageError("--symmetric applies to --scheme int4 (int8 is always symmetric)")
    method = args.method
    if method == "auto":
        method = "gptq" if args.calibration_text else "search"
    if method == "gptq" and not args.calibration_text:
        raise UsageError("--method gptq needs --calibration-text")
    experts = QuantScheme(args.scheme, args.group_size, args.scheme == "int4" and not args.symmetric)
    if args.lm_head == "int8" and args.dense != "int8":
        raise UsageError("--lm-head int8 takes the dense weights' scheme: give --dense int8 too")
    dense = QuantScheme("int8", args.group_size) if args.dense == "int8" else None
    spec = RepackSpec(experts, dense=dense, lm_head=args.lm_head == "int8", method=method)
    out = Path(args.out)
    check_out_dir(args.model, out, args.force)     # before hours of calibration, not after
    t0 = time.perf_counter()
    model = Model.load(args.model, n_threads=args.threads) if spec.needs_importance else None
    try:
        stats, provenance = _calibration(args, model, method) if model else (None, {})
        result = repack(args.model, out, spec, importance=stats, provenance=provenance,
                        shard_size=args.shard_size, overwrite=args.force,
                        threads=args.threads or cpu_threads(),
                        progress=Progress(f"repacking into {out}", unit="B"))
    finally:
        if model is not None:
            model.close()
    for path in result.stale_removed:
        log.info("repack_removed_stale_temporary", path=str(path))
    quantised_source = result.source_format not in ("f32", "f16", "bf16")
    for loss in result.losses:   # a second rounding of FP8 / MXFP4 experts is worth a warning
        (log.warning if quantised_source else log.info)("repack_loses_precision",
                                                        model=args.model, detail=loss)
    log.info("repack_finished", model=args.model, out=str(out), scheme=result.config.label(),
             method=method, shards=result.shards, expert_bytes_before=result.expert_bytes_before,
             expert_bytes_after=result.expert_bytes_after,
             seconds=round(time.perf_counter() - t0, 1))
    print(json.dumps({"model": str(out), "source_format": result.source_format,
                      "scheme": result.config.label(), "method": method,
                      "bits_per_weight": round(experts.bits_per_weight, 3),
                      "expert_bytes_before": result.expert_bytes_before,
                      "expert_bytes_after": result.expert_bytes_after,
                      "shards": result.shards, "losses": result.losses}, indent=2))
    return 0
