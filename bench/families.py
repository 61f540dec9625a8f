"""Benchmark figures of the frontier families (DeepSeek-V3, GLM-4.5, GPT-OSS): one JSON
object per command.

    python bench/families.py decode [--arch A ...] [--rounds 5] [--tokens 48] [--threads 2]
        moed's decode tokens/s against transformers' (bf16, all experts in RAM, the same
        threads) on a make-model checkpoint of a few hundred MB per family (written
        under --dir if missing). Rounds alternate moed, transformers, moed, ... (after
        a warm-up of each); per family: medians, min/max, the ratio of medians and the
        ratio round by round, and how many greedy tokens the two agree on (bf16
        weights, f32 arithmetic in moed, bf16 in transformers: they may part late).
    python bench/families.py recall [--arch A ...] [--cache-fraction 0.25]
        On a `--routing-skew 1` checkpoint per family: the top_k recall of moed's
        next-layer prefetch hint (the family's routing rule applied to the next
        layer's router on the current hidden state) against the experts that layer
        then chose, per layer, over 255 sampled decode steps (T = 0.7) — and the same
        hint ranked by the raw router logits instead of the rule (what an engine that
        ignores DeepSeek's correction bias and groups would predict); then `moed
        bench`'s prefetch_recall and hit rates with the experts streamed through a
        cache of --cache-fraction of them.
    python bench/families.py kv
        KV cache bytes per token of DeepSeek-V3's compressed cache against the expanded
        one: computed from the published config (61 layers, 128 heads, kv_lora_rank 512,
        qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128), and measured on a
        make-model checkpoint with those attention sizes (2 layers, bf16 weights, both
        computing and caching in f32): moed's cache arrays after a 64-token prompt,
        transformers' DynamicCache after it (transformers 5 caches the latent too) and
        the per-head keys and values transformers' attention expands it into
        (`expand_kv`), which is what an expanded cache holds.

Needs the test extra (torch, transformers). The machine's load shows in the decode
figures: read them with their spread.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from decode import moed_run, step_bytes, transformers_run
from served import spread

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FAMILIES = ("deepseek_v3", "glm4_moe", "gpt_oss")
# A few hundred MB in bf16: 8 layers of 16 experts (1024 x 512) each, top-4.
DECODE_SHAPE = dict(layers=8, experts=16, top_k=4, hidden=1024, intermediate=512, dtype="bf16",
                    seed=0)
# The routing-skew figures' shape: the held-out shape of ext/makemodel/skew.py's table.
RECALL_SHAPE = dict(layers=6, experts=64, top_k=8, hidden=512, intermediate=128, dtype="bf16",
                    seed=1)
PROMPT = "<|im_start|>user\nWrite a function that sorts a list.<|im_end|>\n<|im_start|>assistant\n"
DEEPSEEK_V3 = dict(num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512,
                   qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def checkpoint(directory: Path, arch: str, shape: dict, **extra) -> Path:
    """`make_model(directory, arch, **shape)` unless it holds a model already."""
    from ext.makemodel import make_model

    if not (directory / "config.json").exists():
        print(f"writing {directory} ...", file=sys.stderr)
        make_model(directory, arch=arch, **shape, **extra)
    return directory


def decode(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from ext.kernels._kernels import build_info
    from ext.models.model import Model

    torch.set_num_threads(args.threads)
    out = {"threads": args.threads, "kernels": build_info(), "tokens_per_run": args.tokens,
           "rounds": args.rounds, "families": {}}
    for arch in args.arch:
        model_dir = checkpoint(Path(args.dir) / f"decode-{arch}", arch, DECODE_SHAPE)
        moed = Model.load(model_dir, n_threads=args.threads, experts="resident")
        ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()    # dtype "auto": bf16
        prompt = list(range(3, 19))
        moed_run(moed, prompt, 4)                                       # warm-up
        transformers_run(ref, prompt, 4)
        ours, theirs = [], []
        for _ in range(args.rounds):
            time.sleep(args.pause)              # let the other side's threads stop spinning
            tps, moed_tokens = moed_run(moed, prompt, args.tokens)
            ours.append(tps)
            time.sleep(args.pause)
            tps, ref_tokens = transformers_run(ref, prompt, args.tokens)
            theirs.append(tps)
        agree = next((i for i, (a, b) in enumerate(zip(moed_tokens, ref_tokens)) if a != b),
                     len(ref_tokens))
        m, r = statistics.median(ours), statistics.median(theirs)
        out["families"][arch] = {
            "model": str(model_dir), "model_bytes": moed.checkpoint.total_bytes,
            "weight_bytes_per_token": step_bytes(moed),
            "moed_tokens_per_s": spread([round(x, 2) for x in ours]),
            "transformers_tokens_per_s": spread([round(x, 2) for x in theirs]),
            "speedup": round(m / r, 3),
            "speedup_per_round": spread([round(a / b, 3) for a, b in zip(ours, theirs)]),
            "greedy_tokens_agreeing": agree,
        }
        moed.close()
        del ref
    return out


class HintRecorder:
    """An expert provider around another: asks for the forward pass's next-layer hints
    and records, per decode step, the top_k experts each hint favours and the experts
    each MoE layer then acquires. Never changes what `acquire` returns."""

    def __init__(self, inner, top_k: int):
        self.inner, self.top_k = inner, top_k
        self.wants_hints, self.hint_depth = True, 1
        self.decoding = False
        self.hinted: dict[int, list[set[int]]] = {}
        self.chosen: dict[int, list[set[int]]] = {}

    def begin_step(self, tokens: int) -> None:
        self.decoding = tokens == 1
        self.inner.begin_step(tokens)

    def end_step(self) -> None:
        self.inner.end_step()

    def hint(self, layer: int, router_logits, ahead: int = 1) -> None:
        if self.decoding and ahead == 1:        # the next layer's guess (0: a layer's own)
            scores = router_logits() if callable(router_logits) else router_logits
            top = np.argsort(-scores[0], kind="stable")[:self.top_k]
            self.hinted.setdefault(layer, []).append(set(top.tolist()))

    def acquire(self, layer: int, experts):
        if self.decoding:
            self.chosen.setdefault(layer, []).append(set(int(e) for e in experts))
        return self.inner.acquire(layer, experts)

    def acquire_in_order(self, layer: int, experts):   # the decode path's acquire
        if self.decoding:
            self.chosen.setdefault(layer, []).append(set(int(e) for e in experts))
        return self.inner.acquire_in_order(layer, experts)

    def __getattr__(self, name):            # release, max_acquire, close, usage, ...
        return getattr(self.inner, name)

    def recall(self) -> dict[str, float]:
        """Per MoE layer that got hints: mean |hinted & chosen| / top_k over the steps."""
        return {str(l): round(float(np.mean([len(h & c) / self.top_k for h, c in
                                             zip(self.hinted[l], self.chosen[l])])), 3)
                for l in sorted(self.hinted)}


def hint_recall(model_dir: Path, rule_hint: bool) -> dict[str, float]:
    """HintRecorder.recall over 255 decode steps at T = 0.7; `rule_hint` False ranks the
    hint by the raw router logits instead of the family's rule."""
    from ext.generate import Generation
    from ext.models.model import Model
    from ext.sampling import SamplingParams
    from ext.tokenizer import Tokenizer

    model = Model.load(model_dir, n_threads=2, experts="resident")
    recorder = HintRecorder(model.experts, model.config.num_experts_per_tok)
    model.experts = recorder
    if not rule_hint:
        model.routing.hint_scores = lambda router, logits: logits
    prompt = Tokenizer.from_model_dir(model_dir).encode(PROMPT)
    list(Generation(model, prompt, max_tokens=256, sampling=SamplingParams(temperature=0.7, seed=1)))
    model.experts = recorder.inner
    model.close()
    return recorder.recall()


def recall(args: argparse.Namespace) -> dict:
    from daemon.commands.bench_runs import BenchConfig, run_bench
    from daemon.store.plans import plans_for
    from ext.formats.checkpoint import Checkpoint
    from ext.models.config import load_config
    from ext.models.experts import ExpertLayout

    out = {"shape": RECALL_SHAPE, "routing_skew": 1.0, "families": {}}
    for arch in args.arch:
        model_dir = checkpoint(Path(args.dir) / f"skew1-{arch}", arch, RECALL_SHAPE, routing_skew=1.0)
        rule, plain = hint_recall(model_dir, True), hint_recall(model_dir, False)
        plans = plans_for(ExpertLayout(Checkpoint(model_dir), load_config(model_dir)))
        budget = int(len(plans) * args.cache_fraction) * max(p.slot_bytes for p in plans.values())
        report = run_bench(BenchConfig(model=str(model_dir), cache_bytes=budget, tokens=64,
                                       repeats=args.repeats, threads=2, io_workers=2))
        out["families"][arch] = {
            "hint_recall_per_layer": rule,
            "hint_recall_mean": round(float(np.mean(list(rule.values()))), 3),
            "raw_logit_hint_recall_mean": round(float(np.mean(list(plain.values()))), 3),
            "bench": {"cache_fraction": args.cache_fraction, "cache_bytes": budget,
                      **{k: report[k] for k in ("prefetch_recall", "prefetch_precision", "hit_rate",
                                                "tokens_per_second", "speedup_vs_naive")},
                      "naive_hit_rate": report["naive"]["hit_rate"]},
        }
    return out


def kv(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from ext.models.families import kv_bytes_per_token
    from ext.models.config import load_config
    from ext.models.model import Model

    c = DEEPSEEK_V3
    heads, layers = c["num_attention_heads"], c["num_hidden_layers"]
    compressed = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    expanded = heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"])
    computed = {"floats_per_layer_compressed": compressed, "floats_per_layer_expanded": expanded,
                "f32_bytes_per_token_compressed": 4 * layers * compressed,
                "f32_bytes_per_token_expanded": 4 * layers * expanded,
                "bf16_bytes_per_token_expanded": 2 * layers * expanded,
                "ratio": round(expanded / compressed, 2)}
    # The published attention sizes (head_dim 128 gives them; a plain q_proj keeps the
    # file small, the cache does not depend on it), 2 layers, small MoE.
    model_dir = checkpoint(Path(args.dir) / "kv-deepseek_v3", "deepseek_v3",
                           dict(layers=2, experts=4, top_k=2, hidden=256, intermediate=64,
                                heads=heads, head_dim=128, dtype="bf16", seed=0,
                                options={"q_lora_rank": None}))
    config = load_config(model_dir)
    T = 64
    prompt = list(range(3, 3 + T))
    model = Model.load(model_dir, n_threads=2, experts="resident")
    seq = model.new_sequence(capacity=T)
    model.forward(seq, np.asarray(prompt, np.int64))
    moed_bytes = seq.kv.nbytes // seq.kv.capacity              # f32 arrays, capacity T
    model.close()
    # transformers (5.x) caches the latent too; the keys and values its attention then
    # expands the cache into, per head (`expand_kv`), are what an expanded cache holds.
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expanded_bytes = []
    for layer in ref.model.layers:
        attn = layer.self_attn

        def expand_kv(*a, expand=attn.expand_kv, **k):
            key, value = expand(*a, **k)
            expanded_bytes.append(sum(t.numel() * t.element_size() for t in (key, value)))
            return key, value
        attn.expand_kv = expand_kv
    with torch.no_grad():
        cache = ref(torch.tensor([prompt]), use_cache=True).past_key_values
    cached = sum(t.numel() * t.element_size() for layer in cache.layers
                 for t in (layer.keys, layer.values)) // T
    n = config.num_hidden_layers
    expanded_measured = sum(expanded_bytes) // T
    return {"deepseek_v3_computed": computed,
            "measured": {"model": str(model_dir), "layers": n, "prompt_tokens": T, "dtype": "f32",
                         "moed_cache_bytes_per_token": moed_bytes,
                         "moed_planner_bytes_per_token": kv_bytes_per_token(config),
                         "transformers_cache_bytes_per_token": cached,
                         "expanded_keys_values_bytes_per_token": expanded_measured,
                         "ratio": round(expanded_measured / moed_bytes, 2),
                         "per_layer_floats": {"moed": moed_bytes // n // 4,
                                              "expanded": expanded_measured // n // 4}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="figure", required=True)
    for name in ("decode", "recall", "kv"):
        p = sub.add_parser(name)
        p.add_argument("--dir", default="bench-families", help="where checkpoints are made")
        if name != "kv":
            p.add_argument("--arch", action="append", choices=FAMILIES, help="default: all three")
    sub.choices["decode"].add_argument("--rounds", type=int, default=5)
    sub.choices["decode"].add_argument("--tokens", type=int, default=48)
    sub.choices["decode"].add_argument("--threads", type=int, default=2)
    sub.choices["decode"].add_argument("--pause", type=float, default=1.0)
    sub.choices["recall"].add_argument("--cache-fraction", type=float, default=0.25)
    sub.choices["recall"].add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if getattr(args, "arch", None) is None and args.figure != "kv":
        args.arch = list(FAMILIES)
    print(json.dumps({"decode": decode, "recall": recall, "kv": kv}[args.figure](args), indent=2))


if __name__ == "__main__":
    main()
