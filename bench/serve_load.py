"""Load test of `moed serve`: N concurrent streaming clients x M requests over the Unix socket.

Starts the daemon on a private socket (or uses --socket of a running one), runs the load
once with 1 client and once with N, and prints JSON: per run the time to first token and
per-request decode tokens/s at p50 and p99, total generated tokens/s, and the ratio of
total tokens/s with N clients to that with one.

    python bench/serve_load.py --model DIR [--expert-cache-bytes SIZE] [--clients 32]
        [--requests 4] [--max-tokens 32] [--max-concurrent-sequences 4]

TTFT is measured by the client from sending the request to the first content chunk;
decode tokens/s of a request is (completion tokens - 1) / (last chunk - first chunk);
its p99 is the slow tail (99 % of requests were at least that fast).
Each request streams with ignore_eos so every request generates exactly --max-tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time

import aiohttp
from served import percentile, serve, sse_texts


async def _one(session: aiohttp.ClientSession, i: int, max_tokens: int) -> dict:
    body = {"prompt": f"def function_{i}(x):", "max_tokens": max_tokens,
            "temperature": 0.7, "seed": i, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    async with session.post("http://localhost/v1/completions", json=body) as resp:
        async for _ in sse_texts(resp):
            now = time.perf_counter()
            first = first or now
            last = now
            chunks += 1
    return {"ttft": (first or time.perf_counter()) - t0,
            "decode_tps": (max_tokens - 1) / (last - first) if last and last > first else float("nan"),
            "end": time.perf_counter()}


async def _load(socket_path: str, clients: int, requests: int, max_tokens: int) -> dict:
    connector = aiohttp.UnixConnector(path=socket_path, limit=clients)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def client(c: int) -> list[dict]:
            return [await _one(session, c * requests + r, max_tokens) for r in range(requests)]
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(c) for c in range(clients))) for r in rs]
        elapsed = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    tps = [r["decode_tps"] for r in results if r["decode_tps"] == r["decode_tps"]]
    return {"clients": clients, "requests": len(results), "seconds": elapsed,
            "total_tokens_per_second": len(results) * max_tokens / elapsed,
            "time_to_first_token_seconds": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
            # p99 of a rate is its slow tail: 99 % of requests decoded at least this fast.
            "request_tokens_per_second": {"p50": percentile(tps, 0.5), "p99": percentile(tps, 0.01),
                                          "mean": statistics.fmean(tps) if tps else float("nan")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--socket", help="use a running daemon instead of starting one")
    p.add_argument("--expert-cache-bytes", help="cache budget for the daemon this starts")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-concurrent-sequences", type=int, default=4)
    args = p.parse_args()
    with contextlib.ExitStack() as stack:
        sock = args.socket
        if sock is None:
            extra = ["--max-concurrent-sequences", str(args.max_concurrent_sequences),
                     "--max-queue", str(args.clients * args.requests)]
            if args.expert_cache_bytes:
                extra += ["--expert-cache-bytes", args.expert_cache_bytes]
            sock = stack.enter_context(serve(args.model, *extra, tuner=None))["socket"]
        asyncio.run(_load(sock, 1, 2, args.max_tokens))          # warm-up, not counted
        one = asyncio.run(_load(sock, 1, args.requests, args.max_tokens))
        many = asyncio.run(_load(sock, args.clients, args.requests, args.max_tokens))
        print(json.dumps({"one_client": one, "many_clients": many,
                          "total_tokens_per_second_ratio": many["total_tokens_per_second"]
                          / one["total_tokens_per_second"],
                          "max_concurrent_sequences": args.max_concurrent_sequences,
                          "max_tokens": args.max_tokens, "model": args.model}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
