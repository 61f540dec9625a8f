"""The daemon's listening Unix socket: bound by moed itself, or adopted from systemd.

Binding (`bind_unix_socket`), for a socket at PATH:

1. take ``flock(LOCK_EX | LOCK_NB)`` on ``PATH.lock`` and keep it for the daemon's life
   (a second moed on the same path fails here, before it touches the socket file);
2. look at PATH without following links: nothing there, or a socket file that refuses
   connections (a stale one left by a killed daemon), is unlinked and replaced; a socket
   that accepts a connection means another server owns it (`SocketInUseError`); anything
   else (a regular file, a directory, a symlink) is never removed (`ListenError`);
3. bind, then ``chmod(PATH, mode)`` explicitly (the umask plays no part) and
   ``chown(PATH, -1, gid)`` when a group is configured, then listen — so no client can
   connect while the file has other permissions.

`UnixListener.close` unlinks the socket only if PATH is still the inode moed bound (a
newer daemon may have replaced it), then removes and releases the lock.

Socket activation (`adopt_fd`): systemd's moed.socket owns the file, its mode and group;
moed only wraps the inherited fd and never touches the path.

Missing parent directories are created with mode 0755. All functions block briefly
(filesystem calls, one non-blocking connect); call them before the event loop serves, or
from an executor.
"""
from __future__ import annotations

import fcntl
import grp
import os
import socket
import stat

from telemetry.logs import get_logger

log = get_logger("listen")

DIR_MODE = 0o755
LOCK_MODE = 0o644
BACKLOG = 1024       # the kernel caps it at net.core.somaxconn
UNIX_PATH_MAX = 107  # bytes of sun_path (108) minus the terminating NUL
_LOCK_ATTEMPTS = 16


class ListenError(OSError):
    """The socket cannot be bound or adopted; the message names the path, fd or group."""


class SocketInUseError(ListenError):
    """Another server answers on the socket path, or another moed holds its lock."""


def resolve_group(group: str) -> int:
    """The gid of ``group``: a group name (via the group database) or a numeric gid.

    Raises ListenError naming the group when it does not exist.
    """
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isascii() and group.isdigit():
            return int(group)
        raise ListenError(f"socket_group {group!r}: no such group") from None


def _make_parents(directory: str) -> None:
    """Create ``directory`` and its missing ancestors, each with mode 0755 exactly."""
    missing = []
    d = directory
    while d and not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            continue  # raced with another process: theirs is as good as ours
        os.chmod(d, DIR_MODE)


def _lock(lock_path: str, path: str) -> int:
    """An fd holding an exclusive flock on ``lock_path`` (created if missing).

    After locking, checks that ``lock_path`` is still the file locked: a holder that
    closes removes the file first, and a lock on a removed file would not exclude a
    third process that creates a new one.
    """
    for _ in range(_LOCK_ATTEMPTS):
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, LOCK_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SocketInUseError(f"another moed serves {path} (it holds {lock_path})") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            now = os.stat(lock_path)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is not None and (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev):
            return fd
        os.close(fd)  # the previous holder removed it between our open and flock: retry
    raise ListenError(f"cannot lock {lock_path}: it keeps being replaced")


def _answers(path: str) -> bool:
    """Whether a server accepts connections on the socket file ``path``.

    A non-blocking connect: refused (or the file gone) means stale; accepted, or a full
    backlog (EAGAIN), means alive. Other errors (e.g. EACCES) are raised as ListenError:
    we cannot tell, so we must not remove it.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except BlockingIOError:
            return True
        except OSError as e:
            raise ListenError(f"cannot tell whether {path} is in use: {e.strerror}") from None
        return True


class UnixListener:
    """A listening Unix socket bound by moed, with the lock that makes it ours.

    ``sock`` is the listening ``socket.socket`` (serve it with ``aiohttp.web.SockSite``);
    ``path`` its file. The listener owns ``sock``, the socket file and the lock until
    `close`.
    """

    def __init__(self, sock: socket.socket, path: str, lock_path: str, lock_fd: int,
                 identity: tuple[int, int]):
        self.sock = sock
        self.path = path
        self.lock_path = lock_path
        self._lock_fd: int | None = lock_fd
        self._identity = identity  # (st_ino, st_dev) of the socket file we bound

    def close(self) -> None:
        """Close the socket; unlink its file if it is still ours; drop the lock. Idempotent."""
        if self._lock_fd is None:
            return
        self.sock.close()
        try:
            st = os.lstat(self.path)
            if (st.st_ino, st.st_dev) == self._identity:
                os.unlink(self.path)
            else:
                log.warning("socket_replaced", socket=self.path,
                            reason="no longer the socket this moed bound", effect="left in place")
        except FileNotFoundError:
            pass
        try:
            os.unlink(self.lock_path)  # while still holding it: see _lock
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)
        self._lock_fd = None

    def __enter__(self) -> UnixListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bind_unix_socket(path: str | os.PathLike[str], *, mode: int = 0o660,
                     group: str | None = None, backlog: int = BACKLOG) -> UnixListener:
    """Bind and listen on a Unix stream socket at ``path`` (see the module docstring).

    mode: permission bits of the socket file (e.g. 0o660), set with chmod after bind.
    group: group name (or numeric gid) given ownership of the file; None leaves it.
    backlog: listen(2) backlog.

    Raises SocketInUseError ("another moed serves PATH") when a server answers on
    ``path`` or another process holds ``PATH.lock``; ListenError when ``path`` exists and
    is not a socket, is too long for a Unix socket, cannot be probed, or ``group`` does
    not exist or is not one the daemon may give files to; OSError from mkdir, bind or
    chmod (e.g. EACCES on the directory)."""
    path = os.fspath(path)
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ListenError(f"{path}: a Unix socket path is at most {UNIX_PATH_MAX} bytes")
    gid = resolve_group(group) if group is not None else None
    _make_parents(os.path.dirname(os.path.abspath(path)))
    lock_path = path + ".lock"
    lock_fd = _lock(lock_path, path)
    sock = None
    try:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise ListenError(f"{path} exists and is not a socket; not replacing it")
            if _answers(path):
                raise SocketInUseError(f"another moed serves {path}")
            log.warning("stale_socket_replaced", socket=path, reason="nothing answered on it")
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.bind(path)
        try:
            bound = os.lstat(path)
            os.chmod(path, mode)
            if gid is not None:
                try:
                    os.chown(path, -1, gid)
                except PermissionError as e:
                    raise ListenError(f"{path}: cannot give it to group {group!r}: {e.strerror} "
                                      "(the daemon must be a member of the group)") from None
            sock.listen(backlog)
            return UnixListener(sock, path, lock_path, lock_fd, (bound.st_ino, bound.st_dev))
        except BaseException:
            os.unlink(path)
            raise
    except BaseException:
        if sock is not None:
            sock.close()
        try:
            os.unlink(lock_path)
        except FileNotFoundError:
            pass
        os.close(lock_fd)
        raise


def adopt_fd(fd: int) -> socket.socket:
    """Wrap an inherited listening stream socket (socket activation, fd 3 usually).

    The socket's file, mode and group belong to the service manager and are left alone;
    the fd is made close-on-exec. Raises ListenError when ``fd`` is not an open, listening
    stream socket.
    """
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise ListenError(f"fd {fd}: not a socket ({e.strerror})") from None
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError as e:
        sock.detach()
        raise ListenError(f"fd {fd}: {e.strerror}") from None
    if sock.type != socket.SOCK_STREAM or not listening:
        sock.detach()
        raise ListenError(f"fd {fd}: not a listening stream socket (check ListenStream= "
                          "in moed.socket)")
    sock.set_inheritable(False)
    return sock


class AdoptedListener:
    """A socket-activated listener: the service manager owns the file; close only the fd."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        try:
            self.path = sock.getsockname() or f"fd {sock.fileno()}"
        except OSError:
            self.path = f"fd {sock.fileno()}"

    def close(self) -> None:
        self.sock.close()
