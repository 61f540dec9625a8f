"""Model configuration: one typed object read from a Hugging Face `config.json`.

Field names are Hugging Face's. Both spellings in circulation are read: the Hub
checkpoints' (`rope_theta` at the top level, `rope_scaling`) and transformers ≥ 5's
(`rope_parameters: {"rope_theta", "rope_type"}`); Mixtral's `num_local_experts`
and the others' `num_experts`. Defaults for absent fields are the transformers
class defaults of the family (transformers 5, `configuration_<family>.py`); a
field the architecture needs and has no default for raises
`MissingConfigFieldError`; anything we cannot compute faithfully (another
`hidden_act`, a RoPE scaling type) raises `UnsupportedConfigError` naming it.

What every family reads the same way is here (`ConfigReader` and the `read_*`
helpers); what one family reads its own way is in its module of
`ext/models/families/`, whose table gives `parse_config` each family's reader by
`model_type` (`register_family`; the table registers itself when ext.models is imported,
so this module imports no family and the families import it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from ext.formats.files import MetadataFileError, read_json
from ext.formats.quant import QuantMethod, parse_quantization_config

MAX_LAYERS = 4096  # sanity bound: a config beyond it is corrupt, not a model


class ConfigError(ValueError):
    """A config.json that moed cannot serve; the message names the file and field."""

    def __init__(self, path: str | Path, field: str | None, message: str):
        self.path = str(path)
        self.field = field
        where = f"{self.path}: field '{field}'" if field else self.path
        super().__init__(f"{where}: {message}")


class UnsupportedModelError(ConfigError):
    """`model_type` (or `architectures`) names a family moed does not implement."""


class MissingConfigFieldError(ConfigError):
    """A field the architecture needs is absent (and has no class default)."""


class UnsupportedConfigError(ConfigError):
    """A field has a value moed cannot compute faithfully (e.g. another activation)."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (Peng et al. 2023), the fields transformers'
    `_compute_yarn_parameters` reads from `rope_parameters` / `rope_scaling`.

    factor: context extension factor (absent: max_position_embeddings /
        original_max_position_embeddings). beta_fast / beta_slow: the correction range
        (default 32 / 1). mscale, mscale_all_dim: DeepSeek's attention-factor terms, or
        None. attention_factor: explicit multiplier of cos and sin, or None (inferred).
        truncate: round the correction range to whole dims (default True; GPT-OSS False).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention sizes (DeepSeek-V2/V3, HF names): q_lora_rank (None:
    a plain q_proj), kv_lora_rank (the cached latent), qk_nope_head_dim and
    qk_rope_head_dim (the two parts of a query/key head), v_head_dim."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """What the forward pass needs to know, normalised across families.

    Attributes (HF names where one exists):
        model_type: the family (a key of `ext.models.families.FAMILIES`).
        vocab_size, hidden_size, num_hidden_layers: as in config.json.
        num_attention_heads, num_key_value_heads, head_dim: attention shape;
            head_dim defaults to hidden_size // num_attention_heads.
        num_experts, num_experts_per_tok (top_k): routed experts per MoE layer.
        moe_intermediate_size: rows of each routed expert's gate/up projection.
        intermediate_size: size of a dense MLP (layers without experts).
        shared_expert_intermediate_size: Qwen2-MoE's shared expert, 0 if none.
        norm_topk_prob: renormalise the top-k routing weights to sum to 1.
        qkv_bias: q/k/v projections carry a bias (Qwen2-MoE).
        qk_norm: "none", "head" (RMSNorm per head over head_dim, Qwen3-MoE) or
            "full" (RMSNorm over the whole projection, OLMoE).
        clip_qkv: clamp q, k, v to [-clip_qkv, clip_qkv] (OLMoE), or None.
        rope_theta: RoPE base. rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: lm_head shares embed_tokens' weight.
        sliding_windows: per layer, the attention window in tokens, or None.
        moe_layers: per layer, True where the MLP is a routed MoE block.
        max_position_embeddings: context length the model was trained for.
        bos_token_id, eos_token_ids: special ids from config.json.

    Attributes with defaults (what the first families never set):
        rotary_dim: dims of each head RoPE rotates (None: all of head_dim; GLM-4.5's
            `partial_rotary_factor`; MLA: qk_rope_head_dim).
        rope_interleave: RoPE pairs are adjacent dims (DeepSeek-V3 `rope_interleave`).
        rope_scaling: YaRN scaling, or None for plain RoPE.
        mla: the MLA sizes when the attention kind is "mla", else None.
        o_bias: o_proj carries a bias (GPT-OSS). attention_sinks: a learned per-head
            logit joins every softmax (GPT-OSS `sinks`).
        n_group, topk_group, routed_scaling_factor: group-limited sigmoid routing
            (DeepSeek-V3, GLM-4.5); 1, 1, 1.0 elsewhere.
        router_bias: the router linear has a bias (GPT-OSS).
        expert_activation: "swiglu" (silu(gate) * up) or "clamped_swiglu" (GPT-OSS,
            with swiglu_alpha and swiglu_limit). expert_bias: expert projections carry
            biases (GPT-OSS).
        num_nextn_predict_layers: multi-token-prediction layers stored after the
            decoder's (DeepSeek-V3, GLM-4.5); not used for decoding, their tensors ignored.
        quantization: the parsed `quantization_config` (ext.formats.quant: which stored
            formats the weights may have), or None when the weights are plain floats.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    qkv_bias: bool
    qk_norm: str
    clip_qkv: float | None
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    moe_layers: tuple[bool, ...]
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rotary_dim: int | None = None
    rope_interleave: bool = False
    rope_scaling: YarnScaling | None = None
    mla: MlaConfig | None = None
    o_bias: bool = False
    attention_sinks: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    expert_activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False
    num_nextn_predict_layers: int = 0
    quantization: QuantMethod | None = None

    @property
    def top_k(self) -> int:
        return self.num_experts_per_tok


class ConfigReader:
    """Typed access to one config dict, raising errors that name the file and field."""

    def __init__(self, path: Path, raw: dict[str, Any]):
        self.path = path
        self.raw = raw

    def get(self, name: str, kind: type, default: Any = ...) -> Any:
        if name not in self.raw or self.raw[name] is None:
            if default is ...:
                raise MissingConfigFieldError(self.path, name, "is required and missing")
            return default
        value = self.raw[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(self.path, name, f"expected {kind.__name__}, got {value!r}")
        return value

    def positive(self, name: str, default: Any = ...) -> int:
        value = self.get(name, int, default)
        if value <= 0:
            raise ConfigError(self.path, name, f"must be positive, got {value}")
        return value

    def error(self, field: str | None, message: str) -> ConfigError:
        return ConfigError(self.path, field, message)

    def unsupported(self, field: str, message: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(self.path, field, message)


def read_rope_theta(r: ConfigReader, default: float) -> float:
    """The RoPE base from `rope_parameters.rope_theta` or top-level `rope_theta`; only
    the default RoPE type over the whole head is accepted."""
    params = r.raw.get("rope_parameters")
    scaling = r.raw.get("rope_scaling")
    for name, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        if block is None:
            continue
        if not isinstance(block, dict):
            raise r.error(name, f"expected an object, got {block!r}")
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type != "default":
            raise r.unsupported(f"{name}.rope_type", f"RoPE type {rope_type!r} is not supported (only 'default')")
        if block.get("partial_rotary_factor", 1.0) != 1.0:
            raise r.unsupported(f"{name}.partial_rotary_factor", "partial rotary embeddings are not supported")
    if isinstance(params, dict) and "rope_theta" in params:
        return _number(r, "rope_parameters.rope_theta", params["rope_theta"])
    return _number(r, "rope_theta", r.raw.get("rope_theta", default))


def _number(r: ConfigReader, field: str, value: Any, *, positive: bool = True) -> float:
    """`value` as a finite (positive) float, or ConfigError naming `field`."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or (positive and value <= 0):
        kind = "positive finite" if positive else "finite"
        raise r.error(field, f"expected a {kind} number, got {value!r}")
    return float(value)


def read_rope(r: ConfigReader, *, default_theta: float, default_partial: float = 1.0,
              default_scaling: dict[str, Any] | None = None, max_position_embeddings: int
              ) -> tuple[float, float, YarnScaling | None]:
    """(rope_theta, partial_rotary_factor, YaRN scaling or None), read as transformers 5
    does: the RoPE block is `rope_scaling` if set, else `rope_parameters` (else
    `default_scaling`, GPT-OSS's class default); its values win over the top-level
    `rope_theta` / `partial_rotary_factor`; rope_type "default" or "yarn" (also spelled
    `type`). Raises UnsupportedConfigError naming `<block>.rope_type` for another type."""
    block, name = {}, "rope_parameters"
    for field in ("rope_scaling", "rope_parameters"):
        value = r.raw.get(field)
        if value is not None and not isinstance(value, dict):
            raise r.error(field, f"expected an object, got {value!r}")
        if value:
            block, name = value, field
            break
    else:
        block = dict(default_scaling or {})
    theta = _number(r, f"{name}.rope_theta" if "rope_theta" in block else "rope_theta",
                    block.get("rope_theta", r.raw.get("rope_theta", default_theta)))
    partial_field = f"{name}.partial_rotary_factor" if "partial_rotary_factor" in block \
        else "partial_rotary_factor"
    partial = _number(r, partial_field, block.get("partial_rotary_factor",
                                                  r.raw.get("partial_rotary_factor", default_partial)))
    if partial > 1.0:
        raise r.error(partial_field, f"must be in (0, 1], got {partial}")
    rope_type = block.get("rope_type", block.get("type", "default"))
    if rope_type == "default":
        return theta, partial, None
    if rope_type != "yarn":
        raise r.unsupported(f"{name}.rope_type",
                            f"RoPE type {rope_type!r} is not supported (only 'default' and 'yarn')")

    def opt(key: str, *, positive: bool = True) -> float | None:
        value = block.get(key)
        return None if value is None else _number(r, f"{name}.{key}", value, positive=positive)

    original = r.raw.get("original_max_position_embeddings",
                         block.get("original_max_position_embeddings", max_position_embeddings))
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise r.error(f"{name}.original_max_position_embeddings", f"expected a positive int, got {original!r}")
    factor = opt("factor")
    truncate = block.get("truncate", True)
    if not isinstance(truncate, bool):
        raise r.error(f"{name}.truncate", f"expected a bool, got {truncate!r}")
    return theta, partial, YarnScaling(
        factor=factor if factor is not None else max_position_embeddings / original,
        original_max_position_embeddings=original,
        beta_fast=opt("beta_fast") or 32.0, beta_slow=opt("beta_slow") or 1.0,
        mscale=opt("mscale", positive=False), mscale_all_dim=opt("mscale_all_dim", positive=False),
        attention_factor=opt("attention_factor"), truncate=truncate)


def read_eos_ids(r: ConfigReader) -> tuple[int, ...]:
    eos = r.raw.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise r.error("eos_token_id", f"expected an int or a list of ints, got {eos!r}")
    return tuple(ids)


def read_window(r: ConfigReader) -> int:
    """`sliding_window`, which must be a positive int where it is used."""
    window = r.raw.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise r.error("sliding_window", f"expected a positive int, got {window!r}")
    return window


def read_layer_types(r: ConfigReader, n_layers: int, window: int,
                     default: list[str] | None = None) -> tuple[int | None, ...]:
    """Per-layer windows from `layer_types` ("sliding_attention" | "full_attention"),
    or from `default` when the field is absent."""
    layer_types = r.raw.get("layer_types")
    if layer_types is None:
        layer_types = default
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise r.error("layer_types", f"expected a list of {n_layers} layer types")
    out = []
    for t in layer_types:
        if t not in ("sliding_attention", "full_attention"):
            raise r.unsupported("layer_types", f"unknown layer type {t!r}")
        out.append(window if t == "sliding_attention" else None)
    return tuple(out)


def read_mlp_only_layers(r: ConfigReader, n_layers: int, n_experts: int) -> tuple[bool, ...]:
    """Per layer, True where the MLP is routed (Qwen2/3-MoE): a layer is MoE unless in
    `mlp_only_layers`, and when (l + 1) % `decoder_sparse_step` == 0."""
    mlp_only = r.get("mlp_only_layers", list, [])
    for i in mlp_only:
        if not isinstance(i, int) or not 0 <= i < n_layers:
            raise r.error("mlp_only_layers", f"layer {i!r} not in [0, {n_layers})")
    step = r.positive("decoder_sparse_step", 1)
    return tuple(l not in mlp_only and n_experts > 0 and (l + 1) % step == 0 for l in range(n_layers))


def read_uniform_window(r: ConfigReader, n_layers: int, active: bool) -> tuple[int | None, ...]:
    """`sliding_window` for every layer when `active` and the window is set, else none."""
    if not active or r.raw.get("sliding_window") is None:
        return (None,) * n_layers
    return (read_window(r),) * n_layers


def read_experts(r: ConfigReader, field: str, other: str) -> tuple[int, int, str]:
    """(num_experts, top_k, the field the count was read from): the family's own name
    for the count, or the other name when only that one is present."""
    if field not in r.raw and other in r.raw:
        field = other
    n_experts = r.positive(field)
    top_k = r.positive("num_experts_per_tok")
    if top_k > n_experts:
        raise r.error("num_experts_per_tok", f"{top_k} exceeds {field} {n_experts}")
    return n_experts, top_k, field


def read_decoder(r: ConfigReader, *, default_theta: float | None, default_eps: float,
                 head_dim: int | None = None, default_context: int = 4096) -> dict[str, Any]:
    """The fields every decoder family reads alike (ModelConfig keyword arguments):
    vocabulary, layers, attention heads and head_dim (unless the family gives it),
    RoPE base (unless default_theta is None: the family reads RoPE with `read_rope`),
    RMSNorm epsilon, embeddings tying, context length and special ids."""
    act = r.raw.get("hidden_act", "silu")
    if act != "silu":
        raise r.unsupported("hidden_act", f"{act!r} is not supported (only 'silu')")
    hidden = r.positive("hidden_size")
    n_layers = r.positive("num_hidden_layers")
    if n_layers > MAX_LAYERS:
        raise r.error("num_hidden_layers", f"{n_layers} exceeds the {MAX_LAYERS} moed accepts")
    n_heads = r.positive("num_attention_heads")
    n_kv = r.positive("num_key_value_heads", n_heads)
    if n_heads % n_kv:
        raise r.error("num_key_value_heads", f"{n_kv} does not divide num_attention_heads {n_heads}")
    if head_dim is None and r.raw.get("head_dim") is None:
        if hidden % n_heads:
            raise r.error("hidden_size", f"{hidden} not divisible by num_attention_heads {n_heads}")
        head_dim = hidden // n_heads
    elif head_dim is None:
        head_dim = r.positive("head_dim")
    if head_dim % 2:
        raise r.unsupported("head_dim", f"RoPE needs an even head_dim, got {head_dim}")
    eps = r.get("rms_norm_eps", float, default_eps)
    if not (eps > 0 and math.isfinite(eps)):
        raise r.error("rms_norm_eps", f"must be a positive number, got {eps}")
    bos = r.raw.get("bos_token_id")
    return dict(
        vocab_size=r.positive("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        **({} if default_theta is None else {"rope_theta": read_rope_theta(r, default_theta)}),
        rms_norm_eps=eps,
        tie_word_embeddings=r.get("tie_word_embeddings", bool, False),
        max_position_embeddings=r.positive("max_position_embeddings", default_context),
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        eos_token_ids=read_eos_ids(r),
    )


# model_type -> the family's config reader (ext/models/families/__init__.py fills it).
_READERS: dict[str, Callable[[ConfigReader], ModelConfig]] = {}


def register_family(model_type: str, read_config: Callable[[ConfigReader], ModelConfig]) -> None:
    """Make `parse_config` read configs of `model_type` with `read_config`."""
    _READERS[model_type] = read_config


def parse_config(raw: dict[str, Any], path: str | Path = "config.json") -> ModelConfig:
    """Build a ModelConfig from a parsed config.json, with its family's reader.

    Raises:
        UnsupportedModelError: model_type not in SUPPORTED_MODEL_TYPES.
        MissingConfigFieldError: a needed field is absent.
        UnsupportedConfigError: a value moed cannot compute (hidden_act other
            than silu, RoPE scaling, attention biases on OLMoE's o_proj, ...).
        ConfigError: a field of the wrong type or range.
        ext.formats.quant.QuantizationConfigError: a `quantization_config` moed does
            not read (unknown quant_method, fmt, activation scheme, ...).
    """
    path = Path(path)
    if not isinstance(raw, dict):
        raise ConfigError(path, None, "expected a JSON object")
    model_type = raw.get("model_type")
    if model_type is None:
        raise MissingConfigFieldError(path, "model_type", "is required and missing")
    read = _READERS.get(model_type) if isinstance(model_type, str) else None
    if read is None:
        raise UnsupportedModelError(
            path, "model_type", f"{model_type!r} is not supported (supported: {', '.join(_READERS)})")
    config = read(ConfigReader(path, raw))
    return replace(config, quantization=parse_quantization_config(raw, path))


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `<model_dir>/config.json` and parse it (see `parse_config`).

    Raises ConfigError (or a subclass) naming config.json when the file is
    missing, is not valid JSON, or fails `parse_config`.
    """
    path = Path(model_dir) / "config.json"
    try:
        raw = read_json(path)
    except FileNotFoundError:
        raise ConfigError(path, None, "file not found") from None
    except OSError as e:
        raise ConfigError(path, None, f"cannot be read: {e.strerror or e}") from None
    except MetadataFileError as e:
        raise ConfigError(path, None, str(e).removeprefix(f"{path}: ")) from None
    return parse_config(raw, path)
