"""Put tests/ on sys.path so test modules can import shared helpers (oracle_models);
fixtures shared by several test packages; the programs tests run (tests/tools.py):
installed before the first test when missing and allowed, else their tests skip (or,
under MOED_TEST_TOOLS=require, fail)."""
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tools  # noqa: E402  (tests/, just put on sys.path)

_TOOLS_KEY = pytest.StashKey[tools.Report]()


def pytest_collection_modifyitems(config, items) -> None:
    """Every tool the selected tests declare: found, else installed once, else noted."""
    needed = {name for item in items for mark in item.iter_markers("tools") for name in mark.args}
    unknown = needed - set(tools.PACKAGES)
    if unknown:
        raise pytest.UsageError(f"@pytest.mark.tools names unknown programs: {sorted(unknown)} "
                                "(add them to tests/tools.py PACKAGES)")
    config.stash[_TOOLS_KEY] = tools.ensure(needed)


def pytest_runtest_setup(item) -> None:
    report = item.config.stash.get(_TOOLS_KEY, None)
    if report is None:
        return
    reasons = [report.missing[name] for mark in item.iter_markers("tools") for name in mark.args
               if name in report.missing]
    if not reasons:
        return
    if tools.mode() == "require":
        pytest.fail(f"{tools.ENV}=require: " + "; ".join(reasons), pytrace=False)
    pytest.skip("; ".join(reasons))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    report = config.stash.get(_TOOLS_KEY, None)
    if report is None:
        return
    if report.installed:
        terminalreporter.write_line(f"tools: installed Debian packages {' '.join(report.installed)} "
                                    "for the tests")
    for name, reason in sorted(report.missing.items()):
        terminalreporter.write_line(f"tools: {name}: {reason}")


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
