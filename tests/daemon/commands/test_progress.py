"""Long commands show progress on a terminal and nothing in logs; bench and tune say
plainly whether a difference stands out of the noise."""
from __future__ import annotations

import errno
import io
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.commands.args import Progress
from daemon.commands.figures import compare, spread

MOED = str(Path(sys.executable).with_name("moed"))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_bar_with_rate_and_time_left_on_a_terminal(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    p = Progress("writing m", unit="B")
    p(512 << 10, 2 << 20)
    p.note("half way")
    p(2 << 20, 2 << 20)
    out = term.getvalue()
    assert "writing m" in out and "100%" in out and "2.00M/2.00M" in out
    assert "writing m: half way" in out
    assert "<" in out              # tqdm's elapsed<remaining estimate


def test_progress_is_silent_when_stderr_is_not_a_terminal(monkeypatch):
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    p = Progress("bench runs", unit="run")
    p(1, 4)
    p.note("something")
    p(4, 4)
    p.close()
    assert piped.getvalue() == ""


def _run_with_stderr_on_a_pty(args: list[str]) -> tuple[int, str, str]:
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    proc = subprocess.Popen([MOED, *args], stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError as e:               # EIO: the other end is closed
            if e.errno != errno.EIO:
                raise
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    out = proc.stdout.read()
    proc.stdout.close()
    return proc.wait(timeout=120), out.decode(), err.decode(errors="replace")


def test_iobench_shows_its_passes_on_a_terminal_and_only_logs_when_piped(tmp_path):
    args = ["iobench", "--file", str(tmp_path / "scratch"), "--size", "4M", "--seconds", "2",
            "--state-dir", str(tmp_path / "state")]
    code, out, err = _run_with_stderr_on_a_pty(args)
    assert code == 0 and json.loads(out)["results"]
    assert "iobench passes" in err and "pass/s" in err and "100%" in err
    piped = subprocess.run([MOED, *args], capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0
    assert "iobench passes" not in piped.stderr and "%|" not in piped.stderr


def test_the_issue_s_bench_runs_are_called_noise():
    """moed [41.0, 21.1, 31.2] against naive [24.2, 44.3, 16.9]: 1.29 by the medians."""
    v = compare([41.0, 21.1, 31.2], [24.2, 44.3, 16.9], "moed", "naive")
    assert v["ratio"] == pytest.approx(31.2 / 24.2, abs=1e-3)
    assert v["significant"] is False
    assert v["verdict"].startswith("within the noise") and "pairs disagree" in v["verdict"]


def test_a_clear_difference_is_called_one_and_too_few_runs_are_not():
    v = compare([30.0, 31.0, 29.5, 30.5], [20.0, 21.0, 19.0, 20.5], "moed", "naive")
    assert v["significant"] is True and v["verdict"].startswith("moed is 1.49x naive")
    overlap = compare([30.0, 22.5, 31.0], [21.0, 22.0, 23.0], "a", "b")
    assert overlap["significant"] is False and "the runs overlap" in overlap["verdict"]
    one = compare([30.0], [20.0], "a", "b")
    assert one["significant"] is False and "1 pair(s)" in one["verdict"]
    assert spread([1.0, 2.0, 3.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                        "relative_spread": 1.0, "runs": [1.0, 2.0, 3.0]}
