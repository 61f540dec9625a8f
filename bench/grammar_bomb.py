"""What a schema whose compile never ends costs `moed serve` (daemon/workers/grammar.py):
the answer time of one such request (an allOf of 30 `.*x.*` string patterns), then
`--bombs` different ones at once while another client streams a completion: the
daemon's peak RSS (VmHWM, and its growth), the compile workers' largest summed RSS
(sampled every 20 ms), the stream's largest gap between tokens against the same stream
alone, and what each bomb was answered. JSON on stdout.

    .venv/bin/python bench/grammar_bomb.py [--bombs 8] [--tokens 400] [-- SERVE FLAGS]

The checkpoint is `moed make-model` (4 layers, 16 experts) in --model-dir; serve flags
after `--` go to `moed serve` (the grammar_compile_* keys keep their defaults otherwise).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time

import aiohttp

from served import ensure_model, serve

PROMPT = [5, 6, 7, 8]


def bomb(n: int, salt: str) -> dict:
    letters = [chr(97 + i % 26) + str(i // 26 or "") for i in range(n)]
    return {"type": "json_schema", "json_schema": {"name": "bomb", "schema": {
        "allOf": [{"type": "string", "pattern": f".*{salt}{x}.*"} for x in letters]}}}


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _children(pid: int) -> list[int]:
    """Child processes of every thread of `pid` (a worker's parent is the thread that
    started it)."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except OSError:
            pass
    return out


class WorkerRss:
    """The largest summed RSS of the daemon's child processes, sampled in a thread."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            total = 0
            for child in _children(self.pid):
                try:
                    total += _status(child).get("VmRSS", 0)
                except OSError:
                    pass
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


async def _post(session, url, key, body) -> tuple[int, dict, float]:
    started = time.monotonic()
    async with session.post(url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.json(), time.monotonic() - started


async def _stream(session, url, key, tokens: int, until: asyncio.Event | None = None) -> dict:
    """Greedy streamed completions of `tokens` tokens, one after another until `until` is
    set (None: one); the gaps between chunks within each."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    gaps, chunks, streams = [], 0, 0
    started = time.monotonic()
    while True:
        stamps = []
        async with session.post(url + "/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    stamps.append(time.monotonic())
        gaps += [b - a for a, b in zip(stamps, stamps[1:])]
        chunks += len(stamps)
        streams += 1
        if until is None or until.is_set():
            break
    gaps.sort()
    return {"streams": streams, "chunks": chunks, "seconds": round(time.monotonic() - started, 3),
            "largest_gap_s": round(gaps[-1], 4), "p99_gap_s": round(gaps[int(0.99 * len(gaps))], 4),
            "median_gap_s": round(gaps[len(gaps) // 2], 4)}


async def _run(server: dict, bombs: int, tokens: int) -> dict:
    url, key, pid = server["url"], server["api_key"], server["pid"]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await _post(session, url, key, {"prompt": PROMPT, "max_tokens": 2})      # warm
        alone = await _stream(session, url, key, tokens)
        status, body, took = await _post(session, url, key,
                                         {"prompt": PROMPT, "max_tokens": 4,
                                          "response_format": bomb(30, "one")})
        one = {"status": status, "seconds": round(took, 3),
               "message": body.get("error", {}).get("message")}
        before = _status(pid)
        workers = WorkerRss(pid)
        done = asyncio.Event()
        stream = asyncio.ensure_future(_stream(session, url, key, tokens, done))
        await asyncio.sleep(0.05)
        answers = await asyncio.gather(*(
            _post(session, url, key, {"prompt": PROMPT, "max_tokens": 4,
                                      "response_format": bomb(30, str(i))})
            for i in range(bombs)))
        done.set()
        streamed = await stream
        worker_peak = workers.stop()
        after = _status(pid)
    return {
        "one_bomb": one,
        "stream_alone": alone,
        "with_bombs": {
            "bombs": bombs,
            "answers": [{"status": s, "seconds": round(t, 3),
                         "code": b.get("error", {}).get("code")} for s, b, t in answers],
            "stream": streamed,
            "daemon_peak_rss_bytes": after["VmHWM"],
            "daemon_peak_rss_before_bytes": before["VmHWM"],
            "daemon_rss_before_bytes": before["VmRSS"], "daemon_rss_after_bytes": after["VmRSS"],
            "workers_peak_rss_bytes_summed": worker_peak,
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bombs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400, help="tokens the other client streams")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(),
                                                        "moed-bench-grammar-bomb"))
    ap.add_argument("serve_args", nargs="*", help="flags for moed serve (after --)")
    args = ap.parse_args()
    model = ensure_model(args.model_dir, ["--arch", "qwen3_moe", "--layers", "4", "--experts",
                                          "16", "--top-k", "2", "--hidden", "128",
                                          "--intermediate", "64"])
    with serve(model, *args.serve_args) as server:
        report = asyncio.run(_run(server, args.bombs, args.tokens))
    report["serve_args"] = args.serve_args
    report["cpus"] = os.cpu_count()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
