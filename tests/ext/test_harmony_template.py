"""GPT-OSS's chat format ("harmony") through moed's sandboxed template, as transformers
renders it.

HARMONY is make-model's gpt_oss template (ext/makemodel/templates/gpt_oss.jinja), written
from the format's description (openai/harmony: a system message
with identity, knowledge cutoff, date and reasoning effort; a developer message with the
instructions and the functions as a TypeScript-like namespace; assistant analysis on the
`analysis` channel, answers on `final`, tool calls `to=functions.NAME` on `commentary`
ending in <|call|>, tool results from `functions.NAME to=assistant`), with the Jinja the
published template leans on: recursive macros, namespace() objects set in loops,
`is defined / iterable / string / mapping` tests, dict `.items()`, `in` on messages,
slices by `loop.index`, tojson, strftime_now and raise_exception. It is not the
published file (that is not ours to copy); what is checked is that moed's sandbox — in
process, and in the daemon's template workers — renders each conversation exactly as
`transformers.AutoTokenizer.apply_chat_template` does, errors included.
"""
from __future__ import annotations

import json

import pytest

from daemon.workers.templates import TemplateWorkers
from ext.chat_template import ChatTemplateError
from ext.makemodel import GPT_OSS_TEMPLATE as HARMONY
from ext.makemodel import make_model
from ext.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place.",
    "parameters": {"type": "object", "required": ["place"], "properties": {
        "place": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "array", "items": {"type": "integer"}, "nullable": True},
        "where": {"type": "object", "properties": {"lat": {"type": "number"},
                                                   "lon": {"type": ["number", "string"]}}},
    }}}}
CONVERSATIONS = {
    "plain": dict(messages=[{"role": "user", "content": "Hi — é <b>"}]),
    "developer and reasoning": dict(
        messages=[{"role": "developer", "content": "Answer in French."},
                  {"role": "user", "content": "Bonjour"}],
        reasoning_effort="high", model_identity="You are moed's test model."),
    "tool call and result": dict(
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Weather in Lyon?"},
                  {"role": "assistant", "thinking": "I should call the tool.",
                   "tool_calls": [{"type": "function", "function": {
                       "name": "get_weather", "arguments": {"place": "Lyon, FR", "days": [1, 2]}}}]},
                  {"role": "tool", "content": {"temp": 21, "sky": "clear"}},
                  {"role": "assistant", "content": "21 °C and clear."},
                  {"role": "user", "content": "Thanks"}],
        tools=[WEATHER], builtin_tools=["browser", "python"]),
    "final turn, no generation prompt": dict(
        messages=[{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "thinking": "Easy.", "content": "4"}],
        add_generation_prompt=False),
}
BAD = dict(messages=[{"role": "assistant", "content": "<|channel|>analysis<|message|>x"}])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("harmony") / "gpt-oss", arch="gpt_oss", layers=1,
                      experts=4, top_k=2, hidden=64, intermediate=32)
    assert json.loads((path / "tokenizer_config.json").read_text())["chat_template"] == HARMONY
    return path


def _split(conversation: dict) -> tuple[list, dict]:
    kwargs = {"add_generation_prompt": True, **conversation}
    return kwargs.pop("messages"), kwargs


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_harmony_renders_as_transformers_renders_it(model_dir, name):
    transformers = pytest.importorskip("transformers")
    messages, kwargs = _split(CONVERSATIONS[name])
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=False, **kwargs)
    ours = Tokenizer.from_model_dir(model_dir).apply_chat_template(messages, **kwargs)
    assert ours == theirs
    assert ours.startswith("<|start|>system<|message|>") and "Current date: 20" in ours
    workers = TemplateWorkers(max_chars=1 << 20, timeout_s=5.0, workers=1)
    try:
        sandboxed = Tokenizer.from_model_dir(model_dir, renderer=workers.render)
        assert sandboxed.apply_chat_template(messages, **kwargs) == theirs
    finally:
        workers.close()


def test_the_rendered_tool_conversation_is_harmony(model_dir):
    messages, kwargs = _split(CONVERSATIONS["tool call and result"])
    text = Tokenizer.from_model_dir(model_dir).apply_chat_template(messages, **kwargs)
    assert ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"place": "Lyon, FR", "days": [1, 2]}<|call|>') in text
    assert ('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
            '{"temp": 21, "sky": "clear"}<|end|>') in text
    assert "unit?: \"celsius\" | \"fahrenheit\", // default: \"celsius\"\n" in text
    assert "days?: number[] | null,\n" in text and "where?: { lat?: number, lon?: number | string }" in text
    assert "I should call the tool." not in text        # a later final answer drops the analysis
    assert text.endswith("<|start|>user<|message|>Thanks<|end|><|start|>assistant")


def test_a_template_error_is_a_chat_template_error_as_transformers_raises_one(model_dir):
    transformers = pytest.importorskip("transformers")
    import jinja2

    messages, kwargs = _split(BAD)
    with pytest.raises(jinja2.TemplateError, match="not <\\|channel\\|> tags"):
        transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
            messages, tokenize=False, **kwargs)
    with pytest.raises(ChatTemplateError, match="not <\\|channel\\|> tags"):
        Tokenizer.from_model_dir(model_dir).apply_chat_template(messages, **kwargs)
