"""Routed experts: where each one lives in the checkpoint, and how the MoE block gets it.

An expert is addressed as `(layer, expert)`. Its three projections — gate [I, H],
up [I, H], down [H, I] in Hugging Face naming (Mixtral's w1, w3, w2) — are tensors
of the model's own shards, possibly in three different files (transformers ≥ 5
writes them so). `ExpertLayout` maps an address to those byte ranges; the MoE block
asks an `ExpertProvider` for weights through `acquire` / `release`, so that the
streaming cache can replace the simple providers defined here without touching
the forward pass.
"""
from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ext.formats.checkpoint import Checkpoint, MissingTensorError, TensorInfo, TensorRangeError
from ext.models.config import ModelConfig

PROJECTIONS = ("gate", "up", "down")


def expert_tensor_name(model_type: str, layer: int, expert: int, projection: str) -> str:
    """Hub tensor name of one projection ("gate", "up" or "down") of a routed expert."""
    if model_type == "mixtral":
        w = {"gate": "w1", "up": "w3", "down": "w2"}[projection]
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}_proj.weight"


class ExpertWeights(NamedTuple):
    """One expert's projections as arrays in their native dtype (f32, f16 or bf16).

    gate, up: [moe_intermediate_size, hidden_size]; down: [hidden_size,
    moe_intermediate_size]; C-contiguous. They stay valid until the provider's
    `release` for the same acquire.
    """

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


@dataclass(frozen=True)
class ExpertLocation:
    """Where one routed expert's projections lie on disk (per projection: file,
    absolute offset, byte length, dtype, shape — see `checkpoint.TensorInfo`)."""

    layer: int
    expert: int
    gate: TensorInfo
    up: TensorInfo
    down: TensorInfo

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    def projections(self) -> tuple[TensorInfo, TensorInfo, TensorInfo]:
        return (self.gate, self.up, self.down)


class ExpertLayout:
    """Addresses of every routed expert of a checkpoint, validated against the config.

    Raises:
        MissingTensorError: a projection of some (layer, expert) is absent.
        TensorRangeError: a projection's shape or dtype disagrees with the config
            or with its siblings (every expert of a model shares one dtype).
    """

    def __init__(self, checkpoint: Checkpoint, config: ModelConfig):
        self.config = config
        H, I = config.hidden_size, config.moe_intermediate_size
        expected = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        self._locations: dict[tuple[int, int], ExpertLocation] = {}
        dtype = None
        for layer, is_moe in enumerate(config.moe_layers):
            if not is_moe:
                continue
            for expert in range(config.num_experts):
                infos = {}
                for proj in PROJECTIONS:
                    name = expert_tensor_name(config.model_type, layer, expert, proj)
                    if name not in checkpoint:
                        raise MissingTensorError(
                            f"expert ({layer}, {expert}) projection {proj} is missing",
                            path=checkpoint.model_dir, tensor=name)
                    info = checkpoint.info(name)
                    if info.shape != expected[proj]:
                        raise TensorRangeError(
                            f"shape {list(info.shape)} but the config implies {list(expected[proj])}",
                            path=info.path, tensor=name)
                    dtype = dtype or info.dtype
                    if info.dtype != dtype:
                        raise TensorRangeError(
                            f"dtype {info.dtype} differs from the other experts' {dtype}",
                            path=info.path, tensor=name)
                    info.numpy_dtype  # raises UnsupportedDtypeError for a dtype we cannot compute
                    infos[proj] = info
                self._locations[(layer, expert)] = ExpertLocation(layer, expert, **infos)
        self.dtype = dtype

    def __getitem__(self, key: tuple[int, int]) -> ExpertLocation:
        return self._locations[key]

    def __len__(self) -> int:
        return len(self._locations)

    def __iter__(self):
        return iter(self._locations.values())

    @property
    def max_expert_bytes(self) -> int:
        return max((loc.nbytes for loc in self._locations.values()), default=0)


class ExpertProvider(ABC):
    """Hands the MoE block the weights of the experts a step needs.

    Contract: `acquire(layer, experts)` returns, in the order asked, one
    `ExpertWeights` per expert id, valid until `release(layer, experts)` with
    the same arguments; the forward pass calls each pair exactly once per MoE
    layer and step (or `acquire_in_order` in place of `acquire`). When
    `wants_hints` is True, the forward pass also calls `hint` after each layer's
    attention with each of the next `hint_depth` MoE layers' routers applied to the
    current hidden state, and — when `early_hints` is True — before each MoE layer's
    attention with that layer's own router applied to its input (ahead=0): prefetch
    opportunities; they must not block and never change what `acquire` returns.
    When `wants_routing` is True, `observe_routing` gets each MoE layer's top-k choice
    of every row (for learning and recording; it must not keep the array).
    """

    wants_hints: bool = False
    early_hints: bool = False
    wants_routing: bool = False
    hint_depth: int = 1

    @abstractmethod
    def acquire(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        """Weights for `experts` of `layer`; raises KeyError for an unknown address."""

    def acquire_in_order(self, layer: int, experts: Sequence[int]):
        """Like `acquire`, as the weights become usable: yields (positions, weights) —
        positions into `experts` and their `ExpertWeights` — until every expert was
        yielded once; the caller then calls `release(layer, experts)` — unless the
        iteration raised (a failed read), which leaves nothing to release. The default
        yields them all at once; a provider that reads experts yields resident ones
        first and the others as their reads complete, so compute overlaps the reads."""
        yield list(range(len(experts))), self.acquire(layer, experts)

    def observe_routing(self, layer: int, ids: np.ndarray) -> None:
        """Layer `layer` routed its rows: ids [T, K] int32, each row's experts in rank
        order (a view valid only during the call)."""

    def max_acquire(self, layer: int) -> int | None:
        """Most experts of `layer` one `acquire` may ask for (None: no limit). A prefill
        chunk whose experts outnumber it is computed in batches of at most this many."""
        return None

    def begin_step(self, tokens: int) -> None:
        """`tokens` new positions are about to run through the model (time, in tokens)."""

    def release(self, layer: int, experts: Sequence[int]) -> None:
        """The arrays of the matching `acquire` are no longer used."""

    def hint(self, layer: int, router_logits: np.ndarray, ahead: int = 1) -> None:
        """Layer `layer` will probably need the experts these scores favour.

        Args:
            layer: the MoE layer the prediction is for.
            router_logits: [T, E] float32, that layer's router applied to the
                current hidden state (a view valid only during the call), or a
                callable returning it (computed only when the provider asks).
            ahead: how many MoE layers after the current one `layer` is (1 = next;
                0 = `layer` itself, before its attention).
        """

    def close(self) -> None:
        """Free buffers and file handles."""


def _view(buf, offset: int, info: TensorInfo) -> np.ndarray:
    return np.frombuffer(buf, dtype=info.numpy_dtype, count=info.nbytes // info.numpy_dtype.itemsize,
                         offset=offset).reshape(info.shape)


class ResidentExpertProvider(ExpertProvider):
    """Every routed expert read into RAM at start (anonymous memory, native dtype).

    Memory: `layout` total expert bytes. For models whose experts fit in RAM, and
    as the all-experts-resident reference of the benchmarks.
    """

    def __init__(self, checkpoint: Checkpoint, layout: ExpertLayout):
        self._weights: dict[tuple[int, int], ExpertWeights] = {}
        for loc in layout:
            arrays = [checkpoint.load(info.name) for info in loc.projections()]
            self._weights[(loc.layer, loc.expert)] = ExpertWeights(*arrays)

    def acquire(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        return [self._weights[(layer, int(e))] for e in experts]

    def close(self) -> None:
        self._weights.clear()


class MmapExpertProvider(ExpertProvider):
    """Experts served from read-only memory maps of the shards (the page cache).

    Nothing is read at start; the kernel pages weights in on first touch and may
    drop them under memory pressure. This is the page-cache baseline that the
    streaming cache is measured against.
    """

    def __init__(self, layout: ExpertLayout):
        self._layout = layout
        self._maps: dict[str, mmap.mmap] = {}
        self._views: dict[tuple[int, int], ExpertWeights] = {}

    def _map(self, path: str) -> mmap.mmap:
        m = self._maps.get(path)
        if m is None:
            fd = os.open(path, os.O_RDONLY)
            try:
                m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            self._maps[path] = m
        return m

    def acquire(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        out = []
        for e in experts:
            key = (layer, int(e))
            w = self._views.get(key)
            if w is None:
                loc = self._layout[key]
                w = ExpertWeights(*(_view(self._map(i.path), i.offset, i) for i in loc.projections()))
                self._views[key] = w
            out.append(w)
        return out

    def close(self) -> None:
        self._views.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the map closes when it is freed
                pass
        self._maps.clear()
