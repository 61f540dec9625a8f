"""Anthropic's Messages API (`POST /v1/messages`, daemon/api/messages.py) through
`moed serve` with the official `anthropic` client: text, stop sequences, streaming (the
streamed message equals the unstreamed one), a two-tool task run to the end with
tool_choice "any" (tool_use blocks whose input validates, tool_result answers), thinking
blocks, and errors in Anthropic's shape."""
from __future__ import annotations

import json

import anthropic
import httpx2
import jsonschema
import pytest
from daemon_proc import serving, small_chat_model

from daemon.api import messages as messages_api
from daemon.api.chat import ApiError

MODEL = "model"
TOOLS = [
    {"name": "get_weather", "description": "The weather in a city now.",
     "input_schema": {"type": "object", "properties": {
         "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
         "required": ["city"], "additionalProperties": False}},
    {"name": "convert", "description": "Celsius to Fahrenheit.",
     "input_schema": {"type": "object", "properties": {
         "celsius": {"type": "integer", "minimum": -50, "maximum": 50}},
         "required": ["celsius"], "additionalProperties": False}},
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with serving(small_chat_model(tmp_path_factory.mktemp("messages"), 13), "--threads", "1") as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    # the SDK's own HTTP client class (httpx2 since anthropic 2) on the daemon's socket
    http = anthropic.DefaultHttpxClient(transport=httpx2.HTTPTransport(uds=daemon.socket), timeout=120.0)
    with http:
        yield anthropic.Anthropic(base_url="http://localhost", api_key="none", http_client=http,
                                  max_retries=0)


def test_a_text_answer_streamed_and_not(client):
    # sampling fields as extra_body: the current SDK no longer has them, older ones and
    # other clients send them
    kw = dict(model=MODEL, max_tokens=16, system="Be brief.", extra_body={"temperature": 0.7, "top_k": 20, "seed": 4},
              messages=[{"role": "user", "content": "Say something."}])
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.input_tokens > 5
    assert 0 < whole.usage.output_tokens <= 16
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    text = "".join(b.text for b in whole.content if b.type == "text")
    assert "".join(b.text for b in final.content if b.type == "text") == text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_a_stop_sequence_is_named_in_the_answer(client):
    base = dict(model=MODEL, max_tokens=40, extra_body={"temperature": 1.0, "seed": 2},
                messages=[{"role": "user", "content": "Write."}])
    plain = client.messages.create(**base)
    text = plain.content[0].text if plain.content else ""
    if len(text) < 4:
        pytest.skip("the random model said too little to cut")
    stop = text[2:4]
    cut = client.messages.create(stop_sequences=[stop], **base)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert (cut.content[0].text if cut.content else "") == text[:text.find(stop)]


def test_a_two_tool_task_runs_to_the_end(client):
    """The agent loop: the model must call a tool ("any"), the client runs it and sends
    the result, until each tool has been called once; then it answers in text."""
    messages = [{"role": "user", "content": "What is the weather in Oslo, in Fahrenheit?"}]
    called = []
    for name in ("get_weather", "convert"):
        reply = client.messages.create(model=MODEL, max_tokens=300, tools=TOOLS, messages=messages,
                                       # one call: random weights would go on calling
                                       tool_choice={"type": "tool", "name": name,
                                                    "disable_parallel_tool_use": True},
                                       extra_body={"temperature": 0.5, "seed": len(called)})
        assert reply.stop_reason == "tool_use"
        [use] = [b for b in reply.content if b.type == "tool_use"]
        assert use.name == name and use.id.startswith("toolu_")
        jsonschema.validate(use.input, SCHEMAS[name])
        called.append(use.name)
        result = "4 C" if name == "get_weather" else f"{use.input['celsius'] * 9 // 5 + 32} F"
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": result}]}]
    final = client.messages.create(model=MODEL, max_tokens=8, tools=TOOLS, messages=messages,
                                   tool_choice={"type": "none"})
    assert called == ["get_weather", "convert"]
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.input_tokens > 150
    assert all(b.type == "text" for b in final.content)


def test_any_tool_streams_a_tool_use_block_with_its_input(client):
    kw = dict(model=MODEL, max_tokens=300, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "Weather?"}], extra_body={"temperature": 0.5, "seed": 6})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason == "tool_use"
    [a] = [b for b in whole.content if b.type == "tool_use"]
    [b] = [b for b in final.content if b.type == "tool_use"]
    assert (a.name, a.input) == (b.name, b.input)
    jsonschema.validate(b.input, SCHEMAS[b.name])
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events


def test_history_thinking_blocks_reach_the_template_and_thinking_can_be_off(daemon):
    body = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet back", "signature": ""},
                                          {"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "again"}]}
    status, on = daemon.json("POST", "/v1/messages", body)
    assert status == 200, on
    status, off = daemon.json("POST", "/v1/messages", {**body, "thinking": {"type": "disabled"}})

    def prompt(answer):
        return answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"]
    assert status == 200 and prompt(off) > prompt(on)
    chat = messages_api.chat_body(body)
    assert chat["messages"][1] == {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"}


@pytest.mark.parametrize("body, status, kind, text", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
     "'max_tokens' is required"),
    ({"model": MODEL, "max_tokens": 4, "messages": []}, 400, "invalid_request_error", "non-empty list"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", "'image' is not supported"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error", "role is 'user' or 'assistant'"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "'tool_choice.type'"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": 5}]}, 400, "invalid_request_error", "custom tool"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     "server tools are not served"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "thinking": {"type": "maybe"}}, 400, "invalid_request_error", "'thinking'"),
    ({"model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, 404,
     "not_found_error", "does not exist"),
    ([1], 400, "invalid_request_error", "JSON object"),
])
def test_errors_have_anthropics_shape(daemon, body, status, kind, text):
    got, headers, raw = daemon.request("POST", "/v1/messages", json.dumps(body).encode())
    answer = json.loads(raw)
    assert got == status and answer["type"] == "error"
    assert answer["error"]["type"] == kind and text in answer["error"]["message"]
    assert set(answer) == {"type", "error"}


def test_every_error_of_the_route_has_anthropics_shape(daemon):
    for method, body in (("GET", None), ("POST", b'{"max_tokens": 4, "messages": [{"role": "user", '
                                                  b'"content": [{"type": "tool_use", "name": "f", '
                                                  b'"input": {"x": "\\ud800"}}]}]}')):
        status, _, raw = daemon.request(method, "/v1/messages", body)
        answer = json.loads(raw)
        assert status in (400, 405) and answer["type"] == "error" and set(answer) == {"type", "error"}


def test_input_tokens_leave_out_what_the_cache_read(daemon):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "w " * 120}]}
    status, first = daemon.json("POST", "/v1/messages", body)
    assert status == 200 and first["usage"]["cache_read_input_tokens"] == 0
    status, again = daemon.json("POST", "/v1/messages", body)
    u = again["usage"]
    assert status == 200 and u["cache_read_input_tokens"] > 0
    assert u["input_tokens"] + u["cache_read_input_tokens"] == first["usage"]["input_tokens"]


def test_the_anthropic_client_raises_its_own_error_types(client):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=[{"role": "user", "content": "x"}])


def test_error_bodies_map_statuses_to_anthropics_types():
    for status, kind in ((401, "authentication_error"), (429, "rate_limit_error"),
                         (503, "overloaded_error"), (418, "api_error")):
        assert messages_api.error_body(ApiError(status, "m"))["error"]["type"] == kind
