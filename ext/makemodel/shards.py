"""Safetensors shards written tensor by tensor, in bounded memory.

The files are written directly (8-byte little-endian header length, JSON header with
`__metadata__ = {"format": "pt"}` padded with spaces to 8 bytes, then the tensor bytes in
header order); this module assumes a little-endian host. Every tensor draws from its own
`numpy.random.PCG64` stream seeded by (seed, sha256(tensor name)), so a tensor's values
do not depend on how many other tensors the model has, and the same arguments always give
byte-identical files. Values are drawn as float32 in chunks of `_CHUNK_ELEMENTS` and
stored by the tensor's `Encoding` (ext/makemodel/lowbit.py): rounded to bf16/f16 with
`ml_dtypes`/numpy `astype` (round-to-nearest-even), or quantised to FP8 / MXFP4, in
which case one spec becomes several stored tensors (the weight and its scales; shard
boundaries may fall between them, as in published checkpoints). The values drawn are
the same whatever the encoding, so a model's fp8 version is its bf16 version quantised.
Within a shard, tensors are laid out by decreasing element size, keeping their order
otherwise (as the safetensors library does), so every tensor's data is aligned to its
element size; a scale that must precede its weight is computed by a first pass over
the weight's values (drawn again, identically, when the weight is written).
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ext.makemodel.families import TensorSpec
from ext.makemodel.lowbit import Encoder, Encoding, StoredTensor, itemsize

_CHUNK_ELEMENTS = 1 << 23  # 8 Mi values = 32 MiB of float32 scratch

RowAdjust = Callable[[np.ndarray, int], None]


def _plan_shards(tensors: list[StoredTensor], shard_size: int) -> list[list[StoredTensor]]:
    """Split tensors greedily, in order, into shards of at most shard_size data bytes."""
    shards: list[list[StoredTensor]] = [[]]
    used = 0
    for t in tensors:
        if shards[-1] and used + t.nbytes > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += t.nbytes
    return shards


def write_shards(out: Path, specs: list[TensorSpec], encoding_of: Callable[[TensorSpec], Encoding],
                 shard_size: int, seed: int, std: float,
                 progress: Callable[[int, int], None] | None,
                 adjust: dict[str, RowAdjust] | None = None, shown: Path | None = None) -> None:
    """Stream every tensor into its shard file and write the index when sharded.

    encoding_of(spec) says how each spec is stored; its first stored tensor is written as
    the values are drawn, the others (scales) from what the encoder kept. shown: the
    directory that errors name (the output's place when `out` is a temporary one;
    default `out`): an OSError (a full disk) names the file being written.
    """
    shown = out if shown is None else shown
    stored = {spec.name: encoding_of(spec).stored(spec) for spec in specs}
    first_of = {stored[spec.name][0].name: spec for spec in specs}
    extra_of = {t.name: spec for spec in specs for t in stored[spec.name][1:]}
    order = [t for spec in specs for t in stored[spec.name]]
    shards = _plan_shards(order, shard_size)
    total = sum(t.nbytes for t in order)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    scratch = np.empty(min(_CHUNK_ELEMENTS, max(s.numel for s in specs)), dtype=np.float32)
    bound = std * math.sqrt(3.0)
    done = 0
    weight_map = {}
    pending: dict[str, np.ndarray] = {}     # scales computed, not yet written
    written: set[str] = set()

    def encode(f, spec: TensorSpec):
        """Draw and encode `spec` (writing its first tensor to f), keep its other tensors."""
        encoding = encoding_of(spec)
        encoder = encoding.encoder(spec)
        yield from _write_tensor(f, spec, encoding, encoder, seed, bound, scratch,
                                 (adjust or {}).get(spec.name))
        for t, data in zip(stored[spec.name][1:], encoder.extras()):
            if t.name not in written:
                pending[t.name] = data

    for file_name, shard in zip(names, shards):
        shard = sorted(shard, key=lambda t: -itemsize(t.dtype))     # stable: aligned data
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in shard:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
            weight_map[t.name] = file_name
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        with writing(shown / file_name), open(out / file_name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t in shard:
                if t.name in first_of:
                    chunks = encode(f, first_of[t.name])
                else:
                    if t.name not in pending:           # its weight comes later: a first pass
                        for _ in encode(_Discard(), extra_of[t.name]):
                            pass
                    data = pending.pop(t.name)
                    f.write(data.view(np.uint8).data)
                    chunks = [data.nbytes]
                written.add(t.name)
                for nbytes in chunks:
                    done += nbytes
                    if progress is not None:
                        progress(done, total)
    if n > 1:
        index = {"metadata": {"total_parameters": sum(math.prod(t.shape) for t in order),
                              "total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}
        with writing(shown / "model.safetensors.index.json"):
            write_json(out / "model.safetensors.index.json", index)


def _write_tensor(f, spec: TensorSpec, encoding: Encoding, encoder: Encoder, seed: int,
                  bound: float, scratch: np.ndarray, adjust: RowAdjust | None = None) -> Iterator[int]:
    """Write one spec's first stored tensor in chunks; yield the byte count of each chunk.

    `adjust`, when given, is called as adjust(rows, first_row) on every chunk of the
    float32 values, viewed as whole rows [n, shape[-1]], before encoding; it edits them
    in place. Chunks are then cut at row boundaries, and at multiples of the encoding's
    `row_multiple` rows when it has one, and of the adjustment's when it has that
    attribute (the random stream is the same).
    """
    if spec.fill == "ones":
        data = encoder.chunk(np.ones((1, spec.numel), dtype=np.float32))
        f.write(data.view(np.uint8).data)
        yield data.nbytes
        return
    digest = hashlib.sha256(spec.name.encode("utf-8")).digest()
    entropy = [seed, *struct.unpack("<4Q", digest)]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
    remaining = spec.numel
    row = spec.shape[-1]
    aligned = adjust is not None or encoding.row_multiple is not None
    if not aligned:
        step = scratch.size
    else:   # whole groups of rows: the encoding's, and the adjustment's (GPT-OSS: an expert)
        rows = row * math.lcm(encoding.row_multiple or 1, getattr(adjust, "row_multiple", 1))
        step = max(rows, scratch.size // rows * rows)
    if step > scratch.size:
        scratch = np.empty(step, dtype=np.float32)
    while remaining:
        count = min(remaining, step)
        chunk = scratch[:count]
        rng.random(out=chunk, dtype=np.float32)  # [0, 1)
        chunk *= np.float32(2.0 * bound)
        chunk -= np.float32(bound)  # [-bound, bound)
        if adjust is not None:
            adjust(chunk.reshape(-1, row), (spec.numel - remaining) // row)
        data = encoder.chunk(chunk.reshape(-1, row) if aligned else chunk.reshape(1, -1))
        f.write(np.ascontiguousarray(data).view(np.uint8).data)
        remaining -= count
        yield data.nbytes


class _Discard:
    """A file that forgets what is written to it (the first pass over a weight)."""

    def write(self, data) -> None:
        pass


@contextmanager
def writing(shown: Path) -> Iterator[None]:
    """An OSError raised inside (ENOSPC, EDQUOT, EIO, ...) names the output file being
    written as the user will find it, `shown` (its place in out_dir: it is written in a
    temporary directory inside it), with its errno: "[Errno 28] No space left on device:
    writing OUT/model.safetensors". The original is its __cause__. (ext/quant/repack.py
    has its twin: the folder rules keep make-model's code apart from the rest of ext.)"""
    try:
        yield
    except OSError as e:
        if e.errno is None:         # an OSError with a message only
            raise OSError(f"{e}: writing {shown}") from e
        raise OSError(e.errno, f"{e.strerror}: writing {shown}") from e


def write_json(path: Path, obj: object) -> None:
    """Write obj as indented UTF-8 JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
