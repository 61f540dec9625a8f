"""Put tests/ on sys.path so test modules can import shared helpers (oracle_models);
fixtures shared by several test packages."""
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def log_records():
    """log_records(name) -> the list of records logged on `name` during the test, whatever
    an earlier test did to the "moed" logger's level or propagation (the CLI turns it off)."""
    attached = []

    def capture(name: str) -> list[logging.LogRecord]:
        logger, handler = logging.getLogger(name), _Records()
        attached.append((logger, handler, logger.level))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        return handler.records
    yield capture
    for logger, handler, level in attached:
        logger.setLevel(level)
        logger.removeHandler(handler)
