"""The kernels also build without OpenMP, for any CPU (MOED_PORTABLE=1) and, on an
AVX-512 machine, for AVX2 only; every build gives the bits of the native OpenMP build
the tests run against."""
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
# Prints build_info() as "simd openmp".
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
    np.savez(sys.argv[1], **results)
    info = k.build_info()
    print(info["simd"], info["openmp"], "vbmi" if "avx512vbmi" in info["features"] else "")
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


def _run(cwd: Path, out: Path) -> tuple[str, dict[str, np.ndarray]]:
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(ROOT / "tests")],
                         cwd=cwd, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    with np.load(out) as data:
        return run.stdout.strip(), dict(data)


@pytest.mark.slow
@pytest.mark.parametrize("label, env, expected_info", [
    ("sequential", {"MOED_OPENMP": "0"}, None),
    ("portable", {"MOED_PORTABLE": "1"}, "portable True"),
    ("avx2", {"MOED_EXTRA_CFLAGS": "-mno-avx512f"}, "avx2 True"),
    ("avx512-without-vbmi", {"MOED_EXTRA_CFLAGS": "-mno-avx512vbmi"}, "avx512 True"),
])
def test_other_builds_match_the_native_openmp_build(tmp_path, label, env, expected_info):
    native_info, native = _run(ROOT, tmp_path / "native.npz")
    simd, openmp, *vbmi = native_info.split()
    if label == "avx2" and simd != "avx512" or label == "avx512-without-vbmi" and not vbmi:
        pytest.skip(f"the native build ({native_info}) has no such narrower build to compare")
    src = _build_copy(tmp_path, label, **env)
    info, other = _run(src, tmp_path / f"{label}.npz")
    assert openmp == "True"
    assert info.split() == (expected_info or f"{simd} False {' '.join(vbmi)}").split()
    assert sorted(other) == sorted(native)
    for name in native:
        assert np.array_equal(other[name].view(np.uint32), native[name].view(np.uint32)), name
