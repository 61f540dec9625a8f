"""Tool calls in OpenAI's shape: the request's `tools`, `tool_choice` and
`parallel_tool_calls`, the model's tool-call text format, and the parser that turns the
generated text back into `tool_calls`.

A request with tools renders them through the model's own chat template (the template
variable `tools`, a list of {"type": "function", "function": {"name", "description",
"parameters"}} as transformers' apply_chat_template takes them); the model answers in
the format its template teaches, which `detect_format` reads off the template:

- "hermes" (Qwen2.5, Qwen3, QwQ; the format of the NousResearch Hermes models): each
  call is `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, several
  separated by newlines, after the message's text if any.

- "glm" (GLM-4.5, GLM-4.6): each call is `<tool_call>NAME` then, per argument, a line
  `<arg_key>KEY</arg_key>` and a line `<arg_value>VALUE</arg_value>`, then
  `</tool_call>`; a value is the text itself for a string parameter and JSON for any
  other type (as the published template writes history calls: `v if v is string else
  v | tojson`).

- "deepseek" (DeepSeek-V3.1): calls `<｜tool▁calls▁begin｜>`, then per call
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON arguments}<｜tool▁call▁end｜>`, then
  `<｜tool▁calls▁end｜>`; read too: DeepSeek-V3's older body `function<｜tool▁sep｜>NAME`
  and the arguments in a ```json fence. Its published template writes history calls and
  `<｜tool▁output▁begin｜>` results but not `tools`: moed writes the tool description of
  DeepSeek-V3.1's model card ("## Tools", one "### NAME" section per function, the call
  format) at the end of the system prompt, as the card lays the prompt out.

- "generic": a template that teaches no call format (Mixtral-Instruct's, Qwen1.5's,
  OLMoE's, ChatML): moed does what llama-server does for such templates (its "generic"
  chat format, which asks for its own JSON shape) but in the hermes format, which
  models are trained on: the tools go at the end of the system message in
  Qwen2.5's words (the functions as JSON in <tools></tools>, "return a json object with
  function name and arguments within <tool_call></tool_call> XML tags"), or at the start
  of the first user message for a template that refuses a system message
  (Mixtral-Instruct's), history calls
  are written into the assistant's text as `<tool_call>` JSON, tool results become user
  messages of `<tool_response>` blocks (unless the template names a "tool" role), and the
  answer is read and constrained as hermes.

- "harmony" (GPT-OSS; OpenAI's harmony response format,
  cookbook.openai.com/articles/openai-harmony): a call is an assistant message on the
  commentary channel to `functions.NAME`, `<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...}<|call|>`, one per turn; its answers are read, with
  their analysis channel, by daemon/api/harmony.py (not by CallParser).

tool_choice: "auto" (the default with tools: the model chooses, the text is parsed),
"none" (the tools are not offered and nothing is parsed), "required" (at least one call)
or {"type": "function", "function": {"name": N}} (a call of N). The last two constrain
decoding with a grammar (llguidance's Lark, with each function's `parameters` as the
JSON schema of its arguments: daemon/workers/grammar.py compiles it, bounded), so the
call parses whatever the weights are. parallel_tool_calls (default true): several calls
may follow each other; false: one call at most (the grammar of a constrained choice
allows exactly one).

Parsing never loses text: a call whose body is not a JSON object with a string "name"
(and an object or JSON-string "arguments") stays in the content as it was generated, and
so does an unfinished call. Calls get ids "call_" + 24 hex digits.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from ext.json_schema import closed_objects

MAX_TOOLS = 128                 # tools of one request
MAX_TOOL_NAME_CHARS = 64        # OpenAI's limit on a function name
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# The JSON a constrained call writes: no whitespace beyond the separators (llguidance's
# default lets a model pad without end), and the separators of the format's own history
# calls (Qwen's templates write json.dumps' ", " and ": "; GLM's tojson the same).
HERMES_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GLM_JSON = HERMES_JSON
DEEPSEEK_JSON = HERMES_JSON
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
GLM_KEY_OPEN, GLM_KEY_CLOSE = "<arg_key>", "</arg_key>"
GLM_VALUE_OPEN, GLM_VALUE_CLOSE = "<arg_value>", "</arg_value>"
THINK_CLOSE = "</think>"
# The formats' markers: one added token each in the tokenizers of the models that use
# them (Qwen3's, GLM-4.5's and DeepSeek-V3.1's tokenizer.json), plain text elsewhere (the
# generic format's <tool_call> on a ChatML model). A grammar names a marker as the token
# where the tokenizer has it (`LarkText`): llguidance matches an added token only as
# itself, never as the text of a string literal.
MARKERS = (HERMES_OPEN, HERMES_CLOSE, GLM_KEY_OPEN, GLM_KEY_CLOSE, GLM_VALUE_OPEN, GLM_VALUE_CLOSE,
           DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP, THINK_CLOSE)
_MARKER = re.compile("|".join(re.escape(m) for m in sorted(MARKERS, key=len, reverse=True)))


class ToolError(ValueError):
    """A tools field that cannot be used; `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    """One function the model may call: name, description, parameters (a JSON schema)."""

    name: str
    description: str | None
    parameters: dict

    @cached_property
    def arguments_schema(self) -> dict:
        """The schema a constrained call's arguments follow: `parameters` with its object
        schemas closed (ext/json_schema.py: no keys they do not list, unless they say so),
        as llama.cpp's and vLLM's grammars read a schema."""
        return closed_objects(self.parameters)

    def template_entry(self, described: bool = False) -> dict:
        """The function as chat templates take it (OpenAI's tool object); described: with
        a description always ("" when it has none: harmony templates write each one)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None or described:
            fn["description"] = self.description or ""
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: its id, the function's name and the arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def message_entry(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools. choice: "auto", "none", "required" or "function"
    (then `name` is the function's). Only "none" offers the template no tools."""

    tools: tuple[Tool, ...]
    choice: str
    name: str | None
    parallel: bool
    format: str

    @property
    def offered(self) -> bool:
        return self.choice != "none"

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")

    def template_tools(self) -> list[dict]:
        return [t.template_entry(described=self.format == "harmony") for t in self.tools]

    def chosen(self) -> list[Tool]:
        """The tools a constrained answer may call: all, or the one tool_choice names."""
        return [t for t in self.tools if self.choice != "function" or t.name == self.name]

    def grammar(self, tokens: Mapping[str, int], thinking_open: bool = False) -> str:
        """The Lark grammar (llguidance's dialect) of a constrained choice's output, for
        the formats of FORMATS (harmony's is daemon/api/harmony.py's harmony_grammar).
        tokens: the model tokenizer's added tokens (text -> id; `Tokenizer.added_tokens`),
        which decide whether a marker is written as its token or as text (`LarkText`).
        thinking_open: the prompt ends inside an open <think> (DeepSeek-V3.1's with
        thinking on): the output closes it first, `</think>`, so that the call is the
        answer and not reasoning (DeepSeek-V3.1's model card gives tool calls in the
        answer, after the think block)."""
        lark = FORMATS[self.format].grammar(self.chosen(), self.parallel, LarkText(tokens))
        if not thinking_open:
            return lark
        assert lark.startswith("start: ")
        return f"start: {LarkText(tokens)(THINK_CLOSE)} calls\ncalls: " + lark[len("start: "):]

    def parser(self) -> CallParser:
        """A parser of this request's calls in the model's format."""
        return CallParser(self.tools, self.format)


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches ("hermes", "glm", "deepseek",
    "harmony"), or "generic" for one that teaches none; None without a template."""
    if not chat_template:
        return None
    if "<|call|>" in chat_template and "<|channel|>" in chat_template:
        return "harmony"
    if DS_CALL_BEGIN in chat_template:
        return "deepseek"
    if "tools" not in chat_template:
        return "generic"
    if "<arg_key>" in chat_template:
        return "glm"
    if HERMES_OPEN in chat_template:
        return "hermes"
    return "generic"


def _tool(i: int, entry: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(entry.get("function"), dict):
        raise ToolError(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
    fn = entry["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_TOOL_NAME_CHARS or not all(
            c.isascii() and (c.isalnum() or c in "_-") for c in name):
        raise ToolError(f"'{where}.function.name' must be 1 to {MAX_TOOL_NAME_CHARS} of a-z, A-Z, "
                        "0-9, underscores and dashes", "tools")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"'{where}.function.description' must be a string", "tools")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ToolError(f"'{where}.function.parameters' must be a JSON schema (an object)", "tools")
    if not unicode_text(description) or not unicode_text(parameters):
        raise ToolError(f"'{where}.function' holds a lone UTF-16 surrogate: not valid Unicode text", "tools")
    return Tool(name, description, parameters)


def unicode_text(value: Any) -> bool:
    """Whether every string in `value` (JSON: nested lists and objects, keys too) is
    valid Unicode: no lone surrogates, which JSON can carry and UTF-8 cannot."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    except (ValueError, TypeError, RecursionError):
        return True                      # not JSON text at all: other checks say why
    return True


def parse_tools(body: dict, chat_template: str | None) -> ToolRequest | None:
    """The request's tools (None when it has none, or tool_choice "none" without tools).
    Raises ToolError naming the field: malformed tools, a tool_choice naming no tool,
    "required" without tools, a function name given twice, or a model whose chat
    template has no tool-call format moed reads."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise ToolError("'tools' must be a list of function tools", "tools")
    if len(raw) > MAX_TOOLS:
        raise ToolError(f"'tools' takes at most {MAX_TOOLS} tools, got {len(raw)}", "tools")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("'tools' names a function twice", "tools")
    name = None
    if choice is None or choice == "auto":
        kind = "auto"
    elif choice in ("none", "required"):
        kind = choice
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)):
        kind, name = "function", choice["function"]["name"]
        if name not in names:
            raise ToolError(f"'tool_choice' names the function '{name[:64]}', which is not in 'tools'",
                            "tool_choice")
    else:
        raise ToolError("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}", "tool_choice")
    fmt = detect_format(chat_template)
    if fmt is None and kind != "none":
        raise ToolError("this model has no chat template to offer tools through; send the "
                        "request without 'tools'", "tools")
    return ToolRequest(tools, kind, name, parallel, fmt or "hermes")


def _lark_string(text: str) -> str:
    return json.dumps(text)


@dataclass(frozen=True)
class LarkText:
    """Writes text into a Lark grammar: each of the formats' `MARKERS` in it that is an
    added token of the model's tokenizer (`tokens`: text -> id) as that token (`<[id]>`),
    the rest as string literals; a sequence of Lark items, matching `text` as the
    tokenizer encodes it."""

    tokens: Mapping[str, int]

    def __call__(self, text: str) -> str:
        items, at = [], 0
        for m in _MARKER.finditer(text):
            token_id = self.tokens.get(m.group())
            if token_id is None:
                continue
            if m.start() > at:
                items.append(_lark_string(text[at:m.start()]))
            items.append(f"<[{token_id}]>")
            at = m.end()
        if at < len(text) or not items:
            items.append(_lark_string(text[at:]))
        return " ".join(items)


def hermes_grammar(tools: list[Tool], parallel: bool, text: LarkText) -> str:
    """One call (or several, newline-separated, when parallel) of one of `tools`, each
    `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` with the arguments
    following the function's parameters schema; `text` writes the markers."""
    schema = {"anyOf": [{"type": "object",
                         "properties": {"name": {"const": t.name}, "arguments": t.arguments_schema},
                         "required": ["name", "arguments"], "additionalProperties": False}
                        for t in tools],
              "x-guidance": HERMES_JSON}
    calls = 'call ("\\n" call)*' if parallel else "call"
    return (f"start: {calls}\n"
            f"call: {text(HERMES_OPEN + chr(10))} body {text(chr(10) + HERMES_CLOSE)}\n"
            f"body: %json {json.dumps(schema, separators=(',', ':'))}\n")


def glm_grammar(tools: list[Tool], parallel: bool, text: LarkText) -> str:
    """One call (or several, newline-separated, when parallel) of one of `tools` in
    GLM-4.5's format: its arguments in the order of the parameters' properties, the
    required ones always and the others optional; a string value is text without "<"
    (of its minLength to maxLength characters), one with an enum one of them, any other
    value JSON following its schema; `text` writes the markers."""
    nl = _lark_string(chr(10))
    rules = []
    for k, t in enumerate(tools):
        props, required = _glm_arguments(t)
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            value = f"v{k}_{j}"
            if isinstance(schema, dict) and schema.get("type") == "string" and "enum" in schema:
                if not isinstance(schema["enum"], list) or not schema["enum"]:
                    raise ValueError(f"'{t.name}' parameters: the enum of '{key[:64]}' is not a "
                                     "non-empty list")
                rules.append(f"{value}: " + " | ".join(_lark_string(str(e)) for e in schema["enum"]))
            elif isinstance(schema, dict) and schema.get("type") == "string":
                rules.append(f"{value}: /[^<]{_length(schema)}/")
            else:
                typed = {**schema, "x-guidance": GLM_JSON} if isinstance(schema, dict) else schema
                rules.append(f"{value}: %json {json.dumps(typed, separators=(',', ':'))}")
            arg = (f"{nl} {text(GLM_KEY_OPEN + key + GLM_KEY_CLOSE)} "
                   f"{text(chr(10) + GLM_VALUE_OPEN)} {value} {text(GLM_VALUE_CLOSE)}")
            parts.append(arg if key in required else f"({arg})?")
        rules.append(f"f{k}: {_lark_string(t.name)} {' '.join(parts)}")
    calls = f"call ({nl} call)*" if parallel else "call"
    alternatives = " | ".join(f"f{k}" for k in range(len(tools)))
    lines = [f"start: {calls}",
             f"call: {text(HERMES_OPEN)} ({alternatives}) {text(chr(10) + HERMES_CLOSE)}",
             *rules]
    return chr(10).join(lines) + chr(10)


def _glm_arguments(tool: Tool) -> tuple[dict, set[str]]:
    """A tool's parameters as GLM's grammar writes them: (properties, the required names).
    Raises ValueError naming the tool for `properties` that is not an object or
    `required` that is not a list of names."""
    schema = tool.arguments_schema
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    required = schema.get("required", []) if isinstance(schema, dict) else []
    if not isinstance(props, dict):
        raise ValueError(f"'{tool.name}' parameters: 'properties' must be an object")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"'{tool.name}' parameters: 'required' must be a list of property names")
    return props, set(required)


def _length(schema: dict) -> str:
    """The regex repetition of a string schema's minLength/maxLength (characters), "*"
    without them."""
    low, high = schema.get("minLength"), schema.get("maxLength")
    low = low if isinstance(low, int) and not isinstance(low, bool) and low > 0 else 0
    high = high if isinstance(high, int) and not isinstance(high, bool) and high >= low else None
    return "*" if not low and high is None else f"{{{low},{'' if high is None else high}}}"


def deepseek_grammar(tools: list[Tool], parallel: bool, text: LarkText) -> str:
    """One call (or several, back to back, when parallel) of one of `tools` in
    DeepSeek-V3.1's format, `<｜tool▁calls▁begin｜>` to `<｜tool▁calls▁end｜>`, each call's
    arguments JSON following the function's parameters schema; `text` writes the markers
    (one token each in DeepSeek's vocabulary)."""
    rules = []
    for k, t in enumerate(tools):
        typed = {**t.arguments_schema, "x-guidance": DEEPSEEK_JSON}
        rules.append(f"f{k}: {_lark_string(t.name)} {text(DS_SEP)} a{k}")
        rules.append(f"a{k}: %json {json.dumps(typed, separators=(',', ':'))}")
    alternatives = " | ".join(f"f{k}" for k in range(len(tools)))
    calls = "call+" if parallel else "call"
    lines = [f"start: {text(DS_CALLS_BEGIN)} {calls} {text(DS_CALLS_END)}",
             f"call: {text(DS_CALL_BEGIN)} ({alternatives}) {text(DS_CALL_END)}",
             *rules]
    return chr(10).join(lines) + chr(10)


_DS_FENCED = re.compile(r"function" + DS_SEP + r"([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.S)


def _call_from_deepseek(body: str, tools: dict[str, Tool]) -> ToolCall | None:
    """A DeepSeek call body: `NAME<｜tool▁sep｜>{JSON object}` (V3.1), or V3's
    `function<｜tool▁sep｜>NAME` then the object in a ```json fence."""
    fenced = _DS_FENCED.fullmatch(body)
    name, sep, arguments = (fenced.group(1), DS_SEP, fenced.group(2)) if fenced else body.partition(DS_SEP)
    name = name.strip()
    if not sep or not name or "<" in name:
        return None
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    return ToolCall("call_" + uuid.uuid4().hex[:24], name, json.dumps(value, ensure_ascii=False))


def _call_from_glm(body: str, tools: dict[str, Tool]) -> ToolCall | None:
    """A GLM-4.5 call body: the name on its first line, then <arg_key>/<arg_value>
    pairs; a value is kept as text for a string parameter (or one moed does not know),
    else read as JSON (kept as text when it is not)."""
    name, _, rest = body.strip().partition("\n")
    name = name.strip()
    if not name or "<" in name:
        return None
    props = tools[name].parameters.get("properties") if name in tools else None
    props = props if isinstance(props, dict) else {}       # a malformed schema: values as text
    arguments: dict[str, Any] = {}
    for key, value in _GLM_ARG.findall(rest):
        schema = props.get(key)
        if isinstance(schema, dict) and schema.get("type") not in (None, "string"):
            try:
                arguments[key] = json.loads(value)
                continue
            except (ValueError, RecursionError):
                pass
        arguments[key] = value
    if _GLM_ARG.sub("", rest).strip():
        return None                      # text beside the pairs: not a call of this format
    return ToolCall("call_" + uuid.uuid4().hex[:24], name, json.dumps(arguments, ensure_ascii=False))


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _call_from_json(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            if not isinstance(json.loads(arguments), dict):
                return None
        except (ValueError, RecursionError):
            return None
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return ToolCall("call_" + uuid.uuid4().hex[:24], value["name"], text)


class CallParser:
    """Splits one choice's generated text, as it streams, into content and tool calls
    in a format of `FORMATS` (`tools` tell GLM's string parameters from others).
    `feed(text)` and `finish()` return the pieces now known, in
    order: ("content", str) or ("call", ToolCall). Text that may be the start of a call
    tag is held back until it is known; after the first call, whitespace between calls
    and the format's closing of a run of calls (its `trailer`) are not content."""

    def __init__(self, tools: tuple[Tool, ...] = (), fmt: str = "hermes"):
        form = FORMATS[fmt]
        self.opens, self.close, self._trailer = form.opens, form.close, form.trailer
        by_name = {t.name: t for t in tools}
        self._read = lambda body: form.read(body, by_name)
        self._buf = ""
        self._in_call = False
        self._open = ""                  # the open tag of the call being read
        self._ws = ""                    # whitespace after a call, held (`_content`)
        self.calls = 0

    def _content(self, text: str) -> list[tuple[str, Any]]:
        """After a call, whitespace is held until text follows it (then it goes out with
        the text) or another call or the end does (then it was only the calls' spacing)."""
        if not text:
            return []
        if self.calls:
            held = (self._ws + text).lstrip()
            if not held or (self._trailer and self._trailer.startswith(held)):
                self._ws += text
                return []
            if self._trailer and held.startswith(self._trailer):    # syntax, not content
                self._ws = ""
                return self._content(held[len(self._trailer):])
        text, self._ws = self._ws + text, ""
        return [("content", text)]

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self._in_call:
                end = self._buf.find(self.close)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(self.close):]
                self._in_call = False
                out += self._ended(body, closed=True)
            else:
                found = [(self._buf.find(tag), -len(tag), tag) for tag in self.opens if tag in self._buf]
                if not found:
                    keep = max(_prefix_overlap(self._buf, tag) for tag in self.opens)
                    cut = len(self._buf) - keep
                    out += self._content(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                start, _, self._open = min(found)       # the first; at one place the longest
                out += self._content(self._buf[:start])
                self._buf = self._buf[start + len(self._open):]
                self._in_call = True

    def _ended(self, body: str, closed: bool) -> list[tuple[str, Any]]:
        call = self._read(body)
        if call is None:                 # not a call after all: the text as it came
            text, self._ws = self._ws + self._open + body + (self.close if closed else ""), ""
            return [("content", text)]
        self.calls += 1
        self._ws = ""
        return [("call", call)]

    def finish(self) -> list[tuple[str, Any]]:
        """The rest: an unclosed call that parses is a call (the model may end right
        after its JSON), else text."""
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return self._ended(buf, closed=False)
        return self._content(buf)


def _prefix_overlap(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (shorter than it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_calls(text: str, tools: tuple[Tool, ...] = (), fmt: str = "hermes") -> tuple[str, list[ToolCall]]:
    """A whole answer's (content, calls): the content's text with the calls taken out."""
    parser = CallParser(tools, fmt)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p for k, p in pieces if k == "content")
    calls = [p for k, p in pieces if k == "call"]
    return (content.strip() if calls else content), calls


def hermes_system_text(tools: list[dict]) -> str:
    """The tools as Qwen2.5's and Qwen3's templates write them into the system message
    (the NousResearch Hermes wording), for templates that teach no call format."""
    listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function "
            "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def deepseek_system_text(tools: list[dict]) -> str:
    """The tool description of DeepSeek-V3.1's model card ("ToolCall"), which its chat
    template leaves to the system prompt: a "### NAME" section per function with its
    description and parameters (json.dumps), then the call format."""
    sections = "\n\n".join(
        f"### {t['function']['name']}\nDescription: {t['function'].get('description') or ''}\n\n"
        f"Parameters: {json.dumps(t['function']['parameters'], ensure_ascii=False)}" for t in tools)
    return ("## Tools\nYou have access to the following tools:\n\n" + sections + "\n\n"
            "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
            f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}tool_call_name{DS_SEP}tool_call_arguments{DS_CALL_END}"
            "{additional_tool_calls}" + DS_CALLS_END + "\n\nWhere:\n"
            "- `tool_call_name` must be an exact match to one of the available tools\n"
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
            "- For multiple tool calls, chain them directly without separators or spaces")


@dataclass(frozen=True)
class Format:
    """A tool-call format: the text that opens a call (`opens`, tried longest first at a
    place), closes it, and may close a run of calls (`trailer`, syntax dropped after a
    call); `read(body, tools by name)` -> ToolCall or None; `grammar(tools, parallel,
    text)` -> Lark, its top rule `start`, its markers written by `text` (a LarkText);
    `system_text(tools)`: the tools as moed writes them at the end of the system
    message, for a template that does not take `tools` (None: the template writes them);
    `text_arguments`: history calls' arguments go to the template as the JSON text the
    client sent (else as objects); `history_as_text`: history calls and tool results are
    rewritten into text for a template that has no place for them."""

    opens: tuple[str, ...]
    close: str
    trailer: str
    read: Callable[[str, dict[str, Tool]], ToolCall | None]
    grammar: Callable[[list[Tool], bool, LarkText], str]
    system_text: Callable[[list[dict]], str] | None = None
    text_arguments: bool = False
    history_as_text: bool = False


_HERMES = Format((HERMES_OPEN,), HERMES_CLOSE, "", lambda body, _: _call_from_json(body.strip()), hermes_grammar)
FORMATS = {
    "hermes": _HERMES,
    "glm": Format((HERMES_OPEN,), HERMES_CLOSE, "", _call_from_glm, glm_grammar),
    "deepseek": Format((DS_CALLS_BEGIN + DS_CALL_BEGIN, DS_CALL_BEGIN), DS_CALL_END, DS_CALLS_END,
                       _call_from_deepseek, deepseek_grammar, deepseek_system_text, text_arguments=True),
    "generic": replace(_HERMES, system_text=hermes_system_text, history_as_text=True),
}


def history_arguments_as_text(chat_template: str | None) -> bool:
    """Whether the template takes history calls' arguments as JSON text (DeepSeek's
    concatenates them) rather than objects."""
    fmt = detect_format(chat_template)
    return fmt in FORMATS and FORMATS[fmt].text_arguments


def refuses_system(chat_template: str) -> bool:
    """Whether a chat template raises on a system message, read off its text: it raises
    (`raise_exception`) and names no system role (Mixtral-Instruct's and
    Mistral-Instruct-v0.1's: "Only user and assistant roles are supported!"), or says so
    (Gemma's: "System role not supported")."""
    return "raise_exception" in chat_template and (
        "system" not in chat_template or "System role not supported" in chat_template)


def template_input(messages: list[dict], chat_template: str | None,
                   request: ToolRequest | None) -> tuple[list[dict], list[dict] | None]:
    """The messages and the `tools` variable the chat template is given: for a format
    whose template does not write tools, the offered tools at the end of the first system
    message (one is put first if there is none; `tools` then None) or, for a template
    that refuses a system message (`refuses_system`), at the start of the first user
    message; and for "generic" the history's calls and tool results rewritten as text
    (`_history_text`)."""
    fmt = detect_format(chat_template)
    form = FORMATS.get(fmt) if fmt is not None else None
    if form is not None and form.history_as_text:
        messages = _history_text(messages, tool_role="'tool'" in chat_template or '"tool"' in chat_template)
    if request is None or not request.offered:
        return messages, None
    tools = request.template_tools()
    if form is None or form.system_text is None:
        return messages, tools
    text = form.system_text(tools)
    if refuses_system(chat_template or ""):
        first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if first is None:
            return [{"role": "user", "content": text}, *messages], None
        user = messages[first]
        return [*messages[:first], {**user, "content": text + "\n\n" + (user.get("content") or "")},
                *messages[first + 1:]], None
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]], None
    return [{"role": "system", "content": text}, *messages], None


def _history_text(messages: list[dict], tool_role: bool) -> list[dict]:
    """History calls as `<tool_call>` JSON after the assistant's text (Qwen2.5's layout),
    and, unless the template has a tool role, each run of tool results as one user
    message of `<tool_response>` blocks."""
    out: list[dict] = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            text = m.get("content") or ""
            for k, c in enumerate(m["tool_calls"]):
                fn = c["function"]
                arguments = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(
                    fn["arguments"], ensure_ascii=False)
                text += ("\n" if text or k else "") + (f'{HERMES_OPEN}\n{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, '
                                                        f'"arguments": {arguments or "{}"}}}\n{HERMES_CLOSE}')
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        elif m.get("role") == "tool" and not tool_role:
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
