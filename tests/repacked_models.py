"""Test fixtures in every stored format, repacked ones included: `make_in_format` writes
a make-model checkpoint, and for "int4" / "int8" repacks a bf16 one with `moed repack`'s
writer (groups of 32; int4 with a minimum), so the invariance suites run on each."""
from __future__ import annotations

from pathlib import Path

from ext.formats.repacked import QuantScheme
from ext.makemodel import make_model
from ext.quant.repack import RepackSpec, repack

REPACKED = ("int4", "int8")


def make_in_format(out: Path, dtype: str, **kw) -> Path:
    """make_model(out, dtype=dtype, **kw), or its bf16 version repacked into `out`."""
    if dtype not in REPACKED:
        return make_model(out, dtype=dtype, **kw)
    source = make_model(out.parent / f"{out.name}-bf16", dtype="bf16", **kw)
    spec = RepackSpec(QuantScheme(dtype, 32, dtype == "int4"))
    repack(source, out, spec, shard_size=kw.get("shard_size", 2 << 30))
    return out
