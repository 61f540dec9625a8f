"""The log contract, checked on a real process's stderr: every line a JSON object whose
``event`` is a snake_case name, with ``level`` and ``timestamp``, its values as fields —
no value that is itself JSON written into a string, no line of plain text (a library's
traceback, a print) — except the one `moed COMMAND: error: ...` line a command writes
for a person before it exits 1."""
from __future__ import annotations

import json
import re
from collections.abc import Iterable

SNAKE = re.compile(r"[a-z][a-z0-9_]*")
PERSON_LINE = re.compile(r"moed [a-z-]+: error: ")


def _json_in_string(value) -> bool:
    if not isinstance(value, str) or not value.lstrip().startswith(("{", "[")):
        return False
    try:
        return isinstance(json.loads(value), (dict, list))
    except json.JSONDecodeError:
        return False


def problems(lines: Iterable[str]) -> list[str]:
    """The stderr lines that break the contract, each with what is wrong (empty: none)."""
    bad = []
    for line in lines:
        line = line.rstrip("\n")
        if not line or PERSON_LINE.match(line):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            bad.append(f"not JSON: {line[:200]}")
            continue
        if not isinstance(event, dict):
            bad.append(f"not an object: {line[:200]}")
            continue
        name = event.get("event")
        if not (isinstance(name, str) and SNAKE.fullmatch(name)):
            bad.append(f"event is not a snake_case name: {line[:200]}")
        for key in ("level", "timestamp"):
            if key not in event:
                bad.append(f"no {key}: {line[:200]}")
        for key, value in event.items():
            if key != "exception" and _json_in_string(value):
                bad.append(f"JSON inside the string field {key!r}: {line[:200]}")
    return bad


class Lines:
    """Stands in for a module's structlog logger in-process: keeps (level, event, fields)."""

    def __init__(self):
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level):
        return lambda event, **fields: self.lines.append((level, event, fields))

    def named(self, event: str) -> list[tuple[str, dict]]:
        return [(level, fields) for level, e, fields in self.lines if e == event]
