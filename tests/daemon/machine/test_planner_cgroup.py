"""The memory planner in a real memory-limited cgroup: `moed serve` without an expert
cache size starts where the old planner (a fixed 512 MiB runtime, the whole 512 MiB prefix
cache, 4 sequences of 8192 tokens) refused, streams experts several times larger than its
cache, and the group's peak usage stays within what the plan reserved; its stats report
the memory the group leaves, not the host's; structured output works where the plan
reserved its compile workers, and where it could not the daemon starts and says so.
Skips only where
no child cgroup can be made (no memory controller, no permission); the cgroup helpers are
bench/squeeze_cgroup.py's."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
from daemon_proc import Daemon, short_dir

from ext.makemodel import make_model

MIB = 1 << 20
LIMIT = 256 * MIB
OLD_RUNTIME = OLD_PREFIX = 512 * MIB          # what the old plan reserved besides the KV
OLD_CONTEXT, OLD_SEQUENCES = 8192, 4


def _cgroup_helpers():
    path = Path(__file__).parents[3] / "bench" / "squeeze_cgroup.py"
    spec = importlib.util.spec_from_file_location("squeeze_cgroup", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _peak_bytes(version: int, group: Path) -> int | None:
    name = "memory.max_usage_in_bytes" if version == 1 else "memory.peak"
    try:
        return int((group / name).read_text())
    except (OSError, ValueError):
        return None


def test_the_daemon_starts_in_a_cgroup_the_old_plan_refused(tmp_path):
    helpers = _cgroup_helpers()
    try:
        version, group = helpers.make_group(LIMIT)
    except OSError as e:
        pytest.skip(f"cannot make a child memory cgroup here: {e}")
    # 4 layers x 32 experts of 3 x 512 x 768 bf16 (2.25 MiB): 288 MiB of experts in 256 MiB
    model = make_model(tmp_path / "m", arch="qwen3_moe", layers=4, experts=32, top_k=2,
                       hidden=512, intermediate=768, seed=3)
    workdir = short_dir()
    daemon = None
    try:
        daemon = Daemon(model, workdir, "--threads", "1",
                        launcher=("sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group)))
        plan = daemon.wait_event("memory_plan")
        assert plan["experts"] == "streamed"
        # the old plan: dense + KV of 4 x 8192 tokens + 512 MiB runtime + the 512 MiB
        # prefix cache + the margin did not fit
        old = (plan["dense_bytes"] + OLD_SEQUENCES * OLD_CONTEXT * plan["kv_bytes_per_token"]
               + OLD_RUNTIME + OLD_PREFIX + plan["margin_bytes"])
        assert old > plan["available_bytes"]
        assert plan["all_experts_bytes"] > 3 * plan["expert_cache_bytes"]
        assert plan["expert_cache_bytes"] >= plan["expert_cache_minimum_bytes"]
        assert plan["prefix_cache_bytes"] <= plan["prefix_cache_configured_bytes"]
        assert plan["kv_bytes"] == (plan["max_concurrent_sequences"] * plan["kv_context_tokens"]
                                    * plan["kv_bytes_per_token"])
        status, answer = daemon.json("POST", "/v1/completions", {
            "prompt": "the planner measures " * 40, "max_tokens": 24, "n": 2,
            "temperature": 0, "ignore_eos": True})
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 48
        # the compile workers' reserve does not fit beside this model: dropped (text only,
        # and a warning saying why), never a refusal to start
        assert plan["grammar_compile_reserve_bytes"] == 0
        warned = daemon.wait_event("grammar_unavailable")
        assert warned["memory_bytes"] < warned["worker_floor_bytes"], warned
        peak = _peak_bytes(version, group)
        assert daemon.stop() == 0
        if peak is not None:
            # what the group held at its peak fits in what the plan counted (the group's
            # usage when it planned, then dense, runtime, KV, prefix and expert cache),
            # the margin unused
            before = LIMIT - plan["available_bytes"]
            reserved = before + sum(plan[k] for k in ("dense_bytes", "runtime_bytes", "kv_bytes",
                                                      "prefix_cache_bytes", "expert_cache_bytes"))
            print(f"cgroup peak {peak} B; planned {reserved} B (+ margin {plan['margin_bytes']} B)")
            assert peak <= reserved, (peak, reserved, plan)
    finally:
        if daemon is not None:
            daemon.cleanup()
        helpers.remove_group(group)
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_stats_report_the_memory_the_cgroup_leaves(tmp_path):
    """/v1/moed/stats in a 256 MiB cgroup on a host with more available: memory.
    available_bytes is the cgroup's headroom, not the host's MemAvailable."""
    import psutil
    helpers = _cgroup_helpers()
    try:
        version, group = helpers.make_group(LIMIT)
    except OSError as e:
        pytest.skip(f"cannot make a child memory cgroup here: {e}")
    if psutil.virtual_memory().available <= LIMIT:
        helpers.remove_group(group)
        pytest.skip("the host has less memory available than the cgroup's limit")
    model = make_model(tmp_path / "m", arch="qwen3_moe", layers=2, experts=8, top_k=2,
                       hidden=64, intermediate=32, seed=3)
    workdir = short_dir()
    daemon = None
    try:
        daemon = Daemon(model, workdir, "--threads", "1",
                        launcher=("sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group)))
        status, stats = daemon.json("GET", "/v1/moed/stats")
        assert status == 200, stats
        usage = int((group / ("memory.usage_in_bytes" if version == 1 else "memory.current")).read_text())
        available = stats["memory"]["available_bytes"]
        assert 0 < available <= LIMIT
        # the headroom counts the group's reclaimable page cache as free, as MemAvailable does
        assert available >= LIMIT - usage - 16 * MIB, (available, LIMIT - usage)
        # structured output works in this cgroup: the plan reserved its compile workers
        # (before, their cap was half the margin, ~6 MiB: every response_format was a 400
        # saying a worker "did not start within 60 s")
        plan = daemon.wait_event("memory_plan")
        assert plan["grammar_compile_reserve_bytes"] > 0
        status, answer = daemon.json("POST", "/v1/completions", {
            "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0,
            "response_format": {"type": "json_object"}})
        assert status == 200, answer
        assert answer["choices"][0]["text"].startswith("{"), answer
        assert daemon.stop() == 0
    finally:
        if daemon is not None:
            daemon.cleanup()
        helpers.remove_group(group)
        shutil.rmtree(workdir, ignore_errors=True)
