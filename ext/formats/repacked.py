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

This module is the format's definition, plugged into ext/formats/quant.py's registry:
`MoedMethod` reads ``quantization_config`` (`RepackConfig`: which tensors, which scheme;
`check_checkpoint` refuses patterns that match no tensor and scale or min tensors beside
a weight the config does not quantise), and `IntLayout` ("int4", "int8") recognises a
weight's pieces by their dtypes and shapes, checks them against the config's scheme and
hands the kernels a `QuantizedWeight`. Also here: the tensor names (`scale_name`,
`min_name`), shapes (`QuantScheme.shapes`), the packing of int4 codes (`pack_int4` /
`unpack_int4`) and a reference decode (`dequantize`, what the quantiser's tests and
research use; the oracle tests decode with their own implementation). Errors are
QuantizationError subclasses naming config.json and the field, or the shard and tensor.
"""
from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ext.formats.checkpoint import TensorInfo
from ext.formats.quant import (BadScaleError, FormatMismatchError, MissingPieceError,
                               PieceShapeError, QuantizationConfigError, QuantizationError,
                               QuantMethod, StoredWeight, WeightLayout,
                               parse_quantization_config, register_layout,
                               register_quant_method)

QUANT_METHOD = "moed"
FORMAT_VERSION = 1
SCHEMES = ("int4", "int8")
GROUP_SIZES = (32, 64, 128)
ALIGNMENT = 4096            # bytes: an expert's first byte, and a shard's data start
TENSOR_ALIGNMENT = 64       # bytes: each tensor inside an expert
PADDING_PREFIX = "moed.padding."


class RepackFormatError(QuantizationError):
    """A repacked model whose tensors disagree with its quantization_config."""


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
        def fail(field: str, message: str) -> QuantizationConfigError:
            return QuantizationConfigError(path, f"quantization_config.{field}", message)

        if not isinstance(raw, dict):
            raise QuantizationConfigError(path, "quantization_config", "expected an object")
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

    def check_checkpoint(self, tensors: Mapping[str, TensorInfo], where: str | os.PathLike) -> None:
        """What no single weight can see: every pattern matches a tensor, and no scale
        or min tensor sits beside a weight the config does not quantise. Raises
        RepackFormatError naming config.json (`where` is the model directory) or the
        stray tensor."""
        for group in self.groups():
            if not any(group.matches(n) for n in tensors):
                raise RepackFormatError(
                    f"quantization_config pattern(s) {list(group.weights)} match no tensor "
                    "(the config and the tensors disagree)",
                    path=os.path.join(os.fspath(where), "config.json"))
        for name, info in tensors.items():
            for suffix in (".weight_scale", ".weight_min"):
                if name.endswith(suffix) and self.scheme_of(name[: -len(suffix)] + ".weight") is None:
                    raise RepackFormatError(
                        "a scale or min tensor beside a weight quantization_config does not "
                        "quantise (the config and the tensors disagree)",
                        path=info.path, tensor=name)


def read_repack_config(raw_config: Mapping[str, Any],
                       path: str | os.PathLike = "config.json") -> RepackConfig | None:
    """moed's quantization_config of a parsed config.json, or None when it has none (or
    another quant_method's, which is not this module's to read)."""
    q = raw_config.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == QUANT_METHOD:
        return RepackConfig.from_json(q, path)
    return None


# ---------------------------------------------------------------------- registry


@register_quant_method
class MoedMethod(QuantMethod):
    """`"quant_method": "moed"`: moed repack's int4 / int8 groups (see the module doc).
    The weights the config's patterns match must be stored in their entry's scheme; all
    others as they were (any format moed reads)."""

    quant_method = QUANT_METHOD
    formats = SCHEMES

    def __init__(self, raw: dict[str, Any], path: str):
        super().__init__(raw, path)
        self.repack = RepackConfig.from_json(raw, path)
        # The quantization_config of the model that was repacked (FP8, MXFP4): the weights
        # the repack kept as they were still follow it.
        kept = self.repack.source.get("quantization_config")
        self.kept = None if kept is None else parse_quantization_config(
            {"quantization_config": kept}, path)

    def scheme_of(self, module: str) -> QuantScheme | None:
        return self.repack.scheme_of(f"{module}.weight")

    def requires(self, module: str, role: str) -> bool:
        if self.scheme_of(module) is not None:
            return True
        return self.kept is not None and self.kept.requires(module, role)

    def allows(self, module: str, fmt: str) -> bool:
        scheme = self.scheme_of(module)
        if scheme is not None:
            return scheme.scheme == fmt
        return self.kept is not None and self.kept.allows(module, fmt)

    def refusal(self, module: str, fmt: str) -> str:
        scheme = self.scheme_of(module)
        if scheme is not None:
            return f"it stores this weight as {scheme.scheme} (the config and the tensors disagree)"
        if self.kept is not None:
            return self.kept.refusal(module, fmt)
        return "its weights patterns do not cover this weight (the config and the tensors disagree)"

    def delegate(self, module: str) -> QuantMethod:
        return self if self.scheme_of(module) is not None or self.kept is None else self.kept

    @property
    def label(self) -> str:
        return self.repack.scheme

    def describe(self) -> dict[str, Any]:
        e, d = self.repack.experts.scheme, self.repack.dense
        return {"quant_method": QUANT_METHOD, "scheme": e.scheme, "group_size": e.group_size,
                "min": e.min, "label": self.repack.label(),
                "dense": None if d is None else d.scheme.to_json()}

    def check_checkpoint(self, tensors: Mapping[str, TensorInfo], where: str | os.PathLike) -> None:
        self.repack.check_checkpoint(tensors, where)


class IntLayout(WeightLayout):
    """int4 / int8: `<module>.weight` codes (U8 [R, C/2] / I8 [R, C]), `.weight_scale`
    F16 [R, C/g] and, for int4 with a minimum, `.weight_min` F16 [R, C/g]."""

    roles = ("weight", "scale", "min")
    checked_roles = ("scale", "min")

    def __init__(self, fmt: str):
        self.format = fmt
        self.code_dtype = "U8" if fmt == "int4" else "I8"

    def present(self, tensors, module):
        w = tensors.get(f"{module}.weight")
        mine = w is not None and w.dtype == self.code_dtype
        other = w is not None and w.dtype == ("I8" if self.format == "int4" else "U8")
        found = [w.name] if mine else []
        siblings = [f"{module}.weight_scale"] + ([f"{module}.weight_min"] if self.format == "int4" else [])
        if not other:   # a scale beside int8 codes belongs to int8, and the other way round
            found += [n for n in siblings if n in tensors]
        return found

    def build(self, tensors, module, shape, quant, where):
        name, sname, mname = f"{module}.weight", f"{module}.weight_scale", f"{module}.weight_min"
        if name not in tensors:
            raise MissingPieceError(f"the {self.format} codes of {sname!r} are missing",
                                    path=where, tensor=name)
        codes = tensors[name]
        if codes.dtype != self.code_dtype:
            raise FormatMismatchError(f"dtype {codes.dtype}, but {sname!r} exists: {self.format} "
                                      f"codes are {self.code_dtype}", path=codes.path, tensor=name)
        # resolve_weight has checked that moed's config stores this module in this format
        scheme = quant.scheme_of(module)
        R, C = shape
        try:
            want = scheme.shapes((R, C))
        except ValueError as e:
            raise PieceShapeError(f"weight {[R, C]}: {e}", path=codes.path, tensor=name) from None
        if codes.shape != want["codes"]:
            raise PieceShapeError(f"shape {list(codes.shape)}, but {self.format} codes of a weight "
                                  f"{[R, C]} are {list(want['codes'])}", path=codes.path, tensor=name)
        pieces = [codes]
        for part, piece_name in (("scale", sname), ("min", mname)):
            if part not in want:
                if piece_name in tensors:
                    info = tensors[piece_name]
                    raise RepackFormatError(f"{self.format} without a minimum has no min tensor "
                                            "(the config and the tensors disagree)",
                                            path=info.path, tensor=piece_name)
                continue
            if piece_name not in tensors:
                raise MissingPieceError(f"the {part} tensor of {name!r} is missing",
                                        path=codes.path, tensor=piece_name)
            info = tensors[piece_name]
            if info.dtype != "F16" or info.shape != want[part]:
                raise PieceShapeError(f"{part} must be F16 {list(want[part])} for a weight "
                                      f"{[R, C]} in groups of {scheme.group(C)}, got {info.dtype} "
                                      f"{list(info.shape)}", path=info.path, tensor=piece_name)
            pieces.append(info)
        return StoredWeight(name=name, shape=(R, C), format=self.format, pieces=tuple(pieces),
                            block=(1, scheme.group(C)))

    def check_values(self, weight, arrays):
        for role in ("scale", "min"):
            if role not in arrays:
                continue
            values = arrays[role]
            bad = ~np.isfinite(values.astype(np.float32))
            if bad.any():
                info = weight.piece(role)
                raise BadScaleError(f"{int(bad.sum())} of {values.size} {role} values are NaN or "
                                    "infinite", path=info.path, tensor=info.name)

    def kernel_args(self, weight, arrays):
        return {"fmt": self.format, "codes": arrays[0], "scales": arrays[1],
                "mins": arrays[2] if len(arrays) > 2 else None, "group_size": weight.block[1]}


for _fmt in SCHEMES:
    register_layout(IntLayout(_fmt))


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
