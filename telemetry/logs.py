"""Logging for every moed command: structlog, to stderr, JSON unless stderr is a terminal.

`configure(level, stream)` is called once at the edge (the CLI). Both structlog loggers
(`structlog.get_logger()`, used for events such as `request_finished`) and the standard
library's `logging.getLogger("moed.*")` loggers go through the same processors, so one
stream carries one format: JSON objects, one per line, with `timestamp` (ISO 8601 UTC),
`level`, `logger` and `event`, plus whatever the call bound (contextvars included, e.g.
`request_id`). On a terminal the same events render for reading.
stdout is never touched: it carries each command's result.
"""
from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error")


def configure(level: str = "info", stream: TextIO | None = None, json: bool | None = None) -> None:
    """Route all logs to `stream` (default stderr) at `level`.

    json: force the JSON (True) or console (False) renderer; None picks JSON unless the
    stream is a TTY. Raises ValueError for a level outside LEVELS.
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {LEVELS}, got {level!r}")
    stream = stream or sys.stderr
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer])
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger("moed")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def set_level(level: str) -> None:
    """Change the level of every moed logger (SIGHUP). ValueError for an unknown level."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {LEVELS}, got {level!r}")
    logging.getLogger("moed").setLevel(level.upper())


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger under the `moed` hierarchy (name without the prefix)."""
    return structlog.get_logger(f"moed.{name}")
