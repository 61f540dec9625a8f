"""Automatic prefix caching through `moed serve`: a shared long prefix, and a chat whose
turns each append to the last.

1. Shared prefix: per round a fresh random --prefix-tokens prefix; request A (prefix +
   its own 16-token tail) then request B (prefix + another tail), both streamed with
   max_tokens 1; the client's time to first token of each. The ratio A / B (target >= 5)
   per round and over rounds (median, min, max).
2. Chat: --turns turns, each the previous messages + the answer + a new user message
   (the model's chat template), with the prefix cache on and then off (a second daemon
   with prefix_cache_bytes 0): prompt tokens and prefill tokens (prompt - cached) per
   turn, and whether the answers are identical with reuse on and off.

    python bench/prefix_cache.py [--model DIR] [--rounds 5] [--prefix-tokens 2000]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import aiohttp
import numpy as np

from interleave import MAKE_MODEL
from served import ensure_model, serve, spread, sse_texts


async def _ttft(session, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    async with session.post("http://localhost/v1/completions", json={
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "stream": True}) as resp:
        async for _ in sse_texts(resp):
            return time.perf_counter() - t0
    raise RuntimeError("no token")


async def _shared_prefix(socket_path: str, rounds: int, n: int, vocab: int) -> dict:
    rng = np.random.default_rng(1)
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as s:
        await _ttft(s, rng.integers(1, vocab, 32).tolist())                # warm-up
        for _ in range(rounds):
            prefix = rng.integers(1, vocab, n).tolist()
            first = await _ttft(s, prefix + rng.integers(1, vocab, 16).tolist())
            second = await _ttft(s, prefix + rng.integers(1, vocab, 16).tolist())
            out.append({"first_ttft_s": first, "second_ttft_s": second, "ratio": first / second})
    return {"prefix_tokens": n, "rounds": out, "ratio_first_over_second": spread([r["ratio"] for r in out]),
            "target": 5.0}


async def _chat(socket_path: str, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a terse assistant for a code base."}]
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as s:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Turn {turn}: explain step {turn} "
                                                         "of the build in a few words."})
            async with s.post("http://localhost/v1/chat/completions", json={
                    "messages": messages, "max_tokens": 24, "temperature": 0.7,
                    "seed": turn}) as resp:
                body = await resp.json()
            answer = body["choices"][0]["message"]["content"]
            usage = body["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            out.append({"turn": turn, "prompt_tokens": usage["prompt_tokens"],
                        "cached_tokens": cached, "prefill_tokens": usage["prompt_tokens"] - cached,
                        "answer": answer})
            messages.append({"role": "assistant", "content": answer})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-interleave-model",
                   help="model directory (written by make-model when missing)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--turns", type=int, default=10)
    args = p.parse_args()
    model = ensure_model(args.model, MAKE_MODEL)
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    with serve(model) as d:
        shared = asyncio.run(_shared_prefix(d["socket"], args.rounds, args.prefix_tokens, vocab))
        chat_on = asyncio.run(_chat(d["socket"], args.turns))
    with serve(model, "--prefix-cache-bytes", "0") as d:
        chat_off = asyncio.run(_chat(d["socket"], args.turns))
    print(json.dumps({
        "model": model, "shared_prefix": shared,
        "chat": {"turns": [{k: v for k, v in t.items() if k != "answer"} for t in chat_on],
                 "prefill_tokens_on": [t["prefill_tokens"] for t in chat_on],
                 "prefill_tokens_off": [t["prefill_tokens"] for t in chat_off],
                 "identical_answers_on_and_off": [t["answer"] for t in chat_on]
                 == [t["answer"] for t in chat_off]}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
