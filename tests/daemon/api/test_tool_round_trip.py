"""OpenAI's tool-calling round trip against `moed serve`, for every family make-model
writes, through the family's own chat template: the model is asked for a tool (required,
or the function named), the client answers with a tool message, and the model continues
(tool_choice auto) and finishes (none) — streamed and not. A required or named call
parses and validates whatever the weights (the grammar), and the continuation's prompt
holds the call and its result as the family's template writes them.

Formats: qwen3_moe hermes, glm4_moe GLM-4.5's, deepseek_v3 DeepSeek-V3.1's markers,
mixtral, qwen2_moe and olmoe (their published templates, no call format) "generic", the
tools in Mixtral-Instruct's first user message (it refuses a system one). gpt_oss (harmony) is not here:
its tool calls are read by daemon/api/harmony.py, tested with it.

One daemon per family, shared by the module's tests of that family (pytest orders the
tests by the module-scoped parameter, so one daemon runs at a time)."""
from __future__ import annotations

import json

import jsonschema
import pytest
from daemon_proc import openai_client, serving, small_chat_model

MODEL = "model"
FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3", "mixtral", "qwen2_moe", "olmoe")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"],
        "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]
RESULT = "4 C, rain"


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    model_dir = small_chat_model(tmp_path_factory.mktemp(request.param), seed=21, arch=request.param)
    with serving(model_dir, "--threads", "1") as daemon, openai_client(daemon) as client:
        yield daemon, client


def _ask(client, stream: bool, **kw) -> tuple[dict, str, int]:
    """(the assistant message as a client sends it back, finish_reason, prompt tokens)."""
    kw = dict(model=MODEL, tools=[WEATHER, TIME], seed=3, **kw)
    if not stream:
        out = client.chat.completions.create(**kw)
        choice = out.choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason, out.usage.prompt_tokens
    content, calls, reasons, usage = [], {}, [], None
    for ev in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = ev.usage or usage
        for c in ev.choices:
            content.append(c.delta.content or "")
            for d in c.delta.tool_calls or []:        # moed sends each call whole, in one delta
                calls[d.index] = {"id": d.id, "type": "function",
                                  "function": {"name": d.function.name, "arguments": d.function.arguments}}
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert len(reasons) == 1
    message = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return {k: v for k, v in message.items() if v is not None}, reasons[0], usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_the_round_trip(served, stream, choice):
    daemon, client = served
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    first, reason, asked = _ask(client, stream, messages=QUESTION, tool_choice=tool_choice, max_tokens=200,
                                parallel_tool_calls=False)
    assert reason == "tool_calls" and "content" not in first, first
    [call] = first["tool_calls"]
    assert call["id"].startswith("call_") and (choice == "required" or call["function"]["name"] == choice)
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])

    history = QUESTION + [first, {"role": "tool", "tool_call_id": call["id"], "content": RESULT}]
    status, prompt = daemon.json("POST", "/apply-template", {"messages": history, "tools": [WEATHER, TIME]})
    assert status == 200 and RESULT in prompt["prompt"] and call["function"]["name"] in prompt["prompt"]
    assert prompt["prompt"].count(call["function"]["name"]) >= 2        # offered, and called

    second, reason, continued = _ask(client, stream, messages=history, tool_choice="auto", max_tokens=6)
    assert reason in ("stop", "length", "tool_calls") and continued > asked
    finished, reason, _ = _ask(client, stream, messages=history + [
        {"role": "assistant", "content": second.get("content") or "It rains."},
        {"role": "user", "content": "Thanks"}], tool_choice="none", max_tokens=4)
    assert reason in ("stop", "length") and "tool_calls" not in finished


def test_a_required_call_with_thinking_on_is_the_answer_not_reasoning(served):
    """Thinking on (DeepSeek-V3.1's `thinking`, which opens <think> in the prompt; Qwen3's and
    GLM-4.5's `enable_thinking`, on by default, whose prompts leave the model to open it):
    the call still comes back as a tool call, not as reasoning_content."""
    daemon, client = served
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="required", max_tokens=200, seed=4,
        parallel_tool_calls=False, extra_body={"chat_template_kwargs": {"thinking": True, "enable_thinking": True}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    assert not getattr(choice.message, "reasoning_content", None) and not choice.message.content
