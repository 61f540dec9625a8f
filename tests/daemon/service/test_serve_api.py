"""`moed serve` end to end: the real daemon subprocess, spoken to over its Unix socket.

Clients are the ones operators use: the official `openai` Python client over an httpx
Unix-socket transport, `curl --unix-socket`, and plain httpx for concurrency. The model
is a tiny random Qwen3-MoE whose experts are streamed through a cache of about a quarter
of their bytes, so every request also exercises the expert reads. No sleeps: the daemon's
own JSON log lines (`ready`, `request_finished`) and its answers are what the tests wait on.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import socket
import subprocess
import time
from importlib.metadata import version
from pathlib import Path

import httpx
import openai
import pytest
import tools
from daemon_proc import Daemon, UnixHTTPConnection, short_dir

from daemon.store.streaming import minimum_cache_bytes
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model
from ext.models.config import load_config
from ext.models.experts import ExpertLayout
from ext.tokenizer import Tokenizer

MODEL = "model"                      # the canonical name: the model directory's basename
CONTEXT = 4096                       # make_model's max_position_embeddings
MAX_BODY = 64 * 1024
TIMEOUT = httpx.Timeout(120.0)
CLIENTS, PER_CLIENT = 32, 4
# one compute thread: the machine is shared, and an OpenMP team waiting for a busy core is
# slow (the tokens are the same at any thread count)
ONE_THREAD = ("--threads", "1")


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("serve") / MODEL, arch="qwen3_moe", layers=4,
                      experts=16, top_k=4, hidden=128, intermediate=64, dtype="bf16", seed=0)


@pytest.fixture(scope="module")
def cache_bytes(model_dir) -> int:
    """About 25 % of the experts' bytes (the cache's minimum, top_k slots per layer)."""
    config = load_config(model_dir)
    expert_bytes = (config.num_hidden_layers * config.num_experts * 3 * config.hidden_size
                    * config.moe_intermediate_size * 2)
    minimum = minimum_cache_bytes(ExpertLayout(Checkpoint(model_dir), config), config)
    budget = max(minimum, expert_bytes // 4)
    assert budget <= 0.3 * expert_bytes        # streaming, not everything resident
    return budget


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def daemon(model_dir, cache_bytes):
    d = Daemon(model_dir, short_dir(), "--expert-cache-bytes", str(cache_bytes),
               "--max-queue", str(CLIENTS * PER_CLIENT), "--max-body-bytes", str(MAX_BODY),
               *ONE_THREAD)
    try:
        yield d
        assert d.stop() == 0
    finally:
        finish(d)


# ---------------------------------------------------------------------- helpers


def finish(d: Daemon) -> None:
    """Kill if still running, remove its directory, close its pipes."""
    d.cleanup()
    d.proc.stdout.close()
    d.proc.stderr.close()


def uds_client(d: Daemon) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=d.socket), base_url="http://localhost",
                        timeout=TIMEOUT)


def openai_client(http: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=http,
                         max_retries=0)


def sse_payloads(raw: bytes) -> list[bytes]:
    """The payloads of an SSE body that is exactly `data: <payload>\\n\\n` events."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    payloads = []
    for event in raw[:-2].split(b"\n\n"):
        assert event.startswith(b"data: "), event
        assert b"\n" not in event and b"\r" not in event, event
        payloads.append(event[len(b"data: "):])
    return payloads


def sse_chunks(raw: bytes) -> list[dict]:
    """Decode a whole SSE answer: compact JSON events then `[DONE]`; the JSON chunks."""
    payloads = sse_payloads(raw)
    assert payloads[-1] == b"[DONE]"
    chunks = []
    for p in payloads[:-1]:
        chunk = json.loads(p)
        assert json.dumps(chunk, separators=(",", ":")).encode() == p     # compact
        chunks.append(chunk)
    return chunks


def outcome_of_stream(chunks: list[dict], chat: bool) -> dict:
    """text, finish_reason and usage of a streamed answer (include_usage on)."""
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    body = chunks[1:] if chat else chunks
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content, final, usage = body
    assert usage["choices"] == [] and final["choices"][0]["finish_reason"] is not None
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    def piece(c: dict) -> str:       # a chat answer's reasoning (Qwen3's <think> token) and content
        delta = c["choices"][0]["delta"] if chat else {}
        return delta.get("reasoning_content", "") + delta.get("content", "") if chat else c["choices"][0]["text"]
    return {"text": "".join(piece(c) for c in content),
            "finish_reason": final["choices"][0]["finish_reason"],
            "usage": usage["usage"]}


def outcome_of_full(answer: dict, chat: bool) -> dict:
    choice = answer["choices"][0]
    message = choice.get("message", {})
    return {"text": (message.get("reasoning_content") or "") + (message["content"] or "") if chat else choice["text"],
            "finish_reason": choice["finish_reason"], "usage": answer["usage"]}


def assert_error(status: int, body: dict, expected_status: int, *, param=None, code=None,
                 type: str = "invalid_request_error") -> None:
    assert status == expected_status, body
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type
    assert error["param"] == param
    assert error["code"] == code


def assert_serving(d: Daemon) -> None:
    assert d.proc.poll() is None
    assert d.json("GET", "/health") == (200, {"status": "ok"})


def stats(d: Daemon) -> dict:
    status, body = d.json("GET", "/v1/moed/stats")
    assert status == 200
    return body


def chat_prompt_tokens(tokenizer: Tokenizer, messages: list[dict]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------- 6. the small routes


def test_health_models_metrics_stats_pins(daemon, model_dir, cache_bytes):
    assert daemon.json("GET", "/health") == (200, {"status": "ok"})

    status, models = daemon.json("GET", "/v1/models")
    assert status == 200
    assert models["object"] == "list"
    assert [{k: m[k] for k in ("id", "object", "owned_by")} for m in models["data"]] == [
        {"id": MODEL, "object": "model", "owned_by": "moed"}]
    assert isinstance(models["data"][0]["created"], int)
    weights = models["data"][0]["weights"]
    assert (weights["experts"], weights["dense"], weights["quantization"]) == ("bf16", "bf16", None)
    assert list(weights["dense_formats"]) == ["bf16"] and weights["dense_formats"]["bf16"] > 0
    assert weights["numerics"] == "exact"

    status, headers, body = daemon.request("GET", "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=")
    text = body.decode()
    assert "# TYPE moed_build_info gauge" in text
    assert (f'moed_build_info{{model_type="qwen3_moe",numerics="exact",quantization="none",'
            f'version="{version("moed")}"}} 1.0'
            in text.splitlines())

    s = stats(daemon)
    assert {"requests", "cache", "hit_rate", "tokens_per_second", "memory"} <= set(s)
    assert s["requests"]["running"] == 0 and s["requests"]["waiting"] == 0
    assert s["requests"]["max_concurrent_sequences"] == 4
    assert s["requests"]["max_queue"] == CLIENTS * PER_CLIENT
    assert s["memory"]["budget_bytes"] == cache_bytes
    # the daemon's resident memory (psutil), as the kernel counts it
    status_rss = next(int(line.split()[1]) * 1024 for line in
                      Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines()
                      if line.startswith("VmRSS:"))
    assert 0.5 * status_rss < s["memory"]["rss_bytes"] < 2 * status_rss
    cache = s["cache"]
    slots = cache["pinned"]["slots"] + cache["dynamic"]["slots"] + cache["staging"]["slots"]
    assert slots * cache["slot_bytes"] <= cache_bytes < (slots + 1) * cache["slot_bytes"]
    assert s["hit_rate"] is None or 0.0 <= s["hit_rate"] <= 1.0
    assert s["model"] == MODEL

    status, pins = daemon.json("GET", "/v1/moed/pins")
    assert status == 200
    assert pins["model_fingerprint"] == Checkpoint(model_dir).fingerprint()
    # nothing learned yet, and a cache at its minimum has no spare slot to pin
    assert pins["pins"] == []


# ---------------------------------------------------------------------- 1. the openai client


def test_openai_client_chat_and_completion(daemon, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Which experts are hot today?"}]
    prompt_tokens = chat_prompt_tokens(tokenizer, messages)
    with uds_client(daemon) as http:
        client = openai_client(http)
        assert [m.id for m in client.models.list().data] == [MODEL]

        full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                              temperature=0, extra_body={"ignore_eos": True})
        assert full.object == "chat.completion"
        assert full.model == MODEL
        assert full.id.startswith("chatcmpl-")
        assert len(full.choices) == 1
        assert full.choices[0].finish_reason == "length"
        assert full.choices[0].message.role == "assistant"
        assert full.usage.completion_tokens == 12
        assert full.usage.prompt_tokens == prompt_tokens
        assert full.usage.total_tokens == prompt_tokens + 12
        text = full.choices[0].message.content
        assert text

        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert {c.object for c in chunks} == {"chat.completion.chunk"}
        assert len({c.id for c in chunks}) == 1
        assert chunks[0].choices[0].delta.role == "assistant"
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
        assert [c.choices[0].finish_reason for c in finals] == ["length"]
        assert chunks[-1].choices == []
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens,
                chunks[-1].usage.total_tokens) == (prompt_tokens, 12, prompt_tokens + 12)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == text

        # temperature 0.8 with a seed: the same text streamed or not; another seed differs
        sampled = {}
        for seed in (1, 2):
            once = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=16, temperature=0.8, seed=seed,
                extra_body={"ignore_eos": True})
            assert once.usage.completion_tokens == 16
            pieces = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=16, temperature=0.8, seed=seed,
                stream=True, extra_body={"ignore_eos": True})
            streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
            assert streamed == once.choices[0].message.content
            sampled[seed] = streamed
        assert sampled[1] != sampled[2]
        assert sampled[1] != text

        prompt = "Experts are read from disk when"
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert completion.object == "text_completion"
        assert completion.id.startswith("cmpl-")
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage.completion_tokens == 10
        assert completion.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert completion.usage.total_tokens == completion.usage.prompt_tokens + 10
        pieces = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert {c.object for c in pieces} == {"text_completion"}
        assert [c.choices[0].finish_reason for c in pieces][-1] == "length"
        assert "".join(c.choices[0].text for c in pieces) == completion.choices[0].text


# ---------------------------------------------------------------------- 2. curl and SSE framing


@pytest.mark.tools("curl")
def test_curl_streaming_sse_framing(daemon, tokenizer):
    messages = [{"role": "user", "content": "Stream me some tokens."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 9, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    run = subprocess.run([tools.path("curl"), "-sS", "-N", "--unix-socket", daemon.socket, "-D", "-",
                          "-H", "Content-Type: application/json", "--data-binary", json.dumps(body),
                          "http://localhost/v1/chat/completions"],
                         capture_output=True, timeout=120, check=True)
    head, sep, raw = run.stdout.partition(b"\r\n\r\n")
    assert sep
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 200 OK"
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache"

    payloads = sse_payloads(raw)
    assert payloads[-1] == b"[DONE]"
    chunks = sse_chunks(raw)
    first, *content, final, usage = chunks
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]
    assert content
    for c in content:
        assert c["object"] == "chat.completion.chunk"
        assert c["usage"] is None
        assert set(c["choices"][0]["delta"]) == {"content"}
        assert c["choices"][0]["finish_reason"] is None
    assert final["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                 "finish_reason": "length"}]
    prompt_tokens = chat_prompt_tokens(tokenizer, messages)
    assert usage["choices"] == []
    cached = usage["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert cached % 16 == 0 and 0 <= cached < prompt_tokens     # whole prefix-cache blocks
    assert usage["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 9,
                              "total_tokens": prompt_tokens + 9}
    assert len({c["id"] for c in chunks}) == 1 and first["id"].startswith("chatcmpl-")
    assert {c["model"] for c in chunks} == {MODEL}

    # the same request, not streamed: the same text
    status, full = daemon.json("POST", "/v1/chat/completions",
                               {k: v for k, v in body.items()
                                if k not in ("stream", "stream_options")})
    assert status == 200
    assert full["choices"][0]["message"]["content"] == "".join(
        c["choices"][0]["delta"]["content"] for c in content)
    # the streamed run left the whole prompt's blocks in the prefix cache
    assert full["usage"].pop("prompt_tokens_details") == {"cached_tokens": (prompt_tokens - 1) // 16 * 16}
    assert full["usage"] == usage["usage"]


@pytest.mark.tools("curl")
def test_curl_completions_stream_without_usage(daemon):
    body = {"prompt": "once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True}
    run = subprocess.run([tools.path("curl"), "-sS", "-N", "--unix-socket", daemon.socket,
                          "-H", "Content-Type: application/json", "--data-binary", json.dumps(body),
                          "http://localhost/v1/completions"],
                         capture_output=True, timeout=120, check=True)
    chunks = sse_chunks(run.stdout)
    assert all("usage" not in c for c in chunks)
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert ([c["choices"][0]["finish_reason"] for c in chunks]
            == [None] * (len(chunks) - 1) + ["length"])
    assert chunks[-1]["choices"][0]["text"] == ""


# ---------------------------------------------------------------------- 3. concurrency


WORDS = ("the quick brown fox jumps over a lazy dog while experts route tokens through "
         "layers of cached weights and the disk answers slowly").split()


def request_specs(n: int, seed: int) -> list[tuple[str, dict]]:
    """n varied requests (endpoint, body), each reproducible: greedy, or sampled with a seed."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        chat = rng.random() < 0.5
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 14)))
        body = {"model": MODEL, "max_tokens": rng.randint(2, 9),
                "temperature": rng.choice([0.0, 0.5, 0.8, 1.0, 1.3]),
                "seed": rng.randrange(2 ** 31), "ignore_eos": rng.random() < 0.75}
        if rng.random() < 0.3:
            body["top_p"] = 0.9
        if rng.random() < 0.3:
            body["top_k"] = 20
        if chat:
            body["messages"] = [{"role": "user", "content": f"{i}: {words}"}]
        else:
            body["prompt"] = f"{i} {words}"
        if rng.random() < 0.5:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        specs.append(("/v1/chat/completions" if chat else "/v1/completions", body))
    return specs


async def run_one(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    chat = path == "/v1/chat/completions"
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    if body.get("stream"):
        assert response.headers["content-type"] == "text/event-stream"
        return outcome_of_stream(sse_chunks(response.content), chat)
    return outcome_of_full(response.json(), chat)


def async_client(d: Daemon) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=d.socket),
                             base_url="http://localhost", timeout=TIMEOUT)


def test_concurrent_clients_get_the_same_answers_as_alone(daemon):
    specs = request_specs(CLIENTS * PER_CLIENT, seed=3)

    async def references() -> list[dict]:
        async with async_client(daemon) as client:
            return [await run_one(client, path, body) for path, body in specs]

    async def together() -> list[dict]:
        async def one_client(c: int) -> list[tuple[int, dict]]:
            mine = list(range(c, len(specs), CLIENTS))      # 4 requests, one after another
            async with async_client(daemon) as client:
                return [(i, await run_one(client, *specs[i])) for i in mine]
        results = await asyncio.gather(*(one_client(c) for c in range(CLIENTS)))
        out: list = [None] * len(specs)
        for pairs in results:
            for i, outcome in pairs:
                out[i] = outcome
        return out

    alone = asyncio.run(references())
    before = stats(daemon)
    concurrent = asyncio.run(together())
    after = stats(daemon)

    reused = 0
    for (path, body), a, c in zip(specs, alone, concurrent):
        # The second run finds the first one's prompts in the prefix cache: the same
        # answers, but the usage says how much of each prompt was reused.
        reused += c["usage"].pop("prompt_tokens_details")["cached_tokens"]
        assert a["usage"].pop("prompt_tokens_details") == {"cached_tokens": 0}
        assert c == a, (path, body)
        if body["ignore_eos"]:
            assert a["usage"]["completion_tokens"] == body["max_tokens"]
            assert a["finish_reason"] == "length"
    # the requests really shared decode steps (4 sequences at most)
    steps = after["decode_steps"] - before["decode_steps"]
    tokens = after["generated_tokens"] - before["generated_tokens"]
    assert 2 * steps < tokens <= 4 * steps
    assert after["requests"]["total"] - before["requests"]["total"] == len(specs)
    assert after["requests"]["running"] == 0 and after["requests"]["waiting"] == 0
    assert reused > 0 and after["prefix_cache"]["reused_tokens"] - before["prefix_cache"]["reused_tokens"] == reused


@pytest.fixture
def busy_daemon(model_dir, cache_bytes):
    d = Daemon(model_dir, short_dir(), "--expert-cache-bytes", str(cache_bytes),
               "--max-queue", "0", "--max-concurrent-sequences", "1", *ONE_THREAD)
    try:
        yield d
        assert d.stop() == 0
    finally:
        finish(d)


def test_full_queue_answers_429_with_retry_after(busy_daemon):
    long = {"model": MODEL, "prompt": "hold the only place", "max_tokens": 4096,
            "ignore_eos": True, "stream": True}
    short = {"model": MODEL, "prompt": "me too", "max_tokens": 2, "temperature": 0}

    async def burst() -> list[httpx.Response]:
        async with async_client(busy_daemon) as holder:
            async with holder.stream("POST", "/v1/completions", json=long) as held:
                assert held.status_code == 200
                lines = held.aiter_lines()
                first = await anext(lines)           # submitted: it holds the only place
                assert first.startswith("data: ")
                request_id = json.loads(first[len("data: "):])["id"]

                async def one():
                    async with async_client(busy_daemon) as c:
                        return await c.post("/v1/completions", json=short)
                answers = await asyncio.gather(*(one() for _ in range(8)))
        return request_id, answers

    request_id, answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [429] * 8
    for r in answers:
        assert r.headers["Retry-After"] == "1"
        assert r.headers["Content-Type"].startswith("application/json")
        assert_error(r.status_code, r.json(), 429, type="rate_limit_error", code="queue_full")

    # the held stream went away: its place is free again
    finished = busy_daemon.wait_event("request_finished", request_id=request_id)
    assert finished["finish_reason"] == "cancelled"
    status, answer = busy_daemon.json("POST", "/v1/completions", short)
    assert status == 200
    assert answer["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------------- 4. disconnects


def test_streaming_client_disconnect_cancels_within_a_step(daemon):
    probe = {"model": MODEL, "messages": [{"role": "user", "content": "after the cancel"}],
             "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, reference = daemon.json("POST", "/v1/chat/completions", probe)
    assert status == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "talk forever"}],
            "max_tokens": 4096, "ignore_eos": True, "stream": True}
    chunks = []
    with uds_client(daemon) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(json.loads(line[len("data: "):]))
                    if len(chunks) == 3:
                        break
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finished = daemon.wait_event("request_finished", request_id=chunks[0]["id"])
    assert finished["finish_reason"] == "cancelled"
    assert finished["endpoint"] == "chat_completions"
    assert finished["decode_steps_after_cancel"] <= 1
    assert 2 <= finished["completion_tokens"] < 4096 - 100
    s = stats(daemon)
    assert (s["requests"]["running"], s["requests"]["waiting"]) == (0, 0)
    status, again = daemon.json("POST", "/v1/chat/completions", probe)
    assert status == 200
    assert again["choices"] == reference["choices"]
    again["usage"].pop("prompt_tokens_details")       # the probe's prompt is cached now
    reference["usage"].pop("prompt_tokens_details")
    assert again["usage"] == reference["usage"]


def test_non_streaming_client_disconnect_cancels(daemon):
    probe = {"model": MODEL, "prompt": "after the hang-up", "max_tokens": 6, "temperature": 0,
             "ignore_eos": True}
    status, reference = daemon.json("POST", "/v1/completions", probe)
    assert status == 200
    prompt = [7, 11, 13, 17, 19, 23, 29] * 31     # 217 tokens: no other request has as many
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4096,
                       "ignore_eos": True}).encode()
    total = stats(daemon)["requests"]["total"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(daemon.socket)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 60
        while stats(daemon)["requests"]["total"] == total:      # the engine has it
            assert time.monotonic() < deadline, "the request never reached the engine"
    finally:
        sock.close()                                 # before any answer
    finished = daemon.wait_event("request_finished", prompt_tokens=len(prompt),
                                 endpoint="completions")
    assert finished["finish_reason"] == "cancelled"
    assert finished["decode_steps_after_cancel"] <= 1
    assert finished["completion_tokens"] < 4096 - 100
    s = stats(daemon)
    assert (s["requests"]["running"], s["requests"]["waiting"]) == (0, 0)
    status, again = daemon.json("POST", "/v1/completions", probe)
    assert status == 200
    assert again["choices"] == reference["choices"]
    again["usage"].pop("prompt_tokens_details")       # the probe's prompt is cached now
    reference["usage"].pop("prompt_tokens_details")
    assert again["usage"] == reference["usage"]


# ---------------------------------------------------------------------- 5. bad input


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
BAD_REQUESTS = [
    # (id, path, body (bytes are sent as they are), status, param, code)
    ("malformed-json", CHAT, b'{"messages": [', 400, None, None),
    ("not-utf8", CHAT, b'\xff\xfe{}', 400, None, None),
    ("body-a-list", CHAT, [{"messages": HELLO}], 400, None, None),
    ("body-a-string", COMPLETIONS, "hello", 400, None, None),
    ("max-tokens-string", CHAT, {"messages": HELLO, "max_tokens": "x"}, 400, "max_tokens", None),
    ("max-tokens-zero", COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", None),
    ("temperature-string", CHAT, {"messages": HELLO, "temperature": "hot"}, 400, "temperature",
     None),
    ("temperature-too-high", CHAT, {"messages": HELLO, "temperature": 7}, 400, "temperature", None),
    ("messages-number", CHAT, {"messages": 3}, 400, "messages", None),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages", None),
    ("messages-missing", CHAT, {"model": MODEL}, 400, "messages", None),
    ("message-not-object", CHAT, {"messages": ["hello"]}, 400, "messages", None),
    ("content-image-part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     400, "messages", None),
    ("content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages", None),
    ("stream-string", CHAT, {"messages": HELLO, "stream": "yes"}, 400, "stream", None),
    ("n-over-max-concurrent-sequences", CHAT, {"messages": HELLO, "n": 64}, 400, "n", None),
    ("best-of", COMPLETIONS, {"prompt": "a", "best_of": 2}, 400, "best_of", None),
    ("logprobs-not-bool", CHAT, {"messages": HELLO, "logprobs": 3}, 400, "logprobs", None),
    ("top-logprobs-without-logprobs", CHAT, {"messages": HELLO, "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("top-logprobs-21", CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", None),
    ("logprobs-completions-21", COMPLETIONS, {"prompt": "a", "logprobs": 21}, 400, "logprobs",
     None),
    ("presence-penalty-3", CHAT, {"messages": HELLO, "presence_penalty": 3}, 400,
     "presence_penalty", None),
    ("frequency-penalty-string", CHAT, {"messages": HELLO, "frequency_penalty": "x"}, 400,
     "frequency_penalty", None),
    ("logit-bias-list", CHAT, {"messages": HELLO, "logit_bias": [1]}, 400, "logit_bias", None),
    ("logit-bias-key", CHAT, {"messages": HELLO, "logit_bias": {"a": 1}}, 400, "logit_bias", None),
    ("logit-bias-out-of-vocab", CHAT, {"messages": HELLO, "logit_bias": {"100000": 1}}, 400,
     "logit_bias", None),
    ("logit-bias-200", CHAT, {"messages": HELLO, "logit_bias": {"5": 200}}, 400, "logit_bias",
     None),
    ("response-format-unknown", CHAT, {"messages": HELLO, "response_format": {"type": "xml"}},
     400, "response_format", None),
    ("response-format-string", CHAT, {"messages": HELLO, "response_format": "json"}, 400,
     "response_format", None),
    ("json-schema-missing", CHAT, {"messages": HELLO, "response_format": {"type": "json_schema"}},
     400, "response_format", None),
    ("json-schema-invalid", CHAT, {"messages": HELLO, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "response_format", None),
    ("tools-not-a-list", CHAT, {"messages": HELLO, "tools": {"type": "function"}}, 400, "tools", None),
    ("tool-not-a-function", CHAT, {"messages": HELLO, "tools": [{"type": "retrieval"}]}, 400,
     "tools", None),
    ("tool-name-with-a-space", CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {
        "name": "get weather"}}]}, 400, "tools", None),
    ("tool-named-twice", CHAT, {"messages": HELLO, "tools": [TOOL, TOOL]}, 400, "tools", None),
    ("tool-parameters-not-a-schema", CHAT, {"messages": HELLO, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": [1]}}]}, 400, "tools", None),
    ("tool-choice-names-no-tool", CHAT, {"messages": HELLO, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, 400, "tool_choice", None),
    ("tool-choice-unknown", CHAT, {"messages": HELLO, "tools": [TOOL], "tool_choice": "always"},
     400, "tool_choice", None),
    ("tool-choice-without-tools", CHAT, {"messages": HELLO, "tool_choice": "required"}, 400,
     "tool_choice", None),
    ("tool-choice-required-with-json", CHAT, {"messages": HELLO, "tools": [TOOL], "tool_choice": "required",
                                              "response_format": {"type": "json_object"}}, 400,
     "tool_choice", None),
    ("parallel-tool-calls-string", CHAT, {"messages": HELLO, "tools": [TOOL],
                                          "parallel_tool_calls": "yes"}, 400, "parallel_tool_calls", None),
    ("tools-on-completions", COMPLETIONS, {"prompt": "a", "tools": [TOOL]}, 400, "tools", None),
    ("functions-deprecated", CHAT, {"messages": HELLO, "functions": [TOOL["function"]]}, 400,
     "functions", None),
    ("history-tool-calls-not-a-list", CHAT, {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": {"a": 1}}]},
     400, "messages", None),
    ("history-tool-call-without-function", CHAT, {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
     400, "messages", None),
    ("tool-message-id-not-a-string", CHAT, {"messages": [
        {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": 5, "content": "x"}]},
     400, "messages", None),
    ("unknown-model", CHAT, {"model": "gpt-4o", "messages": HELLO}, 404, "model",
     "model_not_found"),
    ("prompt-missing", COMPLETIONS, {"model": MODEL}, 400, "prompt", None),
    ("prompt-token-out-of-vocab", COMPLETIONS, {"prompt": [1, 2, 100000]}, 400, "prompt", None),
    ("prompt-token-ids-too-long", COMPLETIONS, {"prompt": list(range(1, 9)) * (CONTEXT // 8)},
     400, "prompt", "context_length_exceeded"),
    ("n-zero", CHAT, {"messages": HELLO, "n": 0}, 400, "n", None),
    ("n-true", CHAT, {"messages": HELLO, "n": True}, 400, "n", None),
    ("deeply-nested-json", COMPLETIONS, b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}",
     400, None, None),
    ("integer-of-5000-digits", COMPLETIONS, b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
     400, None, None),
    ("prompt-lone-surrogate", COMPLETIONS, b'{"prompt": "hi \\ud800"}', 400, "prompt", None),
    ("message-lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     400, "messages", None),
    ("tool-description-lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"tools": [{"type": "function", "function": {"name": "a", "description": "\\ud800"}}]}', 400, "tools", None),
    ("tool-parameters-lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"tools": [{"type": "function", "function": {"name": "a", "parameters": {"\\udc00": 1}}}]}',
     400, "tools", None),
    ("history-arguments-lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "hi"}, '
     b'{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", '
     b'"arguments": "{\\"x\\": \\"\\ud800\\"}"}}]}]}', 400, "messages", None),
    ("template-kwarg-lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"chat_template_kwargs": {"x": "\\ud800"}}', 400, "chat_template_kwargs", None),
    ("chat-too-long", CHAT, {"messages": [{"role": "user", "content": "hello " * 1100}]},
     400, "messages", "context_length_exceeded"),
]


@pytest.mark.parametrize("path,body,status,param,code",
                         [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(daemon, path, body, status, param, code):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert len(data) <= MAX_BODY
    got, headers, raw = daemon.request("POST", path, data)
    assert headers["Content-Type"].startswith("application/json")
    assert_error(got, json.loads(raw), status, param=param, code=code)
    assert_serving(daemon)


def test_a_max_tokens_cut_by_the_context_says_so_in_a_header(daemon):
    prompt = [4] * (CONTEXT - 3)   # not the tokens of the next test, whose cached_tokens are 0
    status, headers, raw = daemon.request("POST", COMPLETIONS, {
        "prompt": prompt, "max_tokens": 100000, "ignore_eos": True})
    body = json.loads(raw)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert headers["X-Moed-Max-Tokens"] == (
        f"3; limited by the context: {CONTEXT} tokens, {CONTEXT - 3} of them the prompt")
    status, headers, _ = daemon.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and headers["X-Moed-Max-Tokens"] == "2"


def test_a_max_tokens_cut_by_the_server_ceiling_is_named_too():
    from daemon.api import chat as chat_api

    class Vocab:
        vocab_size = 100
    parsed = chat_api.parse_request({"prompt": [1, 2, 3], "max_tokens": 500}, chat=False,
                               model_names=("m",), tokenizer=Vocab(), stop_ids=frozenset(),
                               context=4096, max_tokens_cap=64, request_timeout_s=60, now=0.0)
    assert parsed.engine.max_tokens == 64 and parsed.max_tokens_limited_by == "max_tokens"
    assert chat_api.max_tokens_header(parsed, 4096, 64) == {
        "X-Moed-Max-Tokens": "64; limited by the server's max_tokens ceiling (64)"}


def test_prompt_of_exactly_the_context_is_rejected_one_less_is_served(daemon):
    status, body = daemon.json("POST", COMPLETIONS, {"prompt": [5] * CONTEXT, "max_tokens": 1})
    assert_error(status, body, 400, param="prompt", code="context_length_exceeded")
    assert str(CONTEXT) in body["error"]["message"]
    # one token of room: max_tokens is cut to fit and the answer ends with "length"
    status, body = daemon.json("POST", COMPLETIONS, {"prompt": [5] * (CONTEXT - 1),
                                                     "max_tokens": 50, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"] == {"prompt_tokens": CONTEXT - 1, "completion_tokens": 1,
                             "total_tokens": CONTEXT, "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["choices"][0]["finish_reason"] == "length"


def test_body_over_max_body_bytes_is_413_json(daemon):
    data = json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode()
    status, headers, raw = daemon.request("POST", COMPLETIONS, data)
    assert headers["Content-Type"].startswith("application/json")
    assert_error(status, json.loads(raw), 413, code="request_too_large")
    assert str(MAX_BODY) in json.loads(raw)["error"]["message"]
    assert_serving(daemon)

    # without a Content-Length (chunked): the limit holds while reading
    conn = UnixHTTPConnection(daemon.socket)
    try:
        conn.request("POST", COMPLETIONS, body=iter([data[:40000], data[40000:]]),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        response = conn.getresponse()
        raw = response.read()
        assert response.getheader("Content-Length") != str(len(data))
        assert response.getheader("Content-Type").startswith("application/json")
        assert_error(response.status, json.loads(raw), 413, code="request_too_large")
    finally:
        conn.close()
    assert_serving(daemon)


def test_a_body_that_arrives_in_pieces_is_read_whole(daemon):
    probe = {"model": MODEL, "prompt": "sent in two pieces", "max_tokens": 3, "temperature": 0,
             "ignore_eos": True}
    status, reference = daemon.json("POST", COMPLETIONS, probe)
    assert status == 200
    body = json.dumps(probe).encode()
    half = len(body) // 2
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(daemon.socket)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:half])
        # a round trip through the engine on another connection: meanwhile the daemon has
        # read the first half and its handler is waiting for the rest
        stats(daemon)
        sock.sendall(body[half:])
        response = http.client.HTTPResponse(sock)
        response.begin()
        answer = json.loads(response.read())
    assert response.status == 200, answer
    assert answer["choices"] == reference["choices"]
    assert answer["usage"] == reference["usage"]


def test_unknown_route_and_wrong_method_are_json(daemon):
    status, headers, raw = daemon.request("GET", "/v1/engines")
    assert headers["Content-Type"].startswith("application/json")
    assert_error(status, json.loads(raw), 404, type="not_found_error")

    status, headers, raw = daemon.request("GET", CHAT)
    assert headers["Content-Type"].startswith("application/json")
    assert_error(status, json.loads(raw), 405)
    assert headers["Allow"] == "POST"

    status, headers, raw = daemon.request("DELETE", "/v1/models")
    assert_error(status, json.loads(raw), 405)
    assert set(headers["Allow"].split(",")) == {"GET", "HEAD"}
    assert_serving(daemon)


def test_tcp_listener_checks_the_api_key_and_refuses_admin_calls(model_dir, cache_bytes):
    """Over TCP: no or wrong Bearer key -> 401, the right key -> served, admin -> 403,
    /health open. The Unix socket needs no key."""
    import http.client

    d = Daemon(model_dir, short_dir(), "--expert-cache-bytes", str(cache_bytes),
               "--tcp-address", "127.0.0.1:0", *ONE_THREAD, env={"MOED_API_KEY": "s3cret"})
    try:
        host, port = d.wait_event("tcp_listening")["address"].rsplit(":", 1)

        def tcp(method, path, key=None):
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            headers = {"Authorization": b"Bearer " + (key if isinstance(key, bytes) else
                                                      key.encode())} if key else {}
            conn.request(method, path, body=b"{}" if method == "POST" else None, headers=headers)
            resp = conn.getresponse()
            body = json.loads(resp.read())
            conn.close()
            return resp.status, body

        status, body = tcp("GET", "/v1/models")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert tcp("GET", "/health") == (200, {"status": "ok"})     # probes need no key
        assert tcp("GET", "/v1/models", "wrong")[0] == 401
        logged = len(d.stderr_lines)
        status, body = tcp("GET", "/v1/models", b"\xff\xfe")        # bytes that are not UTF-8
        assert_error(status, body, 401, code="invalid_api_key")
        status, body = tcp("GET", "/v1/models", "s3cret")
        assert status == 200 and body["data"][0]["id"] == MODEL
        status, body = tcp("POST", "/v1/moed/pins/reset", "s3cret")
        assert status == 403 and body["error"]["type"] == "permission_error"
        assert d.json("GET", "/v1/models")[0] == 200            # Unix socket: no key needed
    finally:
        assert d.stop() == 0
        d.cleanup()
    # the undecodable key was a plain 401: no request_failed, no traceback
    assert not [line for line in d.stderr_lines[logged:]
                if "request_failed" in line or "Traceback" in line or "UnicodeEncodeError" in line]


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": [5, 1.5]}, "prompt", "'prompt' token ids must be integers; item 1 is 1.5"),
    ({"prompt": [5, True]}, "prompt", "item 1 is True"),
    ({"prompt": ["a", "b"]}, "prompt", "several prompts"),
    ({"prompt": [[5, 1.5]]}, "prompt", "'prompt' token ids must be integers; prompt[0] item 1 is 1.5"),
    ({"prompt": [[5, 6]]}, "prompt", "list of token-id lists is not supported"),
    ({"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias",
     "'logit_bias' key '99999999999999999999...' is not a token id"),
    ({"prompt": "hi", "logit_bias": {"²": 1}}, "logit_bias", "is not a token id"),
    ({"prompt": "hi", "logit_bias": {"1_0": 1}}, "logit_bias", "is not a token id"),
    ({"prompt": "hi", "logit_bias": {"3": "x" * 5000}}, "logit_bias", "got 'xxxxxxxxxxxxxxxxxxx..."),
])
def test_bad_fields_are_named_and_echo_at_most_a_short_piece_of_client_input(body, param, says):
    from daemon.api import chat as chat_api

    class Vocab:
        vocab_size = 100

        @staticmethod
        def encode(text, add_special_tokens=True):
            return [1] * len(text)
    with pytest.raises(chat_api.ApiError) as e:
        chat_api.parse_request({"max_tokens": 4, **body}, chat=False, model_names=("m",),
                          tokenizer=Vocab(), stop_ids=frozenset(), context=4096,
                          max_tokens_cap=64, request_timeout_s=60, now=0.0)
    assert e.value.status == 400 and e.value.param == param
    message = e.value.message
    assert says in message and len(message) < 200, message


def test_an_endless_body_after_its_413_is_not_read_on(daemon):
    """A chunked body that never ends: after the 413 the daemon closes the connection
    within a second or so instead of reading (and discarding) what keeps coming."""
    import socket as socket_module
    import time

    sock = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    sock.connect(daemon.socket)
    sock.settimeout(10)
    sock.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16))
    sent_after, answered, closed = 0, None, None
    deadline = time.monotonic() + 8
    try:
        sock.setblocking(False)
        while time.monotonic() < deadline:
            try:
                if answered is None and sock.recv(65536):
                    answered = time.monotonic()
            except BlockingIOError:
                pass
            try:
                n = sock.send(chunk)
                if answered is not None:
                    sent_after += n
            except BlockingIOError:
                time.sleep(0.001)
            except (BrokenPipeError, ConnectionResetError):
                closed = time.monotonic()
                break
    finally:
        sock.close()
    assert answered is not None                          # the 413 came
    assert closed is not None and closed - answered < 4, (sent_after, closed)
    assert sent_after < 512 << 20                         # not gigabytes
    assert_serving(daemon)


def test_an_unknown_model_name_is_echoed_64_characters_at_most():
    from daemon.api import chat as chat_api

    with pytest.raises(chat_api.ApiError) as e:
        chat_api.parse_request({"prompt": [1], "model": "m" * 5000}, chat=False, model_names=("x",),
                          tokenizer=None, stop_ids=frozenset(), context=4096,
                          max_tokens_cap=64, request_timeout_s=60, now=0.0)
    assert e.value.status == 404 and e.value.code == "model_not_found"
    assert "m" * 64 + "..." in e.value.message and len(e.value.message) < 140
