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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-model", help="checkpoint dir (made if missing)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per run (default 64)")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs of each (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    parser.add_argument("--pause", type=float, default=1.0, help="idle seconds between runs")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from ext.makemodel import make_model
    from ext.models.model import Model

    model_dir = Path(args.model)
    if not (model_dir / "config.json").exists():
        print(f"writing {model_dir} ...", file=sys.stderr)
        make_model(model_dir, arch="qwen3_moe", layers=16, experts=32, top_k=4, hidden=1024,
                   intermediate=512, dtype="bf16", seed=0)
    torch.set_num_threads(args.threads)
    moed = Model.load(model_dir, n_threads=args.threads, experts="resident")
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # dtype "auto": bf16
    prompt = list(range(3, 19))
    moed_tps, ref_tps = [], []
    moed_run(moed, prompt, 4)  # warm-up: first-touch, thread pools
    transformers_run(ref, prompt, 4)
    for _ in range(args.runs):
        time.sleep(args.pause)  # let the other side's worker threads stop spinning
        moed_tps.append(moed_run(moed, prompt, args.tokens)[0])
        time.sleep(args.pause)
        ref_tps.append(transformers_run(ref, prompt, args.tokens)[0])
    m, r = statistics.median(moed_tps), statistics.median(ref_tps)
    weight_bytes = moed.checkpoint.total_bytes
    active = moed.config
    # Weight bytes one decode step reads: attention, router and top_k experts per
    # layer, plus lm_head (embeddings are a row lookup).
    attention = vars(moed.layers[0].attention).values()
    per_layer = (sum(a.nbytes for a in attention if a is not None)
                 + moed.layers[0].router.weight.nbytes)
    expert_bytes = moed.layout[(0, 0)].nbytes
    step_bytes = active.num_hidden_layers * (per_layer + active.top_k * expert_bytes) + moed.lm_head.nbytes
    print(json.dumps({
        "model": str(model_dir),
        "model_bytes": weight_bytes,
        "reference_dtype": str(ref.dtype),
        "threads": args.threads,
        "tokens_per_run": args.tokens,
        "runs": args.runs,
        "moed_decode_tokens_per_s": round(m, 2),
        "transformers_decode_tokens_per_s": round(r, 2),
        "speedup": round(m / r, 3),
        "weight_bytes_per_token": step_bytes,
        "moed_weight_gb_per_s": round(step_bytes * m / 1e9, 2),
        "moed_runs": [round(x, 2) for x in moed_tps],
        "transformers_runs": [round(x, 2) for x in ref_tps],
    }, indent=2))


if __name__ == "__main__":
    main()
