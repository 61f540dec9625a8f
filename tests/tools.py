"""The programs some tests run (promtool, prometheus, haproxy, systemd-analyze, curl, ...): found,
installed from Debian's archive when missing and allowed, or reported.

A test names what it runs with ``@pytest.mark.tools("promtool", ...)`` (or a module's
``pytestmark``) and gets each program's absolute path from `path(name)`. Before the
first test runs, conftest.py asks `ensure` for every tool the selected tests name; what
is missing is installed in one ``apt-get update && apt-get install`` when the machine is
Debian, we are root and ``MOED_TEST_TOOLS`` allows it. A test whose tool is still missing
is skipped with a reason that says how to get it — except under
``MOED_TEST_TOOLS=require`` (CI, `.ci/run`), where it fails: CI can always install.

``MOED_TEST_TOOLS``:
  ``install`` (default) install what is missing when root on Debian, else skip;
  ``require``           install what is missing, and fail a test whose tool is absent;
  ``skip``              never install; skip a test whose tool is absent.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

ENV = "MOED_TEST_TOOLS"
MODES = ("install", "require", "skip")
APT_TIMEOUT_S = 1800   # a bound on apt-get (a slow mirror), not a sleep

# program -> the Debian package that provides it
PACKAGES: Mapping[str, str] = {
    "promtool": "prometheus",
    "prometheus": "prometheus",
    "systemd-analyze": "systemd",
    "systemd-socket-activate": "systemd",
    "systemd-sysusers": "systemd",
    "curl": "curl",
    "haproxy": "haproxy",      # the fleet test's balancer (haproxy/moed.cfg)
    "kill": "procps",          # /bin/kill: the units' ExecReload=
    "prlimit": "util-linux",
    "unshare": "util-linux",
    "mount": "mount",
    "python3": "python3",      # the system interpreter (the install-service test's venv)
    "gcc": "gcc",              # building moed's kernels (the install-service test)
    "python3-venv": "python3-venv",   # not programs: checked by CHECKS below
    "python3-dev": "python3-dev",
    "runuser": "util-linux",
    "setpriv": "util-linux",
}
# Where a program must be, when the test needs that exact file rather than any on PATH.
FIXED: Mapping[str, str] = {"kill": "/bin/kill", "python3": "/usr/bin/python3",
                             "haproxy": "/usr/sbin/haproxy"}   # sbin: not on a user's PATH


def mode(environ: Mapping[str, str] = os.environ) -> str:
    value = environ.get(ENV, "install") or "install"
    if value not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, got {value!r}")
    return value


def _system_python_has(code: str) -> bool:
    python = "/usr/bin/python3"
    return os.access(python, os.X_OK) and subprocess.run(
        [python, "-c", code], capture_output=True).returncode == 0


# What is not a program on PATH: name -> (a check, what `find` returns when it passes).
CHECKS: Mapping[str, tuple] = {
    "python3-venv": (lambda: _system_python_has("import ensurepip, venv"), "/usr/bin/python3"),
    "python3-dev": (lambda: _system_python_has(
        "import os, sysconfig, sys; "
        "sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"),
        "/usr/bin/python3"),
}


def find(name: str) -> str | None:
    """The absolute path of program `name` (for CHECKS entries: the system Python when the
    check passes), or None."""
    if name in CHECKS:
        check, path = CHECKS[name]
        return path if check() else None
    fixed = FIXED.get(name)
    if fixed is not None:
        return fixed if os.access(fixed, os.X_OK) else None
    return shutil.which(name)


def _may_install() -> str | None:
    """None when this process may install Debian packages, else why not."""
    if not os.path.exists("/etc/debian_version"):
        return "this is not a Debian system"
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("apt-get") is None:
        return "apt-get is missing"
    return None


@dataclass
class Report:
    """What `ensure` found: each missing tool's reason, what was installed, apt's output."""

    missing: dict[str, str] = field(default_factory=dict)
    installed: list[str] = field(default_factory=list)
    apt_output: str = ""


def _apt(packages: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    script = ("apt-get update -q && apt-get install -y -q --no-install-recommends "
              + " ".join(packages))
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env,
                          timeout=APT_TIMEOUT_S)


def ensure(names: Iterable[str], environ: Mapping[str, str] = os.environ) -> Report:
    """Find every tool in `names`; install the missing ones' packages when allowed.

    Returns a Report whose ``missing`` maps each tool still absent to a skip reason that
    names the package to install. Never raises for a missing tool or a failed apt-get.
    """
    report = Report()
    absent = sorted(n for n in set(names) if find(n) is None)
    if not absent:
        return report
    packages = sorted({PACKAGES[n] for n in absent})
    how = f"apt-get install {' '.join(packages)}"
    why_not = "MOED_TEST_TOOLS=skip" if mode(environ) == "skip" else _may_install()
    if why_not is None:
        result = _apt(packages)
        report.apt_output = result.stdout[-4000:] + result.stderr[-4000:]
        if result.returncode != 0:
            why_not = f"`{how}` failed (exit {result.returncode})"
        report.installed = sorted({PACKAGES[n] for n in absent if find(n) is not None})
    for name in absent:
        if find(name) is not None:
            continue
        fixed = FIXED.get(name)
        what = fixed if fixed else f"{name} (on PATH)"
        if why_not is None:
            reason = f"{what} is still missing after `{how}`"
        else:
            reason = (f"{what} is not installed, and the tests did not install it ({why_not}): "
                      f"run `apt-get install {PACKAGES[name]}` as root")
        report.missing[name] = reason
    return report


_found: dict[str, str] = {}


def path(name: str) -> str:
    """The absolute path of a tool a test declared with @pytest.mark.tools (conftest made
    sure it is there before the test ran). AssertionError for an undeclared missing tool."""
    if name not in _found:
        found = find(name)
        assert found is not None, f"{name} is missing; declare it with @pytest.mark.tools({name!r})"
        _found[name] = found
    return _found[name]
