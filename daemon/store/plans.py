"""Read plans: which aligned byte ranges of the shards fill one expert's slot.

Conventions. Every offset is an absolute file offset in bytes and every size is in bytes.
A *slot* is one preallocated buffer that holds one routed expert; its bytes are the
concatenation of the expert's *spans* — the aligned supersets of its *pieces*, rounded
out to ``align`` (4096) because O_DIRECT needs the file offset, the length, the buffer
address and every iovec aligned, and safetensors data offsets are not. The pieces are
every tensor (or byte range of a tensor fused over experts) of its three projections
(gate [I, H], up [I, H], down [H, I]; see ext/models/experts.py): one per projection in
f32/f16/bf16, the weight and its block scales in FP8, blocks and scales in MXFP4
(ext/formats/quant.py). Two pieces share a span only when their aligned ranges touch or
overlap in the same shard file; one expert's pieces may sit in several shards. A piece
is then addressed inside its span, and ``ReadPlan.views`` returns the kernels' weights
(arrays, or QuantizedWeights over the pieces) as zero-copy views of the slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ext.formats.checkpoint import TensorInfo
from ext.formats.quant import StoredWeight
from ext.models.experts import ExpertLayout, ExpertLocation, ExpertWeights, expert_weights
from ext.models.weights import view_weight

ALIGN = 4096  # bytes: O_DIRECT alignment of offset, length, buffer and iovec


def round_down(x: int, align: int) -> int:
    return x - x % align


def round_up(x: int, align: int) -> int:
    return -(-x // align) * align


@dataclass(frozen=True)
class ReadSpan:
    """One contiguous read: ``length`` bytes at file ``offset`` of ``path`` into the slot.

    ``offset`` and ``length`` are multiples of the plan's ``align``; the span lands at
    ``slot_offset`` of the slot buffer; ``tensors`` are the pieces it covers, in file
    order.
    """

    path: str
    offset: int
    length: int
    slot_offset: int
    tensors: tuple[TensorInfo, ...]

    @property
    def needed_bytes(self) -> int:
        """Bytes from ``offset`` that must be read for every tensor to be complete.

        Less than ``length`` when the aligned end lies past the end of the file; a read
        that stops at end of file is complete when it covers this many bytes.
        """
        return max(t.offset + t.nbytes for t in self.tensors) - self.offset


@dataclass(frozen=True)
class TensorPlacement:
    """Where one piece lies in the slot: in span ``span``, at ``slot_offset`` bytes."""

    info: TensorInfo
    span: int
    slot_offset: int


@dataclass(frozen=True)
class ReadPlan:
    """How one expert is read into a slot of ``slot_bytes`` bytes (see the module doc).

    Build with ``ReadPlan.for_expert``. ``spans`` are sorted by (path, offset) and laid
    end to end in the slot; ``slot_bytes`` is the sum of their aligned lengths (a multiple
    of ``align``) and equals the bytes the io workers issue for this expert.
    ``placements`` has one entry per piece, in ``ExpertLocation.pieces()`` order;
    ``weights`` are the projections (gate, up, down) the pieces make up (empty for a plan
    that is only read, never viewed, as the storage probe's).
    """

    layer: int
    expert: int
    align: int
    spans: tuple[ReadSpan, ...]
    placements: tuple[TensorPlacement, ...]
    slot_bytes: int
    weights: tuple[StoredWeight, ...] = ()

    @classmethod
    def for_expert(cls, location: ExpertLocation, align: int = ALIGN) -> ReadPlan:
        """Plan the reads of every piece of ``location`` at ``align`` bytes.

        Each piece's range is widened to ``[round_down(offset), round_up(end))``; ranges
        in the same file whose widened ranges touch or overlap become one span; ranges in
        different files never do. Raises ValueError if ``align`` is not a positive power
        of two.
        """
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a positive power of two, got {align}")
        pieces = location.pieces()
        order = sorted(range(len(pieces)), key=lambda i: (pieces[i].path, pieces[i].offset))
        groups: list[list] = []  # [path, start, end, [piece indices]]
        for i in order:
            info = pieces[i]
            start = round_down(info.offset, align)
            end = round_up(info.offset + info.nbytes, align)
            last = groups[-1] if groups else None
            if last is not None and last[0] == info.path and start <= last[2]:
                last[2] = max(last[2], end)
                last[3].append(i)
            else:
                groups.append([info.path, start, end, [i]])
        spans, placements, slot_offset = [], [None] * len(pieces), 0
        for g, (path, start, end, members) in enumerate(groups):
            spans.append(ReadSpan(path=path, offset=start, length=end - start,
                                  slot_offset=slot_offset,
                                  tensors=tuple(pieces[i] for i in members)))
            for i in members:
                placements[i] = TensorPlacement(pieces[i], g, slot_offset + pieces[i].offset - start)
            slot_offset += end - start
        return cls(layer=location.layer, expert=location.expert, align=align,
                   spans=tuple(spans), placements=tuple(placements), slot_bytes=slot_offset,
                   weights=location.projections())

    @cached_property
    def view_signature(self) -> tuple:
        """What `views` makes of a buffer besides its bytes: each projection's format,
        shape and block, and each of its pieces' dtype, shape, length and slot offset.
        Two plans with equal signatures give views of one buffer that differ in nothing
        but which expert's bytes it holds (names and file positions only say where the
        bytes came from)."""
        at = {p.info: p.slot_offset for p in self.placements}
        return tuple(None if w is None else
                     (w.format, w.shape, w.block, tuple((i.dtype, i.shape, i.nbytes, at[i]) for i in w.pieces))
                     for w in self.weights)

    def views(self, buffer) -> ExpertWeights:
        """The expert's projections as read-only kernel weights over ``buffer`` (no copy).

        ``buffer``: a bytes-like object of at least ``slot_bytes`` bytes into which this
        plan was read (e.g. ``SlotArena.buffer(slot)``). Returns ExpertWeights of arrays
        (C-contiguous, dtype ``info.numpy_dtype``, shape ``info.shape``) or
        QuantizedWeights over such arrays, aliasing the buffer: they are valid as long
        as the slot holds this expert. Raises ValueError if the buffer is too small.
        """
        mv = memoryview(buffer)
        if mv.nbytes < self.slot_bytes:
            raise ValueError(f"buffer of {mv.nbytes} bytes is smaller than the "
                             f"{self.slot_bytes}-byte slot of expert ({self.layer}, {self.expert})")
        at = {p.info: p.slot_offset for p in self.placements}

        def view(info: TensorInfo) -> np.ndarray:
            dtype = info.numpy_dtype
            a = np.frombuffer(mv, dtype=dtype, count=info.nbytes // dtype.itemsize,
                              offset=at[info]).reshape(info.shape)
            a.flags.writeable = False
            return a

        return expert_weights(self.weights, lambda w: view_weight(w, view))


def max_slot_bytes(layout: ExpertLayout, align: int = ALIGN) -> int:
    """Largest ``ReadPlan.slot_bytes`` over every expert of ``layout`` (0 if none)."""
    return max((ReadPlan.for_expert(loc, align).slot_bytes for loc in layout), default=0)


def plans_for(layout: ExpertLayout, align: int = ALIGN) -> dict[tuple[int, int], ReadPlan]:
    """``ReadPlan`` of every expert of ``layout``, keyed by (layer, expert)."""
    return {(loc.layer, loc.expert): ReadPlan.for_expert(loc, align) for loc in layout}
