"""ext/formats/_guarded_map.pyx: a file cut under a GuardedMap reads zeros and counts a
fault; any other SIGBUS still ends the process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ext.formats._guarded_map import GuardedMap

PAGE = os.sysconf("SC_PAGE_SIZE")


def test_a_file_cut_under_the_map_reads_zeros_and_counts_a_fault(tmp_path):
    path = tmp_path / "shard"
    data = np.random.default_rng(0).integers(1, 256, 4 * PAGE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        m = GuardedMap(fd, 4 * PAGE)
        view = np.frombuffer(m, np.uint8)
        assert not view.flags.writeable and len(m) == 4 * PAGE
        assert np.array_equal(view, data) and m.faults == 0
        os.truncate(path, PAGE + 100)
        assert np.array_equal(view[:PAGE + 100], data[:PAGE + 100])   # what is left reads
        assert m.faults == 0
        assert np.count_nonzero(view[PAGE + 100:]) == 0                # the rest is zeros
        assert m.faults == 1                                          # one fault zeroed it all
        del m                                        # the view keeps the mapping alive
        assert np.count_nonzero(view[:PAGE]) == np.count_nonzero(data[:PAGE])
        with pytest.raises(TypeError, match="read-only"):
            memoryview(GuardedMap(fd, PAGE))[0:1] = b"x"
        with pytest.raises(ValueError):
            GuardedMap(fd, 0)
    finally:
        os.close(fd)


def test_a_sigbus_outside_every_guarded_map_still_ends_the_process(tmp_path):
    script = f"""
import mmap, os
from ext.formats._guarded_map import GuardedMap
path = {str(tmp_path / "f")!r}
open(path, "wb").write(b"x" * {4 * PAGE})
fd = os.open(path, os.O_RDONLY)
guarded = GuardedMap(fd, {4 * PAGE})
plain = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
os.truncate(path, 10)
print(plain[{3 * PAGE}])
"""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    env.pop("PYTHONFAULTHANDLER", None)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert run.returncode == -signal.SIGBUS, run.stderr
