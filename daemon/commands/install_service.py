"""`moed install-service`: install moed as a systemd service, as an operator would by hand.

What it does, under `--root` (default /; another root builds the same tree elsewhere, as
DESTDIR does for a package):

1. checks that the moed it installs — its entry point, the Python interpreter behind it,
   its packages and the model — lie outside what moed.service hides (ProtectHome=yes:
   /home, /root, /run/user; PrivateTmp=yes: /tmp, /var/tmp) and that every directory on
   the way is open to other users, so that the service user can run and read them;
2. links /usr/local/bin/moed (where ExecStart= points) to that entry point;
3. creates the system user and group moed (systemd-sysusers with /etc/sysusers.d/moed.conf);
4. writes /etc/moed/moed.toml from the documented example with `model` set (unless the
   file exists), root-owned, group moed, mode 0640;
5. creates the state directory /var/lib/moed (owner moed, mode 0700);
6. installs moed.socket and moed.service in /etc/systemd/system and the README their
   Documentation= names, /usr/local/share/doc/moed/README.md;
7. on the live root, runs `systemd-analyze verify` on the installed units.

It enables and starts nothing: it prints the systemctl commands that do. Exit 1 with a
one-line error when a check fails; nothing is written before the checks pass.
"""
from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
from importlib import metadata, resources
from pathlib import Path

from daemon.commands.args import MODEL_HELP, ExamplesFormatter, Parents, check_model_dir, nonempty

BIN = "usr/local/bin/moed"
UNIT_DIR = "etc/systemd/system"
UNITS = ("moed.socket", "moed.service")
CONFIG = "etc/moed/moed.toml"
SYSUSERS = "etc/sysusers.d/moed.conf"
STATE_DIR = "var/lib/moed"
DOC = "usr/local/share/doc/moed/README.md"
USER = "moed"
# What moed.service makes invisible to the daemon (ProtectHome=yes, PrivateTmp=yes).
HIDDEN = ("/home", "/root", "/run/user", "/tmp", "/var/tmp")


class InstallError(ValueError):
    """Something stands in the way of a working service; the message says what to do."""


def _shipped(name: str) -> str:
    """A file of the package's systemd/ folder (units, example config, sysusers)."""
    return (resources.files("daemon") / "systemd" / name).read_text(encoding="utf-8")


def _hidden(path: Path) -> str | None:
    p = str(path)
    return next((h for h in HIDDEN if p == h or p.startswith(h + "/")), None)


def _closed_to_others(path: Path, want: int) -> Path | None:
    """The first of `path`'s directories that others cannot enter, or `path` itself when
    others lack the `want` bits (stat.S_IROTH, S_IXOTH) on it; None when all is open."""
    path = path.resolve()
    for d in reversed(path.parents):
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return d
    if os.stat(path).st_mode & want != want:
        return path
    return None


def _check_reachable(what: str, path: Path, want: int) -> None:
    real = path.resolve()
    hidden = _hidden(real)
    if hidden is not None:
        raise InstallError(
            f"{what} {real} is under {hidden}, which moed.service hides from the daemon "
            "(ProtectHome=yes, PrivateTmp=yes): install moed outside it, e.g. "
            "python3 -m venv /opt/moed && /opt/moed/bin/pip install <moed> && "
            "/opt/moed/bin/moed install-service (with a Python interpreter outside home "
            "directories too)")
    closed = _closed_to_others(real, want)
    if closed is not None:
        raise InstallError(f"{what} {real}: {closed} is not open to other users (the service "
                           f"runs as {USER}): chmod o+rx it, or install moed elsewhere")


def _interpreter(entry: Path) -> Path:
    """The Python interpreter of a console script (its #! line), resolved."""
    first = entry.read_bytes().split(b"\n", 1)[0]
    if not first.startswith(b"#!"):
        raise InstallError(f"{entry} is not a console script (no #! line)")
    return Path(first[2:].decode().split()[0]).resolve()


def _lookup(root: Path, name: str, database: str) -> int:
    """uid or gid of `name` in root's /etc/passwd or /etc/group."""
    if str(root) == "/":
        return pwd.getpwnam(name).pw_uid if database == "passwd" else grp.getgrnam(name).gr_gid
    for line in (root / "etc" / database).read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return int(fields[2])
    raise InstallError(f"{root / 'etc' / database}: no {name}")


def _config_text(model: str) -> str:
    lines = _shipped("moed.toml").splitlines(keepends=True)
    out = []
    for line in lines:
        out.append(f"model = {json.dumps(model)}\n" if line.startswith("model = ") else line)
    return "".join(out)


def install(root: Path, entry: Path, model: Path, *, force: bool = False,
            note=lambda message: None) -> dict:
    """Install the service under `root` (see the module docstring); what was done.

    entry: the moed console script ExecStart= will run. model: the model directory the
    config names. Raises InstallError (a check failed, and then nothing was written; or
    systemd-sysusers or systemd-analyze verify failed) and OSError."""
    try:
        executable = entry.is_file() and os.access(entry, os.X_OK)
    except OSError as e:            # a directory on the way we may not enter
        raise InstallError(f"{entry} is not an executable moed entry point: {e}") from e
    if not executable:
        raise InstallError(f"{entry} is not an executable moed entry point")
    _check_reachable("the moed entry point", entry, stat.S_IROTH | stat.S_IXOTH)
    _check_reachable("its Python interpreter", _interpreter(entry), stat.S_IXOTH)
    package = Path(resources.files("daemon")).resolve()
    _check_reachable("its package", package / "__init__.py", stat.S_IROTH)
    _check_reachable("its libraries", Path(sysconfig.get_paths()["purelib"]), stat.S_IXOTH)
    _check_reachable("the model", model / "config.json", stat.S_IROTH)
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        raise InstallError("systemd-sysusers is missing: apt-get install systemd")
    done = {"root": str(root), "moed": str(entry.resolve()), "model": str(model)}

    link = root / BIN
    if link.is_symlink() or not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(entry.resolve())
    elif not force:
        raise InstallError(f"{link} exists and is not a link: remove it or give --force")
    else:
        link.unlink()
        link.symlink_to(entry.resolve())
    note(f"{link} -> {entry.resolve()}")

    conf = root / SYSUSERS
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(_shipped("moed.sysusers"))
    made = subprocess.run([sysusers, f"--root={root}", str(conf)], capture_output=True, text=True)
    if made.returncode != 0:
        raise InstallError(f"systemd-sysusers could not create the user {USER}: "
                           f"{made.stderr.strip() or made.returncode}")
    uid, gid = _lookup(root, USER, "passwd"), _lookup(root, USER, "group")
    note(f"user and group {USER} ({uid}:{gid})")

    config = root / CONFIG
    config.parent.mkdir(parents=True, exist_ok=True)
    if config.exists() and not force:
        note(f"{config} exists: left as it is")
        done["config"] = "kept"
    else:
        config.write_text(_config_text(str(model)))
        done["config"] = "written"
        note(f"{config} (model = {model})")
    os.chown(config, 0, gid)
    os.chmod(config, 0o640)

    state = root / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    os.chown(state, uid, gid)
    os.chmod(state, 0o700)

    units = root / UNIT_DIR
    units.mkdir(parents=True, exist_ok=True)
    for name in UNITS:
        (units / name).write_text(_shipped(name))
    doc = root / DOC
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(metadata.metadata("moed").get_payload() or _readme_fallback())
    note(f"{units / 'moed.socket'}, {units / 'moed.service'}, {doc}")
    done.update(user=USER, uid=uid, gid=gid, state_dir=str(state),
                units=[str(units / n) for n in UNITS], config_path=str(config))
    if str(root) == "/":
        done["verify"] = verify([units / n for n in UNITS])
    return done


def _readme_fallback() -> str:
    return "moed: see `moed --help` and `moed serve --help`.\n"


def verify(units: list[Path]) -> str:
    """`systemd-analyze verify` on installed units; its output ("" when all is well).
    Raises InstallError when it fails."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        raise InstallError("systemd-analyze is missing: apt-get install systemd")
    run = subprocess.run([analyze, "verify", *map(str, units)], capture_output=True, text=True,
                         env={**os.environ, "SYSTEMD_LOG_COLOR": "0"})
    if run.returncode != 0 or run.stderr.strip():
        raise InstallError(f"systemd-analyze verify: {run.stderr.strip() or run.returncode}")
    return run.stderr


def register(sub, parents: Parents) -> None:
    """`moed install-service` and its options."""
    s = sub.add_parser(
        "install-service", parents=[parents.common],
        description="Install this moed as the systemd service moed.socket + moed.service: "
                    "link /usr/local/bin/moed to it, create the system user moed, write "
                    "/etc/moed/moed.toml (unless it exists) with --model, create "
                    "/var/lib/moed, install the units and check them with systemd-analyze "
                    "verify. Needs root. moed must live where the service can reach it "
                    "(not under /home, /root or /tmp): install it in its own virtual "
                    "environment, e.g. /opt/moed. Starts nothing; prints the systemctl "
                    "commands that do.",
        epilog="example:\n"
               "  python3 -m venv /opt/moed && /opt/moed/bin/pip install .\n"
               "  /opt/moed/bin/moed install-service --model /srv/models/my-moe\n"
               "  systemctl daemon-reload && systemctl enable --now moed.socket moed.service",
        formatter_class=ExamplesFormatter)
    s.add_argument("--model", default=None, metavar="DIR", type=nonempty,
                   help=MODEL_HELP + " the service serves (default: the embedded default model)")
    s.add_argument("--root", default="/", metavar="DIR", type=nonempty,
                   help="install under this root instead of / (a package build; the units are "
                        "then not verified)")
    s.add_argument("--force", action="store_true",
                   help="replace an existing /etc/moed/moed.toml and /usr/local/bin/moed")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from daemon.service.config import default_model_dir

    if os.geteuid() != 0:
        raise InstallError("install-service needs root (it creates a user and writes /etc)")
    model = Path(check_model_dir(args.model)).resolve() if args.model else default_model_dir()
    root = Path(args.root).resolve()
    entry = Path(sys.executable).with_name("moed")
    done = install(root, entry, model, force=args.force,
                   note=lambda m: print(f"moed install-service: {m}", file=sys.stderr))
    print(json.dumps(done, indent=2))
    if str(root) == "/":
        print("moed install-service: installed; start it with\n"
              "  systemctl daemon-reload && systemctl enable --now moed.socket moed.service\n"
              f"and let a user reach the socket with: usermod -aG {USER} USER", file=sys.stderr)
    return 0
