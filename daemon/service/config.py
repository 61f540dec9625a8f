"""`moed serve` configuration: one typed, validated, frozen `ServeConfig` built at the edge.

Sources, in increasing precedence:

1. a TOML file: ``--config FILE``, else ``$MOED_CONFIG``, else ``/etc/moed/moed.toml``.
   Only the default file may be missing. The file is flat: top-level ``key = value``
   pairs named as the fields of `ServeConfig` (systemd/moed.toml documents every key);
2. environment variables ``MOED_<KEY>`` (KEY upper-case), e.g. ``MOED_MAX_QUEUE=16``;
3. command-line flags ``--<key>`` with dashes for underscores, e.g. ``--max-queue 16``
   (`add_arguments` registers them; only flags actually given override).

Every key has all three. Environment variables and flags are strings parsed by the same
rules as the file's strings; an empty string there sets an optional key back to None.

Units and formats. Sizes are bytes, an integer or a string with an optional K/M/G suffix
in powers of 1024 (``65536``, ``"512M"``, ``"1.5GiB"``; `parse_size`). Durations are
seconds (``_s``). Addresses are ``"host:port"`` with IPv6 hosts in brackets
(``"[::1]:9464"``; `parse_address`). ``socket_mode`` is octal: ``"0660"`` anywhere, or a
TOML integer such as ``0o660``. Booleans: TOML ``true``/``false``, else one of
true/false/1/0/yes/no.

Errors. A bad value in any source (even one a later source overrides), an unknown key in
the file, a missing or unreadable file that was named explicitly, or invalid TOML raise
`ConfigError` (a ValueError) whose message starts with the key and its source:
``max_queue (environment MOED_MAX_QUEUE): must be >= 0, got -1``. An unknown ``MOED_*``
variable is only a warning; warnings are returned to the caller (logging may not be set
up yet when the config is read).

Nothing here reads ``os.environ`` or ``sys.argv``: the caller passes both in.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import ipaddress
import math
import os
import re
import stat
import tomllib
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

# The numerics settings: auto, then the kernels' modes (ext.kernels.NUMERICS_SETTINGS;
# tests/ext/models/test_numerics.py checks they agree), named here so that the command line
# can offer them without loading ext/. auto resolves per model (ext.kernels.resolve_numerics).
NUMERICS = ("auto", "exact", "fast", "fast-bf16")
DEFAULT_CONFIG_PATH = "/etc/moed/moed.toml"
ENV_PREFIX = "MOED_"
CONFIG_ENV = "MOED_CONFIG"
# MOED_* variables that are not serve keys: the config file's name, build switches read
# by setup.py, and the client commands' daemon URL (daemon/commands/client.py). They are
# known, so they do not warn.
OTHER_ENV = frozenset({CONFIG_ENV, "MOED_PORTABLE", "MOED_OPENMP", "MOED_DEBUG", "MOED_URL"})
MAX_THREADS = 1024
MAX_CONNECTIONS = 65536
MAX_CONCURRENT_SEQUENCES = 64   # ext.models.model.PREFILL_CHUNK: the rows of one batched step
MAX_SECONDS = 1e6    # ~11.6 days: beyond this, waits overflow the platform's timeouts
UNIX_PATH_MAX = 107  # bytes of sun_path (108) minus its terminating NUL
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_SOURCE = "default"
ARGUMENT_SOURCE = "ServeConfig argument"
MIB = 2**20
GIB = 2**30


class ConfigError(ValueError):
    """A configuration value, key or file that cannot be used.

    ``key`` is the configuration key (``"config"`` for the file itself) and ``source``
    where the value came from (``"config file PATH"``, ``"environment MOED_KEY"``,
    ``"flag --key"``, ``"default"``); the message is ``"key (source): reason"``, unless
    ``message`` gives the whole of it (for a value no source gave: "(default)" would
    read as a value named "default").
    """

    def __init__(self, key: str, source: str, reason: str, *, message: str | None = None):
        super().__init__(message or f"{key} ({source}): {reason}")
        self.key = key
        self.source = source
        self.reason = reason


# --- value parsers: each takes a string (env, flag, TOML) or a native TOML/Python value
# --- and returns the typed value, or raises ValueError whose message is the reason.

def parse_size(text: str) -> int:
    """Bytes from ``text``: an integer with an optional K/M/G suffix (powers of 1024).

    ``"65536"``, ``"512M"``, ``"2G"``, ``"1.5GiB"``; a trailing ``B`` and ``i`` are
    ignored and fractions are truncated to whole bytes. Raises ValueError when the text
    is not a size or the result is below 1 byte. (The `moed` CLI's ``--expert-cache-bytes``
    and ``--shard-size`` use the same syntax.)
    """
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = units.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if t[-1:] in units else t) * mult)
    except (ValueError, OverflowError):
        raise ValueError(f"not a size: {text!r} (e.g. 65536, 512M, 2G)") from None
    if value < 1:
        raise ValueError(f"must be positive, got {text!r}")
    return value


class Address(NamedTuple):
    """A TCP address to listen on: ``host`` (name or IP, IPv6 without brackets), ``port``."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def parse_address(text: str) -> Address:
    """``"host:port"`` -> `Address`; IPv6 hosts in brackets (``"[::1]:9464"``).

    The host is an IP address or a DNS name; the port an integer in [0, 65535] (0: the
    kernel picks a free port). Raises ValueError naming what is wrong.
    """
    if not isinstance(text, str):
        raise ValueError(f"expected a \"host:port\" string, got {_type_name(text)}")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if not rest.startswith(":"):
            raise ValueError(f"expected \"[ipv6]:port\", got {text!r}")
        port = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"not an IPv6 address in brackets: {host!r}") from None
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError(f"expected \"host:port\", got {text!r}")
        if ":" in host:
            raise ValueError(f"IPv6 addresses go in brackets, e.g. \"[::1]:9464\"; got {text!r}")
        if not host:
            raise ValueError(f"missing host in {text!r} (0.0.0.0 listens on every interface)")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if len(host) > 253 or not _HOSTNAME.fullmatch(host):
                raise ValueError(f"not a host name or IP address: {host!r}") from None
    if not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
    return Address(host, int(port))


def is_loopback(host: str) -> bool:
    """Whether ``host`` can only be reached from this machine.

    True for ``localhost`` and for loopback IP addresses (127.0.0.0/8, ::1, and
    IPv4-mapped ``::ffff:127.x.y.z``); False for every other name, since a name may
    resolve to a public address.
    """
    h = host.strip("[]").lower()
    if h in ("localhost", "localhost."):
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _type_name(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return f"a {type(value).__name__}"


def _int(lo: int, hi: int | None = None) -> Callable[[object], int]:
    def parse(value: object) -> int:
        if isinstance(value, str):
            try:
                n = int(value.strip())
            except ValueError:
                raise ValueError(f"not an integer: {value!r}") from None
        elif isinstance(value, int) and not isinstance(value, bool):
            n = value
        else:
            raise ValueError(f"expected an integer, got {_type_name(value)}")
        if n < lo:
            raise ValueError(f"must be >= {lo}, got {n}")
        if hi is not None and n > hi:
            raise ValueError(f"must be <= {hi}, got {n}")
        return n
    return parse


def _float(lo: float, *, lo_open: bool, hi: float | None = None,
           infinite: bool = False) -> Callable[[object], float]:
    """A number >= lo (> lo when lo_open) and <= hi; `infinite`: inf is taken too."""
    def parse(value: object) -> float:
        if isinstance(value, str):
            try:
                x = float(value.strip())
            except ValueError:
                raise ValueError(f"not a number: {value!r}") from None
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            x = float(value)
        else:
            raise ValueError(f"expected a number, got {_type_name(value)}")
        if infinite and x == math.inf:
            return x
        if not math.isfinite(x):
            raise ValueError(f"must be finite{' or inf' if infinite else ''}, got {value!r}")
        if x < lo or (lo_open and x == lo):
            raise ValueError(f"must be {'>' if lo_open else '>='} {lo:g}, got {x:g}")
        if hi is not None and x > hi:
            raise ValueError(f"must be <= {hi:g}, got {x:g}")
        return x
    return parse


def _size(value: object) -> int:
    if isinstance(value, str):
        return parse_size(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"must be positive, got {value}")
        return value
    raise ValueError(f"expected a size (an integer, or a string such as \"512M\"), "
                     f"got {_type_name(value)}")


def _size_or_zero(value: object) -> int:
    """A size as `_size`, or 0 (``0``, ``"0"``): the feature is off."""
    if value == 0 or (isinstance(value, str) and value.strip() == "0"):
        return 0
    return _size(value)


def _mode(value: object) -> int:
    if isinstance(value, str):
        digits = value.strip()
        digits = digits[2:] if digits[:2] in ("0o", "0O") else digits
        if not digits or len(digits) > 4 or any(c not in "01234567" for c in digits):
            raise ValueError(f"not an octal mode: {value!r} (e.g. \"0660\")")
        mode = int(digits, 8)
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        raise ValueError(f"expected an octal mode such as \"0660\", got {_type_name(value)}")
    if not 0 <= mode <= 0o777:
        raise ValueError(f"must be between 0 and 0o777, got {mode} (in TOML write 0o660 "
                         "or \"0660\"; a plain 660 is decimal)")
    return mode


_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise ValueError(f"not a boolean: {value!r} (true/false, 1/0, yes/no)")
    raise ValueError(f"expected a boolean, got {_type_name(value)}")


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_type_name(value)}")
    if not value:
        raise ValueError("must not be empty")
    if "\0" in value:
        raise ValueError("must not contain a NUL character")
    return value


def _socket_path(value: object) -> str:
    path = _text(value)
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ValueError(f"a Unix socket path is at most {UNIX_PATH_MAX} bytes, "
                         f"got {len(os.fsencode(path))}: {path!r}")
    return path


def _address(value: object) -> Address:
    if isinstance(value, tuple) and len(value) == 2:  # an Address already
        return parse_address(str(Address(*value)))
    return parse_address(value)  # type: ignore[arg-type]


MAX_PREFILL_CHUNK = 16384


def _prefill_chunk(value: object) -> int | str:
    """"auto" (case and spaces ignored) or tokens per step, 1 .. MAX_PREFILL_CHUNK."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return _int(1, MAX_PREFILL_CHUNK)(value)


def _choice(choices: tuple[str, ...]) -> Callable[[object], str]:
    """A parser of one of `choices`, case and surrounding spaces ignored."""
    def parse(value: object) -> str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {_type_name(value)}")
        word = value.strip().lower()
        if word not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}")
        return word
    return parse


_log_level = _choice(LOG_LEVELS)


DEFAULT_MODEL_ALIAS = "default"


def default_model_dir() -> Path:
    """The embedded default model, shipped as package data (daemon/default_model/)."""
    return Path(__file__).resolve().parent.parent / "default_model"     # daemon/service/..


def resolve_model_alias(model: str) -> str:
    """"default" names the embedded default model, unless a directory called "default"
    exists where moed runs (then that directory wins)."""
    if model == DEFAULT_MODEL_ALIAS and not os.path.isdir(model):
        return str(default_model_dir())
    return model


TUNER_MODES = ("off", "live", "live+idle")
# "moed": the streaming expert cache as designed (its eviction policy, learned pins,
# prefetch, the referee); "naive": the baseline it is measured against (LRU, no pins, no
# prefetch, nothing learned or saved), as `moed bench` runs it.
EXPERT_CACHE_MODES = ("moed", "naive")


_tuner = _choice(TUNER_MODES)
# Who shares prefix cache blocks: "shared", every request of the same cache_salt (or of
# none); "client", only requests of the same client (peer uid on the Unix socket, peer
# address or IPv6 /64 over TCP; daemon/workers/compile_slots.py) and the same cache_salt.
PREFIX_CACHE_SCOPES = ("shared", "client")


@dataclass(frozen=True)
class _Key:
    parse: Callable[[object], Any]
    metavar: str
    help: str
    optional: bool = False
    unset: str = "unset"  # what None means, for --help


# One entry per ServeConfig field, in field order.
KEYS: Mapping[str, _Key] = types.MappingProxyType({
    "model": _Key(lambda v: resolve_model_alias(_text(v)), "DIR",
                  'Hugging Face model directory ("default": the embedded default model)', True,
                  "none; required to serve"),
    "socket": _Key(_socket_path, "PATH", "Unix socket to serve the HTTP API on"),
    "socket_mode": _Key(_mode, "MODE", "octal permissions of the socket file, set after bind"),
    "socket_group": _Key(_text, "GROUP", "group owning the socket file", True,
                         "the daemon's group"),
    "state_dir": _Key(_text, "DIR", "where learned expert usage is kept", True,
                      "$STATE_DIRECTORY, else ~/.local/state/moed"),
    "expert_cache_bytes": _Key(_size, "SIZE", "stream experts into a cache of SIZE bytes, "
                                              "K/M/G suffixes", True,
                                "sized by the memory planner"),
    "max_concurrent_sequences": _Key(_int(1, MAX_CONCURRENT_SEQUENCES), "N", "requests decoded together"),
    "max_queue": _Key(_int(0), "N", "requests waiting behind them before 429"),
    "prefill_step_ratio": _Key(_float(1, lo_open=True, hi=100, infinite=True), "R|inf",
                               "a step that prefills beside decodes aims at R decode steps' "
                               "time: lower, streams first (their tokens come at most about R "
                               "times slower while a prompt is prefilled); higher, long prompts "
                               "first; inf: a prompt takes whole prefill chunks and the streams "
                               "wait a chunk's time, as llama.cpp does"),
    "prefill_chunk": _Key(_prefill_chunk, "TOKENS|auto",
                          "prompt tokens a forward step takes at most; auto: 512 (64 when memory "
                          "is short), or up to 1024 when the experts stream (fewer expert reads "
                          "per prompt token), its buffers at most a quarter of the expert cache"),
    "prefix_cache_bytes": _Key(_size_or_zero, "SIZE", "KV of recent prompts kept for requests "
                                                      "that start the same way (0: off)"),
    "prefix_cache_scope": _Key(_choice(PREFIX_CACHE_SCOPES), "SCOPE",
                               "who shares cached prefixes: shared (every client; cached_tokens "
                               "and timing show whether another client's prompt began the same "
                               "way) or client (only the same peer uid, address or /64)"),
    "prefix_cache_persist_bytes": _Key(_size_or_zero, "SIZE", "KV of the prefix cache kept "
                                                              "in the state directory across "
                                                              "restarts, the most recent first "
                                                              "(0: none)"),
    "max_context_tokens": _Key(_int(1), "N", "tokens one sequence may hold, prompt and "
                                             "completion (at most the model's)", True,
                                "the model's; with the memory planner at most 8192, cut to "
                                "what fits"),
    "max_tokens": _Key(_int(1), "N", "ceiling on a request's max_tokens (larger asks are cut to it)"),
    "max_body_bytes": _Key(_size, "SIZE", "largest request body"),
    "request_timeout_s": _Key(_float(0, lo_open=True, hi=MAX_SECONDS), "SECONDS", "a request's time limit"),
    "header_timeout_s": _Key(_float(0, lo_open=True, hi=MAX_SECONDS), "SECONDS",
                             "time a connection gets to send a whole request head (request "
                             "line and headers), from when it opens or its last answer ended"),
    "body_timeout_s": _Key(_float(0, lo_open=True, hi=MAX_SECONDS), "SECONDS",
                           "time a request gets to send its whole body (then 408)"),
    "max_connections": _Key(_int(1, MAX_CONNECTIONS), "N",
                            "open connections per listener (socket, tcp_address, "
                            "metrics_address); one more is answered 503"),
    "max_connections_per_peer": _Key(_int(1, MAX_CONNECTIONS), "N",
                                     "open connections of one peer per TCP listener (its "
                                     "address, IPv6 by /64; the Unix socket has none), at "
                                     "most max_connections; one more is answered 503"),
    "chat_template_max_chars": _Key(_int(1), "N", "longest text the model's chat template may "
                                                  "render for one request (then 400)"),
    "chat_template_timeout_s": _Key(_float(0, lo_open=True, hi=MAX_SECONDS), "SECONDS",
                                    "time the chat template may take to render one request "
                                    "(then 400)"),
    "grammar_compile_timeout_s": _Key(_float(0, lo_open=True, hi=MAX_SECONDS), "SECONDS",
                                      "time a response_format schema may take to compile "
                                      "(then 400)"),
    "grammar_compile_memory_bytes": _Key(_size, "SIZE", "address space of the process a "
                                                        "response_format schema compiles in "
                                                        "(then 400)"),
    "shutdown_grace_s": _Key(_float(0, lo_open=False, hi=MAX_SECONDS), "SECONDS",
                             "time running requests get to finish on SIGTERM"),
    "metrics_address": _Key(_address, "HOST:PORT", "where /metrics is also served over TCP"),
    "tcp_address": _Key(_address, "HOST:PORT", "also serve the API over TCP (non-loopback "
                                               "needs api_key)", True),
    "api_key": _Key(_text, "KEY", "bearer token TCP clients must send", True),
    "log_level": _Key(_log_level, "LEVEL", "one of " + ", ".join(LOG_LEVELS)),
    "threads": _Key(_int(1, MAX_THREADS), "N", "compute threads", True, "the CPUs available"),
    "io_workers": _Key(_int(1, MAX_THREADS), "N", "reader threads for streamed experts"),
    "pin_fraction": _Key(_float(0, lo_open=False, hi=1), "F",
                         "share of the spare expert cache pinned to learned hot experts"),
    "prefetch": _Key(_bool, "BOOL", "read predicted experts ahead"),
    "half_life_tokens": _Key(_float(0, lo_open=True), "TOKENS", "half-life of expert usage counts"),
    "numerics": _Key(_choice(NUMERICS), "MODE",
                     "auto (fast when the model has int8/int4/MXFP4 weights, else exact), "
                     "exact (quantised weights dequantised exactly, f32 activations), fast "
                     "(int8/int4/MXFP4 weights dotted with int8 activations; bf16, f16, f32 "
                     "and FP8 weights exact) or fast-bf16 (fast, and bf16 weights dotted with "
                     "bf16-rounded activations)"),
    "expert_cache_mode": _Key(_choice(EXPERT_CACHE_MODES), "MODE",
                              "moed (learned pins, eviction policy, prefetch) or naive (the "
                              "baseline: LRU, no pins, no prefetch, nothing learned)"),
    "tuner": _Key(_tuner, "MODE", "self-tuning of threads, io workers and prefetch width: off, "
                                  "live (on traffic; saved winners reused) or live+idle (also a "
                                  "built-in workload when idle)"),
    "record_trace": _Key(_text, "FILE", "append the routing of every decoded token to FILE, in "
                                        "the format moed replay-trace reads", True, "not recorded"),
})


@dataclass(frozen=True)
class ServeConfig:
    """Everything `moed serve` is configured with; validated on construction.

    Fields are the configuration keys (see the module docstring and systemd/moed.toml):
    sizes in bytes, durations in seconds, ``socket_mode`` an int such as 0o660, addresses
    as `Address`. ``state_dir`` None means the caller's default
    (``daemon.state.default_state_dir``); ``threads`` None means all CPUs available;
    ``expert_cache_bytes`` None means the memory planner sizes the cache (or experts stay
    memory-mapped when they all fit; daemon.memory.plan_serving_memory).
    ``sources`` maps each key to where its value came from (``"default"``, or
    ``"ServeConfig argument"`` for a value given directly); it does not take part in
    equality.

    Raises ConfigError (naming the key and its source) for a value out of range or of the
    wrong type, and for a non-loopback ``tcp_address`` without ``api_key``.
    """

    model: str | None = None
    socket: str = "/run/moed/moed.sock"
    socket_mode: int = 0o660
    socket_group: str | None = None
    state_dir: str | None = None
    expert_cache_bytes: int | None = None
    max_concurrent_sequences: int = 4
    max_queue: int = 64
    prefill_step_ratio: float = 2.75
    prefill_chunk: int | str = "auto"
    prefix_cache_bytes: int = 512 * MIB
    prefix_cache_scope: str = "shared"
    prefix_cache_persist_bytes: int = 512 * MIB
    max_context_tokens: int | None = None
    max_tokens: int = 4096
    max_body_bytes: int = 1 * MIB
    request_timeout_s: float = 600.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 512
    max_connections_per_peer: int = 64
    chat_template_max_chars: int = 4 * MIB
    chat_template_timeout_s: float = 5.0
    grammar_compile_timeout_s: float = 5.0
    grammar_compile_memory_bytes: int = 1 * GIB
    shutdown_grace_s: float = 30.0
    metrics_address: Address = Address("127.0.0.1", 9464)
    tcp_address: Address | None = None
    api_key: str | None = field(default=None, repr=False)  # never in logs
    log_level: str = "info"
    threads: int | None = None
    io_workers: int = 2
    pin_fraction: float = 0.5
    prefetch: bool = True
    half_life_tokens: float = 2048.0
    numerics: str = "auto"
    expert_cache_mode: str = "moed"
    tuner: str = "live"
    record_trace: str | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        sources = {f.name: self.sources.get(f.name) or (
                       DEFAULT_SOURCE if getattr(self, f.name) == f.default else ARGUMENT_SOURCE)
                   for f in dataclasses.fields(self) if f.name in KEYS}
        object.__setattr__(self, "sources", types.MappingProxyType(sources))
        for name, key in KEYS.items():
            value = getattr(self, name)
            if value is None:
                if key.optional:
                    continue
                raise ConfigError(name, sources[name], "must be set")
            try:
                object.__setattr__(self, name, key.parse(value))
            except ValueError as e:
                raise ConfigError(name, sources[name], str(e)) from None
        if (self.tcp_address is not None and not is_loopback(self.tcp_address.host)
                and self.api_key is None):
            raise ConfigError("tcp_address", sources["tcp_address"],
                              f"{self.tcp_address.host} is not a loopback address: set "
                              "api_key too (MOED_API_KEY or api_key in the config file)")

    def require_model(self) -> str:
        """The model directory; raises ConfigError when unset or not a directory."""
        source = self.sources["model"]
        if self.model is None:
            # None by default, or set back to None by an empty value ("" in a source)
            given = "" if source == DEFAULT_SOURCE else f" ({source} sets it empty)"
            raise ConfigError("model", source, "not set", message=(
                f"no model given{given}: give --model DIR, MOED_MODEL=DIR or "
                "model = \"DIR\" in the config file"))
        if not os.path.exists(self.model):
            raise ConfigError("model", source, f"{self.model} does not exist")
        if not os.path.isdir(self.model):
            raise ConfigError("model", source, f"{self.model} is not a directory (expected "
                                               "config.json, tokenizer.json, *.safetensors)")
        return self.model

    def to_dict(self) -> dict[str, Any]:
        """Every key with a JSON-able value for logging: addresses as ``"host:port"``,
        ``socket_mode`` as ``"0660"``, ``api_key`` as ``"<redacted>"`` when set."""
        out: dict[str, Any] = {}
        for name in KEYS:
            value = getattr(self, name)
            if isinstance(value, Address):
                value = str(value)
            out[name] = value
        out["socket_mode"] = f"0{self.socket_mode:o}"
        if self.api_key is not None:
            out["api_key"] = "<redacted>"
        return out


def _default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(ServeConfig) if f.name == name)


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def size_text(n: int) -> str:
    """``n`` bytes as the docs and systemd/moed.toml write a size: the largest of G, M, K
    (powers of 1024) that divides it exactly, else plain bytes (``512M``, ``1G``, ``1536``;
    `parse_size` reads each back to ``n``)."""
    for suffix, unit in (("G", GIB), ("M", MIB), ("K", 2**10)):
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def default_text(name: str) -> str:
    """Key ``name``'s default as `moed serve --help` and docs/configuration.md show it:
    sizes with a K/M/G suffix, ``socket_mode`` in octal, booleans in lower case, and the
    key's ``unset`` words when the default is None."""
    key, default = KEYS[name], _default(name)
    if default is None:
        return key.unset
    if name == "socket_mode":
        return f"0{default:o}"
    if key.parse in (_size, _size_or_zero):
        return size_text(default)
    return str(default).lower() if isinstance(default, bool) else str(default)


def add_arguments(parser: argparse.ArgumentParser, *, exclude: Collection[str] = ()) -> None:
    """Register ``--config`` and one flag per key (except those in ``exclude``) on ``parser``.

    Flags take strings, checked by `load_config` (so a bad flag value is a ConfigError
    naming the flag, like a bad file or environment value). Their default is
    ``argparse.SUPPRESS``: only flags actually given appear in the namespace and override
    the environment and the file. ``prefetch`` is ``--prefetch [BOOL]`` / ``--no-prefetch``.
    Use ``exclude`` for keys a parent parser already defines (e.g. ``{"log_level"}``).
    """
    group = parser.add_argument_group(
        "configuration", "Each option may also be set as MOED_<KEY> in the environment or as "
                         "a key of the config file; flags override the environment, which "
                         "overrides the file.")
    group.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                       help=f"TOML config file (default: ${CONFIG_ENV}, else "
                            f"{DEFAULT_CONFIG_PATH} if it exists)")
    for name, key in KEYS.items():
        if name in exclude:
            continue
        text = f"{key.help} (default: {default_text(name)}; env {_env_name(name)})"
        if name == "prefetch":
            group.add_argument(_flag_name(name), dest=name, nargs="?", const="true",
                               default=argparse.SUPPRESS, metavar=key.metavar, help=text)
            group.add_argument("--no-prefetch", dest=name, action="store_const", const="false",
                               default=argparse.SUPPRESS, help="same as --prefetch false")
        else:
            group.add_argument(_flag_name(name), dest=name, default=argparse.SUPPRESS,
                               metavar=key.metavar, help=text)


def _config_file(flags: Mapping[str, Any], environ: Mapping[str, str],
                 default_path: str | os.PathLike[str]) -> tuple[str, str, bool]:
    """(path, who named it, must it exist)."""
    if flags.get("config") is not None:
        path = flags["config"]
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigError("config", "flag --config", "must be a file path")
        return os.fspath(path), "flag --config", True
    if environ.get(CONFIG_ENV):
        return environ[CONFIG_ENV], f"environment {CONFIG_ENV}", True
    return os.fspath(default_path), DEFAULT_SOURCE, False


def _read_file(path: str, named_by: str, required: bool) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        if required:
            raise ConfigError("config", named_by, f"{path} does not exist") from None
        return None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", named_by, f"{path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError("config", named_by, f"{path}: {e.strerror or e}") from None


def _hint(word: str, candidates: Collection[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def load_config(args: argparse.Namespace | Mapping[str, Any], environ: Mapping[str, str], *,
                default_path: str | os.PathLike[str] = DEFAULT_CONFIG_PATH,
                ) -> tuple[ServeConfig, list[str]]:
    """Build the `ServeConfig` from the file, then ``environ``, then the flags in ``args``.

    args: the parsed namespace (or a dict) holding ``config`` and flags under their key
        names; entries that are absent or None are "not given", other entries are ignored.
    environ: the process environment (``os.environ`` at the edge; a dict in tests).
    default_path: the file read when neither ``--config`` nor ``$MOED_CONFIG`` names one.

    Returns the config and a list of warnings (unknown ``MOED_*`` variables, an api_key
    exposed on the command line or in a world-readable file), for the caller to log.
    Raises ConfigError as described in the module docstring.
    """
    flags = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    warnings: list[str] = []
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def put(name: str, raw: object, source: str) -> None:
        key = KEYS[name]
        if key.optional and raw == "":
            values[name] = None
        else:
            try:
                values[name] = key.parse(raw)
            except ValueError as e:
                raise ConfigError(name, source, str(e)) from None
        sources[name] = source

    path, named_by, required = _config_file(flags, environ, default_path)
    document = _read_file(path, named_by, required)
    if document is not None:
        source = f"config file {path}"
        for name, raw in document.items():
            if name not in KEYS:
                raise ConfigError(name, source, "unknown key" + _hint(name, KEYS))
            put(name, raw, source)
        if "api_key" in document and os.stat(path).st_mode & stat.S_IROTH:
            warnings.append(f"api_key (config file {path}): the file is readable by every "
                            "user; chmod o-r it")
    known_env = {_env_name(n): n for n in KEYS}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX):
            continue
        if var in known_env:
            put(known_env[var], environ[var], f"environment {var}")
        elif var not in OTHER_ENV:
            warnings.append(f"unknown environment variable {var} ignored"
                            + _hint(var, [*known_env, *OTHER_ENV]))
    for name in KEYS:
        if flags.get(name) is not None:
            put(name, flags[name], f"flag {_flag_name(name)}")
    if sources.get("api_key", "").startswith("flag") and values.get("api_key") is not None:
        warnings.append("api_key (flag --api-key): visible to every local user in the process "
                        f"list; prefer {_env_name('api_key')} or the config file")
    return ServeConfig(**values, sources=sources), warnings
