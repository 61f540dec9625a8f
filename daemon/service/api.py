"""The OpenAI-compatible request and response shapes of moed's HTTP API.

Parsing turns a JSON body into an `EngineRequest` or raises `ApiError` (status, type,
message, param, code), which the server renders in OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}`. Responses and Server-Sent Event
chunks follow the OpenAI API reference for `/v1/completions` ("text_completion") and
`/v1/chat/completions` ("chat.completion", "chat.completion.chunk").

Defaults follow OpenAI: temperature 1.0, top_p 1.0, n 1; max_tokens 16 for
completions and the configured cap for chat. Extensions accepted as vLLM accepts them:
top_k, ignore_eos, seed. A prompt that leaves no room in the context is a 400 with code
"context_length_exceeded"; max_tokens beyond the room left, or beyond the server's
max_tokens ceiling, is cut to fit (the answer then ends with finish_reason "length"), and
the X-Moed-Max-Tokens header of every answer says the max_tokens in force and what cut it.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from daemon.service.engine import EngineRequest, RequestStats
from ext.sampling import SamplingParamError, SamplingParams
from ext.tokenizer import ChatTemplateError, Tokenizer

COMPLETIONS_MAX_TOKENS_DEFAULT = 16
MAX_STOP_STRINGS = 4


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


def _unsupported(body: dict, chat: bool) -> None:
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad(f"'n' must be 1 (got {n!r}): moed returns one choice per request", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad("'best_of' > 1 is not supported", "best_of")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise bad("'logprobs' is not supported", "logprobs")
    for key in ("tools", "functions"):
        if body.get(key):
            raise bad(f"'{key}' is not supported: moed has no tool calling", key)
    if body.get("tool_choice") not in (None, "none"):
        raise bad("'tool_choice' is not supported: moed has no tool calling", "tool_choice")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise bad(f"'{key}' is not supported (only 0)", key)
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported", "logit_bias")
    if not chat:
        if body.get("echo"):
            raise bad("'echo' is not supported", "echo")
        if body.get("suffix"):
            raise bad("'suffix' is not supported", "suffix")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("'response_format' other than {\"type\": \"text\"} is not supported",
                  "response_format")


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


def _messages(body: dict) -> list[dict]:
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
        out.append({"role": _unicode(role, "messages"), "content": _unicode(content, "messages")})
    return out


def parse_request(body: Any, *, chat: bool, model_names: tuple[str, ...], tokenizer: Tokenizer,
                  stop_ids: frozenset[int], context: int, max_tokens_cap: int,
                  request_timeout_s: float, now: float) -> ParsedRequest:
    """Validate an OpenAI request body and build the engine request.

    body: the decoded JSON. chat: /v1/chat/completions (else /v1/completions).
    model_names: names this daemon answers to (the first is the canonical one).
    context: max_position_embeddings. max_tokens_cap: the configured ceiling.
    now: clock() seconds, for the deadline.
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
        raise ApiError(404, f"the model '{model}' does not exist; this daemon serves "
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
    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p,
                                  top_k=0 if top_k == -1 else top_k, seed=seed)
    except SamplingParamError as e:
        raise bad(str(e), e.field) from None
    default_max = max_tokens_cap if chat else COMPLETIONS_MAX_TOKENS_DEFAULT
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    asked = _integer(body, key, None, low=1)
    max_tokens = min(default_max if asked is None else asked, max_tokens_cap)
    limited_by = "max_tokens" if asked is not None and asked > max_tokens_cap else None
    ignore_eos = _boolean(body, "ignore_eos")
    if chat:
        messages = _messages(body)
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ChatTemplateError as e:
            raise bad(str(e), "messages") from None
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        prompt_param = "messages"
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(_unicode(prompt, "prompt"))
        elif (isinstance(prompt, list) and prompt
              and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            vocab = tokenizer.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise bad(f"'prompt' token ids must be in [0, {vocab})", "prompt")
            prompt_ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise bad("'prompt' as a list of several prompts is not supported: send one per "
                      "request", "prompt")
        else:
            raise bad("'prompt' must be a string or a non-empty list of token ids", "prompt")
        prompt_param = "prompt"
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
        deadline=now + request_timeout_s)
    return ParsedRequest(engine=engine, model=model_names[0], stream=stream,
                         include_usage=include_usage, chat=chat, max_tokens_limited_by=limited_by)


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


# ------------------------------------------------------------------ responses


def usage(stats: RequestStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def _base(req: ParsedRequest, created: int) -> dict:
    return {"id": req.engine.request_id,
            "object": ("chat.completion.chunk" if req.stream else "chat.completion") if req.chat
            else "text_completion",
            "created": created, "model": req.model}


def full_response(req: ParsedRequest, text: str, finish_reason: str, stats: RequestStats,
                  created: int | None = None) -> dict:
    """The non-streaming answer: one choice and `usage`."""
    out = _base(req, created or int(time.time()))
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    out["choices"] = [choice]
    out["usage"] = usage(stats)
    return out


def chunk(req: ParsedRequest, created: int, *, text: str | None = None, role: bool = False,
          finish_reason: str | None = None, stats: RequestStats | None = None) -> dict:
    """One Server-Sent Event payload of a streamed answer.

    role: the chat's first chunk (delta {"role": "assistant", "content": ""}).
    stats: the usage chunk (choices empty), sent when stream_options.include_usage.
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
        elif text:
            delta = {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    out["choices"] = [choice]
    if req.include_usage:
        out["usage"] = None
    return out
