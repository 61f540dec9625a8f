"""The table of model families moed serves: `model_type` -> `Family` (ext/models/family.py).

Each family is one module here (its config reading, attention kind, routing rule and
tensor names); adding a family is adding its module and its entry below.
"""
from ext.models.config import ModelConfig, register_family
from ext.models.family import Family
from ext.models.families import (deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe,
                                 qwen3_moe)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    mixtral.FAMILY,
    qwen2_moe.FAMILY,
    qwen3_moe.FAMILY,
    olmoe.FAMILY,
    deepseek_v3.FAMILY,
    glm4_moe.FAMILY,
    gpt_oss.FAMILY,
)}
FAMILIES["kimi_k2"] = deepseek_v3.FAMILY   # Kimi K2: DeepseekV3ForCausalLM under its own name
for _name, _family in FAMILIES.items():
    register_family(_name, _family.read_config)


def family_of(model_type: str) -> Family:
    """The family of a parsed config's model_type (KeyError for one not in the table)."""
    return FAMILIES[model_type]


def kv_bytes_per_token(config: ModelConfig) -> int:
    """Bytes of KV cache one token of one sequence takes, every layer (the attention
    kind's real layout: GQA's K and V per key/value head, MLA's compressed latent)."""
    return family_of(config.model_type).attention.kv_bytes_per_token(config)


def unused_tensors(config: ModelConfig, names) -> list[str]:
    """The tensors of `names` the forward pass never reads: the multi-token-prediction
    layers stored after the decoder's (`model.layers.{l}` for l >= num_hidden_layers,
    DeepSeek-V3's model.layers.61), which a checkpoint may carry and moed ignores."""
    prefix = "model.layers."
    out = []
    for name in names:
        if name.startswith(prefix):
            index = name[len(prefix):].split(".", 1)[0]
            if index.isdigit() and int(index) >= config.num_hidden_layers:
                out.append(name)
    return out
