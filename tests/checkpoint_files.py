"""Reading (and, to damage a copy, rewriting) what a checkpoint directory holds without
the code under test: the safetensors headers of every shard (8-byte little-endian length,
then JSON)."""
from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path


def headers(model_dir: Path) -> dict[str, dict]:
    """name -> header entry (dtype, shape, data_offsets) over every shard."""
    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out.update(header)
    return out


def edit_header(model_dir: Path, tensor: str, **fields) -> Path:
    """Rewrite `tensor`'s entry in the header of the shard the index puts it in (its data
    left as it is: the data offsets are relative to the end of the header); returns the
    shard's path."""
    model_dir = Path(model_dir)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shard = model_dir / index["weight_map"][tensor]
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header[tensor].update(fields)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    return shard


def no_space(*args, **kwargs):
    """Raise what a full disk raises (ENOSPC)."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FullFile:
    """A file opened for writing on a disk that fills after its first bytes: the first
    write goes through, every later one raises ENOSPC."""

    def __init__(self, f):
        self._f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def write(self, data):
        if self._f.tell() > 0:
            no_space()
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)
