"""Stored formats of linear weights, and the quantisation config that says which a model uses.

A *linear weight* is a matrix W [R, C] = [out_features, in_features] (torch.nn.Linear's
layout) that the forward pass multiplies activations by. The checkpoint stores it as
one or more tensors, its *pieces*, in one of these formats (`format`, a closed set):

  f32 | f16 | bf16   `<module>.weight` [R, C] of that dtype.
  fp8_e4m3           `<module>.weight` F8_E4M3 [R, C] and `<module>.weight_scale_inv`
                     [ceil(R / bR), ceil(C / bC)]: W[r, c] = fp8[r, c] x scale[r // bR,
                     c // bC] (the last block of each direction may be partial).
                     (bR, bC) = `weight_block_size` of the config ([128, 128] in every
                     published model). Scales are F32 or BF16 values, or E8M0 exponents
                     (U8 or F8_E8M0: 2^(s - 127), 255 is NaN) when `scale_fmt` is
                     "ue8m0". As DeepSeek-V3/R1, Kimi K2, MiniMax-M2 and the Qwen3/GLM
                     "-FP8" releases ship them (DeepSeek-V3 inference/kernel.py
                     `weight_dequant`; transformers' FineGrainedFP8Config).
  mxfp4              OCP Microscaling MXFP4 (OCP MX spec v1.0): groups of 32 E2M1 values
                     along C sharing one E8M0 scale. `<module>.weight_blocks` U8
                     [R, G, 16] (G = C / 32; element 2i of a group in the low nibble of
                     byte i, 2i + 1 in the high nibble; E2M1 magnitudes 0, 0.5, 1, 1.5,
                     2, 3, 4, 6, bit 3 the sign) and `<module>.weight_scales` U8 [R, G]
                     (multiplier 2^(s - 127), 255 is NaN). This is GPT-OSS's layout
                     (`<param>_blocks` [E, R, G, 16] / `<param>_scales` [E, R, G]
                     fused over experts: `Mxfp4Layout.fused_expert` reads one expert of
                     it); for the families whose experts are separate modules moed names
                     the pieces after the module, `<module>.weight_blocks` /
                     `<module>.weight_scales`, like FP8's `<module>.weight_scale_inv`.

A format is recognised by the pieces' dtypes and shapes, then checked against
config.json's `quantization_config`: a quantised piece without a config that allows it,
a module the config converts stored in plain floats (or one it lists in
`modules_to_not_convert` stored quantised), a scale grid of the wrong shape, or a
missing piece is a `QuantizationError` naming the file and tensor. Scale values (NaN,
inf, negative, E8M0 255) are checked by `check_values` on the arrays once they are read.

The generic mechanism: a `QuantMethod` subclass per `quant_method` (its config fields,
which modules it converts, which formats it may use) and a `WeightLayout` per stored
format (which tensors, how they are validated, what the kernels get), both registered
here (`register_quant_method`, `register_layout`); moed's own repack format plugs in the
same way. Nothing here reads weight data except `check_values`.
"""
from __future__ import annotations

import math
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ext.formats.checkpoint import (CheckpointError, MissingTensorError,
                                    TensorInfo, TensorRangeError, UnsupportedDtypeError)

PLAIN_FORMATS = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
FP8_E4M3 = "fp8_e4m3"
MXFP4 = "mxfp4"
MXFP4_GROUP = 32            # values per E8M0 scale
E8M0_NAN = 255
E8M0_DTYPES = ("U8", "F8_E8M0")

# Roles of a linear weight in the model (the forward pass names each weight's role):
EXPERT = "expert"           # a routed expert's gate/up/down
ATTENTION = "attention"     # q/k/v/o projections
MLP = "mlp"                 # a dense layer's MLP, a shared expert
ROUTER = "router"           # the router (mlp.gate), a shared expert's gate
HEAD = "head"               # lm_head
ROLES = (EXPERT, ATTENTION, MLP, ROUTER, HEAD)


class QuantizationError(CheckpointError):
    """A quantised weight that cannot be used: pieces missing or malformed, scales that
    are not numbers, or tensors that disagree with the quantization config."""


class QuantizationConfigError(QuantizationError):
    """A `quantization_config` field moed does not read (unknown quant_method, fmt,
    scheme, ...); `.field` names it (e.g. "quantization_config.fmt")."""

    def __init__(self, path: str | os.PathLike, field: str, message: str):
        self.field = field
        super().__init__(f"field '{field}': {message}", path=path)


class MissingPieceError(QuantizationError, MissingTensorError):
    """A piece of a quantised weight (a scale tensor, say) is absent from the checkpoint."""


class PieceShapeError(QuantizationError, TensorRangeError):
    """A piece's dtype or shape disagrees with the weight it belongs to (a scale grid of
    the wrong shape, `_blocks` and `_scales` that disagree)."""


class BadScaleError(QuantizationError):
    """Scales that are NaN, infinite or negative, or E8M0 255 (NaN)."""


class FormatMismatchError(QuantizationError):
    """The tensors are stored in one format and the config says another."""


# ---------------------------------------------------------------- quantization_config


def _module_pattern(path: str, pattern: object) -> re.Pattern:
    """A `modules_to_not_convert` entry as transformers reads it: a regular expression
    matched from the start of the module name up to a module boundary ("model.layers.1"
    matches "model.layers.1.mlp", not "model.layers.11"; "mlp.gate" not "mlp.gate_proj")."""
    if not isinstance(pattern, str) or not pattern:
        raise QuantizationConfigError(path, "quantization_config.modules_to_not_convert",
                                      f"entries must be non-empty strings, got {pattern!r}")
    try:
        return re.compile(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))")
    except re.error as e:
        raise QuantizationConfigError(path, "quantization_config.modules_to_not_convert",
                                      f"{pattern!r} is not a regular expression: {e}") from None


class QuantMethod(ABC):
    """One `quantization_config` of config.json, parsed: the base of each quant_method's.

    Subclasses set `quant_method` (the config's string) and `formats` (the stored formats
    its weights may have), parse their own fields in `__init__` (raising
    QuantizationConfigError naming the field) and say in `requires` which weights must
    be quantised. `modules_to_not_convert` (alias `ignored_layers`, as MiniMax writes
    it) is read here for all.
    """

    quant_method: ClassVar[str]
    formats: ClassVar[tuple[str, ...]]

    def __init__(self, raw: dict[str, Any], path: str):
        self.path = path
        self.raw = raw
        skip = raw.get("modules_to_not_convert")
        if skip is None:
            skip = raw.get("ignored_layers")
        if skip is None:
            skip = []
        if not isinstance(skip, list):
            raise QuantizationConfigError(path, "quantization_config.modules_to_not_convert",
                                          f"expected a list of module names, got {skip!r}")
        self.modules_to_not_convert = tuple(skip)
        self._skip = [(p, _module_pattern(path, p)) for p in skip]

    def converts(self, module: str) -> bool:
        """False when `modules_to_not_convert` names `module` (a prefix up to a module
        boundary, a regular expression, or a suffix, as transformers matches them)."""
        return not any(rx.match(module) or module.endswith(p) for p, rx in self._skip)

    @abstractmethod
    def requires(self, module: str, role: str) -> bool:
        """True when the weight of `module` (role one of ROLES) must be stored quantised."""

    def allows(self, module: str, fmt: str) -> bool:
        """True when `module` may be stored in format `fmt`."""
        return fmt in self.formats and self.converts(module)

    def describe(self) -> dict[str, Any]:
        """The fields that say what the model is (JSON-able; logs and /v1/models)."""
        return {"quant_method": self.quant_method}

    def refusal(self, module: str, fmt: str) -> str:
        """Why `module` may not be stored in `fmt` (when `allows` says no), for errors."""
        if fmt in self.formats:
            return "modules_to_not_convert lists this module"
        return f"quant_method {self.quant_method!r} stores {', '.join(self.formats)}"

    def delegate(self, module: str) -> QuantMethod:
        """The config whose fields describe `module`'s stored weight (itself, except for a
        config that wraps another's, as moed's repack format wraps the FP8 config of the
        dense weights it kept)."""
        return self

    def check_checkpoint(self, tensors: Mapping[str, TensorInfo], where: str | os.PathLike) -> None:
        """Checks over the whole tensor table that no single weight can make (nothing by
        default; moed's repack format checks its patterns match); raises QuantizationError."""

    @property
    def label(self) -> str:
        """The format of the weights this config quantises (one of `formats()`): the
        `quantization` label of moed's build-info metric."""
        return self.formats[0]


def _field(raw: dict, path: str, name: str, allowed: tuple, default: object) -> object:
    value = raw.get(name, default)
    if value is None:
        value = default
    if value not in allowed:
        raise QuantizationConfigError(
            path, f"quantization_config.{name}",
            f"{value!r} is not supported (supported: {', '.join(map(repr, allowed))})")
    return value


class Fp8Method(QuantMethod):
    """`"quant_method": "fp8"`: FP8 E4M3 weights with 2-D block scales.

    Fields: `fmt` ("e4m3", the default), `weight_block_size` ([bR, bC] positive ints,
    default [128, 128]), `activation_scheme` ("dynamic", the default: moed keeps
    activations in f32 and dequantises the weights, as a weight-only reader does;
    "static" needs activation scales and is refused), `scale_fmt` ("float" or "ue8m0"),
    `expert_dtype` ("fp8" only), `modules_to_convert` (must be empty: moed keeps
    embeddings as stored). Attention, MLP and routed-expert projections must be FP8
    unless `modules_to_not_convert` names them; routers and lm_head may be either.
    """

    quant_method = "fp8"
    formats = (FP8_E4M3,)

    def __init__(self, raw: dict[str, Any], path: str):
        super().__init__(raw, path)
        self.fmt = _field(raw, path, "fmt", ("e4m3",), "e4m3")
        self.activation_scheme = _field(raw, path, "activation_scheme", ("dynamic",), "dynamic")
        self.scale_fmt = _field(raw, path, "scale_fmt", ("float", "ue8m0"), "float")
        _field(raw, path, "expert_dtype", ("fp8",), "fp8")
        if raw.get("modules_to_convert"):
            raise QuantizationConfigError(path, "quantization_config.modules_to_convert",
                                          "converting further modules (embeddings) is not "
                                          "supported: moed keeps them as stored")
        block = raw.get("weight_block_size", [128, 128])
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise QuantizationConfigError(path, "quantization_config.weight_block_size",
                                          f"expected [rows, cols] of positive ints, got {block!r}"
                                          " (per-tensor FP8 scales are not supported)")
        self.weight_block_size = (block[0], block[1])

    def requires(self, module: str, role: str) -> bool:
        return role in (EXPERT, ATTENTION, MLP) and self.converts(module)

    def scale_dtypes(self) -> tuple[str, ...]:
        """The scale dtypes this config allows (E8M0 only with scale_fmt "ue8m0")."""
        return ("F32", "BF16", *E8M0_DTYPES) if self.scale_fmt == "ue8m0" else ("F32", "BF16")

    def describe(self) -> dict[str, Any]:
        return {"quant_method": "fp8", "fmt": self.fmt,
                "weight_block_size": list(self.weight_block_size),
                "activation_scheme": self.activation_scheme, "scale_fmt": self.scale_fmt}


class Mxfp4Method(QuantMethod):
    """`"quant_method": "mxfp4"` (GPT-OSS): routed experts in MXFP4, the rest as stored
    (routed-expert projections must be MXFP4 unless `modules_to_not_convert` names them)."""

    quant_method = "mxfp4"
    formats = (MXFP4,)

    def requires(self, module: str, role: str) -> bool:
        return role == EXPERT and self.converts(module)


QUANT_METHODS: dict[str, type[QuantMethod]] = {}


def register_quant_method(cls: type[QuantMethod]) -> type[QuantMethod]:
    """Make `cls.quant_method` readable from config.json (usable as a class decorator)."""
    QUANT_METHODS[cls.quant_method] = cls
    return cls


register_quant_method(Fp8Method)
register_quant_method(Mxfp4Method)


def parse_quantization_config(raw_config: Mapping[str, Any],
                              path: str | os.PathLike) -> QuantMethod | None:
    """The `quantization_config` of a parsed config.json, or None when it has none.

    Raises QuantizationConfigError (naming config.json and the field) for a config that
    is not an object, an unknown `quant_method` (the message lists the supported ones),
    or a field the method does not support.
    """
    path = os.fspath(path)
    raw = raw_config.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise QuantizationConfigError(path, "quantization_config", f"expected an object, got {raw!r}")
    method = raw.get("quant_method")
    if method not in QUANT_METHODS:
        raise QuantizationConfigError(path, "quantization_config.quant_method",
                                      f"{method!r} is not supported (supported: "
                                      f"{', '.join(sorted(QUANT_METHODS))})")
    return QUANT_METHODS[method](raw, path)


# ---------------------------------------------------------------- stored weights


@dataclass(frozen=True)
class StoredWeight:
    """One linear weight as the checkpoint stores it.

    name: the logical weight, `<module>.weight`. shape: its [R, C] (out, in) shape.
    format: one of `formats()` (f32, f16, bf16, fp8_e4m3, mxfp4, ...). pieces: where its
    tensors are, in the order of its layout's `roles` (`TensorInfo`s: whole tensors, or
    byte ranges of tensors fused over experts). block: the (rows, cols) each scale
    covers (fp8: weight_block_size; mxfp4: (1, 32); plain: None).
    """

    name: str
    shape: tuple[int, int]
    format: str
    pieces: tuple[TensorInfo, ...]
    block: tuple[int, int] | None = None

    @classmethod
    def plain(cls, info: TensorInfo) -> StoredWeight:
        """A weight stored as one f32/f16/bf16 tensor [R, C]."""
        return cls(name=info.name, shape=(info.shape[0], info.shape[1]),
                   format=PLAIN_FORMATS[info.dtype], pieces=(info,))

    @property
    def layout(self) -> WeightLayout:
        return LAYOUTS[self.format]

    @property
    def nbytes(self) -> int:
        """Bytes of every piece: what reading this weight costs."""
        return sum(p.nbytes for p in self.pieces)

    def piece(self, role: str) -> TensorInfo:
        """The piece of `role` (e.g. "weight", "scale"); KeyError for another."""
        return self.pieces[self.layout.roles.index(role)]

    @property
    def scale_dtype(self) -> str | None:
        """The dtype string of the scale piece (None for a plain weight)."""
        return self.pieces[1].dtype if len(self.pieces) > 1 else None

    def checked_pieces(self) -> dict[str, TensorInfo]:
        """The pieces whose values `check_values` checks (the scales), by role (a layout's
        optional last pieces, such as int4's minimums, only when present)."""
        roles = self.layout.roles
        return {r: self.piece(r) for r in self.layout.checked_roles
                if roles.index(r) < len(self.pieces)}

    def check_values(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Raise BadScaleError if the arrays of `checked_pieces()` (as read, by role) hold
        scales that are not usable numbers (NaN, inf, negative, E8M0 255)."""
        self.layout.check_values(self, arrays)


class WeightLayout(ABC):
    """How one stored format lays a linear weight out in tensors.

    `format` is its label, `roles` its pieces in order, `checked_roles` those whose
    values `check_values` checks. `present` says which of its tensors exist for a module
    (a format is recognised by its pieces' names, dtypes and shapes together), `build`
    validates them into a StoredWeight, `kernel_args` says what the kernels get.
    """

    format: ClassVar[str]
    roles: ClassVar[tuple[str, ...]]
    checked_roles: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def present(self, tensors: Mapping[str, TensorInfo], module: str) -> list[str]:
        """Names of this format's tensors for `module` that the checkpoint holds."""

    @abstractmethod
    def build(self, tensors: Mapping[str, TensorInfo], module: str, shape: tuple[int, int],
              quant: QuantMethod | None, where: str) -> StoredWeight:
        """Validate the pieces of `module`'s weight [R, C] = `shape`; `where` is the
        model directory (for errors about tensors that are absent)."""

    def check_values(self, weight: StoredWeight, arrays: Mapping[str, np.ndarray]) -> None:
        """Raise BadScaleError for unusable values of the `checked_roles` arrays (by role)."""

    @abstractmethod
    def kernel_args(self, weight: StoredWeight, arrays: tuple[np.ndarray, ...]) -> dict[str, Any]:
        """Keyword arguments of the kernels' `QuantizedWeight(fmt, codes, scales, mins=None,
        *, block_size=None, group_size=None)` for these piece arrays (zero-copy views, in
        `pieces` order); a plain format returns {"array": the array}."""


def _shape_error(info: TensorInfo, what: str) -> PieceShapeError:
    return PieceShapeError(what, path=info.path, tensor=info.name)


class PlainLayout(WeightLayout):
    """f32 / f16 / bf16: `<module>.weight` [R, C] of that dtype (the format is its dtype)."""

    roles = ("weight",)

    def __init__(self, fmt: str):
        self.format = fmt

    def present(self, tensors, module):
        info = tensors.get(f"{module}.weight")
        return [info.name] if info is not None and PLAIN_FORMATS.get(info.dtype) == self.format else []

    def build(self, tensors, module, shape, quant, where):
        info = tensors[f"{module}.weight"]
        if info.shape != tuple(shape):
            raise _shape_error(info, f"shape {list(info.shape)} but the config implies {list(shape)}")
        return StoredWeight.plain(info)

    def kernel_args(self, weight, arrays):
        return {"array": arrays[0]}


def _check_float_scales(info: TensorInfo, scales: np.ndarray) -> None:
    values = scales.astype(np.float32)
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        first = np.unravel_index(int(np.argmax(bad)), values.shape)
        raise BadScaleError(f"{int(bad.sum())} of {values.size} scales are NaN, infinite or "
                            f"negative (first: {values[first]!r} at {list(map(int, first))})",
                            path=info.path, tensor=info.name)


def _check_e8m0(info: TensorInfo, scales: np.ndarray) -> None:
    codes = scales.view(np.uint8)
    bad = codes == E8M0_NAN
    if bad.any():
        first = np.unravel_index(int(np.argmax(bad)), codes.shape)
        raise BadScaleError(f"{int(bad.sum())} of {codes.size} E8M0 scales are 255 (NaN) "
                            f"(first at {list(map(int, first))})", path=info.path, tensor=info.name)


class Fp8Layout(WeightLayout):
    """fp8_e4m3: `<module>.weight` F8_E4M3 [R, C] + `<module>.weight_scale_inv`
    [ceil(R / bR), ceil(C / bC)] (see the module doc)."""

    format = FP8_E4M3
    roles = ("weight", "scale")
    checked_roles = ("scale",)

    def present(self, tensors, module):
        w = tensors.get(f"{module}.weight")
        found = [w.name] if w is not None and w.dtype == "F8_E4M3" else []
        return found + [n for n in (f"{module}.weight_scale_inv",) if n in tensors]

    def build(self, tensors, module, shape, quant, where):
        name, scale_name = f"{module}.weight", f"{module}.weight_scale_inv"
        if name not in tensors:
            raise MissingPieceError(f"the FP8 weight of {scale_name!r} is missing",
                                    path=where, tensor=name)
        w = tensors[name]
        if w.dtype != "F8_E4M3":
            raise FormatMismatchError(f"dtype {w.dtype}, but {scale_name!r} exists: FP8 block "
                                      "scales belong to an F8_E4M3 weight", path=w.path, tensor=name)
        if w.shape != tuple(shape):
            raise _shape_error(w, f"shape {list(w.shape)} but the config implies {list(shape)}")
        if scale_name not in tensors:
            raise MissingPieceError(f"the block scales of the F8_E4M3 weight {name!r} are "
                                    "missing", path=w.path, tensor=scale_name)
        s = tensors[scale_name]
        assert isinstance(quant, Fp8Method)
        bR, bC = quant.weight_block_size
        grid = (math.ceil(shape[0] / bR), math.ceil(shape[1] / bC))
        if s.dtype not in quant.scale_dtypes():
            hint = (" (E8M0 scales need quantization_config.scale_fmt 'ue8m0')"
                    if s.dtype in E8M0_DTYPES else "")
            raise _shape_error(s, f"dtype {s.dtype}; FP8 scales are "
                                  f"{' or '.join(quant.scale_dtypes())}{hint}")
        if s.shape != grid:
            raise _shape_error(s, f"scale grid {list(s.shape)}, but weight {list(shape)} in "
                                  f"{bR}x{bC} blocks (quantization_config.weight_block_size) "
                                  f"needs {list(grid)}")
        return StoredWeight(name=name, shape=tuple(shape), format=FP8_E4M3, pieces=(w, s),
                            block=(bR, bC))

    def check_values(self, weight, arrays):
        info = weight.piece("scale")
        if info.dtype in E8M0_DTYPES:
            _check_e8m0(info, arrays["scale"])
        else:
            _check_float_scales(info, arrays["scale"])

    def kernel_args(self, weight, arrays):
        return {"fmt": FP8_E4M3, "codes": arrays[0], "scales": arrays[1],
                "block_size": weight.block}


class Mxfp4Layout(WeightLayout):
    """mxfp4: `<module>.weight_blocks` U8 [R, C/32, 16] + `<module>.weight_scales` U8
    [R, C/32] (see the module doc); C must be a multiple of 32."""

    format = MXFP4
    roles = ("blocks", "scales")
    checked_roles = ("scales",)

    def present(self, tensors, module):
        return [n for n in (f"{module}.weight_blocks", f"{module}.weight_scales") if n in tensors]

    def build(self, tensors, module, shape, quant, where):
        names = f"{module}.weight_blocks", f"{module}.weight_scales"
        for n, other in (names, names[::-1]):
            if n not in tensors:
                raise MissingPieceError(f"the MXFP4 weight has {other!r} but not this tensor",
                                        path=tensors[other].path, tensor=n)
        return self.assemble(tensors[names[0]], tensors[names[1]], f"{module}.weight", shape)

    def fused_expert(self, tensors: Mapping[str, TensorInfo], param: str, expert: int,
                     shape: tuple[int, int], where: str) -> StoredWeight:
        """Expert `expert`'s weight [R, C] inside GPT-OSS-style tensors fused over experts,
        `<param>_blocks` U8 [E, R, C/32, 16] and `<param>_scales` U8 [E, R, C/32]: its
        pieces are byte ranges of those (`TensorInfo.index`). Raises MissingPieceError,
        PieceShapeError (leading axes that disagree, or `expert` beyond them)."""
        blocks, scales = f"{param}_blocks", f"{param}_scales"
        for n in (blocks, scales):
            if n not in tensors:
                raise MissingPieceError("an MXFP4 tensor fused over experts is missing",
                                        path=where, tensor=n)
        b, s = tensors[blocks], tensors[scales]
        if len(b.shape) != 4 or len(s.shape) != 3 or b.shape[0] != s.shape[0]:
            raise _shape_error(s, f"shape {list(s.shape)} does not match {blocks!r} "
                                  f"{list(b.shape)} (want [E, R, G] beside [E, R, G, 16])")
        if not 0 <= expert < b.shape[0]:
            raise _shape_error(b, f"holds {b.shape[0]} experts, expert {expert} asked for")
        return self.assemble(b.index(expert), s.index(expert), f"{param}[{expert}]", shape)

    def assemble(self, b: TensorInfo, s: TensorInfo, name: str,
                 shape: tuple[int, int]) -> StoredWeight:
        """Validate blocks `b` [R, G, 16] and scales `s` [R, G] of a weight [R, C]."""
        R, C = shape
        if C % MXFP4_GROUP:
            raise _shape_error(b, f"MXFP4 groups {MXFP4_GROUP} values along in_features, "
                                  f"which is {C} here (not a multiple of {MXFP4_GROUP})")
        G = C // MXFP4_GROUP
        for info, want in ((b, (R, G, 16)), (s, (R, G))):
            if info.dtype != "U8":
                raise _shape_error(info, f"dtype {info.dtype}; MXFP4 blocks and scales are U8")
            if info.shape != want:
                raise _shape_error(info, f"shape {list(info.shape)}, but an MXFP4 weight "
                                         f"{[R, C]} needs {list(want)}")
        return StoredWeight(name=name, shape=(R, C), format=MXFP4, pieces=(b, s),
                            block=(1, MXFP4_GROUP))

    def check_values(self, weight, arrays):
        _check_e8m0(weight.piece("scales"), arrays["scales"])

    def kernel_args(self, weight, arrays):
        return {"fmt": MXFP4, "codes": arrays[0], "scales": arrays[1]}


LAYOUTS: dict[str, WeightLayout] = {}


def register_layout(layout: WeightLayout) -> WeightLayout:
    """Make a stored format recognisable (its `format` joins the closed set `formats()`)."""
    LAYOUTS[layout.format] = layout
    return layout


for _layout in (*(PlainLayout(f) for f in PLAIN_FORMATS.values()), Fp8Layout(), Mxfp4Layout()):
    register_layout(_layout)


def formats() -> tuple[str, ...]:
    """Every stored format label moed reads (a closed set, e.g. for metric labels)."""
    return tuple(LAYOUTS)


def quantization_label(quant: QuantMethod | None) -> str:
    """What a model's quantization is called in metrics: "none" (plain floats as stored)
    or the quantised weights' format (`QuantMethod.label`)."""
    return "none" if quant is None else quant.label


def resolve_weight(tensors: Mapping[str, TensorInfo], module: str, shape: tuple[int, int],
                   role: str, quant: QuantMethod | None, where: str | os.PathLike) -> StoredWeight:
    """The stored form of the linear weight of `module` (e.g. "model.layers.0.self_attn.
    q_proj"), whose shape the config implies is [R, C] = `shape`.

    The format is the one whose tensors are present (names, dtypes, shapes), then checked
    against `quant` (the parsed quantization_config, None without one) for `role` (one of
    ROLES). Raises MissingTensorError (no tensor of any format), UnsupportedDtypeError
    (`<module>.weight` of a dtype no format reads), FormatMismatchError (tensors of two
    formats, or a format the config does not allow here, or plain floats where it
    requires quantised ones), MissingPieceError / PieceShapeError (from the format).
    """
    where = os.fspath(where)
    found = {fmt: names for fmt, layout in LAYOUTS.items()
             if (names := layout.present(tensors, module))}
    weight = f"{module}.weight"
    if not found:
        if weight in tensors:
            info = tensors[weight]
            raise UnsupportedDtypeError(f"dtype {info.dtype} is not a weight format moed reads "
                                        f"({', '.join(formats())})", path=info.path, tensor=weight)
        raise MissingTensorError("required by the config but missing from the checkpoint",
                                 path=where, tensor=weight)
    if len(found) > 1:
        (fa, na), (fb, nb) = list(found.items())[:2]
        info = tensors[na[0]]
        raise FormatMismatchError(f"stored as {fa} ({', '.join(na)}) and as {fb} "
                                  f"({', '.join(nb)}) at once", path=info.path, tensor=info.name)
    (fmt, names), = found.items()
    first = tensors[names[0]]
    if fmt in PLAIN_FORMATS.values():
        if quant is not None and quant.requires(module, role):
            raise FormatMismatchError(
                f"dtype {first.dtype}, but config.json's quantization_config "
                f"(quant_method {quant.quant_method!r}) stores this weight quantised and "
                "modules_to_not_convert does not list it", path=first.path, tensor=first.name)
    elif quant is None:
        raise FormatMismatchError(f"stored as {fmt}, but config.json has no quantization_config",
                                  path=first.path, tensor=first.name)
    elif not quant.allows(module, fmt):
        why = quant.refusal(module, fmt)
        raise FormatMismatchError(f"stored as {fmt}, but config.json's quantization_config says "
                                  f"otherwise: {why}", path=first.path, tensor=first.name)
    return LAYOUTS[fmt].build(tensors, module, shape, quant.delegate(module) if quant else None,
                              where)
