"""The seam between the forward pass and the model families.

A family is what differs between `model_type`s, named once (`Family`): how its
config.json is read, its attention kind, its routing rule and the names of its
tensors. The forward pass (`ext/models/model.py`) asks the family and never tests a
`model_type`; a new family is a module in `ext/models/families/` with its `FAMILY`,
and an entry in the table of `ext/models/families/__init__.py`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ext.models.config import ConfigReader, ModelConfig
from ext.models.ffn import SwiGluExperts

PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class TensorNames:
    """Where a family's MoE-block tensors are, under `model.layers.{l}.`.

    moe_block: the block holding router and experts ("mlp"; Mixtral "block_sparse_moe").
    router: its router, `{moe_block}.{router}.weight` [E, H].
    expert_projections: the tensor names of a routed expert's gate, up and down
        projections, `{moe_block}.experts.{e}.{name}.weight` (Mixtral: w1, w3, w2).
    shared_expert: the shared expert's module, `{moe_block}.{shared_expert}.
        {gate,up,down}_proj.weight`, or None.
    shared_expert_gate: the shared expert's sigmoid gate `{moe_block}.{name}.weight`
        [1, H] (Qwen2-MoE), or None for an ungated shared expert.
    fused_experts: the routed experts are fused over [E, ...] as GPT-OSS stores them
        (`{moe_block}.experts.gate_up_proj`, `.down_proj` and their biases; see
        ext/models/experts.py) instead of one module per expert.
    """

    moe_block: str = "mlp"
    router: str = "gate"
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    fused_experts: bool = False

    def layer(self, layer: int) -> str:
        return f"model.layers.{layer}"

    def moe(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.moe_block}"

    def expert_module(self, layer: int, expert: int, projection: str) -> str:
        """Hub module name of one projection ("gate", "up" or "down") of a routed expert
        (its weight's tensors are named after it: ext/formats/quant.py)."""
        name = self.expert_projections[PROJECTIONS.index(projection)]
        return f"{self.moe(layer)}.experts.{expert}.{name}"

    def expert(self, layer: int, expert: int, projection: str) -> str:
        """Hub tensor name of one projection's weight (plain floats: its only tensor)."""
        return self.expert_module(layer, expert, projection) + ".weight"


@dataclass(frozen=True)
class Family:
    """One model family behind the seam.

    model_type / architecture: config.json's `model_type` and `architectures` entry.
    read_config: config.json (through a ConfigReader) -> ModelConfig; raises ConfigError
        subclasses naming the field.
    attention: the attention kind, a class built once per model as
        attention(config, chunk, n_threads) (`ext.models.attention`).
    routing: the routing rule, a class built once per model as routing(config)
        (`ext.models.routing`).
    tensors: the names of its MoE-block tensors.
    experts: the expert FFN kind (activation and layout of the routed experts), built
        once per model as experts(config, transposed) (`ext.models.ffn`).
    """

    model_type: str
    architecture: str
    read_config: Callable[[ConfigReader], ModelConfig]
    attention: type
    routing: type
    tensors: TensorNames
    experts: type = SwiGluExperts
