"""Routed experts: where each one lives in the checkpoint, and how the MoE block gets it.

An expert is addressed as `(layer, expert)`. Its three projections — gate [I, H],
up [I, H], down [H, I] in Hugging Face naming (Mixtral's w1, w3, w2) — are linear
weights stored in one of the formats of ext/formats/quant.py: one tensor each
(f32/f16/bf16), or several *pieces* each (FP8: the weight and its block scales; MXFP4:
blocks and scales), possibly in different files (transformers ≥ 5 writes them so), or
byte ranges of tensors fused over experts. `ExpertLayout` maps an address to those
pieces; the MoE block asks an `ExpertProvider` for weights through `acquire` /
`release`, so that the streaming cache can replace the simple providers defined here
without touching the forward pass.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ext.formats._guarded_map import GuardedMap, faults_total
from ext.formats.checkpoint import (Checkpoint, MissingTensorError, TensorInfo, TensorRangeError,
                                    TruncatedFileError, UnsupportedDtypeError)
from ext.formats.quant import (EXPERT, LAYOUTS, MXFP4, PLAIN_FORMATS, FormatMismatchError,
                               StoredWeight, resolve_weight)
from ext.models.config import ModelConfig
from ext.models.families import family_of
from ext.models.family import PROJECTIONS
from ext.models.weights import Weight, read_weight, view_weight


def expert_module_name(model_type: str, layer: int, expert: int, projection: str) -> str:
    """Hub module name of one projection ("gate", "up" or "down") of a routed expert."""
    return family_of(model_type).tensors.expert_module(layer, expert, projection)


def expert_tensor_name(model_type: str, layer: int, expert: int, projection: str) -> str:
    """Hub name of one projection's weight, `<module>.weight` (its only tensor when the
    weight is plain floats)."""
    return expert_module_name(model_type, layer, expert, projection) + ".weight"


class ExpertWeights(NamedTuple):
    """One expert's projections as the kernels take them: arrays in their native dtype
    (f32, f16, bf16) or QuantizedWeights over the stored pieces (ext/models/weights.py).

    gate, up: [moe_intermediate_size, hidden_size]; down: [hidden_size,
    moe_intermediate_size]. Experts fused as GPT-OSS stores them have gate = the
    interleaved gate_up ([2I, H], or [H, 2I] when the layout is `transposed`), up None
    and down [H, I] (or [I, H]). They stay valid until the provider's `release` for
    the same acquire.
    """

    gate: Weight
    up: Weight | None
    down: Weight


def expert_weights(projections, make) -> ExpertWeights:
    """ExpertWeights of make(w) for each projection (gate, up, down) of a location's
    `projections()`; a missing up (fused gate_up) stays None."""
    return ExpertWeights(*(None if w is None else make(w) for w in projections))


@dataclass(frozen=True)
class ExpertLocation:
    """Where one routed expert's projections lie on disk: per projection a StoredWeight,
    whose pieces give file, absolute offset, byte length, dtype and shape."""

    layer: int
    expert: int
    gate: StoredWeight
    up: StoredWeight | None            # None: gate is GPT-OSS's interleaved gate_up
    down: StoredWeight

    @property
    def nbytes(self) -> int:
        """Bytes of every piece of the expert (weights and scales)."""
        return sum(p.nbytes for p in self.pieces())

    def projections(self) -> tuple[StoredWeight, StoredWeight | None, StoredWeight]:
        return (self.gate, self.up, self.down)

    def pieces(self) -> tuple[TensorInfo, ...]:
        """Every tensor (or byte range) the expert is made of, projection by projection."""
        return tuple(p for w in self.projections() if w is not None for p in w.pieces)


class ExpertLayout:
    """Addresses of every routed expert of a checkpoint, validated against the config.

    `format` is the experts' stored format (ext.formats.quant.formats(): "bf16",
    "fp8_e4m3", "mxfp4", ...). Reads tensor headers only; the scale values are checked
    by `check_scales`.

    Raises:
        MissingTensorError: a projection (or a piece of it) of some (layer, expert) is
            absent.
        TensorRangeError: a projection's shape disagrees with the config, its format or
            piece dtypes with its siblings' (every expert of a model shares one), or its
            scales' block with the same projection's of the other experts.
        QuantizationError: pieces that disagree with each other or with the
            quantization config (ext/formats/quant.py).
    """

    def __init__(self, checkpoint: Checkpoint, config: ModelConfig):
        self.config = config
        H, I = config.hidden_size, config.moe_intermediate_size
        expected = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        self._locations: dict[tuple[int, int], ExpertLocation] = {}
        names = family_of(config.model_type).tensors
        self.transposed = False        # plain fused experts stored [in, out] (GPT-OSS)
        kind = None
        blocks: dict[str, tuple[int, int] | None] = {}   # proj -> the block of its scales
        for layer, is_moe in enumerate(config.moe_layers):
            if not is_moe:
                continue
            for expert in range(config.num_experts):
                if names.fused_experts:
                    weights = self._fused(checkpoint, names.moe(layer), expert)
                else:
                    weights = {}
                    for proj in PROJECTIONS:
                        module = expert_module_name(config.model_type, layer, expert, proj)
                        weights[proj] = resolve_weight(checkpoint.tensors, module, expected[proj], EXPERT,
                                                       config.quantization, checkpoint.model_dir)
                for proj, w in weights.items():
                    if w is None:
                        continue
                    this = (w.format, tuple(p.dtype for p in w.pieces))
                    kind = kind or this
                    # one format for every expert; the block each scale covers may differ
                    # between projections (moed's repack groups g = min(group_size, C)
                    # inputs, so down's differs when intermediate_size < group_size)
                    block = blocks.setdefault(proj, w.block)
                    if this != kind or w.block != block:
                        first = w.pieces[0]
                        raise TensorRangeError(
                            f"stored as {_describe(this, w.block)}, unlike the other experts' "
                            f"{_describe(kind, block)}", path=first.path, tensor=first.name)
                self._locations[(layer, expert)] = ExpertLocation(layer, expert, **weights)
        self.format = kind[0] if kind else None

    def _fused(self, checkpoint: Checkpoint, moe: str, expert: int) -> dict[str, StoredWeight | None]:
        """Expert `expert` of GPT-OSS's tensors fused over experts under `moe`.experts:
        `gate_up_proj` (gate and up interleaved) and `down_proj`, either MXFP4
        (`<param>_blocks` [E, R, C/32, 16] + `<param>_scales` [E, R, C/32], rows =
        outputs) or plain floats [E, in, out] as transformers stores them (then the
        layout is `transposed`). Raises MissingTensorError, FormatMismatchError (both
        at once, or against the quantization_config), TensorRangeError (shapes)."""
        c = self.config
        H, I, E = c.hidden_size, c.moe_intermediate_size, c.num_experts
        quant, where, tensors = c.quantization, checkpoint.model_dir, checkpoint.tensors
        out: dict[str, StoredWeight | None] = {"up": None}
        for proj, param, shape in (("gate", f"{moe}.experts.gate_up_proj", (2 * I, H)),
                                   ("down", f"{moe}.experts.down_proj", (H, I))):
            quantised = [n for n in (f"{param}_blocks", f"{param}_scales") if n in tensors]
            if quantised and param in tensors:
                info = tensors[param]
                raise FormatMismatchError(f"stored as plain floats and as MXFP4 ({quantised[0]}) at once",
                                          path=info.path, tensor=param)
            if quantised:
                first = tensors[quantised[0]]
                if quant is None or not quant.allows(param, MXFP4):
                    raise FormatMismatchError("stored as mxfp4, but config.json's quantization_config "
                                              "does not store these experts in MXFP4",
                                              path=first.path, tensor=first.name)
                if first.shape[:1] != (E,):
                    raise TensorRangeError(f"shape {list(first.shape)}: the leading axis must hold "
                                           f"the {E} experts", path=first.path, tensor=first.name)
                out[proj] = LAYOUTS[MXFP4].fused_expert(tensors, param, expert, shape, where)
                continue
            if param not in tensors:
                raise MissingTensorError("required by the config but missing from the checkpoint",
                                         path=where, tensor=param)
            info = tensors[param]
            if info.dtype not in PLAIN_FORMATS:
                raise UnsupportedDtypeError(f"dtype {info.dtype} is not a weight format moed reads",
                                            path=info.path, tensor=param)
            want = (E, shape[1], shape[0])                   # [E, in, out]
            if info.shape != want:
                raise TensorRangeError(f"shape {list(info.shape)} but the config implies {list(want)}",
                                       path=info.path, tensor=param)
            if quant is not None and quant.requires(param, EXPERT):
                raise FormatMismatchError(f"dtype {info.dtype}, but config.json's quantization_config "
                                          "stores these experts quantised", path=info.path, tensor=param)
            out[proj] = StoredWeight(name=f"{param}[{expert}]", shape=want[1:],
                                     format=PLAIN_FORMATS[info.dtype], pieces=(info.index(expert),))
            self.transposed = True
        return out

    def __getitem__(self, key: tuple[int, int]) -> ExpertLocation:
        return self._locations[key]

    def __len__(self) -> int:
        return len(self._locations)

    def __iter__(self):
        return iter(self._locations.values())

    @property
    def max_expert_bytes(self) -> int:
        return max((loc.nbytes for loc in self._locations.values()), default=0)

    def check_scales(self, checkpoint: Checkpoint) -> None:
        """Read every expert's scale pieces and refuse unusable ones (BadScaleError naming
        the file and tensor): NaN, inf or negative scales, E8M0 255. Nothing to do for
        plain float experts. Reads only the scales (1/16 of an MXFP4 expert, far less
        of an FP8 one)."""
        for loc in self:
            for w in filter(None, loc.projections()):
                pieces = w.checked_pieces()
                if pieces:
                    w.check_values({role: checkpoint.read(p) for role, p in pieces.items()})


def _describe(kind: tuple, block: tuple[int, int] | None) -> str:
    fmt, dtypes = kind
    text = f"{fmt} ({', '.join(dtypes)})" if len(dtypes) > 1 else fmt
    return text if block is None else f"{text} in blocks of {block[0]}x{block[1]}"


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

    def end_step(self) -> None:
        """The step of the last `begin_step` has run every layer (not called when it failed)."""

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
    dtype = info.numpy_dtype
    return np.frombuffer(buf, dtype=dtype, count=info.nbytes // dtype.itemsize,
                         offset=offset).reshape(info.shape)


class ResidentExpertProvider(ExpertProvider):
    """Every routed expert read into RAM at start (anonymous memory, stored format).

    Memory: `layout` total expert bytes. For models whose experts fit in RAM, and
    as the all-experts-resident reference of the benchmarks.
    """

    def __init__(self, checkpoint: Checkpoint, layout: ExpertLayout):
        self._weights: dict[tuple[int, int], ExpertWeights] = {}
        for loc in layout:
            self._weights[(loc.layer, loc.expert)] = expert_weights(
                loc.projections(), lambda w: read_weight(checkpoint, w))

    def acquire(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        return [self._weights[(layer, int(e))] for e in experts]

    def close(self) -> None:
        self._weights.clear()


class MmapExpertProvider(ExpertProvider):
    """Experts served from read-only memory maps of the shards (the page cache).

    Nothing is read at start; the kernel pages weights in on first touch and may
    drop them under memory pressure. This is the page-cache baseline that the
    streaming cache is measured against.

    A shard truncated under a plain mapping kills the process with SIGBUS at the first
    touch of a page past its new end. So every acquire first checks (one fstat per shard
    of the call, well under a microsecond) that each shard still holds the acquired
    experts' bytes, and raises TruncatedFileError naming the file, the expert and the
    sizes; and the shards are mapped as ext.formats GuardedMaps, so that a truncation
    after that check — while the kernels read — reads zeros instead of killing the
    process: `release` sees the map's fault count and raises TruncatedFileError naming
    the file (the layer's rows were computed from bytes that may be zeros and must not
    be used), and the next acquire maps the file again. `failing()` reports either until
    the shard is whole again.

    A shard restored by replacing its file (a copy renamed over the path, as rsync,
    package managers and `cp` + `mv` do) leaves the open descriptor and its map on the old,
    unlinked inode, which stays short. So when a size check fails, the path is stat'ed,
    and if it names another file (st_dev, st_ino) than the open one, the shard is opened
    and mapped again from the path; `failing()` judges a shard by the file its path names.
    """

    def __init__(self, layout: ExpertLayout):
        self._layout = layout
        self._maps: dict[str, GuardedMap] = {}
        self._fds: dict[str, int] = {}
        self._views: dict[tuple[int, int], ExpertWeights] = {}
        self._ends: dict[tuple[int, int], dict[str, int]] = {}   # per expert: file -> its end
        self._failing: dict[str, tuple[int, str]] = {}           # file -> (end needed, why)
        self._faults_seen = faults_total()      # every map made since holds no fault
        self._faults_at: dict[int, int] = {}    # layer -> faults_total() at its acquire
        self._file_ends: dict[str, int] = {}                     # file -> its last expert's end
        for loc in layout:
            for info in loc.pieces():
                end = info.offset + info.nbytes
                self._file_ends[info.path] = max(self._file_ends.get(info.path, 0), end)

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _replaced(self, path: str) -> bool:
        """Whether `path` now names another file than the one open for it; if so, close
        the open one and drop its map and the views over it, so that the next `_fd` /
        `_map` open and map the file the path names. (A view still held by a caller keeps
        its old map alive until it is dropped.)"""
        fd = self._fds.get(path)
        if fd is None:
            return False
        try:
            now = os.stat(path)
        except OSError:
            return False                # removed: keep serving from (or failing on) the open file
        was = os.fstat(fd)
        if (now.st_dev, now.st_ino) == (was.st_dev, was.st_ino):
            return False
        self._maps.pop(path, None)
        self._views.clear()
        del self._fds[path]
        os.close(fd)
        return True

    def _map(self, path: str) -> GuardedMap:
        m = self._maps.get(path)
        if m is None:
            fd = self._fd(path)
            # never shorter than its experts: a file cut since the check reads as a fault
            m = self._maps[path] = GuardedMap(fd, max(os.fstat(fd).st_size, self._file_ends[path]))
        return m

    def _paths(self, layer: int, experts: Sequence[int]) -> set[str]:
        """The shards that hold the experts of a call (known after `_check_sizes`)."""
        return {path for e in experts for path in self._ends[(layer, int(e))]}

    def _check_sizes(self, layer: int, experts: Sequence[int]) -> None:
        """Raise TruncatedFileError when a shard no longer holds an expert of the call."""
        need: dict[str, tuple[int, int]] = {}                    # file -> (end, expert)
        for e in experts:
            key = (layer, int(e))
            ends = self._ends.get(key)
            if ends is None:
                ends = {}
                for info in self._layout[key].pieces():
                    ends[info.path] = max(ends.get(info.path, 0), info.offset + info.nbytes)
                self._ends[key] = ends
            for path, end in ends.items():
                if end > need.get(path, (0, 0))[0]:
                    need[path] = (end, int(e))
        for path, (end, expert) in need.items():
            size = os.fstat(self._fd(path)).st_size
            if size < end and self._replaced(path):
                size = os.fstat(self._fd(path)).st_size     # the file now at the path
            if size < end:
                what = path if self._names_open_file(path) else (
                    f"the file open as {path} (since removed or replaced there)")
                why = (f"{what} ends at byte {size}, before layer {layer} expert {expert}'s "
                       f"weights end at {end} (truncated while served)")
                self._failing[path] = (end, why)
                raise TruncatedFileError(why, path=path, tensor=None)
            self._failing.pop(path, None)

    def _names_open_file(self, path: str) -> bool:
        """Whether `path` still names the file open for it."""
        try:
            now, was = os.stat(path), os.fstat(self._fds[path])
        except (OSError, KeyError):
            return False
        return (now.st_dev, now.st_ino) == (was.st_dev, was.st_ino)

    def failing(self) -> str | None:
        """Why experts cannot be served now (a shard truncated below an expert it holds),
        until every such shard is whole again (re-checked here, on the file its path
        names: the next acquire opens a replaced one); else None."""
        for path, (end, why) in list(self._failing.items()):
            try:
                whole = os.stat(path).st_size >= end
            except OSError:
                whole = False
            if not whole:
                return why
            self._failing.pop(path, None)
        return None

    def acquire(self, layer: int, experts: Sequence[int]) -> list[ExpertWeights]:
        self._check_sizes(layer, experts)
        total = faults_total()
        if total != self._faults_seen:  # some map faulted: it is part zeros, map its file again
            faulted = [path for path, m in self._maps.items() if m.faults]
            for path in faulted:
                del self._maps[path]
            if faulted:
                self._views.clear()     # (a view keeps its old map alive until it is dropped)
            self._faults_seen = total
        self._faults_at[layer] = total
        out = []
        for e in experts:
            key = (layer, int(e))
            w = self._views.get(key)
            if w is None:
                loc = self._layout[key]
                w = expert_weights(loc.projections(), lambda p: view_weight(
                    p, lambda i: _view(self._map(i.path), i.offset, i)))
                self._views[key] = w
            out.append(w)
        return out

    def release(self, layer: int, experts: Sequence[int]) -> None:
        """Raises TruncatedFileError when a shard of the call was cut while its experts
        were read (their maps counted a fault): the rows computed since `acquire` may
        come from zeros."""
        if faults_total() == self._faults_at.pop(layer, None):
            return                      # no map of the process faulted since the acquire
        for path in sorted(self._paths(layer, experts)):
            m = self._maps.get(path)
            if m is not None and m.faults:
                size = os.fstat(self._fd(path)).st_size
                end = max(self._ends[(layer, int(e))].get(path, 0) for e in experts)
                why = (f"{path} was cut to {size} bytes while layer {layer}'s experts were "
                       f"read from it (truncated while served)")
                self._failing[path] = (end, why)
                raise TruncatedFileError(why, path=path, tensor=None)

    def close(self) -> None:
        self._views.clear()
        self._maps.clear()       # each unmaps when its last view is gone
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
