"""The OpenAI fields people send, end to end through `moed serve` and the official client:
response_format (JSON schemas, validated by jsonschema), logprobs, n, penalties,
logit_bias, prefix reuse in usage, models.retrieve, /tokenize and /detokenize, and a
prompt too long to tokenize refused by its length in bytes."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from daemon_proc import openai_client, serving

from ext.makemodel import make_model
from ext.tokenizer import Tokenizer

MODEL = "model"
TIMEOUT = httpx.Timeout(120.0)
MAX_BODY = 4 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("surface") / MODEL, arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=4)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def daemon(model_dir):
    with serving(model_dir, "--threads", "1", "--max-body-bytes", str(MAX_BODY),
                 "--max-concurrent-sequences", "4") as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    with openai_client(daemon, TIMEOUT.read) as c:
        yield c


def _obj(properties: dict, required=None) -> dict:
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "required": list(properties) if required is None else required}


SHORT = {"type": "string", "maxLength": 6}
SCHEMAS = [
    _obj({"name": SHORT}),
    _obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"name": SHORT, "age": {"type": "integer", "minimum": 18, "maximum": 99}}),
    _obj({"tags": {"type": "array", "items": SHORT, "maxItems": 3}}),
    _obj({"point": _obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                         "y": {"type": "integer", "minimum": -9, "maximum": 9}})}),
    _obj({"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}}),
    _obj({"maybe": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]}}),
    _obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50}, "minItems": 1,
     "maxItems": 4},
    _obj({"kind": {"const": "user"}, "level": {"enum": [1, 2, 3]}}),
    _obj({"a": SHORT, "b": {"type": "boolean"}}, required=["a"]),
    _obj({"items": {"type": "array", "maxItems": 2,
                    "items": _obj({"k": SHORT, "v": {"type": "integer", "minimum": 0, "maximum": 5}})}}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    {"enum": ["yes", "no", "maybe"]},
    _obj({"matrix": {"type": "array", "maxItems": 2,
                     "items": {"type": "array", "maxItems": 2,
                               "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}),
    _obj({"user": _obj({"name": SHORT, "admin": {"type": "boolean"}}),
          "count": {"type": "integer", "minimum": 1, "maximum": 3}}),
    _obj({"email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}}),
    _obj({"mode": {"type": "string", "enum": ["fast", "slow"]},
          "retries": {"type": "integer", "minimum": 0, "maximum": 3},
          "note": {"type": ["string", "null"], "maxLength": 4}}),
]


def test_twenty_json_schema_answers_parse_and_validate(client):
    assert len(SCHEMAS) == 20
    for i, schema in enumerate(SCHEMAS):
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Answer {i} as JSON."}],
            max_tokens=300, temperature=0.8, seed=i,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_the_same_tokens_streamed(client, tokenizer):
    bias = {str(tokenizer.token_to_id(t)): 8 for t in ('"', "}", ":")}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "an object"}],
                  max_tokens=300, temperature=0.7, seed=3, logit_bias=bias,
                  response_format={"type": "json_object"})
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(full.choices[0].message.content), dict)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == full.choices[0].message.content


@pytest.mark.parametrize("stop", [None, ["zq", "<|"]])
def test_every_generated_token_is_an_event_of_its_own_held_text_included(client, stop):
    """As llama-server streams: one chunk per token, its content "" when the token has
    no text yet (part of a UTF-8 character, the possible start of a stop string, a token
    of no text), so a client can time every token."""
    kwargs = dict(model=MODEL, max_tokens=24, temperature=1.0, seed=7, stream=True,
                  stream_options={"include_usage": True}, stop=stop, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "go"}], **kwargs))
    tokens = [c for c in chunks if c.choices and c.choices[0].delta.content is not None
              and c.choices[0].delta.role is None]
    n = chunks[-1].usage.completion_tokens
    assert n == 24
    # one more when text held to the end (a stop string's possible start, part of a
    # character) is let out as the answer ends
    assert len(tokens) in (n, n + 1)
    assert sum(1 for c in tokens if c.choices[0].delta.content == "") > 0 or stop is None
    texts = [c for c in client.completions.create(prompt="go", **kwargs)
             if c.choices and c.choices[0].finish_reason is None]
    assert len(texts) in (n, n + 1)


def test_chat_logprobs_streamed_and_not(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                  temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 8
    # a token may hold part of a UTF-8 character: its bytes are exact, its text is not
    # (and an invalid sequence a random model emits is U+FFFD in the text, as decoding does)
    assert (b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace")
            == full.choices[0].message.content)
    for c in content:
        assert len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs),
                                                             reverse=True)
        assert c.logprob <= 0
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_shape(client):
    answer = client.completions.create(model=MODEL, prompt="once upon", max_tokens=5,
                                       temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    if "\ufffd" not in "".join(lp.tokens):
        assert "".join(lp.tokens) == answer.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) <= 2 and max(top.values()) == lp for top, lp in
               zip(lp.top_logprobs, lp.token_logprobs))


def test_n_choices_decode_together_and_are_the_seeds_plus_i(client):
    kwargs = dict(model=MODEL, prompt="the cache", max_tokens=6, temperature=1.0,
                  extra_body={"ignore_eos": True})
    three = client.completions.create(n=3, seed=10, **kwargs)
    assert [c.index for c in three.choices] == [0, 1, 2]
    singles = [client.completions.create(seed=10 + i, **kwargs).choices[0].text for i in range(3)]
    assert [c.text for c in three.choices] == singles
    assert three.usage.completion_tokens == 18
    streamed = {}
    for c in client.completions.create(n=3, seed=10, stream=True, **kwargs):
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == singles


def test_penalties_and_logit_bias_change_the_answer(client, tokenizer):
    kwargs = dict(model=MODEL, prompt="a a a a", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].text
    penalised = client.completions.create(frequency_penalty=2, presence_penalty=1, **kwargs)
    assert penalised.choices[0].text != plain
    target = tokenizer.token_to_id("e")
    forced = client.completions.create(logit_bias={str(target): 100}, **kwargs).choices[0].text
    assert forced == "e" * 12


def test_a_repeated_prompt_reuses_its_prefix(client, daemon):
    prompt = "moed serves mixture of experts models " * 8
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert second.choices[0].text == first.choices[0].text
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
    status, stats = daemon.json("GET", "/v1/moed/stats")
    assert status == 200 and stats["prefix_cache"]["hits"] >= 1
    assert stats["prefix_cache"]["bytes"] > 0


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_tokenize_and_detokenize_in_llama_servers_shapes(daemon, tokenizer):
    text = "Grüße, world"
    status, body = daemon.json("POST", "/tokenize", {"content": text})
    assert status == 200 and body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    status, pieces = daemon.json("POST", "/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == body["tokens"]
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                      for p in pieces["tokens"])
    assert joined.decode() == text
    status, back = daemon.json("POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"content": text}
    status, error = daemon.json("POST", "/detokenize", {"tokens": [10**9]})
    assert status == 400 and error["error"]["param"] == "tokens"
    status, error = daemon.json("POST", "/tokenize", {"text": text})
    assert status == 400 and error["error"]["param"] == "content"


def test_a_prompt_whose_bytes_prove_it_too_long_is_refused_untokenized(daemon, tokenizer):
    context = 4096
    text = "x" * (4 * tokenizer.max_token_bytes * context)
    assert len(text) < MAX_BODY
    status, body = daemon.json("POST", "/v1/completions", {"model": MODEL, "prompt": text})
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"
    assert "at least" in body["error"]["message"] and "bytes" in body["error"]["message"]
    status, _ = daemon.json("POST", "/v1/completions", {"model": MODEL, "prompt": "ok",
                                                        "max_tokens": 1})
    assert status == 200
