"""The kernels also build without OpenMP, for any CPU (MOED_PORTABLE=1) and, on an
AVX-512 machine, for AVX2 only (with and without AVX-VNNI) and for AVX-512 without VBMI
or without VNNI; every build gives the bits of the native OpenMP build the tests run
against, in exact and in fast mode."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]

# Runs in a build's source tree: argv[1] = output .npz, argv[2] = the tests/ folder.
# Prints build_info() as "simd fast openmp [vbmi]" and, on a second line, the features.
SCRIPT = textwrap.dedent("""
    import sys
    import ml_dtypes
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    import quant_reference as ref
    from ext.kernels import _kernels as k

    rng = np.random.default_rng(0)
    R, C, T = 37, 416, 5  # a partial group of rows; 416 = 13 x 32, not a multiple of 128
    weights = {"bf16": rng.standard_normal((R, C), dtype=np.float32).astype(ml_dtypes.bfloat16)}
    for dtype in ("float32", "bfloat16", "ue8m0"):
        weights[f"fp8-{dtype}"] = k.QuantizedWeight(
            "fp8_e4m3", *ref.random_fp8(rng, R, C - 7, (16, 96), dtype), block_size=(16, 96))
    weights["mxfp4"] = k.QuantizedWeight("mxfp4", *ref.random_mxfp4(rng, R, C))
    weights["int8"] = k.QuantizedWeight("int8", *ref.random_int8(rng, R, C, 32))
    for mins in (False, True):
        weights[f"int4-{mins}"] = k.QuantizedWeight("int4", *ref.random_int4(rng, R, C, 32, mins))
    results = {}
    for name, w in weights.items():
        x = rng.standard_normal((T, w.shape[1]), dtype=np.float32)
        out = np.empty((T, R), np.float32)
        k.matmul(w, x, out, 2)
        results[name] = out
        results[name + "-values"] = k.dequantize(w)
    H, I = 64, 96
    experts = [k.QuantizedWeight("int4", *ref.random_int4(rng, r, c, 32, True))
               for r, c in ((I, H), (I, H), (H, I))]
    x = rng.standard_normal((3, H), dtype=np.float32)
    out = np.empty((3, H), np.float32)
    k.expert_ffn(*([w] for w in experts), x, np.array([0, 3], np.int64),
                 np.empty((3, I), np.float32), out, 2)
    results["expert_ffn"] = out
    # fast mode: 29 blocks (a whole chunk of 16, then 13) or 28 with groups of 64 and 128
    fast = {"mxfp4": k.QuantizedWeight("mxfp4", *ref.random_mxfp4(rng, R, 928)),
            "int8-g32": k.QuantizedWeight("int8", *ref.random_int8(rng, R, 928, 32)),
            "int8-g64": k.QuantizedWeight("int8", *ref.random_int8(rng, R, 896, 64))}
    for mins in (False, True):
        fast[f"int4-g32-{mins}"] = k.QuantizedWeight("int4", *ref.random_int4(rng, R, 928, 32, mins))
        fast[f"int4-g128-{mins}"] = k.QuantizedWeight("int4", *ref.random_int4(rng, R, 896, 128, mins))
    # tails of at most 8 blocks (half a chunk's integer work): 24 = 16 + 8 and 21 = 16 + 5 blocks
    fast["mxfp4-768"] = k.QuantizedWeight("mxfp4", *ref.random_mxfp4(rng, R, 768))
    fast["int8-g32-672"] = k.QuantizedWeight("int8", *ref.random_int8(rng, R, 672, 32))
    fast["int4-g32-768"] = k.QuantizedWeight("int4", *ref.random_int4(rng, R, 768, 32, True))
    for name, w in fast.items():
        x = rng.standard_normal((T, w.shape[1]), dtype=np.float32)
        out = np.empty((T, R), np.float32)
        k.matmul(w, x, out, 2, fast=True)
        results[name + "-fast"] = out.copy()
        k._matmul_portable(w, x, out, 2, fast=True)
        results[name + "-fast-portable"] = out
    H, I = 544, 96
    for fmt in ("int4", "mxfp4", "int8"):
        make = {"int4": lambda r, c: ref.random_int4(rng, r, c, 32, True),
                "mxfp4": lambda r, c: ref.random_mxfp4(rng, r, c),
                "int8": lambda r, c: ref.random_int8(rng, r, c, 32)}[fmt]
        experts = [[k.QuantizedWeight(fmt, *make(r, c)) for _ in range(2)] for r, c in ((I, H), (I, H), (H, I))]
        x = rng.standard_normal((5, H), dtype=np.float32)
        out = np.empty((5, H), np.float32)
        k.expert_ffn(*experts, x, np.array([0, 3, 5], np.int64), np.empty((5, I), np.float32), out, 2,
                     fast=True)
        results[f"expert_ffn-{fmt}-fast"] = out
    # bf16 fast ("bf16-dp"): VDPBF16PS where built in, its emulation elsewhere; wide
    # dynamic range for subnormal products, a partial last step of 32 columns
    wb = (rng.standard_normal((R, C - 9)) * np.exp(rng.uniform(-40, 5, (R, C - 9)))).astype(np.float32)
    xb = (rng.standard_normal((T, C - 9)) * np.exp(rng.uniform(-45, 5, (T, C - 9)))).astype(np.float32)
    out = np.empty((T, R), np.float32)
    k.matmul(wb.astype(ml_dtypes.bfloat16), xb, out, 2, fast=2)
    results["bf16-fast"] = out.copy()
    k._matmul_portable(wb.astype(ml_dtypes.bfloat16), xb, out, 2, fast=2)
    results["bf16-fast-portable"] = out.copy()
    # attention: blocks of 16 keys and the tail, D with a 16-column step and a scalar tail,
    # a sliding window, sinks, and MLA's latent cache (Dv < Dk)
    for D, window in ((64, 0), (40, 5), (19, 0)):
        T, NH, NKV, S, pos0 = 6, 4, 2, 48, 30
        q = rng.standard_normal((T, NH, D), dtype=np.float32)
        kc = rng.standard_normal((NKV, S, D), dtype=np.float32)
        vc = rng.standard_normal((NKV, S, D), dtype=np.float32)
        out = np.empty_like(q)
        k.attention(q, kc, vc, pos0, window, 0.3, out, 2, rng.standard_normal(NH, dtype=np.float32))
        results[f"attention-{D}-{window}"] = out
    q = rng.standard_normal((5, 3, 72), dtype=np.float32)
    cache = rng.standard_normal((40, 72), dtype=np.float32)
    out = np.empty((5, 3, 64), np.float32)
    k.latent_attention(q, cache, 33, 0.2, out, 2)
    results["latent_attention"] = out
    np.savez(sys.argv[1], **results)
    info = k.build_info()
    print(info["simd"], info["fast"], info["openmp"], "vbmi" if "avx512vbmi" in info["features"] else "")
    print(" ".join(info["features"]))
""")


def _build_copy(tmp_path: Path, label: str, **env: str) -> Path:
    """Build a copy of the sources with extra environment variables; returns its root."""
    src = tmp_path / label
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("ext", "scheduler"):          # (setup.py builds the scheduler's bookkeeping too)
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__"))
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=src,
                           env=dict(os.environ, **env), capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    return src


def _run(cwd: Path, out: Path) -> tuple[str, set[str], dict[str, np.ndarray]]:
    """(the build's "simd fast openmp [vbmi]", its features, the results)."""
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(ROOT / "tests")],
                         cwd=cwd, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    info, features = (run.stdout.strip().split("\n") + [""])[:2]
    with np.load(out) as data:
        return info.strip(), set(features.split()), dict(data)


@pytest.mark.slow
@pytest.mark.parametrize("label, env", [
    ("sequential", {"MOED_OPENMP": "0"}),
    ("pool-serial", {"MOED_EXTRA_CFLAGS": "-DMOED_POOL_SERIAL"}),
    ("portable", {"MOED_PORTABLE": "1"}),
    ("avx2", {"MOED_EXTRA_CFLAGS": "-mno-avx512f"}),
    ("avx2-without-vnni", {"MOED_EXTRA_CFLAGS": "-mno-avx512f -mno-avxvnni"}),
    ("avx512-without-vbmi", {"MOED_EXTRA_CFLAGS": "-mno-avx512vbmi"}),
    ("avx512-without-vnni", {"MOED_EXTRA_CFLAGS": "-mno-avx512vnni -mno-avxvnni"}),
])
def test_other_builds_match_the_native_openmp_build(tmp_path, label, env):
    native_info, features, native = _run(ROOT, tmp_path / "native.npz")
    simd, fast, openmp, *vbmi = native_info.split()
    narrower = {"avx2": simd == "avx512",
                "avx2-without-vnni": simd == "avx512" or fast == "avx2-vnni",
                "avx512-without-vbmi": bool(vbmi),
                "avx512-without-vnni": fast == "avx512-vnni"}
    if not narrower.get(label, True):
        pytest.skip(f"the native build ({native_info}) has no such narrower build to compare")
    expected_info = {
        "sequential": f"{simd} {fast} False {' '.join(vbmi)}",
        "pool-serial": f"{simd} {fast} True {' '.join(vbmi)}",
        "portable": "portable portable True",
        "avx2": f"avx2 {'avx2-vnni' if 'avxvnni' in features else 'avx2'} True",
        "avx2-without-vnni": "avx2 avx2 True",
        "avx512-without-vbmi": f"avx512 {fast} True",
        "avx512-without-vnni": f"avx512 avx2 True {' '.join(vbmi)}",
    }[label]
    src = _build_copy(tmp_path, label, **env)
    info, _, other = _run(src, tmp_path / f"{label}.npz")
    assert openmp == "True"
    assert info.split() == expected_info.split()
    assert sorted(other) == sorted(native)
    for name in native:
        assert np.array_equal(other[name].view(np.uint32), native[name].view(np.uint32)), name
