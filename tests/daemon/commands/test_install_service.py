"""`moed install-service`: the service steps of docs/service.md done for real — a virtual
environment of the system's Python in /opt/moed, `pip install` of this checkout, then
install-service (user, config, state directory, /usr/local/bin/moed, units) — and
`systemd-analyze verify` on the units as installed, the service user serving the default
model with the installed moed and the installed configuration.

It runs in a mount namespace of its own where /etc, /var/lib and /usr/local are overlays
and /opt a tmpfs, so the machine's own files never change. The pip install builds the
kernels: about a minute and a half (slow).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tools

from daemon.commands.install_service import InstallError, install
from daemon.service.config import default_model_dir

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = r'''
set -eu
for d in etc var/lib usr/local; do
    mkdir -p "$SCRATCH/$d/upper" "$SCRATCH/$d/work"
    mount -t overlay overlay -o "lowerdir=/$d,upperdir=$SCRATCH/$d/upper,workdir=$SCRATCH/$d/work" "/$d"
done
mount -t tmpfs -o size=2G tmpfs /opt
cd "$SCRATCH/src"
/usr/bin/python3 -m venv /opt/moed
/opt/moed/bin/pip install -q . > "$SCRATCH/pip.out" 2>&1
/opt/moed/bin/moed install-service > "$SCRATCH/installed.json" 2> "$SCRATCH/install.err"
systemd-analyze verify /etc/systemd/system/moed.socket /etc/systemd/system/moed.service > "$SCRATCH/verify.out" 2>&1
echo $? > "$SCRATCH/verify.rc"
getent passwd moed > "$SCRATCH/passwd"
stat -c '%U:%G %a' /etc/moed/moed.toml /var/lib/moed > "$SCRATCH/modes"
readlink /usr/local/bin/moed > "$SCRATCH/link"
cp /etc/moed/moed.toml "$SCRATCH/moed.toml"
cd /var/lib/moed
# the installed moed, run as the service user, loads the installed default model
runuser -u moed -- /usr/local/bin/moed generate --model default --max-tokens 4 \
    --temperature 0 --threads 1 'def f(x):' > "$SCRATCH/generated" 2> "$SCRATCH/generate.err"
'''


def _copy_checkout(to: Path) -> None:
    """The checkout's tracked files (git ls-files), as `pip install .` would see them."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src, dst = ROOT / name, to / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        elif src.is_file():
            shutil.copy2(src, dst)


@pytest.mark.slow
@pytest.mark.tools("unshare", "mount", "systemd-analyze", "systemd-sysusers", "kill", "runuser",
                   "python3", "python3-venv", "python3-dev", "gcc")
def test_the_installed_units_pass_systemd_analyze_verify_and_the_service_user_runs_moed(tmp_path):
    probe = subprocess.run([tools.path("unshare"), "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here (unshare -m: {probe.stderr.strip()})")
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of the files pip would install")
    _copy_checkout(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    env.update(SCRATCH=str(tmp_path), SYSTEMD_LOG_COLOR="0")
    run = subprocess.run([tools.path("unshare"), "-m", "sh", "-c", SCRIPT], env=env,
                         capture_output=True, text=True, timeout=1200)
    logs = "".join((tmp_path / n).read_text() for n in ("pip.out", "install.err", "generate.err")
                   if (tmp_path / n).exists())
    assert run.returncode == 0, run.stderr + logs
    installed = json.loads((tmp_path / "installed.json").read_text())
    assert installed["moed"] == "/opt/moed/bin/moed" and installed["verify"] == ""
    assert installed["model"].startswith("/opt/moed/lib/python3.")
    assert installed["model"].endswith("/site-packages/daemon/default_model")
    assert ((tmp_path / "verify.rc").read_text().strip(), (tmp_path / "verify.out").read_text()) == ("0", "")
    assert (tmp_path / "link").read_text().strip() == "/opt/moed/bin/moed"
    user = (tmp_path / "passwd").read_text().strip().split(":")
    assert (user[0], user[5], user[6]) == ("moed", "/var/lib/moed", "/usr/sbin/nologin")
    assert (tmp_path / "modes").read_text().splitlines() == ["root:moed 640", "moed:moed 700"]
    assert f'model = "{installed["model"]}"' in (tmp_path / "moed.toml").read_text()
    assert (tmp_path / "generated").read_text().strip()       # the service user ran moed
    # and the machine itself is untouched
    assert not Path("/etc/moed/moed.toml").exists() or \
        installed["model"] not in Path("/etc/moed/moed.toml").read_text()
    assert not Path("/usr/local/bin/moed").is_symlink() or \
        os.readlink("/usr/local/bin/moed") != "/opt/moed/bin/moed"


def test_a_moed_under_root_s_home_is_refused_before_anything_is_written(tmp_path):
    home = tmp_path / "root-like"
    entry = Path("/root") / "moed-nowhere" / "bin" / "moed"
    with pytest.raises(InstallError, match="is not an executable"):
        install(home, entry, default_model_dir())
    script = tmp_path / "moed"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        print("moed")
        """))
    script.chmod(0o755)
    with pytest.raises(InstallError, match=r"under /tmp, which moed.service hides") as e:
        install(home, script, default_model_dir())
    assert "/opt/moed" in str(e.value)
    assert not home.exists()                                  # nothing written



def test_an_entry_point_behind_a_directory_we_may_not_enter_is_an_install_error(tmp_path,
                                                                                 monkeypatch):
    """stat(2) refused (a non-root user and /root/...; root is never refused, so the
    refusal is injected): the one-line InstallError, not a PermissionError traceback, and
    nothing written."""
    entry = tmp_path / "locked" / "bin" / "moed"
    real_stat = Path.stat

    def refusing_stat(self, *args, **kwargs):
        if self == entry:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", refusing_stat)
    with pytest.raises(InstallError, match="is not an executable moed entry point: .*Permission denied"):
        install(tmp_path / "root", entry, default_model_dir())
    assert not (tmp_path / "root").exists()
