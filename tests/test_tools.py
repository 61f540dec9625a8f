"""tests/tools.py: a missing program is installed when the run may, else its tests skip
with a reason naming the package (or fail under MOED_TEST_TOOLS=require)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tools

ROOT = Path(__file__).resolve().parent.parent


def fake_apt(bin_dir: Path, log: Path, provides: str | None) -> None:
    """An `apt-get` that records its arguments and, on install, creates `provides`."""
    script = f"""#!/bin/sh
echo "$@" >> {log}
if [ "$1" = install ] && [ -n "{provides or ''}" ]; then
    printf '#!/bin/sh\\necho fake\\n' > {bin_dir}/{provides or 'x'}
    chmod +x {bin_dir}/{provides or 'x'}
fi
"""
    (bin_dir / "apt-get").write_text(script)
    (bin_dir / "apt-get").chmod(0o755)


@pytest.fixture
def bare_path(tmp_path, monkeypatch):
    """PATH = a directory with only sh and chmod (and what a test puts there)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink("/bin/sh", bin_dir / "sh")
    os.symlink("/bin/chmod", bin_dir / "chmod")
    monkeypatch.setenv("PATH", str(bin_dir))
    tools._found.clear()
    return bin_dir


def test_a_missing_tool_is_installed_with_apt_get_when_root_on_debian(bare_path, tmp_path, monkeypatch):
    if not os.path.exists("/etc/debian_version"):
        pytest.skip("not a Debian system: tools.py never installs here")
    monkeypatch.setattr(tools.os, "geteuid", lambda: 0)
    log = tmp_path / "apt.log"
    fake_apt(bare_path, log, provides="promtool")
    report = tools.ensure(["promtool"], environ={})
    assert report.missing == {} and report.installed == ["prometheus"]
    assert log.read_text().splitlines() == [
        "update -q", "install -y -q --no-install-recommends prometheus"]
    assert tools.path("promtool") == str(bare_path / "promtool")


def test_without_root_nothing_is_installed_and_the_reason_says_how(bare_path, tmp_path, monkeypatch):
    monkeypatch.setattr(tools.os, "geteuid", lambda: 1000)
    log = tmp_path / "apt.log"
    fake_apt(bare_path, log, provides="promtool")
    report = tools.ensure(["promtool", "curl"], environ={})
    assert not log.exists()
    assert set(report.missing) == {"promtool", "curl"}
    assert "apt-get install prometheus" in report.missing["promtool"]
    assert "apt-get install curl" in report.missing["curl"]
    assert "not root" in report.missing["promtool"] or "not a Debian" in report.missing["promtool"]


def test_skip_mode_never_installs(bare_path, tmp_path, monkeypatch):
    monkeypatch.setattr(tools.os, "geteuid", lambda: 0)
    log = tmp_path / "apt.log"
    fake_apt(bare_path, log, provides="promtool")
    report = tools.ensure(["promtool"], environ={tools.ENV: "skip"})
    assert not log.exists() and "MOED_TEST_TOOLS=skip" in report.missing["promtool"]


def test_an_install_that_does_not_provide_the_tool_is_reported(bare_path, tmp_path, monkeypatch):
    if not os.path.exists("/etc/debian_version"):
        pytest.skip("not a Debian system: tools.py never installs here")
    monkeypatch.setattr(tools.os, "geteuid", lambda: 0)
    fake_apt(bare_path, tmp_path / "apt.log", provides=None)
    report = tools.ensure(["promtool"], environ={})
    assert report.installed == []
    assert "still missing after `apt-get install prometheus`" in report.missing["promtool"]


RUN = textwrap.dedent('''
    import pytest

    @pytest.mark.tools("promtool")
    def test_needs_promtool():
        pass
''')


@pytest.mark.parametrize("mode, outcome", [("skip", "skipped"), ("require", "error")])
def test_a_test_whose_tool_is_missing_skips_or_under_require_fails(tmp_path, mode, outcome):
    """The whole hook, in a pytest run of its own: PATH without promtool, no install."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (suite / "tools.py").write_text((ROOT / "tests" / "tools.py").read_text())
    (suite / "test_it.py").write_text(RUN)
    (suite / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider -rs --strict-markers\n"
                                      "markers =\n    tools(*names): programs\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink("/bin/sh", bin_dir / "sh")
    # skip: never installs; require with a fake apt-get that provides nothing: still missing
    fake_apt(bin_dir, tmp_path / "apt.log", provides=None)
    env = {"PATH": str(bin_dir), tools.ENV: mode, "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "pytest", str(suite)], capture_output=True,
                         text=True, env=env, cwd=suite, timeout=120)
    assert f"1 {outcome}" in run.stdout, run.stdout + run.stderr
    assert "promtool" in run.stdout and "apt-get install prometheus" in run.stdout
    assert run.returncode == (0 if outcome == "skipped" else 1)
