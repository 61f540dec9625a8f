"""The squeezer in a real memory-limited cgroup: page cache is not pressure, an anonymous
hog is, and the cache grows back when it leaves.

    python bench/squeeze_cgroup.py [--model DIR] [--limit 640M] [--budget 64M]

Creates a child cgroup of this process's own (cgroup v1 memory controller or v2 with
memory enabled) with the limit, runs the scenario below in a child process inside it, and
removes the group. Prints one JSON object: each phase's readings (the cgroup's limit,
usage, page cache and the available memory the squeezer saw, PSI), the cache sizes it
chose and the RSS the process held. Exits 77 when no child cgroup can be made here
(no memory controller, no permission); tests/daemon/machine/test_squeeze_cgroup.py runs it.

Scenario (the child, after joining the group; readings are real, taken with
`daemon.machine.squeeze.system_feed`):
  1. start  a model (default: written by `make-model` into a temporary directory, 96 MiB
            of experts) served through a cache of --budget; a few tokens fill it.
  2. cache  a file of 1.25 x the limit is read through the page cache, which the cgroup is
            charged for: its usage nears the limit; the squeezer must not shrink (no PSI).
  3. hog    a child process in the group allocates and touches anonymous memory until
            the memory left is 3/4 of the low water mark: the cache must shrink, and RSS
            fall.
  4. gone   the hog exits: after calm readings the cache grows back to its budget.
The tokens generated after every phase equal those of the first (placement only).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

EXIT_SKIP = 77
MIB = 1 << 20


def _own_group() -> tuple[int, Path] | None:
    """(version, directory) of this process's memory cgroup, or None."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            return 1, base / path.lstrip("/")
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0":
            base = Path("/sys/fs/cgroup")
            directory = base / path.lstrip("/")
            if "memory" in (directory / "cgroup.controllers").read_text().split():
                return 2, directory
    return None


def make_group(limit: int) -> tuple[int, Path]:
    """A child cgroup with `limit` bytes; raises OSError when it cannot be made."""
    found = _own_group()
    if found is None:
        raise OSError("no memory cgroup controller for this process")
    version, parent = found
    group = parent / f"moed-squeeze-{os.getpid()}"
    group.mkdir()
    try:
        if version == 1:
            (group / "memory.limit_in_bytes").write_text(str(limit))
        else:
            (group / "memory.max").write_text(str(limit))
    except OSError:
        group.rmdir()
        raise
    return version, group


def remove_group(group: Path) -> None:
    for _ in range(100):
        try:
            group.rmdir()
            return
        except OSError:
            procs = (group / "cgroup.procs").read_text().split()
            for pid in procs:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if procs:
                os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


HOG = """
import sys
size = int(sys.argv[1])
block = bytearray(size)
for i in range(0, size, 4096):
    block[i] = 1
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.read()
"""


def scenario(group: Path, model_dir: str, budget: int, limit: int, scratch: Path) -> dict:
    """The child's part (it has joined `group`): the four phases, their figures."""
    from daemon.machine.squeeze import MemoryWatcher, system_feed
    from daemon.store.session import open_model
    from daemon.store.streaming import minimum_cache_bytes
    from ext.generate import Generation
    from ext.sampling import SamplingParams

    def generate(model, n=32):
        return list(Generation(model, [1, 2, 3, 4], max_tokens=n,
                               sampling=SamplingParams(temperature=0.7, seed=7)))

    model, session = open_model(model_dir, threads=1, cache_bytes=budget, prefetch=False,
                                state_dir=scratch / "state")
    watcher = MemoryWatcher(session, budget, minimum_cache_bytes(model.layout, model.config),
                            run_on_engine=lambda fn: fn(), feed=system_feed)
    phases = []

    def phase(name: str, readings: int, **extra) -> None:
        sizes, available = [], []
        for _ in range(readings):
            watcher.check()
            sizes.append(session.options.cache_bytes)
            available.append(watcher.last.available_bytes)
        phases.append({"phase": name, "cache_bytes": sizes, "available_bytes": available,
                       "rss_bytes": rss_bytes(), "reading": watcher.last.to_dict(),
                       "tokens_unchanged": generate(model) == expected, **extra})

    expected = generate(model, 32)
    p = watcher.squeeze.policy
    phase("start", 2)
    big = scratch / "page-cache.bin"
    with open(big, "wb") as f:                       # written outside the page cache's way
        chunk = os.urandom(MIB)
        for _ in range(int(1.25 * limit) // MIB):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    with open(big, "rb") as f:                       # read back: page cache charged to us
        while f.read(8 * MIB):
            pass
    phase("page cache", 3)
    big.unlink()
    available = system_feed().available_bytes
    hog_bytes = max(0, available - 3 * p.low_water_bytes // 4)
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(hog_bytes)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    assert hog.stdout.readline().strip() == "ready"
    phase("hog", 2, hog_bytes=hog_bytes)
    hog.stdin.close()
    hog.wait()
    phase("hog gone", 40)
    model.close()
    return {"limit_bytes": limit, "budget_bytes": budget, "slot_bytes": session.provider.slot_bytes,
            "low_water_bytes": p.low_water_bytes,
            "high_water_bytes": p.high_water_bytes, "pressure_avg10_threshold": p.pressure_avg10,
            "phases": phases}


def fs_type(path: str) -> str:
    """The filesystem type of the mount holding `path` (/proc/self/mountinfo)."""
    path, best, kind = os.path.realpath(path), "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        point = fields.split()[4].replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, tail.split()[0]
    return kind


def scratch_parent() -> str | None:
    """Where the page-cache file may go: a writable directory whose file pages are page
    cache (not tmpfs or ramfs, whose pages are memory the group cannot reclaim and would
    be killed for); /var/tmp first, since /tmp is a tmpfs on many machines."""
    for d in ("/var/tmp", tempfile.gettempdir()):
        if os.path.isdir(d) and os.access(d, os.W_OK) and fs_type(d) not in ("tmpfs", "ramfs"):
            return d
    return None


def main(argv=None) -> int:
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(description=doc[0], epilog=doc[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="model directory (default: a make-model checkpoint of 96 MiB of experts)")
    parser.add_argument("--limit", default="640M", help="the cgroup's memory limit (default 640M)")
    parser.add_argument("--budget", default="64M", help="the expert cache budget (default 64M)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from daemon.commands.args import size
    limit, budget = size(args.limit), size(args.budget)
    if args.child:                                   # inside the group
        group = Path(args.child)
        (group / "cgroup.procs").write_text(str(os.getpid()))
        with tempfile.TemporaryDirectory(prefix="moed-squeeze-", dir=scratch_parent()) as scratch:
            print(json.dumps(scenario(group, args.model, budget, limit, Path(scratch))))
        return 0
    if scratch_parent() is None:
        print("squeeze_cgroup: no writable directory outside tmpfs for the page-cache file "
              "(/var/tmp and the temporary directory are tmpfs)", file=sys.stderr)
        return EXIT_SKIP
    try:
        version, group = make_group(limit)
    except OSError as e:
        print(f"squeeze_cgroup: cannot make a child cgroup here: {e}", file=sys.stderr)
        return EXIT_SKIP
    try:
        with tempfile.TemporaryDirectory(prefix="moed-squeeze-model-") as tmp:
            model = args.model
            if model is None:
                from ext.makemodel import make_model
                model = str(make_model(Path(tmp) / "model", arch="qwen3_moe", layers=4, experts=32,
                                       top_k=2, hidden=256, intermediate=512, routing_skew=1.0, seed=5))
            proc = subprocess.run([sys.executable, __file__, "--child", str(group), "--model", model,
                                   "--limit", str(limit), "--budget", str(budget)],
                                  capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        report.update(cgroup_version=version, cgroup=str(group))
        print(json.dumps(report, indent=2))
        return 0
    finally:
        remove_group(group)


if __name__ == "__main__":
    sys.exit(main())
