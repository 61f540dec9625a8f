"""The daemon's Unix socket (daemon/service/listen.py): stale files replaced, live ones and foreign
files refused, the lock, mode and group set explicitly, close() leaving others' files,
socket activation."""
from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from daemon.service.listen import (ListenError, SocketInUseError, UnixListener, adopt_fd,
                                   bind_unix_socket)

ROOT = Path(__file__).resolve().parents[3]
WAIT = 60  # seconds: a bound on subprocesses, not a sleep


@pytest.fixture
def short_dir():
    """A directory under /tmp: AF_UNIX paths must stay below 108 bytes."""
    d = tempfile.mkdtemp(dir="/tmp", prefix="moedl")
    yield Path(d)
    shutil.rmtree(d)


@pytest.fixture
def umask_077():
    old = os.umask(0o077)
    yield
    os.umask(old)


@pytest.fixture
def listen_log(log_records):
    return log_records("moed.listen")


def _round_trip(listener: UnixListener) -> bytes:
    """Connect to the listener's path, accept, send a byte across: proves it serves."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(listener.path)
        conn, _ = listener.sock.accept()
        with conn:
            conn.sendall(b"x")
            return client.recv(1)


def _stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a killed daemon leaves it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1)
    s.close()


def test_binds_listens_and_sets_the_mode_explicitly(short_dir, umask_077):
    path = short_dir / "moed.sock"
    with bind_unix_socket(path, mode=0o660) as listener:
        assert isinstance(listener.sock, socket.socket)
        assert listener.sock.family == socket.AF_UNIX and listener.sock.type == socket.SOCK_STREAM
        st = path.lstat()
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660  # not 0o600, what umask 077 would give
        assert _round_trip(listener) == b"x"
        assert Path(listener.lock_path) == short_dir / "moed.sock.lock"
        assert Path(listener.lock_path).exists()
    with bind_unix_socket(path, mode=0o604) as listener:  # bits a umask would never add
        assert stat.S_IMODE(path.lstat().st_mode) == 0o604


def test_missing_parent_directories_are_created_0755(short_dir, umask_077):
    path = short_dir / "run" / "moed" / "moed.sock"
    with bind_unix_socket(path) as listener:
        assert _round_trip(listener) == b"x"
        assert stat.S_IMODE((short_dir / "run").stat().st_mode) == 0o755
        assert stat.S_IMODE((short_dir / "run" / "moed").stat().st_mode) == 0o755


def test_a_stale_socket_is_replaced(short_dir, listen_log):
    path = short_dir / "moed.sock"
    _stale_socket(path)
    with socket.socket(socket.AF_UNIX) as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(str(path))
    with bind_unix_socket(path) as listener:
        assert _round_trip(listener) == b"x"
    assert any(r["event"] == "stale_socket_replaced" for r in listen_log)


def test_a_live_socket_is_refused_and_left_alone(short_dir):
    path = short_dir / "moed.sock"
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(str(path))
        other.listen(1)
        before = path.lstat().st_ino
        with pytest.raises(SocketInUseError) as e:
            bind_unix_socket(path)
        assert str(e.value) == f"another moed serves {path}"
        assert path.lstat().st_ino == before
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))  # still the other server's
            conn, _ = other.accept()
            conn.close()
    assert not (short_dir / "moed.sock.lock").exists()  # our lock did not outlive the attempt


def test_a_live_socket_with_a_full_backlog_is_still_live(short_dir):
    """A non-blocking connect to a server whose backlog is full fails with EAGAIN: that
    server is alive and its file must not be replaced."""
    path = short_dir / "moed.sock"
    clients = []
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(str(path))
        other.listen(0)
        try:
            for _ in range(16):
                c = socket.socket(socket.AF_UNIX)
                clients.append(c)
                c.setblocking(False)
                c.connect(str(path))
        except BlockingIOError:
            pass
        else:
            pytest.fail("the backlog never filled")
        with pytest.raises(SocketInUseError, match="another moed serves"):
            bind_unix_socket(path)
        assert stat.S_ISSOCK(path.lstat().st_mode)
    for c in clients:
        c.close()


@pytest.mark.parametrize("kind", ["file", "directory", "symlink to a stale socket"])
def test_a_path_that_is_not_a_socket_is_never_removed(short_dir, kind):
    path = short_dir / "moed.sock"
    if kind == "file":
        path.write_text("precious")
    elif kind == "directory":
        path.mkdir()
    else:
        _stale_socket(short_dir / "target.sock")
        path.symlink_to(short_dir / "target.sock")
    with pytest.raises(ListenError) as e:
        bind_unix_socket(path)
    assert not isinstance(e.value, SocketInUseError)
    assert str(e.value) == f"{path} exists and is not a socket; not replacing it"
    assert os.path.lexists(path)
    if kind == "file":
        assert path.read_text() == "precious"
    if kind.startswith("symlink"):
        assert path.is_symlink() and (short_dir / "target.sock").exists()


def test_a_lock_held_by_another_process_means_another_moed(short_dir):
    path = short_dir / "moed.sock"
    holder = ("import fcntl, os, sys\n"
              "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
              "fcntl.flock(fd, fcntl.LOCK_EX)\n"
              "print('locked', flush=True)\n"
              "sys.stdin.read()\n")
    with subprocess.Popen([sys.executable, "-c", holder, f"{path}.lock"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout.readline() == "locked\n"
        with pytest.raises(SocketInUseError) as e:
            bind_unix_socket(path)
        assert str(e.value).startswith(f"another moed serves {path}")
        assert not os.path.lexists(path)  # the socket path was not touched
        proc.stdin.close()
        assert proc.wait(timeout=WAIT) == 0
    with bind_unix_socket(path) as listener:  # the holder is gone: the lock is ours now
        assert _round_trip(listener) == b"x"


def test_a_second_bind_fails_until_the_first_closes(short_dir):
    path = short_dir / "moed.sock"
    first = bind_unix_socket(path)
    with pytest.raises(SocketInUseError, match="another moed serves"):
        bind_unix_socket(path)
    assert _round_trip(first) == b"x"  # the failed attempt left the first one serving
    first.close()
    with bind_unix_socket(path) as second:
        assert _round_trip(second) == b"x"


def test_close_removes_the_socket_and_the_lock_and_is_idempotent(short_dir):
    path = short_dir / "moed.sock"
    listener = bind_unix_socket(path)
    lock_path = Path(listener.lock_path)
    listener.close()
    assert not os.path.lexists(path) and not lock_path.exists()
    assert listener.sock.fileno() == -1
    listener.close()
    assert sorted(short_dir.iterdir()) == []


def test_close_leaves_a_socket_that_replaced_ours(short_dir, listen_log):
    path = short_dir / "moed.sock"
    listener = bind_unix_socket(path)
    os.unlink(path)
    with socket.socket(socket.AF_UNIX) as newer:
        newer.bind(str(path))
        newer.listen(1)
        ino = path.lstat().st_ino
        listener.close()
        assert path.lstat().st_ino == ino
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))  # still served by the newer owner
            newer.accept()[0].close()
    assert any(r["event"] == "socket_replaced" for r in listen_log)
    # The lock was released all the same; the newer owner's file is stale by now.
    with bind_unix_socket(path) as again:
        assert _round_trip(again) == b"x"


def _other_group() -> grp.struct_group:
    """A group we may give files to that is not our own primary group."""
    groups = set(os.getgroups()) if os.geteuid() else {g.gr_gid for g in grp.getgrall()}
    for gid in sorted(groups - {os.getegid()}):
        try:
            return grp.getgrgid(gid)
        except KeyError:
            continue
    pytest.skip("no second group to give the socket to")


def test_the_group_is_set_explicitly(short_dir):
    group = _other_group()
    path = short_dir / "moed.sock"
    with bind_unix_socket(path, group=group.gr_name):
        assert path.lstat().st_gid == group.gr_gid != os.getegid()
    with bind_unix_socket(path, group=str(group.gr_gid)):
        assert path.lstat().st_gid == group.gr_gid
    with bind_unix_socket(path):
        assert path.lstat().st_gid == os.getegid()


def test_an_unknown_group_is_an_error_naming_it(short_dir):
    path = short_dir / "moed.sock"
    with pytest.raises(ListenError) as e:
        bind_unix_socket(path, group="no-such-group-moed")
    assert str(e.value) == "socket_group 'no-such-group-moed': no such group"
    assert sorted(short_dir.iterdir()) == []  # nothing bound, no lock left


def test_a_path_too_long_for_a_unix_socket(short_dir):
    path = short_dir / ("s" * 120)
    with pytest.raises(ListenError, match="at most 107 bytes"):
        bind_unix_socket(path)


def test_adopt_fd_wraps_a_listening_socket_and_leaves_its_file_alone(short_dir):
    path = short_dir / "activated.sock"
    with socket.socket(socket.AF_UNIX) as original:
        original.bind(str(path))
        os.chmod(path, 0o600)
        original.listen(1)
        fd = os.dup(original.fileno())
        os.set_inheritable(fd, True)
        sock = adopt_fd(fd)
        with sock:
            assert sock.fileno() == fd and sock.family == socket.AF_UNIX
            assert not os.get_inheritable(fd)
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(str(path))
                sock.accept()[0].close()
            assert stat.S_IMODE(path.lstat().st_mode) == 0o600


@pytest.mark.parametrize("kind", ["unconnected socket", "datagram socket", "regular file",
                                  "closed fd"])
def test_adopt_fd_rejects_what_is_not_a_listening_stream_socket(tmp_path, kind):
    if kind == "unconnected socket":
        thing = socket.socket(socket.AF_UNIX)
        fd = thing.fileno()
    elif kind == "datagram socket":
        thing = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        fd = thing.fileno()
    elif kind == "regular file":
        thing = open(tmp_path / "f", "w")
        fd = thing.fileno()
    else:
        thing = open(tmp_path / "f", "w")
        fd = os.dup(thing.fileno())
        os.close(fd)
    with thing:
        with pytest.raises(ListenError, match=f"^fd {fd}: "):
            adopt_fd(fd)
        if kind != "closed fd":
            os.fstat(fd)  # the rejected fd was not closed behind the caller's back


CHILD = """
import json, os
from daemon.service.sdnotify import listen_fds
from daemon.service.listen import adopt_fd
fds = listen_fds(os.environ)
sock = adopt_fd(fds[0])
conn, _ = sock.accept()
conn.sendall(json.dumps({"fds": fds, "family": int(sock.family)}).encode())
conn.close()
"""


def test_socket_activation_end_to_end(short_dir):
    """systemd-socket-activate binds, passes fd 3 with LISTEN_FDS/LISTEN_PID; the child
    finds it with listen_fds and serves it with adopt_fd."""
    tool = shutil.which("systemd-socket-activate")
    assert tool, "systemd-socket-activate is missing: apt-get install systemd"
    path = short_dir / "moed.sock"
    with subprocess.Popen([tool, "-l", str(path), "-E", f"PYTHONPATH={ROOT}",
                           sys.executable, "-c", CHILD],
                          stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr.readline().startswith(f"Listening on {path}")
        mode = stat.S_IMODE(path.lstat().st_mode)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))
            reply = b"".join(iter(lambda: client.recv(4096), b""))
        rest = proc.stderr.read()
        assert proc.wait(timeout=WAIT) == 0, rest
    assert json.loads(reply) == {"fds": [3], "family": int(socket.AF_UNIX)}, rest
    assert stat.S_IMODE(path.lstat().st_mode) == mode
