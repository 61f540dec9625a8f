"""Open a Hugging Face safetensors checkpoint and read its tensors straight from the files.

Format (safetensors spec, https://huggingface.co/docs/safetensors): a shard file is an
8-byte little-endian unsigned header length ``N``, then ``N`` bytes of UTF-8 JSON mapping
tensor name -> ``{"dtype", "shape", "data_offsets": [begin, end]}``, with an optional
``"__metadata__"`` object; ``begin``/``end`` count bytes from the first byte after the
header. A sharded model adds ``model.safetensors.index.json`` whose ``"weight_map"`` maps
tensor name -> shard file name; an unsharded one is a single ``model.safetensors``.

Conventions: every offset here is an *absolute* file offset in bytes (``8 + N + begin``),
every size is in bytes. Data is little-endian, row-major, and loaded in its native dtype
(bf16 stays ``ml_dtypes.bfloat16``, F8_E4M3 ``ml_dtypes.float8_e4m3fn``, F8_E8M0
``ml_dtypes.float8_e8m0fnu``, U8 ``uint8``; a little-endian host is assumed). What the
bytes of a quantised weight mean is ext/formats/quant.py's business. We parse headers
ourselves, not with the safetensors library, because expert reads need byte ranges for
direct ``preadv``. Everything is validated at open; errors are ``CheckpointError``
subclasses whose message and ``.path`` / ``.tensor`` name the offending file and tensor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ext.formats.files import MetadataFileError, read_json

log = logging.getLogger("moed.checkpoint")   # ext/ logs with the standard library: fields in extra=

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's bound on N
# Bytes per element of every dtype we recognise (for range checks).
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
# The subset load() can return, little-endian as stored on disk.
NUMPY_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
                "BF16": np.dtype(ml_dtypes.bfloat16),
                "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
                "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
                "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8)}
# Float dtypes the kernels compute with as they are (no scales).
FLOAT_DTYPES = ("F32", "F16", "BF16")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; ``.path`` and ``.tensor`` name the culprit (or None)."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None,
                 tensor: str | None = None):
        self.path = None if path is None else os.fspath(path)
        self.tensor = tensor
        where = [self.path] if path is not None else []
        where += [f"tensor {tensor!r}"] if tensor is not None else []
        super().__init__(": ".join([*where, message]))


class HeaderError(CheckpointError):
    """Shard header (or index JSON) is malformed: bad length, bad JSON, bad entry."""


class TruncatedFileError(CheckpointError):
    """A shard file ends before the end of its last tensor."""


class TensorRangeError(CheckpointError):
    """A tensor's byte range runs backwards or disagrees with shape x dtype size."""


class TensorOverlapError(CheckpointError):
    """Two tensors' byte ranges in one shard overlap."""


class UnsupportedDtypeError(CheckpointError):
    """A dtype string that is unknown (at open) or known but not loadable (at load)."""


class MissingShardError(CheckpointError):
    """The index names a shard file that does not exist."""


class MissingTensorError(CheckpointError):
    """A tensor is not where the index says, or a name is not in the checkpoint."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``nbytes`` bytes at absolute byte ``offset`` of file ``path``.

    ``dtype`` is the safetensors dtype string (e.g. ``"BF16"``), ``shape`` the row-major
    shape; ``nbytes == prod(shape) * DTYPE_SIZES[dtype]``.
    """

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def index(self, i: int) -> TensorInfo:
        """Entry ``i`` of the leading axis as a tensor of its own (a byte range inside this one).

        For tensors fused over experts ([E, ...], as GPT-OSS stores ``gate_up_proj_blocks``):
        name ``f"{name}[{i}]"``, shape ``shape[1:]``, ``nbytes / shape[0]`` bytes at
        ``offset + i * that``. Raises IndexError when ``i`` is not in ``[0, shape[0])``.
        """
        if not self.shape or not 0 <= i < self.shape[0]:
            raise IndexError(f"{self.name}: index {i} outside the leading axis of {list(self.shape)}")
        step = self.nbytes // self.shape[0]
        return TensorInfo(name=f"{self.name}[{i}]", path=self.path, offset=self.offset + i * step,
                          nbytes=step, dtype=self.dtype, shape=self.shape[1:])

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype ``load()`` returns; raises UnsupportedDtypeError if not loadable."""
        try:
            return NUMPY_DTYPES[self.dtype]
        except KeyError:
            raise UnsupportedDtypeError(
                f"dtype {self.dtype} cannot be loaded (supported: {', '.join(NUMPY_DTYPES)})",
                path=self.path, tensor=self.name) from None


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_entry(path: str, name: str, entry: object, data_start: int) -> TensorInfo:
    """Validate one header entry and turn it into a TensorInfo (range checks included)."""
    def is_count(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    fields = entry if isinstance(entry, dict) else {}
    dtype, shape, offsets = (fields.get(k) for k in ("dtype", "shape", "data_offsets"))
    if not (isinstance(dtype, str) and isinstance(shape, list) and all(map(is_count, shape))
            and isinstance(offsets, list) and len(offsets) == 2
            and all(map(is_count, offsets))):
        raise HeaderError(f"want dtype: str, shape: [int >= 0], data_offsets: [begin, end]; "
                          f"got {entry!r}", path=path, tensor=name)
    if dtype not in DTYPE_SIZES:
        raise UnsupportedDtypeError(f"unknown dtype {dtype!r}", path=path, tensor=name)
    begin, end = offsets
    if end < begin:
        raise TensorRangeError(f"data_offsets [{begin}, {end}] run backwards",
                               path=path, tensor=name)
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise TensorRangeError(
            f"data_offsets [{begin}, {end}] span {end - begin} bytes but shape {shape} "
            f"x {dtype} needs {expected}", path=path, tensor=name)
    return TensorInfo(name=name, path=path, offset=data_start + begin, nbytes=expected,
                      dtype=dtype, shape=tuple(shape))


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse and validate the header of one safetensors shard file.

    Reads only the 8 + N header bytes (file size from ``os.stat``). Returns tensor name ->
    TensorInfo (``path`` made absolute) in header order, ``__metadata__`` skipped.
    Raises HeaderError (file < 8 bytes, N beyond the file or above MAX_HEADER_BYTES, not
    UTF-8 JSON object, bad entry), UnsupportedDtypeError (unknown dtype string),
    TensorRangeError (range backwards or != shape x dtype size), TensorOverlapError (two
    ranges overlap; names both), TruncatedFileError (file ends before the last tensor).
    Bytes after the last tensor are ignored with a ``shard_trailing_bytes`` warning.
    """
    path = os.path.abspath(os.fspath(path))
    size = os.stat(path).st_size
    if size < 8:
        raise HeaderError(f"file is {size} bytes, too short for a header", path=path)
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8 or header_len > MAX_HEADER_BYTES:
            raise HeaderError(f"header length {header_len} exceeds the file ({size} bytes) "
                              f"or the {MAX_HEADER_BYTES}-byte limit", path=path)
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise HeaderError(f"header is not valid UTF-8 JSON: {e}", path=path) from None
    except RecursionError:
        raise HeaderError("header JSON is nested too deeply", path=path) from None
    if not isinstance(header, dict):
        raise HeaderError("header JSON is not an object", path=path)
    if not isinstance(header.get("__metadata__", {}), dict):
        raise HeaderError("__metadata__ is not an object", path=path)

    data_start = 8 + header_len
    tensors = {name: _parse_entry(path, name, entry, data_start)
               for name, entry in header.items() if name != "__metadata__"}

    # Overlaps: sweep by start, compare with the furthest-reaching non-empty range so far.
    reach: TensorInfo | None = None
    for t in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        if t.nbytes == 0:
            continue
        if reach is not None and t.offset < reach.offset + reach.nbytes:
            raise TensorOverlapError(
                f"bytes [{t.offset}, {t.offset + t.nbytes}) overlap tensor {reach.name!r} "
                f"at [{reach.offset}, {reach.offset + reach.nbytes})", path=path, tensor=t.name)
        if reach is None or t.offset + t.nbytes > reach.offset + reach.nbytes:
            reach = t
    last = max(tensors.values(), key=lambda t: t.offset + t.nbytes, default=None)
    if last is not None and last.offset + last.nbytes > size:
        raise TruncatedFileError(f"file is {size} bytes but the tensor ends at byte "
                                 f"{last.offset + last.nbytes}", path=path, tensor=last.name)
    data_end = data_start if last is None else max(data_start, last.offset + last.nbytes)
    if data_end < size:
        _warn_trailing(path, size, data_end, None if last is None else last.name)
    return tensors


_warned_trailing: set[tuple[str, int, int]] = set()
_warned_lock = threading.Lock()


def _warn_trailing(path: str, size: int, data_end: int, last: str | None) -> None:
    """Bytes after the last tensor: the spec has none (the reference library refuses such
    a file); moed reads the tensors and warns, once per file and size in a process."""
    key = (path, size, data_end)
    with _warned_lock:
        if key in _warned_trailing:
            return
        _warned_trailing.add(key)
    log.warning("shard_trailing_bytes", extra={
        "path": path, "trailing_bytes": size - data_end, "data_end": data_end,
        "file_bytes": size, "last_tensor": last,
        "effect": "ignored; the safetensors spec allows no bytes after the last tensor "
                  "(a copy that went wrong, or a different file?)"})


def _read_header_checked(path: str) -> dict[str, TensorInfo]:
    """`read_header` of a shard that must be a regular, readable file."""
    try:
        if not os.path.isfile(path):
            raise HeaderError("not a regular file", path=path)
        return read_header(path)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}", path=path) from None


class Checkpoint:
    """A validated HF model directory: every tensor's shard, byte range, dtype and shape.

    ``Checkpoint(model_dir)`` reads every shard header eagerly. With
    ``model.safetensors.index.json`` (which wins over ``model.safetensors`` when both
    exist) the tensor table is exactly the index's ``weight_map``; tensors present in a
    shard but absent from the index are ignored. Without an index, ``model.safetensors``
    supplies every tensor it holds.

    Attributes: ``model_dir`` (absolute Path), ``shards`` (sorted absolute shard paths),
    ``tensors`` (name -> TensorInfo, sorted by name).
    Raises CheckpointError (neither index nor model.safetensors in ``model_dir``),
    HeaderError (malformed index: bad JSON, no ``weight_map`` object, non-string or
    path-like shard names; or a malformed shard header), MissingShardError,
    MissingTensorError, and everything ``read_header`` raises.

    Shard files are opened read-only, once each, on first load; ``close()`` (or leaving a
    ``with`` block) closes them. Loads may run from several threads at once.
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = Path(os.path.abspath(os.fspath(model_dir)))
        index_path, single_path = self.model_dir / INDEX_NAME, self.model_dir / SINGLE_NAME
        if index_path.exists() and not index_path.is_file():
            raise HeaderError("not a regular file", path=index_path)
        if index_path.exists():
            weight_map = self._read_index(index_path)
            shard_of = {name: str(self.model_dir / shard) for name, shard in weight_map.items()}
            self.shards = sorted(set(shard_of.values()))
            for shard in self.shards:
                if not os.path.isfile(shard):
                    first = min(n for n, s in shard_of.items() if s == shard)
                    what = ("is not a regular file" if os.path.lexists(shard)
                            else "does not exist")
                    raise MissingShardError(f"shard file named by the index {what}",
                                            path=shard, tensor=first)
            headers = {shard: _read_header_checked(shard) for shard in self.shards}
            tensors = {}
            for name, shard in shard_of.items():
                if name not in headers[shard]:
                    raise MissingTensorError(f"{INDEX_NAME} maps the tensor to this shard, "
                                             "which does not hold it", path=shard, tensor=name)
                tensors[name] = headers[shard][name]
        elif single_path.exists():
            self.shards = [str(single_path)]
            tensors = _read_header_checked(str(single_path))
        else:
            raise CheckpointError(f"neither {INDEX_NAME} nor {SINGLE_NAME} found",
                                  path=self.model_dir)
        self.tensors: dict[str, TensorInfo] = dict(sorted(tensors.items()))
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    @staticmethod
    def _read_index(index_path: Path) -> dict[str, str]:
        try:
            index = read_json(index_path)
        except MetadataFileError as e:
            raise HeaderError(str(e).removeprefix(f"{index_path}: "), path=index_path) from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise HeaderError('index has no "weight_map" object', path=index_path)
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
                raise HeaderError(f"shard {shard!r} is not a plain file name",
                                  path=index_path, tensor=name)
        return weight_map

    def info(self, name: str) -> TensorInfo:
        """Return where tensor ``name`` lives; raises MissingTensorError if unknown."""
        try:
            return self.tensors[name]
        except KeyError:
            raise MissingTensorError("no such tensor in the checkpoint",
                                     path=self.model_dir, tensor=name) from None

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    @property
    def total_bytes(self) -> int:
        """Sum of ``nbytes`` over the tensor table, in bytes."""
        return sum(t.nbytes for t in self.tensors.values())

    def _fd(self, path: str) -> int:
        with self._lock:
            if self._closed:
                raise CheckpointError("checkpoint is closed", path=self.model_dir)
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def load(self, name: str) -> np.ndarray:
        """Read tensor ``name`` into a new array.

        Returns a fresh, writable, C-contiguous array that owns its memory (the caller
        owns it), shape ``info(name).shape`` and the dtype of ``NUMPY_DTYPES`` (F32 ->
        float32, F16 -> float16, BF16 -> ml_dtypes.bfloat16, F8_E4M3 ->
        ml_dtypes.float8_e4m3fn, U8 -> uint8, ...), bytes copied verbatim with
        ``os.preadv``. Raises MissingTensorError (unknown name), UnsupportedDtypeError
        (dtype not loadable), TruncatedFileError (the file shrank since open),
        CheckpointError (after ``close()``), OSError (read failure).
        """
        return self.read(self.info(name))

    def read(self, info: TensorInfo) -> np.ndarray:
        """Read the bytes ``info`` describes (a tensor, or a range of one from
        ``TensorInfo.index``) into a new array; as ``load``."""
        name = info.name
        out = np.empty(info.shape, dtype=info.numpy_dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))  # [nbytes], aliases out
        fd = self._fd(info.path) if info.nbytes else -1
        done = 0
        while done < info.nbytes:
            n = os.preadv(fd, [view[done:]], info.offset + done)
            if n == 0:
                raise TruncatedFileError(f"end of file after {done} of {info.nbytes} bytes",
                                         path=info.path, tensor=name)
            done += n
        return out

    def fingerprint(self) -> str:
        """Identify the model: sha256 hex digest of config.json and the tensor table.

        Hashed, in order: the 8-byte little-endian length of ``config.json``'s bytes (read
        now), those bytes, then the compact JSON (sorted by name) of
        ``[name, dtype, shape, nbytes, shard basename, offset]`` per tensor. Absolute paths
        are excluded, so moving the directory keeps the fingerprint. Raises OSError
        (e.g. FileNotFoundError) if config.json cannot be read.
        """
        config = (self.model_dir / CONFIG_NAME).read_bytes()
        table = [[t.name, t.dtype, list(t.shape), t.nbytes, os.path.basename(t.path), t.offset]
                 for t in self.tensors.values()]
        h = hashlib.sha256(struct.pack("<Q", len(config)))
        h.update(config)
        h.update(json.dumps(table, separators=(",", ":")).encode())
        return h.hexdigest()

    def close(self) -> None:
        """Close the shard file descriptors; later loads raise CheckpointError."""
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
