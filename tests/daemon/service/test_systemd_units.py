"""systemd/moed.socket and systemd/moed.service: `systemd-analyze verify` accepts them with
no warning at all, and they carry the settings the daemon relies on.

systemd-analyze comes from Debian's systemd package, which the test run installs when it
may (tests/tools.py); where it cannot, the tests that run it skip saying so, and under
MOED_TEST_TOOLS=require (CI) they fail instead.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tools

from daemon.service.config import DEFAULT_CONFIG_PATH, ServeConfig

ROOT = Path(__file__).resolve().parents[3]
UNITS = ROOT / "systemd"
INSTALLED_AT = "/usr/local/bin/moed"  # ExecStart= in the shipped unit
WAIT = 120  # seconds: a bound on systemd-analyze, not a sleep


def _tool() -> str:
    return tools.path("systemd-analyze")


def _moed() -> str:
    """The moed executable of this installation (the venv's, else the one on PATH)."""
    beside = Path(sys.executable).parent / "moed"
    found = str(beside) if beside.exists() else shutil.which("moed")
    assert found, "moed is not installed: pip install -e ."
    return found


def _verify(directory: Path, *names: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{directory}:", SYSTEMD_LOG_COLOR="0")
    return subprocess.run([_tool(), "verify", *(str(directory / n) for n in names)],
                          capture_output=True, text=True, env=env, cwd=directory, timeout=WAIT)


def _copy_units(tmp_path: Path) -> Path:
    """The shipped units, ExecStart pointed at this installation's moed."""
    out = tmp_path / "units"
    out.mkdir()
    shutil.copy(UNITS / "moed.socket", out / "moed.socket")
    service = (UNITS / "moed.service").read_text()
    assert service.count(f"ExecStart={INSTALLED_AT} ") == 1
    (out / "moed.service").write_text(service.replace(f"ExecStart={INSTALLED_AT} ",
                                                      f"ExecStart={_moed()} "))
    return out


def _directives(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values, comments dropped (systemd allows repeated keys)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{path.name}: {line!r} outside a section"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _usec(timespan: str) -> int:
    """A systemd time span in microseconds, as systemd itself parses it."""
    out = subprocess.run([_tool(), "timespan", timespan], capture_output=True, text=True,
                         check=True, timeout=WAIT).stdout
    return int(re.search(r"μs: (\d+)", out).group(1))


@pytest.mark.tools("systemd-analyze", "kill")
def test_systemd_analyze_verify_accepts_the_units_silently(tmp_path):
    units = _copy_units(tmp_path)
    result = _verify(units, "moed.socket", "moed.service")
    assert (result.returncode, result.stderr) == (0, ""), result.stderr


@pytest.mark.tools("systemd-analyze", "kill")
def test_verify_as_run_here_does_report_a_bad_unit(tmp_path):
    """The check above has teeth: an unknown key (only a warning in systemd 252) and a
    missing executable both show up on stderr."""
    units = _copy_units(tmp_path)
    service = units / "moed.service"
    service.write_text(service.read_text().replace("[Service]\n", "[Service]\nNotAKey=1\n"))
    result = _verify(units, "moed.socket", "moed.service")
    assert "Unknown key 'NotAKey'" in result.stderr
    service.write_text(service.read_text().replace(f"ExecStart={_moed()} ",
                                                   "ExecStart=/nonexistent/moed "))
    result = _verify(units, "moed.socket", "moed.service")
    assert result.returncode != 0 and "/nonexistent/moed" in result.stderr


def test_socket_unit():
    socket_unit = _directives(UNITS / "moed.socket")
    s = socket_unit["Socket"]
    assert s["ListenStream"] == [ServeConfig().socket] == ["/run/moed/moed.sock"]
    assert s["SocketMode"] == [f"0{ServeConfig().socket_mode:o}"] == ["0660"]
    assert s["SocketGroup"] == ["moed"]
    assert socket_unit["Install"]["WantedBy"] == ["sockets.target"]


def test_service_unit():
    text = (UNITS / "moed.service").read_text()
    unit = _directives(UNITS / "moed.service")
    u, s = unit["Unit"], unit["Service"]
    assert u["Requires"] == ["moed.socket"] and u["After"] == ["moed.socket"]
    assert s["Type"] == ["notify"]
    assert s["ExecStart"] == [f"{INSTALLED_AT} serve --config {DEFAULT_CONFIG_PATH}"]
    assert re.fullmatch(r"(/usr)?(/bin/)?kill -HUP \$MAINPID", s["ExecReload"][0])
    assert (s["User"], s["Group"], s["StateDirectory"]) == (["moed"], ["moed"], ["moed"])
    assert s["Restart"] == ["on-failure"]
    # RuntimeDirectory= would delete /run/moed (and the socket in it) when the service
    # stops; the unit must not set it and must say why.
    assert "RuntimeDirectory" not in s
    assert re.search(r"(?m)^#.*No RuntimeDirectory=", text)
    assert s["ProtectSystem"] == ["strict"]
    assert s["NoNewPrivileges"] == ["yes"] and s["PrivateTmp"] == ["yes"]
    assert len(s["ProtectHome"]) == 1 and len(s["ReadOnlyPaths"]) == 1
    assert len(s["LimitMEMLOCK"]) == 1 and len(s["WatchdogSec"]) == 1
    assert re.search(r"(?m)^#\s*MemoryHigh=", text) and re.search(r"(?m)^#\s*MemoryMax=", text)
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.mark.tools("systemd-analyze")
def test_service_timeouts_fit_the_daemon():
    s = _directives(UNITS / "moed.service")["Service"]
    grace_usec = int(ServeConfig().shutdown_grace_s * 1e6)
    assert _usec(s["TimeoutStopSec"][0]) >= grace_usec + 30_000_000
    assert _usec(s["TimeoutStartSec"][0]) >= 5 * 60 * 1_000_000  # loads extend it further
    assert _usec(s["WatchdogSec"][0]) >= 10_000_000


@pytest.mark.parametrize("name", ["moed.socket", "moed.service"])
def test_units_mention_no_path_of_this_checkout(name):
    text = (UNITS / name).read_text()
    assert str(ROOT) not in text and ".venv" not in text


def test_units_name_their_documentation_and_the_user_install_service_creates():
    for name in ("moed.socket", "moed.service"):
        docs = _directives(UNITS / name)["Unit"]["Documentation"]
        assert docs == ["file:/usr/local/share/doc/moed/README.md"]
    user = _directives(UNITS / "moed.service")["Service"]["User"][0]
    [line] = [x for x in (UNITS / "moed.sysusers").read_text().splitlines()
              if x and not x.startswith("#")]
    kind, name, _id, _gecos, home, shell = line.split(maxsplit=2)[:2] + ["-"] + \
        line.split('"')[1:2] + line.split('"')[2].split()
    assert (kind, name, home, shell) == ("u", user, "/var/lib/moed", "/usr/sbin/nologin")
    from importlib import resources
    shipped = resources.files("daemon") / "systemd"           # what a wheel carries
    assert {p.name for p in shipped.iterdir()} >= {"moed.service", "moed.socket", "moed.toml",
                                                   "moed.sysusers"}
