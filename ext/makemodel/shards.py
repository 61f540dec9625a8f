"""Safetensors shards written tensor by tensor, in bounded memory.

The files are written directly (8-byte little-endian header length, JSON header with
`__metadata__ = {"format": "pt"}` padded with spaces to 8 bytes, then the tensor bytes in
header order); this module assumes a little-endian host. Every tensor draws from its own
`numpy.random.PCG64` stream seeded by (seed, sha256(tensor name)), so a tensor's values
do not depend on how many other tensors the model has, and the same arguments always give
byte-identical files. Values are drawn as float32 and rounded to bf16/f16 with
`ml_dtypes`/numpy `astype` (round-to-nearest-even), in chunks of `_CHUNK_ELEMENTS`.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from ext.makemodel.families import TensorSpec

_DTYPES = {
    # name: (numpy dtype, safetensors dtype, config "dtype")
    "bf16": (np.dtype(ml_dtypes.bfloat16), "BF16", "bfloat16"),
    "f16": (np.dtype(np.float16), "F16", "float16"),
    "f32": (np.dtype(np.float32), "F32", "float32"),
}
_CHUNK_ELEMENTS = 1 << 23  # 8 Mi values = 32 MiB of float32 scratch

RowAdjust = Callable[[np.ndarray, int], None]


def _plan_shards(specs: list[TensorSpec], itemsize: int, shard_size: int) -> list[list[TensorSpec]]:
    """Split tensors greedily, in order, into shards of at most shard_size data bytes."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        if shards[-1] and used + nbytes > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += nbytes
    return shards


def write_shards(out: Path, specs: list[TensorSpec], np_dtype: np.dtype, st_dtype: str,
                  shard_size: int, seed: int, std: float,
                  progress: Callable[[int, int], None] | None,
                  adjust: dict[str, RowAdjust] | None = None) -> None:
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
                for nbytes in _write_tensor(f, spec, np_dtype, seed, bound, scratch,
                                            (adjust or {}).get(spec.name)):
                    done += nbytes
                    if progress is not None:
                        progress(done, total)
    if n > 1:
        index = {"metadata": {"total_parameters": sum(s.numel for s in specs),
                              "total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}
        write_json(out / "model.safetensors.index.json", index)


def _write_tensor(f, spec: TensorSpec, np_dtype: np.dtype, seed: int, bound: float,
                  scratch: np.ndarray, adjust: RowAdjust | None = None) -> Iterator[int]:
    """Write one tensor's bytes in chunks; yield the byte count of each chunk written.

    `adjust`, when given, is called as adjust(rows, first_row) on every chunk of the
    float32 values, viewed as whole rows [n, shape[-1]], before rounding; it edits them
    in place. Chunks are then cut at row boundaries (the random stream is the same).
    """
    if spec.fill == "ones":
        data = np.ones(spec.numel, dtype=np_dtype)
        f.write(data.view(np.uint8).data)
        yield data.nbytes
        return
    digest = hashlib.sha256(spec.name.encode("utf-8")).digest()
    entropy = [seed, *struct.unpack("<4Q", digest)]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
    remaining = spec.numel
    row = spec.shape[-1]
    step = scratch.size if adjust is None else max(row, scratch.size // row * row)
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
        data = chunk if np_dtype == np.float32 else chunk.astype(np_dtype)
        f.write(data.view(np.uint8).data)
        remaining -= count
        yield data.nbytes


def write_json(path: Path, obj: object) -> None:
    """Write obj as indented UTF-8 JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
