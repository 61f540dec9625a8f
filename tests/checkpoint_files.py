"""Reading what a checkpoint directory holds without the code under test: the
safetensors headers of every shard (8-byte little-endian length, then JSON)."""
from __future__ import annotations

import json
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
