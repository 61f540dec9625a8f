"""Put tests/ on sys.path so test modules can import shared helpers (oracle_models);
fixtures shared by several test packages."""
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def event_of(record: logging.LogRecord) -> dict:
    """A log record as the event dict moed writes: "event", "level", "logger" and the
    fields (structlog's event dict, or a standard-library record's `extra=`)."""
    if isinstance(record.msg, dict):
        event = {k: v for k, v in record.msg.items() if not k.startswith("_")}
    else:
        event = {"event": record.getMessage(),
                 **{k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS}}
    event["level"] = record.levelname.lower()
    event["logger"] = record.name
    return event


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(event_of(record))


@pytest.fixture
def log_records():
    """log_records(name) -> the list of events (dicts: "event", "level", "logger" and the
    event's fields) logged on `name` and below during the test, whatever an earlier test
    did to the "moed" logger's level."""
    attached = []

    def capture(name: str) -> list[dict]:
        logger, handler = logging.getLogger(name), _Records()
        attached.append((logger, handler, logger.level))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        return handler.records
    yield capture
    for logger, handler, level in attached:
        logger.setLevel(level)
        logger.removeHandler(handler)


@pytest.fixture(scope="session")
def lowbit_oracle(tmp_path_factory):
    """tests/lowbit_reference.py's LowBitOracle: each low-bit case's reference and moed run."""
    from lowbit_reference import LowBitOracle
    return LowBitOracle(tmp_path_factory)
