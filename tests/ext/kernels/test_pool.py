"""moed's compute pool (`_pool.h`): every thread count, spin setting, concurrent caller
and forked child gets the bits of one thread."""
from __future__ import annotations

import os
import threading

import ml_dtypes
import numpy as np
import pytest

from ext.kernels import _kernels


def _case(seed=0, R=300, C=512, T=3):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((R, C), dtype=np.float32) * 0.05).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((T, C), dtype=np.float32)
    ref = np.empty((T, R), np.float32)
    _kernels.matmul(w, x, ref, 1)
    return w, x, ref


@pytest.fixture
def spin():
    before = _kernels.pool_info()["spin_ns"]
    yield
    _kernels.set_pool_spin(before)


@pytest.mark.parametrize("n_threads", [2, 3, 7])
@pytest.mark.parametrize("spin_ns", [0, 50_000])
def test_any_thread_count_and_spin_gives_the_bits_of_one_thread(n_threads, spin_ns, spin):
    w, x, ref = _case()
    _kernels.set_pool_spin(spin_ns)
    out = np.empty_like(ref)
    for _ in range(20):                      # workers asleep, spinning, or late
        out.fill(np.nan)
        _kernels.matmul(w, x, out, n_threads)
        assert np.array_equal(out, ref)
    info = _kernels.pool_info()
    if info["threaded"]:
        assert info["workers"] >= n_threads - 1
        assert info["jobs"] > 0 and info["chunks"] >= info["worker_chunks"]


def test_the_pool_counts_jobs_and_refuses_a_negative_spin(spin):
    w, x, ref = _case()
    before = _kernels.pool_info()
    _kernels.matmul(w, x, np.empty_like(ref), 2)
    after = _kernels.pool_info()
    # one job on 2 threads (or none: after a stall the pool runs a few calls alone)
    assert after["jobs"] - before["jobs"] == (after["chunks"] - before["chunks"]) // 19 <= 1
    if after["threaded"] and after["stalls"] == 0:
        # 38 row groups of 8 rows in chunks of 38 // (2 threads x 8) = 2 groups: 19 chunks
        assert after["chunks"] - before["chunks"] == 19
    with pytest.raises(ValueError, match="must be >= 0"):
        _kernels.set_pool_spin(-1)


def test_concurrent_callers_each_get_their_own_bits():
    """Two Python threads calling at once: one owns the pool, the other runs alone;
    neither sees the other's rows."""
    cases = [_case(seed) for seed in (1, 2)]
    errors = []

    def call(w, x, ref):
        out = np.empty_like(ref)
        for _ in range(200):
            _kernels.matmul(w, x, out, 2)
            if not np.array_equal(out, ref):
                errors.append("mismatch")
                return

    threads = [threading.Thread(target=call, args=case) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_forked_child_starts_its_own_workers():
    w, x, ref = _case()
    _kernels.matmul(w, x, np.empty_like(ref), 2)        # the parent's pool is running
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out = np.empty_like(ref)
            for _ in range(5):
                _kernels.matmul(w, x, out, 2)
            info = _kernels.pool_info()
            code = 0 if np.array_equal(out, ref) and (info["workers"] >= 1 or not info["threaded"]) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_attention_scratch_rows_belong_to_the_running_thread():
    """Each block of rows uses its thread's rows of the call's scores scratch: with 2
    and 3 threads the output is that of one thread."""
    rng = np.random.default_rng(3)
    T, NH, NKV, D, S = 4, 8, 2, 32, 64
    q = rng.standard_normal((T, NH, D), dtype=np.float32)
    k = rng.standard_normal((NKV, S, D), dtype=np.float32)
    v = rng.standard_normal((NKV, S, D), dtype=np.float32)
    ref = np.empty_like(q)
    _kernels.attention(q, k, v, 20, 0, 0.2, ref, 1)
    for n_threads in (2, 3):
        out = np.empty_like(q)
        _kernels.attention(q, k, v, 20, 0, 0.2, out, n_threads)
        assert np.array_equal(out, ref)
