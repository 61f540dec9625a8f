"""`moed make-model`: a random-weight checkpoint in the exact Hugging Face layout."""
from __future__ import annotations

import argparse
import json

from daemon.commands.args import Parents, Progress, nonempty, positive_int, size
from ext.makemodel import ARCHITECTURES


def _field(text: str) -> tuple[str, object]:
    """FIELD=JSON as (field, value); a bad one is an argparse usage error (exit 2)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected FIELD=JSON, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{name}: value {value!r} is not JSON ({e.msg})") from None


def register(sub, parents: Parents) -> None:
    """`moed make-model` and its options."""
    m = sub.add_parser(
        "make-model", parents=[parents.common],
        description="Write a checkpoint with random weights (config.json, tokenizer, and one "
                    "model.safetensors, or shards of at most --shard-size with a "
                    "model.safetensors.index.json when the tensors are larger) that "
                    "transformers and moed both load. For tests and benchmarks: the text it "
                    "generates is noise.",
        epilog="example: moed make-model --arch qwen3_moe --layers 4 --experts 16 --top-k 4 "
               "--hidden 256 --intermediate 128 --out ./demo-model")
    m.add_argument("--arch", required=True, choices=list(ARCHITECTURES),
                   help="model family (config.json model_type)")
    m.add_argument("--layers", type=positive_int, required=True, metavar="L",
                   help="num_hidden_layers")
    m.add_argument("--experts", type=positive_int, required=True, metavar="E",
                   help="routed experts per layer")
    m.add_argument("--top-k", type=positive_int, required=True, metavar="K",
                   help="experts per token")
    m.add_argument("--hidden", type=positive_int, required=True, metavar="H", help="hidden_size")
    m.add_argument("--intermediate", type=positive_int, required=True, metavar="I",
                   help="each expert's intermediate size")
    m.add_argument("--dtype", choices=["f32", "f16", "bf16", "fp8", "mxfp4"], default="bf16",
                   help="stored dtype (default: bf16); fp8: attention and expert projections "
                        "FP8 E4M3 with 128x128 block scales (as DeepSeek-V3 and the Qwen3 "
                        "FP8 releases), the rest bf16; mxfp4: routed experts MXFP4 (GPT-OSS's "
                        "blocks and scales), the rest bf16")
    m.add_argument("--scale-dtype", choices=["f32", "bf16", "e8m0"], default=None,
                   help="fp8 only: dtype of the block scales (default f32; e8m0: UE8M0 "
                        "exponents stored as U8, implies --scale-fmt ue8m0)")
    m.add_argument("--scale-fmt", choices=["float", "ue8m0"], default=None,
                   help="fp8 only: ue8m0 rounds every block scale up to a power of two and "
                        "writes \"scale_fmt\": \"ue8m0\" (DeepSeek-V3.1); default float")
    m.add_argument("--shard-size", type=size, default=size("2G"), metavar="SIZE",
                   help="largest shard, e.g. 64M or 2G (default: 2G)")
    m.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default: 0)")
    m.add_argument("--vocab-size", type=positive_int, default=None, metavar="V",
                   help="tokenizer vocabulary (default: 512)")
    m.add_argument("--heads", type=positive_int, default=None, metavar="N",
                   help="attention heads (default: hidden / 64, or 4 when that is under 2)")
    m.add_argument("--kv-heads", type=positive_int, default=None, metavar="N",
                   help="key/value heads (default: half the heads, all when they are odd; "
                        "deepseek_v3: all)")
    m.add_argument("--head-dim", type=positive_int, default=None, metavar="D",
                   help="head_dim (qwen3_moe, glm4_moe, gpt_oss; deepseek_v3: sizes the MLA "
                        "defaults); default hidden / heads")
    m.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", type=_field,
                   help="deepseek_v3, glm4_moe, gpt_oss: a config.json field of the family, "
                        "value in JSON, instead of make-model's default (repeatable), e.g. "
                        "--set q_lora_rank=null --set n_group=4 --set topk_group=2 --set "
                        "'rope_parameters={\"rope_type\": \"yarn\", \"factor\": 4.0, "
                        "\"original_max_position_embeddings\": 1024}'; the tensors follow them")
    m.add_argument("--initializer-range", type=float, default=0.02, metavar="R",
                   help="standard deviation of the random weights (default: 0.02)")
    m.add_argument("--routing-skew", type=float, default=None, metavar="S",
                   help="build routers whose expert popularity per layer follows Zipf(S) (about 1 "
                        "on real code workloads) with realistic reuse between consecutive "
                        "tokens; default: plain random weights")
    m.add_argument("--force", action="store_true", help="replace an existing checkpoint in --out")
    m.add_argument("--out", required=True, metavar="DIR", type=nonempty, help="directory to write")
    m.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:
    from ext.makemodel import make_model

    out = make_model(args.out, arch=args.arch, layers=args.layers, experts=args.experts,
                     top_k=args.top_k, hidden=args.hidden, intermediate=args.intermediate,
                     dtype=args.dtype, shard_size=args.shard_size, seed=args.seed,
                     vocab_size=args.vocab_size, heads=args.heads, kv_heads=args.kv_heads,
                     head_dim=args.head_dim, options=dict(args.set) or None,
                     initializer_range=args.initializer_range, overwrite=args.force,
                     routing_skew=args.routing_skew, scale_dtype=args.scale_dtype,
                     scale_fmt=args.scale_fmt, progress=Progress(f"writing {args.out}", unit="B"))
    print(json.dumps({"model": str(out)}))
    return 0
