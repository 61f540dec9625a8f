"""An independent numpy reading of the low-bit formats, for the oracle tests.

Written in the tests from the format descriptions alone — not moed's kernels, not
ext/formats, not transformers' dequantisers (whose FP8 one infers the block size from
the scale grid and is wrong for shapes that are not multiples of 128):

  FP8 E4M3 (OCP 8-bit floating point spec, "E4M3FN"): bit 7 the sign, bits 6-3 the
      exponent (bias 7), bits 2-0 the mantissa; exponent 0 is subnormal
      (m / 8 x 2^-6); S.1111.111 is NaN; no infinities. A weight [R, C] is
      fp8[r, c] x scale[r // bR, c // bC], (bR, bC) = quantization_config's
      weight_block_size; scales F32 / BF16 values, or E8M0 exponents.
  E8M0 (OCP MX spec): 2^(s - 127), s = 255 is NaN.
  MXFP4 (OCP MX spec): E2M1 nibbles, bit 3 the sign, magnitudes 0, 0.5, 1, 1.5, 2, 3,
      4, 6; element 2i of a 32-value group in the low nibble of byte i, 2i + 1 in the
      high nibble; the group's E8M0 scale multiplies all 32.

`dequantised_twin` writes a plain float32 copy of a low-bit checkpoint (same tensor
names, `<module>.weight` for every quantised weight, no quantization_config) that
transformers loads with its own model classes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e4m3(codes: np.ndarray) -> np.ndarray:
    """float64 values of E4M3FN codes (uint8)."""
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exponent, mantissa = (c >> 3) & 0xF, c & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = (mantissa / 8.0) * 2.0 ** -6
    value = sign * np.where(exponent == 0, subnormal, normal)
    return np.where((exponent == 15) & (mantissa == 7), np.nan, value)


def e8m0(codes: np.ndarray) -> np.ndarray:
    """float64 values of E8M0 exponents (uint8)."""
    c = codes.astype(np.int64)
    return np.where(c == 255, np.nan, np.exp2(c - 127.0))


def fp8_weight(codes: np.ndarray, scales: np.ndarray, block: tuple[int, int],
               e8m0_scales: bool) -> np.ndarray:
    """float32 [R, C] of FP8 codes [R, C] (uint8) and their block scales."""
    R, C = codes.shape
    bR, bC = block
    s = e8m0(scales) if e8m0_scales else scales.astype(np.float64)
    assert s.shape == (-(-R // bR), -(-C // bC)), (s.shape, codes.shape, block)
    full = np.repeat(np.repeat(s, bR, axis=0), bC, axis=1)[:R, :C]
    return (e4m3(codes) * full).astype(np.float32)


def mxfp4_weight(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [R, 32 G] of MXFP4 blocks [R, G, 16] (uint8) and scales [R, G] (uint8)."""
    R, G, B = blocks.shape
    assert B == 16 and scales.shape == (R, G)
    b = blocks.astype(np.int64)
    nibbles = np.empty((R, G, 32), np.int64)
    nibbles[..., 0::2] = b & 0x0F
    nibbles[..., 1::2] = b >> 4
    values = np.where(nibbles & 0x8, -1.0, 1.0) * E2M1[nibbles & 0x7]
    return (values * e8m0(scales)[..., None]).reshape(R, 32 * G).astype(np.float32)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        return t.view(torch.uint8).numpy()
    if t.dtype == torch.uint8:
        return t.numpy()
    return t.float().numpy()


def read_tensors(model_dir: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (torch dtype name, numpy array: codes as uint8, floats as float32)."""
    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, t in load_file(path).items():
            out[name] = (str(t.dtype).removeprefix("torch."), _as_numpy(t))
    return out


def dequantise(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint as float32, quantised weights dequantised (by the
    config's quantization_config, never by guessing from the shapes)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    block = tuple(quant.get("weight_block_size", (128, 128)))
    tensors = read_tensors(model_dir)
    out = {}
    for name, (dtype, array) in tensors.items():
        if name.endswith(("_scale_inv", "_scales")):
            continue
        if name.endswith(".weight_blocks"):
            assert method == "mxfp4"
            base = name.removesuffix("_blocks")
            out[base] = mxfp4_weight(array, tensors[base + "_scales"][1])
        elif dtype == "float8_e4m3fn":
            assert method == "fp8"
            scale_dtype, scales = tensors[name + "_scale_inv"]
            out[name] = fp8_weight(array, scales, block,
                                   e8m0_scales=scale_dtype in ("uint8", "float8_e8m0fnu"))
        else:
            out[name] = array.astype(np.float32)
    return out


def dequantised_twin(model_dir: Path, twin_dir: Path) -> Path:
    """Write the float32 dequantised copy of `model_dir` (config without its
    quantization_config) into `twin_dir`; returns twin_dir."""
    twin_dir.mkdir(parents=True)
    save_file({k: torch.from_numpy(v) for k, v in dequantise(model_dir).items()},
              str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = config["torch_dtype"] = "float32"
    (twin_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, twin_dir / name)
    return twin_dir
