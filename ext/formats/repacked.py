"""moed's own repack format: int4 / int8 group quantisation, as `moed repack` writes it.

A repacked model directory is an ordinary Hugging Face model directory (config.json,
tokenizer files, generation_config.json, safetensors shards and their index) whose
config.json carries moed's ``quantization_config``::

    "quantization_config": {
      "quant_method": "moed",            # this format; nothing else writes it
      "format_version": 1,
      "scheme": "int4",                  # the routed experts' scheme: "int4" | "int8"
      "group_size": 32,                  # weights per scale, along a row: 32 | 64 | 128
      "min": true,                       # int4 only: a float16 minimum per group
      "weights": ["model.layers.*.mlp.experts.*.gate_proj.weight", ...],
      "dense": null,                     # or {"scheme": "int8", "group_size": 32,
                                         #     "min": false, "weights": [...]}
      "alignment": 4096,                 # bytes; every routed expert starts on it
      "quantizer": {...},                # how the codes were chosen (provenance only)
      "source": {...}                    # what was repacked (provenance only)
    }

``weights`` are fnmatch patterns (``fnmatch.fnmatchcase``) over tensor names: every
tensor of the index they match is quantised with the entry's scheme, and no other
tensor is. A quantised tensor keeps its name for its codes and has siblings:

    <name>                    int8: I8 [R, C]                code q in [-127, 127]
                              int4: U8 [R, C / 2]            two codes per byte: element
                                                             2i in the low nibble of byte i,
                                                             2i+1 in the high nibble
    <name minus .weight>.weight_scale   F16 [R, C / g]       one scale per group
    <name minus .weight>.weight_min     F16 [R, C / g]       int4 with "min": true only

where [R, C] is the original weight's shape (out_features, in_features) and
g = min(group_size, C) (a row shorter than the group size is one group; C must be a
multiple of g, and of 2 for int4). Element (r, c) belongs to group c // g, and its value
is, computed in float32:

    int8:              q * scale
    int4, "min": true  code * scale + min         (code in 0..15)
    int4, "min": false (code - 8) * scale         (code in 0..15)

Scales and minimums are finite float16 values of either sign (a symmetric int4 group
whose largest magnitude is positive has a negative scale, so level -8 lands on it).

Shards are laid out for streaming: each shard's header is padded with spaces (the
safetensors spec allows trailing whitespace in the header) so that its data starts
at a multiple of ``alignment`` bytes in the file; each routed expert's tensors —
gate, up, down, each as codes, scale, min — are contiguous and start at a multiple of
``alignment``, so one expert is one aligned read; inside an expert each tensor starts
at a multiple of 64 bytes. Safetensors allows no holes in the data, so every gap is an
explicit padding tensor: dtype U8, shape [n], zero bytes, named
``moed.padding.<shard index>.<k>`` (PADDING_PREFIX). Padding tensors appear in their
shard's header only: the index's ``weight_map`` lists every other tensor (a repacked
directory always has an index, even with one shard).

This module is the format's definition: parsing and checking ``quantization_config``
(`RepackConfig`), the tensor names (`scale_name`, `min_name`), shapes
(`QuantScheme.shapes`), the packing of int4 codes (`pack_int4` / `unpack_int4`) and a
reference decode (`dequantize`). Errors are `RepackFormatError` (a CheckpointError) naming
config.json and the field, or the shard and tensor at fault.
"""
from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ext.formats.checkpoint import Checkpoint, CheckpointError, TensorInfo

QUANT_METHOD = "moed"
FORMAT_VERSION = 1
SCHEMES = ("int4", "int8")
GROUP_SIZES = (32, 64, 128)
ALIGNMENT = 4096            # bytes: an expert's first byte, and a shard's data start
TENSOR_ALIGNMENT = 64       # bytes: each tensor inside an expert
PADDING_PREFIX = "moed.padding."


class RepackFormatError(CheckpointError):
    """A repacked model whose quantization_config, or whose tensors against it, is wrong."""


def _base(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def scale_name(name: str) -> str:
    """The scale tensor of quantised tensor `name` ("x.weight" -> "x.weight_scale")."""
    return _base(name) + ".weight_scale"


def min_name(name: str) -> str:
    """The minimum tensor of quantised tensor `name` ("x.weight" -> "x.weight_min")."""
    return _base(name) + ".weight_min"


def is_padding(name: str) -> bool:
    return name.startswith(PADDING_PREFIX)


@dataclass(frozen=True)
class QuantScheme:
    """One quantisation scheme: "int4" or "int8", a group size, int4's optional minimum."""

    scheme: str
    group_size: int
    min: bool = False

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r} (known: {', '.join(SCHEMES)})")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size {self.group_size!r} is not one of {GROUP_SIZES}")
        if self.min and self.scheme != "int4":
            raise ValueError("only int4 carries a per-group minimum")

    @property
    def bits(self) -> int:
        return 4 if self.scheme == "int4" else 8

    @property
    def code_dtype(self) -> str:
        """The safetensors dtype of the codes: "U8" (int4, packed) or "I8"."""
        return "U8" if self.scheme == "int4" else "I8"

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight: codes plus float16 scale (and min) per group_size."""
        return self.bits + 16 * (2 if self.min else 1) / self.group_size

    def group(self, columns: int) -> int:
        """The group length of a tensor of `columns` columns: min(group_size, columns)."""
        return min(self.group_size, columns)

    def check_columns(self, columns: int) -> str | None:
        """Why a weight of `columns` columns cannot take this scheme, or None."""
        g = self.group(columns)
        if g not in GROUP_SIZES:
            return (f"{columns} columns: a row needs a multiple of "
                    f"{min(GROUP_SIZES)} columns to be quantised in groups")
        if columns % g:
            return f"{columns} columns are not a multiple of the group size {g}"
        return None

    def shapes(self, shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
        """{"codes", "scale"(, "min")} shapes for a weight of `shape` [R, C]; ValueError
        when the shape cannot take the scheme."""
        if len(shape) != 2:
            raise ValueError(f"only 2-D weights are quantised, got shape {list(shape)}")
        R, C = shape
        why = self.check_columns(C)
        if why:
            raise ValueError(why)
        g = self.group(C)
        out = {"codes": (R, C // 2) if self.scheme == "int4" else (R, C), "scale": (R, C // g)}
        if self.min:
            out["min"] = (R, C // g)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "group_size": self.group_size, "min": self.min}


@dataclass(frozen=True)
class QuantGroup:
    """One scheme and the fnmatch patterns of the tensor names it covers."""

    scheme: QuantScheme
    weights: tuple[str, ...]

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.weights)


@dataclass(frozen=True)
class RepackConfig:
    """moed's ``quantization_config`` (see the module doc), parsed and checked.

    experts: the routed experts' scheme and patterns; dense: another scheme for other
    weights, or None; alignment: bytes; quantizer / source: provenance, as written.
    """

    experts: QuantGroup
    dense: QuantGroup | None
    alignment: int
    quantizer: Mapping[str, Any]
    source: Mapping[str, Any]

    @property
    def scheme(self) -> str:
        return self.experts.scheme.scheme

    def groups(self) -> tuple[QuantGroup, ...]:
        return (self.experts,) if self.dense is None else (self.experts, self.dense)

    def scheme_of(self, name: str) -> QuantScheme | None:
        """The scheme tensor `name` is quantised with, or None (stored as it was)."""
        for group in self.groups():
            if group.matches(name):
                return group.scheme
        return None

    def label(self) -> str:
        """A short name for logs and metrics, e.g. "int4-g32-min" or "int4-g32+int8-g32"."""
        def one(s: QuantScheme) -> str:
            return f"{s.scheme}-g{s.group_size}" + ("-min" if s.min else "")
        return one(self.experts.scheme) + ("" if self.dense is None else f"+{one(self.dense.scheme)}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION,
                               **self.experts.scheme.to_json(),
                               "weights": list(self.experts.weights),
                               "dense": None if self.dense is None else {
                                   **self.dense.scheme.to_json(),
                                   "weights": list(self.dense.weights)},
                               "alignment": self.alignment,
                               "quantizer": dict(self.quantizer), "source": dict(self.source)}
        return out

    # ------------------------------------------------------------------ parsing

    @classmethod
    def from_json(cls, raw: object, path: str | os.PathLike = "config.json") -> RepackConfig:
        """Parse a ``quantization_config`` whose quant_method is "moed".

        Raises RepackFormatError naming `path` and the field: not an object, another
        quant_method, an unknown format_version, scheme, group_size or alignment, "min"
        on int8, patterns that are not a non-empty list of strings.
        """
        def fail(field: str, message: str) -> RepackFormatError:
            return RepackFormatError(f"quantization_config.{field}: {message}", path=path)

        if not isinstance(raw, dict):
            raise RepackFormatError("quantization_config is not an object", path=path)
        if raw.get("quant_method") != QUANT_METHOD:
            raise fail("quant_method", f"{raw.get('quant_method')!r} is not {QUANT_METHOD!r}")
        if raw.get("format_version") != FORMAT_VERSION:
            raise fail("format_version", f"{raw.get('format_version')!r} is not supported "
                                         f"(this moed reads version {FORMAT_VERSION})")

        def group(block: Mapping, prefix: str) -> QuantGroup:
            scheme, size, has_min = block.get("scheme"), block.get("group_size"), block.get("min", False)
            if scheme not in SCHEMES:
                raise fail(prefix + "scheme", f"unknown scheme {scheme!r} (known: {', '.join(SCHEMES)})")
            if not isinstance(size, int) or isinstance(size, bool) or size not in GROUP_SIZES:
                raise fail(prefix + "group_size", f"{size!r} is not one of {list(GROUP_SIZES)}")
            if not isinstance(has_min, bool):
                raise fail(prefix + "min", f"expected true or false, got {has_min!r}")
            if has_min and scheme != "int4":
                raise fail(prefix + "min", "only int4 carries a per-group minimum")
            weights = block.get("weights")
            if (not isinstance(weights, list) or not weights
                    or not all(isinstance(w, str) and w for w in weights)):
                raise fail(prefix + "weights", "expected a non-empty list of tensor name patterns")
            return QuantGroup(QuantScheme(scheme, size, has_min), tuple(weights))

        experts = group(raw, "")
        dense_raw = raw.get("dense")
        if dense_raw is not None and not isinstance(dense_raw, dict):
            raise fail("dense", f"expected null or an object, got {dense_raw!r}")
        dense = None if dense_raw is None else group(dense_raw, "dense.")
        alignment = raw.get("alignment", ALIGNMENT)
        if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 64
                or alignment & (alignment - 1)):
            raise fail("alignment", f"expected a power of two >= 64, got {alignment!r}")
        for field in ("quantizer", "source"):
            if not isinstance(raw.get(field, {}), dict):
                raise fail(field, "expected an object")
        return cls(experts=experts, dense=dense, alignment=alignment,
                   quantizer=raw.get("quantizer", {}), source=raw.get("source", {}))

    # ------------------------------------------------------------------ checking

    def check(self, checkpoint: Checkpoint) -> dict[str, QuantizedTensorInfo]:
        """Check every tensor of `checkpoint` against this config.

        Returns name -> QuantizedTensorInfo of every quantised tensor. Raises
        RepackFormatError naming the shard and tensor when a pattern matches nothing, a
        quantised tensor's codes have the wrong dtype or shape, its scale (or min) is
        missing, not F16, of the wrong shape or holds NaN/inf, or a scale / min tensor
        exists for a tensor that is not quantised (the config and tensors disagree).
        """
        out: dict[str, QuantizedTensorInfo] = {}
        siblings = set()
        for group in self.groups():
            hits = [n for n in checkpoint.tensors if group.matches(n)]
            if not hits:
                raise RepackFormatError(
                    f"quantization_config pattern(s) {list(group.weights)} match no tensor",
                    path=checkpoint.model_dir / "config.json")
            for name in hits:
                if name in out:
                    continue
                q = self._check_one(checkpoint, name, group.scheme)
                out[name] = q
                siblings.update(i.name for i in (q.scale, q.min) if i is not None)
        for name, info in checkpoint.tensors.items():
            if name in out or name in siblings:
                continue
            if name.endswith((".weight_scale", ".weight_min")):
                raise RepackFormatError(
                    "a quantisation sibling of a tensor quantization_config does not quantise "
                    "(the config and the tensors disagree)", path=info.path, tensor=name)
        return out

    def _check_one(self, checkpoint: Checkpoint, name: str, scheme: QuantScheme) -> QuantizedTensorInfo:
        codes = checkpoint.info(name)

        def fail(info: TensorInfo | None, tensor: str, message: str) -> RepackFormatError:
            return RepackFormatError(message, path=info.path if info else codes.path, tensor=tensor)

        if codes.dtype != scheme.code_dtype or len(codes.shape) != 2:
            raise fail(codes, name, f"{scheme.scheme} codes must be 2-D {scheme.code_dtype}, got "
                                    f"{codes.dtype} {list(codes.shape)} (the config and the "
                                    "tensors disagree)")
        R, stored = codes.shape
        C = stored * 2 if scheme.scheme == "int4" else stored
        try:
            shapes = scheme.shapes((R, C))
        except ValueError as e:
            raise fail(codes, name, str(e)) from None
        infos = {}
        for part, sibling in (("scale", scale_name(name)), ("min", min_name(name))):
            if part not in shapes:
                if sibling in checkpoint:
                    raise fail(checkpoint.info(sibling), sibling,
                               f"{scheme.scheme} without a minimum has no {part} tensor (the "
                               "config and the tensors disagree)")
                continue
            if sibling not in checkpoint:
                raise fail(None, sibling, f"missing: the {part} tensor of {name}")
            info = checkpoint.info(sibling)
            if info.dtype != "F16" or info.shape != shapes[part]:
                raise fail(info, sibling, f"{part} must be F16 {list(shapes[part])} for codes "
                                          f"{list(codes.shape)} in groups of {scheme.group(C)}, "
                                          f"got {info.dtype} {list(info.shape)}")
            values = checkpoint.load(sibling)
            if not np.isfinite(values).all():
                raise fail(info, sibling, f"{part} holds NaN or inf")
            infos[part] = info
        return QuantizedTensorInfo(name=name, scheme=scheme, shape=(R, C), codes=codes,
                                   scale=infos["scale"], min=infos.get("min"))


@dataclass(frozen=True)
class QuantizedTensorInfo:
    """Where a quantised tensor's parts are: codes, scale and (int4 with min) min, each a
    TensorInfo; `shape` is the weight's logical [R, C]."""

    name: str
    scheme: QuantScheme
    shape: tuple[int, int]
    codes: TensorInfo
    scale: TensorInfo
    min: TensorInfo | None

    def parts(self) -> tuple[TensorInfo, ...]:
        return (self.codes, self.scale) + ((self.min,) if self.min is not None else ())


def read_repack_config(raw_config: Mapping[str, Any],
                       path: str | os.PathLike = "config.json") -> RepackConfig | None:
    """moed's quantization_config of a parsed config.json, or None when it has none (or
    another quant_method's, which is not this module's to read)."""
    q = raw_config.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == QUANT_METHOD:
        return RepackConfig.from_json(q, path)
    return None


# ---------------------------------------------------------------------- codes


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """uint8 [R, C] codes in 0..15 -> uint8 [R, C/2]: element 2i low nibble, 2i+1 high."""
    c = np.asarray(codes, np.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 [R, C/2] -> uint8 [R, C] codes in 0..15 (inverse of `pack_int4`)."""
    p = np.asarray(packed, np.uint8)
    out = np.empty((p.shape[0], p.shape[1] * 2), np.uint8)
    out[:, 0::2] = p & 0x0F
    out[:, 1::2] = p >> 4
    return out


def dequantize(scheme: QuantScheme, codes: np.ndarray, scale: np.ndarray,
               minimum: np.ndarray | None = None) -> np.ndarray:
    """float32 [R, C] values of stored codes (int8 [R, C] or packed uint8 [R, C/2]),
    float16 scale [R, C/g] and, for int4 with min, float16 minimum [R, C/g]."""
    q = unpack_int4(codes).astype(np.float32) if scheme.scheme == "int4" else codes.astype(np.float32)
    R, C = q.shape
    g = scheme.group(C)
    q = q.reshape(R, C // g, g)
    s = scale.astype(np.float32)[:, :, None]
    if scheme.scheme == "int4" and scheme.min:
        out = q * s + minimum.astype(np.float32)[:, :, None]
    elif scheme.scheme == "int4":
        out = (q - np.float32(8)) * s
    else:
        out = q * s
    return out.reshape(R, C)
