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

- "harmony" (GPT-OSS; OpenAI's harmony response format,
  cookbook.openai.com/articles/openai-harmony): a call is an assistant message on the
  commentary channel to `functions.NAME`, `<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...}<|call|>`, one per turn; its answers are read, with
  their analysis channel, by daemon/api/harmony.py.

Other families' formats (DeepSeek-V3's call markers) are not read yet: a request with
tools to a model whose template uses none of the known formats is a 400 saying so.

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
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 128                 # tools of one request
MAX_TOOL_NAME_CHARS = 64        # OpenAI's limit on a function name
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# The JSON a constrained call writes: no whitespace beyond the separators (llguidance's
# default lets a model pad without end), and the separators of the format's own history
# calls (Qwen's templates write json.dumps' ", " and ": "; GLM's tojson the same).
HERMES_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GLM_JSON = HERMES_JSON


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

    def grammar(self) -> str:
        """The Lark grammar (llguidance's dialect) of a constrained choice's output."""
        tools = [t for t in self.tools if self.choice != "function" or t.name == self.name]
        if self.format == "harmony":
            from daemon.api.harmony import harmony_grammar     # (harmony imports this module)
            return harmony_grammar(tools)
        return (glm_grammar if self.format == "glm" else hermes_grammar)(tools, self.parallel)

    def parser(self) -> CallParser:
        """A parser of this request's calls in the model's format."""
        return CallParser(self.tools, self.format)


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches ("hermes", "glm" or "harmony"), or None."""
    if not chat_template or "tools" not in chat_template:
        return None
    if "<|call|>" in chat_template and "<|channel|>" in chat_template:
        return "harmony"
    if "tool▁call" in chat_template:
        return None          # DeepSeek-V3: not read yet
    if "<arg_key>" in chat_template:
        return "glm"
    if HERMES_OPEN in chat_template:
        return "hermes"
    return None


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
        raise ToolError("this model's chat template has no tool-call format moed can read (it "
                        "reads the <tool_call> JSON format of Qwen2.5, Qwen3 and Hermes, "
                        "GLM-4.5's <arg_key>/<arg_value> calls and GPT-OSS's harmony); send "
                        "the request without 'tools'", "tools")
    return ToolRequest(tools, kind, name, parallel, fmt or "hermes")


def _lark_string(text: str) -> str:
    return json.dumps(text)


def hermes_grammar(tools: list[Tool], parallel: bool) -> str:
    """One call (or several, newline-separated, when parallel) of one of `tools`, each
    `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` with the arguments
    following the function's parameters schema."""
    schema = {"anyOf": [{"type": "object",
                         "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                         "required": ["name", "arguments"], "additionalProperties": False}
                        for t in tools],
              "x-guidance": HERMES_JSON}
    calls = 'call ("\\n" call)*' if parallel else "call"
    return (f"start: {calls}\n"
            f"call: {_lark_string(HERMES_OPEN + chr(10))} body {_lark_string(chr(10) + HERMES_CLOSE)}\n"
            f"body: %json {json.dumps(schema, separators=(',', ':'))}\n")


def glm_grammar(tools: list[Tool], parallel: bool) -> str:
    """One call (or several, newline-separated, when parallel) of one of `tools` in
    GLM-4.5's format: its arguments in the order of the parameters' properties, the
    required ones always and the others optional; a string value is text without "<",
    one with an enum one of them, any other value JSON following its schema."""
    nl = _lark_string(chr(10))
    rules = []
    for k, t in enumerate(tools):
        props = t.parameters.get("properties", {}) if isinstance(t.parameters, dict) else {}
        required = set(t.parameters.get("required", [])) if isinstance(t.parameters, dict) else set()
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            value = f"v{k}_{j}"
            if isinstance(schema, dict) and schema.get("type") == "string" and "enum" in schema:
                rules.append(f"{value}: " + " | ".join(_lark_string(str(e)) for e in schema["enum"]))
            elif isinstance(schema, dict) and schema.get("type") == "string":
                rules.append(f"{value}: /[^<]*/")
            else:
                typed = {**schema, "x-guidance": GLM_JSON} if isinstance(schema, dict) else schema
                rules.append(f"{value}: %json {json.dumps(typed, separators=(',', ':'))}")
            arg = (f"{nl} {_lark_string('<arg_key>' + key + '</arg_key>')} "
                   f"{_lark_string(chr(10) + '<arg_value>')} {value} {_lark_string('</arg_value>')}")
            parts.append(arg if key in required else f"({arg})?")
        rules.append(f"f{k}: {_lark_string(t.name)} {' '.join(parts)}")
    calls = f"call ({nl} call)*" if parallel else "call"
    alternatives = " | ".join(f"f{k}" for k in range(len(tools)))
    lines = [f"start: {calls}",
             f"call: {_lark_string(HERMES_OPEN)} ({alternatives}) {_lark_string(chr(10) + HERMES_CLOSE)}",
             *rules]
    return chr(10).join(lines) + chr(10)


def _call_from_glm(body: str, tools: dict[str, Tool]) -> ToolCall | None:
    """A GLM-4.5 call body: the name on its first line, then <arg_key>/<arg_value>
    pairs; a value is kept as text for a string parameter (or one moed does not know),
    else read as JSON (kept as text when it is not)."""
    name, _, rest = body.strip().partition("\n")
    name = name.strip()
    if not name or "<" in name:
        return None
    props = tools[name].parameters.get("properties", {}) if name in tools and isinstance(
        tools[name].parameters, dict) else {}
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
    (hermes, or GLM-4.5's with `tools` telling a string parameter from others).
    `feed(text)` and `finish()` return the pieces now known, in
    order: ("content", str) or ("call", ToolCall). Text that may be the start of a call
    tag is held back until it is known; after the first call, whitespace between calls
    is not content."""

    def __init__(self, tools: tuple[Tool, ...] = (), fmt: str = "hermes"):
        self.open, self.close = HERMES_OPEN, HERMES_CLOSE          # both formats' tags
        self._read = ((lambda body: _call_from_glm(body, {t.name: t for t in tools})) if fmt == "glm"
                      else (lambda body: _call_from_json(body.strip())))
        self._buf = ""
        self._in_call = False
        self._ws = ""                    # whitespace after a call, held (`_content`)
        self.calls = 0

    def _content(self, text: str) -> list[tuple[str, Any]]:
        """After a call, whitespace is held until text follows it (then it goes out with
        the text) or another call or the end does (then it was only the calls' spacing)."""
        if not text:
            return []
        if self.calls and not text.strip():
            self._ws += text
            return []
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
                start = self._buf.find(self.open)
                if start < 0:
                    keep = _prefix_overlap(self._buf, self.open)
                    cut = len(self._buf) - keep
                    out += self._content(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                out += self._content(self._buf[:start])
                self._buf = self._buf[start + len(self.open):]
                self._in_call = True

    def _ended(self, body: str, closed: bool) -> list[tuple[str, Any]]:
        call = self._read(body)
        if call is None:                 # not a call after all: the text as it came
            text, self._ws = self._ws + self.open + body + (self.close if closed else ""), ""
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
