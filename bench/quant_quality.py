"""Quality of every repack variant: KL(original || repacked), top-1 agreement, bits/byte.

Each variant is written by `moed repack`'s own writer (ext/quant/repack.py: the routed
experts, and for "+dense" variants the attention projections, in moed's int4/int8
format) into a scratch directory, loaded natively (codes stay codes; the kernels decode
them) and teacher-forced against the unmodified model (ext/evaluate.py).

Texts, kept apart:
  calibration  importance statistics (importance weightings only): training modules of
               the default model (CALIBRATION_FILES), first --calibration-tokens tokens
  tuning       where choices are made: other training modules (TUNING_FILES), the first
               --per-file tokens (512) of each
  held-out     where the figures are reported: argparse.py (first 4096 tokens, the
               issue's reference text) and the other held-out modules of
               training/default_model.py (first --per-file tokens of each)
All from the standard library of the interpreter running this script (the default
model was trained on CPython 3.11.7's). For a `moed make-model` checkpoint (--random,
no meaningful text) every text is a fixed sequence of uniform random token ids
(seeded), and calibration uses another seed.

    python bench/quant_quality.py [--model default] [--variants all|NAME,...] [--random]

Prints one JSON object: per variant, its scheme, bits per weight and the figures of
each text. Progress on stderr, with each variant's row as a line "row {JSON}" when it is
done.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ext.evaluate import (TokenStream, log_softmax, score_window, summarize,  # noqa: E402
                          token_stream, window_logprobs)
from ext.formats.repacked import QuantScheme  # noqa: E402
from ext.models.model import Model  # noqa: E402
from ext.quant.importance import gather  # noqa: E402
from ext.quant.repack import RepackSpec, repack  # noqa: E402
from ext.tokenizer import Tokenizer  # noqa: E402

CALIBRATION_FILES = ("typing.py", "pathlib.py", "subprocess.py", "inspect.py",
                     "collections/__init__.py", "logging/__init__.py", "functools.py", "enum.py",
                     "ast.py", "dis.py", "pickle.py", "zipfile.py")
TUNING_FILES = ("optparse.py", "configparser.py", "tarfile.py", "datetime.py",
                "email/message.py", "http/client.py", "threading.py", "shutil.py")
HELD_OUT_REF = "argparse.py"


def parse_scheme(text: str) -> QuantScheme:
    """"int4-g32-min" / "int4-g64" / "int8-g32" -> QuantScheme."""
    parts = text.split("-")
    return QuantScheme(parts[0], int(parts[1][1:]), "min" in parts[2:])


def variants() -> dict[str, RepackSpec]:
    """Every variant measured, by name: <scheme>/<method>[/<weighting>][/p<prior>][+dense]."""
    out: dict[str, RepackSpec] = {}
    for g in (32, 64, 128):
        for s in (f"int8-g{g}", f"int4-g{g}-min", f"int4-g{g}"):
            scheme = parse_scheme(s)
            out[f"{s}/rtn"] = RepackSpec(scheme, method="rtn", weighting="uniform")
            if s.startswith("int8") and g > 32:
                continue
            out[f"{s}/search/magnitude"] = RepackSpec(scheme, weighting="magnitude")
            if s.startswith("int4") and g == 32:
                weightings = ("uniform", "importance") + (("importance*magnitude",)
                                                          if s.endswith("-min") else ())
                for w in weightings:
                    out[f"{s}/search/{w}"] = RepackSpec(scheme, weighting=w)
            out[f"{s}/gptq"] = RepackSpec(scheme, method="gptq")
    for prior in (0.0, 64.0):
        out[f"int4-g32-min/gptq/p{prior:g}"] = RepackSpec(parse_scheme("int4-g32-min"), method="gptq",
                                                           prior_tokens=prior)
    for s, m in (("int4-g32-min", "gptq"), ("int8-g32", "search")):
        out[f"{s}/{m}+dense-int8-g32"] = RepackSpec(parse_scheme(s), dense=parse_scheme("int8-g32"), method=m)
    return out


def variant_model(model_dir: str, spec: RepackSpec, stats, threads: int, scratch: Path) -> Model:
    """`moed repack`'s own writer into `scratch`, loaded natively (codes in RAM)."""
    repack(model_dir, scratch, spec, importance=stats, overwrite=True)
    return Model.load(scratch, n_threads=threads, experts="resident")


def _bits_per_weight(model: Model) -> dict:
    """Stored bits per routed-expert weight: every piece's bytes (codes, scales, mins)."""
    n = sum(w.shape[0] * w.shape[1] for loc in model.layout for w in loc.projections())
    return {"experts_bits_per_weight": round(8 * sum(loc.nbytes for loc in model.layout) / n, 4)}


def stdlib_dir() -> Path:
    """The standard library of the interpreter running this script."""
    return Path(sysconfig.get_paths()["stdlib"])


def files_text(names, tok: Tokenizer, per_file: int) -> str:
    """Each file's first `per_file` tokens, decoded back, joined by newlines."""
    parts = []
    for n in names:
        ids = tok.encode((stdlib_dir() / n).read_text(encoding="utf-8"), add_special_tokens=False)
        parts.append(tok.decode(ids[:per_file], skip_special_tokens=False))
    return "\n".join(parts)


def held_out_texts(model_dir: str, tok: Tokenizer, tokens: int, per_file: int,
                   context: int) -> dict[str, TokenStream]:
    """The default model's held-out texts (training_files.json): "argparse", the first
    `tokens` tokens of HELD_OUT_REF, and "held_out", the first `per_file` tokens of each
    other held-out module, joined."""
    return {"argparse": token_stream(tok, (stdlib_dir() / HELD_OUT_REF).read_text(encoding="utf-8"),
                                     tokens=tokens, context=context),
            "held_out": token_stream(tok, files_text(other_held_out(model_dir), tok, per_file),
                                     context=context)}


def other_held_out(model_dir: str) -> list[str]:
    """The held-out modules of training_files.json but HELD_OUT_REF, in its order."""
    held = json.loads((Path(model_dir) / "training_files.json").read_text())["held_out_files"]
    return [h for h in held if h != HELD_OUT_REF]


def held_out_info(model_dir: str, tokens: int, per_file: int) -> dict[str, str]:
    """What each text of `held_out_texts` is, for the JSON."""
    return {"argparse": f"{HELD_OUT_REF}, first {tokens} tokens (held out)",
            "held_out": f"the other {len(other_held_out(model_dir))} held-out modules, first "
                        f"{per_file} tokens of each"}


def _random_stream(vocab: int, tokens: int, seed: int, context: int) -> TokenStream:
    ids = np.random.default_rng(seed).integers(0, vocab, tokens + 1).astype(np.int64)
    return TokenStream(ids=ids, prefix=(), context=context, n_bytes=tokens, sha256=f"random-seed-{seed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="model directory (default: moed's default model)")
    parser.add_argument("--variants", default="all", help="comma-separated names, or all")
    parser.add_argument("--random", action="store_true",
                        help="texts are seeded random token ids (for make-model checkpoints)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of each random text / of argparse")
    parser.add_argument("--calibration-tokens", type=int, default=32768,
                        help="tokens of calibration text (default: moed repack's, 32768)")
    parser.add_argument("--per-file", type=int, default=512,
                        help="tokens from each held-out / tuning module (default 512)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--texts", default="argparse,held_out,tuning",
                        help="which texts to score (argparse, held_out, tuning)")
    args = parser.parse_args()
    from daemon.service.config import resolve_model_alias
    model_dir = resolve_model_alias(args.model)
    reference = Model.load(model_dir, n_threads=args.threads, experts="resident")
    vocab = reference.config.vocab_size
    texts: dict[str, TokenStream] = {}
    wanted = args.texts.split(",")
    if args.random:
        for i, name in enumerate(("random_a", "random_b")):
            texts[name] = _random_stream(vocab, args.tokens, 1000 + i, args.context)
        calibration = _random_stream(vocab, args.calibration_tokens, 7, args.context)
        text_info = {"random_a": "uniform random ids, seed 1000", "random_b": "seed 1001",
                     "calibration": "uniform random ids, seed 7"}
    else:
        tok = Tokenizer.from_model_dir(model_dir)
        files = json.loads((Path(model_dir) / "training_files.json").read_text())
        train = set(files["train_files"])
        assert set(CALIBRATION_FILES) <= train and set(TUNING_FILES) <= train
        assert not set(CALIBRATION_FILES) & set(TUNING_FILES)
        texts.update((name, stream) for name, stream in held_out_texts(
            model_dir, tok, args.tokens, args.per_file, args.context).items() if name in wanted)
        if "tuning" in wanted:
            texts["tuning"] = token_stream(tok, files_text(TUNING_FILES, tok, args.per_file), context=args.context)
        calibration = token_stream(tok, files_text(CALIBRATION_FILES, tok, 10**9),
                                   tokens=args.calibration_tokens, context=args.context)
        text_info = {**held_out_info(model_dir, args.tokens, args.per_file),
                     "tuning": f"training modules {list(TUNING_FILES)}, first {args.per_file} "
                               "tokens of each",
                     "calibration": f"training modules {list(CALIBRATION_FILES)}, first "
                                    f"{args.calibration_tokens} tokens"}
    print("reference log-probs ...", file=sys.stderr)
    ref_logp = {name: [window_logprobs(reference, inp, tgt.size) for inp, tgt in s.windows()]
                for name, s in texts.items()}
    all_variants = variants()
    names = list(all_variants) if args.variants == "all" else args.variants.split(",")
    stats = None
    if any(all_variants[n].needs_importance for n in names):
        t0 = time.perf_counter()
        stats = gather(reference, [inp for inp, _ in calibration.windows()],
                       second_moments=any(all_variants[n].method == "gptq" for n in names))
        print(f"importance from {stats.tokens} calibration tokens in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="quant-quality-"))
    for i, name in enumerate(names):
        spec = all_variants[name]
        t0 = time.perf_counter()
        model = variant_model(model_dir, spec, stats, args.threads, scratch / "variant")
        quant_s = time.perf_counter() - t0
        row = {"variant": name, **_bits_per_weight(model),
               "dense": None if spec.dense is None else f"int8-g{spec.dense.group_size}"}
        for tname, stream in texts.items():
            scores = [score_window(window_logprobs(model, inp, tgt.size), ref, tgt)
                      for (inp, tgt), ref in zip(stream.windows(), ref_logp[tname])]
            c = summarize(scores, stream)
            row[tname] = {"kl_mean": round(c.kl_mean_nats, 6), "kl_p99": round(c.kl_p99_nats, 5),
                          "top1": round(c.top1_agreement, 4),
                          "bpb": round(c.bits_per_byte_model, 4),
                          "bpb_reference": round(c.bits_per_byte_reference, 4), "tokens": c.tokens}
        model.close()
        rows.append(row)
        print(f"[{i + 1}/{len(names)}] {name} quantised in {quant_s:.1f} s: "
              + " ".join(f"{t}={row[t]['kl_mean']:.5f}/{row[t]['top1']:.3f}" for t in texts),
              file=sys.stderr)
        print("row " + json.dumps(row), file=sys.stderr, flush=True)   # a long sweep cut short keeps its rows
    shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps({"model": model_dir, "texts": text_info, "context": args.context,
                      "calibration_tokens": args.calibration_tokens, "variants": rows}, indent=1))


if __name__ == "__main__":
    main()
