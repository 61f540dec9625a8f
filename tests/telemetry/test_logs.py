"""One stream, one format: every log of the process is a JSON line whose event is a
snake_case name with its values as fields — moed's events, ext/'s standard-library
records, and other libraries' (aiohttp, asyncio, warnings) alike."""
from __future__ import annotations

import ast
import asyncio
import io
import json
import logging
import re
import threading
import warnings
from pathlib import Path

import pytest

from telemetry import logs

ROOT = Path(__file__).resolve().parent.parent.parent
SNAKE = re.compile(r"[a-z][a-z0-9_]*")
LEVEL_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}


@pytest.fixture
def stream():
    """configure() onto a buffer; the previous root handlers and hooks put back after."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, threading.excepthook, logging.getLogger("moed").level)
    buf = io.StringIO()
    logs.configure("info", buf, json=True)
    yield buf
    root.handlers[:], level, threading.excepthook, moed_level = saved
    root.setLevel(level)
    logging.getLogger("moed").setLevel(moed_level)
    logging.captureWarnings(False)


def lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_moed_events_are_json_objects_with_fields(stream):
    logs.get_logger("server").info("request_finished", tokens=3, request_id="r1")
    [event] = lines(stream)
    assert (event["event"], event["tokens"], event["request_id"]) == ("request_finished", 3, "r1")
    assert (event["level"], event["logger"]) == ("info", "moed.server")
    assert event["timestamp"].endswith("Z")


def test_aiohttp_tracebacks_become_one_json_line_each(stream):
    # What aiohttp's server does when a handler's write hits a closing transport.
    try:
        raise ConnectionResetError("Cannot write to closing transport")
    except ConnectionResetError:
        logging.getLogger("aiohttp.server").exception("Error handling request")
    [event] = lines(stream)
    assert (event["event"], event["logger"], event["level"]) == ("library_log", "aiohttp.server", "error")
    assert event["message"] == "Error handling request"
    assert "Traceback" in event["exception"] and "closing transport" in event["exception"]


def test_asyncio_loop_errors_and_warnings_and_thread_crashes_are_json_too(stream):
    loop = asyncio.new_event_loop()
    try:
        loop.call_exception_handler({"message": "Task exception was never retrieved",
                                     "exception": RuntimeError("lost")})
    finally:
        loop.close()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        logging.captureWarnings(True)        # catch_warnings put showwarning back
        warnings.warn("deprecated thing", UserWarning)

    def crash():
        raise ValueError("in a thread")
    # configure() leaves a hook someone else installed (pytest's) alone: install ours here
    threading.excepthook = logs._thread_exception
    t = threading.Thread(target=crash, name="worker-1")
    t.start()
    t.join()
    events = lines(stream)
    assert [e["logger"] for e in events] == ["asyncio", "py.warnings", "moed"]
    assert "RuntimeError: lost" in events[0]["exception"]
    assert "deprecated thing" in events[1]["message"]
    assert (events[2]["event"], events[2]["thread_name"]) == ("thread_crashed", "worker-1")
    assert "ValueError: in a thread" in events[2]["exception"]


def test_ext_records_keep_their_extra_fields(stream):
    logging.getLogger("moed.checkpoint").warning("shard_trailing_bytes",
                                                 extra={"path": "a.safetensors", "trailing_bytes": 7})
    [event] = lines(stream)
    assert (event["event"], event["path"], event["trailing_bytes"]) == (
        "shard_trailing_bytes", "a.safetensors", 7)


def test_levels_apply_to_moed_and_libraries_pass_only_warnings(stream):
    logs.set_level("warning")
    logs.get_logger("x").info("quiet_event")
    logging.getLogger("aiohttp.access").info("GET / 200")
    logs.get_logger("x").warning("loud_event")
    assert [e["event"] for e in lines(stream)] == ["loud_event"]


def _log_calls(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in LEVEL_METHODS and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ("log", "logger")):
            yield node


@pytest.mark.parametrize("package", ["daemon", "ext", "scheduler", "telemetry"])
def test_every_log_call_is_a_snake_case_event_with_fields(package):
    """No printf-style messages, no values formatted into the event, no JSON in a string."""
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for call in _log_calls(path):
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            if not call.args:
                bad.append(f"{where}: no event")
                continue
            event = call.args[0]
            if isinstance(event, ast.IfExp):      # ("a_event" if c else "b_event")
                names = [event.body, event.orelse]
            else:
                names = [event]
            for name in names:
                if not (isinstance(name, ast.Constant) and isinstance(name.value, str)
                        and SNAKE.fullmatch(name.value)):
                    bad.append(f"{where}: event is not a snake_case literal: {ast.unparse(name)}")
            if len(call.args) > 1:
                bad.append(f"{where}: positional (printf-style) arguments")
    assert bad == []
