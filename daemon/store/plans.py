"""Read plans: which aligned byte ranges of the shards fill one expert's slot.

Conventions. Every offset is an absolute file offset in bytes and every size is in bytes.
A *slot* is one preallocated buffer that holds one routed expert; its bytes are the
concatenation of the expert's *spans* — the aligned supersets of its three projections
(gate [I, H], up [I, H], down [H, I]; see ext/models/experts.py), rounded out to
``align`` (4096) because O_DIRECT needs the file offset, the length, the buffer address
and every iovec aligned, and safetensors data offsets are not. Two projections share a
span only when their aligned ranges touch or overlap in the same shard file; one expert's
projections may sit in three different shards. A tensor is then addressed inside its
span, and ``ReadPlan.views`` returns zero-copy numpy arrays over the slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ext.formats.checkpoint import TensorInfo
from ext.models.experts import PROJECTIONS, ExpertLayout, ExpertLocation, ExpertWeights

ALIGN = 4096  # bytes: O_DIRECT alignment of offset, length, buffer and iovec


def round_down(x: int, align: int) -> int:
    return x - x % align


def round_up(x: int, align: int) -> int:
    return -(-x // align) * align


@dataclass(frozen=True)
class ReadSpan:
    """One contiguous read: ``length`` bytes at file ``offset`` of ``path`` into the slot.

    ``offset`` and ``length`` are multiples of the plan's ``align``; the span lands at
    ``slot_offset`` of the slot buffer; ``tensors`` are the projections it covers, in
    file order.
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
    """Where one projection lies in the slot: in span ``span``, at ``slot_offset`` bytes."""

    info: TensorInfo
    span: int
    slot_offset: int


@dataclass(frozen=True)
class ReadPlan:
    """How one expert is read into a slot of ``slot_bytes`` bytes (see the module doc).

    Build with ``ReadPlan.for_expert``. ``spans`` are sorted by (path, offset) and laid
    end to end in the slot; ``slot_bytes`` is the sum of their aligned lengths (a multiple
    of ``align``) and equals the bytes the io workers issue for this expert.
    """

    layer: int
    expert: int
    align: int
    spans: tuple[ReadSpan, ...]
    gate: TensorPlacement
    up: TensorPlacement
    down: TensorPlacement
    slot_bytes: int

    @classmethod
    def for_expert(cls, location: ExpertLocation, align: int = ALIGN) -> ReadPlan:
        """Plan the reads of ``location``'s three projections at ``align`` bytes.

        Each projection's range is widened to ``[round_down(offset), round_up(end))``;
        ranges in the same file whose widened ranges touch or overlap become one span;
        ranges in different files never do. Raises ValueError if ``align`` is not a
        positive power of two.
        """
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a positive power of two, got {align}")
        infos = dict(zip(PROJECTIONS, location.projections()))
        order = sorted(PROJECTIONS, key=lambda p: (infos[p].path, infos[p].offset))
        groups: list[list] = []  # [path, start, end, [projection names]]
        for proj in order:
            info = infos[proj]
            start = round_down(info.offset, align)
            end = round_up(info.offset + info.nbytes, align)
            last = groups[-1] if groups else None
            if last is not None and last[0] == info.path and start <= last[2]:
                last[2] = max(last[2], end)
                last[3].append(proj)
            else:
                groups.append([info.path, start, end, [proj]])
        spans, placements, slot_offset = [], {}, 0
        for i, (path, start, end, projs) in enumerate(groups):
            spans.append(ReadSpan(path=path, offset=start, length=end - start,
                                  slot_offset=slot_offset,
                                  tensors=tuple(infos[p] for p in projs)))
            for p in projs:
                placements[p] = TensorPlacement(infos[p], i,
                                                slot_offset + infos[p].offset - start)
            slot_offset += end - start
        return cls(layer=location.layer, expert=location.expert, align=align,
                   spans=tuple(spans), slot_bytes=slot_offset, **placements)

    def placements(self) -> tuple[TensorPlacement, TensorPlacement, TensorPlacement]:
        """(gate, up, down) placements."""
        return (self.gate, self.up, self.down)

    def views(self, buffer) -> ExpertWeights:
        """The expert's projections as read-only arrays over ``buffer`` (no copy).

        ``buffer``: a bytes-like object of at least ``slot_bytes`` bytes into which this
        plan was read (e.g. ``SlotArena.buffer(slot)``). Returns ExpertWeights of
        C-contiguous arrays, dtype ``info.numpy_dtype``, shape ``info.shape``, aliasing the
        buffer: they are valid as long as the slot holds this expert. Raises ValueError if
        the buffer is too small.
        """
        mv = memoryview(buffer)
        if mv.nbytes < self.slot_bytes:
            raise ValueError(f"buffer of {mv.nbytes} bytes is smaller than the "
                             f"{self.slot_bytes}-byte slot of expert ({self.layer}, {self.expert})")
        arrays = []
        for p in self.placements():
            dtype = p.info.numpy_dtype
            a = np.frombuffer(mv, dtype=dtype, count=p.info.nbytes // dtype.itemsize,
                              offset=p.slot_offset).reshape(p.info.shape)
            a.flags.writeable = False
            arrays.append(a)
        return ExpertWeights(*arrays)


def max_slot_bytes(layout: ExpertLayout, align: int = ALIGN) -> int:
    """Largest ``ReadPlan.slot_bytes`` over every expert of ``layout`` (0 if none)."""
    return max((ReadPlan.for_expert(loc, align).slot_bytes for loc in layout), default=0)


def plans_for(layout: ExpertLayout, align: int = ALIGN) -> dict[tuple[int, int], ReadPlan]:
    """``ReadPlan`` of every expert of ``layout``, keyed by (layer, expert)."""
    return {(loc.layer, loc.expert): ReadPlan.for_expert(loc, align) for loc in layout}
