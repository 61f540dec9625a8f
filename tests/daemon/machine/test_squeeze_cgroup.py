"""The squeezer in a real memory-limited cgroup (bench/squeeze_cgroup.py, run as a child
process): page cache filling the group is not pressure, an anonymous hog is, and the
cache grows back once the hog exits; tokens never change. Skips only where no child
cgroup can be made (no memory controller, no permission)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[3] / "bench" / "squeeze_cgroup.py"
MIB = 1 << 20


@pytest.mark.slow
def test_the_squeezer_reads_the_cgroup_it_runs_in(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--limit", "640M", "--budget", "64M"],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode == 77:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    phases = {p["phase"]: p for p in report["phases"]}
    limit, budget = report["limit_bytes"], report["budget_bytes"]
    # water marks relative to the cgroup's 640 MiB, not to the host's memory
    assert report["low_water_bytes"] == 32 * MIB and report["high_water_bytes"] == 64 * MIB
    start, cached, hog, gone = (phases[n] for n in ("start", "page cache", "hog", "hog gone"))
    assert start["reading"]["cgroup"]["limit_bytes"] == limit
    slot = report["slot_bytes"]
    full = budget // slot                          # the budget's slots; bytes differ once resized

    def slots(sizes):
        return [b // slot for b in sizes]
    assert slots(start["cache_bytes"])[-1] == full
    # 1. page cache charged to the group fills it, and is not mistaken for pressure
    c = cached["reading"]["cgroup"]
    assert c["usage_bytes"] > 0.8 * limit and c["page_cache_bytes"] > 0.5 * limit
    assert cached["reading"]["available_bytes"] > report["high_water_bytes"]
    if max(cached["reading"]["pressure_avg10"] or 0.0, 0.0) < report["pressure_avg10_threshold"]:
        assert slots(cached["cache_bytes"]) == [full] * len(cached["cache_bytes"])
    # 2. an anonymous hog is: the cache shrinks at once and the process gives memory back
    assert hog["available_bytes"][0] < report["low_water_bytes"]
    assert slots(hog["cache_bytes"])[0] < full
    assert hog["rss_bytes"] < cached["rss_bytes"] - (budget - hog["cache_bytes"][-1]) // 2
    # 3. the hog gone, the cache grows back to its budget, slowly
    sizes = slots(gone["cache_bytes"])
    assert sizes[-1] == full and sizes[0] < full
    assert all(b >= a for a, b in zip(sizes, sizes[1:]))
    assert all(p["tokens_unchanged"] for p in report["phases"])
