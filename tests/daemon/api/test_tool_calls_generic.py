"""Tools for a template that teaches no call format (daemon/api/tools.py, "generic"):
the tools go at the end of the system message in Qwen2.5's hermes words (at the start of
the first user message for a template that refuses a system message, Mixtral-Instruct's),
history calls become `<tool_call>` JSON in the assistant's text and tool results user
messages of `<tool_response>` blocks, and the answer is read and constrained as hermes.
Checked on make-model's published templates of mixtral, qwen2_moe and olmoe against
transformers rendering the rewritten conversation. Through `moed serve`:
tests/daemon/api/test_tool_round_trip.py."""
from __future__ import annotations

import pytest

from daemon.api import chat as chat_api
from daemon.api.tools import Tool, ToolRequest, detect_format, hermes_system_text, refuses_system, template_input
from ext.makemodel import CHATML_TEMPLATE, MIXTRAL_TEMPLATE, QWEN15_TEMPLATE, make_model
from ext.tokenizer import Tokenizer

MODEL = "model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [{"role": "user", "content": "Oslo and Lima?"},
           {"role": "assistant", "content": "Checking.", "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
               {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "4 C"},
           {"role": "tool", "tool_call_id": "c2", "content": "20 C"}]
# the same conversation as Qwen2.5's template lays it out
REWRITTEN = [{"role": "user", "content": "Oslo and Lima?"},
             {"role": "assistant", "content": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                              '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": '
                                              '"get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'},
             {"role": "user", "content": "<tool_response>\n4 C\n</tool_response>\n<tool_response>\n20 C\n</tool_response>"}]


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "olmoe"])
def model_dir(request, tmp_path_factory):
    return make_model(tmp_path_factory.mktemp(request.param) / MODEL, arch=request.param, layers=1, experts=4,
                      top_k=2, hidden=32, intermediate=16, dtype="bf16", seed=5)


def _prompt(tokenizer, body) -> str:
    parsed = chat_api.parse_request(body, chat=True, model_names=(MODEL,), tokenizer=tokenizer,
                                    stop_ids=frozenset(), context=4096, max_tokens_cap=64,
                                    request_timeout_s=60, now=0.0)
    return tokenizer.decode(parsed.engine.prompt_ids, skip_special_tokens=False)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_tools_and_history_reach_the_template_as_qwen25_writes_them(model_dir, system):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer = Tokenizer.from_model_dir(model_dir)
    assert detect_format(tokenizer.chat_template) == "generic"
    refuses = refuses_system(tokenizer.chat_template)
    assert refuses is (tokenizer.chat_template == MIXTRAL_TEMPLATE)
    head = [{"role": "system", "content": system}] if system else []
    tools_text = hermes_system_text([WEATHER])
    if refuses:               # Mixtral-Instruct's: the tools start the first user message
        if system:
            with pytest.raises(chat_api.ApiError, match="roles") as e:
                _prompt(tokenizer, {"messages": head + HISTORY, "tools": [WEATHER]})
            assert e.value.status == 400 and e.value.param == "messages"
            return
        want = [{"role": "user", "content": tools_text + "\n\n" + REWRITTEN[0]["content"]}] + REWRITTEN[1:]
    else:
        want = [{"role": "system", "content": (system + "\n\n" if system else "") + tools_text}] + REWRITTEN
    got = _prompt(tokenizer, {"messages": head + HISTORY, "tools": [WEATHER]})
    assert got == theirs.apply_chat_template(want, add_generation_prompt=True, tokenize=False)
    assert ('<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "The weather.", '
            '"parameters": ') in got and "within <tool_call></tool_call> XML tags" in got
    # without tools offered the history is still written as text, the tools are not
    none = _prompt(tokenizer, {"messages": head + HISTORY, "tools": [WEATHER], "tool_choice": "none"})
    assert none == theirs.apply_chat_template(head + REWRITTEN, add_generation_prompt=True, tokenize=False)


def test_a_system_message_is_refused_only_where_the_template_raises_on_one():
    assert refuses_system(MIXTRAL_TEMPLATE) and refuses_system("{{ raise_exception('System role not supported') }}")
    assert not refuses_system(QWEN15_TEMPLATE) and not refuses_system(CHATML_TEMPLATE)
    request = ToolRequest((Tool("get_weather", None, {}),), "auto", None, True, "generic")
    messages, _ = template_input([{"role": "assistant", "content": "hi"}], MIXTRAL_TEMPLATE, request)
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"].startswith("# Tools")


def test_a_template_with_a_tool_role_keeps_its_tool_messages():
    template = "{% for m in messages %}{% if m.role == 'tool' %}T{% endif %}{{ m.content }}{% endfor %}"
    request = ToolRequest((Tool("get_weather", None, {}),), "auto", None, True, "generic")
    messages, tools = template_input(HISTORY, template, request)
    assert tools is None and messages[0]["role"] == "system" and messages[0]["content"].startswith("# Tools")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert "tool_calls" not in messages[2] and messages[2]["content"] == REWRITTEN[1]["content"]
    assert template_input(HISTORY, CHATML_TEMPLATE, None) == (REWRITTEN, None)
