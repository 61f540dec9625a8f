"""OpenAI's Responses API (`POST /v1/responses`, daemon/api/responses.py) through
`moed serve` with the official `openai` client: text answers streamed and not (the
streamed response equals the unstreamed one), function calls required and named, their
outputs continuing the conversation, structured output, and errors naming the field."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from daemon_proc import openai_client, serving, small_chat_model


MODEL = "model"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
                          "required": ["city"], "additionalProperties": False}}
ZONE = {"type": "function", "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
                       "required": ["zone"], "additionalProperties": False}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, ZONE)}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with serving(small_chat_model(tmp_path_factory.mktemp("responses"), 15), "--threads", "1") as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    with openai_client(daemon) as c:
        yield c


def test_a_text_response_streamed_and_not(client):
    kw = dict(model=MODEL, input="Say something.", instructions="Be brief.", max_output_tokens=12,
              temperature=0.8, extra_body={"seed": 3})
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete")
    assert (whole.status == "incomplete") == (whole.incomplete_details is not None)
    assert whole.usage.input_tokens > 5 and 0 < whole.usage.output_tokens <= 12
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == whole.output_text
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_and_its_output_continue_the_conversation(client, stream):
    kw = dict(model=MODEL, input="Weather in Oslo?", tools=[WEATHER, ZONE], tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=300, extra_body={"seed": 4})
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1
        out = events[-1].response
    else:
        out = client.responses.create(**kw)
    [call] = [o for o in out.output if o.type == "function_call"]
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "4 C, rain"}]
    second = client.responses.create(model=MODEL, input=history, tools=[WEATHER, ZONE], max_output_tokens=6)
    assert second.status in ("completed", "incomplete")
    # the same tools and question, and now the call and its output: a longer prompt
    assert second.usage.input_tokens > out.usage.input_tokens + 20


def test_a_named_function_is_the_one_called(client):
    out = client.responses.create(model=MODEL, input="Time in zone 2?", tools=[WEATHER, ZONE],
                                  tool_choice={"type": "function", "name": "get_time"},
                                  parallel_tool_calls=False, max_output_tokens=300, extra_body={"seed": 5})
    [call] = [o for o in out.output if o.type == "function_call"]
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_time"])


def test_structured_output_follows_its_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = client.responses.create(model=MODEL, input="ok?", max_output_tokens=100, extra_body={"seed": 6},
                                  text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(out.output_text), schema)


@pytest.mark.parametrize("kw, param", [
    (dict(input="x", previous_response_id="resp_1"), "previous_response_id"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]), "input"),
    (dict(input="x", tools=[{"type": "web_search"}]), "tools"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input"),
    (dict(input=[]), "input"),
    (dict(input="x", text={"format": {"type": "xml"}}), "text"),
    (dict(input=[{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]), "input"),
])
def test_what_moed_cannot_serve_is_a_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, max_output_tokens=4, **kw)
    assert e.value.body["param"] == param
