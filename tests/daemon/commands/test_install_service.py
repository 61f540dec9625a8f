"""`moed install-service`: the documented install, done for real — user, config, state
directory, /usr/local/bin/moed, units — and `systemd-analyze verify` on the units as
installed, the service user running the installed moed on the default model.

It runs in a mount namespace of its own where /etc, /var/lib and /usr/local are overlays
and /opt a tmpfs, so the machine's own files never change. moed goes to /opt/moed, a
virtual environment of the system's Python (an interpreter under /root or /home is what
install-service refuses) that reaches this checkout's packages.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import tools

from daemon.commands.install_service import InstallError, install
from daemon.service.config import default_model_dir

SCRIPT = r'''
set -eu
for d in etc var/lib usr/local; do
    mkdir -p "$SCRATCH/$d/upper" "$SCRATCH/$d/work"
    mount -t overlay overlay -o "lowerdir=/$d,upperdir=$SCRATCH/$d/upper,workdir=$SCRATCH/$d/work" "/$d"
done
mount -t tmpfs tmpfs /opt
"$SYSTEM_PYTHON" -m venv --without-pip /opt/moed
purelib=$(/opt/moed/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$CHECKOUT_SITE')" > "$purelib/moed-checkout.pth"
printf '#!/opt/moed/bin/python\nimport sys\nfrom daemon.commands.cli import main\nsys.exit(main())\n' > /opt/moed/bin/moed
chmod 755 /opt/moed/bin/moed
/opt/moed/bin/moed install-service > "$SCRATCH/installed.json" 2> "$SCRATCH/install.err"
systemd-analyze verify /etc/systemd/system/moed.socket /etc/systemd/system/moed.service > "$SCRATCH/verify.out" 2>&1
echo $? > "$SCRATCH/verify.rc"
getent passwd moed > "$SCRATCH/passwd"
stat -c '%U:%G %a' /etc/moed/moed.toml /var/lib/moed > "$SCRATCH/modes"
readlink /usr/local/bin/moed > "$SCRATCH/link"
cp /etc/moed/moed.toml "$SCRATCH/moed.toml"
cd /var/lib/moed
runuser -u moed -- /usr/local/bin/moed generate --model default --max-tokens 4 --temperature 0 \
    --threads 1 'def f(x):' > "$SCRATCH/generated" 2> "$SCRATCH/generate.err"
'''


@pytest.mark.tools("unshare", "mount", "systemd-analyze", "systemd-sysusers", "kill", "python3")
def test_the_installed_units_pass_systemd_analyze_verify_and_the_service_user_runs_moed(tmp_path):
    probe = subprocess.run([tools.path("unshare"), "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here (unshare -m: {probe.stderr.strip()})")
    env = dict(os.environ, SCRATCH=str(tmp_path), SYSTEM_PYTHON=tools.path("python3"),
               CHECKOUT_SITE=sysconfig.get_paths()["purelib"], SYSTEMD_LOG_COLOR="0")
    env = {k: v for k, v in env.items() if not k.startswith("MOED_")}
    run = subprocess.run([tools.path("unshare"), "-m", "sh", "-c", SCRIPT], env=env,
                         capture_output=True, text=True, timeout=300)
    err = (tmp_path / "install.err").read_text() if (tmp_path / "install.err").exists() else ""
    assert run.returncode == 0, run.stderr + err + (
        (tmp_path / "generate.err").read_text() if (tmp_path / "generate.err").exists() else "")
    installed = json.loads((tmp_path / "installed.json").read_text())
    assert installed["moed"] == "/opt/moed/bin/moed" and installed["verify"] == ""
    assert installed["model"] == str(default_model_dir())
    assert ((tmp_path / "verify.rc").read_text().strip(), (tmp_path / "verify.out").read_text()) == ("0", "")
    assert (tmp_path / "link").read_text().strip() == "/opt/moed/bin/moed"
    user = (tmp_path / "passwd").read_text().split(":")
    assert user[0] == "moed" and user[5] == "/var/lib/moed" and user[6].strip() == "/usr/sbin/nologin"
    assert (tmp_path / "modes").read_text().splitlines() == ["root:moed 640", "moed:moed 700"]
    assert f'model = "{default_model_dir()}"' in (tmp_path / "moed.toml").read_text()
    assert (tmp_path / "generated").read_text().strip()       # the service user ran moed
    # and the machine itself is untouched
    assert not Path("/etc/moed").exists() or "moed.toml" not in os.listdir("/etc/moed")
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
