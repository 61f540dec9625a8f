"""Anthropic's Messages API (`POST /v1/messages`) on the same engine as chat completions.

A Messages request is translated into a chat completions body and parsed by
daemon.api.chat.parse_request, so it has the same limits, errors (in Anthropic's
shape here), queue, prefix cache, tool calls and reasoning:

- `system` (a string or text blocks) -> a system message; `messages` whose `content` is a
  string or blocks: `text`; `tool_use` (assistant: a call, its `input` the arguments) and
  `tool_result` (user: a tool message per result, before the user's text; `content` a
  string or text blocks, `is_error` said in the text); `thinking` (assistant: its text
  is the message's reasoning_content); other blocks (images, documents) are a 400.
- `max_tokens` (required), `stop_sequences` (at most 4), `temperature`, `top_p`,
  `top_k`, `stream`; `metadata` is accepted and ignored; chat completions' `seed`,
  `ignore_eos` and `cache_salt` as extensions.
- `tools` [{"name", "description", "input_schema"}] and `tool_choice` {"type": "auto" |
  "any" | "tool" (with "name") | "none", "disable_parallel_tool_use"}: "any" and "tool"
  constrain decoding, as "required" and a named function do in chat completions.
- `thinking` {"type": "disabled"} is chat completions' reasoning_effort "none" (thinking
  off where the template switches it: Qwen3's enable_thinking, DeepSeek-V3.1's thinking;
  GPT-OSS's least effort, "Reasoning: low", harmony having no off); {"type": "enabled",
  "budget_tokens"} (at least 1024, below max_tokens: checked, not enforced) and {"type":
  "adaptive"} turn it on (enable_thinking and thinking true) at the template's effort.

The answer: {"id": "msg_...", "type": "message", "role": "assistant", "model",
"content": [thinking?, text?, tool_use...], "stop_reason": "end_turn" | "max_tokens" |
"stop_sequence" | "tool_use", "stop_sequence", "usage": {"input_tokens",
"output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"}}. Streamed:
the events message_start, content_block_start / content_block_delta (text_delta,
thinking_delta, input_json_delta) / content_block_stop per block, message_delta (the
stop reason and output tokens) and message_stop, each as `event: <type>` and `data:
<json>`; an error after the stream began is an `error` event.
"""
from __future__ import annotations

import json
from typing import Any

from daemon.api.chat import ApiError, bad, function_tools, join_text

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error"}
MIN_THINKING_BUDGET = 1024      # Anthropic's least thinking.budget_tokens
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "timeout": "end_turn",
                "cancelled": "end_turn"}


def error_body(e: ApiError) -> dict:
    """An ApiError in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                       "message": e.message}}


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined."""
    return join_text(blocks, where, "messages")


def _message(i: int, m: Any) -> list[dict]:
    """One Messages message as chat messages (a user turn's tool results come first)."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad(f"'messages[{i}]' must be an object whose role is 'user' or 'assistant'", "messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad(f"'messages[{i}].content' must be a string or a list of content blocks", "messages")
    text, calls, results, thought = [], [], [], None
    for k, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        where = f"messages[{i}].content[{k}]"
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad(f"'{where}' (tool_use) needs a string 'name' and an object 'input'", "messages")
            calls.append({"id": str(b.get("id", f"toolu_{i}_{k}")), "type": "function",
                          "function": {"name": b["name"],
                                       "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            body = _text_of(b.get("content", ""), where + ".content")
            if b.get("is_error") is True:
                body = "Error: " + body
            results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")), "content": body})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if isinstance(b.get("thinking"), str):
                thought = (thought or "") + b["thinking"]
        else:
            raise bad(f"'{where}' of type {str(kind)[:32]!r} is not supported in a {role} message "
                      "(moed serves text: text, tool_use, tool_result and thinking blocks)", "messages")
    out = results
    if role == "user" and (text or not results):
        out = out + [{"role": "user", "content": "".join(text)}]
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        if thought is not None:
            msg["reasoning_content"] = thought
        out = out + [msg]
    return out


def _tools(body: dict) -> dict:
    """tools and tool_choice as chat completions takes them."""
    out: dict[str, Any] = {}

    def function(i: int, t: Any) -> dict:
        if (not isinstance(t, dict) or not isinstance(t.get("name"), str)
                or t.get("type", "custom") != "custom"):
            raise bad(f"'tools[{i}]' must be a custom tool {{\"name\", \"description\", "
                      "\"input_schema\"}} (server tools are not served)", "tools")
        fn = {"name": t["name"], "parameters": t.get("input_schema", {"type": "object"})}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        return fn
    tools = function_tools(body, function)
    if tools is not None:
        out["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict):
            raise bad("'tool_choice' must be an object such as {\"type\": \"auto\"}", "tool_choice")
        kind = choice.get("type")
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            mapped = {"type": "function", "function": {"name": choice.get("name")}}
        if mapped is None:
            raise bad("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'", "tool_choice")
        out["tool_choice"] = mapped
        if choice.get("disable_parallel_tool_use") is True:
            out["parallel_tool_calls"] = False
    return out


def _thinking(body: dict) -> dict:
    """`thinking` as chat completions takes it: {"type": "disabled"} is reasoning_effort
    "none"; {"type": "enabled", "budget_tokens": N} (N an integer of at least
    MIN_THINKING_BUDGET and below max_tokens, as Anthropic asks) and {"type": "adaptive"}
    turn the template's thinking on (enable_thinking and thinking true), at its own effort.
    The budget is checked, not enforced: the thinking ends when the model ends it, within
    max_tokens."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                  "{\"type\": \"adaptive\"} or {\"type\": \"disabled\"}", "thinking")
    if kind == "disabled":
        return {"reasoning_effort": "none"}
    budget, cap = thinking.get("budget_tokens"), body["max_tokens"]
    if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int)
                              or budget < MIN_THINKING_BUDGET
                              or (isinstance(cap, int) and budget >= cap)):
        raise bad(f"'thinking.budget_tokens' must be an integer of at least {MIN_THINKING_BUDGET} "
                  f"and less than max_tokens, got {str(budget)[:32]}", "thinking")
    if kind == "adaptive" and budget is not None:
        raise bad("'thinking.budget_tokens' is not taken with {\"type\": \"adaptive\"}", "thinking")
    return {"chat_template_kwargs": {"enable_thinking": True, "thinking": True}}


def chat_body(body: Any) -> dict:
    """The chat completions body of a Messages request. Raises ApiError (400) naming the
    field at fault."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if body.get("max_tokens") is None:
        raise bad("'max_tokens' is required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    chat: list[dict] = []
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(messages):
        chat += _message(i, m)
    out: dict[str, Any] = {"messages": chat, "max_tokens": body["max_tokens"],
                           "stream": body.get("stream", False), **_tools(body)}
    for key in ("temperature", "top_p", "top_k", "model", "seed", "ignore_eos", "cache_salt"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    out.update(_thinking(body))
    return out


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    if finish_reason == "stop":
        return "stop_sequence" if stop_sequence is not None else "end_turn"
    return STOP_REASONS.get(finish_reason or "", "end_turn")


def usage(stats) -> dict:
    """Anthropic's usage: input_tokens are those not read from the cache (a client adds
    cache_read_input_tokens to get the prompt's)."""
    return {"input_tokens": stats.prompt_tokens - stats.cached_tokens,
            "output_tokens": stats.completion_tokens,
            "cache_read_input_tokens": stats.cached_tokens, "cache_creation_input_tokens": 0}


def content_blocks(reasoning: str | None, text: str, calls) -> list[dict]:
    """The answer's content blocks: its thinking, its text, its tool calls."""
    blocks: list[dict] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text:
        blocks.append({"type": "text", "text": text})
    for call in calls:
        blocks.append({"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
                       "input": json.loads(call.arguments)})
    return blocks


def message(request_id: str, model: str, blocks: list[dict], reason: str,
            sequence: str | None, stats) -> dict:
    return {"id": request_id, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(stats)}


class BlockStream:
    """The streamed content blocks of one answer: `events(kind, value)` for each piece of
    the answer parser (daemon/api/reasoning.py) gives the SSE events, opening and
    closing blocks as the kind changes; `close()` ends the open one."""

    KINDS = {"content": ("text", "text_delta", "text"), "reasoning": ("thinking", "thinking_delta", "thinking")}

    def __init__(self):
        self.index = -1                  # the last block's index
        self.open: str | None = None     # the kind of the open block

    def _start(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block})]

    def events(self, kind: str, value) -> list[tuple[str, dict]]:
        if kind == "call":
            return (self._start("call", {"type": "tool_use", "id": "toolu_" + value.id.removeprefix("call_"),
                                         "name": value.name, "input": {}})
                    + [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                "delta": {"type": "input_json_delta",
                                                          "partial_json": value.arguments}})]
                    + self.close())
        if not value:
            return []
        block, delta, field = self.KINDS[kind]
        out = []
        if self.open != kind:
            out = self._start(kind, {"type": block, field: "",
                                     **({"signature": ""} if block == "thinking" else {})})
        out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                            "delta": {"type": delta, field: value}}))
        return out

    def close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]
