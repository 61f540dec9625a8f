"""Write random-weight Mixture-of-Experts checkpoints in the exact Hugging Face layout.

`make_model` produces a directory that transformers 5 (`AutoModelForCausalLM`) and moed
load alike: config.json, generation_config.json, tokenizer.json, tokenizer_config.json
and safetensors shards (`model.safetensors`, or `model-0000i-of-0000N.safetensors` plus
`model.safetensors.index.json`). It exists for tests, demos and benchmarks — moed never
downloads fixtures.

Conventions (shape legend as in the rest of ext/):
  L layers, E num_experts, H hidden_size, I intermediate_size (per expert),
  S shared-expert intermediate size (qwen2_moe), V vocab_size,
  Nq attention heads, Nkv key/value heads, D head_dim.
  Linear weights are stored [out_features, in_features] as in `torch.nn.Linear`.

Tensor names and config keys were checked against what transformers 5.24's own
`save_pretrained` writes for `MixtralForCausalLM`, `Qwen2MoeForCausalLM`,
`Qwen3MoeForCausalLM` and `OlmoeForCausalLM` (per-expert tensors, not the fused
`gate_up_proj` that transformers uses in memory).

Weights: linear weights and biases are uniform on ±initializer_range·√3 (standard
deviation = initializer_range); norm weights are 1.0. Every tensor draws from its own
`numpy.random.PCG64` stream seeded by (seed, sha256(tensor name)), so a tensor's values
do not depend on how many other tensors the model has, and the same arguments always
give byte-identical files. Values are drawn as float32 and rounded to bf16/f16 with
`ml_dtypes`/numpy `astype` (round-to-nearest-even). Shards are streamed tensor by tensor in
chunks of `_CHUNK_ELEMENTS`, so memory stays bounded whatever the model size. The
safetensors files are written directly (8-byte little-endian header length, JSON header
with `__metadata__ = {"format": "pt"}` padded with spaces to 8 bytes, then the tensor
bytes in header order); this module assumes a little-endian host.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_DTYPES = {
    # name: (numpy dtype, safetensors dtype, config "dtype")
    "bf16": (np.dtype(ml_dtypes.bfloat16), "BF16", "bfloat16"),
    "f16": (np.dtype(np.float16), "F16", "float16"),
    "f32": (np.dtype(np.float32), "F32", "float32"),
}

_ARCH = {
    # model_type: (architectures entry, rope_theta, rms_norm_eps)
    "mixtral": ("MixtralForCausalLM", 1e6, 1e-5),
    "qwen2_moe": ("Qwen2MoeForCausalLM", 1e6, 1e-6),
    "qwen3_moe": ("Qwen3MoeForCausalLM", 1e6, 1e-6),
    "olmoe": ("OlmoeForCausalLM", 1e4, 1e-5),
}

_CHUNK_ELEMENTS = 1 << 23  # 8 Mi values = 32 MiB of float32 scratch
_VOCAB_MULTIPLE = 64
DEFAULT_SHARD_SIZE = 2 << 30  # bytes

# Fixed training text for the byte-level BPE merges. Changing it changes every
# generated tokenizer, so it is a constant rather than, say, this file's source.
_BPE_CORPUS = """\
A mixture of experts replaces the single feed-forward block of a transformer layer with
many smaller experts and a router that picks a few of them for every token. The router
computes a score for each expert, keeps the top k, and mixes the chosen experts' outputs
with weights taken from a softmax over the scores. Because each token touches only a few
experts, the model can hold far more parameters than it spends on any one token.

The daemon keeps the dense part of the model resident in memory: the embeddings, the
attention weights, the norms, the routers and the shared experts. The routed experts stay
on the disk in the model's own safetensors shards and are read into an expert cache when
a token needs them. Hot experts are pinned; the next layer's experts are predicted and
read while the processor computes the current layer.

Hello, world! How are you today? I am fine, thank you. What is the weather like? It is
sunny and warm, with a light breeze from the sea. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100
1024 2048 4096. Code: def forward(self, x): return self.down(silu(self.gate(x)) * self.up(x))
for i in range(n): total += values[i] if values[i] > 0 else 0; print(f"{total:.3f}")
Un café au lait, s'il vous plaît. Die Straße ist naß. El niño comió piña. Ça va très bien.
Grüße aus München — zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.
日本語の文章も少し入れておきます。東京は大きな都市です。中文也可以。한국어 문장입니다.
Prices: 5 € or £4 or ¥600; temperatures of −5 °C to 30 °C; π ≈ 3.14159; x² + y² = r².
<|im_start|>user
What is a mixture of experts?<|im_end|>
<|im_start|>assistant
It is a layer in which a router sends each token to a few of many expert networks.<|im_end|>
"""


@dataclass(frozen=True)
class _Tensor:
    """One tensor to write: name, shape and how to fill it ("random" or "ones")."""

    name: str
    shape: tuple[int, ...]
    fill: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train the byte-level BPE tokenizer used by generated checkpoints.

    Args:
        vocab_size: target vocabulary size including the 3 special tokens
            (`<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2) and the 256
            byte tokens; the remaining entries are merges learned from a fixed
            built-in text. The result may be smaller if the text runs out of merges.

    Returns:
        A `tokenizers.Tokenizer` with a ByteLevel pre-tokenizer (add_prefix_space=False)
        and ByteLevel decoder; deterministic for a given `vocab_size`.

    Raises:
        ValueError: vocab_size < 259 (the special and byte tokens would not fit).
    """
    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_BPE_CORPUS], trainer=trainer)
    return tokenizer


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
) -> Path:
    """Write a random-weight checkpoint for one MoE architecture in Hugging Face layout.

    Args:
        out_dir: directory to write; created if missing.
        arch: one of `ARCHITECTURES` ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe");
            becomes config.json `model_type`.
        layers: L, `num_hidden_layers`; every layer is a MoE layer.
        experts: E, `num_local_experts` (mixtral) or `num_experts` (others).
        top_k: `num_experts_per_tok`, 1 <= top_k <= E.
        hidden: H, `hidden_size`.
        intermediate: I, per-expert FFN width: `intermediate_size` for mixtral/olmoe,
            `moe_intermediate_size` for qwen2_moe/qwen3_moe.
        dtype: "bf16", "f16" or "f32" — the stored dtype of every tensor.
        shard_size: maximum bytes of tensor data per shard file; tensors are assigned
            greedily in order, a tensor larger than this gets a shard of its own. If
            everything fits, a single `model.safetensors` is written with no index.
        seed: base seed of the per-tensor random streams.
        vocab_size: target tokenizer size (default 512); config `vocab_size` (rows of
            embed_tokens / lm_head) is this rounded up to a multiple of 64.
        heads: Nq; default H // 64 when that gives >= 2 heads (head_dim 64), else 4.
        kv_heads: Nkv; default Nq // 2 when Nq is even, else Nq. Must divide Nq.
        head_dim: D; only qwen3_moe may choose it freely (written to config.json);
            default H // Nq, which the other architectures require.
        shared_intermediate: S, qwen2_moe `shared_expert_intermediate_size`;
            default 4 * I (the ratio of Qwen1.5-MoE-A2.7B). Rejected for other archs.
        max_position_embeddings: written to config.json.
        initializer_range: standard deviation of the random weights.
        overwrite: remove checkpoint files of an earlier run in out_dir first; without
            it an existing config.json or *.safetensors there is an error.
        progress: optional callable(done_bytes, total_bytes) called as tensor data is
            written (after each chunk) and once at the end with done == total.

    Returns:
        The checkpoint directory as a `Path`.

    Raises:
        ValueError: unknown arch or dtype, or sizes that are non-positive or
            inconsistent (top_k > experts, Nq not divisible by Nkv, H != Nq * D for an
            arch that requires it, odd head_dim).
        FileExistsError: out_dir already holds a checkpoint and overwrite is False.
    """
    if arch not in _ARCH:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
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
    if not initializer_range > 0:
        raise ValueError(f"initializer_range must be > 0, got {initializer_range!r}")
    if heads is None:
        heads = hidden // 64 if hidden // 64 >= 2 else 4
    if kv_heads is None:
        kv_heads = heads // 2 if heads % 2 == 0 else heads
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        head_dim = hidden // heads
    elif arch != "qwen3_moe" and head_dim * heads != hidden:
        raise ValueError(f"{arch} needs head_dim * heads == hidden, got {head_dim} * {heads} != {hidden}")
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim = hidden / heads = {hidden} / {heads} = {head_dim} must be a positive "
                         f"even number (RoPE rotates pairs); choose heads so that it is")
    if shared_intermediate is not None and arch != "qwen2_moe":
        raise ValueError(f"shared_intermediate applies to qwen2_moe only, not {arch}")
    if arch == "qwen2_moe":
        shared_intermediate = 4 * intermediate if shared_intermediate is None else shared_intermediate
        if shared_intermediate <= 0:
            raise ValueError(f"shared_intermediate must be positive, got {shared_intermediate}")

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    _clear_checkpoint(out, overwrite)

    tokenizer = build_tokenizer(512 if vocab_size is None else vocab_size)
    config_vocab = -(-max(tokenizer.get_vocab_size(), vocab_size or 0) // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}

    dims = dict(L=layers, E=experts, H=hidden, I=intermediate, S=shared_intermediate,
                V=config_vocab, Nq=heads, Nkv=kv_heads, D=head_dim)
    specs = list(_tensor_specs(arch, dims))
    np_dtype, st_dtype, config_dtype = _DTYPES[dtype]
    _write_shards(out, specs, np_dtype, st_dtype, shard_size, seed, initializer_range, progress)

    config = _config(arch, dims, top_k, config_dtype, ids, max_position_embeddings, initializer_range)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    })
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(ids, max_position_embeddings))
    return out


def _clear_checkpoint(out: Path, overwrite: bool) -> None:
    """Refuse to mix with an existing checkpoint, or delete its files if overwrite."""
    old = [p for p in out.iterdir()
           if p.name.endswith(".safetensors") or p.name in (
               "config.json", "generation_config.json", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json")]
    if old and not overwrite:
        raise FileExistsError(f"{out} already holds a checkpoint ({old[0].name}); use --force (overwrite=True) to replace it")
    for path in old:
        path.unlink()


def _tensor_specs(arch: str, d: dict) -> Iterator[_Tensor]:
    """Yield every tensor of the checkpoint, in file order (embeddings, layers, head)."""
    H, I, E, D, Nq, Nkv = d["H"], d["I"], d["E"], d["D"], d["Nq"], d["Nkv"]
    yield _Tensor("model.embed_tokens.weight", (d["V"], H), "random")
    for layer in range(d["L"]):
        p = f"model.layers.{layer}."
        yield _Tensor(p + "input_layernorm.weight", (H,), "ones")
        for proj, rows in (("q", Nq * D), ("k", Nkv * D), ("v", Nkv * D)):
            yield _Tensor(f"{p}self_attn.{proj}_proj.weight", (rows, H), "random")
            if arch == "qwen2_moe":
                yield _Tensor(f"{p}self_attn.{proj}_proj.bias", (rows,), "random")
        yield _Tensor(p + "self_attn.o_proj.weight", (H, Nq * D), "random")
        if arch == "qwen3_moe":
            yield _Tensor(p + "self_attn.q_norm.weight", (D,), "ones")
            yield _Tensor(p + "self_attn.k_norm.weight", (D,), "ones")
        elif arch == "olmoe":
            yield _Tensor(p + "self_attn.q_norm.weight", (Nq * D,), "ones")
            yield _Tensor(p + "self_attn.k_norm.weight", (Nkv * D,), "ones")
        yield _Tensor(p + "post_attention_layernorm.weight", (H,), "ones")
        if arch == "mixtral":
            yield _Tensor(p + "block_sparse_moe.gate.weight", (E, H), "random")
            for e in range(E):
                q = f"{p}block_sparse_moe.experts.{e}."
                yield _Tensor(q + "w1.weight", (I, H), "random")  # gate
                yield _Tensor(q + "w3.weight", (I, H), "random")  # up
                yield _Tensor(q + "w2.weight", (H, I), "random")  # down
            continue
        yield _Tensor(p + "mlp.gate.weight", (E, H), "random")
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            yield _Tensor(q + "gate_proj.weight", (I, H), "random")
            yield _Tensor(q + "up_proj.weight", (I, H), "random")
            yield _Tensor(q + "down_proj.weight", (H, I), "random")
        if arch == "qwen2_moe":
            S = d["S"]
            yield _Tensor(p + "mlp.shared_expert.gate_proj.weight", (S, H), "random")
            yield _Tensor(p + "mlp.shared_expert.up_proj.weight", (S, H), "random")
            yield _Tensor(p + "mlp.shared_expert.down_proj.weight", (H, S), "random")
            yield _Tensor(p + "mlp.shared_expert_gate.weight", (1, H), "random")
    yield _Tensor("model.norm.weight", (H,), "ones")
    yield _Tensor("lm_head.weight", (d["V"], H), "random")


def _plan_shards(specs: list[_Tensor], itemsize: int, shard_size: int) -> list[list[_Tensor]]:
    """Split tensors greedily, in order, into shards of at most shard_size data bytes."""
    shards: list[list[_Tensor]] = [[]]
    used = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        if shards[-1] and used + nbytes > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += nbytes
    return shards


def _write_shards(out: Path, specs: list[_Tensor], np_dtype: np.dtype, st_dtype: str,
                  shard_size: int, seed: int, std: float,
                  progress: Callable[[int, int], None] | None) -> None:
    """Stream every tensor into its shard file and write the index when sharded."""
    itemsize = np_dtype.itemsize
    shards = _plan_shards(specs, itemsize, shard_size)
    total = sum(s.numel for s in specs) * itemsize
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    scratch = np.empty(min(_CHUNK_ELEMENTS, max(s.numel for s in specs)), dtype=np.float32)
    bound = std * math.sqrt(3.0)
    done = 0
    weight_map = {}
    for file_name, shard in zip(names, shards):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in shard:
            nbytes = spec.numel * itemsize
            header[spec.name] = {"dtype": st_dtype, "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[spec.name] = file_name
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        with open(out / file_name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for spec in shard:
                for nbytes in _write_tensor(f, spec, np_dtype, seed, bound, scratch):
                    done += nbytes
                    if progress is not None:
                        progress(done, total)
    if n > 1:
        index = {"metadata": {"total_parameters": sum(s.numel for s in specs),
                              "total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out / "model.safetensors.index.json", index)


def _write_tensor(f, spec: _Tensor, np_dtype: np.dtype, seed: int, bound: float,
                  scratch: np.ndarray) -> Iterator[int]:
    """Write one tensor's bytes in chunks; yield the byte count of each chunk written."""
    if spec.fill == "ones":
        data = np.ones(spec.numel, dtype=np_dtype)
        f.write(data.view(np.uint8).data)
        yield data.nbytes
        return
    digest = hashlib.sha256(spec.name.encode("utf-8")).digest()
    entropy = [seed, *struct.unpack("<4Q", digest)]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
    remaining = spec.numel
    while remaining:
        count = min(remaining, scratch.size)
        chunk = scratch[:count]
        rng.random(out=chunk, dtype=np.float32)  # [0, 1)
        chunk *= np.float32(2.0 * bound)
        chunk -= np.float32(bound)  # [-bound, bound)
        data = chunk if np_dtype == np.float32 else chunk.astype(np_dtype)
        f.write(data.view(np.uint8).data)
        remaining -= count
        yield data.nbytes


def _config(arch: str, d: dict, top_k: int, config_dtype: str, ids: dict,
            max_position_embeddings: int, initializer_range: float) -> dict:
    """config.json contents: the keys transformers 5 writes, plus top-level rope_theta."""
    architecture, rope_theta, rms_norm_eps = _ARCH[arch]
    config: dict[str, object] = {
        "architectures": [architecture],
        "model_type": arch,
        "vocab_size": d["V"],
        "hidden_size": d["H"],
        "num_hidden_layers": d["L"],
        "num_attention_heads": d["Nq"],
        "num_key_value_heads": d["Nkv"],
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": initializer_range,
        "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "rope_theta": rope_theta,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "num_experts_per_tok": top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "dtype": config_dtype,
        "torch_dtype": config_dtype,
    }
    if arch == "mixtral":
        config.update(num_local_experts=d["E"], intermediate_size=d["I"], head_dim=d["D"],
                      sliding_window=None, router_jitter_noise=0.0)
    elif arch == "qwen2_moe":
        config.update(num_experts=d["E"], moe_intermediate_size=d["I"],
                      intermediate_size=d["S"], shared_expert_intermediate_size=d["S"],
                      norm_topk_prob=False, qkv_bias=True, decoder_sparse_step=1,
                      mlp_only_layers=[], use_sliding_window=False)
    elif arch == "qwen3_moe":
        config.update(num_experts=d["E"], moe_intermediate_size=d["I"],
                      intermediate_size=d["I"], head_dim=d["D"], norm_topk_prob=True,
                      attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[],
                      use_sliding_window=False)
    else:  # olmoe
        config.update(num_experts=d["E"], intermediate_size=d["I"], norm_topk_prob=False,
                      attention_bias=False, clip_qkv=None)
    return dict(sorted(config.items()))


def _tokenizer_config(ids: dict, model_max_length: int) -> dict:
    """tokenizer_config.json contents: special tokens and the ChatML chat template."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {"content": token, "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True}
            for token, token_id in sorted(ids.items(), key=lambda kv: kv[1])},
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _write_json(path: Path, obj: object) -> None:
    """Write obj as indented UTF-8 JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
