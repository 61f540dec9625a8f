"""The kernels also build and run without OpenMP, with bit-identical results."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_sequential_build_matches_openmp_build(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "ext", src / "ext", ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__"))
    env = dict(os.environ, MOED_OPENMP="0")
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=src,
                           env=env, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    assert "sequential" in build.stderr
    script = textwrap.dedent("""
        import numpy as np, ml_dtypes, sys
        from ext.kernels import _kernels as k
        rng = np.random.default_rng(0)
        w = rng.standard_normal((37, 200), dtype=np.float32).astype(ml_dtypes.bfloat16)
        x = rng.standard_normal((5, 200), dtype=np.float32)
        out = np.empty((5, 37), np.float32)
        k.matmul(w, x, out, 2)
        np.save(sys.argv[1], out)
        print(k.openmp_enabled())
    """)
    results = {}
    for label, cwd in (("sequential", src), ("openmp", ROOT)):
        run = subprocess.run([sys.executable, "-c", script, str(tmp_path / f"{label}.npy")],
                             cwd=cwd, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        results[label] = run.stdout.strip()
    assert results == {"sequential": "False", "openmp": "True"}
    import numpy as np
    assert np.array_equal(np.load(tmp_path / "sequential.npy"), np.load(tmp_path / "openmp.npy"))
