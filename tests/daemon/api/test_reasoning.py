"""Reasoning (daemon/api/reasoning.py): a thinking model's <think> block goes to
reasoning_content, streamed or not, whatever the text's splits; a prompt that leaves the
block open starts the answer in it; chat_template_kwargs reach the template (Qwen3's
enable_thinking) within bounds."""
from __future__ import annotations

import json

import pytest
from daemon_proc import openai_client, serving

from daemon.api import chat as chat_api
from daemon.api.reasoning import AnswerParser, opens_thinking, split_answer, thinks
from ext.makemodel import CHATML_TEMPLATE, QWEN3_TEMPLATE, make_model
from ext.tokenizer import Tokenizer

MODEL = "model"
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def _pieces(text: str, step: int, **kw) -> list:
    parser = AnswerParser(**kw)
    out = []
    for i in range(0, len(text), step):
        out += parser.feed(text[i:i + step])
    out += parser.finish()
    merged: list = []
    for kind, value in out:
        if kind != "call" and merged and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + value)
        else:
            merged.append((kind, value if kind != "call" else value.name))
    return merged


@pytest.mark.parametrize("text, kw, want", [
    ("<think>\nstep 1\n</think>\n\nThe answer.", {"reasoning": True},
     [("reasoning", "\nstep 1\n"), ("content", "The answer.")]),
    ("  <think>a</think>b", {"reasoning": True}, [("reasoning", "a"), ("content", "b")]),
    ("No thinking here.", {"reasoning": True}, [("content", "No thinking here.")]),
    ("<thin", {"reasoning": True}, [("content", "<thin")]),                 # ended before the tag
    ("still thinking", {"reasoning": True, "started": True}, [("reasoning", "still thinking")]),
    ("plan</think>\n\nOK", {"reasoning": True, "started": True}, [("reasoning", "plan"), ("content", "OK")]),
    ("<think>never closed", {"reasoning": True}, [("reasoning", "never closed")]),
    ("<think>x</think>", {"reasoning": False}, [("content", "<think>x</think>")]),   # not a thinker
    ("\nkept newline", {"reasoning": False}, [("content", "\nkept newline")]),
    ("<think>which tool</think>\n" + CALL, {"reasoning": True, "tools": True},
     [("reasoning", "which tool"), ("call", "f")]),
])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_the_answer_splits_into_reasoning_content_and_calls_however_it_streams(text, kw, want, step):
    assert _pieces(text, step, **kw) == want


def test_a_whole_answers_parts():
    assert split_answer("<think>\nhm\n</think>\n\nYes.", reasoning=True) == ("hm", "Yes.", [])
    assert split_answer("Yes.", reasoning=True) == (None, "Yes.", [])
    thought, content, calls = split_answer("<think>t</think>" + CALL, reasoning=True, tools=True)
    assert (thought, content, [c.name for c in calls]) == ("t", "", ["f"])


def test_thinking_is_read_off_the_template_and_the_prompt():
    assert thinks(QWEN3_TEMPLATE) and not thinks(CHATML_TEMPLATE) and not thinks(None)
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def _parse(tokenizer, body):
    return chat_api.parse_request(body, chat=True, model_names=(MODEL,), tokenizer=tokenizer,
                             stop_ids=frozenset(), context=4096, max_tokens_cap=64,
                             request_timeout_s=60, now=0.0)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("think") / MODEL, arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=12)


def test_chat_template_kwargs_reach_the_template_within_bounds(qwen3_dir):
    tokenizer = Tokenizer.from_model_dir(qwen3_dir)
    hi = [{"role": "user", "content": "hi"}]
    on = _parse(tokenizer, {"messages": hi})
    off = _parse(tokenizer, {"messages": hi, "chat_template_kwargs": {"enable_thinking": False}})
    text = tokenizer.decode(off.engine.prompt_ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert len(off.engine.prompt_ids) > len(on.engine.prompt_ids)
    assert on.reasoning and not on.reasoning_started and not off.reasoning_started
    for bad, what in [({"messages": 1}, "cannot set 'messages'"), ([1], "an object"),
                      ({f"k{i}": 1 for i in range(17)}, "at most 16"),
                      ({"x": [1, 2]}, "must be a boolean"), ({"x": "y" * 257}, "must be a boolean"),
                      ({"not a name": 1}, "cannot set")]:
        with pytest.raises(chat_api.ApiError, match=what) as e:
            _parse(tokenizer, {"messages": hi, "chat_template_kwargs": bad})
        assert e.value.param == "chat_template_kwargs"


def test_reasoning_effort_switches_qwen3s_thinking_and_chat_template_kwargs_win(qwen3_dir):
    tokenizer = Tokenizer.from_model_dir(qwen3_dir)
    hi = [{"role": "user", "content": "hi"}]

    def prompt(**kw):
        return tokenizer.decode(_parse(tokenizer, {"messages": hi, **kw}).engine.prompt_ids,
                                skip_special_tokens=False)
    empty = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert prompt(reasoning_effort="none").endswith(empty)
    assert prompt(reasoning_effort="high") == prompt()           # on, as by default
    assert not prompt(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}).endswith(empty)


# ----------------------------------------------- a template that opens <think> itself

@pytest.fixture(scope="module")
def r1_dir(qwen3_dir, tmp_path_factory):
    """The Qwen3 model with a generation prompt that opens <think> (as DeepSeek-R1's
    template does): the whole answer of random weights is reasoning."""
    out = make_model(tmp_path_factory.mktemp("r1") / MODEL, arch="qwen3_moe", layers=2,
                     experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=12)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    template = config["chat_template"]
    opened = template.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert opened != template
    config["chat_template"] = opened
    path.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def client(r1_dir):
    with serving(r1_dir, "--threads", "1") as d, openai_client(d) as c:
        yield c


def test_reasoning_content_streamed_and_not_is_the_answers_thinking(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Think about 2 + 2."}],
              max_tokens=24, seed=3, temperature=0.8, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0]
    thought = whole.message.model_extra.get("reasoning_content")
    assert thought and whole.message.content == "" and whole.finish_reason == "length"
    parts, content = [], []
    for ev in client.chat.completions.create(stream=True, **kw):
        for c in ev.choices:
            if c.delta.model_extra.get("reasoning_content"):
                parts.append(c.delta.model_extra["reasoning_content"])
            if c.delta.content:
                content.append(c.delta.content)
    assert "".join(parts).strip("\n") == thought and not content
