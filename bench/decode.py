"""Benchmark: decode tokens/s of moed against transformers' default bf16 path.

Both run the same bf16 checkpoint with all experts in RAM and the same number of
threads (`torch.set_num_threads`). Each run generates N tokens greedily from the
same prompt, with `min_new_tokens=N` on the transformers side so neither stops
early; decode tokens/s = (N - 1) / (t_N - t_1), t_i the time token i was
produced. Runs alternate (moed, transformers, moed, ...) and medians are
reported with their ratio. The checkpoint is written by `moed make-model` if
missing (default: Qwen3-MoE, 16 layers, hidden 1024, 32 experts, top-4,
moe_intermediate 512).

    python bench/decode.py [--model DIR] [--tokens 64] [--runs 3] [--threads 2]
        [--repack int4] [--repack int4+dense-int8] [--repack int8] [--no-transformers]

With --repack, moed also runs the same model repacked by `moed repack`'s writer (made
beside --model if missing), each round running every subject once; the JSON then gives
each repacked model's median tokens/s, its ratio to moed's bf16 (of medians, and round
by round) and the weight bytes one decode step reads.

Needs the test extra (torch, transformers). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def moed_run(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    seq = model.new_sequence(capacity=len(prompt) + n)
    logits = model.forward(seq, np.asarray(prompt, np.int64))
    times, tokens = [], []
    for i in range(n):
        token = int(np.argmax(logits[-1]))
        tokens.append(token)
        times.append(time.perf_counter())
        if i + 1 < n:
            logits = model.forward(seq, [token])
    return (n - 1) / (times[-1] - times[0]), tokens


def transformers_run(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []
            self.first = True

        def put(self, value):
            if self.first:  # the prompt
                self.first = False
                return
            self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             streamer=clock, pad_token_id=0)
    t = clock.times
    return (n - 1) / (t[-1] - t[0]), out[0, len(prompt):].tolist()


REPACKS = {  # --repack NAME: what `moed repack` writes (search, no calibration text)
    "int4": dict(scheme="int4", group_size=32, min=True, dense=False),
    "int4+dense-int8": dict(scheme="int4", group_size=32, min=True, dense=True),
    "int8": dict(scheme="int8", group_size=32, min=False, dense=False),
}


def repacked_dir(model_dir: Path, name: str) -> Path:
    """`model_dir` repacked as REPACKS[name] into a sibling directory (made if missing)."""
    from ext.formats.repacked import QuantScheme
    from ext.quant.repack import RepackSpec, repack

    out = model_dir.with_name(f"{model_dir.name}-{name}")
    if not (out / "config.json").exists():
        r = REPACKS[name]
        spec = RepackSpec(QuantScheme(r["scheme"], r["group_size"], r["min"]),
                          dense=QuantScheme("int8", 32) if r["dense"] else None)
        print(f"repacking {model_dir} into {out} ...", file=sys.stderr)
        repack(model_dir, out, spec, overwrite=True)
    return out


def step_bytes(model) -> int:
    """Weight bytes one decode step reads: every layer's attention and router, top_k
    experts per MoE layer, and lm_head (embeddings are a row lookup), as stored."""
    dense = sum(w.nbytes for m, w in model.dense_weights.items() if m != "lm_head")
    head = model.dense_weights["lm_head"].nbytes if "lm_head" in model.dense_weights else model.embed.nbytes
    experts = sum(model.config.top_k * model.layout[(l, 0)].nbytes
                  for l, is_moe in enumerate(model.config.moe_layers) if is_moe)
    return dense + head + experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-model", help="checkpoint dir (made if missing)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per run (default 64)")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs of each (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    parser.add_argument("--pause", type=float, default=1.0, help="idle seconds between runs")
    parser.add_argument("--repack", action="append", default=[], choices=sorted(REPACKS),
                        help="also run moed on the model repacked this way (repeatable; made "
                             "beside --model if missing), interleaved with the others")
    parser.add_argument("--no-transformers", action="store_true",
                        help="leave transformers out (moed's formats only)")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from ext.kernels._kernels import build_info
    from ext.makemodel import make_model
    from ext.models.model import Model

    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        print(f"writing {model_dir} ...", file=sys.stderr)
        make_model(model_dir, arch="qwen3_moe", layers=16, experts=32, top_k=4, hidden=1024,
                   intermediate=512, dtype="bf16", seed=0)
    torch.set_num_threads(args.threads)
    moeds = {"bf16": Model.load(model_dir, n_threads=args.threads, experts="resident")}
    for name in args.repack:
        moeds[name] = Model.load(repacked_dir(model_dir, name), n_threads=args.threads,
                                 experts="resident")
    ref = None if args.no_transformers else AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = list(range(3, 19))
    runs: dict[str, list[float]] = {name: [] for name in moeds}
    ref_tps: list[float] = []
    for m in moeds.values():
        moed_run(m, prompt, 4)  # warm-up: first-touch, thread pools
    if ref is not None:
        transformers_run(ref, prompt, 4)
    for _ in range(args.runs):      # rounds: every subject once, in the same order
        for name, m in moeds.items():
            time.sleep(args.pause)  # let the other side's worker threads stop spinning
            runs[name].append(moed_run(m, prompt, args.tokens)[0])
        if ref is not None:
            time.sleep(args.pause)
            ref_tps.append(transformers_run(ref, prompt, args.tokens)[0])
    med = {name: statistics.median(v) for name, v in runs.items()}
    base = moeds["bf16"]
    out = {
        "model": str(model_dir),
        "model_bytes": base.checkpoint.total_bytes,
        "threads": args.threads,
        "kernels": build_info(),
        "tokens_per_run": args.tokens,
        "runs": args.runs,
        "moed_decode_tokens_per_s": round(med["bf16"], 2),
        "weight_bytes_per_token": step_bytes(base),
        "moed_weight_gb_per_s": round(step_bytes(base) * med["bf16"] / 1e9, 2),
        "moed_runs": [round(x, 2) for x in runs["bf16"]],
    }
    if ref is not None:
        r = statistics.median(ref_tps)
        out.update({"reference_dtype": str(ref.dtype),
                    "transformers_decode_tokens_per_s": round(r, 2),
                    "speedup": round(med["bf16"] / r, 3),
                    "transformers_runs": [round(x, 2) for x in ref_tps]})
    if args.repack:
        out["repacked"] = {
            name: {"decode_tokens_per_s": round(med[name], 2),
                   "ratio_to_bf16": round(med[name] / med["bf16"], 3),
                   "ratio_per_round": [round(a / b, 3) for a, b in zip(runs[name], runs["bf16"])],
                   "weight_bytes_per_token": step_bytes(m),
                   "weight_gb_per_s": round(step_bytes(m) * med[name] / 1e9, 2),
                   "runs": [round(x, 2) for x in runs[name]],
                   "formats": m.weight_formats()}
            for name, m in moeds.items() if name != "bf16"}
    print(json.dumps(out, indent=2))

if __name__ == "__main__":
    main()
