"""Write random-weight Mixture-of-Experts checkpoints in the exact Hugging Face layout.

`make_model` produces a directory that transformers 5 (`AutoModelForCausalLM`) and moed
load alike: config.json, generation_config.json, tokenizer.json, tokenizer_config.json
and safetensors shards (`model.safetensors`, or `model-0000i-of-0000N.safetensors` plus
`model.safetensors.index.json`). It exists for tests, demos and benchmarks — moed never
downloads fixtures. It shares no code with the reader it tests (ext/formats/, ext/models/).

Conventions (shape legend as in the rest of ext/):
  L layers, E num_experts, H hidden_size, I intermediate_size (per expert),
  S shared-expert intermediate size (qwen2_moe), V vocab_size,
  Nq attention heads, Nkv key/value heads, D head_dim.
  Linear weights are stored [out_features, in_features] as in `torch.nn.Linear`.

Weights: linear weights and biases are uniform on ±initializer_range·√3 (standard
deviation = initializer_range); norm weights are 1.0 (ext/makemodel/shards.py writes
them). `routing_skew=S > 0` edits some rows of these random tensors so that routing is
realistic for cache benchmarks (ext/makemodel/skew.py). What each architecture holds is
ext/makemodel/families.py.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ext.makemodel.families import (_ARCH, ARCHITECTURES, ATTENTION, EXPERT, FLOAT32, HEAD, MLP,
                                    ROUTER, family_fields,
                                    TensorSpec, config_json, tensor_specs)
from ext.makemodel.lowbit import (_PLAIN, MXFP4_GROUP, SCALE_DTYPES, Encoding, Fp8, Mxfp4, Plain,
                                  quantization_config)
from ext.makemodel.shards import write_json, write_shards, writing
from ext.makemodel.skew import skew_adjustments
from ext.makemodel.tokenizer import (CHAT_TEMPLATES, CHATML_TEMPLATE, added_token_ids, bos_eos, stop_tokens,
                                     build_tokenizer, tokenizer_config)

_VOCAB_MULTIPLE = 64
DEFAULT_SHARD_SIZE = 2 << 30  # bytes
DTYPES = ("f32", "f16", "bf16", "fp8", "mxfp4")
TEMP_PREFIX = ".moed-make-model-"    # the temporary directory inside out_dir


def make_model(
    out_dir: str | Path,
    *,
    arch: str,
    layers: int,
    experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    dtype: str = "bf16",
    shard_size: int = DEFAULT_SHARD_SIZE,
    seed: int = 0,
    vocab_size: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    shared_intermediate: int | None = None,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.02,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    routing_skew: float | None = None,
    scale_dtype: str | None = None,
    scale_fmt: str | None = None,
    options: dict | None = None,
) -> Path:
    """Write a random-weight checkpoint for one MoE architecture in Hugging Face layout.

    Args:
        out_dir: directory to write; created if missing. The files are written in a
            temporary directory inside it and moved in once all are whole.
        arch: one of `ARCHITECTURES` ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
            "deepseek_v3", "glm4_moe", "gpt_oss"); becomes config.json `model_type`.
        layers: L, `num_hidden_layers`; every layer is a MoE layer, except the leading
            `first_k_dense_replace` of deepseek_v3 and glm4_moe (default 1).
        experts: E, `num_local_experts` (mixtral, gpt_oss), `n_routed_experts`
            (deepseek_v3, glm4_moe) or `num_experts` (others).
        top_k: `num_experts_per_tok`, 1 <= top_k <= E.
        hidden: H, `hidden_size`.
        intermediate: I, per-expert FFN width: `intermediate_size` for mixtral/olmoe,
            `moe_intermediate_size` for qwen2_moe/qwen3_moe.
        dtype: "bf16", "f16" or "f32" — the stored dtype of every tensor; or a published
            low-bit layout (ext/makemodel/lowbit.py) with config.json's
            `quantization_config` as those models write it: "fp8" — attention, routed
            and shared expert projections FP8 E4M3 with 128 x 128 block scales
            (DeepSeek-V3 / Qwen3-FP8), everything else bf16 (routers and lm_head listed
            in `modules_to_not_convert`); "mxfp4" — routed experts MXFP4 (GPT-OSS's
            blocks and scales), everything else bf16. The values are the bf16 model's
            (same seed) before rounding.
        scale_dtype: fp8 only: "f32" (the default), "bf16" or "e8m0" (UE8M0 exponents, U8).
        scale_fmt: fp8 only: "float" or "ue8m0" (scales rounded up to powers of two and
            `"scale_fmt": "ue8m0"` in the config, as DeepSeek-V3.1); default "ue8m0"
            for scale_dtype "e8m0", else "float".
        shard_size: maximum bytes of tensor data per shard file; tensors are assigned
            greedily in order, a tensor larger than this gets a shard of its own. If
            everything fits, a single `model.safetensors` is written with no index.
        seed: base seed of the per-tensor random streams.
        vocab_size: target tokenizer size (default 512); config `vocab_size` (rows of
            embed_tokens / lm_head) is this rounded up to a multiple of 64.
        heads: Nq; default H // 64 when that gives >= 2 heads (head_dim 64), else 4.
        kv_heads: Nkv; default Nq // 2 when Nq is even, else Nq. Must divide Nq.
        head_dim: D; qwen3_moe, glm4_moe and gpt_oss may choose it freely (written to
            config.json); default H // Nq, which the others require. For deepseek_v3 it
            sizes the MLA defaults (ext/makemodel/families.py `family_fields`).
        shared_intermediate: S, qwen2_moe `shared_expert_intermediate_size`;
            default 4 * I (the ratio of Qwen1.5-MoE-A2.7B). Rejected for other archs.
        max_position_embeddings: written to config.json.
        initializer_range: standard deviation of the random weights.
        overwrite: remove checkpoint files of an earlier run in out_dir first; without
            it an existing config.json or *.safetensors there is an error.
        progress: optional callable(done_bytes, total_bytes) called as tensor data is
            written (after each chunk) and once at the end with done == total.
        routing_skew: S. None or 0: plain random weights, byte-identical to what this
            function wrote before the keyword existed. S > 0: weights built so that, when
            the model samples at temperature 0.7, each MoE layer's expert popularity
            (share of top_k selections) follows Zipf(S) over a random per-layer ranking
            of the experts, and a token's expert was also chosen by the previous token at
            about the real rate (0.40 at S = 1). See "Routing skew" below.
        options: config.json fields of deepseek_v3, glm4_moe and gpt_oss to set instead
            of make-model's defaults (`family_fields`: e.g. {"q_lora_rank": None,
            "n_group": 4, "topk_group": 2, "rope_parameters": {...yarn...}}); the tensors
            follow them. Rejected for the other architectures.

    Returns:
        The checkpoint directory as a `Path`.

    Raises:
        ValueError: unknown arch or dtype, or sizes that are non-positive or
            inconsistent (top_k > experts, Nq not divisible by Nkv, H != Nq * D for an
            arch that requires it, odd head_dim, mxfp4 with hidden or intermediate not
            a multiple of 32), scale options that do not fit the dtype, or routing_skew
            negative / not finite.
        FileExistsError: out_dir already holds a checkpoint and overwrite is False.
        OSError: writing failed (a full disk), naming the file as it would be in out_dir;
            nothing of the new checkpoint is left, an old one is kept, and out_dir is
            removed if this call created it.
    See ext/makemodel/skew.py for the routing-skew construction and its measurements.
    """
    if arch not in _ARCH:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if (scale_dtype is not None or scale_fmt is not None) and dtype != "fp8":
        raise ValueError(f"scale_dtype and scale_fmt apply to dtype 'fp8' only, not {dtype!r}")
    scale_dtype = scale_dtype or "f32"
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {tuple(SCALE_DTYPES)}, got {scale_dtype!r}")
    scale_fmt = scale_fmt or ("ue8m0" if scale_dtype == "e8m0" else "float")
    if sys.byteorder != "little":
        raise ValueError("make_model writes little-endian safetensors and needs a little-endian host")
    for field, value in (("layers", layers), ("experts", experts), ("top_k", top_k),
                         ("hidden", hidden), ("intermediate", intermediate),
                         ("shard_size", shard_size),
                         ("max_position_embeddings", max_position_embeddings)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{field} must be a positive int, got {value!r}")
    if top_k > experts:
        raise ValueError(f"top_k ({top_k}) must be <= experts ({experts})")
    if not 0 < initializer_range <= 1:
        raise ValueError(f"initializer_range must be in (0, 1], got {initializer_range!r}")
    if routing_skew is not None and not (isinstance(routing_skew, (int, float))
                                         and not isinstance(routing_skew, bool)
                                         and math.isfinite(routing_skew) and routing_skew >= 0):
        raise ValueError(f"routing_skew must be a finite number >= 0 or None, got {routing_skew!r}")
    if heads is None:
        heads = hidden // 64 if hidden // 64 >= 2 else 4
    if arch == "deepseek_v3":
        if kv_heads not in (None, heads):
            raise ValueError(f"deepseek_v3's latent attention gives every head its key: kv_heads "
                             f"({kv_heads}) must equal heads ({heads})")
        kv_heads = heads
    if kv_heads is None:
        kv_heads = heads // 2 if heads % 2 == 0 else heads
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        head_dim = hidden // heads
    elif arch not in ("qwen3_moe", "glm4_moe", "gpt_oss", "deepseek_v3") and head_dim * heads != hidden:
        raise ValueError(f"{arch} needs head_dim * heads == hidden, got {head_dim} * {heads} != {hidden}")
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim = hidden / heads = {hidden} / {heads} = {head_dim} must be a positive "
                         f"even number (RoPE rotates pairs); choose heads so that it is")
    if dtype == "mxfp4" and (hidden % MXFP4_GROUP or intermediate % MXFP4_GROUP):
        raise ValueError(f"dtype mxfp4 groups {MXFP4_GROUP} values along each expert's inputs: "
                         f"hidden ({hidden}) and intermediate ({intermediate}) must be multiples "
                         f"of {MXFP4_GROUP}")
    if arch == "gpt_oss" and dtype in ("fp8",):
        raise ValueError("gpt_oss is published with MXFP4 experts: dtype fp8 is not a layout it has")
    if options and arch not in ("deepseek_v3", "glm4_moe", "gpt_oss"):
        raise ValueError(f"options apply to deepseek_v3, glm4_moe and gpt_oss, not {arch}")
    if shared_intermediate is not None and arch != "qwen2_moe":
        raise ValueError(f"shared_intermediate applies to qwen2_moe only, not {arch}")
    if arch == "qwen2_moe":
        shared_intermediate = 4 * intermediate if shared_intermediate is None else shared_intermediate
        if shared_intermediate <= 0:
            raise ValueError(f"shared_intermediate must be positive, got {shared_intermediate}")

    encoding_of = _encodings(dtype, scale_dtype, scale_fmt)   # checks the scale options
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    with _staged(out, overwrite) as tmp:         # files move into `out` once all are whole
        tokenizer = build_tokenizer(512 if vocab_size is None else vocab_size, arch)
        config_vocab = -(-max(tokenizer.get_vocab_size(), vocab_size or 0) // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
        ids = added_token_ids(tokenizer, arch)
        bos, eos = (ids[t] for t in bos_eos(arch))

        dims = dict(L=layers, E=experts, H=hidden, I=intermediate, S=shared_intermediate,
                    V=config_vocab, Nq=heads, Nkv=kv_heads, D=head_dim, rows_out=dtype == "mxfp4")
        dims["fields"] = family_fields(arch, dims, top_k, options)
        specs = list(tensor_specs(arch, dims))
        adjust = (skew_adjustments(arch, dims, top_k, seed, initializer_range, float(routing_skew))
                  if routing_skew else None)             # None and 0: plain random weights
        write_shards(tmp, specs, encoding_of, shard_size, seed, initializer_range, progress, adjust,
                     shown=out)

        config_dtype = _PLAIN[dtype if dtype in _PLAIN else "bf16"][2]
        config = config_json(arch, dims, top_k, config_dtype, (bos, eos, ids["<|endoftext|>"]),
                             max_position_embeddings, initializer_range)
        kept = [spec.name.removesuffix(".weight") for spec in specs if spec.role in (ROUTER, HEAD)]
        quant = quantization_config(dtype, arch, kept, scale_fmt)
        if quant is not None:
            config = dict(sorted({**config, "quantization_config": quant}.items()))
        with writing(out / "config.json"):
            write_json(tmp / "config.json", config)
        with writing(out / "generation_config.json"):
            write_json(tmp / "generation_config.json", {
                "bos_token_id": bos,
                "eos_token_id": [ids[t] for t in stop_tokens(arch)],
                "pad_token_id": ids["<|endoftext|>"],
            })
        with writing(out / "tokenizer.json"):
            (tmp / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
        with writing(out / "tokenizer_config.json"):
            write_json(tmp / "tokenizer_config.json", tokenizer_config(
                ids, max_position_embeddings, CHAT_TEMPLATES.get(arch, CHATML_TEMPLATE), arch))
    return out


@contextmanager
def _staged(out: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary directory inside `out` (created if missing) to write a checkpoint in.

    Refuses an existing checkpoint in `out` unless `overwrite` (FileExistsError). When the
    block ends without error, the old checkpoint's files are deleted and the new ones
    renamed into `out`; when it raises (a full disk), the temporary directory is removed,
    and `out` too if this call created it: no partial checkpoint is left, and an old one
    is kept."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        old = _old_checkpoint(out, overwrite)
        tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=out))
        try:
            yield tmp
            for path in old:
                path.unlink()
            for path in sorted(tmp.iterdir()):
                os.rename(path, out / path.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _encodings(dtype: str, scale_dtype: str, scale_fmt: str) -> Callable[[TensorSpec], Encoding]:
    """How each tensor of a `dtype` checkpoint is stored (by its role)."""
    f32 = Plain("f32")
    if dtype in _PLAIN:
        plain = Plain(dtype)
        return lambda spec: f32 if spec.role == FLOAT32 else plain
    bf16 = Plain("bf16")
    if dtype == "fp8":
        fp8 = Fp8(scale_dtype, scale_fmt)
        return lambda spec: fp8 if spec.role in (EXPERT, ATTENTION, MLP) else f32 if spec.role == FLOAT32 else bf16
    mxfp4 = Mxfp4()
    return lambda spec: mxfp4 if spec.role == EXPERT else f32 if spec.role == FLOAT32 else bf16


def _old_checkpoint(out: Path, overwrite: bool) -> list[Path]:
    """The files of an existing checkpoint in `out`, to be replaced (overwrite); without
    overwrite, one is a FileExistsError (never mixed with)."""
    old = [p for p in out.iterdir()
           if p.name.endswith(".safetensors") or p.name in (
               "config.json", "generation_config.json", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")]
    if old and not overwrite:
        raise FileExistsError(f"{out} already holds a checkpoint ({old[0].name}); use --force to replace it")
    return old
