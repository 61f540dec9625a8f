"""The parallel threshold: which calls run on one thread; a speed choice that never
changes a result."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ext.kernels import _kernels

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("policy", [None, "ACTIVE", "PASSIVE"])
def test_the_threshold_ignores_the_openmp_wait_policy(policy):
    """The kernels' threads are moed's pool, not libgomp's: OMP_WAIT_POLICY changes
    nothing, in a fresh process (where it would be read)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    code = "from ext.kernels import _kernels; print(_kernels.parallel_threshold())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == 32768


def test_set_and_read_the_threshold_and_refuse_nonsense():
    _kernels.set_parallel_threshold(1234)
    assert _kernels.parallel_threshold() == 1234 == _kernels.build_info()["parallel_threshold"]
    with pytest.raises(ValueError, match="must be >= 1"):
        _kernels.set_parallel_threshold(0)
    assert _kernels.parallel_threshold() == 1234


@pytest.mark.parametrize("threshold", [1, 1 << 30])
def test_the_threshold_changes_no_result(threshold):
    """2 threads on every call, or 1 thread on every call: the same bits."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((300, 512), dtype=np.float32) * 0.05).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((3, 512), dtype=np.float32)
    ref = np.empty((3, 300), np.float32)
    _kernels.matmul(w, x, ref, 1)
    _kernels.set_parallel_threshold(threshold)
    out = np.empty_like(ref)
    _kernels.matmul(w, x, out, 2)
    assert np.array_equal(out, ref)
