"""What fast numerics costs in quality, per weight format: KL(exact || fast) on held-out text.

`Model.load(dir, numerics="fast")` dots int8 activations (quantised in blocks of 32)
with int8 / int4 / MXFP4 weight codes; "exact" (the default) dequantises the weights
exactly and is the oracle. This script measures the difference on the default model (a
small Qwen3-MoE trained on the Python standard library), one weight format at a time:

1. Models, built into --dir (default bench-fast-numerics/) and reused when present
   (--rebuild replaces them):
     int4    `moed repack`'s own writer (ext/quant/repack.py) with its default scheme
             and method: int4 in groups of 32 with a minimum, scales searched (int4-g32-min)
     int8    the same writer, int8 in groups of 32 (int8-g32)
     mxfp4   the routed experts re-encoded as OCP MXFP4 (per 32 values a scale
             2^(floor(log2 max |w|) - 2), values rounded to E2M1, saturating at 6) by
             make-model's encoder (ext/makemodel/lowbit.py), written as a Hugging Face
             directory moed reads natively: `<module>.weight_blocks` U8 [R, C/32, 16] and
             `<module>.weight_scales` U8 [R, C/32] with GPT-OSS's quantization_config
             ("quant_method": "mxfp4"); every other tensor and file as in the source.
     bf16    the default model itself (bf16 weights), for --numerics-under-test
             fast-bf16: bf16-dp (activations rounded to bf16, `ext.kernels._kernels`)
   Other repack schemes can be named as bench/quant_quality.py names them
   (e.g. int4-g64, int4-g32-min, int8-g128). The quantised models keep bf16 attention
   and dense weights, which fast-bf16 runs under bf16-dp too.
2. Each format's model loaded twice, with --numerics-under-test (default fast) and
   exact, and teacher-forced over the held-out texts (ext/evaluate.py, `moed eval`'s
   measure, reference = exact): "argparse", the first --tokens (4096) tokens of the
   stdlib's argparse.py, the default model's held-out reference module; and
   "held_out", the first --per-file (512) tokens of each of the other held-out modules
   of training_files.json, joined — both from the standard library of the interpreter
   running this script, in windows of --context tokens.
3. JSON on stdout, per format and text: mean, p99 and max KL(exact || under test) per
   token in nats, top-1 agreement, tokens scored, and whether the project's bar for
   fast numerics is met (mean KL <= 1e-4 nats and top-1 >= 0.995; a format meets it
   when every text does). Beside it, what the format's own rounding costs
   (KL(bf16 || exact quantised), the same measure against the unquantised model: a
   sanity check that each quantised model is the default model — a non-finite or
   large figure stops the run). Also the kernels' build_info() (its "simd" path and,
   in builds that have them, the "fast" kernels), the CPU model and the threads used.
   Progress on stderr.

`--numerics-under-test exact` compares exact with exact: every KL must be 0 and every
top-1 1.0 (the forward pass is deterministic), a self-check of the script.

    python bench/fast_numerics.py [--formats int4,int8,mxfp4] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import quant_quality  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from daemon.machine.system import cpu_model  # noqa: E402
from ext.evaluate import (Comparison, TokenStream, check_comparable, score_window,  # noqa: E402
                          summarize, window_logprobs)
from ext.formats.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint  # noqa: E402
from ext.formats.files import read_json  # noqa: E402
from ext.formats.quant import PLAIN_FORMATS  # noqa: E402
from ext.makemodel.families import EXPERT, TensorSpec  # noqa: E402
from ext.makemodel.lowbit import MXFP4_GROUP, Mxfp4, quantization_config  # noqa: E402
from ext.models.config import load_config  # noqa: E402
from ext.models.experts import ExpertLayout  # noqa: E402
from ext.models.model import Model  # noqa: E402
from ext.models.weights import weight_values  # noqa: E402
from ext.quant.repack import RepackSpec, repack  # noqa: E402
from ext.tokenizer import Tokenizer  # noqa: E402

BAR_KL_MEAN_NATS = 1e-4     # the project's bar for fast numerics, per text
BAR_TOP1 = 0.995
# KL(bf16 || exact quantised) above this (or not finite) means the quantised model is not
# the source model quantised: its int4, int8 and MXFP4 cost a few hundredths of a nat.
SANITY_KL_MEAN_NATS = 0.5
MXFP4 = "mxfp4"
BF16 = "bf16"      # the source model itself (its weights are bf16): fast = bf16-dp
ALIASES = {"int4": "int4-g32-min", "int8": "int8-g32"}   # moed repack's defaults


def repack_spec(fmt: str) -> RepackSpec:
    """`moed repack`'s spec for a scheme name ("int4", "int8" or quant_quality's
    "int4-g64", ...): its method without calibration text, "search"."""
    return RepackSpec(quant_quality.parse_scheme(ALIASES.get(fmt, fmt)), method="search")


def write_mxfp4(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write `model_dir` with its routed experts in MXFP4 into `out_dir` (module doc).

    The source's experts must be plain floats (f32, f16, bf16), one tensor per
    projection (not GPT-OSS's fused experts), with in_features a multiple of 32. The
    whole model is held in RAM (meant for the default model). Built in a temporary
    directory beside `out_dir` and renamed into place; an existing `out_dir` is replaced.
    Raises ValueError for a source it cannot convert.
    """
    src, out = Path(model_dir), Path(out_dir)
    raw_config = read_json(src / CONFIG_NAME)
    if raw_config.get("quantization_config") is not None:
        raise ValueError(f"{src}: already quantised ({raw_config['quantization_config']}); "
                         "give a model with float experts")
    config = load_config(src)
    encoding = Mxfp4()
    tensors = {}
    with Checkpoint(src) as checkpoint:
        experts = {}
        for loc in ExpertLayout(checkpoint, config):
            if loc.up is None:
                raise ValueError(f"{src}: fused gate_up experts (GPT-OSS) are not converted")
            for w in loc.projections():
                if (w.format not in PLAIN_FORMATS.values() or len(w.pieces) != 1
                        or w.pieces[0].name != w.name):
                    raise ValueError(f"{src}: expert weight {w.name!r} is not one float tensor "
                                     "of its own; only separate float experts are converted")
                if w.shape[1] % MXFP4_GROUP:
                    raise ValueError(f"{src}: {w.name} has {w.shape[1]} inputs, not a multiple "
                                     f"of MXFP4's {MXFP4_GROUP}")
                experts[w.name] = w
        for name in checkpoint.tensors:
            if name not in experts:
                tensors[name] = checkpoint.load(name)          # verbatim
        for name, w in experts.items():
            spec = TensorSpec(name, w.shape, "random", EXPERT)
            encoder = encoding.encoder(spec)
            arrays = [encoder.chunk(weight_values(checkpoint, w)), *encoder.extras()]
            for stored, array in zip(encoding.stored(spec), arrays, strict=True):
                assert array.shape == stored.shape, (stored, array.shape)
                tensors[stored.name] = array
    new_config = {**raw_config,
                  "quantization_config": quantization_config(MXFP4, config.model_type, [], "float")}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(new_config, indent=2) + "\n", encoding="utf-8")
        for entry in sorted(src.iterdir()):
            if (entry.is_file() and entry.name not in (CONFIG_NAME, INDEX_NAME)
                    and not entry.name.endswith(".safetensors")):
                shutil.copyfile(entry, tmp / entry.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def build(fmt: str, model_dir: str, root: Path, rebuild: bool, threads: int) -> Path:
    """The model of format `fmt` under `root`, written when absent (or `rebuild`)."""
    if fmt == BF16:
        return Path(model_dir)
    name = fmt if fmt == MXFP4 else ALIASES.get(fmt, fmt)
    out = root / name
    if (out / CONFIG_NAME).is_file() and not rebuild:
        print(f"{fmt}: reusing {out}", file=sys.stderr)
        return out
    t0 = time.perf_counter()
    if fmt == MXFP4:
        write_mxfp4(model_dir, out)
    else:
        repack(model_dir, out, repack_spec(fmt), overwrite=True, threads=threads)
    print(f"{fmt}: wrote {out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def _figures(c: Comparison, bar: bool) -> dict:
    out = {"kl_mean_nats": c.kl_mean_nats, "kl_p99_nats": c.kl_p99_nats,
           "kl_max_nats": c.kl_max_nats, "top1_agreement": c.top1_agreement, "tokens": c.tokens}
    if bar:
        out["meets_bar"] = bool(c.kl_mean_nats <= BAR_KL_MEAN_NATS and c.top1_agreement >= BAR_TOP1)
    return out


def measure(under: Model, exact: Model, bf16: Model, stream: TokenStream,
            label: str) -> tuple[Comparison, Comparison]:
    """(KL(exact || under), KL(bf16 || exact)) over `stream`, each window's exact
    log-probabilities computed once and used in both."""
    check_comparable(under, exact, stream)
    check_comparable(exact, bf16, stream)
    fast_scores, quant_scores = [], []
    windows = stream.windows()
    t0 = time.perf_counter()
    for i, (inputs, targets) in enumerate(windows):
        lp_exact = window_logprobs(exact, inputs, targets.size)
        fast_scores.append(score_window(window_logprobs(under, inputs, targets.size), lp_exact, targets))
        quant_scores.append(score_window(lp_exact, window_logprobs(bf16, inputs, targets.size), targets))
        print(f"  {label}: window {i + 1}/{len(windows)} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    return summarize(fast_scores, stream), summarize(quant_scores, stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default",
                        help="source model (default: moed's default model; the held-out texts "
                             "come from its training_files.json)")
    parser.add_argument("--dir", default="bench-fast-numerics",
                        help="where the quantised models are written and reused (default: %(default)s)")
    parser.add_argument("--rebuild", action="store_true", help="rewrite the models even when present")
    parser.add_argument("--formats", default="int4,int8,mxfp4",
                        help="comma-separated: int4, int8, mxfp4, bf16, or a repack scheme such as "
                             "int4-g64 (default: %(default)s)")
    parser.add_argument("--numerics-under-test", choices=["fast", "fast-bf16", "exact"], default="fast",
                        help="the numerics compared with exact (fast-bf16: bf16 weights too, bf16-dp; "
                             "the bf16 format needs it); exact is a self-check (KL 0)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of argparse.py (default 4096)")
    parser.add_argument("--per-file", type=int, default=512,
                        help="tokens of each other held-out module (default 512)")
    parser.add_argument("--context", type=int, default=512, help="tokens per window (default 512)")
    parser.add_argument("--threads", type=int, default=2, help="compute threads (default 2)")
    args = parser.parse_args()
    from daemon.service.config import resolve_model_alias
    from ext.kernels._kernels import build_info

    formats = args.formats.split(",")
    for fmt in formats:
        if fmt not in (MXFP4, BF16):
            repack_spec(fmt)                    # a bad name fails before any work
    model_dir = resolve_model_alias(args.model)
    tok = Tokenizer.from_model_dir(model_dir)
    texts = quant_quality.held_out_texts(model_dir, tok, args.tokens, args.per_file, args.context)
    root = Path(args.dir)
    paths = {fmt: build(fmt, model_dir, root, args.rebuild, args.threads) for fmt in formats}
    bf16 = Model.load(model_dir, n_threads=args.threads, experts="resident")
    rows = []
    t_start = time.perf_counter()
    for fmt, path in paths.items():
        exact = Model.load(path, n_threads=args.threads, experts="resident")
        under = Model.load(path, n_threads=args.threads, experts="resident",
                           numerics=args.numerics_under_test)
        if under.numerics_in_force() == "exact" and args.numerics_under_test != "exact":
            raise SystemExit(f"{fmt}: {path} loaded with numerics={args.numerics_under_test!r} runs "
                             f"{under.numerics_in_force()!r}: nothing to measure")
        row = {"format": fmt, "scheme": path.name, "model": str(path),
               "weights": under.weight_formats(), "texts": {}, "quantisation_vs_bf16": {}}
        try:
            for tname, stream in texts.items():
                fast, quant = measure(under, exact, bf16, stream, f"{fmt} {tname}")
                if not math.isfinite(quant.kl_mean_nats) or quant.kl_mean_nats > SANITY_KL_MEAN_NATS:
                    raise SystemExit(f"{fmt}: KL(bf16 || exact {fmt}) on {tname} is "
                                     f"{quant.kl_mean_nats} nats: {path} is not the default model "
                                     "quantised (delete it, or --rebuild)")
                row["texts"][tname] = _figures(fast, bar=True)
                row["quantisation_vs_bf16"][tname] = _figures(quant, bar=False)
                print(f"{fmt} {tname}: KL(exact||{args.numerics_under_test}) mean "
                      f"{fast.kl_mean_nats:.3g} p99 {fast.kl_p99_nats:.3g} max {fast.kl_max_nats:.3g} "
                      f"top-1 {fast.top1_agreement:.4f}; KL(bf16||exact) mean {quant.kl_mean_nats:.3g}",
                      file=sys.stderr, flush=True)
        finally:
            under.close()
            exact.close()
        row["meets_bar"] = all(t["meets_bar"] for t in row["texts"].values())
        rows.append(row)
    bf16.close()
    print(json.dumps({
        "model": model_dir, "numerics_under_test": args.numerics_under_test,
        "reference_numerics": "exact",
        "bar": {"kl_mean_nats_at_most": BAR_KL_MEAN_NATS, "top1_at_least": BAR_TOP1,
                "applies_to": "every text"},
        "texts": quant_quality.held_out_info(model_dir, args.tokens, args.per_file),
        "context": args.context, "threads": args.threads,
        "kernels": {k: v for k, v in build_info().items() if k in ("simd", "fast", "fast_bf16")},
        "cpu": cpu_model(), "seconds": round(time.perf_counter() - t_start, 1),
        "formats": rows}, indent=1))


if __name__ == "__main__":
    main()
