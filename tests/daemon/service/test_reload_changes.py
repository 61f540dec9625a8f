"""What a SIGHUP reload says: every key whose value changed, split into those applied and
those that need a restart (whose running values stay), each by name only — a changed
api_key is applied and named, and its value is never logged. `Daemon.reload` runs in this
process without a model (nothing loaded: only the configuration and the log change)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daemon.service import daemon as daemon_module
from daemon.service.config import ServeConfig
from daemon.service.daemon import RESTART_KEYS, Daemon
from daemon.service.sdnotify import Notifier
from log_contract import Lines

OLD_KEY, NEW_KEY = "old-secret-1", "new-secret-2"


def _reload(monkeypatch, old: ServeConfig, new: ServeConfig) -> tuple[Daemon, Lines]:
    lines = Lines()
    monkeypatch.setattr(daemon_module, "log", lines)
    d = Daemon(old, load=None, reload=lambda: new, listener=None, notifier=Notifier({}))
    asyncio.run(d.reload())
    assert not lines.named("reload_failed")
    return d, lines


@pytest.fixture
def old() -> ServeConfig:
    return ServeConfig(model="/models/a", socket="/run/a.sock", api_key=OLD_KEY, max_queue=64)


def test_keys_that_need_a_restart_are_listed_apart_and_keep_their_running_values(
        monkeypatch, old):
    new = ServeConfig(model="/models/b", socket="/run/b.sock", tcp_address="127.0.0.1:8080",
                      api_key=NEW_KEY, max_queue=10)
    d, lines = _reload(monkeypatch, old, new)
    [(level, fields)] = lines.named("reloaded")
    assert fields["changed"] == ["api_key", "max_queue", "model", "socket", "tcp_address"]
    assert fields["applied"] == ["api_key", "max_queue"]
    assert fields["needs_restart"] == ["model", "socket", "tcp_address"]
    [(level, fields)] = lines.named("reload_needs_restart")
    assert level == "warning" and fields["keys"] == ["model", "socket", "tcp_address"]
    config = d.state.config
    assert (config.model, config.socket, config.tcp_address) == ("/models/a", "/run/a.sock", None)
    assert (config.api_key, config.max_queue) == (NEW_KEY, 10)
    assert not any(key in repr(lines.lines) for key in (OLD_KEY, NEW_KEY))


def test_a_changed_api_key_alone_is_applied_and_named(monkeypatch, old):
    d, lines = _reload(monkeypatch, old, ServeConfig(model="/models/a", socket="/run/a.sock",
                                                     api_key=NEW_KEY, max_queue=64))
    [(_, fields)] = lines.named("reloaded")
    assert (fields["changed"], fields["applied"], fields["needs_restart"]) == (
        ["api_key"], ["api_key"], [])
    assert not lines.named("reload_needs_restart")
    assert d.state.config.api_key == NEW_KEY
    assert not any(key in repr(lines.lines) for key in (OLD_KEY, NEW_KEY))


def test_an_unchanged_config_reloads_with_nothing_changed(monkeypatch, old):
    _, lines = _reload(monkeypatch, old, old)
    [(_, fields)] = lines.named("reloaded")
    assert (fields["changed"], fields["applied"], fields["needs_restart"]) == ([], [], [])


def test_every_restart_key_is_a_configuration_key():
    assert RESTART_KEYS <= set(ServeConfig().to_dict())
    assert {"model", "socket", "tcp_address", "half_life_tokens",
            "max_connections_per_peer"} <= RESTART_KEYS
    assert "api_key" not in RESTART_KEYS


def test_the_configuration_page_lists_every_restart_key():
    page = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    intro = page.split("| key |", 1)[0]
    assert all(f"`{key}`" in intro for key in RESTART_KEYS), sorted(
        k for k in RESTART_KEYS if f"`{k}`" not in intro)
