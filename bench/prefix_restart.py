"""Benchmark: time to first token of a long prompt after `moed serve` restarts, with the
prefix cache kept in the state directory (daemon/engine/prefix_store.py) against a cold
start.

For each round: a daemon on a fresh state directory answers a prompt of `--prompt`
tokens (its TTFT is the cold figure; the cache then holds it), is stopped (SIGTERM, or
kill -9 once it has saved: the `prefix_cache_saved` log line) and started again on the
same state directory, and the same prompt with a few new tokens at its end is sent (an
agent's next turn): its TTFT, cached_tokens and the start's `prefix_cache_restored`
line. Also per round, a daemon started with `--prefix-cache-persist-bytes 0` (nothing
kept) answers the same next turn after a restart: the cold-restart figure. Streams
/v1/completions over the Unix socket; TTFT is the time to the first streamed chunk.
Prints one JSON object: per mode (sigterm, kill-9, not kept) the TTFTs per round, their
median and spread, the cached tokens; the ratio kept / not kept per round.

    python bench/prefix_restart.py --model DIR [--prompt 4000] [--rounds 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import tokenizers

MOED = str(Path(sys.executable).with_name("moed"))


class Serve:
    """`moed serve` in a subprocess; its log lines parsed as they come."""

    def __init__(self, model: str, state: str, threads: int, *args: str):
        self.dir = tempfile.mkdtemp(prefix="moedb")
        self.socket = os.path.join(self.dir, "s.sock")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
        env["MOED_TUNER"] = "off"
        env["MOED_CONFIG"] = os.path.join(self.dir, "none.toml")
        Path(env["MOED_CONFIG"]).write_text("")
        self.proc = subprocess.Popen([MOED, "serve", "--model", model, "--socket", self.socket,
                                      "--state-dir", state, "--threads", str(threads),
                                      "--metrics-address", "127.0.0.1:0", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.events: list[dict] = []
        self.started = time.monotonic()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait("ready", 600)
        self.ready_s = time.monotonic() - self.started
        self.http = httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), base_url="http://x",
                                 timeout=600)

    def _read(self) -> None:
        for line in self.proc.stderr:
            try:
                self.events.append(json.loads(line))
            except ValueError:
                pass

    def wait(self, event: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events:
                if e.get("event") == event:
                    return e
            if self.proc.poll() is not None:
                raise RuntimeError(f"moed serve exited {self.proc.returncode} before {event}")
            time.sleep(0.05)
        raise TimeoutError(event)

    def ttft(self, ids: list[int]) -> tuple[float, int]:
        """(seconds to the first streamed chunk, cached_tokens of the answer)."""
        t0 = time.monotonic()
        first = None
        cached = None
        body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:500]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first is None:
                    first = time.monotonic() - t0
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        return first, cached

    def stop(self, kill: bool = False) -> None:
        self.http.close()
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        self.proc.wait(600)
        shutil.rmtree(self.dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt", type=int, default=4000, help="prompt tokens (default 4000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    vocab = min(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"],
                tokenizers.Tokenizer.from_file(str(Path(args.model) / "tokenizer.json")).get_vocab_size())
    results = {m: {"ttft_s": [], "cached_tokens": [], "restored_blocks": [], "cold_ttft_s": []}
               for m in ("sigterm", "kill-9", "not-kept")}
    for r in range(args.rounds):
        ids = [(7919 * (i + 1000 * r)) % (vocab - 10) + 5 for i in range(args.prompt)]
        turn = ids + [11, 12, 13, 14, 15, 16, 17, 18]
        for mode in results:
            state = tempfile.mkdtemp(prefix="moedstate")
            extra = ("--prefix-cache-persist-bytes", "0") if mode == "not-kept" else ()
            try:
                first = Serve(args.model, state, args.threads, *extra)
                cold, _ = first.ttft(ids)
                if mode == "kill-9":
                    first.wait("prefix_cache_saved", 600)
                first.stop(kill=mode == "kill-9")
                second = Serve(args.model, state, args.threads, *extra)
                warm, cached = second.ttft(turn)
                restored = next((e for e in second.events if e.get("event") == "prefix_cache_restored"), {})
                second.stop()
            finally:
                shutil.rmtree(state, ignore_errors=True)
            out = results[mode]
            out["cold_ttft_s"].append(round(cold, 3))
            out["ttft_s"].append(round(warm, 3))
            out["cached_tokens"].append(cached)
            out["restored_blocks"].append(restored.get("blocks", 0))
            print(f"round {r + 1} {mode}: first start {cold:.2f} s, after the restart {warm:.2f} s, "
                  f"cached {cached}", file=sys.stderr)
    for mode, out in results.items():
        v = out["ttft_s"]
        out["median_ttft_s"] = statistics.median(v)
        out["spread_ttft_s"] = [min(v), max(v)]
    base = results["not-kept"]["ttft_s"]
    report = {"model": args.model, "prompt_tokens": args.prompt, "rounds": args.rounds,
              "threads": args.threads, "loadavg": os.getloadavg(), "modes": results,
              "not_kept_over_kept": {m: [round(b / k, 2) for b, k in zip(base, results[m]["ttft_s"])]
                                     for m in ("sigterm", "kill-9")}}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
