"""A long prompt arriving while streams decode: does it stall them, and is it still quick?

Starts `moed serve` (prefix cache off, so every prompt is computed) on a `moed make-model`
checkpoint (written into --model on first use), then for each round, interleaved:

  alone:  the long prompt (--prompt-tokens random token ids) with nothing else running;
          its time to first token;
  mixed:  --streams streaming requests decoding; after --baseline-s seconds the same kind
          of long prompt is sent. The streams' inter-token gaps before it (median) and
          while it is prefilled (from its send to its first token: p99, max) and the long
          prompt's time to first token.

Prints JSON: per round and over the rounds (median, min, max) the ratios the serving
targets name — p99 gap during the prefill / median gap before it (target <= 3), and
the long prompt's TTFT mixed / alone (target <= 1.5). Gaps and TTFT are measured by the
client, from the arrival of Server-Sent Events over the Unix socket. Last, a 0.9 MB
prompt too long for the context is posted while the streams decode: its answer (400,
refused before tokenization) and the streams' worst gap meanwhile.

    python bench/interleave.py [--model DIR] [--rounds 5] [--prompt-tokens 3500]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import aiohttp
import numpy as np

from served import ensure_model, percentile, serve, spread, sse_choices, tokenizer_size

MAKE_MODEL = ["--arch", "qwen3_moe", "--layers", "8", "--experts", "16", "--top-k", "2",
              "--hidden", "256", "--intermediate", "256", "--seed", "3"]


async def _stream(session, body: dict, arrivals: list[float], first: asyncio.Future | None = None,
                  tokens: list[int] | None = None):
    """Stream a completion; the arrival time of each event with text (and, for a body
    asking for logprobs, into `tokens`, how many tokens it carries)."""
    async with session.post("http://localhost/v1/completions", json=body) as resp:
        async for choice in sse_choices(resp):
            arrivals.append(time.perf_counter())
            if tokens is not None:
                tokens.append(len(choice["logprobs"]["tokens"]))
            if first is not None and not first.done():
                first.set_result(arrivals[-1])


def _stream_body(rng, vocab: int, seed: int) -> dict:
    return {"prompt": rng.integers(1, vocab, 8).tolist(), "max_tokens": 4000, "temperature": 0.8,
            "seed": seed, "ignore_eos": True, "stream": True, "logprobs": 0}


def _gaps(arrivals: list[float], tokens: list[int]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(event gaps, token gaps) of one stream, each as (end time, seconds): token gaps
    are those ending in an event of one token."""
    events = [(t1, t1 - t0) for t0, t1 in zip(arrivals, arrivals[1:])]
    return events, [g for g, k in zip(events, tokens[1:]) if k == 1]


def _long_body(rng, n: int, vocab: int) -> dict:
    return {"prompt": rng.integers(1, vocab, n).tolist(), "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": True}


async def _alone(socket_path: str, body: dict) -> float:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as s:
        arrivals: list[float] = []
        t0 = time.perf_counter()
        await _stream(s, body, arrivals)
        return arrivals[0] - t0


async def _mixed(socket_path: str, body: dict, streams: int, baseline_s: float, rng, vocab: int) -> dict:
    connector = aiohttp.UnixConnector(path=socket_path, limit=streams + 1)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=3600)) as s:
        arrivals = [[] for _ in range(streams)]
        tokens = [[] for _ in range(streams)]
        tasks = [asyncio.create_task(_stream(s, _stream_body(rng, vocab, i), arrivals[i],
                                             tokens=tokens[i])) for i in range(streams)]
        while min(len(a) for a in arrivals) < 2:          # every stream is decoding
            await asyncio.sleep(0.01)
        await asyncio.sleep(baseline_s)
        sent = time.perf_counter()
        first: asyncio.Future = asyncio.get_running_loop().create_future()
        long_arrivals: list[float] = []
        long_task = asyncio.create_task(_stream(s, body, long_arrivals, first))
        ttft_at = await first
        await long_task
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    out = {"ttft_s": ttft_at - sent}
    for kind, which in (("token", 1), ("event", 0)):
        out[kind] = gap_stats([_gaps(a, k)[which] for a, k in zip(arrivals, tokens)], sent, ttft_at)
    return out


def gap_stats(streams: list[list[tuple[float, float]]], sent: float, first_at: float) -> dict:
    """The streams' gaps ((end time, seconds) each) before a long prompt was sent at
    `sent` and during its prefill (until its first token at `first_at`): medians, p99,
    max, counts, and the ratios to the median before."""
    before, during = [], []
    for gaps in streams:
        before += [g for t1, g in gaps if t1 < sent]
        # a gap belongs to the prefill when it ends after the send and starts before
        # the long prompt's first token
        during += [g for t1, g in gaps if t1 > sent and t1 - g < first_at]
    median = statistics.median(before)
    return {"gap_before_median_s": median, "gap_before_p99_s": percentile(before, 0.99),
            "gap_during_median_s": statistics.median(during),
            "gap_during_p99_s": percentile(during, 0.99), "gap_during_max_s": max(during),
            "gaps_before": len(before), "gaps_during": len(during),
            "gap_ratio_p99_over_median": percentile(during, 0.99) / median,
            "gap_ratio_max_over_median": max(during) / median,
            "gap_ratio_p99_before_over_median": percentile(before, 0.99) / median}


async def _rejected(socket_path: str, streams: int, nbytes: int, rng, vocab: int) -> dict:
    """Streams decoding while a prompt of nbytes of text too long for the context is
    posted: its status and time to answer, the streams' worst gap meanwhile."""
    connector = aiohttp.UnixConnector(path=socket_path, limit=streams + 1)
    async with aiohttp.ClientSession(connector=connector) as s:
        arrivals = [[] for _ in range(streams)]
        tasks = [asyncio.create_task(_stream(s, _stream_body(rng, vocab, i), arrivals[i]))
                 for i in range(streams)]
        while min(len(a) for a in arrivals) < 20:
            await asyncio.sleep(0.01)
        sent = time.perf_counter()
        words = " ".join(f"w{i % 977}" for i in range(nbytes // 5))[:nbytes]
        async with s.post("http://localhost/v1/completions", json={"prompt": words}) as resp:
            status = resp.status
            message = (await resp.json())["error"]["message"]
        answered = time.perf_counter()
        await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    before = [t1 - t0 for a in arrivals for t0, t1 in zip(a, a[1:]) if t1 < sent]
    during = [t1 - t0 for a in arrivals for t0, t1 in zip(a, a[1:]) if t1 > sent and t0 < answered]
    return {"prompt_bytes": nbytes, "status": status, "message": message,
            "answer_s": answered - sent, "gap_before_median_s": statistics.median(before),
            "gap_during_max_s": max(during) if during else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-interleave-model",
                   help="model directory (written by make-model when missing)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=3500)
    p.add_argument("--baseline-s", type=float, default=2.0,
                   help="seconds of decoding measured before the long prompt")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra `moed serve` argument (repeatable), e.g. --serve-arg=--max-concurrent-sequences=8")
    args = p.parse_args()
    model = ensure_model(args.model, MAKE_MODEL)
    vocab = tokenizer_size(model)
    extra = ["--prefix-cache-bytes", "0", *args.serve_arg]
    if args.threads:
        extra += ["--threads", str(args.threads)]
    rng = np.random.default_rng(0)
    rounds = []
    with serve(model, *extra) as d:
        asyncio.run(_alone(d["socket"], _long_body(rng, 64, vocab)))       # warm-up
        for _ in range(args.rounds):
            alone = asyncio.run(_alone(d["socket"], _long_body(rng, args.prompt_tokens, vocab)))
            mixed = asyncio.run(_mixed(d["socket"], _long_body(rng, args.prompt_tokens, vocab),
                                       args.streams, args.baseline_s, rng, vocab))
            mixed["ttft_alone_s"] = alone
            mixed["ttft_ratio_mixed_over_alone"] = mixed["ttft_s"] / alone
            rounds.append(mixed)
        rejected = asyncio.run(_rejected(d["socket"], args.streams, 900_000, rng, vocab))
    print(json.dumps({
        "model": model, "make_model": MAKE_MODEL, "streams": args.streams,
        "prompt_tokens": args.prompt_tokens, "serve_args": extra, "rounds": rounds,
        "gap_ratio_p99_over_median": spread([r["token"]["gap_ratio_p99_over_median"] for r in rounds]),
        "ttft_ratio_mixed_over_alone": spread([r["ttft_ratio_mixed_over_alone"] for r in rounds]),
        "ttft_alone_s": spread([r["ttft_alone_s"] for r in rounds]),
        "ttft_mixed_s": spread([r["ttft_s"] for r in rounds]),
        **{f"{kind}_gaps": {
            "gap_ratio_p99_over_median": spread([r[kind]["gap_ratio_p99_over_median"] for r in rounds]),
            # the same ratio with no long prompt at all: the streams' own jitter
            "gap_ratio_p99_before_over_median": spread([r[kind]["gap_ratio_p99_before_over_median"]
                                                        for r in rounds]),
            "gap_before_median_s": spread([r[kind]["gap_before_median_s"] for r in rounds]),
            "gap_during_median_s": spread([r[kind]["gap_during_median_s"] for r in rounds]),
            "gap_during_p99_s": spread([r[kind]["gap_during_p99_s"] for r in rounds])}
           for kind in ("token", "event")},
        "rejected_long_prompt": rejected,
        "targets": {"gap_ratio_p99_over_median": 3.0, "ttft_ratio_mixed_over_alone": 1.5}},
        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
