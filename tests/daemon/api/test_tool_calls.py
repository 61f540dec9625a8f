"""Tool calls (daemon/api/tools.py): the hermes parser on whole and streamed text, the
grammar of a required or named call, the Qwen3 template rendering tools as transformers
does, and OpenAI's client through `moed serve`: required and named calls parse (streamed
and not) whatever the weights, and the answer to a call continues the conversation."""
from __future__ import annotations

import json

import jsonschema
import pytest
from tool_grammar import matcher, takes_whole
from daemon_proc import openai_client, serving

from daemon.api import chat as chat_api
from daemon.api.tools import (CallParser, LarkText, Tool, ToolError, detect_format, hermes_grammar,
                                  parse_tools, split_calls)
from ext.makemodel import CHATML_TEMPLATE, QWEN3_TEMPLATE, make_model
from ext.tokenizer import Tokenizer

MODEL = "model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tools") / MODEL, arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=11)


# ------------------------------------------------------------------ the parser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'


def _stream(text: str, step: int) -> list:
    parser = CallParser()
    out = []
    for i in range(0, len(text), step):
        out += parser.feed(text[i:i + step])
    return out + parser.finish()


def _merged(pieces) -> list:
    """Adjacent content pieces joined (a stream may split text anywhere)."""
    out: list = []
    for kind, value in pieces:
        if kind == "content" and out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + value)
        else:
            out.append((kind, value))
    return [(k, v if k == "content" else (v.name, json.loads(v.arguments))) for k, v in out]


@pytest.mark.parametrize("text, want", [
    ("Just text.", [("content", "Just text.")]),
    ("Let me check.\n" + CALL, [("content", "Let me check.\n"),
                                ("call", ("get_weather", {"city": "Oslo", "unit": "C"}))]),
    (CALL + "\n" + CALL.replace("Oslo", "Lima"),
     [("call", ("get_weather", {"city": "Oslo", "unit": "C"})),
      ("call", ("get_weather", {"city": "Lima", "unit": "C"}))]),
    # arguments given as JSON text are kept as that text
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', [("call", ("f", {"a": 1}))]),
    # not a call: the text as generated
    ("<tool_call>\nnot json\n</tool_call> after",
     [("content", "<tool_call>\nnot json\n</tool_call> after")]),
    ('<tool_call>{"arguments": {}}</tool_call>', [("content", '<tool_call>{"arguments": {}}</tool_call>')]),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     [("content", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>')]),
    # an unclosed call that parses is a call; one that does not is text
    ('<tool_call>\n{"name": "f", "arguments": {}}', [("call", ("f", {}))]),
    ('<tool_call>\n{"name": "f", "argu', [("content", '<tool_call>\n{"name": "f", "argu')]),
    # a partial tag at the end is text after all
    ("a <tool_ca", [("content", "a <tool_ca")]),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_parser_splits_content_and_calls_however_the_text_streams(text, want, step):
    assert _merged(_stream(text, step)) == want


def test_held_back_text_is_only_a_possible_tag_start():
    parser = CallParser()
    assert parser.feed("The answer <") == [("content", "The answer ")]
    assert parser.feed("b>") == [("content", "<b>")]
    assert parser.feed("<tool_call>") == []
    assert parser.feed('{"name": "f", "arguments": {}}</tool_call>\n') [0][0] == "call"
    assert parser.finish() == []          # whitespace after a call is not content


def test_text_after_a_call_keeps_its_whitespace_however_it_streams():
    text = CALL + "\n\nHello \n\nworld" + "\n" + CALL + "\n"
    whole_content, calls = split_calls(text)
    assert whole_content == "Hello \n\nworld" and len(calls) == 2
    for step in (1, 2, 7):
        streamed = "".join(v for k, v in _stream(text, step) if k == "content")
        assert streamed.strip() == whole_content, step


def _generic_tokenizer() -> Tokenizer:
    """The tokenizer of a small checkpoint whose template has no call format (Qwen1.5's
    ChatML: history calls reach it as text, their arguments as they are)."""
    import tempfile
    d = make_model(tempfile.mkdtemp(prefix="moedtok") + "/m", arch="qwen2_moe", layers=1, experts=2,
                   top_k=1, hidden=32, intermediate=16, dtype="bf16", seed=1)
    return Tokenizer.from_model_dir(d)


def test_deep_json_in_calls_is_text_not_an_error():
    deep = '<tool_call>{"name": "f", "arguments": "' + "[" * 5000 + '"}</tool_call>'
    assert split_calls(deep) == (deep, [])
    tokenizer = _generic_tokenizer()
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"a":' * 5000 + "1" + "}" * 5000}}]}]}
    parsed = chat_api.parse_request(body, chat=True, model_names=(MODEL,), tokenizer=tokenizer,
                               stop_ids=frozenset(), context=1 << 20, max_tokens_cap=4,
                               request_timeout_s=60, now=0.0)
    assert parsed.engine.prompt_ids


def test_a_whole_answers_content_is_stripped_around_its_calls_and_ids_differ():
    content, calls = split_calls("Sure.\n\n" + CALL + "\n" + CALL)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather", "get_weather"]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_") and len(calls[0].id) == 29
    assert split_calls("plain ") == ("plain ", [])


# ------------------------------------------------------------------ the request

def test_the_format_is_read_off_the_template():
    assert detect_format(QWEN3_TEMPLATE) == "hermes"
    assert detect_format(CHATML_TEMPLATE) == "generic"           # no format: offered as hermes
    assert detect_format(None) is None
    assert detect_format("{% if tools %}<arg_key>{% endif %}<tool_call>") == "glm"     # GLM-4.5
    assert detect_format("{{'<｜tool▁call▁begin｜>'}}") == "deepseek"                  # DeepSeek-V3.1
    assert detect_format("{% if tools %}<|channel|>x<|call|>{% endif %}") == "harmony"  # GPT-OSS
    assert detect_format("{% if tools %}<|call|>{% endif %}") == "generic"              # no channels


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "names the function 'nope', which is not in 'tools'"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128 tools"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools", "1 to 64"),
    ({"tools": [WEATHER], "parallel_tool_calls": 1}, "parallel_tool_calls", "a boolean"),
])
def test_bad_tool_fields_name_the_field(body, param, message):
    with pytest.raises(ToolError, match=message) as e:
        parse_tools(body, QWEN3_TEMPLATE)
    assert e.value.param == param


def test_a_model_without_a_chat_template_refuses_tools_but_not_tool_choice_none():
    with pytest.raises(ToolError, match="no chat template to offer tools through"):
        parse_tools({"tools": [WEATHER]}, None)
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}, None).offered is False
    assert parse_tools({"tool_choice": "none"}, None) is None
    assert parse_tools({"tools": [WEATHER]}, CHATML_TEMPLATE).format == "generic"


def test_the_tools_render_as_transformers_renders_them(model_dir):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_model_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and the time in zone 1?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Oslo", "unit": "C"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": 1}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 C, rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
        {"role": "assistant", "content": "<think>\nadd up\n</think>\n\nRain, 4 C, at 14:05."},
        {"role": "user", "content": "Thanks"}]
    for messages in (history[:2], history[:5], history):
        for tools in (None, [WEATHER, TIME]):
            want = theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            got = ours.apply_chat_template(messages, add_generation_prompt=True,
                                           **({"tools": tools} if tools else {}))
            assert got == want
    want = theirs.apply_chat_template(history[:2], add_generation_prompt=True, tokenize=False,
                                      enable_thinking=False)
    assert ours.apply_chat_template(history[:2], enable_thinking=False) == want
    assert want.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_request_passes_openais_history_to_the_template_with_object_arguments(model_dir):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    body = {"messages": [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "4 C"}], "tools": [WEATHER]}
    parsed = chat_api.parse_request(body, chat=True, model_names=(MODEL,), tokenizer=tokenizer,
                               stop_ids=frozenset(), context=4096, max_tokens_cap=64,
                               request_timeout_s=60, now=0.0)
    text = tokenizer.decode(parsed.engine.prompt_ids, skip_special_tokens=False)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n4 C\n</tool_response>') in text
    assert '"name": "get_weather", "description": "The weather in a city now."' in text   # the tools block
    assert parsed.tools is not None and parsed.grammar is None            # auto: nothing constrained
    none = chat_api.parse_request({**body, "tool_choice": "none"}, chat=True, model_names=(MODEL,),
                             tokenizer=tokenizer, stop_ids=frozenset(), context=4096,
                             max_tokens_cap=64, request_timeout_s=60, now=0.0)
    assert none.tools is None and "# Tools" not in tokenizer.decode(none.engine.prompt_ids,
                                                                    skip_special_tokens=False)


# ------------------------------------------------------------------ the grammar

@pytest.mark.parametrize("text, ok", [
    (CALL, True),
    (CALL.replace("Oslo", "Rome"), False),                       # not in the enum
    (CALL.replace("get_weather", "get_time"), False),            # get_time's arguments differ
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>', True),
    (CALL.replace('"city": "Oslo"', '"city":  "Oslo"'), False),    # no spacing but the format's
    ("Sure: " + CALL, False),                                    # a required call comes first
])
def test_the_grammar_takes_exactly_the_tools_calls(model_dir, text, ok):
    tools = [Tool(t["function"]["name"], None, t["function"]["parameters"]) for t in (WEATHER, TIME)]
    tok, m = matcher(model_dir, lambda text: hermes_grammar(tools, False, text))
    assert takes_whole(tok, m, text) is ok


def test_a_marker_is_written_as_the_token_where_the_tokenizer_has_one_and_as_text_elsewhere(model_dir):
    assert LarkText({})("<tool_call>\n") == '"<tool_call>\\n"'
    assert LarkText({"<tool_call>": 7, "</tool_call>": 8})("\n</tool_call>") == '"\\n" <[8]>'
    assert LarkText({"<arg_key>": 3})("<arg_key>city</arg_key>") == '<[3]> "city</arg_key>"'
    # Qwen3's tokenizer has them: the grammar takes the token, not the text spelled out
    tools = [Tool("get_time", None, SCHEMAS["get_time"])]
    tok, m = matcher(model_dir, lambda text: hermes_grammar(tools, False, text))
    spelled = [i for piece in ("<", "tool", "_call", ">") for i in tok.encode(piece, add_special_tokens=False).ids]
    assert tok.token_to_id("<tool_call>") not in spelled and not m.consume_token(spelled[0])


def test_arguments_take_no_key_their_schema_does_not_list_unless_it_says_so(model_dir):
    """An object schema without additionalProperties is closed for the grammar, as
    llama.cpp's and vLLM's read it (a random model added keys until max_tokens); one that
    allows others keeps allowing them."""
    listed = {"type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}
    extra = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3, "city": "Oslo"}}\n</tool_call>'
    for parameters, ok in ((listed, False), ({**listed, "additionalProperties": True}, True)):
        tool = Tool("get_time", None, parameters)
        tok, m = matcher(model_dir, lambda text: hermes_grammar([tool], False, text))
        took = all(m.consume_token(i) for i in tok.encode(extra, add_special_tokens=False).ids)
        assert (took and m.is_stopped()) is ok
        assert tool.parameters == parameters and tool.template_entry()["function"]["parameters"] == parameters


def test_a_parallel_grammar_takes_several_calls_and_may_end_after_any(model_dir):
    tools = [Tool("get_time", None, SCHEMAS["get_time"])]
    tok, m = matcher(model_dir, lambda text: hermes_grammar(tools, True, text))
    one = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>'
    assert all(m.consume_token(t) for t in tok.encode(one, add_special_tokens=False).ids)
    assert m.is_accepting() and not m.is_stopped()
    assert all(m.consume_token(t) for t in tok.encode("\n" + one, add_special_tokens=False).ids)
    assert m.is_accepting()


# ------------------------------------------------------------------ through moed serve

@pytest.fixture(scope="module")
def daemon(model_dir):
    with serving(model_dir, "--threads", "1", "--max-concurrent-sequences", "4") as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    with openai_client(daemon) as c:
        yield c


def test_apply_template_answers_the_prompt_a_chat_request_would_get(daemon, model_dir):
    body = {"messages": QUESTION, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}}
    status, got = daemon.json("POST", "/apply-template", body)
    want = Tokenizer.from_model_dir(model_dir).apply_chat_template(
        QUESTION, tools=[WEATHER], enable_thinking=False)
    assert status == 200 and got == {"prompt": want}
    assert "# Tools" in want and want.endswith("<think>\n\n</think>\n\n")
    status, got = daemon.json("POST", "/apply-template", {"messages": QUESTION, "tools": [{"type": "x"}]})
    assert status == 400 and got["error"]["param"] == "tools"
    status, got = daemon.json("POST", "/apply-template", [1])
    assert status == 400 and "JSON object" in got["error"]["message"]


QUESTION = [{"role": "user", "content": "What is the weather in Oslo, and the time in zone 1?"}]


def _check_call(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", range(4))
def test_a_required_call_parses_whatever_the_weights(client, model_dir, seed):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME],
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=200, seed=seed, logprobs=True)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0])
    # the markers are generated as Qwen3's added tokens, one token each, as a real
    # checkpoint writes them (not spelled out in ordinary tokens), and kept in the text
    tokens = [t.token for t in choice.logprobs.content]
    assert tokens[0] == "<tool_call>" and tokens[-1] == "</tool_call>" and tokens.count("<tool_call>") == 1
    tok = Tokenizer.from_model_dir(model_dir)
    assert tok.encode("".join(tokens), add_special_tokens=False)[0] == tok.added_tokens["<tool_call>"]


def test_a_named_call_streams_as_openais_deltas_and_equals_the_unstreamed_one(client):
    kw = dict(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=200, seed=5,
              tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    _check_call(call, "get_time")
    deltas, reasons, content = [], [], []
    for ev in client.chat.completions.create(stream=True, **kw):
        for c in ev.choices:
            if c.delta.tool_calls:
                deltas += c.delta.tool_calls
            if c.delta.content:
                content.append(c.delta.content)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and not content
    [d] = deltas
    assert (d.index, d.type, d.function.name, d.function.arguments) == (
        0, "function", "get_time", call.function.arguments)


def test_the_models_answer_to_a_call_continues_the_conversation(client):
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME],
                                           tool_choice="required", max_tokens=200, seed=1,
                                           parallel_tool_calls=False).choices[0].message
    [call] = first.tool_calls
    history = QUESTION + [first.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "4 C, rain"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME],
                                            max_tokens=8, seed=2)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > 100          # the tools, the call and its result
    # with tool_choice none the same history is answered as text, the tools not offered
    third = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME],
                                           tool_choice="none", max_tokens=8, seed=2)
    assert third.choices[0].message.tool_calls is None
    assert third.usage.prompt_tokens < second.usage.prompt_tokens
