"""The sd_notify protocol and socket activation, without libsystemd.

Protocol (systemd's sd_notify(3), sd_listen_fds(3)): the service manager names a datagram
AF_UNIX socket in ``$NOTIFY_SOCKET`` (a path, or an abstract-namespace name when it starts
with ``@``); each notification is one datagram of newline-separated ``KEY=VALUE`` lines
(``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ``EXTEND_TIMEOUT_USEC=...``,
``RELOADING=1``, ``STOPPING=1``). The watchdog interval is ``$WATCHDOG_USEC``, for us only
when ``$WATCHDOG_PID`` is unset or our pid. Activated sockets are fds 3 .. 3 + N - 1 where
N is ``$LISTEN_FDS``, for us only when ``$LISTEN_PID`` is our pid.

Nothing here reads ``os.environ``: the caller passes the environment in. Sending never
raises: the service must not fail because the manager went away; the first failure is
logged as a warning on "moed.sdnotify", later ones are counted silently.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

from telemetry.logs import get_logger

log = get_logger("sdnotify")

LISTEN_FDS_START = 3


def _monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Notifications to the service manager named by ``environ["NOTIFY_SOCKET"]``.

    environ: the process environment. Without ``NOTIFY_SOCKET`` every method is a no-op
    that returns False. monotonic_usec: CLOCK_MONOTONIC in microseconds (the clock
    ``RELOADING=1`` is stamped with; injectable for tests). Each send method returns
    whether the datagram was sent; none raises. Thread-safe. Owns one socket, closed by
    `close`.
    """

    def __init__(self, environ: Mapping[str, str], *,
                 monotonic_usec: Callable[[], int] = _monotonic_usec):
        name = environ.get("NOTIFY_SOCKET", "")
        self.address: str | None = ("\0" + name[1:]) if name.startswith("@") else (name or None)
        self._environ = dict(environ)
        self._monotonic_usec = monotonic_usec
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.send_failures = 0

    @property
    def enabled(self) -> bool:
        """Whether a service manager listens (``$NOTIFY_SOCKET`` is set)."""
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """Send ``lines`` (``KEY=VALUE`` each) as one datagram; False if not sent."""
        if self.address is None:
            return False
        data = "\n".join(lines).encode("utf-8")
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX,
                                               socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(data, self.address)
                return True
            except OSError as e:
                self.send_failures += 1
                if self.send_failures == 1:
                    log.warning("sd_notify_failed", message=lines[0].split("=")[0],
                                address=self.address.replace("\0", "@"), error=str(e),
                                effect="further failures not logged")
                return False

    def ready(self) -> bool:
        """``READY=1``: start-up (or a reload) is complete; the socket serves."""
        return self.send("READY=1")

    def status(self, text: str) -> bool:
        """``STATUS=text`` (shown by ``systemctl status``); newlines become spaces."""
        return self.send("STATUS=" + text.replace("\r", " ").replace("\n", " "))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: keep-alive, due every `watchdog_interval_s` seconds."""
        return self.send("WATCHDOG=1")

    def extend_timeout(self, usec: int) -> bool:
        """``EXTEND_TIMEOUT_USEC=usec``: the current start/stop phase needs ``usec`` more
        microseconds from now (repeat before it runs out while loading a large model)."""
        if usec < 0:
            raise ValueError(f"usec must be >= 0, got {usec}")
        return self.send(f"EXTEND_TIMEOUT_USEC={int(usec)}")

    def reloading(self) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (CLOCK_MONOTONIC, µs) as systemd >= 253
        requires; send `ready` when the reload is done."""
        return self.send("RELOADING=1", f"MONOTONIC_USEC={self._monotonic_usec()}")

    def stopping(self) -> bool:
        """``STOPPING=1``: shutdown has begun (draining)."""
        return self.send("STOPPING=1")

    def watchdog_interval_s(self) -> float | None:
        """Seconds between `watchdog` pings: half of ``$WATCHDOG_USEC``, or None when the
        watchdog is off, not ours (``$WATCHDOG_PID`` names another pid) or malformed."""
        try:
            usec = int(self._environ.get("WATCHDOG_USEC", ""))
        except ValueError:
            return None
        if usec <= 0:
            return None
        pid = self._environ.get("WATCHDOG_PID")
        if pid is not None and pid.strip() != str(os.getpid()):
            return None
        return usec / 2 / 1e6

    def close(self) -> None:
        """Close the socket (a later send opens a new one)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def listen_fds(environ: Mapping[str, str]) -> list[int]:
    """File descriptors passed by socket activation: ``[3, ..., 3 + $LISTEN_FDS - 1]``.

    Empty unless ``$LISTEN_FDS`` is a positive integer and ``$LISTEN_PID`` is this
    process's pid (the variables are inherited by children, which must not take the fds).
    The fds are returned as they are; `daemon.listen.adopt_fd` wraps one into a socket.
    """
    try:
        count = int(environ.get("LISTEN_FDS", ""))
        pid = int(environ.get("LISTEN_PID", ""))
    except ValueError:
        return []
    if pid != os.getpid() or count <= 0:
        return []
    return list(range(LISTEN_FDS_START, LISTEN_FDS_START + count))
