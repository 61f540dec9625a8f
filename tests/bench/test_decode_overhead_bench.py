"""bench/decode_overhead.py: the kernels' share of a decode step is counted from the
wrapped kernel calls, and the outside share is what remains."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ext.makemodel import make_model

BENCH = Path(__file__).resolve().parents[2] / "bench" / "decode_overhead.py"


def test_a_run_reports_both_thread_counts_and_shares_within_0_and_1(tmp_path):
    model = make_model(tmp_path / "m", arch="qwen3_moe", layers=2, experts=8, top_k=2, hidden=64,
                       intermediate=32, dtype="bf16", seed=4)
    run = subprocess.run([sys.executable, str(BENCH), "--model", str(model), "--threads", "1,2",
                          "--tokens", "3", "--rounds", "2"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert set(out["threads"]) == {"1", "2"} and out["numerics"] == "exact"
    for row in out["threads"].values():
        assert len(row["tokens_per_second_runs"]) == 2
        assert all(0 <= s < 1 for s in row["outside_kernels_share_runs"])
        # 2 layers: norms, attention's projections and kernel, router, experts, ...
        assert row["kernel_calls_per_token"] >= 2 * 8
    assert "ratio_to_1_thread" in out["threads"]["2"]
    assert out["build_info"]["simd"] in ("avx512", "avx2", "portable")
