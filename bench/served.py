"""Helpers of the serving benchmarks: a `moed serve` subprocess, a checkpoint written by
`moed make-model` on first use, percentiles and spreads.

Imported by the scripts beside it (`python bench/NAME.py` puts bench/ on sys.path).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

MOED = str(Path(sys.executable).with_name("moed"))


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values, linear between order statistics; nan if empty."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def sse_events(resp):
    """Every chunk (a dict) of a streamed completion (aiohttp response), up to [DONE];
    RuntimeError for an answer that is not 200."""
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
    async for line in resp.content:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        yield json.loads(line[6:])


async def sse_choices(resp):
    """The first choice (a dict) of each chunk with text of a streamed completion
    (aiohttp response)."""
    async for event in sse_events(resp):
        if event["choices"] and event["choices"][0].get("text"):
            yield event["choices"][0]


async def sse_texts(resp):
    """The text of each choice chunk of a streamed completion (aiohttp response)."""
    async for choice in sse_choices(resp):
        yield choice["text"]


def tokenizer_size(model: str | Path) -> int:
    """Token ids a checkpoint's tokenizer.json knows (its config's vocab_size may be
    larger, as make-model's --vocab-size pads the embedding past the tokenizer)."""
    tok = json.loads((Path(model) / "tokenizer.json").read_text())
    return len(tok["model"]["vocab"])


def spread(values: list[float]) -> dict:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_model(directory: str, make_args: list[str]) -> str:
    """`moed make-model MAKE_ARGS --out DIRECTORY` unless DIRECTORY holds a model."""
    if not (Path(directory) / "config.json").exists():
        subprocess.run([MOED, "make-model", *make_args, "--out", directory], check=True,
                       stdout=subprocess.DEVNULL)
    return directory


@contextlib.contextmanager
def serve(model: str, *args: str, tuner: str | None = "off") -> Iterator[dict]:
    """A `moed serve` on a private Unix socket and a loopback TCP port with an API key;
    yields {"socket", "url", "api_key", "workdir", "pid"}; SIGTERM and wait on exit. `tuner`:
    its MOED_TUNER (None: the configured default)."""
    workdir = tempfile.mkdtemp(prefix="moedbench", dir="/tmp")
    sock = os.path.join(workdir, "moed.sock")
    port, key = free_port(), "bench-key"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    env["MOED_CONFIG"] = os.path.join(workdir, "empty.toml")
    if tuner is not None:
        env["MOED_TUNER"] = tuner
    Path(env["MOED_CONFIG"]).write_text("")
    cmd = [MOED, "serve", "--model", model, "--socket", sock, "--state-dir",
           os.path.join(workdir, "state"), "--metrics-address", "127.0.0.1:0",
           "--tcp-address", f"127.0.0.1:{port}", "--api-key", key, *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        for line in proc.stderr:
            if '"event": "ready"' in line:
                break
        else:
            raise RuntimeError(f"moed serve exited with {proc.wait()} before it was ready")
        # Keep reading its log: a full pipe would block the daemon's next log line.
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        yield {"socket": sock, "url": f"http://127.0.0.1:{port}", "api_key": key, "workdir": workdir,
               "pid": proc.pid}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        shutil.rmtree(workdir, ignore_errors=True)
