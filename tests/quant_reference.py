"""Independent numpy implementations of the block-quantised weight formats, written from
their published descriptions (not from moed's kernels), for tests to compare with.

Each `dequantize_*` returns the float32 [R, C] values the format defines, computed as
numpy computes them: decode(code) in f32, times the f32 scale (plus the f32 minimum for
int4 with mins), one f32 operation at a time. The `random_*` helpers make seeded test
weights in each layout.

Sources:
- FP8 E4M3 ("e4m3fn"): OCP 8-bit Floating Point Specification (OFP8) rev. 1.0: 1 sign,
  4 exponent bits (bias 7), 3 mantissa bits, no infinities, S.1111.111 is NaN; block
  scales as DeepSeek-V3's `weight_scale_inv` (one per weight_block_size block, the last
  block of each direction partial), UE8M0 scales = 2^(s - 127).
- MXFP4: OCP Microscaling Formats (MX) v1.0: E2M1 elements (1 sign, 2 exponent bits
  bias 1, 1 mantissa bit), one E8M0 scale 2^(s - 127) per 32 (255 = NaN); GPT-OSS packs
  element 2i in the low nibble of byte i and 2i+1 in the high nibble.
- int8 / int4 groups (moed's repack): value = code * scale per g consecutive inputs;
  int4 code * scale + min, or (code - 8) * scale without mins; nibble order as MXFP4.
"""
from __future__ import annotations

import numpy as np

F32 = np.float32


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """float32 value of each float8_e4m3fn byte (uint8 array of any shape)."""
    b = codes.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, sign * mag).astype(F32)


def e2m1_values(nibbles: np.ndarray) -> np.ndarray:
    """float32 value of each E2M1 nibble (0..15)."""
    n = nibbles.astype(np.int64)
    sign = np.where(n & 8, -1.0, 1.0)
    e, m = (n >> 1) & 3, n & 1
    mag = np.where(e == 0, m * 0.5, (1 + m / 2.0) * 2.0 ** (e - 1))
    return (sign * mag).astype(F32)


def e8m0_values(s: np.ndarray) -> np.ndarray:
    """float32 2^(s - 127) for E8M0 bytes; 255 is NaN."""
    s = s.astype(np.int64)
    return np.where(s == 255, np.nan, np.ldexp(1.0, s - 127)).astype(F32)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> [..., 2n] nibbles: element 2i low nibble of byte i, 2i+1 high."""
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out


def pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """Inverse of unpack_nibbles."""
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def fp8_scale_values(scales: np.ndarray) -> np.ndarray:
    """float32 values of an fp8 block-scale grid of dtype float32, bfloat16 or uint8 UE8M0."""
    if scales.dtype == np.uint8:
        return e8m0_values(scales)
    if scales.dtype.name == "bfloat16":  # bf16 is the upper half of an f32
        return (scales.view(np.uint16).astype(np.uint32) << 16).view(F32)
    assert scales.dtype == F32, scales.dtype
    return scales


def dequantize_fp8(codes: np.ndarray, scales: np.ndarray, block_size=(128, 128)) -> np.ndarray:
    """codes uint8 [R, C]; scales [ceil(R/br), ceil(C/bc)] -> float32 [R, C]."""
    R, C = codes.shape
    br, bc = block_size
    assert scales.shape == (-(-R // br), -(-C // bc)), (scales.shape, R, C, block_size)
    s = fp8_scale_values(scales)
    s = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[:R, :C]
    return e4m3_values(codes.view(np.uint8)) * s


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [R, G, 16]; scales uint8 [R, G] -> float32 [R, 32 G]."""
    R, G, _ = blocks.shape
    v = e2m1_values(unpack_nibbles(blocks))  # [R, G, 32]
    return (v * e8m0_values(scales.view(np.uint8))[:, :, None]).reshape(R, 32 * G)


def dequantize_int8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes int8 [R, C]; scales float16 [R, C/g] -> float32 [R, C]."""
    g = codes.shape[1] // scales.shape[1]
    return codes.astype(F32) * np.repeat(scales.astype(F32), g, axis=1)


def dequantize_int4(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None = None) -> np.ndarray:
    """codes uint8 [R, C/2]; scales (and mins) float16 [R, C/g] -> float32 [R, C]."""
    q = unpack_nibbles(codes).astype(F32)
    g = q.shape[1] // scales.shape[1]
    s = np.repeat(scales.astype(F32), g, axis=1)
    if mins is None:
        return (q - F32(8)) * s
    return q * s + np.repeat(mins.astype(F32), g, axis=1)


# ------------------------------------------------------------ random test weights

def random_fp8(rng, R, C, block_size=(128, 128), scale_dtype="float32", nan_codes=False):
    """(codes uint8 [R, C], scales [ceil(R/br), ceil(C/bc)]) with random bytes (no NaN
    codes unless asked) and positive scales of the given dtype ("float32",
    "bfloat16" or "ue8m0")."""
    import ml_dtypes

    codes = rng.integers(0, 256, (R, C), dtype=np.uint8)
    if not nan_codes:
        codes[(codes & 0x7F) == 0x7F] ^= 1
    grid = (-(-R // block_size[0]), -(-C // block_size[1]))
    if scale_dtype == "ue8m0":
        scales = rng.integers(112, 121, grid, dtype=np.uint8)  # 2^-15 .. 2^-6
    else:
        scales = (rng.uniform(0.5, 2.0, grid) * 2.0 ** -8).astype(F32)
        if scale_dtype == "bfloat16":
            scales = scales.astype(ml_dtypes.bfloat16)
    return codes, scales


def random_mxfp4(rng, R, C):
    """(blocks uint8 [R, C/32, 16], scales uint8 [R, C/32]) of random bytes."""
    G = C // 32
    return (rng.integers(0, 256, (R, G, 16), dtype=np.uint8),
            rng.integers(120, 130, (R, G), dtype=np.uint8))


def random_int8(rng, R, C, g):
    """(codes int8 [R, C], scales float16 [R, C/g])."""
    return (rng.integers(-128, 128, (R, C), dtype=np.int8),
            (rng.uniform(0.5, 2.0, (R, C // g)) / 128).astype(np.float16))


def random_int4(rng, R, C, g, with_mins):
    """(codes uint8 [R, C/2], scales float16 [R, C/g], mins float16 [R, C/g] or None)."""
    codes = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, (R, C // g)) / 8).astype(np.float16)
    mins = (-8 * scales.astype(F32) * rng.uniform(0.7, 1.3, scales.shape)).astype(np.float16)
    return codes, scales, (mins if with_mins else None)
