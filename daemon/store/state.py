"""The persisted usage statistics: one versioned JSON file per model in the state directory.

File: ``<state_dir>/usage-<fingerprint[:16]>.json`` holding
``{"version": 1, "fingerprint": <full model fingerprint>, "written_unix": <seconds>,
"tokens": <tokens counted into the file, all writers together>, "payload": {...}}``.
The payload is opaque here: the scheduler owns its content and its merge rule.

Guarantees. Writes are atomic (temp file in the same directory, write, flush, fsync,
rename over, fsync of the directory), so a crash at any instant leaves the old file or the
new one, never a torn one. Every read-modify-write runs under an exclusive ``flock`` on
``usage-<fingerprint[:16]>.lock``, so two processes serving the same model merge their
counts instead of overwriting each other: ``save(merge)`` hands ``merge`` the payload
currently on disk. A file that is corrupt (not JSON, truncated, wrong shape) is renamed to
``*.corrupt-<UTC timestamp>``; one of another version or another model to
``*.foreign-<UTC timestamp>``; so is one larger than the store's ``max_bytes``, unread (a
bound the caller derives from the model, far above any real file: reading a file of
gigabytes would exhaust memory before its JSON could be refused); a warning is logged on "moed.state" and learning starts
fresh. The caller may hand ``load`` and ``save`` a ``check`` of the payload (the
scheduler's validation): a payload it refuses (ValueError) is corrupt too, and set aside
under the same lock, so a hand-edited or damaged file is kept for a look instead of being
overwritten by the next save. Content is never trusted and never fatal; OSErrors of the
directory itself (permissions, a full disk) are raised to the caller.

A directory moed may read but not write (a read-only mount, another user's directory) is
read and used: ``writable`` is False, ``load`` reads without the lock (a writer replaces
the file with one rename, so a reader sees the old file or the new one), a bad file is
ignored instead of set aside, and ``save`` raises `StateReadOnlyError` without touching
anything. Callers check ``writable`` and say so once.

Blocking: ``load`` and ``save`` block on the lock and on fsync; the daemon calls them from
the engine thread (which owns the usage counts), never on the event loop. aiofiles would
split the one critical section (flock, read-merge, temp file, fsync, rename, fsync of the
directory) into about seven executor hops, it has no fsync, and it measured no better
from the loop: bench/state_io.py.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import math
import os
import pwd
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from telemetry.logs import get_logger

log = get_logger("state")

VERSION = 1
DIR_MODE = 0o700
FILE_MODE = 0o600
MAX_BYTES = 1 << 20     # a state file of a few settings (the tuner's); usage files pass theirs
FAULT_STEPS = ("tmp_written", "fsynced", "renamed")  # where the _fault hook is called
KINDS = ("usage", "tuned", "experts")   # file name stems (StateStore's kind)
Check = Callable[[dict], object]    # validates a payload; raises ValueError naming the field


def default_state_dir(env: Mapping[str, str]) -> Path:
    """Where state lives when ``--state-dir`` is not given.

    ``$STATE_DIRECTORY`` (its first entry; systemd sets a colon-separated list from
    ``StateDirectory=``), else ``$XDG_STATE_HOME/moed`` (ignored unless absolute, per the
    XDG base directory spec), else ``$HOME/.local/state/moed`` (home from the password
    database when HOME is unset). ``env`` is the environment, passed in by the caller.
    """
    state_directory = env.get("STATE_DIRECTORY", "").split(":")[0]
    if state_directory:
        return Path(state_directory)
    xdg = env.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "moed"
    home = env.get("HOME") or pwd.getpwuid(os.getuid()).pw_dir
    return Path(home) / ".local" / "state" / "moed"


class StateReadOnlyError(OSError):
    """The state directory can be read but not written; nothing was saved."""


@dataclass(frozen=True)
class StateRecord:
    """A validated state file: the envelope fields and the caller's payload."""

    fingerprint: str
    written_unix: float
    tokens: int
    payload: dict


class _Invalid(Exception):
    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind = kind  # "corrupt" or "foreign"


class StateStore:
    """Load and save the usage-statistics file of one model.

    ``state_dir``: the directory (created with mode 0o700 if missing). ``fingerprint``:
    the model fingerprint (``Checkpoint.fingerprint()``), at least 16 characters.
    ``clock``: seconds since the epoch, for ``written_unix`` and set-aside names.
    ``_fault``: test hook called with each step of FAULT_STEPS during ``save``.
    ``kind``: the file's name stem, ``usage`` (learned expert usage), ``tuned`` (the
    self-tuner's winners, daemon.tuning) or ``experts`` (the expert cache's working set,
    daemon.store.working_set); each kind has its own file and lock.
    ``max_bytes``: the largest file read; a larger one is corrupt, set aside unread (for
    usage files, scheduler.usage.max_state_file_bytes of the model).
    """

    def __init__(self, state_dir: Path, fingerprint: str, *,
                 clock: Callable[[], float] = time.time,
                 _fault: Callable[[str], None] | None = None, kind: str = "usage",
                 max_bytes: int = MAX_BYTES):
        if len(fingerprint) < 16:
            raise ValueError(f"fingerprint {fingerprint!r} is shorter than 16 characters")
        self.state_dir = Path(state_dir)
        self.fingerprint = fingerprint
        self.state_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        if kind not in KINDS:
            raise ValueError(f"state file kind must be 'usage', 'tuned' or 'experts', got {kind!r}")
        stem = f"{kind}-{fingerprint[:16]}"
        self.path = self.state_dir / f"{stem}.json"
        self.lock_path = self.state_dir / f"{stem}.lock"
        self._tmp_prefix = f".{stem}.json.tmp-"
        self._clock = clock
        self._fault = _fault
        self.max_bytes = max_bytes
        self.writable = _writable(self.state_dir, self.lock_path)

    # -- reading

    def load(self, check: Check | None = None) -> dict | None:
        """The payload on disk, or None (no file, or a bad one that was set aside).

        check: called with the payload; a ValueError from it (its message names the
        field) makes the file corrupt: set aside, None returned."""
        record = self.load_record(check)
        return None if record is None else record.payload

    def load_record(self, check: Check | None = None) -> StateRecord | None:
        """The whole validated file, or None (see ``load``). Takes the lock briefly
        (not in a read-only directory)."""
        if not self.writable:
            return self._read_validated(check)
        with self._locked():
            return self._read_validated(check)

    def _read_validated(self, check: Check | None = None) -> StateRecord | None:
        """Read and check the file; set a bad one aside. Call with the lock held."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO must not block us
        except FileNotFoundError:
            return None
        try:
            try:
                st = os.fstat(fd)
                mode = st.st_mode
                if stat.S_ISDIR(mode):
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(self.path))
                if not stat.S_ISREG(mode):
                    raise _Invalid("corrupt", f"not a regular file ({stat.filemode(mode)})")
                self._check_size(st.st_size)
                with os.fdopen(os.dup(fd), "rb") as f:
                    raw = f.read(self.max_bytes + 1)     # bounded: the file may be growing
                self._check_size(len(raw))
            finally:
                os.close(fd)
            record = self._parse(raw)
            if check is not None:
                try:
                    check(record.payload)
                except ValueError as e:
                    raise _Invalid("corrupt", f"payload refused: {e}") from None
            return record
        except _Invalid as bad:
            if self.writable:
                self._set_aside(bad)
            else:
                log.warning("state_file_ignored", path=str(self.path), kind=bad.kind,
                            reason=str(bad), effect="the directory is read-only: left in place")
            return None

    def _check_size(self, size: int) -> None:
        if size > self.max_bytes:
            raise _Invalid("corrupt", f"{size} bytes, more than the {self.max_bytes} a state "
                                      "file of this model can take; not read")

    def _parse(self, raw: bytes) -> StateRecord:
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise _Invalid("corrupt", f"not UTF-8 JSON ({e})") from None
        if not isinstance(doc, dict) or "version" not in doc:
            raise _Invalid("corrupt", "not a moed state object")
        if doc["version"] != VERSION:
            raise _Invalid("foreign", f"version {doc['version']!r}, this moed reads {VERSION}")
        if doc.get("fingerprint") != self.fingerprint:
            raise _Invalid("foreign", f"model fingerprint {doc.get('fingerprint')!r}, "
                                      f"serving {self.fingerprint!r}")
        written, tokens, payload = (doc.get(k) for k in ("written_unix", "tokens", "payload"))
        if not (isinstance(written, (int, float)) and not isinstance(written, bool)
                and _finite(written)):
            raise _Invalid("corrupt", f"written_unix {written!r} is not a number")
        if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0):
            raise _Invalid("corrupt", f"tokens {tokens!r} is not a count")
        if not isinstance(payload, dict):
            raise _Invalid("corrupt", "payload is not an object")
        return StateRecord(self.fingerprint, float(written), tokens, payload)

    def _set_aside(self, bad: _Invalid) -> None:
        set_aside(self.path, bad.kind, str(bad), self._clock, effect="learning starts fresh")

    # -- writing

    def save(self, merge: Callable[[dict | None], dict], *, tokens: int = 0,
             check: Check | None = None) -> StateRecord:
        """Read-merge-write the file under the lock; returns what was written.

        ``merge(current)`` gets the payload now on disk (None if absent, or set aside
        because it is corrupt or ``check`` refused it, as in ``load``) and
        returns the payload to write (a JSON-serialisable dict; NaN and infinities are
        refused). ``tokens``: tokens this writer served since its last save, added to the
        file's running total. Raises ValueError/TypeError for a payload JSON cannot hold
        (nothing is written then) and OSError for failures of the directory.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if not self.writable:
            raise StateReadOnlyError(f"{self.state_dir} is read-only: {self.path.name} not saved")
        with self._locked():
            self._remove_stale_temps()
            current = self._read_validated(check)
            payload = merge(None if current is None else current.payload)
            if not isinstance(payload, dict):
                raise TypeError(f"merge returned {type(payload).__name__}, not a dict")
            record = StateRecord(self.fingerprint, self._clock(),
                                 (0 if current is None else current.tokens) + tokens, payload)
            data = json.dumps({"version": VERSION, "fingerprint": record.fingerprint,
                               "written_unix": record.written_unix, "tokens": record.tokens,
                               "payload": record.payload},
                              allow_nan=False, separators=(",", ":")).encode()
            self._write_atomically(data)
        return record

    def _write_atomically(self, data: bytes) -> None:
        write_atomically(self.path, lambda f: f.write(data), tmp_prefix=self._tmp_prefix, step=self._step)

    def _remove_stale_temps(self) -> None:
        """Temp files of writers that died mid-save (only a lock holder writes one)."""
        for entry in os.scandir(self.state_dir):
            if entry.name.startswith(self._tmp_prefix):
                os.unlink(entry.path)

    def _step(self, name: str) -> None:
        if self._fault is not None:
            self._fault(name)

    def _locked(self) -> _FileLock:
        return _FileLock(self.lock_path)


def write_atomically(path: Path, write: Callable, *, tmp_prefix: str | None = None,
                     step: Callable[[str], None] | None = None) -> None:
    """Replace `path` with what write(f) writes to a binary file, so that a crash at any
    instant leaves the old file or the new one: a temp file in the same directory
    (`tmp_prefix` + pid; mode FILE_MODE), flush, fsync, rename over, fsync of the
    directory. step: called with each of FAULT_STEPS (a test hook). Raises OSError; the
    temp file is removed on any failure."""
    path = Path(path)
    tmp = path.parent / f"{tmp_prefix or '.' + path.name + '.tmp-'}{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if step:
                step("tmp_written")
            os.fsync(f.fileno())
            if step:
                step("fsynced")
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if step:
        step("renamed")
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_aside(path: Path, kind: str, reason: str, clock: Callable[[], float], effect: str) -> None:
    """Rename a bad state file to ``<name>.<kind>-<UTC stamp>`` (kind "corrupt" or
    "foreign"), never to be read again, with a warning saying why and `effect`; a file
    that cannot be moved is left and said so."""
    path = Path(path)
    stamp = datetime.datetime.fromtimestamp(clock(), datetime.timezone.utc)
    base = f"{path.name}.{kind}-{stamp:%Y%m%dT%H%M%S.%fZ}"
    target = path.parent / base
    n = 0
    while target.exists():
        n += 1
        target = path.parent / f"{base}-{n}"
    try:
        os.rename(path, target)
    except OSError as e:
        log.warning("state_file_unusable", path=str(path), kind=kind, reason=reason,
                    error=f"could not move it aside: {e}", effect=effect)
        return
    log.warning("state_file_set_aside", path=str(path), kind=kind, reason=reason,
                moved_to=str(target), effect=effect)


def _finite(x: int | float) -> bool:
    """math.isfinite, False for an integer too large for a float (JSON allows one)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _writable(state_dir: Path, lock_path: Path) -> bool:
    """Whether moed may write in `state_dir`: the lock file opens for writing (created if
    missing). EROFS, EACCES, EPERM: no. Other OSErrors are raised."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except (PermissionError, OSError) as e:
        if isinstance(e, PermissionError) or e.errno == errno.EROFS:
            return False
        raise
    os.close(fd)
    return os.access(state_dir, os.W_OK)


class _FileLock:
    """An exclusive ``flock`` on a lock file, held for a ``with`` block.

    flock locks belong to the open file description, so two opens exclude each other
    even within one process, and the kernel drops the lock when its holder dies.
    """

    def __init__(self, path: Path):
        self._path = path
        self._fd = -1

    def __enter__(self) -> None:
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self._fd)
            raise

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)  # closing the last fd of the description releases the lock
