"""How make-model stores each tensor: plain floats, FP8 E4M3 with block scales, or MXFP4.

An `Encoding` turns the float32 values of one tensor (drawn row chunk by row chunk) into
the tensors the checkpoint holds for it, in the layouts published models use:

  plain   one tensor of the dtype (F32, F16, BF16), rounded to nearest even.
  fp8     DeepSeek-V3 / Qwen3-FP8: `<name>` F8_E4M3 [R, C] and `<name>_scale_inv`
          [ceil(R / 128), ceil(C / 128)] (partial last blocks), value = fp8 x scale of
          its block. Each block's scale is max |w| / 448 (E4M3's largest finite value),
          stored as F32 or BF16 (the rounded scale is the one divided by), or, with
          scale_fmt "ue8m0", rounded up to a power of two (DeepSeek-V3.1) and stored as
          F32 or as E8M0 exponents (U8, 2^(s - 127)). Weights are w / scale clipped to
          +-448 and rounded to E4M3 (ml_dtypes, round to nearest even).
  mxfp4   OCP Microscaling MXFP4 (OCP MX spec v1.0, section 6.3): per group of 32
          values along C a shared scale 2^(floor(log2 max |w|) - 2) (2 = E2M1's largest
          exponent), the values divided by it rounded to E2M1 (saturating at 6) and
          packed two per byte, element 2i in the low nibble of byte i. Written as
          `<module>.weight_blocks` U8 [R, C/32, 16] and `<module>.weight_scales` U8
          [R, C/32] (scale + 127): GPT-OSS's `_blocks` / `_scales` named per module.

This module shares no code with the reader (ext/formats/quant.py): it is written from
the same format descriptions, so that each checks the other.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ext.makemodel.families import TensorSpec

FP8_MAX = 448.0            # largest finite float8_e4m3fn
FP8_BLOCK = (128, 128)     # weight_block_size of every published FP8 checkpoint
MXFP4_GROUP = 32
E8M0_BIAS = 127
SCALE_DTYPES = {"f32": (np.dtype(np.float32), "F32"),
                "bf16": (np.dtype(ml_dtypes.bfloat16), "BF16"),
                "e8m0": (np.dtype(np.uint8), "U8")}
_PLAIN = {
    # name: (numpy dtype, safetensors dtype, config "dtype")
    "bf16": (np.dtype(ml_dtypes.bfloat16), "BF16", "bfloat16"),
    "f16": (np.dtype(np.float16), "F16", "float16"),
    "f32": (np.dtype(np.float32), "F32", "float32"),
}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "U8": 1}


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype make-model writes."""
    return _ITEMSIZE[dtype]


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a shard: safetensors name, dtype string, shape and byte size."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


class Encoder(ABC):
    """Encodes one tensor: `chunk` per chunk of float32 rows, then `extras`."""

    @abstractmethod
    def chunk(self, rows: np.ndarray) -> np.ndarray:
        """The bytes of the first stored tensor for these rows [n, C] (an array to write)."""

    def extras(self) -> list[np.ndarray]:
        """After the last chunk: the data of the other stored tensors, in order."""
        return []


class Encoding(ABC):
    """How a tensor spec is stored. `row_multiple`: chunks must hold whole groups of this
    many rows (None: any chunking works)."""

    row_multiple: int | None = None

    @abstractmethod
    def stored(self, spec: TensorSpec) -> list[StoredTensor]:
        """The tensors written for `spec`, first the one `Encoder.chunk` streams."""

    @abstractmethod
    def encoder(self, spec: TensorSpec) -> Encoder:
        """A fresh encoder for one pass over `spec`'s values."""


class Plain(Encoding):
    """The values rounded to one float dtype ("f32", "f16", "bf16")."""

    def __init__(self, dtype: str):
        self.np_dtype, self.st_dtype, self.config_dtype = _PLAIN[dtype]

    def stored(self, spec):
        return [StoredTensor(spec.name, self.st_dtype, spec.shape)]

    def encoder(self, spec):
        return _CastEncoder(self.np_dtype)


class _CastEncoder(Encoder):
    def __init__(self, np_dtype: np.dtype):
        self.np_dtype = np_dtype

    def chunk(self, rows):
        return rows if self.np_dtype == np.float32 else rows.astype(self.np_dtype)


class Fp8(Encoding):
    """FP8 E4M3 with 128 x 128 block scales (see the module doc)."""

    row_multiple = FP8_BLOCK[0]

    def __init__(self, scale_dtype: str = "f32", scale_fmt: str = "float"):
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {tuple(SCALE_DTYPES)}, got {scale_dtype!r}")
        if scale_fmt not in ("float", "ue8m0"):
            raise ValueError(f"scale_fmt must be 'float' or 'ue8m0', got {scale_fmt!r}")
        if scale_dtype == "e8m0" and scale_fmt != "ue8m0":
            raise ValueError("scale_dtype 'e8m0' stores exponents: it needs scale_fmt 'ue8m0'")
        if scale_dtype == "bf16" and scale_fmt == "ue8m0":
            raise ValueError("scale_fmt 'ue8m0' scales are stored as f32 or e8m0, not bf16")
        self.scale_dtype, self.scale_fmt = scale_dtype, scale_fmt

    def stored(self, spec):
        R, C = spec.shape
        grid = (-(-R // FP8_BLOCK[0]), -(-C // FP8_BLOCK[1]))
        return [StoredTensor(spec.name, "F8_E4M3", spec.shape),
                StoredTensor(spec.name + "_scale_inv", SCALE_DTYPES[self.scale_dtype][1], grid)]

    def encoder(self, spec):
        return _Fp8Encoder(self.scale_dtype, self.scale_fmt)


class _Fp8Encoder(Encoder):
    def __init__(self, scale_dtype: str, scale_fmt: str):
        self.scale_dtype, self.scale_fmt = scale_dtype, scale_fmt
        self.scales: list[np.ndarray] = []

    def chunk(self, rows):
        n, C = rows.shape
        bR, bC = FP8_BLOCK
        gr, gc = -(-n // bR), -(-C // bC)
        padded = np.zeros((gr * bR, gc * bC), np.float32)
        padded[:n, :C] = rows
        amax = np.abs(padded).reshape(gr, bR, gc, bC).max(axis=(1, 3))
        scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
        if self.scale_fmt == "ue8m0":
            scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
        if self.scale_dtype == "bf16":              # divide by the scale that is stored
            scale = scale.astype(ml_dtypes.bfloat16).astype(np.float32)
        self.scales.append(scale)
        full = np.repeat(np.repeat(scale, bR, axis=0), bC, axis=1)[:n, :C]
        q = np.clip(rows / full, -FP8_MAX, FP8_MAX)
        return q.astype(ml_dtypes.float8_e4m3fn)

    def extras(self):
        scale = np.concatenate(self.scales)
        if self.scale_dtype == "e8m0":
            return [(np.log2(scale).astype(np.int32) + E8M0_BIAS).astype(np.uint8)]
        return [scale.astype(SCALE_DTYPES[self.scale_dtype][0])]


class Mxfp4(Encoding):
    """MXFP4 blocks and E8M0 scales (see the module doc); the name's ".weight" becomes
    ".weight_blocks" / ".weight_scales"."""

    row_multiple = 1

    def stored(self, spec):
        *rows, C = spec.shape                 # [R, C], or [E, R, C] fused over experts (GPT-OSS)
        G = C // MXFP4_GROUP
        return [StoredTensor(spec.name + "_blocks", "U8", (*rows, G, MXFP4_GROUP // 2)),
                StoredTensor(spec.name + "_scales", "U8", (*rows, G))]

    def encoder(self, spec):
        return _Mxfp4Encoder()


class _Mxfp4Encoder(Encoder):
    def __init__(self):
        self.scales: list[np.ndarray] = []

    def chunk(self, rows):
        n, C = rows.shape
        groups = rows.reshape(n, C // MXFP4_GROUP, MXFP4_GROUP)
        amax = np.abs(groups).max(axis=-1)
        with np.errstate(divide="ignore"):
            exponent = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -E8M0_BIAS)
        exponent = np.clip(exponent, -E8M0_BIAS, E8M0_BIAS).astype(np.int32)
        values = groups / np.exp2(exponent)[..., None].astype(np.float32)
        codes = values.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F   # [n, G, 32]
        self.scales.append((exponent + E8M0_BIAS).astype(np.uint8))
        return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # [n, G, 16]

    def extras(self):
        return [np.concatenate(self.scales)]


def quantization_config(dtype: str, arch: str, kept: list[str], scale_fmt: str) -> dict | None:
    """config.json's `quantization_config` for a low-bit `dtype`, as the published
    models write it (None for plain floats). kept: the linear modules left in bf16."""
    if dtype == "fp8":                    # Qwen3-30B-A3B-FP8 / DeepSeek-V3's keys
        config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                  "weight_block_size": list(FP8_BLOCK), "modules_to_not_convert": kept}
        if scale_fmt == "ue8m0":          # DeepSeek-V3.1
            config["scale_fmt"] = "ue8m0"
        return config
    if dtype == "mxfp4" and arch == "gpt_oss":   # openai/gpt-oss-*'s own
        return {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"],
                "quant_method": "mxfp4"}
    if dtype == "mxfp4":                  # GPT-OSS's, with this family's module names
        moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
        skip = ["model.layers.*.self_attn", f"model.layers.*.{moe}.gate", "model.embed_tokens",
                "lm_head"]
        if arch == "qwen2_moe":
            skip += ["model.layers.*.mlp.shared_expert", "model.layers.*.mlp.shared_expert_gate"]
        return {"modules_to_not_convert": skip, "quant_method": "mxfp4"}
    return None
