"""A long prompt beside decoding streams, moed against llama-server on one checkpoint: the
streams' inter-token gaps while it is prefilled and its time to first token; one JSON object.

    python bench/interleave_peer.py --llama-server PATH --gguf F.gguf --model DIR
        [--runs 3] [--ratios inf,2.75,1.5] [--prompt-tokens 1500] [--streams 3]

DIR is a moed checkpoint and F.gguf the same weights converted to GGUF (bench/llamacpp_ab.py
makes both under its --work-dir: moed/bf16 and gguf/BF16.gguf; PATH is the llama-server of
its build, build/bin/llama-server). Subjects: llama-server (`-m F.gguf -t T -c S*N -np S`:
S slots of N context tokens each, its default batch sizes) and `moed serve` on DIR (T
threads, S sequences, N context tokens, prefix cache off) once per `prefill_step_ratio` of
--ratios. Both are reached over loopback TCP. Every subject is a fresh server per run; a
run takes the subjects in turn, in the reverse order every other run.

Tokens are counted from the events, each of which says how many tokens it carries: moed
sends an event per token (its text possibly empty) with the token's logprobs; llama-server
sends no event for a token after which the text ends in an incomplete UTF-8 character
(random output of a byte-level vocabulary often does), so its requests ask for
timings_per_token and each event's timings.predicted_n counts the tokens so far. An event
of k tokens ends one gap and k - 1 gaps of zero.

Per subject and run, after a warm-up:
  check:  S - 1 streams of --check-tokens tokens with stream_options.include_usage: the
          tokens the events carried against usage.completion_tokens ("token_check_ok"),
          and whether every token had an event of its own ("one_event_per_token");
  alone:  the long prompt (--prompt-tokens random token ids, max_tokens 2) with nothing
          else running: its time to first token;
  mixed:  --streams streaming completions (8-token prompts, ignore_eos, --stream-tokens
          at most) decode; after --baseline-s the long prompt (new random ids) is sent.
          The streams' median gap before it, median, p99 and max gap during its prefill
          (gaps ending after the send and starting before its first token), its time to
          first token; the ratios p99 (and max) gap / median gap before, and TTFT mixed /
          alone.

Prompts are token ids, so both engines prefill the same tokens (no chat template, no
tokenizer difference); they are random, so no prefix is reused (usage's cached_tokens is
reported). The JSON: the machine and its load average before, after and at each run,
moed's kernels' build_info() (its SIMD path), llama-server's --version and the sdist it was
built from, per subject every run's figures and their median, min and max, and "summary",
a flat table of the medians.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT)]

from interleave import gap_stats  # noqa: E402
from llamacpp_ab import machine, llama_source  # noqa: E402
from served import free_port, serve, spread, sse_events, tokenizer_size  # noqa: E402

LLAMA = "llama.cpp"


def log(msg: str) -> None:
    print(f"[interleave_peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ratio_list(text: str) -> list[float]:
    out = []
    for t in text.split(","):
        try:
            r = float(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {t!r}") from None
        if not r > 1:
            raise argparse.ArgumentTypeError(f"{t}: a prefill_step_ratio is > 1 (or inf)")
        out.append(r)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", type=Path, required=True, help="llama-server binary")
    p.add_argument("--gguf", type=Path, required=True, help="the checkpoint as GGUF, for llama-server")
    p.add_argument("--model", type=Path, required=True, help="the same checkpoint, moed's directory")
    p.add_argument("--runs", type=int, default=3, help="runs of every subject, at least 3 (default 3)")
    p.add_argument("--ratios", type=ratio_list, default=[float("inf"), 2.75, 1.5],
                   help="moed's prefill_step_ratio values, one subject each (default inf,2.75,1.5)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=4, help="llama-server -np; moed's max_concurrent_sequences")
    p.add_argument("--context", type=int, default=4096, help="context tokens per sequence")
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--stream-tokens", type=int, default=2000,
                   help="max_tokens of a stream: more than it makes while the prompt is prefilled")
    p.add_argument("--check-tokens", type=int, default=24)
    p.add_argument("--baseline-s", type=float, default=3.0,
                   help="seconds of decoding measured before the long prompt")
    p.add_argument("--pause", type=float, default=2.0, help="idle seconds before each run")
    p.add_argument("--llama-server-args", type=shlex.split, default=[], metavar="ARGS",
                   help="more llama-server arguments, one string, e.g. '--poll 0' (default none)")
    args = p.parse_args(argv)
    if args.runs < 3:
        p.error("--runs: at least 3")
    if args.streams + 1 > args.slots:
        p.error("--slots: at least --streams + 1 (the long prompt needs a place beside them)")
    if max(args.prompt_tokens, args.stream_tokens + 8) + 2 > args.context:
        p.error("--context: too small for --prompt-tokens or --stream-tokens")
    for f in (args.llama_server, args.gguf, args.model):
        if not f.exists():
            p.error(f"{f}: not found")
    return args


# ---------------------------------------------------------------- the servers

@contextlib.contextmanager
def llama_server(args) -> dict:
    port = free_port()
    cmd = [str(args.llama_server), "-m", str(args.gguf), "-t", str(args.threads),
           "-c", str(args.context * args.slots), "-np", str(args.slots), "--port", str(port),
           "--host", "127.0.0.1", *args.llama_server_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.time() > deadline:
                raise RuntimeError("llama-server not ready in 300 s")
            time.sleep(0.5)
        # timings_per_token: every event counts the tokens so far (llama-server sends no
        # event, nor logprobs, for a token that leaves the text an incomplete UTF-8 character)
        yield {"url": url, "headers": {}, "extra": {"timings_per_token": True}, "command": cmd}
    finally:
        proc.terminate()
        proc.wait(60)


@contextlib.contextmanager
def moed_server(args, ratio: float) -> dict:
    extra = ["--threads", str(args.threads), "--max-concurrent-sequences", str(args.slots),
             "--max-context-tokens", str(args.context), "--prefix-cache-bytes", "0",
             "--prefill-step-ratio", str(ratio)]
    with serve(str(args.model), *extra) as d:
        yield {"url": d["url"], "headers": {"Authorization": f"Bearer {d['api_key']}"}, "extra": {},
               "command": ["moed", "serve", "--model", str(args.model), *extra]}


def llama_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    return (out.stdout + out.stderr).strip()


# ---------------------------------------------------------------- the requests

def event_tokens(event: dict, before: int) -> int:
    """Tokens a streamed completion event carries, `before` tokens having come: from
    llama-server's count of tokens so far (timings.predicted_n, sent with every event when
    the request asks timings_per_token), else from the choice's logprobs (OpenAI's
    completions shape, "tokens": moed; the chat shape, "content")."""
    counted = (event.get("timings") or {}).get("predicted_n")
    if counted is not None:
        return counted - before
    lp = event["choices"][0].get("logprobs") or {}
    return len(lp.get("tokens") or lp.get("content") or [])


async def _stream(session, server: dict, body: dict, events: list[tuple[float, int]], usage: dict,
                  first: asyncio.Future | None = None) -> None:
    """A streamed completion: (arrival time, tokens carried) of each event with a choice
    into `events`, its usage into `usage`; `first` gets the first token's arrival."""
    async with session.post(server["url"] + "/v1/completions", json={**body, **server["extra"]},
                            headers=server["headers"]) as resp:
        came = 0
        async for event in sse_events(resp):
            if event.get("usage"):
                usage.update(event["usage"])
            if event["choices"]:
                k = event_tokens(event, came)
                came += k
                events.append((time.perf_counter(), k))
                if first is not None and k and not first.done():
                    first.set_result(events[-1][0])


def token_gaps(events: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """(end time, seconds) of each token's gap after the one before: an event of k tokens
    ends one gap and k - 1 of zero (they arrive together); events without one are skipped."""
    out, last = [], None
    for t, k in events:
        if not k:
            continue
        if last is not None:
            out += [(t, t - last)] + [(t, 0.0)] * (k - 1)
        last = t
    return out


def _body(prompt: list[int], max_tokens: int, seed: int) -> dict:
    # logprobs: every event says how many tokens it carries
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": 1}


def _session(n: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n + 1),
                                 timeout=aiohttp.ClientTimeout(total=3600))


async def check(server: dict, n: int, tokens: int, ids) -> list[dict]:
    """n streams of `tokens` tokens at once: token events against usage, per stream."""
    async with _session(n) as s:
        events = [[] for _ in range(n)]
        usage = [{} for _ in range(n)]
        await asyncio.gather(*(_stream(s, server, _body(ids(8), tokens, i), events[i], usage[i])
                               for i in range(n)))
    return [{"events": len(e), "token_events": sum(1 for _, k in e if k),
             "tokens": sum(k for _, k in e), "completion_tokens": u.get("completion_tokens")}
            for e, u in zip(events, usage)]


async def alone(server: dict, prompt: list[int]) -> dict:
    async with _session(1) as s:
        events, usage = [], {}
        t0 = time.perf_counter()
        await _stream(s, server, _body(prompt, 2, 0), events, usage)
    return {"ttft_s": next(t for t, k in events if k) - t0, "usage": usage}


async def mixed(server: dict, args, prompt: list[int], ids) -> dict:
    async with _session(args.streams) as s:
        events = [[] for _ in range(args.streams)]
        usage = [{} for _ in range(args.streams)]
        tasks = [asyncio.create_task(_stream(s, server, _body(ids(8), args.stream_tokens, i),
                                             events[i], usage[i])) for i in range(args.streams)]
        while min(sum(k for _, k in e) for e in events) < 2:     # every stream is decoding
            if any(t.done() for t in tasks):
                await asyncio.gather(*tasks)                # raises the failure
            await asyncio.sleep(0.01)
        await asyncio.sleep(args.baseline_s)
        sent = time.perf_counter()
        first: asyncio.Future = asyncio.get_running_loop().create_future()
        long_events, long_usage = [], {}
        await _stream(s, server, _body(prompt, 2, 0), long_events, long_usage, first)
        first_at = first.result()
        done_early = [t.done() for t in tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if any(done_early):
        raise RuntimeError("a stream ended before the long prompt's first token: raise --stream-tokens")
    return {"ttft_s": first_at - sent, "usage": long_usage,
            "stream_tokens": [sum(k for _, k in e) for e in events],
            "stream_events": [len(e) for e in events],
            **gap_stats([token_gaps(e) for e in events], sent, first_at)}


def one_run(args, subject: tuple[str, float | None], rng) -> dict:
    engine, ratio = subject
    vocab = tokenizer_size(args.model)

    def ids(n: int) -> list[int]:
        return rng.integers(3, vocab, n).tolist()

    time.sleep(args.pause)
    load = os.getloadavg()
    with (llama_server(args) if engine == LLAMA else moed_server(args, ratio)) as server:
        asyncio.run(alone(server, ids(64)))                                # warm-up
        checked = asyncio.run(check(server, args.slots - 1, args.check_tokens, ids))
        lone = asyncio.run(alone(server, ids(args.prompt_tokens)))
        mix = asyncio.run(mixed(server, args, ids(args.prompt_tokens), ids))
    mix.update({"ttft_alone_s": lone["ttft_s"], "ttft_ratio_mixed_over_alone": mix["ttft_s"] / lone["ttft_s"],
                "alone_usage": lone["usage"], "token_check": checked,
                "token_check_ok": all(c["tokens"] == c["completion_tokens"] for c in checked),
                "one_event_per_token": all(c["token_events"] == c["tokens"] for c in checked),
                "loadavg_at_start": list(load), "command": server["command"]})
    return mix


def subject_name(subject: tuple[str, float | None]) -> str:
    engine, ratio = subject
    return engine if ratio is None else f"moed prefill_step_ratio={ratio:g}"


FIGURES = ("ttft_alone_s", "ttft_s", "ttft_ratio_mixed_over_alone", "gap_before_median_s",
           "gap_during_median_s", "gap_during_p99_s", "gap_during_max_s",
           "gap_ratio_p99_over_median", "gap_ratio_max_over_median",
           "gap_ratio_p99_before_over_median")


def main(argv=None) -> int:
    args = parse_args(argv)
    from ext.kernels._kernels import build_info
    subjects = [(LLAMA, None)] + [("moed", r) for r in args.ratios]
    rng = np.random.default_rng(0)
    runs: dict[str, list[dict]] = {subject_name(s): [] for s in subjects}
    start, before = time.time(), os.getloadavg()
    for run in range(args.runs):
        for subject in (subjects if run % 2 == 0 else subjects[::-1]):
            r = one_run(args, subject, rng)
            runs[subject_name(subject)].append(r)
            log(f"run {run + 1} {subject_name(subject)}: TTFT {r['ttft_alone_s']:.2f} s alone, "
                f"{r['ttft_s']:.2f} s mixed ({r['ttft_ratio_mixed_over_alone']:.2f}x); gap median "
                f"{r['gap_before_median_s'] * 1e3:.0f} ms, p99 during {r['gap_during_p99_s']:.2f} s "
                f"({r['gap_ratio_p99_over_median']:.1f}x); load {r['loadavg_at_start'][0]:.2f}")
    results = {name: {"runs": rs, **{f: spread([round(r[f], 4) for r in rs]) for f in FIGURES},
                      "token_check_ok": all(r["token_check_ok"] for r in rs),
                      "one_event_per_token": all(r["one_event_per_token"] for r in rs)}
               for name, rs in runs.items()}
    tree = args.llama_server.resolve().parent.parent.parent          # <tree>/build/bin/llama-server
    print(json.dumps({
        "machine": {**machine(), "loadavg_before": list(before), "loadavg_after": list(os.getloadavg())},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "moed": {"build_info": build_info(), "omp_wait_policy": "PASSIVE (the moed command sets it)"},
        "llama_cpp": {"version": llama_version(args.llama_server), **llama_source(tree)},
        "results": results,
        "summary": [{"subject": name, **{f: r[f]["median"] for f in FIGURES},
                     "token_check_ok": r["token_check_ok"],
                     "one_event_per_token": r["one_event_per_token"]} for name, r in results.items()],
        "elapsed_s": round(time.time() - start, 1)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
