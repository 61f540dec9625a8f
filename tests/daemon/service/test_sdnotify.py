"""sd_notify and socket activation (daemon/service/sdnotify.py), against a real datagram socket."""
from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid

import pytest

from daemon.service.sdnotify import Notifier, listen_fds


@pytest.fixture
def manager():
    """A datagram socket standing in for systemd's notify socket: (environ, socket)."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="sdn")  # AF_UNIX paths are short
    path = os.path.join(directory, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)  # every expected datagram is already queued when we read
    yield {"NOTIFY_SOCKET": path}, sock
    sock.close()
    os.unlink(path)
    os.rmdir(directory)


def _received(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def test_each_message_is_one_exact_datagram(manager):
    environ, sock = manager
    n = Notifier(environ, monotonic_usec=lambda: 123456789)
    assert n.enabled
    assert n.ready() and n.status("decoding 12.5 tokens/s, hit rate 0.93")
    assert n.watchdog() and n.extend_timeout(30_000_000) and n.reloading() and n.stopping()
    assert _received(sock) == [
        "READY=1",
        "STATUS=decoding 12.5 tokens/s, hit rate 0.93",
        "WATCHDOG=1",
        "EXTEND_TIMEOUT_USEC=30000000",
        "RELOADING=1\nMONOTONIC_USEC=123456789",
        "STOPPING=1",
    ]
    n.close()


def test_status_cannot_inject_other_assignments(manager):
    environ, sock = manager
    n = Notifier(environ)
    n.status("line one\nREADY=1\r\nx")
    assert _received(sock) == ["STATUS=line one READY=1  x"]
    n.close()


def test_reloading_is_stamped_with_clock_monotonic_in_microseconds(manager):
    environ, sock = manager
    n = Notifier(environ)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    n.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    (message,) = _received(sock)
    first, second = message.split("\n")
    assert first == "RELOADING=1"
    key, value = second.split("=")
    assert key == "MONOTONIC_USEC" and before <= int(value) <= after
    n.close()


def test_abstract_namespace_socket():
    name = f"moed-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.address == "\0" + name
        assert n.ready()
        assert sock.recv(100) == b"READY=1"
        n.close()


def test_no_notify_socket_is_a_no_op():
    n = Notifier({"WATCHDOG_USEC": "1000000"})
    assert not n.enabled
    assert [n.ready(), n.status("x"), n.watchdog(), n.extend_timeout(1), n.reloading(),
            n.stopping()] == [False] * 6
    assert n.send_failures == 0
    n.close()


@pytest.fixture
def sdnotify_log(log_records):
    return log_records("moed.sdnotify")


def test_send_errors_never_raise_and_warn_once(tmp_path, sdnotify_log):
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})  # nobody listens there
    assert n.ready() is False
    assert n.watchdog() is False
    assert n.stopping() is False
    assert n.send_failures == 3
    warnings = [r for r in sdnotify_log if r["level"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["event"] == "sd_notify_failed"
    assert warnings[0]["message"] == "READY"
    n.close()


def test_extend_timeout_rejects_negative(manager):
    environ, sock = manager
    n = Notifier(environ)
    with pytest.raises(ValueError):
        n.extend_timeout(-1)
    assert _received(sock) == []
    n.close()


@pytest.mark.parametrize("env, interval", [
    ({"WATCHDOG_USEC": "60000000"}, 30.0),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "<self>"}, 1.5),
    ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "<other>"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({}, None)])
def test_watchdog_interval_is_half_of_watchdog_usec_when_ours(env, interval):
    pid = {"<self>": str(os.getpid()), "<other>": str(os.getpid() + 1)}
    environ = {k: pid.get(v, v) for k, v in env.items()}
    assert Notifier(environ).watchdog_interval_s() == interval


@pytest.mark.parametrize("env, fds", [
    ({"LISTEN_FDS": "1", "LISTEN_PID": "<self>"}, [3]),
    ({"LISTEN_FDS": "3", "LISTEN_PID": "<self>"}, [3, 4, 5]),
    ({"LISTEN_FDS": "1", "LISTEN_PID": "<other>"}, []),  # meant for our parent or child
    ({"LISTEN_FDS": "1"}, []),
    ({"LISTEN_FDS": "0", "LISTEN_PID": "<self>"}, []),
    ({"LISTEN_FDS": "x", "LISTEN_PID": "<self>"}, []),
    ({}, [])])
def test_listen_fds(env, fds):
    pid = {"<self>": str(os.getpid()), "<other>": str(os.getpid() + 1)}
    assert listen_fds({k: pid.get(v, v) for k, v in env.items()}) == fds
