"""bench/provider_overhead.py: the routing it records is the model's own, and a run
reports both modes' CPU per step with the options it was given."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ext.makemodel import make_model
from ext.models.config import load_config

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import provider_overhead  # noqa: E402


def _model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "m", arch="qwen3_moe", layers=3, experts=8, top_k=2, hidden=64,
                      intermediate=32, dtype="bf16", seed=4, initializer_range=0.2)


def test_the_recorded_routing_is_one_entry_per_moe_layer_and_step(tmp_path):
    model_dir = _model(tmp_path)
    config = load_config(model_dir)
    steps = provider_overhead.record_routing(str(model_dir), [1, 2, 3, 4], 6)
    assert len(steps) == 6
    for step in steps:
        assert [layer for layer, _ in step] == [i for i, moe in enumerate(config.moe_layers) if moe]
        for _, experts in step:
            assert len(experts) == config.top_k and experts == sorted(set(experts))
            assert all(0 <= e < config.num_experts for e in experts)
    # Sampled with a fixed seed: the same routing again.
    assert provider_overhead.record_routing(str(model_dir), [1, 2, 3, 4], 6) == steps


def test_a_run_reports_both_modes_per_step_with_its_options(tmp_path):
    model_dir = _model(tmp_path)
    out = subprocess.run([sys.executable, str(BENCH / "provider_overhead.py"), "--model", str(model_dir),
                          "--expert-cache-bytes", "128K", "--tokens", "16", "--rounds", "2",
                          "--options", '{"warm_start": false}'],
                         capture_output=True, text=True, check=True, timeout=300)
    report = json.loads(out.stdout)
    assert report["options"] == {"warm_start": False}
    assert report["steps_replayed"] == 8 and report["rounds"] == 2
    for mode in ("naive_us_per_step", "moed_us_per_step"):
        assert len(report[mode]["runs"]) == 2 and report[mode]["median"] > 0
    assert set(report["hit_rate"]) == {"naive", "moed"}
    assert 0.0 <= report["hit_rate"]["naive"] <= 1.0


def test_a_budget_below_the_minimum_is_refused_naming_the_option(tmp_path):
    model_dir = _model(tmp_path)
    out = subprocess.run([sys.executable, str(BENCH / "provider_overhead.py"), "--model", str(model_dir),
                          "--expert-cache-bytes", "64K", "--tokens", "8", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--expert-cache-bytes" in out.stderr and "minimum" in out.stderr
