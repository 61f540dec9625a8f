"""Reading the small metadata files of a model directory safely.

config.json, tokenizer_config.json, generation_config.json, the safetensors index and
chat templates are read whole. A path that is not a regular file (a FIFO would block
forever, /dev/zero would never end), a file larger than the cap, text that is not
UTF-8, or JSON that is invalid or nested too deeply is refused with an error naming
the file. A missing file raises FileNotFoundError so callers can treat it as absent.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

MAX_METADATA_BYTES = 64 << 20  # tokenizer.json of large vocabularies is ~10-30 MB


class MetadataFileError(ValueError):
    """A metadata file that cannot be used; the message names the file."""


def read_text(path: str | os.PathLike, max_bytes: int = MAX_METADATA_BYTES) -> str:
    """The whole file as UTF-8 text.

    Raises FileNotFoundError when absent, MetadataFileError when it is not a regular
    file, larger than max_bytes, unreadable or not UTF-8.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except FileNotFoundError:
        raise
    except OSError as e:
        raise MetadataFileError(f"{path}: cannot open: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MetadataFileError(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise MetadataFileError(f"{path}: {st.st_size} bytes, larger than the {max_bytes} allowed")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise MetadataFileError(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MetadataFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def parse_json(text: str, path: str | os.PathLike, **kwargs) -> object:
    """json.loads that names `path` in its errors (bad JSON, too deep, huge integers)."""
    try:
        return json.loads(text, **kwargs)
    except json.JSONDecodeError as e:
        raise MetadataFileError(f"{path}: invalid JSON: {e}") from None
    except RecursionError:
        raise MetadataFileError(f"{path}: JSON nested too deeply") from None
    except ValueError as e:  # e.g. integers beyond the digit limit; duplicate-key hooks
        raise MetadataFileError(f"{path}: invalid JSON: {e}") from None


def read_json(path: str | os.PathLike, max_bytes: int = MAX_METADATA_BYTES) -> object:
    """`read_text` then `parse_json`."""
    return parse_json(read_text(path, max_bytes), path)
