"""bench/matvec.py's stream mode: rings of copies larger than asked, copies that hold the
same weight in memory of their own, and a run of the script that reports every format."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import matvec  # noqa: E402

from ext.kernels import _kernels  # noqa: E402


def test_ring_size_covers_the_asked_bytes_with_at_least_three_copies():
    assert matvec.ring_size(1 << 20, 8) == 8
    assert matvec.ring_size(3 << 20, 8) == 3          # ceil(8 / 3) = 3
    assert matvec.ring_size(5 << 20, 8) == 3          # at least 3
    assert matvec.ring_size(64 << 20, 8) == 3
    assert matvec.ring_size(1000, 1) == 1049          # ceil(2**20 / 1000)


@pytest.mark.parametrize("name", ["bf16", "fp8-bf16", "int8", "int4-mins", "int4", "mxfp4"])
def test_a_copied_weight_computes_the_same_from_memory_of_its_own(name):
    rng = np.random.default_rng(0)
    w = matvec.make_weight(name, 16, 256, 32, rng)
    c = matvec.copy_weight(w)
    x = rng.standard_normal((1, 256), dtype=np.float32)
    a, b = np.empty((1, 16), np.float32), np.empty((1, 16), np.float32)
    _kernels.matmul(w, x, a, 1)
    _kernels.matmul(c, x, b, 1)
    assert np.array_equal(a, b)
    arrays = (w,) if isinstance(w, np.ndarray) else (w.codes, w.scales)
    copies = (c,) if isinstance(c, np.ndarray) else (c.codes, c.scales)
    for one, other in zip(arrays, copies):
        assert not np.shares_memory(one, other)


def test_stream_seconds_leaves_the_first_call_out():
    calls = []
    seconds = matvec.stream_seconds([lambda i=i: calls.append(i) for i in range(4)])
    assert calls == [0, 1, 2, 3] and seconds >= 0.0


def test_the_script_reports_every_format_in_stream_mode():
    out = subprocess.run(
        [sys.executable, str(BENCH / "matvec.py"), "--shapes", "64x256", "--formats", "f32,bf16,int4-mins",
         "--repeats", "2", "--threads", "1", "--expert", "none", "--stream-mib", "1",
         "--flush-mib", "1", "--pause", "0"], check=True, capture_output=True, text=True,
        cwd=BENCH.parent).stdout
    report = json.loads(out)
    assert report["mode"] == "stream of 1 MiB rings"
    (shape,) = report["matvec"]
    assert shape["numpy_f32"]["gb_per_s"] > 0
    assert set(shape["formats"]) == {"f32", "bf16", "int4-mins"}
    for r in shape["formats"].values():
        assert r["gb_per_s"] > 0 and r["max_rel_err"] < 1e-5
