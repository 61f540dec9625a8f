"""`moed eval`: what a model's weights cost against a reference, over teacher-forced text."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from daemon.commands.args import (MODEL_HELP, ExamplesFormatter, Parents, Progress, UsageError,
                                  add_numerics, check_model_dir, nonempty, positive_int,
                                  read_text_file)


def register(sub, parents: Parents) -> None:
    """`moed eval` and its options."""
    e = sub.add_parser(
        "eval", parents=[parents.common, parents.machine],
        description="Feed the same text to a model and a reference (e.g. a repacked model and "
                    "the model it came from), in windows of --context tokens, and print JSON: "
                    "mean, p99 and max per-token KL(reference || model) in nats, top-1 "
                    "agreement, and both models' bits per byte. Both models must share a "
                    "tokenizer. Deterministic: the same inputs give the same figures. "
                    "--numerics applies to --model (default auto, as moed serves it: fast "
                    "for int8/int4/MXFP4 weights); the reference always runs exact, so "
                    "--model D --reference D --numerics fast measures what fast numerics costs "
                    "on D's weights, and --numerics exact what the weights alone cost.",
        epilog="example: what an int4 repack of the default model costs, over a text of yours\n"
               "  moed repack --model default --scheme int4 --out ./default-int4\n"
               "  moed eval --model ./default-int4 --reference default --text ./my_code.py "
               "--tokens 4096\n"
               "(--text: any UTF-8 file; for the default model, Python code it was not "
               "trained on)",
        formatter_class=ExamplesFormatter)
    e.add_argument("--model", required=True, metavar="DIR", type=nonempty, help=MODEL_HELP)
    e.add_argument("--reference", required=True, metavar="DIR", type=nonempty,
                   help='the model to compare against ("default": the embedded default model)')
    e.add_argument("--text", required=True, metavar="FILE", type=nonempty,
                   help="UTF-8 text to teacher-force (keep it out of any text used to build "
                        "the model, e.g. a held-out file)")
    e.add_argument("--tokens", type=positive_int, default=None, metavar="N",
                   help="score the first N positions of the text (default: all of it)")
    e.add_argument("--context", type=positive_int, default=None, metavar="W",
                   help="tokens per teacher-forced window, each a fresh sequence (default: "
                        "512, or the models' max_position_embeddings if smaller)")
    add_numerics(e)
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from daemon.service.config import resolve_model_alias
    from ext.evaluate import DEFAULT_CONTEXT, EvaluationInputError, compare, token_stream
    from ext.models.model import Model
    from ext.tokenizer import Tokenizer
    from telemetry.logs import get_logger

    log = get_logger("eval")
    args.reference = resolve_model_alias(args.reference)
    check_model_dir(args.model)
    if not Path(args.reference).is_dir():
        raise UsageError(f"--reference: {args.reference} is not a model directory")
    text = read_text_file(args.text, "--text")
    t0 = time.perf_counter()
    model = Model.load(args.model, n_threads=args.threads, numerics=args.numerics)
    reference = Model.load(args.reference, n_threads=args.threads)          # exact numerics
    try:
        context = args.context or min(DEFAULT_CONTEXT, model.config.max_position_embeddings,
                                      reference.config.max_position_embeddings)
        ref_tok = Tokenizer.from_model_dir(args.reference)
        stream = token_stream(ref_tok, text, tokens=args.tokens, context=context)
        own = token_stream(Tokenizer.from_model_dir(args.model), text, tokens=args.tokens,
                           context=context)
        if own.sha256 != stream.sha256 or own.prefix != stream.prefix:
            raise EvaluationInputError(f"{args.model} and {args.reference} tokenize {args.text} "
                                       "differently: compare models that share a tokenizer")
        result = compare(model, reference, stream, progress=Progress("eval windows"))
        weights = {"model": model.weight_formats(), "reference": reference.weight_formats()}
    finally:
        model.close()
        reference.close()
    log.info("eval_finished", model=args.model, reference=args.reference, tokens=result.tokens,
             numerics=weights["model"]["numerics"], numerics_configured=args.numerics,
             kl_mean_nats=round(result.kl_mean_nats, 6), top1_agreement=round(result.top1_agreement, 4),
             seconds=round(time.perf_counter() - t0, 2))
    print(json.dumps({"model": args.model, "reference": args.reference, "text": args.text,
                      "token_ids_sha256": stream.sha256, **result.to_json(),
                      "weights": weights}, indent=2))
    return 0
