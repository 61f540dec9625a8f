"""daemon/machine/memory.py on fake /proc and cgroup trees, and once on this machine."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from daemon.machine.memory import MemoryReading, read_available_bytes, read_memory
from daemon.service.loading import (LOAD_BASE_BYTES, LOAD_BYTES_PER_VOCAB_TOKEN, MARGIN_FRACTION,
                                    plan_serving_memory, runtime_bytes, workspace_bytes)
from daemon.store.probe import model_target, probe_memory_bytes, run_iobench
from ext.models.config import load_config
from ext.models.families import kv_bytes_per_token
from ext.makemodel import make_model
from scheduler.planner import CgroupLimit, MemoryPlanError, available_bytes

GiB = 2**30
MiB = 2**20
V1_UNLIMITED = "9223372036854771712"  # what v1 writes when no limit is set
MOUNT_V2 = "41 23 0:38 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
MOUNT_V1_MEMORY = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
MOUNT_V1_CPU = "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def proc(root: Path, cgroup: str, mountinfo: str, mem_available_kb: int = 64 * 1024 * 1024) -> None:
    write(root, "proc/meminfo", f"MemTotal:       99999999 kB\nMemFree:         1000 kB\n"
                                f"MemAvailable:   {mem_available_kb} kB\nCached:  5 kB\n")
    write(root, "proc/self/cgroup", cgroup)
    write(root, "proc/self/mountinfo", mountinfo)


def v2_cgroup(root: Path, directory: str, max_: str | None = None, high: str | None = None,
              current: int | None = None, inactive_file: int | None = None) -> None:
    base = f"sys/fs/cgroup/{directory}".rstrip("/")
    for name, value in (("memory.max", max_), ("memory.high", high), ("memory.current", current)):
        if value is not None:
            write(root, f"{base}/{name}", f"{value}\n")
    if inactive_file is not None:
        write(root, f"{base}/memory.stat", f"anon 1\nfile 2\ninactive_anon 3\n"
                                           f"inactive_file {inactive_file}\nactive_file 4\n")


def v1_cgroup(root: Path, directory: str, limit: str, usage: int, total_inactive_file: int,
              hierarchical: str = V1_UNLIMITED) -> None:
    base = f"sys/fs/cgroup/memory/{directory}".rstrip("/")
    write(root, f"{base}/memory.limit_in_bytes", f"{limit}\n")
    write(root, f"{base}/memory.usage_in_bytes", f"{usage}\n")
    write(root, f"{base}/memory.stat", f"cache 1\ninactive_file 7\nhierarchical_memory_limit "
                                       f"{hierarchical}\ntotal_inactive_file {total_inactive_file}\n")


def v2_host(root: Path, cgroup_path: str = "/moed.slice/moed.service") -> None:
    proc(root, f"0::{cgroup_path}\n", MOUNT_V2)
    write(root, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")


def test_v2_limit_is_read_net_of_usage(tmp_path):
    v2_host(tmp_path)
    v2_cgroup(tmp_path, "moed.slice/moed.service", max_=str(8 * GiB), high="max",
              current=3 * GiB, inactive_file=0)
    reading = read_memory(tmp_path)
    assert reading.mem_available_bytes == 64 * GiB
    [limit] = reading.cgroup_limits  # the root and the slice have no memory.max
    assert limit.version == 2
    assert limit.path == str(tmp_path / "sys/fs/cgroup/moed.slice/moed.service")
    assert (limit.limit_bytes, limit.usage_bytes, limit.inactive_file_bytes) == (8 * GiB, 3 * GiB, 0)
    assert available_bytes(reading.mem_available_bytes, reading.cgroup_limits, None) == 5 * GiB


def test_v2_high_tighter_than_max_wins(tmp_path):
    v2_host(tmp_path)
    v2_cgroup(tmp_path, "moed.slice/moed.service", max_=str(8 * GiB), high=str(6 * GiB),
              current=GiB, inactive_file=0)
    [limit] = read_memory(tmp_path).cgroup_limits
    assert limit.limit_bytes == 6 * GiB


def test_v2_max_means_no_limit(tmp_path):
    v2_host(tmp_path)
    v2_cgroup(tmp_path, "moed.slice/moed.service", max_="max", high="max", current=GiB,
              inactive_file=0)
    reading = read_memory(tmp_path)
    [limit] = reading.cgroup_limits
    assert limit.limit_bytes is None
    assert available_bytes(reading.mem_available_bytes, reading.cgroup_limits, None) == 64 * GiB


def test_v2_nested_parent_tighter_than_child(tmp_path):
    v2_host(tmp_path)
    v2_cgroup(tmp_path, "moed.slice", max_=str(4 * GiB), current=3 * GiB, inactive_file=0)
    v2_cgroup(tmp_path, "moed.slice/moed.service", max_=str(16 * GiB), current=GiB,
              inactive_file=0)
    reading = read_memory(tmp_path)
    assert [(c.path.removeprefix(str(tmp_path)), c.limit_bytes) for c in reading.cgroup_limits] == [
        ("/sys/fs/cgroup/moed.slice/moed.service", 16 * GiB), ("/sys/fs/cgroup/moed.slice", 4 * GiB)]
    # the slice's siblings use 2 GiB of its 4: moed gets 1 GiB, not the child's 15
    assert available_bytes(reading.mem_available_bytes, reading.cgroup_limits, None) == GiB


def test_container_host_has_far_more_memory_than_the_limit(tmp_path):
    # cgroup namespace: the process sees itself at "/", the mount root is the container's
    proc(tmp_path, "0::/\n", MOUNT_V2, mem_available_kb=500 * 1024 * 1024)
    write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpu memory pids\n")
    v2_cgroup(tmp_path, "", max_=str(2 * GiB), current=512 * MiB, inactive_file=0)
    reading = read_memory(tmp_path)
    assert reading.mem_available_bytes == 500 * GiB
    assert available_bytes(reading.mem_available_bytes, reading.cgroup_limits, None) == 1536 * MiB


def test_the_available_figure_of_the_stats_is_bounded_by_the_cgroup(tmp_path):
    """/v1/moed/stats' memory.available_bytes: the host's MemAvailable, or the cgroup's
    headroom (limit - (usage - inactive_file)) when that is tighter; None when neither is
    known."""
    v1 = "4:memory:/moed.service\n"
    proc(tmp_path, v1, MOUNT_V1_MEMORY, mem_available_kb=64 * 1024 * 1024)
    v1_cgroup(tmp_path, "moed.service", str(320 * MiB), usage=250 * MiB,
              total_inactive_file=10 * MiB)
    assert read_available_bytes(tmp_path) == 80 * MiB
    proc(tmp_path, v1, MOUNT_V1_MEMORY, mem_available_kb=50 * 1024)      # the host is tighter
    assert read_available_bytes(tmp_path) == 50 * MiB
    bare = tmp_path / "bare"
    proc(bare, "0::/\n", "")
    (bare / "proc/meminfo").write_text("MemTotal: 1 kB\n")
    assert read_available_bytes(bare) is None


def test_reclaimable_page_cache_is_not_counted_as_used(tmp_path):
    v2_host(tmp_path)
    v2_cgroup(tmp_path, "moed.slice/moed.service", max_=str(8 * GiB), current=7 * GiB,
              inactive_file=5 * GiB)
    reading = read_memory(tmp_path)
    assert reading.cgroup_limits[0].inactive_file_bytes == 5 * GiB
    # 7 GiB "used", 5 of it inactive page cache: 8 - (7 - 5) = 6 GiB, not 1
    assert available_bytes(reading.mem_available_bytes, reading.cgroup_limits, None) == 6 * GiB


def test_v1_unlimited(tmp_path):
    proc(tmp_path, "4:memory:/user.slice\n1:cpu,cpuacct:/\n", MOUNT_V1_CPU + MOUNT_V1_MEMORY)
    v1_cgroup(tmp_path, "user.slice", V1_UNLIMITED, usage=GiB, total_inactive_file=0)
    v1_cgroup(tmp_path, "", V1_UNLIMITED, usage=9 * GiB, total_inactive_file=0)
    reading = read_memory(tmp_path)
    assert [(c.version, c.limit_bytes, c.usage_bytes) for c in reading.cgroup_limits] == [
        (1, None, GiB), (1, None, 9 * GiB)]
    assert available_bytes(reading.mem_available_bytes, reading.cgroup_limits, None) == 64 * GiB


def test_v1_limit_with_combined_controllers_and_hierarchical_limit(tmp_path):
    mount = "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,cpu,memory\n"
    proc(tmp_path, "3:cpu,memory:/docker/abc\n", mount)
    # the child's own file says 8 GiB; an ancestor outside the visible tree caps it at 3
    v1_cgroup(tmp_path, "docker/abc", str(8 * GiB), usage=2 * GiB,
              total_inactive_file=GiB, hierarchical=str(3 * GiB))
    reading = read_memory(tmp_path)
    first = reading.cgroup_limits[0]
    assert (first.version, first.limit_bytes, first.usage_bytes, first.inactive_file_bytes) == (
        1, 3 * GiB, 2 * GiB, GiB)
    assert available_bytes(reading.mem_available_bytes, reading.cgroup_limits, None) == 2 * GiB


def test_hybrid_host_uses_v1_when_cgroup2_lacks_memory(tmp_path):
    # this machine's layout: "0::/" plus a cgroup2 mount without memory, memory on v1
    unified = "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    proc(tmp_path, "4:memory:/process_api/x\n1:cpu:/\n0::/\n",
         "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n" + MOUNT_V1_CPU + MOUNT_V1_MEMORY + unified)
    write(tmp_path, "sys/fs/cgroup/unified/cgroup.controllers", "\n")
    write(tmp_path, "sys/fs/cgroup/unified/memory.max", f"{GiB}\n")  # a decoy: not the memory tree
    v1_cgroup(tmp_path, "process_api/x", str(4 * GiB), usage=GiB, total_inactive_file=0)
    v1_cgroup(tmp_path, "process_api", V1_UNLIMITED, usage=GiB, total_inactive_file=0)
    v1_cgroup(tmp_path, "", V1_UNLIMITED, usage=GiB, total_inactive_file=0)
    reading = read_memory(tmp_path)
    assert [c.path.removeprefix(str(tmp_path)) for c in reading.cgroup_limits] == [
        "/sys/fs/cgroup/memory/process_api/x", "/sys/fs/cgroup/memory/process_api",
        "/sys/fs/cgroup/memory"]
    assert {c.version for c in reading.cgroup_limits} == {1}
    assert available_bytes(reading.mem_available_bytes, reading.cgroup_limits, None) == 3 * GiB


def test_missing_files_never_crash(tmp_path):
    reading = read_memory(tmp_path)  # an empty tree
    assert (reading.mem_available_bytes, reading.cgroup_limits) == (None, ())
    # a cgroup whose limit file is missing is skipped; one with only a limit is kept
    v2_host(tmp_path)
    v2_cgroup(tmp_path, "moed.slice", max_=str(4 * GiB))
    (tmp_path / "sys/fs/cgroup/moed.slice/moed.service").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 1 kB\n")
    reading = read_memory(tmp_path)
    assert reading.mem_available_bytes is None
    [limit] = reading.cgroup_limits
    assert (limit.limit_bytes, limit.usage_bytes, limit.inactive_file_bytes) == (4 * GiB, None, None)
    assert available_bytes(reading.mem_available_bytes, reading.cgroup_limits, None) == 4 * GiB


def test_garbage_and_truncated_files_are_unknown(tmp_path):
    proc(tmp_path, "garbage\n0::/a\n", "bad line\n" + MOUNT_V2)
    write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "memory\n")
    v2_cgroup(tmp_path, "a", max_="not-a-number", high=str(GiB), current=None)
    write(tmp_path, "sys/fs/cgroup/a/memory.current", "\n")
    [limit] = read_memory(tmp_path).cgroup_limits
    assert (limit.limit_bytes, limit.usage_bytes) == (GiB, None)


def test_this_machine():
    reading = read_memory()
    assert reading.mem_available_bytes is not None and reading.mem_available_bytes > 0
    assert all(c.version in (1, 2) for c in reading.cgroup_limits)
    assert 0 <= available_bytes(reading.mem_available_bytes, reading.cgroup_limits, None) \
        <= reading.mem_available_bytes


# ------------------------------------------------------------ the plan for serving

@pytest.fixture(scope="module")
def planned_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("plan") / "m", arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=64, intermediate=32)


def test_the_serving_plan_streams_only_what_does_not_fit(planned_model):
    roomy = plan_serving_memory(planned_model, max_concurrent_sequences=4, pin_fraction=0.5,
                                reading=MemoryReading(64 << 30, ()))
    assert not roomy.stream                              # every expert fits: memory-mapped
    p = roomy.plan
    assert p.expert_cache_bytes == p.available_bytes - p.dense_bytes - p.kv_bytes - p.runtime_bytes \
        - p.margin_bytes - (p.available_bytes - p.dense_bytes - p.kv_bytes - p.runtime_bytes
                            - p.margin_bytes) % p.slot_bytes
    # a cgroup limit far below MemAvailable binds: now the experts must stream
    fixed = p.dense_bytes + p.kv_bytes + p.runtime_bytes
    tight_limit = int((fixed + 6 * p.slot_bytes) / 0.95) + 1
    tight = plan_serving_memory(planned_model, max_concurrent_sequences=4, pin_fraction=0.5,
                                reading=MemoryReading(64 << 30, (CgroupLimit("/x", 2, tight_limit, 0, 0),)))
    assert tight.stream and tight.plan.total_slots >= 4 and tight.plan.total_slots < 16


def test_the_serving_plan_refuses_with_the_numbers(planned_model):
    with pytest.raises(MemoryPlanError, match=r"needs at least \d+ B to start .* 4 sequences"):
        plan_serving_memory(planned_model, max_concurrent_sequences=4, pin_fraction=0.5,
                            reading=MemoryReading(20 << 20, ()))


def test_the_refusal_names_the_context_that_fits(planned_model):
    """Where one sequence at the 2048-token floor does not fit but one of 512 tokens does
    (the 350 MiB cgroup of the report): the refusal names max_context_tokens with a value
    and its bytes, not "no key lowers that", and that value then plans."""
    def plan(available, **keys):       # no compile workers' reserve: the KV decides
        return plan_serving_memory(planned_model, max_concurrent_sequences=4, pin_fraction=0,
                                   threads=1, reading=MemoryReading(available, ()),
                                   grammar_compile_memory_bytes=0, **keys)
    small = plan(64 << 30, max_context_tokens=512).plan
    available = int((small.minimum_bytes - small.margin_bytes) / (1 - MARGIN_FRACTION)) + (64 << 10)
    with pytest.raises(MemoryPlanError) as error:
        plan(available)
    message = str(error.value)
    assert "no key lowers" not in message
    found = re.search(r"max_context_tokens (\d+) \(the context counted: 2048 tokens\) lowers "
                      r"it by (\d+) B, enough", message)
    assert found, message
    tokens = int(found.group(1))
    assert 512 <= tokens < 2048
    fits = plan(available, max_context_tokens=tokens).plan
    assert fits.context_tokens == tokens and fits.minimum_bytes <= available


def test_the_serving_plan_measures_its_reserve_and_cuts_context_and_prefix_cache(planned_model):
    """The runtime comes from the config (no fixed 512 MiB), the prefix cache takes only a
    share of what is left, and in a tight room the context and then the sequences are cut
    before the plan refuses; an operator's max_concurrent_sequences is not cut."""
    config = load_config(planned_model)
    roomy = plan_serving_memory(planned_model, max_concurrent_sequences=4, pin_fraction=0.5,
                                reading=MemoryReading(64 << 30, ()), prefix_cache_bytes=512 << 20,
                                threads=2)
    p = roomy.plan
    assert p.runtime_bytes == runtime_bytes(config, threads=2, context=roomy.context, sequences=4,
                                            slot_bytes=p.slot_bytes, grammar_bytes=roomy.grammar_bytes)
    assert p.runtime_bytes - roomy.grammar_bytes < 64 << 20   # a tiny model: no 512 MiB reserve
    assert p.prefix_cache_bytes == 512 << 20 and roomy.context == min(8192, config.max_position_embeddings)
    per_token = kv_bytes_per_token(config)
    floor = min(2048, config.max_position_embeddings)
    # without the compile workers' reserve (grammar_compile_memory_bytes 0)
    base = p.dense_bytes + p.runtime_bytes - roomy.grammar_bytes + p.min_dynamic_slots * p.slot_bytes
    # room for 2 sequences at the floor (and the 5 % margin): 2 sequences, 0-B prefix cache
    available = int((base + 2 * floor * per_token + 1000) / 0.95)
    tight = plan_serving_memory(planned_model, max_concurrent_sequences=4, pin_fraction=0.5,
                                reading=MemoryReading(available, ()), prefix_cache_bytes=512 << 20,
                                threads=2, grammar_compile_memory_bytes=0)
    t = tight.plan
    assert (t.max_concurrent_sequences, t.context_tokens) == (2, floor)
    assert t.prefix_cache_bytes < 1000 and t.total_slots == t.min_dynamic_slots
    with pytest.raises(MemoryPlanError, match="lower max_concurrent_sequences by 2, from 4 to 2"):
        plan_serving_memory(planned_model, max_concurrent_sequences=4, pin_fraction=0.5,
                            reading=MemoryReading(available, ()), threads=2, sequences_fixed=True,
                            grammar_compile_memory_bytes=0)
    # with it (1 GiB configured), where only the plan without it fits: dropped, not refused
    text_only = plan_serving_memory(planned_model, max_concurrent_sequences=4, pin_fraction=0.5,
                                    reading=MemoryReading(available, ()), threads=2)
    assert text_only.grammar_bytes == 0 and text_only.plan.runtime_bytes == t.runtime_bytes


def _peak_rss_growth(run) -> int:
    """How far `run()` raises this process's peak RSS above its RSS before, in bytes."""
    def status(key: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                    if x.startswith(key))
        return int(line.split()[1]) * 1024
    Path("/proc/self/clear_refs").write_text("5")           # VmHWM := VmRSS
    before = status("VmRSS:")
    run()
    return status("VmHWM:") - before


def test_the_serving_plan_reserves_what_the_idle_storage_probe_adds(tmp_path):
    """The daemon probes its disk when idle after READY, with every cache full: the plan's
    runtime holds the probe's arena and workers, and a real probe run over the model's
    experts adds no more than that to the process."""
    model = make_model(tmp_path / "m", arch="qwen3_moe", layers=2, experts=8, top_k=2,
                       hidden=256, intermediate=384)
    config = load_config(model)
    served = plan_serving_memory(model, max_concurrent_sequences=1, pin_fraction=0.5,
                                 reading=MemoryReading(64 << 30, ()), threads=2)
    p = served.plan
    without_probe = (LOAD_BASE_BYTES + LOAD_BYTES_PER_VOCAB_TOKEN * config.vocab_size
                     + workspace_bytes(config, threads=2, context=served.context, sequences=1)
                     + served.grammar_bytes)
    target = model_target(model)
    assert target.block_bytes <= p.slot_bytes
    assert p.runtime_bytes - without_probe == probe_memory_bytes(p.slot_bytes)
    assert probe_memory_bytes(p.slot_bytes) >= 16 * p.slot_bytes      # 16 reads in flight
    grown = _peak_rss_growth(lambda: run_iobench(target, seconds=1.0, repeats=2))
    assert 0 < grown <= probe_memory_bytes(target.block_bytes), (grown, target.block_bytes)


def test_the_serving_plan_counts_the_stored_bytes_of_lowbit_weights(tmp_path):
    """FP8 experts and attention: the plan's dense part and slots are FP8 bytes plus
    scales, not the bf16 sizes of the same model."""
    kw = dict(arch="qwen3_moe", layers=2, experts=8, top_k=2, hidden=256, intermediate=128)
    bf16, fp8 = make_model(tmp_path / "b", **kw), make_model(tmp_path / "f", dtype="fp8", **kw)
    reading = MemoryReading(64 << 30, ())
    b, f = (plan_serving_memory(d, max_concurrent_sequences=1, pin_fraction=0.5, reading=reading)
            for d in (bf16, fp8))
    # a bf16 expert is 3 x 128 x 256 x 2 bytes = 48 pages (49 when it starts mid-page);
    # FP8 is half, plus a page of block scales (the safetensors layout puts the F32 scales
    # apart from the codes) and one for an unaligned start
    assert b.plan.slot_bytes in (48 * 4096, 49 * 4096)
    assert 25 * 4096 <= f.plan.slot_bytes <= 26 * 4096
    assert (b.all_experts_bytes, f.all_experts_bytes) == (16 * b.plan.slot_bytes, 16 * f.plan.slot_bytes)
    # attention q, k, v, o (256 x 256, 2 x 128 x 256, 256 x 256) per layer: half, plus
    # the 2 x 2, 1 x 2, 1 x 2, 2 x 2 F32 scale grids
    attention = 256 * 256 + 2 * 128 * 256 + 256 * 256
    assert b.plan.dense_bytes - f.plan.dense_bytes == 2 * (attention - 12 * 4)


def test_the_live_system_is_read_through_psutil():
    import os

    import psutil

    from daemon.machine.memory import read_mem_available, read_mem_total
    from daemon.machine.system import mem_total_bytes, usable_cpus
    assert read_mem_total() == psutil.virtual_memory().total == mem_total_bytes()
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    assert read_mem_total() == int(meminfo["MemTotal"].split()[0]) * 1024
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    assert abs(read_mem_available() - available) < 0.1 * read_mem_total()   # it moves
    assert usable_cpus() == len(os.sched_getaffinity(0))


def test_the_plan_reserves_the_grammar_compile_workers(planned_model):
    """The runtime holds, for each of the 2 compile slots, a worker's start (measured:
    32 MiB + 576 B a vocabulary token + 3 B a tokenizer.json byte) and 16 MiB for its
    compiles, at most grammar_compile_memory_bytes; the runtime grows by just that."""
    from daemon.workers import grammar
    config = load_config(planned_model)
    tokenizer_bytes = (planned_model / "tokenizer.json").stat().st_size
    floor = (32 << 20) + 576 * config.vocab_size + 3 * tokenizer_bytes
    assert grammar.worker_floor_bytes(config.vocab_size, tokenizer_bytes) == floor

    def planned(**keys):
        return plan_serving_memory(planned_model, max_concurrent_sequences=4, pin_fraction=0,
                                   threads=1, reading=MemoryReading(64 << 30, ()), **keys)
    roomy = planned()                                    # grammar_compile_memory_bytes 1 GiB
    assert roomy.grammar_bytes == 2 * (floor + (16 << 20))
    capped = planned(grammar_compile_memory_bytes=20 << 20)
    assert capped.grammar_bytes == 2 * (20 << 20)
    assert roomy.plan.runtime_bytes - capped.plan.runtime_bytes == 2 * (floor + (16 << 20) - (20 << 20))
