"""The OpenAI-compatible request and response shapes of moed's HTTP API.

Parsing turns a JSON body into an `EngineRequest` or raises `ApiError` (status, type,
message, param, code), which the server renders in OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}`. Responses and Server-Sent Event
chunks follow the OpenAI API reference for `/v1/completions` ("text_completion") and
`/v1/chat/completions` ("chat.completion", "chat.completion.chunk").

Defaults follow OpenAI: temperature 1.0, top_p 1.0, n 1; max_tokens 16 for
completions and the configured cap for chat. Accepted as OpenAI documents them: n (the
choices decode as a batch from one prefill; with a seed, choice i samples with seed + i,
as vLLM does), logprobs (completions: an integer of alternatives, 0-20; chat: a boolean
with top_logprobs 0-20; log-probabilities of the model's own distribution, streamed
too), presence_penalty and frequency_penalty (-2..2, over the tokens generated so far),
logit_bias (token id -> -100..100), response_format {"type": "text" | "json_object" |
"json_schema"} (constrained decoding, daemon/workers/grammar.py), reasoning_effort (one of
REASONING_EFFORTS: chat template variables, daemon/api/reasoning.effort_variables, under
the request's own chat_template_kwargs). Extensions accepted as
vLLM accepts them: top_k, ignore_eos, seed, cache_salt (a string of 1 to
MAX_CACHE_SALT_CHARS characters: only requests of the same cache_salt share prefix cache
blocks, daemon/engine/prefix_cache.py). A prompt that leaves no room in the context
is a 400 with code "context_length_exceeded" — refused before it is tokenized when its
length in bytes already proves it; max_tokens beyond the room left, or beyond the
server's max_tokens ceiling, is cut to fit (the answer then ends with finish_reason
"length"), and the X-Moed-Max-Tokens header of every answer says the max_tokens in force
and what cut it. Chat takes tools, tool_choice and parallel_tool_calls (assistant
messages with tool_calls and tool messages in the history; the answer's calls parsed into
tool_calls, finish_reason "tool_calls": daemon/api/tools.py; a GPT-OSS answer's harmony
channels read into reasoning_content, content and tool_calls: daemon/api/harmony.py).
What stays unsupported (best_of > 1, functions and function_call, echo, suffix) is a 400
naming the field.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.engine.engine import EngineRequest, RequestStats
from daemon.api.harmony import HarmonyParser, harmony_grammar, harmony_json_grammar, is_harmony
from daemon.api.reasoning import (REASONING_EFFORTS, AnswerParser, effort_variables, opens_thinking,
                                  split_with, thinks)
from daemon.api.tools import (ToolCall, ToolError, ToolRequest, history_arguments_as_text, parse_tools,
                              template_input)
from ext.sampling import SamplingParamError, SamplingParams
from ext.tokenizer import ChatTemplateError, Tokenizer

COMPLETIONS_MAX_TOKENS_DEFAULT = 16
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 256
LONG_TEXT_CHARS = 1 << 14       # tokenized with the GIL released (Tokenizer.encode_long)


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: what to run and how to answer it."""

    engine: EngineRequest
    model: str
    stream: bool
    include_usage: bool
    chat: bool
    # Why max_tokens is smaller than the request asked (None: it is not): "context" (the
    # prompt leaves only that many tokens of the model's context) or "max_tokens" (the
    # server's ceiling, configuration key max_tokens). Said in the X-Moed-Max-Tokens header.
    max_tokens_limited_by: str | None = None
    # response_format's grammar (a daemon.workers.grammar.GrammarSpec), None for text: the
    # caller compiles it (Grammars.compile, bounded, on the event loop) and sets
    # engine.constraint before it submits the request.
    grammar: object | None = None
    grammar_param: str = "response_format"      # the field a grammar error names
    # The tools offered (daemon/api/tools.py): the answer's text is parsed into
    # tool_calls. None: no tools, or tool_choice "none".
    tools: ToolRequest | None = None
    # The model's template writes reasoning in <think> blocks (daemon/api/reasoning.py):
    # the answer's thinking goes to reasoning_content; reasoning_started: the prompt left
    # one open.
    reasoning: bool = False
    reasoning_started: bool = False
    # The model answers in GPT-OSS's harmony (daemon/api/harmony.py): its channels are
    # reasoning, content and calls; the engine writes its special tokens as text.
    harmony: bool = False

    @property
    def parses_answer(self) -> bool:
        """Whether a choice's text is split into reasoning, content and tool calls."""
        return self.tools is not None or self.reasoning or self.harmony

    def answer_parser(self) -> AnswerParser | HarmonyParser | None:
        """A parser of one choice's text (reasoning, content, tool calls), or None when
        the text is all content."""
        if not self.parses_answer:
            return None
        if self.harmony:
            return HarmonyParser(tools=[t.name for t in self.tools.tools] if self.tools is not None else ())
        return AnswerParser(reasoning=self.reasoning, started=self.reasoning_started,
                            tools=self.tools.parser() if self.tools is not None else False)

    def split_answer(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        """A whole choice's (reasoning_content or None, content, tool calls)."""
        parser = self.answer_parser()
        return (None, text, []) if parser is None else split_with(parser, text)

    @property
    def logprobs(self) -> bool:
        return self.engine.logprobs is not None


def _number(body: dict, key: str, default: float, *, low: float, high: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{key}' must be a number, got {type(value).__name__}", key)
    if not low <= value <= high:
        raise bad(f"'{key}' must be in [{low}, {high}], got {value}", key)
    return float(value)


def _integer(body: dict, key: str, default: int | None, *, low: int) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{key}' must be an integer, got {type(value).__name__}", key)
    if value < low:
        raise bad(f"'{key}' must be >= {low}, got {value}", key)
    return value


def _boolean(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{key}' must be a boolean, got {type(value).__name__}", key)
    return value


def _cache_salt(body: dict) -> str | None:
    """The request's cache_salt: None when absent or null, else a non-empty string of at
    most MAX_CACHE_SALT_CHARS characters (ApiError otherwise)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise bad(f"'cache_salt' must be a string, got {type(salt).__name__}", "cache_salt")
    if not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad(f"'cache_salt' must be 1 to {MAX_CACHE_SALT_CHARS} characters, got "
                  f"{len(salt)}", "cache_salt")
    return _unicode(salt, "cache_salt")


def _unsupported(body: dict, chat: bool) -> None:
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad("'best_of' > 1 is not supported", "best_of")
    for key in ("functions", "function_call"):          # deprecated by OpenAI for tools
        if body.get(key) is not None:
            raise bad(f"'{key}' is not supported: send 'tools' and 'tool_choice'", key)
    if not chat:
        for key in ("tools", "tool_choice"):
            if body.get(key) is not None:
                raise bad(f"'{key}' is only for /v1/chat/completions", key)
        if body.get("echo"):
            raise bad("'echo' is not supported", "echo")
        if body.get("suffix"):
            raise bad("'suffix' is not supported", "suffix")


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives to return beside each token's log-probability, or None."""
    if chat:
        wanted = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", None, low=0)
        if top is not None and top > MAX_LOGPROBS:
            raise bad(f"'top_logprobs' must be <= {MAX_LOGPROBS}, got {top}", "top_logprobs")
        if top is not None and not wanted:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if wanted else None
    top = _integer(body, "logprobs", None, low=0)
    if top is not None and top > MAX_LOGPROBS:
        raise bad(f"'logprobs' must be <= {MAX_LOGPROBS}, got {top}", "logprobs")
    return top


def clip(text: str, limit: int = 20) -> str:
    """`text` cut to `limit` characters (with "..." when cut), for echoing client input."""
    return text if len(text) <= limit else text[:limit] + "..."


def _logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    out = []
    for key, value in bias.items():
        # A key is a client's string of any length: at most 20 characters of it go back.
        try:
            if len(key) > 20 or not key.strip().lstrip("+-").isdecimal():
                raise ValueError(key)
            token = int(key)
        except ValueError:
            raise bad(f"'logit_bias' key {clip(key)!r} is not a token id", "logit_bias") from None
        if not 0 <= token < vocab:
            raise bad(f"'logit_bias' token id {token} is not in [0, {vocab})", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100], got "
                      f"{clip(repr(value))}", "logit_bias")
        out.append((token, float(value)))
    return tuple(sorted(out))


def _constraint(body: dict, grammars, harmony: bool = False):
    """response_format's GrammarSpec, or None for text; harmony: the JSON framed as the
    answer's final message (daemon/api/harmony.py)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad("'response_format' must be an object such as {\"type\": \"json_object\"}",
                  "response_format")
    if fmt.get("type") == "text":
        return None
    if grammars is None:
        raise bad("'response_format' other than text is not available: the grammar library "
                  "could not be loaded for this tokenizer", "response_format")
    try:
        # compiled by the caller, out of this thread
        return grammars.spec(fmt, harmony_json_grammar if harmony else None)
    except ValueError as e:
        raise bad(str(e), "response_format") from None


def _unicode(text: str, param: str) -> str:
    """`text` if it is valid Unicode (no lone surrogates, which JSON can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"'{param}' holds a lone UTF-16 surrogate: not valid Unicode text", param) from None
    return text


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    return tuple(_unicode(s, "stop") for s in stop if s)


def join_text(content: Any, where: str, param: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A string, or a list of text parts ({"type": one of kinds, "text": str}) joined.
    Raises ApiError (400) naming `where` and `param` for anything else (images, files:
    moed serves text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or a list of text parts", param)
    out = []
    for k, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in kinds and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(f"'{where}[{k}]' of type {str(kind)[:32]!r} is not supported here: moed serves "
                      f"text ({', '.join(kinds)} parts)", param)
        out.append(part["text"])
    return "".join(out)


def function_tools(body: dict, function: Callable[[int, Any], dict]) -> list[dict] | None:
    """A request's `tools` (None when absent) as chat completions' function tools, each
    entry turned into {"name", "description", "parameters"} by function(index, entry)
    (which raises ApiError for one it cannot serve)."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    return [{"type": "function", "function": function(i, t)} for i, t in enumerate(tools)]


def _history_calls(i: int, calls: Any, text_arguments: bool = False) -> list[dict]:
    """An assistant message's tool_calls, for the template: OpenAI's shape, with the
    arguments as an object where they are JSON text of one (templates write objects with
    tojson; transformers' documentation asks for them so), else the text; always the
    text with text_arguments (a template that concatenates them: DeepSeek's)."""
    if not isinstance(calls, list):
        raise bad(f"'messages[{i}].tool_calls' must be a list", "messages")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", ""), str)):
            raise bad(f"'messages[{i}].tool_calls[{k}]' must be {{\"id\", \"type\": \"function\", "
                      "\"function\": {\"name\": ..., \"arguments\": \"<JSON text>\"}}", "messages")
        arguments: Any = _unicode(fn.get("arguments", ""), "messages")
        try:
            parsed = json.loads(arguments) if arguments else {}
            if isinstance(parsed, dict) and not text_arguments:
                arguments = parsed
        except (ValueError, RecursionError):      # kept as the text it is
            pass
        entry = {"type": "function", "function": {"name": _unicode(fn["name"], "messages"),
                                                  "arguments": arguments}}
        if isinstance(c.get("id"), str):
            entry["id"] = c["id"]
        out.append(entry)
    return out


MAX_TEMPLATE_KWARGS = 16
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


def _template_kwargs(body: dict) -> dict[str, Any]:
    """chat_template_kwargs (as vLLM and llama-server take them): extra variables of the
    chat template, such as {"enable_thinking": false}; at most MAX_TEMPLATE_KWARGS, names
    that are not the template's own variables, values JSON scalars."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise bad(f"'chat_template_kwargs' must be an object of at most {MAX_TEMPLATE_KWARGS} "
                  "variables", "chat_template_kwargs")
    for name, value in kwargs.items():
        if name in RESERVED_TEMPLATE_VARIABLES or not name.isidentifier():
            raise bad(f"'chat_template_kwargs' cannot set '{clip(name)}'", "chat_template_kwargs")
        if not (value is None or isinstance(value, (bool, int, float))
                or (isinstance(value, str) and len(value) <= 256)):
            raise bad(f"'chat_template_kwargs.{name}' must be a boolean, a number, null or a "
                      "string of at most 256 characters", "chat_template_kwargs")
        if isinstance(value, str):
            _unicode(value, "chat_template_kwargs")
    return dict(kwargs)


def reasoning_effort(value: Any, param: str = "reasoning_effort") -> str | None:
    """A reasoning effort (OpenAI's values, REASONING_EFFORTS) or None; ApiError (400)
    naming `param` for anything else."""
    if value is None or value in REASONING_EFFORTS:
        return value
    raise bad(f"'{param}' must be one of {', '.join(map(repr, REASONING_EFFORTS))}, got "
              f"{clip(repr(value))}", param)


def _messages(body: dict, text_arguments: bool = False) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"'messages[{i}]' must be an object", "messages")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise bad(f"'messages[{i}].role' must be a non-empty string", "messages")
        extra: dict[str, Any] = {}
        if role == "assistant" and m.get("tool_calls"):
            extra["tool_calls"] = _history_calls(i, m["tool_calls"], text_arguments)
        if role == "assistant" and m.get("reasoning_content") is not None:
            if not isinstance(m["reasoning_content"], str):
                raise bad(f"'messages[{i}].reasoning_content' must be a string", "messages")
            extra["reasoning_content"] = _unicode(m["reasoning_content"], "messages")
            extra["thinking"] = extra["reasoning_content"]     # harmony templates' name for it
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise bad(f"'messages[{i}].{key}' must be a string", "messages")
                    extra[key] = _unicode(m[key], "messages")
        if isinstance(content, list):        # content parts: only text is understood
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad(f"'messages[{i}].content' parts must be {{\"type\": \"text\", "
                              "\"text\": ...}}: moed serves text-only models", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"'messages[{i}].content' must be a string or a list of text parts", "messages")
        out.append({"role": _unicode(role, "messages"), "content": _unicode(content, "messages"),
                    **extra})
    return out


def _tool_request(body: dict, tokenizer: Tokenizer) -> ToolRequest | None:
    try:
        return parse_tools(body, tokenizer.chat_template)
    except ToolError as e:
        raise bad(str(e), e.param) from None


def render_chat(body: dict, tokenizer: Tokenizer, tool_req: ToolRequest | None) -> str:
    """The prompt text of a chat request: its messages (and the tools offered, and its
    chat_template_kwargs) through the model's chat template, with the generation prompt.
    Raises ApiError (400) naming the field at fault."""
    messages = _messages(body, history_arguments_as_text(tokenizer.chat_template))
    effort = reasoning_effort(body.get("reasoning_effort"))
    # chat_template_kwargs name the template's own variables: where one sets a variable
    # the effort would, it wins (as in vLLM)
    extra = {**(effort_variables(effort, is_harmony(tokenizer.chat_template)) if effort else {}),
             **_template_kwargs(body)}
    messages, tools = template_input(messages, tokenizer.chat_template, tool_req)
    if tools is not None:
        extra["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    except ChatTemplateError as e:
        raise bad(str(e), "messages") from None
    # each field is checked where it is read, naming it; this catches what a template
    # prints from anywhere else, before the tokenizer would fail on it (a 500)
    return _unicode(text, "messages")


def apply_template(body: Any, tokenizer: Tokenizer) -> dict:
    """POST /apply-template as llama-server answers it: a chat request's body (messages,
    tools, tool_choice, chat_template_kwargs) -> {"prompt": the text the model would be
    given}. Raises ApiError (400) naming the field at fault."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return {"prompt": render_chat(body, tokenizer, _tool_request(body, tokenizer))}


def parse_request(body: Any, *, chat: bool, model_names: tuple[str, ...], tokenizer: Tokenizer,
                  stop_ids: frozenset[int], context: int, max_tokens_cap: int,
                  request_timeout_s: float, now: float, grammars=None,
                  max_n: int = 1) -> ParsedRequest:
    """Validate an OpenAI request body and build the engine request.

    body: the decoded JSON. chat: /v1/chat/completions (else /v1/completions).
    model_names: names this daemon answers to (the first is the canonical one).
    context: max_position_embeddings. max_tokens_cap: the configured ceiling.
    now: clock() seconds, for the deadline. grammars: a daemon.workers.grammar.Grammars
    for response_format (None: only "text" is accepted); its schema is only checked here,
    the caller compiles `ParsedRequest.grammar`. max_n: the most choices a
    request may ask for (max_concurrent_sequences).
    Raises ApiError (400 for a bad field or a prompt too long, naming the param; 404 for
    an unknown model).
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = model_names[0]
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model not in model_names:
        raise ApiError(404, f"the model '{clip(model, 64)}' does not exist; this daemon serves "
                            f"'{model_names[0]}'", type="invalid_request_error", param="model",
                       code="model_not_found")
    _unsupported(body, chat)
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    if options and not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    temperature = _number(body, "temperature", 1.0, low=0.0, high=2.0)
    top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise bad("'top_p' must be > 0", "top_p")
    top_k = _integer(body, "top_k", 0, low=-1)
    seed = _integer(body, "seed", None, low=0)
    n = _integer(body, "n", 1, low=1)
    if n > max_n:
        raise bad(f"'n' must be <= {max_n} (max_concurrent_sequences: the choices decode "
                  f"together), got {n}", "n")
    top_logprobs = _logprobs(body, chat)
    try:
        sampling = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=0 if top_k == -1 else top_k, seed=seed,
            presence_penalty=_number(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
            logit_bias=_logit_bias(body, tokenizer.vocab_size))
    except SamplingParamError as e:
        raise bad(str(e), e.field) from None
    harmony = chat and is_harmony(tokenizer.chat_template)
    constraint = _constraint(body, grammars, harmony)
    grammar_param = "response_format"
    tool_req = _tool_request(body, tokenizer) if chat else None
    if tool_req is not None and tool_req.constrained:
        if constraint is not None:
            raise bad("'tool_choice' that requires a call cannot be combined with a "
                      "'response_format' other than text", "tool_choice")
        if grammars is None:
            raise bad("'tool_choice' that requires a call is not available: the grammar library "
                      "could not be loaded for this tokenizer", "tool_choice")
        grammar_param = "tools"         # its grammar once the prompt is known (it may open thinking)
    default_max = max_tokens_cap if chat else COMPLETIONS_MAX_TOKENS_DEFAULT
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    asked = _integer(body, key, None, low=1)
    max_tokens = min(default_max if asked is None else asked, max_tokens_cap)
    limited_by = "max_tokens" if asked is not None and asked > max_tokens_cap else None
    ignore_eos = _boolean(body, "ignore_eos")
    cache_salt = _cache_salt(body)
    if chat:
        text = render_chat(body, tokenizer, tool_req)
        _refuse_untokenized(tokenizer, text, context, "messages")
        prompt_ids = _encode(tokenizer, text, add_special_tokens=False)
        prompt_param = "messages"
        reasoning = thinks(tokenizer.chat_template)
        reasoning_started = reasoning and opens_thinking(text)
        if tool_req is not None and tool_req.constrained:
            try:
                constraint = grammars.spec_lark(
                    harmony_grammar(tool_req.chosen()) if tool_req.format == "harmony"
                    else tool_req.grammar(tokenizer.added_tokens, reasoning_started))
            except ValueError as e:
                raise bad(f"the tools' parameters cannot be used: {e}", "tools") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            _refuse_untokenized(tokenizer, prompt, context, "prompt")
            prompt_ids = _encode(tokenizer, _unicode(prompt, "prompt"))
        elif (isinstance(prompt, list) and prompt
              and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            vocab = tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise bad(f"'prompt' token ids must be in [0, {vocab})", "prompt")
            prompt_ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(t, str) for t in prompt):
            raise bad("'prompt' as a list of several prompts is not supported: send one per "
                      "request", "prompt")
        elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            ids = prompt[0] if len(prompt) == 1 and isinstance(prompt[0], list) else prompt
            where = "prompt[0] " if ids is not prompt else ""
            at = next((i for i, t in enumerate(ids) if not isinstance(t, int) or isinstance(t, bool)), None)
            if at is None:
                raise bad("'prompt' as a list of token-id lists is not supported: send the ids "
                          "as one flat list", "prompt")
            raise bad(f"'prompt' token ids must be integers; {where}item {at} is "
                      f"{clip(repr(ids[at]))}", "prompt")
        else:
            raise bad("'prompt' must be a string or a non-empty list of token ids", "prompt")
        prompt_param = "prompt"
        reasoning = reasoning_started = False
    if not prompt_ids:
        raise bad("the prompt is empty", prompt_param)
    if len(prompt_ids) >= context:
        raise bad(f"the prompt is {len(prompt_ids)} tokens; this model's context is {context} "
                  "tokens and one must be left for the answer", prompt_param,
                  code="context_length_exceeded")
    if max_tokens > context - len(prompt_ids):
        max_tokens = context - len(prompt_ids)
        limited_by = "context" if asked is not None or chat else None
    engine = EngineRequest(
        request_id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
        prompt_ids=tuple(prompt_ids), max_tokens=max_tokens, sampling=sampling,
        stop_ids=frozenset() if ignore_eos else stop_ids, stop_strings=_stop_strings(body),
        deadline=now + request_timeout_s, n=n, logprobs=top_logprobs, cache_salt=cache_salt,
        special_tokens=harmony)
    return ParsedRequest(engine=engine, model=model_names[0], stream=stream,
                         include_usage=include_usage, chat=chat, max_tokens_limited_by=limited_by,
                         grammar=constraint, grammar_param=grammar_param,
                         tools=tool_req if tool_req is not None and tool_req.offered else None,
                         reasoning=reasoning, reasoning_started=reasoning_started, harmony=harmony)


def max_tokens_header(req: ParsedRequest, context: int, cap: int) -> dict[str, str]:
    """`X-Moed-Max-Tokens`: the max_tokens in force and, when it is smaller than asked,
    what limited it ("1023; limited by the context: 4096 tokens, 3073 of them the prompt")."""
    n = req.engine.max_tokens
    if req.max_tokens_limited_by == "context":
        why = (f"; limited by the context: {context} tokens, {len(req.engine.prompt_ids)} of "
               "them the prompt")
    elif req.max_tokens_limited_by == "max_tokens":
        why = f"; limited by the server's max_tokens ceiling ({cap})"
    else:
        why = ""
    return {"X-Moed-Max-Tokens": f"{n}{why}"}


def _refuse_untokenized(tokenizer: Tokenizer, text: str, context: int, param: str) -> None:
    """400 before tokenizing when the text's byte length alone proves it too long."""
    at_least = tokenizer.min_tokens(text)
    if at_least >= context:
        raise bad(f"the prompt is at least {at_least} tokens ({len(text.encode('utf-8', 'replace'))}"
                  f" bytes); this model's context is {context} tokens", param,
                  code="context_length_exceeded")


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    if len(text) > LONG_TEXT_CHARS:
        return tokenizer.encode_long(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


# ------------------------------------------------------------------ responses


def usage(stats: RequestStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


class LogprobFormatter:
    """OpenAI's logprobs objects for one choice, built token by token (the offsets of a
    completion's tokens run on across the chunks of a stream)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat
        self.offset = 0

    def _entry(self, token: int, logprob: float) -> dict:
        text, raw = self.tokenizer.token_piece(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def format(self, entries) -> dict:
        """entries: daemon.engine.engine.TokenLogprob, in order."""
        if self.chat:
            content = []
            for e in entries:
                item = self._entry(e.token, e.logprob)
                item["top_logprobs"] = [self._entry(t, lp) for t, lp in e.top]
                content.append(item)
            return {"content": content, "refusal": None}
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text, _ = self.tokenizer.token_piece(e.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            top: dict = {}
            for t, lp in e.top:
                top.setdefault(self.tokenizer.token_piece(t)[0], lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


@dataclass
class Choice:
    """One choice of a finished answer: its text, finish_reason and logprobs object, and
    the tool calls parsed out of its text (chat with tools)."""

    text: str
    finish_reason: str | None
    logprobs: dict | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None
    stop_string: str | None = None         # the stop string that ended it, if one did


def _base(req: ParsedRequest, created: int) -> dict:
    return {"id": req.engine.request_id,
            "object": ("chat.completion.chunk" if req.stream else "chat.completion") if req.chat
            else "text_completion",
            "created": created, "model": req.model}


def full_response(req: ParsedRequest, choices: list[Choice], stats: RequestStats,
                  created: int | None = None) -> dict:
    """The non-streaming answer: every choice, in index order, and `usage`."""
    out = _base(req, created or int(time.time()))
    out["choices"] = []
    for i, c in enumerate(choices):
        if req.chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if c.reasoning is not None:
                message["reasoning_content"] = c.reasoning
            if c.tool_calls:
                message["content"] = c.text or None
                message["tool_calls"] = [call.message_entry() for call in c.tool_calls]
            choice = {"index": i, "message": message, "logprobs": c.logprobs,
                      "finish_reason": c.finish_reason}
        else:
            choice = {"index": i, "text": c.text, "logprobs": c.logprobs,
                      "finish_reason": c.finish_reason}
        out["choices"].append(choice)
    out["usage"] = usage(stats)
    return out


def chunk(req: ParsedRequest, created: int, *, text: str | None = None, role: bool = False,
          finish_reason: str | None = None, stats: RequestStats | None = None, index: int = 0,
          logprobs: dict | None = None, tool_call: tuple[int, ToolCall] | None = None,
          reasoning: str | None = None) -> dict:
    """One Server-Sent Event payload of a streamed answer, for choice `index`.

    role: the chat's first chunk (delta {"role": "assistant", "content": ""}).
    stats: the usage chunk (choices empty), sent when stream_options.include_usage.
    logprobs: the logprobs object of this chunk's tokens.
    tool_call: (its index in the choice's calls, the call): a delta of the whole call,
    id, name and arguments at once (a client adds the deltas of one index up).
    reasoning: text of the model's thinking (delta {"reasoning_content": ...}).
    """
    out = _base(req, created)
    if stats is not None:
        out["choices"] = []
        out["usage"] = usage(stats)
        return out
    if req.chat:
        delta: dict = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": text}
        elif reasoning:
            delta = {"reasoning_content": reasoning}
        elif tool_call is not None:
            k, call = tool_call
            delta = {"tool_calls": [{"index": k, **call.message_entry()}]}
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}
    out["choices"] = [choice]
    if req.include_usage:
        out["usage"] = None
    return out


def tokenize(body: Any, tokenizer: Tokenizer) -> dict:
    """POST /tokenize as llama-server answers it: {"content", "add_special",
    "with_pieces"} -> {"tokens": [ids]} or, with_pieces, {"tokens": [{"id", "piece"}]}
    (piece a string, or a list of byte values when it is not valid UTF-8 alone)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    content = body.get("content")
    if not isinstance(content, str):
        raise bad("'content' must be a string", "content")
    ids = _encode(tokenizer, _unicode(content, "content"),
                  add_special_tokens=_boolean(body, "add_special"))
    if not _boolean(body, "with_pieces"):
        return {"tokens": ids}
    pieces = []
    for t in ids:
        text, raw = tokenizer.token_piece(t)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": t, "piece": piece})
    return {"tokens": pieces}


def detokenize(body: Any, tokenizer: Tokenizer) -> dict:
    """POST /detokenize as llama-server answers it: {"tokens": [ids]} -> {"content"}."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    tokens = body.get("tokens")
    vocab = tokenizer.vocab_size
    if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                             and 0 <= t < vocab for t in tokens)):
        raise bad(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
    return {"content": tokenizer.decode(tokens, skip_special_tokens=False)}
