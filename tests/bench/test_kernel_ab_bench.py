"""bench/kernel_ab.py: two builds in one process, their outputs compared, and a checkout
without built kernels refused by name."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import kernel_ab  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_ab.py"), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_the_same_build_against_itself_gives_identical_outputs_and_a_ratio_per_format():
    out = run("--a", str(ROOT), "--b", str(ROOT), "--formats", "bf16,int4-mins,fp8-f32",
              "--shapes", "64x256", "--rounds", "2", "--threads", "1", "--stream-mib", "1")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [r["format"] for r in report["results"]] == ["bf16", "int4-mins", "fp8-f32"]
    for r in report["results"]:
        assert r["identical_outputs"] is True
        assert r["shape"] == [64, 256] and r["ring"] >= 3
        assert r["a_gb_per_s"] > 0 and r["b_gb_per_s"] > 0 and r["b_over_a"] > 0
        lo, hi = r["b_over_a_quartiles"]
        assert lo <= hi
    assert report["a"]["build"]["simd"] == report["b"]["build"]["simd"]


def test_a_mat_mat_of_several_tokens_runs_too():
    out = run("--a", str(ROOT), "--b", str(ROOT), "--formats", "int8", "--shapes", "32x128",
              "--rounds", "1", "--threads", "1", "--stream-mib", "1", "--tokens", "3")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tokens"] == 3


def test_fast_numerics_of_both_builds():
    out = run("--a", str(ROOT), "--b", str(ROOT), "--formats", "int4-mins,mxfp4", "--shapes", "32x128",
              "--rounds", "1", "--threads", "1", "--stream-mib", "1", "--fast")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["fast"] is True
    assert all(r["identical_outputs"] for r in report["results"])


def test_a_checkout_without_built_kernels_is_named(tmp_path):
    out = run("--a", str(tmp_path), "--b", str(ROOT), "--shapes", "32x128", "--rounds", "1")
    assert out.returncode != 0
    assert str(tmp_path) in out.stderr and "no built ext/kernels/_kernels" in out.stderr


def test_bad_formats_and_shapes_are_refused_by_flag():
    bad = run("--a", str(ROOT), "--b", str(ROOT), "--formats", "int3")
    assert bad.returncode == 2 and "--formats: unknown int3" in bad.stderr
    bad = run("--a", str(ROOT), "--b", str(ROOT), "--shapes", "64by256")
    assert bad.returncode == 2 and "--shapes" in bad.stderr


def test_a_weight_rewrapped_for_another_build_keeps_its_arrays():
    from ext.kernels import _kernels
    rng = np.random.default_rng(0)
    w = kernel_ab.matvec.make_weight("int4-mins", 8, 64, 32, rng)
    again = kernel_ab.rewrap(_kernels, w)
    assert again.codes is w.codes or np.shares_memory(again.codes, w.codes)
    assert again.nbytes == w.codes.nbytes + w.scales.nbytes + w.mins.nbytes   # what GB/s counts
    assert kernel_ab.quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == [2.0, 4.0]
