"""The parallel threshold: which calls run on one thread, chosen by the OpenMP wait
policy; a speed choice that never changes a result."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ext.kernels import _kernels


@pytest.mark.parametrize("env, expected", [
    ({}, 65536),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, 65536),
    ({"OMP_WAIT_POLICY": "passive"}, 6 * 1024 * 1024),
    ({"OMP_WAIT_POLICY": " PASSIVE "}, 6 * 1024 * 1024),
    ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}, 65536),   # spins first: cheap wakes
])
def test_the_threshold_follows_the_wait_policy(env, expected):
    assert _kernels._wait_policy_threshold(env) == expected


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
