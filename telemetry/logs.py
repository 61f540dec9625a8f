"""Logging for every moed command: structlog, to stderr, JSON unless stderr is a terminal.

Events are snake_case facts with their values as fields, never values formatted into the
event string: ``log.warning("expert_read_failed", reason="demand", error=str(e))``.
moed's own modules log through `get_logger` (structlog, bound to the standard library's
``moed.*`` loggers); ext/, which may not import structlog, logs with the standard
library and puts its fields in ``extra=`` (``log.warning("shard_trailing_bytes",
extra={"path": ..., "trailing_bytes": n})``).

`configure(level, stream)` is called once at the edge (the CLI). It puts one handler on
the root logger, so that every logger in the process — moed's, aiohttp's
(``aiohttp.server`` tracebacks such as "Error handling request"), asyncio's (the event
loop's exception handler), ``py.warnings`` (`warnings.warn`), and uncaught exceptions in
threads and the main thread — goes through the same processors and one stream carries one
format: JSON objects, one per line, with ``timestamp`` (ISO 8601 UTC), ``level``,
``logger`` and ``event``, plus whatever the call bound (contextvars included, e.g.
``request_id``) and ``exception`` (the traceback, as one string field). A library's own
message (not a snake_case event) goes in ``message`` under the event ``library_log``.
On a terminal the same events render for reading. stdout is never touched: it carries
each command's result.

Until `configure` runs (a library user, a test), structlog events still go through the
standard library's ``moed.*`` loggers, so handlers attached there see them: each record's
``msg`` is the event dict.
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error")
LIBRARY_EVENT = "library_log"       # the event of a record from a logger outside moed

# Added to every event, moed's and other libraries' alike.
_SHARED = (
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
)
# structlog's events always reach the standard library (see the module docstring).
structlog.configure(
    processors=[*_SHARED, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
    logger_factory=structlog.stdlib.LoggerFactory(),
    wrapper_class=structlog.stdlib.BoundLogger,
    cache_logger_on_first_use=False,
)


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever `sys.stderr` is when a record is written (a command
    that swaps stderr, a test's capture) instead of the one at construction."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _library_message(logger, name: str, event_dict: dict) -> dict:
    """A record from outside moed (aiohttp, asyncio, py.warnings): its text becomes
    ``message`` and the event ``library_log``, so every event stays a snake_case name."""
    record = event_dict.get("_record")
    if record is not None and not record.name.startswith("moed"):
        event_dict["message"] = event_dict.pop("event", "")
        event_dict["event"] = LIBRARY_EVENT
    return event_dict


def configure(level: str = "info", stream: TextIO | None = None, json: bool | None = None) -> None:
    """Route every log of the process to `stream` (default: the current stderr) at `level`.

    level: moed's level; other libraries' loggers pass warnings and worse.
    json: force the JSON (True) or console (False) renderer; None picks JSON unless the
    stream is a TTY. Calling it again replaces the previous configuration. Raises
    ValueError for a level outside LEVELS.
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {LEVELS}, got {level!r}")
    target = stream if stream is not None else sys.stderr
    if json is None:
        json = not (hasattr(target, "isatty") and target.isatty())
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=False))
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_SHARED, structlog.stdlib.ExtraAdder(), _library_message],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer])
    handler = _StderrHandler() if stream is None else logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler._moed = True  # type: ignore[attr-defined]  # ours: replaced on the next call
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not getattr(h, "_moed", False)] + [handler]
    if root.level == logging.NOTSET or root.level < logging.WARNING:
        root.setLevel(logging.WARNING)
    moed = logging.getLogger("moed")
    moed.handlers[:] = [h for h in moed.handlers if not getattr(h, "_moed", False)]
    moed.setLevel(level.upper())
    moed.propagate = True
    logging.captureWarnings(True)
    # Uncaught exceptions become events too, unless someone else (a test runner) already
    # handles them.
    if threading.excepthook in (threading.__excepthook__, _thread_exception):
        threading.excepthook = _thread_exception
    if sys.excepthook in (sys.__excepthook__, _uncaught_exception):
        sys.excepthook = _uncaught_exception


def _thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    logging.getLogger("moed").error(
        "thread_crashed", extra={"thread_name": getattr(args.thread, "name", None)},
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def _uncaught_exception(exc_type, exc_value, traceback) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc_value, traceback)
        return
    logging.getLogger("moed").error("uncaught_exception",
                                    exc_info=(exc_type, exc_value, traceback))


def set_level(level: str) -> None:
    """Change the level of every moed logger (SIGHUP). ValueError for an unknown level."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {LEVELS}, got {level!r}")
    logging.getLogger("moed").setLevel(level.upper())


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger under the `moed` hierarchy (name without the prefix)."""
    return structlog.get_logger(f"moed.{name}")
