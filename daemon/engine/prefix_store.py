"""The prefix cache on disk: its blocks of KV kept across restarts, for agents that resend
long, growing prompts (a daemon restarted by an upgrade, a crash, kill -9).

File: ``<state_dir>/prefix-<model fingerprint[:16]>.kv``, written by `PrefixStore.save`
every flush of the state (daemon/service/background.py, FLUSH_INTERVAL_S) when the cache
has changed, and at shutdown; read once at start, before the daemon is ready. Layout:

    b"MOEDKV1\\n", the header's length (8 bytes, little-endian), the header (UTF-8 JSON),
    then each block's arrays, raw, in the header's order.

Header: {"version", "fingerprint" (the model's, whole), "numerics" (the mode in force:
the values of the KV depend on it), "block_tokens", "arrays" ([shape, dtype] of a block's
arrays, as KVCache.read returns them), "blocks" ([parent, salt, tokens] per block, the
most recent first, so a parent comes before its children: parent is the index of the
parent block in this list or -1 for the first block of a chain, salt that chain's
cache_salt / client key), "crc32" (one per block, of its bytes)}. At most `budget_bytes` of blocks
are written: the most recent ones, and since a parent is always more recent than its
children (daemon/engine/prefix_cache.py), every chain kept is whole.

Never trusted: a file of another model, numerics mode, block size or layout is
"foreign", one that is truncated, does not parse or whose payload does not match its
crc32 is "corrupt"; either is renamed to ``*.foreign-<UTC stamp>`` / ``*.corrupt-…``
(kept for a look, never read again) with a warning, and the cache starts empty. Writes
are atomic as the state files' are (daemon/store/state.py: temp file, fsync, rename,
fsync of the directory): a crash or kill -9 at any instant leaves the previous file or
the new one. Only the blocks the cache can hold are read (and checked); the file's size
must be that of every block it lists.
"""
from __future__ import annotations

import contextlib
import json
import os
import stat
import struct
import time
import zlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from daemon.store.state import DIR_MODE, set_aside, write_atomically
from telemetry.logs import get_logger

log = get_logger("prefix_store")

MAGIC = b"MOEDKV1\n"
VERSION = 1
MAX_HEADER_BYTES = 64 << 20          # the header of a file of millions of blocks
HEADER_BYTES_PER_BLOCK = 1024        # what one block's header entry takes, at most (salts included)
Layout = list[tuple[tuple[int, ...], str]]


@dataclass(frozen=True)
class SavedBlock:
    """One block as stored: its parent (index in the saved list, -1 for a chain's first
    block), its chain's salt (for a first block; JSON-able), its tokens, its arrays."""

    parent: int
    salt: Hashable | None
    tokens: tuple[int, ...]
    data: list[np.ndarray]


class _Bad(Exception):
    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind


def _salt_to_json(salt):
    """A salt as JSON (tuples tagged), or raise TypeError for one JSON cannot hold."""
    if salt is None or isinstance(salt, (str, int)) and not isinstance(salt, bool):
        return salt
    if isinstance(salt, tuple):
        return {"tuple": [_salt_to_json(s) for s in salt]}
    raise TypeError(f"salt of type {type(salt).__name__}")


def _salt_from_json(value):
    if value is None or isinstance(value, (str, int)) and not isinstance(value, bool):
        return value
    if isinstance(value, dict) and set(value) == {"tuple"} and isinstance(value["tuple"], list):
        return tuple(_salt_from_json(v) for v in value["tuple"])
    raise _Bad("corrupt", f"a salt of the form {str(value)[:40]!r}")


class PrefixStore:
    """The saved prefix cache of one model in `state_dir`.

    fingerprint: the model's (Checkpoint.fingerprint()); numerics: the mode in force;
    block_tokens and layout ([(shape, dtype)] of one block's arrays): what a block must
    be to be used; budget_bytes: the most block bytes a save writes. Raises OSError when
    the directory cannot be created.
    """

    def __init__(self, state_dir: Path, fingerprint: str, *, numerics: str, block_tokens: int,
                 layout: Layout, budget_bytes: int, clock: Callable[[], float] = time.time):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        self.path = self.state_dir / f"prefix-{fingerprint[:16]}.kv"
        self.fingerprint, self.numerics = fingerprint, numerics
        self.block_tokens = block_tokens
        self.layout = [(tuple(int(d) for d in shape), str(np.dtype(dtype))) for shape, dtype in layout]
        self.block_bytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in self.layout)
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._remove_stale_temps()

    def _remove_stale_temps(self) -> None:
        """Temp files of saves whose process died mid-write (kill -9, a crash): each
        names its writer's pid; those of processes still alive are theirs."""
        prefix = f".{self.path.name}.tmp-"
        for entry in os.scandir(self.state_dir):
            if not entry.name.startswith(prefix):
                continue
            try:
                os.kill(int(entry.name[len(prefix):]), 0)
            except ValueError:
                continue
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
            except PermissionError:      # alive, another user's
                continue

    # -- writing

    def save(self, blocks: list[SavedBlock]) -> int:
        """Write the first blocks of `blocks` (most recent first, parents before children)
        that fit the budget, atomically; returns how many. Blocks whose salt JSON cannot
        hold are left out, with their children. Raises OSError (the directory)."""
        kept: list[SavedBlock] = []
        index: dict[int, int] = {}            # position in `blocks` -> position in `kept`
        header_blocks = []
        limit = self.budget_bytes // self.block_bytes if self.block_bytes else 0
        for i, b in enumerate(blocks):
            if len(kept) >= limit:
                break
            if b.parent >= 0:
                if b.parent not in index:
                    continue                    # its parent was left out
                entry = [index[b.parent], None, list(b.tokens)]
            else:
                try:
                    entry = [-1, _salt_to_json(b.salt), list(b.tokens)]
                except TypeError:
                    continue
            index[i] = len(kept)
            kept.append(b)
            header_blocks.append(entry)
        crcs = []
        for b in kept:
            crc = 0
            for a in b.data:
                crc = zlib.crc32(np.ascontiguousarray(a).data, crc)
            crcs.append(crc)
        header = json.dumps({"version": VERSION, "fingerprint": self.fingerprint,
                             "numerics": self.numerics, "block_tokens": self.block_tokens,
                             "arrays": [[list(s), d] for s, d in self.layout],
                             "blocks": header_blocks, "crc32": crcs},
                            separators=(",", ":")).encode()

        def write(f) -> None:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for b in kept:
                for a in b.data:
                    f.write(np.ascontiguousarray(a).data)
        write_atomically(self.path, write)
        return len(kept)

    # -- reading

    def load(self, max_blocks: int) -> list[SavedBlock]:
        """The saved blocks (at most max_blocks, the most recent; parents before
        children), or [] when there is no file or a bad one (set aside, with a warning)."""
        try:     # non-blocking: a FIFO put there must not hang the start
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return []
        except IsADirectoryError:
            fd = None
        try:
            if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _Bad("corrupt", "not a regular file")
            with os.fdopen(fd, "rb") as f:
                fd = None
                return self._read(f, max_blocks)
        except _Bad as bad:
            set_aside(self.path, bad.kind, str(bad), self._clock, effect="the prefix cache starts empty")
            return []
        finally:
            if fd is not None:
                os.close(fd)

    def _read(self, f, max_blocks: int) -> list[SavedBlock]:
        if f.read(len(MAGIC)) != MAGIC:
            raise _Bad("corrupt", "not a moed prefix cache file")
        raw = f.read(8)
        if len(raw) != 8:
            raise _Bad("corrupt", "truncated header")
        (size,) = struct.unpack("<Q", raw)
        # a block's header entry is under HEADER_BYTES_PER_BLOCK bytes (16 token ids, a
        # parent, a salt, a crc): more than the blocks this store or cache could keep is
        # not a file this daemon wrote, and is not parsed
        allowed = max(max_blocks, self.budget_bytes // max(self.block_bytes, 1))
        if size > min(MAX_HEADER_BYTES, 4096 + HEADER_BYTES_PER_BLOCK * (allowed + 1)):
            raise _Bad("corrupt", f"a header of {size} bytes, more than {allowed} blocks take")
        raw = f.read(size)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise _Bad("corrupt", f"the header is not UTF-8 JSON ({e})") from None
        needed = ("version", "fingerprint", "numerics", "block_tokens", "arrays", "blocks", "crc32")
        if not isinstance(header, dict) or any(k not in header for k in needed):
            raise _Bad("corrupt", "the header is not a prefix cache header")
        for key, want in (("version", VERSION), ("fingerprint", self.fingerprint),
                          ("numerics", self.numerics), ("block_tokens", self.block_tokens),
                          ("arrays", [[list(s), d] for s, d in self.layout])):
            if header.get(key) != want:
                raise _Bad("foreign", f"{key} {str(header.get(key))[:80]!r}, this daemon needs "
                                      f"{str(want)[:80]!r}")
        entries, crcs = header.get("blocks"), header.get("crc32")
        if not isinstance(entries, list) or not isinstance(crcs, list) or len(crcs) != len(entries):
            raise _Bad("corrupt", "no block list, or not one checksum a block")
        # the file's size says it holds every block, no more: nothing past what is kept is read
        if os.fstat(f.fileno()).st_size != len(MAGIC) + 8 + size + len(entries) * self.block_bytes:
            raise _Bad("corrupt", f"its size is not that of the {len(entries)} blocks it lists")
        out: list[SavedBlock] = []
        keys: set = set()
        for i, entry in enumerate(entries[:max_blocks]):
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int)
                    and -1 <= entry[0] < i and isinstance(entry[2], list)
                    and len(entry[2]) == self.block_tokens
                    and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in entry[2])):
                raise _Bad("corrupt", f"block {i} is not [parent, salt, tokens]")
            data, crc = [], 0
            for shape, dtype in self.layout:
                n = int(np.prod(shape)) * np.dtype(dtype).itemsize
                buf = f.read(n)
                if len(buf) != n:
                    raise _Bad("corrupt", f"truncated at block {i} of {len(entries)}")
                crc = zlib.crc32(buf, crc)
                data.append(np.frombuffer(buf, dtype).reshape(shape).copy())
            if crc != crcs[i]:
                raise _Bad("corrupt", f"block {i} does not match its crc32")
            key = (entry[0], json.dumps(entry[1]) if entry[0] < 0 else None, tuple(entry[2]))
            if key in keys:             # a cache never holds one chain twice
                raise _Bad("corrupt", f"block {i} repeats an earlier block")
            keys.add(key)
            out.append(SavedBlock(entry[0], _salt_from_json(entry[1]) if entry[0] < 0 else None,
                                  tuple(entry[2]), data))
        return out

