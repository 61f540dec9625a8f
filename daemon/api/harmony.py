"""GPT-OSS's answers in harmony, OpenAI's harmony response format
(cookbook.openai.com/articles/openai-harmony; github.com/openai/harmony): the generated
text split into reasoning, content and tool calls, as it streams, and the grammar of a
required call.

A harmony conversation is a run of messages `<|start|>ROLE HEADER<|message|>TEXT END`;
the header names the message's channel (`<|channel|>analysis`, `commentary` or `final`),
its recipient (`to=functions.NAME`, before or after the channel) and the content type of
a call (`<|constrain|>json`, or ` json`). The chat template's generation prompt ends with
`<|start|>assistant`, so an answer starts with the header of its first message, e.g.

    <|channel|>analysis<|message|>The user wants...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

or, calling a function,

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

END is <|end|> (another message follows), <|return|> (the answer's end) or <|call|> (a
call's end); the last two are the model's stop tokens (its generation_config's
eos_token_id), so they end generation and are usually not in the text. The markup tokens
are special tokens, which the engine writes as text for this format only
(EngineRequest.special_tokens).

Reading (`HarmonyParser`): an `analysis` message is reasoning (reasoning_content);
`final` and `commentary` without a recipient (a preamble to the user) are content, as is a
message of any other channel; a message to `functions.NAME` is a tool call of NAME whose
arguments are the message's text when NAME is one of the request's functions and the
text is a JSON object, else its markup and text go to the content as generated; so does
a message to any other recipient (harmony's built-in tools, `browser.*` and `python`,
which moed neither offers the model nor runs). Text that does not follow the
format (a header that does not start as one, or none within MAX_HEADER_CHARS; anything
but `<|start|>assistant` after a message's end) is content from there on: never dropped.
Harmony has one call per assistant turn (the model stops at <|call|> and is given the
result), so parallel_tool_calls cannot make several.

The grammar of tool_choice "required" or a named function (`harmony_grammar`, in
llguidance's Lark, where `<|...|>` names a special token) allows an analysis message
first, then forces `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`,
the arguments as JSON following the function's parameters schema, and <|call|>; that of
a response_format (`harmony_json_grammar`) allows an analysis message, then forces
`<|channel|>final<|message|>`, the JSON and <|return|>. Either analysis is at most
MAX_ANALYSIS_TOKENS tokens.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from typing import Any

from daemon.api.tools import Tool, ToolCall, _prefix_overlap

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN, RETURN, CALL = "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"
MESSAGE_ENDS = (END, CALL, RETURN)
NEXT_MESSAGE = START + "assistant"
HEADER_STARTS = (CHANNEL, " to=", "to=")
MAX_HEADER_CHARS = 256          # a header without <|message|> within this is not harmony
# The analysis a constrained answer may write before its call or its JSON, in tokens: past
# it the grammar ends the message (<|end|>), so the call or the JSON always comes (a
# model of random weights, or one that reasons on, would otherwise spend max_tokens there);
# GPT-OSS at high effort reasons for thousands of tokens, which this leaves room for.
MAX_ANALYSIS_TOKENS = 16384
# The JSON of a constrained call: compact, as the format's examples write arguments
# ({"location":"San Francisco"}), and no whitespace the model could pad without end.
HARMONY_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# Each optional part starts with text the one before cannot match, so a header that is not
# one fails in time linear in its length (two adjacent `\s*` backtracked cubically).
_HEADER = re.compile(r"\s*(?:to=(?P<to1>[^\s<]+)\s*)?<\|channel\|>(?P<channel>[\w-]+)"
                     r"(?:\s*to=(?P<to2>[^\s<]+))?\s*(?:<\|constrain\|>\s*)?(?:[\w/.+-]+\s*)?")


def is_harmony(chat_template: str | None) -> bool:
    """Does the chat template write harmony (GPT-OSS's format)?"""
    return bool(chat_template) and all(m in chat_template for m in (CHANNEL, MESSAGE, CALL))


def _header(text: str) -> tuple[str, str | None] | None:
    """(channel, recipient or None) of a message header, None when it is not one."""
    m = _HEADER.fullmatch(text)
    if m is None:
        return None
    return m["channel"], m["to1"] or m["to2"]


def _call(recipient: str, body: str, names: frozenset[str]) -> ToolCall | None:
    """A call of `functions.NAME`, NAME one of `names`, whose text is a JSON object, else
    None."""
    name = recipient.removeprefix("functions.")
    if name == recipient or name not in names:
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    return ToolCall("call_" + uuid.uuid4().hex[:24], name, body.strip())


class HarmonyParser:
    """One choice's harmony text, fed as it streams, as pieces ("reasoning", str),
    ("content", str) and ("call", ToolCall) in order (daemon.api.reasoning.AnswerParser's
    interface). tools: the names of the functions the request offered (a call of one of
    them is read; any other message with a recipient, a built-in tool's or an unknown
    function's, is content as generated). Reasoning and content stream as they come (a
    possible end marker held back); a call is one piece once its message has ended."""

    def __init__(self, tools: Iterable[str] = ()):
        self._names = frozenset(tools)
        self._state = "header"          # header | body | next | raw
        self._buf = ""
        self._header = ""               # the current message's header text
        self._kind = "content"          # what the body is: reasoning | content | call
        self._recipient: str | None = None
        self.calls = 0

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        out: list[tuple[str, Any]] = []
        while self._buf:
            if self._state == "raw":
                out.append(("content", self._buf))
                self._buf = ""
            elif self._state == "next":                 # after a message: another one?
                if self._buf.startswith(NEXT_MESSAGE):
                    self._buf = self._buf[len(NEXT_MESSAGE):]
                    self._state = "header"
                elif NEXT_MESSAGE.startswith(self._buf):
                    break
                else:
                    self._state = "raw"
            elif self._state == "header":
                if not self._header_feed():
                    break
            else:
                if not self._body_feed(out):
                    break
        return out

    def _header_feed(self) -> bool:
        """Reads the header in the buffer; False when more text is needed."""
        at = self._buf.find(MESSAGE, 0, MAX_HEADER_CHARS + len(MESSAGE))
        if at < 0:                       # (a whole answer comes in one piece: bound it too)
            if len(self._buf) > MAX_HEADER_CHARS or not any(
                    self._buf.startswith(s) or s.startswith(self._buf) for s in HEADER_STARTS):
                self._state = "raw"
                return True
            return False
        header = _header(self._buf[:at])
        if header is None:
            self._state = "raw"
            return True
        self._header = self._buf[:at + len(MESSAGE)]
        channel, self._recipient = header
        self._buf = self._buf[at + len(MESSAGE):]
        self._state = "body"
        if self._recipient is not None:
            self._kind = "call"
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"
        return True

    def _body_feed(self, out: list) -> bool:
        """Streams the body in the buffer; False when more text is needed."""
        ends = [(i, m) for m in MESSAGE_ENDS if (i := self._buf.find(m)) >= 0]
        if not ends:
            if self._kind != "call":
                cut = len(self._buf) - max(_prefix_overlap(self._buf, m) for m in MESSAGE_ENDS)
                if cut:
                    out.append((self._kind, self._buf[:cut]))
                    self._buf = self._buf[cut:]
            return False
        at, marker = min(ends)
        body, self._buf = self._buf[:at], self._buf[at + len(marker):]
        out += self._ended(body, marker)
        self._state = "next"
        return True

    def _ended(self, body: str, marker: str) -> list[tuple[str, Any]]:
        """The pieces of a message whose body has ended (with `marker`, "" at the end)."""
        if self._kind != "call":
            return [(self._kind, body)] if body else []
        call = _call(self._recipient or "", body, self._names)
        if call is None:                 # not a call moed reads: the text as generated
            return [("content", self._header + body + marker)]
        self.calls += 1
        return [("call", call)]

    def finish(self) -> list[tuple[str, Any]]:
        """The rest, once the choice has ended (a stop token ends the last message)."""
        buf, self._buf = self._buf, ""
        if self._state == "body":
            self._state = "next"
            return self._ended(buf, "")
        return [("content", buf)] if buf else []


def _analysis_rules() -> list[str]:
    """The Lark rules of an analysis message (`analysis`) of at most MAX_ANALYSIS_TOKENS
    tokens of text, then `<|start|>assistant`: what a constrained answer may think first."""
    return [f"analysis: {CHANNEL} \"analysis\" {MESSAGE} analysis_text {END} {START} \"assistant\"",
            f"analysis_text[max_tokens={MAX_ANALYSIS_TOKENS}]: /(.|\\n)*/"]


def harmony_grammar(tools: list[Tool]) -> str:
    """The Lark grammar (llguidance's dialect, `<|...|>` a special token) of one call of
    one of `tools` after the generation prompt `<|start|>assistant`: an optional analysis
    message (`_analysis_rules`), then `<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>`, the arguments following the function's parameters
    schema, and <|call|>."""
    rules = []
    for k, t in enumerate(tools):
        schema = {**t.arguments_schema, "x-guidance": HARMONY_JSON}
        rules.append(f"f{k}: {json.dumps(t.name)} \" \" {CONSTRAIN} \"json\" {MESSAGE} a{k} {CALL}")
        rules.append(f"a{k}: %json {json.dumps(schema, separators=(',', ':'))}")
    alternatives = " | ".join(f"f{k}" for k in range(len(tools)))
    lines = ["start: analysis? call", *_analysis_rules(),
             f"call: {CHANNEL} \"commentary to=functions.\" ({alternatives})",
             *rules]
    return "\n".join(lines) + "\n"


def harmony_json_grammar(schema: dict) -> str:
    """The Lark grammar of a response_format's answer after the generation prompt: an
    optional analysis message (`_analysis_rules`), then `<|channel|>final<|message|>`, a
    JSON value following `schema` (a JSON schema; its "x-guidance" options llguidance's
    JSON layout) and <|return|>: the JSON is the answer's content, in harmony."""
    return "\n".join([
        "start: analysis? final", *_analysis_rules(),
        f"final: {CHANNEL} \"final\" {MESSAGE} answer {RETURN}",
        f"answer: %json {json.dumps(schema, separators=(',', ':'))}"]) + "\n"
