"""GPT-OSS's harmony (daemon/api/harmony.py): the parser splits analysis, final answers and
calls however the text streams and keeps text that is not harmony; the grammar of a
required call takes exactly the tools' calls, with the tokenizer's stop ids as llguidance's
EOS; make-model's gpt_oss tokenizer holds the markup as single tokens and stops as the
checkpoints' generation_config does; a chat request renders OpenAI's history (calls,
results, reasoning) through the template as transformers renders the equivalent; and
through `moed serve` a required call, its result and the answer round-trip (streamed and
not), on chat completions and /v1/responses."""
from __future__ import annotations

import json
import time

import jsonschema
import llguidance
import pytest
from daemon_proc import openai_client, serving, small_chat_model

from daemon.api import chat as chat_api
from daemon.api import messages as messages_api
from daemon.api import responses as responses_api
from daemon.api.harmony import (MAX_ANALYSIS_TOKENS, HarmonyParser, harmony_grammar, harmony_json_grammar,
                                is_harmony)
from daemon.api.reasoning import effort_variables, split_with
from daemon.api.tools import Tool, detect_format, parse_tools
from ext.makemodel import GLM45_TEMPLATE, GPT_OSS_TEMPLATE, HARMONY_TOKENS, QWEN3_TEMPLATE
from ext.tokenizer import Tokenizer, stop_token_ids

MODEL = "model"


def _function(name: str, description: str, **properties) -> dict:
    """An OpenAI function tool whose arguments are exactly `properties`, all required
    (the harmony template writes every tool's description)."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties),
        "additionalProperties": False}}}


WEATHER = _function("get_weather", "The weather in a city now.",
                    city={"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                    unit={"type": "string", "enum": ["C", "F"]})
TIME = _function("get_time", "The time in a zone.", zone={"type": "integer", "minimum": -12, "maximum": 14})
TOOLS = tuple(Tool(t["function"]["name"], None, t["function"]["parameters"]) for t in (WEATHER, TIME))
SCHEMAS = {t.name: t.parameters for t in TOOLS}
NAMES = tuple(SCHEMAS)
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]

ANALYSIS = "<|channel|>analysis<|message|>The user asks <b>; need the tool.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city":"Oslo","unit":"C"}')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 4 C."


def _read(text: str, step: int, tools: bool = True):
    parser = HarmonyParser(tools=NAMES if tools else ())
    pieces = []
    for i in range(0, len(text), step):
        pieces += parser.feed(text[i:i + step])
    return pieces + parser.finish(), parser


def _joined(pieces):
    out: dict = {}
    for kind, value in pieces:
        if kind == "call":
            out.setdefault("calls", []).append((value.name, value.arguments))
        else:
            out[kind] = out.get(kind, "") + value
    return out


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize("text, want", [
    (ANALYSIS + FINAL, {"reasoning": "The user asks <b>; need the tool.", "content": "It is 4 C."}),
    (ANALYSIS + FINAL + "<|return|>", {"reasoning": "The user asks <b>; need the tool.",
                                       "content": "It is 4 C."}),          # ignore_eos: the stop as text
    (ANALYSIS + CALL, {"reasoning": "The user asks <b>; need the tool.",
                       "calls": [("get_weather", '{"city":"Oslo","unit":"C"}')]}),
    (CALL.removeprefix("<|start|>assistant") + "<|call|>",
     {"calls": [("get_weather", '{"city":"Oslo","unit":"C"}')]}),
    # the recipient in the header before the channel, as the template writes history calls
    (' to=functions.get_time<|channel|>commentary json<|message|>{"zone": 2}',
     {"calls": [("get_time", '{"zone": 2}')]}),
    # a preamble to the user (commentary, no recipient) is content
    ("<|channel|>commentary<|message|>Checking.<|end|>" + CALL, {
        "content": "Checking.", "calls": [("get_weather", '{"city":"Oslo","unit":"C"}')]}),
    # not harmony (random weights): all content, as generated
    ("Hello <|end|> there", {"content": "Hello <|end|> there"}),
    ("<|channel|>analysis no message marker", {"content": "<|channel|>analysis no message marker"}),
    (ANALYSIS + "then words", {"reasoning": "The user asks <b>; need the tool.", "content": "then words"}),
    # built-in tools (browser.*, python) and a function the request did not offer: not
    # calls moed reads, so content as generated
    ('<|channel|>analysis to=browser.search code<|message|>{"query":"Oslo"}<|call|>',
     {"content": '<|channel|>analysis to=browser.search code<|message|>{"query":"Oslo"}<|call|>'}),
    (ANALYSIS + "<|start|>assistant<|channel|>commentary to=python code<|message|>print(4)",
     {"reasoning": "The user asks <b>; need the tool.",
      "content": "<|channel|>commentary to=python code<|message|>print(4)"}),
    ('<|channel|>commentary to=functions.get_stock <|constrain|>json<|message|>{"s":"X"}<|call|>',
     {"content": '<|channel|>commentary to=functions.get_stock <|constrain|>json<|message|>{"s":"X"}<|call|>'}),
    # a call whose text is not a JSON object stays content, with its markup
    ("<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{zone: 2}<|call|>",
     {"content": "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{zone: 2}<|call|>"}),
])
def test_the_parser_splits_channels_and_calls_however_the_text_streams(text, want, step):
    pieces, parser = _read(text, step)
    assert _joined(pieces) == want
    assert parser.calls == len(want.get("calls", []))


def test_reasoning_and_content_stream_as_they_come_and_a_call_when_it_ends():
    parser = HarmonyParser(tools=NAMES)
    assert parser.feed("<|channel|>analysis<|message|>Thin") == [("reasoning", "Thin")]
    assert parser.feed("king<|e") == [("reasoning", "king")]          # a marker's start is held
    assert parser.feed("nd|><|start|>assistant<|channel|>final<|message|>Sun") == [("content", "Sun")]
    parser = HarmonyParser(tools=NAMES)
    assert parser.feed(CALL.removeprefix("<|start|>assistant")) == []
    [(kind, call)] = parser.finish()                                     # the stop token ended it
    assert kind == "call" and call.name == "get_weather" and call.id.startswith("call_")


def test_without_tools_a_call_is_content_and_a_whole_answer_splits():
    text = CALL.removeprefix("<|start|>assistant")
    assert split_with(HarmonyParser(), text) == (None, text, [])
    reasoning, content, calls = split_with(HarmonyParser(tools=NAMES), ANALYSIS + CALL)
    assert reasoning == "The user asks <b>; need the tool." and content == "" and len(calls) == 1


def test_a_long_header_of_whitespace_is_content_at_once_whole_or_streamed():
    # a whole answer is fed at once: a header of thousands of spaces before <|message|>
    # (a looping model) took the header pattern's backtracking minutes on the event loop
    text = "<|channel|>analysis" + " " * 3000 + "!<|message|>hi"
    started = time.perf_counter()
    assert split_with(HarmonyParser(tools=NAMES), text) == (None, text, [])
    assert _joined(_read(text, 7)[0]) == {"content": text}
    assert time.perf_counter() - started < 1.0


def test_the_format_is_read_off_the_template():
    assert is_harmony(GPT_OSS_TEMPLATE) and detect_format(GPT_OSS_TEMPLATE) == "harmony"
    assert not is_harmony(QWEN3_TEMPLATE) and not is_harmony(GLM45_TEMPLATE) and not is_harmony(None)
    req = parse_tools({"tools": [WEATHER], "tool_choice": "required"}, GPT_OSS_TEMPLATE)
    assert req.format == "harmony" and "to=functions." in harmony_grammar(req.chosen())


# ------------------------------------------------------------------ make-model's gpt_oss


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return small_chat_model(tmp_path_factory.mktemp("harmony"), seed=21, arch="gpt_oss")


def test_the_tokenizer_holds_the_markup_as_single_tokens_and_stops_as_gpt_oss(model_dir):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    ids = {t: tokenizer.encode(t, add_special_tokens=False) for t in HARMONY_TOKENS}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert stop_token_ids(model_dir) == {ids["<|return|>"][0], ids["<|call|>"][0],
                                         tokenizer.token_to_id("<|endoftext|>")}
    assert tokenizer.eos_token == "<|return|>"
    # added after the trained vocabulary, as every family's own tokens are: the model's
    # embedding rows (padded to a multiple of 64) hold them
    assert min(i for [i] in ids.values()) >= 512
    assert tokenizer.vocab_size <= json.loads((model_dir / "config.json").read_text())["vocab_size"]
    decoder = tokenizer.stream_decoder(special_tokens=True)
    ids = tokenizer.encode(CALL, add_special_tokens=False)
    text = "".join(decoder.step(t) for t in ids) + decoder.finish()
    assert text == CALL
    plain = tokenizer.stream_decoder()
    assert "".join(plain.step(t) for t in ids) == (
        'assistantcommentary to=functions.get_weather json{"city":"Oslo","unit":"C"}')


@pytest.mark.parametrize("text, ok", [
    (CALL.removeprefix("<|start|>assistant") + "<|call|>", True),
    (ANALYSIS + CALL + "<|call|>", True),
    ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone":-3}<|call|>', True),
    ('<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone":20}<|call|>', False),
    (CALL.removeprefix("<|start|>assistant").replace("Oslo", "Rome") + "<|call|>", False),
    (CALL.removeprefix("<|start|>assistant").replace('","', '", "') + "<|call|>", False),  # compact JSON
    ("<|channel|>final<|message|>It is 4 C.<|return|>", False),        # a required call comes
])
def test_the_grammar_takes_exactly_the_tools_calls(model_dir, text, ok):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    ll = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size,
                                eos_token=sorted(stop_token_ids(model_dir)))
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(harmony_grammar(list(TOOLS))),
                                   log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    took = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert (took and matcher.is_stopped()) is ok
    if ok:
        [call] = split_with(HarmonyParser(tools=NAMES), text)[2]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_openais_history_renders_as_transformers_renders_the_templates_own_fields(model_dir):
    transformers = pytest.importorskip("transformers")
    tokenizer = Tokenizer.from_model_dir(model_dir)
    history = QUESTION + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "4 C"}]
    parsed = chat_api.parse_request(
        {"messages": history, "tools": [WEATHER], "chat_template_kwargs": {"reasoning_effort": "high"}},
        chat=True, model_names=(MODEL,), tokenizer=tokenizer, stop_ids=frozenset(), context=4096,
        max_tokens_cap=64, request_timeout_s=60, now=0.0)
    ours = tokenizer.decode(parsed.engine.prompt_ids, skip_special_tokens=False)
    theirs = transformers.AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        QUESTION + [{"role": "assistant", "content": "", "thinking": "Need the tool.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Oslo", "unit": "C"}}}]},
                    {"role": "tool", "content": "4 C"}],
        tools=[WEATHER], reasoning_effort="high", add_generation_prompt=True, tokenize=False)
    assert ours == theirs
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Oslo", "unit": "C"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"4 C"<|end|>'
            "<|start|>assistant") in ours and ours.endswith("<|start|>assistant")
    assert "Reasoning: high" in ours
    assert parsed.harmony and parsed.engine.special_tokens and parsed.tools is not None


def test_a_tool_without_a_description_renders(model_dir):
    # harmony templates write "// " + description for every tool (GPT-OSS's own does too)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    bare = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
    text = chat_api.render_chat({"messages": QUESTION, "tools": [bare]}, tokenizer,
                                parse_tools({"tools": [bare]}, tokenizer.chat_template))
    assert "// \ntype ping = () => any;" in text


# ------------------------------------------------------------------ through moed serve


@pytest.fixture(scope="module")
def client(model_dir):
    with serving(model_dir, "--threads", "1") as d, openai_client(d) as c:
        yield c


def _end_bias(model_dir):
    """logit_bias that makes <|end|> likely: the random weights' optional analysis ends soon."""
    return {str(Tokenizer.from_model_dir(model_dir).token_to_id("<|end|>")): 8}


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_its_result_and_the_answer_round_trip(client, model_dir, stream):
    kw = dict(model=MODEL, tools=[WEATHER, TIME], max_tokens=300, seed=3,
              logit_bias=_end_bias(model_dir))
    if stream:
        calls, reasons, reasoning = [], [], []
        for ev in client.chat.completions.create(messages=QUESTION, tool_choice="required",
                                                 stream=True, **kw):
            for c in ev.choices:
                calls += c.delta.tool_calls or []
                reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
                assert not c.delta.content
                reasons += [c.finish_reason] if c.finish_reason else []
        assert reasons == ["tool_calls"]
        [call] = calls
        message = {"role": "assistant", "content": None, "reasoning_content": "".join(reasoning),
                   "tool_calls": [{"id": call.id, "type": "function",
                                   "function": call.function.model_dump()}]}
    else:
        choice = client.chat.completions.create(messages=QUESTION, tool_choice="required", **kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        message = choice.message.model_dump(exclude_none=True)
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    history = QUESTION + [message, {"role": "tool", "tool_call_id": call.id, "content": "4 C, rain"}]
    for choice in ("auto", "none"):
        answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME],
                                                tool_choice=choice, max_tokens=8, seed=2)
        [c] = answer.choices
        assert c.finish_reason in ("stop", "length") and c.message.tool_calls is None
        assert c.message.content or getattr(c.message, "reasoning_content", None)   # nothing dropped
        assert answer.usage.prompt_tokens > 60


# With these weights (make-model seed 21) and sampling seed, the grammar's optional analysis
# message is taken and ended before the call: reasoning and a call in one answer.
ANALYSING_SEED = 3


def test_an_analysis_before_a_required_call_is_reasoning_content(client):
    choice = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME],
                                            tool_choice="required", max_tokens=300,
                                            seed=ANALYSING_SEED).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content and "<|" not in choice.message.reasoning_content
    [call] = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_responses_carry_the_analysis_and_the_call(client, stream):
    body = dict(model=MODEL, input="Weather in Oslo?", max_output_tokens=300, tool_choice="required",
                tools=[{"type": "function", **t["function"]} for t in (WEATHER, TIME)],
                extra_body={"seed": ANALYSING_SEED})
    if stream:
        [out] = [ev.response for ev in client.responses.create(stream=True, **body)
                 if ev.type == "response.completed"]
    else:
        out = client.responses.create(**body)
    assert [item.type for item in out.output] == ["reasoning", "function_call"]
    assert out.output[0].content[0].text and "<|" not in out.output[0].content[0].text
    call = out.output[1]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


# ------------------------------------------------------------------ response_format

ANSWER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                           "temp": {"type": "integer", "minimum": -50, "maximum": 50}},
          "required": ["city", "temp"], "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER}}


def _matcher(model_dir, lark: str):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    ll = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size,
                                eos_token=sorted(stop_token_ids(model_dir)))
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return tokenizer, matcher


def _takes(tokenizer, matcher, text: str) -> bool:
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.is_stopped()


@pytest.mark.parametrize("text, ok", [
    ('<|channel|>final<|message|>{"city":"Oslo","temp":-3}<|return|>', True),
    (ANALYSIS + '<|start|>assistant<|channel|>final<|message|>{"city":"Paris","temp":20}<|return|>', True),
    ('{"city":"Oslo","temp":-3}', False),                                     # off-format
    ('<|channel|>final<|message|>{"city":"Rome","temp":-3}<|return|>', False),
    ('<|channel|>commentary<|message|>{"city":"Oslo","temp":-3}<|return|>', False),
])
def test_a_response_formats_json_is_harmonys_final_message(model_dir, text, ok):
    typed = {**ANSWER, "x-guidance": {"whitespace_flexible": False}}
    tokenizer, matcher = _matcher(model_dir, harmony_json_grammar(typed))
    assert _takes(tokenizer, matcher, text) is ok
    if ok:
        reasoning, content, calls = split_with(HarmonyParser(tools=NAMES), text)
        jsonschema.validate(json.loads(content), ANSWER)
        assert not calls and (reasoning is not None) == text.startswith(ANALYSIS)


@pytest.mark.parametrize("grammar", [harmony_json_grammar({"type": "object"}), harmony_grammar(list(TOOLS))])
def test_a_constrained_answers_analysis_ends_after_max_analysis_tokens(model_dir, grammar):
    tokenizer, matcher = _matcher(model_dir, grammar)
    words = tokenizer.encode(" sun" * (MAX_ANALYSIS_TOKENS + 1), add_special_tokens=False)
    assert len(words) > MAX_ANALYSIS_TOKENS
    head = tokenizer.encode("<|channel|>analysis<|message|>", add_special_tokens=False)
    assert all(matcher.consume_token(t) for t in head + words[:MAX_ANALYSIS_TOKENS])
    end = tokenizer.token_to_id("<|end|>")
    assert matcher.validate_tokens([words[MAX_ANALYSIS_TOKENS]]) == 0     # no more text
    assert matcher.consume_token(end)                                    # the message ends


# ------------------------------------------------------------------ reasoning effort


def _rendered(model_dir, body: dict) -> str:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    return chat_api.render_chat({"messages": QUESTION, **body}, tokenizer, None)


@pytest.mark.parametrize("body, level", [
    ({}, "medium"),                                         # the template's default
    ({"reasoning_effort": "high"}, "high"),
    ({"reasoning_effort": "xhigh"}, "high"),                # harmony's nearest levels
    ({"reasoning_effort": "none"}, "low"),
    ({"reasoning_effort": "minimal"}, "low"),
    # chat_template_kwargs name the template's own variable: it wins
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "high"),
])
def test_reasoning_effort_is_gpt_osss_reasoning_level(model_dir, body, level):
    text = _rendered(model_dir, body)
    assert f"Reasoning: {level}\n" in text


def test_an_unknown_reasoning_effort_is_a_400_naming_it(model_dir):
    with pytest.raises(chat_api.ApiError) as e:
        _rendered(model_dir, {"reasoning_effort": "extreme"})
    assert e.value.status == 400 and e.value.param == "reasoning_effort" and "'extreme'" in e.value.message
    with pytest.raises(chat_api.ApiError) as e:
        responses_api.chat_body({"input": "hi", "reasoning": {"effort": 3}})
    assert e.value.param == "reasoning"


def test_effort_turns_thinking_on_or_off_where_a_template_switches_it():
    assert effort_variables("none", harmony=False) == {"reasoning_effort": "none", "enable_thinking": False,
                                                       "thinking": False}
    assert effort_variables("low", harmony=False)["enable_thinking"] is True
    assert effort_variables("none", harmony=True)["reasoning_effort"] == "low"
    assert responses_api.chat_body({"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}})[
        "reasoning_effort"] == "low"
    base = {"max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}]}
    assert messages_api.chat_body({**base, "thinking": {"type": "disabled"}})["reasoning_effort"] == "none"
    on = messages_api.chat_body({**base, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert on["chat_template_kwargs"] == {"enable_thinking": True, "thinking": True}
    assert "reasoning_effort" not in on
    for bad in ({"type": "enabled"}, {"type": "enabled", "budget_tokens": 1023},
                {"type": "enabled", "budget_tokens": 2048}, {"type": "enabled", "budget_tokens": True},
                {"type": "adaptive", "budget_tokens": 1024}):
        with pytest.raises(chat_api.ApiError) as e:
            messages_api.chat_body({**base, "thinking": bad})
        assert e.value.param == "thinking", bad


# With these weights and sampling seed, the grammar's optional analysis is taken and ended
# before the final message: reasoning and the JSON in one answer.
JSON_ANALYSING_SEED = 4


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_answer_is_the_content_of_harmonys_final_message(client, stream):
    kw = dict(model=MODEL, messages=QUESTION, response_format=JSON_FORMAT, max_tokens=300,
              seed=JSON_ANALYSING_SEED, reasoning_effort="low", logprobs=True)
    content, reasoning, reasons, tokens = [], [], [], []
    if stream:
        for ev in client.chat.completions.create(stream=True, **kw):
            for c in ev.choices:
                content.append(c.delta.content or "")
                reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
                reasons += [c.finish_reason] if c.finish_reason else []
                tokens += [t.token for t in (c.logprobs.content if c.logprobs else None) or []]
    else:
        [c] = client.chat.completions.create(**kw).choices
        content, reasoning, reasons = [c.message.content], [c.message.reasoning_content], [c.finish_reason]
        tokens = [t.token for t in c.logprobs.content]
    text, thought = "".join(content), "".join(reasoning)
    assert reasons == ["stop"]
    jsonschema.validate(json.loads(text), ANSWER)
    assert thought and "<|" not in text + thought
    # as generated: an analysis message, then the JSON as harmony's final message
    assert "".join(tokens).startswith("<|channel|>analysis<|message|>")
    assert "".join(tokens).endswith("<|start|>assistant<|channel|>final<|message|>" + text)


@pytest.mark.parametrize("kw, param", [
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    # a schema llguidance refuses, inside harmony's frame: refused by the compile
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
])
def test_bad_fields_are_400s_naming_them_through_the_server(client, kw, param):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **kw)
    assert e.value.body["param"] == param
