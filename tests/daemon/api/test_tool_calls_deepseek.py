"""DeepSeek-V3.1's tool-call format (daemon/api/tools.py, "deepseek"): the parser reads
<｜tool▁calls▁begin｜> runs of calls however the text streams, the grammar of a required
call takes exactly the tools' calls, make-model's deepseek_v3 template (the published
DeepSeek-V3.1 one) renders history calls, tool results and thinking as transformers does,
and a request's tools reach the prompt as the model card's tool description at the end of
the system prompt. Through `moed serve`: tests/daemon/api/test_tool_round_trip.py."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tool_grammar import matcher, takes_whole

from daemon.api import chat as chat_api
from daemon.api.reasoning import opens_thinking, split_answer
from daemon.api.tools import (DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP, THINK_CLOSE,
                              CallParser, Tool, ToolRequest, deepseek_grammar, deepseek_system_text,
                              detect_format, split_calls)
from ext.makemodel import DEEPSEEK_V31_TEMPLATE, make_model
from ext.tokenizer import Tokenizer

MODEL = "model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"], "additionalProperties": False}}}
TOOLS = (Tool("get_weather", None, WEATHER["function"]["parameters"]),)


def _call(name: str, arguments: str) -> str:
    return DS_CALL_BEGIN + name + DS_SEP + arguments + DS_CALL_END


CALLS = DS_CALLS_BEGIN + _call("get_weather", '{"city": "Oslo"}') + _call("get_weather", '{"city":"Lima","days":2}') + DS_CALLS_END


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("deepseek") / MODEL, arch="deepseek_v3", layers=2, experts=8,
                      top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=17)


def _pieces(text: str, step: int) -> list:
    parser = CallParser(TOOLS, "deepseek")
    out = []
    for i in range(0, len(text), step):
        out += parser.feed(text[i:i + step])
    out += parser.finish()
    merged: list = []
    for kind, value in out:
        if kind == "content" and merged and merged[-1][0] == "content":
            merged[-1] = ("content", merged[-1][1] + value)
        else:
            merged.append((kind, value if kind == "content" else (value.name, json.loads(value.arguments))))
    return merged


@pytest.mark.parametrize("text, want", [
    ("Let me look." + CALLS, [("content", "Let me look."), ("call", ("get_weather", {"city": "Oslo"})),
                              ("call", ("get_weather", {"city": "Lima", "days": 2}))]),
    (CALLS + "\nDone.", [("call", ("get_weather", {"city": "Oslo"})),
                         ("call", ("get_weather", {"city": "Lima", "days": 2})), ("content", "\nDone.")]),
    # DeepSeek-V3's older body: function<｜tool▁sep｜>NAME and the arguments in a json fence
    (DS_CALLS_BEGIN + _call("function", 'get_weather\n```json\n{"city": "Lima"}\n```') + DS_CALLS_END,
     [("call", ("get_weather", {"city": "Lima"}))]),
    # not a call: the text as generated, markers and all
    (DS_CALLS_BEGIN + _call("get_weather", "Oslo") + DS_CALLS_END,
     [("content", DS_CALLS_BEGIN + _call("get_weather", "Oslo") + DS_CALLS_END)]),
    (DS_CALLS_BEGIN + _call("", "{}"), [("content", DS_CALLS_BEGIN + _call("", "{}"))]),
    # an unclosed call that parses is a call; one that does not is text
    (DS_CALLS_BEGIN + DS_CALL_BEGIN + 'f' + DS_SEP + '{"a": 1}', [("call", ("f", {"a": 1}))]),
    (DS_CALLS_BEGIN + DS_CALL_BEGIN + 'f' + DS_SEP + '{"a"', [("content", DS_CALLS_BEGIN + DS_CALL_BEGIN + 'f' + DS_SEP + '{"a"')]),
    ("a <｜tool▁call", [("content", "a <｜tool▁call")]),
])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_calls_are_read_however_the_text_streams(text, want, step):
    assert _pieces(text, step) == want


def test_a_whole_answer_and_the_format_read_off_the_template():
    content, calls = split_calls("Sure.\n" + CALLS, TOOLS, "deepseek")
    assert content == "Sure." and [c.name for c in calls] == ["get_weather"] * 2
    assert calls[0].id != calls[1].id
    assert detect_format(DEEPSEEK_V31_TEMPLATE) == "deepseek"


ONE = DS_CALLS_BEGIN + _call("get_weather", '{"city": "Oslo", "days": 3}') + DS_CALLS_END


@pytest.mark.parametrize("text, ok", [
    (ONE, True),
    (ONE.replace(", \"days\": 3", ""), True),
    (ONE.replace("Oslo", "Rome"), False),                         # not in the enum
    (ONE.replace("3", "9"), False),                               # days > 7
    (ONE.replace('"city": "Oslo"', '"city":"Oslo"'), False),      # the format's separators only
    (ONE.replace(DS_CALLS_END, ""), False),                       # the run is closed
    ("Sure. " + ONE, False),                                      # a required call comes first
])
def test_the_grammar_takes_exactly_the_tools_calls(model_dir, text, ok):
    tok, m = matcher(model_dir, lambda text: deepseek_grammar(list(TOOLS), False, text))
    assert takes_whole(tok, m, text) is ok
    if ok:
        [call] = split_calls(text, TOOLS, "deepseek")[1]
        jsonschema.validate(json.loads(call.arguments), TOOLS[0].parameters)


def test_a_parallel_grammar_takes_calls_back_to_back(model_dir):
    tok, m = matcher(model_dir, lambda text: deepseek_grammar(list(TOOLS), True, text))
    two = ONE.replace(DS_CALLS_END, _call("get_weather", '{"city": "Lima"}') + DS_CALLS_END)
    assert all(m.consume_token(t) for t in tok.encode(two, add_special_tokens=False).ids) and m.is_stopped()


def test_with_thinking_open_in_the_prompt_the_grammar_closes_it_before_the_calls(model_dir):
    request = ToolRequest(TOOLS, "required", None, False, "deepseek")
    for text, ok in ((THINK_CLOSE + ONE, True), (ONE, False), ("hm" + THINK_CLOSE + ONE, False)):
        tok, m = matcher(model_dir, lambda lark: request.grammar(lark.tokens, thinking_open=True))
        took = all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids)
        assert (took and m.is_stopped()) is ok, text
    thought, content, calls = split_answer(THINK_CLOSE + ONE, reasoning=True, started=True,
                                           tools=CallParser(TOOLS, "deepseek"))
    assert (thought, content, [c.name for c in calls]) == (None, "", ["get_weather"])


HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
               {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Lima"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "4 C"},
           {"role": "tool", "tool_call_id": "c2", "content": "20 C"},
           {"role": "assistant", "content": "Cold and warm."},
           {"role": "user", "content": "Thanks"}]


def test_the_template_renders_history_and_thinking_as_transformers_does(model_dir):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_model_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for messages in (HISTORY[:2], HISTORY[:5], HISTORY):
        for kw in ({}, {"tools": [WEATHER]}, {"thinking": True}):
            want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
            assert ours.apply_chat_template(messages, add_generation_prompt=True, **kw) == want
    text = ours.apply_chat_template(HISTORY[:5])
    assert text.startswith("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Oslo?<｜Assistant｜></think>" + DS_CALLS_BEGIN)
    assert text.endswith("<｜tool▁output▁begin｜>4 C<｜tool▁output▁end｜><｜tool▁output▁begin｜>20 C<｜tool▁output▁end｜>")
    # the markers are single tokens, kept when decoding; the sentence marks are special
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text.replace("<｜begin▁of▁sentence｜>", "").replace("<｜end▁of▁sentence｜>", "")
    assert ours.encode(DS_CALLS_BEGIN, add_special_tokens=False) == [ours.token_to_id(DS_CALLS_BEGIN)]


def _prompt(tokenizer, body) -> str:
    parsed = chat_api.parse_request(body, chat=True, model_names=(MODEL,), tokenizer=tokenizer,
                                    stop_ids=frozenset(), context=8192, max_tokens_cap=64,
                                    request_timeout_s=60, now=0.0)
    return tokenizer.decode(parsed.engine.prompt_ids, skip_special_tokens=False)


@pytest.mark.parametrize("system", [True, False])
def test_a_requests_tools_are_the_model_cards_description_at_the_end_of_the_system_prompt(model_dir, system):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer = Tokenizer.from_model_dir(model_dir)
    messages = HISTORY[:5] if system else HISTORY[1:5]
    got = _prompt(tokenizer, {"messages": messages, "tools": [WEATHER]})
    description = deepseek_system_text([WEATHER])
    card = ([{"role": "system", "content": "Be brief.\n\n" + description}, *messages[1:]] if system
            else [{"role": "system", "content": description}, *messages])
    assert got == theirs.apply_chat_template(card, add_generation_prompt=True, tokenize=False)
    assert ("### get_weather\nDescription: The weather.\n\nParameters: "
            + json.dumps(WEATHER["function"]["parameters"]) + "\n\nIMPORTANT: ALWAYS adhere") in got
    # history arguments reach the template as the text the client sent
    assert _call("get_weather", '{"city":"Lima"}') in got
    assert "## Tools" not in _prompt(tokenizer, {"messages": messages, "tools": [WEATHER], "tool_choice": "none"})


def test_thinking_opens_in_the_prompt_and_the_answer_after_it_is_parsed(model_dir):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    on = _prompt(tokenizer, {"messages": HISTORY[1:2], "chat_template_kwargs": {"thinking": True}})
    off = _prompt(tokenizer, {"messages": HISTORY[1:2]})
    assert opens_thinking(on) and not opens_thinking(off) and off.endswith("<｜Assistant｜></think>")
    thought, content, calls = split_answer("look it up</think>" + ONE, reasoning=True, started=True,
                                           tools=CallParser(TOOLS, "deepseek"))
    assert (thought, content, [c.name for c in calls]) == ("look it up", "", ["get_weather"])
