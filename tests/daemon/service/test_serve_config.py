"""`moed serve` configuration (daemon/service/config.py): file < environment < flags for every key,
errors that name the key and the source, the example systemd/moed.toml."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest

from daemon.service.config import (DEFAULT_CONFIG_PATH, KEYS, Address, ConfigError, ServeConfig,
                                   add_arguments, is_loopback, load_config, parse_address,
                                   parse_size)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "systemd" / "moed.toml"
G, M, K = 2**30, 2**20, 2**10

# key: (TOML literal in the file, its value, env string, its value, flag string, its value).
# Each layer differs from the one below it (and the file from the default), so every
# precedence step is visible.
LAYERS = {
    "model": ('"/m/file"', "/m/file", "/m/env", "/m/env", "/m/flag", "/m/flag"),
    "socket": ('"/s/file.sock"', "/s/file.sock", "/s/env.sock", "/s/env.sock",
               "/s/flag.sock", "/s/flag.sock"),
    "socket_mode": ("0o600", 0o600, "0640", 0o640, "644", 0o644),
    "socket_group": ('"gfile"', "gfile", "genv", "genv", "gflag", "gflag"),
    "state_dir": ('"/st/file"', "/st/file", "/st/env", "/st/env", "/st/flag", "/st/flag"),
    "expert_cache_bytes": ('"512M"', 512 * M, "2G", 2 * G, "65536", 65536),
    "max_concurrent_sequences": ("2", 2, "3", 3, "5", 5),
    "max_queue": ("0", 0, "1", 1, "2", 2),
    "prefill_step_ratio": ("1.5", 1.5, "inf", float("inf"), "4", 4.0),
    "prefill_chunk": ("256", 256, "AUTO", "auto", "2048", 2048),
    "prefix_cache_bytes": ("0", 0, "8K", 8 * K, "1.5M", int(1.5 * M)),
    "prefix_cache_scope": ('"client"', "client", "SHARED", "shared", "client", "client"),
    "prefix_cache_persist_bytes": ("0", 0, "8K", 8 * K, "1.5M", int(1.5 * M)),
    "max_context_tokens": ("4096", 4096, "2048", 2048, "1024", 1024),
    "max_tokens": ("10", 10, "20", 20, "30", 30),
    "max_body_bytes": ("4096", 4096, "8K", 8 * K, "1.5M", int(1.5 * M)),
    "request_timeout_s": ("1.5", 1.5, "2", 2.0, "2.5", 2.5),
    "header_timeout_s": ("1", 1.0, "2.5", 2.5, "3", 3.0),
    "body_timeout_s": ("4", 4.0, "5", 5.0, "0.5", 0.5),
    "max_connections": ("1", 1, "2", 2, "65536", 65536),
    "max_connections_per_peer": ("1", 1, "2", 2, "65536", 65536),
    "chat_template_max_chars": ("100", 100, "200", 200, "300", 300),
    "chat_template_timeout_s": ("0.25", 0.25, "1", 1.0, "2", 2.0),
    "grammar_compile_timeout_s": ("0.5", 0.5, "2", 2.0, "3.5", 3.5),
    "grammar_compile_memory_bytes": ('"512M"', 512 * M, "2G", 2 * G, "300000000", 300000000),
    "shutdown_grace_s": ("5", 5.0, "0", 0.0, "1.25", 1.25),
    "metrics_address": ('"127.0.0.1:0"', Address("127.0.0.1", 0), "[::1]:9000",
                        Address("::1", 9000), "localhost:9100", Address("localhost", 9100)),
    "tcp_address": ('"127.0.0.1:8080"', Address("127.0.0.1", 8080), "[::1]:8081",
                    Address("::1", 8081), "localhost:8082", Address("localhost", 8082)),
    "api_key": ('"kfile"', "kfile", "kenv", "kenv", "kflag", "kflag"),
    "log_level": ('"debug"', "debug", "WARNING", "warning", "error", "error"),
    "threads": ("1", 1, "2", 2, "3", 3),
    "io_workers": ("3", 3, "4", 4, "5", 5),
    "pin_fraction": ("0", 0.0, "1", 1.0, "0.25", 0.25),
    "prefetch": ("false", False, "yes", True, "no", False),
    "half_life_tokens": ("100", 100.0, "512.5", 512.5, "4096", 4096.0),
    "numerics": ('"fast"', "fast", "EXACT", "exact", "fast-bf16", "fast-bf16"),
    "expert_cache_mode": ('"naive"', "naive", "MOED", "moed", "naive", "naive"),
    "tuner": ('"off"', "off", "LIVE+idle", "live+idle", "live", "live"),
    "record_trace": ('"/t/file.jsonl"', "/t/file.jsonl", "/t/env.jsonl", "/t/env.jsonl",
                     "/t/flag.jsonl", "/t/flag.jsonl"),
}

# key: (bad TOML literal, bad env string, bad flag string); None where no string is bad.
BAD = {
    "model": ("5", None, None),
    "socket": ("1", "", "/" + "x" * 120),
    "socket_mode": ("660", "0999", "rw"),
    "socket_group": ("true", None, None),
    "state_dir": ("[]", None, None),
    "record_trace": ("7", None, None),
    "expert_cache_bytes": ("0", "lots", "-1G"),
    "max_context_tokens": ("0", "x", "-5"),
    "max_concurrent_sequences": ("0", "x", "1.5"),
    "max_queue": ("-1", "-1", "many"),
    "prefill_step_ratio": ("1", "-inf", "nan"),
    "prefill_chunk": ('"big"', "0", "16385"),
    "prefix_cache_bytes": ("-1", "-5", "lots"),
    "prefix_cache_scope": ("1", "user", "none"),
    "prefix_cache_persist_bytes": ("-1", "-5", "lots"),
    "max_tokens": ("0", "0", ""),
    "max_body_bytes": ("1.5", "0", "1T"),
    "request_timeout_s": ("0", "nan", "-1"),
    "header_timeout_s": ("0", "-1", "soon"),
    "body_timeout_s": ('"x"', "0", "inf"),
    "max_connections": ("0", "65537", "many"),
    "max_connections_per_peer": ("0", "65537", "many"),
    "chat_template_max_chars": ("0", "-1", "1M"),
    "chat_template_timeout_s": ("0", "nan", "-3"),
    "grammar_compile_timeout_s": ("0", "inf", "-1"),
    "grammar_compile_memory_bytes": ("0", "-1G", "lots"),
    "shutdown_grace_s": ("-1", "inf", "soon"),
    "metrics_address": ('"9464"', "::1:9464", "127.0.0.1:65536"),
    "tcp_address": ('"host only"', "[nothost]:1", "a:b"),
    "api_key": ("123", None, None),
    "log_level": ('"verbose"', "trace", "critical"),
    "threads": ("0", "1025", "-2"),
    "io_workers": ("0", "two", "0"),
    "pin_fraction": ("1.5", "-0.1", "nan"),
    "prefetch": ("1", "maybe", "2"),
    "half_life_tokens": ("0", "-5", "x"),
    "numerics": ("1", "quick", "int8"),
    "expert_cache_mode": ("1", "lru", "mmap"),
    "tuner": ("1", "on", "offline"),
}


def _env(name: str) -> str:
    return "MOED_" + name.upper()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moed serve")
    add_arguments(parser)
    return parser.parse_args(argv)


def _write(tmp_path: Path, text: str, name: str = "moed.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o640)
    return path


@pytest.fixture
def nowhere(tmp_path) -> Path:
    """A default config path with no file."""
    return tmp_path / "absent" / "moed.toml"


def test_tables_cover_every_key_and_every_field():
    fields = [f.name for f in dataclasses.fields(ServeConfig)]
    assert fields == [*KEYS, "sources"]
    assert set(LAYERS) == set(KEYS) == set(BAD)


def test_defaults_without_any_source(nowhere):
    config, warnings = load_config(argparse.Namespace(), {}, default_path=nowhere)
    assert config == ServeConfig()
    assert warnings == []
    assert set(config.sources.values()) == {"default"}
    assert config.socket == "/run/moed/moed.sock"
    assert config.socket_mode == 0o660
    assert config.max_body_bytes == 2**20
    assert config.metrics_address == Address("127.0.0.1", 9464)
    assert (config.model, config.tcp_address, config.api_key, config.state_dir,
            config.threads, config.expert_cache_bytes, config.socket_group) == (None,) * 7
    assert (config.max_concurrent_sequences, config.max_queue, config.max_tokens,
            config.io_workers) == (4, 64, 4096, 2)
    assert (config.request_timeout_s, config.shutdown_grace_s, config.pin_fraction,
            config.half_life_tokens, config.prefetch, config.log_level) == (
            600.0, 30.0, 0.5, 2048.0, True, "info")
    assert DEFAULT_CONFIG_PATH == "/etc/moed/moed.toml"


@pytest.mark.parametrize("name", list(LAYERS))
def test_file_then_environment_then_flag(name, tmp_path, nowhere):
    toml, file_value, env, env_value, flag, flag_value = LAYERS[name]
    assert file_value != getattr(ServeConfig(), name)
    assert env_value != file_value and flag_value != env_value
    path = _write(tmp_path, f"{name} = {toml}\n")

    config, _ = load_config(_parse(["--config", str(path)]), {}, default_path=nowhere)
    assert getattr(config, name) == file_value
    assert type(getattr(config, name)) is type(file_value)
    assert config.sources[name] == f"config file {path}"

    environ = {_env(name): env}
    config, _ = load_config(_parse(["--config", str(path)]), environ, default_path=nowhere)
    assert getattr(config, name) == env_value
    assert config.sources[name] == f"environment {_env(name)}"

    config, _ = load_config(_parse(["--config", str(path), _flag(name), flag]), environ,
                            default_path=nowhere)
    assert getattr(config, name) == flag_value
    assert config.sources[name] == f"flag {_flag(name)}"
    # Every other key kept its default.
    assert {k: getattr(config, k) for k in KEYS if k != name} == {
        k: getattr(ServeConfig(), k) for k in KEYS if k != name}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_value_in_the_file_names_key_and_file(name, tmp_path, nowhere):
    path = _write(tmp_path, f"{name} = {BAD[name][0]}\n")
    with pytest.raises(ConfigError) as e:
        load_config({"config": str(path)}, {}, default_path=nowhere)
    assert (e.value.key, e.value.source) == (name, f"config file {path}")
    assert str(e.value).startswith(f"{name} (config file {path}): ")


@pytest.mark.parametrize("name", [k for k, v in BAD.items() if v[1] is not None])
def test_bad_value_in_the_environment_names_key_and_variable(name, nowhere):
    with pytest.raises(ConfigError) as e:
        load_config({}, {_env(name): BAD[name][1]}, default_path=nowhere)
    assert str(e.value).startswith(f"{name} (environment {_env(name)}): ")
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("name", [k for k, v in BAD.items() if v[2] is not None])
def test_bad_value_in_a_flag_names_key_and_flag(name, nowhere):
    with pytest.raises(ConfigError) as e:
        load_config(_parse([f"{_flag(name)}={BAD[name][2]}"]), {}, default_path=nowhere)
    assert str(e.value).startswith(f"{name} (flag {_flag(name)}): ")


def test_a_bad_value_is_an_error_even_when_a_later_source_overrides_it(tmp_path, nowhere):
    path = _write(tmp_path, "max_queue = -1\n")
    with pytest.raises(ConfigError, match="max_queue.*config file"):
        load_config({"config": path}, {"MOED_MAX_QUEUE": "5"}, default_path=nowhere)
    with pytest.raises(ConfigError, match="MOED_MAX_QUEUE"):
        load_config(_parse(["--max-queue", "5"]), {"MOED_MAX_QUEUE": "-1"}, default_path=nowhere)


def test_messages_say_what_is_wrong(tmp_path, nowhere):
    cases = {
        "socket_mode = 660": "0o660",  # decimal 660 is not 0o660
        "max_queue = -1": "must be >= 0, got -1",
        "threads = 2000": "must be <= 1024",
        'log_level = "loud"': "debug, info, warning, error",
        'metrics_address = "::1:9464"': "brackets",
        'expert_cache_bytes = "lots"': "not a size",
        "pin_fraction = 2": "must be <= 1",
        "request_timeout_s = 0": "must be > 0",
        "prefetch = 1": "expected a boolean",
        "max_tokens = true": "expected an integer, got a boolean",
    }
    for line, fragment in cases.items():
        path = _write(tmp_path, line + "\n")
        with pytest.raises(ConfigError) as e:
            load_config({"config": path}, {}, default_path=nowhere)
        assert fragment in str(e.value), line


def test_socket_mode_forms():
    assert [ServeConfig(socket_mode=m).socket_mode for m in ("0660", "660", "0o600", " 0755 ", 0o640)] \
        == [0o660, 0o660, 0o600, 0o755, 0o640]
    with pytest.raises(ConfigError, match="0o777"):
        ServeConfig(socket_mode=0o1777)


def test_flags_only_override_when_given(nowhere):
    ns = _parse([])
    assert vars(ns) == {}  # argparse.SUPPRESS: nothing to override with
    config, _ = load_config(ns, {"MOED_MAX_QUEUE": "7"}, default_path=nowhere)
    assert config.max_queue == 7
    # A None entry (another parser's default) is "not given" too.
    config, _ = load_config(argparse.Namespace(max_queue=None, threads=None, command="serve"),
                            {"MOED_MAX_QUEUE": "7", "MOED_THREADS": "3"}, default_path=nowhere)
    assert (config.max_queue, config.threads) == (7, 3)


def test_every_key_has_a_flag():
    for name, (_, _, _, _, flag, value) in LAYERS.items():
        assert getattr(_parse([_flag(name), flag]), name) == flag


def test_help_names_every_flag_variable_and_default():
    parser = argparse.ArgumentParser(prog="moed serve")
    add_arguments(parser)
    text = " ".join(parser.format_help().split())  # argparse wraps lines
    for name in KEYS:
        assert _flag(name) in text and _env(name) in text
    assert "--no-prefetch" in text and "--config FILE" in text
    assert "(default: 0660; env MOED_SOCKET_MODE)" in text
    assert "(default: 1M; env MOED_MAX_BODY_BYTES)" in text
    # every size in the docs' unit form, those that may be 0 (off) too
    assert "(default: 512M; env MOED_PREFIX_CACHE_BYTES)" in text
    assert "(default: 512M; env MOED_PREFIX_CACHE_PERSIST_BYTES)" in text
    assert "(default: 1G; env MOED_GRAMMAR_COMPILE_MEMORY_BYTES)" in text
    sizes = [n for n in KEYS if n.endswith("_bytes") and n != "expert_cache_bytes"]
    assert len(sizes) == 4
    for name in sizes:                      # no raw byte counts
        assert re.search(rf"\(default: \d+[KMG]; env {_env(name)}\)", text), name
    assert "(default: 127.0.0.1:9464; env MOED_METRICS_ADDRESS)" in text


@pytest.mark.parametrize("argv, expected", [
    (["--prefetch"], True), (["--no-prefetch"], False), (["--prefetch", "no"], False),
    (["--prefetch=0"], False), (["--prefetch", "YES"], True),
    (["--no-prefetch", "--prefetch"], True)])
def test_prefetch_flags_override_the_environment(argv, expected, nowhere):
    environ = {"MOED_PREFETCH": "false" if expected else "true"}  # the opposite
    config, _ = load_config(_parse(argv), environ, default_path=nowhere)
    assert config.prefetch is expected
    assert config.sources["prefetch"] == ("flag --prefetch")


def test_exclude_leaves_a_key_to_a_parent_parser(nowhere):
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--log-level", default=argparse.SUPPRESS,
                        choices=["debug", "info", "warning", "error"])
    parser = argparse.ArgumentParser(parents=[parent])
    add_arguments(parser, exclude={"log_level"})
    config, _ = load_config(parser.parse_args(["--log-level", "debug", "--threads", "2"]), {},
                            default_path=nowhere)
    assert (config.log_level, config.threads) == ("debug", 2)
    with pytest.raises(argparse.ArgumentError):
        add_arguments(argparse.ArgumentParser(parents=[parent]))  # the conflict exclude avoids


def test_empty_environment_or_flag_unsets_an_optional_key(tmp_path, nowhere):
    path = _write(tmp_path, 'threads = 3\nstate_dir = "/x"\n')
    config, _ = load_config({"config": path}, {"MOED_THREADS": ""}, default_path=nowhere)
    assert config.threads is None and config.state_dir == "/x"
    assert config.sources["threads"] == "environment MOED_THREADS"
    config, _ = load_config(_parse(["--config", str(path), "--state-dir", ""]), {},
                            default_path=nowhere)
    assert config.state_dir is None and config.threads == 3
    with pytest.raises(ConfigError, match=r"max_queue \(environment MOED_MAX_QUEUE\)"):
        load_config({}, {"MOED_MAX_QUEUE": ""}, default_path=nowhere)  # not optional


def test_which_file_is_read(tmp_path):
    default = _write(tmp_path, "max_queue = 1\n", "default.toml")
    named = _write(tmp_path, "max_queue = 2\n", "named.toml")
    flagged = _write(tmp_path, "max_queue = 3\n", "flagged.toml")
    assert load_config({}, {}, default_path=default)[0].max_queue == 1
    assert load_config({}, {"MOED_CONFIG": str(named)}, default_path=default)[0].max_queue == 2
    assert load_config({"config": str(flagged)}, {"MOED_CONFIG": str(named)},
                       default_path=default)[0].max_queue == 3
    # An empty MOED_CONFIG is unset.
    assert load_config({}, {"MOED_CONFIG": ""}, default_path=default)[0].max_queue == 1


def test_only_the_default_file_may_be_missing(tmp_path, nowhere):
    missing = tmp_path / "missing.toml"
    assert load_config({}, {}, default_path=nowhere)[0] == ServeConfig()
    with pytest.raises(ConfigError) as e:
        load_config({"config": str(missing)}, {}, default_path=nowhere)
    assert str(e.value) == f"config (flag --config): {missing} does not exist"
    with pytest.raises(ConfigError) as e:
        load_config({}, {"MOED_CONFIG": str(missing)}, default_path=nowhere)
    assert str(e.value) == f"config (environment MOED_CONFIG): {missing} does not exist"


def test_unreadable_or_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}:")):
        load_config({}, {}, default_path=tmp_path)  # a directory, even as the default
    bad = _write(tmp_path, "max_queue = = 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"{bad} is not valid TOML")):
        load_config({"config": bad}, {}, default_path=tmp_path / "x")


def test_unknown_key_in_the_file_is_an_error_with_a_hint(tmp_path, nowhere):
    path = _write(tmp_path, "max_queue = 3\nmax-queue = 4\n")
    with pytest.raises(ConfigError) as e:
        load_config({"config": path}, {}, default_path=nowhere)
    assert (e.value.key, e.value.source) == ("max-queue", f"config file {path}")
    assert "unknown key" in str(e.value) and "did you mean max_queue?" in str(e.value)
    path = _write(tmp_path, "[serve]\nmax_queue = 3\n")  # the file is flat: no tables
    with pytest.raises(ConfigError, match="serve .*unknown key"):
        load_config({"config": path}, {}, default_path=nowhere)


def test_unknown_moed_variables_only_warn(nowhere):
    environ = {"MOED_MAX_QUEUE": "5", "MOED_MAX_QUEU": "6", "MOED_max_queue": "7",
               "MOED_CONFIG": "", "MOED_PORTABLE": "1", "MOED_OPENMP": "0", "MOED_DEBUG": "1",
               "MOED_URL": "http://h:1", "LANG": "C.UTF-8", "OTHER_MAX_QUEUE": "8"}
    config, warnings = load_config({}, environ, default_path=nowhere)
    assert config.max_queue == 5
    assert len(warnings) == 2
    assert "MOED_MAX_QUEU " in warnings[0] + " " and "did you mean MOED_MAX_QUEUE" in warnings[0]
    assert "MOED_max_queue" in warnings[1]


def test_api_key_warnings(tmp_path, nowhere):
    _, warnings = load_config(_parse(["--api-key", "secret"]), {}, default_path=nowhere)
    assert len(warnings) == 1 and "process list" in warnings[0]
    assert "secret" not in warnings[0]
    path = _write(tmp_path, 'api_key = "secret"\n')
    assert load_config({"config": path}, {}, default_path=nowhere)[1] == []
    path.chmod(0o644)
    _, warnings = load_config({"config": path}, {}, default_path=nowhere)
    assert len(warnings) == 1 and str(path) in warnings[0] and "readable by every" in warnings[0]
    assert load_config({}, {"MOED_API_KEY": "secret"}, default_path=nowhere)[1] == []


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.5.6.7", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("LocalHost", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.1", False), ("192.168.1.2", False),
    ("example.com", False), ("localhost.example.com", False), ("::ffff:10.0.0.1", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("text, address", [
    ("127.0.0.1:9464", Address("127.0.0.1", 9464)), ("[::1]:0", Address("::1", 0)),
    ("localhost:65535", Address("localhost", 65535)), ("0.0.0.0:80", Address("0.0.0.0", 80)),
    ("metrics.example.com:9464", Address("metrics.example.com", 9464)),
    ("[fe80::1%eth0]:1", Address("fe80::1%eth0", 1))])
def test_parse_address(text, address):
    assert parse_address(text) == address
    assert str(address) == text


@pytest.mark.parametrize("text", [
    "9464", "127.0.0.1", ":9464", "127.0.0.1:", "::1:9464", "[::1]9464", "[127.0.0.1]:1",
    "127.0.0.1:-1", "127.0.0.1:65536", "127.0.0.1:+80", "bad_host:80", "-a.com:80",
    "127.0.0.1:٣"])
def test_parse_address_rejects(text):
    with pytest.raises(ValueError):
        parse_address(text)


def test_non_loopback_tcp_address_needs_an_api_key(nowhere):
    with pytest.raises(ConfigError) as e:
        load_config(_parse(["--tcp-address", "0.0.0.0:8080"]), {}, default_path=nowhere)
    assert str(e.value).startswith("tcp_address (flag --tcp-address): 0.0.0.0 is not a loopback")
    assert "api_key" in str(e.value)
    config, _ = load_config(_parse(["--tcp-address", "0.0.0.0:8080"]), {"MOED_API_KEY": "k"},
                            default_path=nowhere)
    assert config.tcp_address == Address("0.0.0.0", 8080) and config.api_key == "k"
    config, _ = load_config(_parse(["--tcp-address", "[::1]:8080"]), {}, default_path=nowhere)
    assert config.tcp_address == Address("::1", 8080) and config.api_key is None
    # A non-loopback metrics address is allowed: it can only be set explicitly.
    config, _ = load_config({}, {"MOED_METRICS_ADDRESS": "0.0.0.0:9464"}, default_path=nowhere)
    assert not is_loopback(config.metrics_address.host)


@pytest.mark.parametrize("text, size", [
    ("65536", 65536), ("512M", 512 * M), ("2G", 2 * G), ("1.5GiB", int(1.5 * G)),
    ("8k", 8 * K), ("1KB", K), (" 4K ", 4 * K), ("1e3", 1000), ("0.5K", 512)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "0", "-1K", "1T", "inf", "nan", "lots", "0.1"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_construction_validates_and_config_is_frozen():
    with pytest.raises(ConfigError) as e:
        ServeConfig(max_queue=-1)
    assert str(e.value) == "max_queue (ServeConfig argument): must be >= 0, got -1"
    with pytest.raises(ConfigError, match=r"^socket \(ServeConfig argument\): must be set"):
        ServeConfig(socket=None)
    config = ServeConfig(log_level="DEBUG", metrics_address=("::1", 1))
    assert config.log_level == "debug" and config.metrics_address == Address("::1", 1)
    assert config.sources["log_level"] == "ServeConfig argument"
    assert config.sources["max_queue"] == "default"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_queue = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.sources["max_queue"] = "x"  # type: ignore[index]
    # sources do not take part in equality
    assert ServeConfig(max_queue=3) == dataclasses.replace(ServeConfig(), max_queue=3)


def test_to_dict_redacts_the_api_key():
    config = ServeConfig(api_key="s3cr3t", tcp_address="[::1]:8080", socket_mode="0640",
                         expert_cache_bytes="1G")
    d = config.to_dict()
    assert d["api_key"] == "<redacted>"
    assert (d["socket_mode"], d["tcp_address"], d["metrics_address"]) == (
        "0640", "[::1]:8080", "127.0.0.1:9464")
    assert d["expert_cache_bytes"] == G
    assert set(d) == set(KEYS)
    assert "s3cr3t" not in json.dumps(d) and "s3cr3t" not in repr(config)
    assert ServeConfig().to_dict()["api_key"] is None


def test_require_model(tmp_path, nowhere):
    with pytest.raises(ConfigError) as e:
        ServeConfig().require_model()
    assert str(e.value) == ('no model given: give --model DIR, MOED_MODEL=DIR or model = "DIR" '
                            'in the config file')
    emptied, _ = load_config({}, {"MOED_MODEL": ""}, default_path=nowhere)
    with pytest.raises(ConfigError, match=r"^no model given \(environment MOED_MODEL sets it "
                                          r"empty\): give --model DIR"):
        emptied.require_model()
    missing = tmp_path / "none"
    config, _ = load_config({}, {"MOED_MODEL": str(missing)}, default_path=nowhere)
    with pytest.raises(ConfigError) as e:
        config.require_model()
    assert str(e.value) == f"model (environment MOED_MODEL): {missing} does not exist"
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        ServeConfig(model=str(tmp_path / "file")).require_model()
    assert ServeConfig(model=str(tmp_path)).require_model() == str(tmp_path)


def _example_assignments(text: str) -> dict[str, int]:
    """key -> line number of its `key = ` or `# key = ` line in the example file."""
    found = {}
    for i, line in enumerate(text.splitlines()):
        m = re.match(r"^(?:# )?([a-z_]+) = ", line)
        if m:
            assert m.group(1) not in found, f"{m.group(1)} documented twice"
            found[m.group(1)] = i
    return found


def test_example_file_documents_every_key_with_its_default(tmp_path, nowhere):
    text = EXAMPLE.read_text()
    lines = text.splitlines()
    found = _example_assignments(text)
    assert set(found) == set(KEYS)
    for name, i in found.items():  # each key follows its own comment
        assert lines[i - 1].startswith("# ") and not re.match(r"^# [a-z_]+ = ", lines[i - 1]), name
    # The example loads as it is ...
    config, warnings = load_config({"config": str(EXAMPLE)}, {}, default_path=nowhere)
    assert warnings == []
    assert config.model == "/srv/models/your-model"
    assert dataclasses.replace(config, model=None) == ServeConfig()
    # ... and with every commented-out key switched on: the shown values are valid, and
    # for keys with a default they are the default.
    on = _write(tmp_path, re.sub(r"(?m)^# ([a-z_]+ = )", r"\1", text), "all.toml")
    config, _ = load_config({"config": str(on)}, {}, default_path=nowhere)
    defaults = ServeConfig()
    for name in KEYS:
        if name == "model":
            continue
        if getattr(defaults, name) is None:
            assert getattr(config, name) is not None, name  # an example value is shown
            assert config.sources[name] == f"config file {on}"
        else:
            assert getattr(config, name) == getattr(defaults, name), name


def test_the_concurrency_ceiling_is_the_engines_batch_limit():
    from daemon.service.config import MAX_CONCURRENT_SEQUENCES
    from ext.models.model import PREFILL_CHUNK

    assert MAX_CONCURRENT_SEQUENCES == PREFILL_CHUNK
    with pytest.raises(ConfigError, match="max_concurrent_sequences"):
        ServeConfig(max_concurrent_sequences=PREFILL_CHUNK + 1)
    with pytest.raises(ConfigError, match="shutdown_grace_s"):
        ServeConfig(shutdown_grace_s=1e10)


def test_the_numerics_label_before_the_load_counts_the_plain_weights_dtype(tmp_path):
    """fast-bf16 changes bf16 weights, so the label moed_build_info has before the load
    reads config.json's torch_dtype (or dtype); anything unreadable counts as nothing."""
    from daemon.service.daemon import _plain_format
    for raw, want in (('{"torch_dtype": "bfloat16"}', ("bf16",)), ('{"dtype": "float16"}', ("f16",)),
                      ('{"torch_dtype": "float32"}', ("f32",)), ('{"torch_dtype": 7}', ()),
                      ("[1]", ()), ("{not json", ())):
        (tmp_path / "config.json").write_text(raw)
        assert _plain_format(tmp_path) == want, raw
    assert _plain_format(tmp_path / "absent") == ()
