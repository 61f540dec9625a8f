"""GPT-OSS's chat format ("harmony") through moed's sandboxed template, as transformers
renders it.

HARMONY is written here from the format's description (openai/harmony: a system message
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
from ext.makemodel import make_model
from ext.tokenizer import Tokenizer

HARMONY = r"""
{%- macro ts_type(spec) -%}
    {%- if spec.type is defined and spec.type is iterable and spec.type is not string
           and spec.type is not mapping -%}
        {{- spec.type | join(" | ") -}}
    {%- elif spec.type == "array" -%}
        {{- (ts_type(spec['items']) if spec['items'] is defined else "any") + "[]" -}}
    {%- elif spec.type == "string" and spec.enum -%}
        {{- '"' + spec.enum | join('" | "') + '"' -}}
    {%- elif spec.type in ("number", "integer") -%}
        {{- "number" -}}
    {%- elif spec.type == "object" and spec.properties -%}
        {{- "{ " -}}
        {%- for name, sub in spec.properties.items() -%}
            {{- name + ("" if name in (spec.required or []) else "?") + ": " + ts_type(sub) -}}
            {%- if not loop.last %}{{ ", " }}{% endif -%}
        {%- endfor -%}
        {{- " }" -}}
    {%- elif spec.type is defined -%}
        {{- spec.type -}}
    {%- else -%}
        {{- "any" -}}
    {%- endif -%}
    {%- if spec.nullable %}{{ " | null" }}{% endif -%}
{%- endmacro -%}

{%- macro functions_namespace(tools) -%}
    {{- "## functions\n\nnamespace functions {\n\n" -}}
    {%- for tool in tools -%}
        {%- set fn = tool.function -%}
        {{- "// " + fn.description + "\ntype " + fn.name + " = " -}}
        {%- if fn.parameters and fn.parameters.properties -%}
            {{- "(_: {\n" -}}
            {%- for name, spec in fn.parameters.properties.items() -%}
                {%- if spec.description %}{{ "// " + spec.description + "\n" }}{% endif -%}
                {{- name + ("" if name in (fn.parameters.required or []) else "?") + ": " + ts_type(spec) -}}
                {%- if spec.default is defined %}{{ ", // default: " + spec.default | tojson }}{% else %}{{ "," }}{% endif -%}
                {{- "\n" -}}
            {%- endfor -%}
            {{- "}) => any;\n\n" -}}
        {%- else -%}
            {{- "() => any;\n\n" -}}
        {%- endif -%}
    {%- endfor -%}
    {{- "} // namespace functions" -}}
{%- endmacro -%}

{{- "<|start|>system<|message|>" -}}
{{- (model_identity if model_identity is defined else "You are a helpful assistant.") + "\n" -}}
{{- "Knowledge cutoff: 2024-06\nCurrent date: " + strftime_now("%Y-%m-%d") + "\n\n" -}}
{{- "Reasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") + "\n\n" -}}
{%- if builtin_tools -%}
    {%- set have = namespace(browser=false, python=false) -%}
    {%- for t in builtin_tools -%}
        {%- if t == "browser" %}{% set have.browser = true %}{% elif t == "python" %}{% set have.python = true %}{% endif -%}
    {%- endfor -%}
    {{- "# Tools\n\n" + ("## browser\n\n" if have.browser else "") + ("## python\n\n" if have.python else "") -}}
{%- endif -%}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools %}{{ "\nCalls to these tools must go to the commentary channel: 'functions'." }}{% endif -%}
{{- "<|end|>" -}}

{%- if messages[0].role in ("developer", "system") -%}
    {%- set instructions = messages[0].content -%}
    {%- set rest = messages[1:] -%}
{%- else -%}
    {%- set instructions = "" -%}
    {%- set rest = messages -%}
{%- endif -%}
{%- if instructions or tools -%}
    {{- "<|start|>developer<|message|>" -}}
    {%- if instructions %}{{ "# Instructions\n\n" + instructions + "\n\n" }}{% endif -%}
    {%- if tools %}{{ "# Tools\n\n" + functions_namespace(tools) }}{% endif -%}
    {{- "<|end|>" -}}
{%- endif -%}

{%- set last_call = namespace(name=none) -%}
{%- for message in rest -%}
    {%- if message.role == "assistant" -%}
        {%- if "content" in message and "<|channel|>" in message.content -%}
            {{- raise_exception("pass analysis in 'thinking', not <|channel|> tags in 'content'") -}}
        {%- endif -%}
        {%- if "tool_calls" in message -%}
            {%- set later = namespace(final=false) -%}
            {%- for m in rest[loop.index:] -%}
                {%- if m.role == "assistant" and "tool_calls" not in m %}{% set later.final = true %}{% endif -%}
            {%- endfor -%}
            {%- set call = message.tool_calls[0].function if message.tool_calls[0].function is defined
                           else message.tool_calls[0] -%}
            {%- if message.thinking is defined and not later.final -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
            {%- endif -%}
            {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" -}}
            {{- (call.arguments if call.arguments is string else call.arguments | tojson) + "<|call|>" -}}
            {%- set last_call.name = call.name -%}
        {%- elif loop.last and not add_generation_prompt -%}
            {%- if message.thinking is defined -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
            {%- endif -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" -}}
        {%- else -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" -}}
        {%- endif -%}
    {%- elif message.role == "tool" -%}
        {%- if last_call.name is none %}{{ raise_exception("a tool result without a tool call") }}{% endif -%}
        {{- "<|start|>functions." + last_call.name + " to=assistant<|channel|>commentary<|message|>" -}}
        {{- message.content | tojson + "<|end|>" -}}
    {%- else -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ "<|start|>assistant" }}{% endif -%}
"""

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
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = HARMONY
    config_path.write_text(json.dumps(config))
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
