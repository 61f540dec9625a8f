"""GLM-4.5's tool-call format (daemon/api/tools.py, "glm"): the parser reads
<arg_key>/<arg_value> calls with values typed by the tools' schemas, the grammar of a
required call takes exactly the tools' calls, make-model's GLM-4.5 template renders tools
and history as transformers does, and through `moed serve` a required call on a glm4_moe
checkpoint parses and validates, streamed and not."""
from __future__ import annotations

import json

import jsonschema
import pytest
from tool_grammar import matcher, takes_whole
from daemon_proc import openai_client, serving

from daemon.api.tools import CallParser, LarkText, Tool, glm_grammar, split_calls
from ext.makemodel import make_model
from ext.tokenizer import Tokenizer

MODEL = "model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TOOLS = (Tool("get_weather", None, WEATHER["function"]["parameters"]),)
CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo 5</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("glm") / MODEL, arch="glm4_moe", layers=2, experts=8,
                      top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=16)


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_calls_are_read_with_values_typed_by_the_schema(step):
    text = "Let me look.\n" + CALL + "\n" + CALL.replace(">3<", ">three<")
    parser = CallParser(TOOLS, "glm")
    pieces = []
    for i in range(0, len(text), step):
        pieces += parser.feed(text[i:i + step])
    pieces += parser.finish()
    calls = [v for k, v in pieces if k == "call"]
    assert "".join(v for k, v in pieces if k == "content") == "Let me look.\n"
    assert json.loads(calls[0].arguments) == {"city": "Oslo 5", "days": 3}        # "Oslo 5" stays text
    assert json.loads(calls[1].arguments) == {"city": "Oslo 5", "days": "three"}  # not JSON: the text


def test_text_beside_the_pairs_or_no_name_is_not_a_call():
    bad = "<tool_call>get_weather\nsome words\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    assert split_calls(bad, TOOLS, "glm") == (bad, [])
    assert split_calls("<tool_call>\n</tool_call>", TOOLS, "glm")[1] == []


@pytest.mark.parametrize("text, ok", [
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
     "<arg_key>unit</arg_key>\n<arg_value>C</arg_value>\n</tool_call>", True),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
     "<arg_key>unit</arg_key>\n<arg_value>F</arg_value>\n</tool_call>", True),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>",
     False),                                                    # unit is required
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
     "<arg_key>unit</arg_key>\n<arg_value>K</arg_value>\n</tool_call>", False),      # not in the enum
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>9</arg_value>\n"
     "<arg_key>unit</arg_key>\n<arg_value>C</arg_value>\n</tool_call>", False),      # days > 7
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo and Bergen</arg_value>\n"
     "<arg_key>unit</arg_key>\n<arg_value>C</arg_value>\n</tool_call>", False),      # > maxLength
])
def test_the_grammar_takes_exactly_the_tools_calls(model_dir, text, ok):
    tok, m = matcher(model_dir, lambda text: glm_grammar(list(TOOLS), False, text))
    assert takes_whole(tok, m, text) is ok
    if ok:
        [call] = split_calls(text, TOOLS, "glm")[1]
        jsonschema.validate(json.loads(call.arguments), TOOLS[0].parameters)


def test_the_template_renders_tools_and_history_as_transformers_does(model_dir):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_model_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
               {"role": "assistant", "content": "", "reasoning_content": "look",
                "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "unit": "C"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "4 C"},
               {"role": "assistant", "content": "<think>sum</think>Cold."},
               {"role": "user", "content": "Thanks"}]
    for messages in (history[:2], history[:4], history):
        for kw in ({}, {"tools": [WEATHER]}, {"enable_thinking": False}):
            want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
            assert ours.apply_chat_template(messages, add_generation_prompt=True, **kw) == want
    rendered = ours.apply_chat_template(history[:4], tools=[WEATHER])
    assert ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n") in rendered


@pytest.fixture(scope="module")
def client(model_dir):
    with serving(model_dir, "--threads", "1") as d, openai_client(d) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_on_a_glm_checkpoint_parses_and_validates(client, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo for 3 days?"}],
              tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=200, seed=2)
    if stream:
        deltas = [d for ev in client.chat.completions.create(stream=True, **kw) for c in ev.choices
                  for d in (c.delta.tool_calls or [])]
        [d] = deltas
        name, arguments = d.function.name, d.function.arguments
    else:
        choice = client.chat.completions.create(logprobs=True, **kw).choices[0]
        assert choice.finish_reason == "tool_calls"
        # GLM-4.5's markers are generated as its added tokens, one token each
        tokens = [t.token for t in choice.logprobs.content]
        assert tokens[0] == "<tool_call>" and tokens[-1] == "</tool_call>"
        assert {"<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"} <= set(tokens)
        [call] = choice.message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": [1, 2]},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": 5},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": [["a"]]},
    {"type": "object", "properties": {"a": {"type": "string", "enum": 5}}},
    {"type": "object", "properties": {"a": {"type": "string", "enum": []}}},
])
def test_malformed_parameters_are_a_value_error_and_parse_as_text(parameters):
    # a client's schema reaches glm_grammar (a required call) and the parser (auto):
    # a ValueError is the 400 naming tools, anything else a 500 or a broken stream
    tools = (Tool("f", None, parameters),)
    with pytest.raises(ValueError, match="parameters"):
        glm_grammar(list(tools), False, LarkText({}))
    call = "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"
    assert json.loads(split_calls(call, tools, "glm")[1][0].arguments) == {"a": "1"}
