"""OpenAI's Responses API (`POST /v1/responses`) on the same engine as chat completions.

A Responses request is translated into a chat completions body and parsed by
daemon.api.chat.parse_request, so it has the same limits, errors (OpenAI's shape),
queue, prefix cache, tool calls and reasoning:

- `instructions` -> a system message; `input`: a string (one user message) or items:
  messages (`role` user, assistant, system or developer — a system message — with a
  string or `input_text` / `output_text` parts), `function_call` items (the assistant's
  calls: `call_id`, `name`, `arguments`), `function_call_output` items (a tool message
  per output) and `reasoning` items (their text is the next assistant message's
  reasoning_content); images, files and other items are a 400.
- `tools` [{"type": "function", "name", "description", "parameters"}], `tool_choice`
  ("auto", "none", "required", {"type": "function", "name"}), `parallel_tool_calls`,
  `max_output_tokens`, `temperature`, `top_p`, `stream`, `text.format` ("text",
  "json_object", "json_schema" with `schema`: response_format), `reasoning.effort` (chat
  completions' reasoning_effort: the chat template's variables, docs/api.md; `summary`
  is ignored); `store`, `metadata`, `user` and `truncation` are accepted and have no
  effect (moed keeps no responses: `previous_response_id` is a 400 asking for the whole
  conversation).

The answer: {"id": "resp_...", "object": "response", "status": "completed" or
"incomplete" (incomplete_details.reason "max_output_tokens"), "output": [reasoning?,
message?, function_call...], "usage": {"input_tokens", "input_tokens_details":
{"cached_tokens"}, "output_tokens", "output_tokens_details", "total_tokens"}, and the
request's settings}. Streamed: response.created and response.in_progress, then per output
item response.output_item.added, its deltas (response.output_text.delta with
content_part.added/done around them, response.reasoning_text.delta,
response.function_call_arguments.delta), its .done events and response.output_item.done,
then response.completed (or response.incomplete); each event has a sequence_number.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from daemon.api.chat import bad, function_tools, join_text, reasoning_effort

TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    return join_text(content, where, "input", TEXT_PARTS)


def _messages(body: dict) -> list[dict]:
    """The conversation as chat messages."""
    chat: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("'instructions' must be a string", "instructions")
        chat.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return chat + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    thought = None
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad(f"'input[{i}]' must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
            role = "system" if item["role"] == "developer" else item["role"]
            msg = {"role": role, "content": _text(item.get("content", ""), f"input[{i}].content")}
            if role == "assistant" and thought is not None:
                msg["reasoning_content"], thought = thought, None
            chat.append(msg)
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad(f"'input[{i}]' (function_call) needs string 'call_id', 'name' and "
                          "'arguments'", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if chat and chat[-1]["role"] == "assistant":       # the calls of that answer
                chat[-1].setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if thought is not None:
                    msg["reasoning_content"], thought = thought, None
                chat.append(msg)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"'input[{i}]' (function_call_output) needs a string 'call_id'", "input")
            chat.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text(item.get("output", ""), f"input[{i}].output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if isinstance(parts, list):
                thought = "".join(p.get("text", "") for p in parts if isinstance(p, dict)
                                  and isinstance(p.get("text"), str))
        else:
            raise bad(f"'input[{i}]' of type {str(kind)[:32]!r} is not supported (messages, "
                      "function_call, function_call_output and reasoning items are)", "input")
    return chat


def chat_body(body: Any) -> dict:
    """The chat completions body of a Responses request. Raises ApiError (400) naming the
    field at fault."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise bad("'previous_response_id' is not supported: moed keeps no responses; send the "
                  "whole conversation in 'input'", "previous_response_id")
    out: dict[str, Any] = {"messages": _messages(body), "stream": body.get("stream", False)}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    for key in ("model", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k",
                "cache_salt", "ignore_eos"):
        if body.get(key) is not None:
            out[key] = body[key]

    def function(i: int, t: Any) -> dict:
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(f"'tools[{i}]' of type {str(kind)[:32]!r} is not supported: moed serves "
                      "function tools", "tools")
        return {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
    tools = function_tools(body, function)
    if tools is not None:
        out["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        out["tool_choice"] = choice
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad("'reasoning' must be an object such as {\"effort\": \"low\"}", "reasoning")
        effort = reasoning_effort(reasoning.get("effort"), "reasoning")
        if effort is not None:
            out["reasoning_effort"] = effort
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "answer"), "schema": fmt.get("schema", {})}}
    elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "text"):
        out["response_format"] = {"type": fmt["type"]}
    elif fmt is not None:
        raise bad("'text.format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}", "text")
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(stats) -> dict:
    return {"input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens},
            "output_tokens": stats.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def response(body: dict, request_id: str, model: str, output: list[dict], finish_reason: str | None,
             stats, created: int | None = None, status: str | None = None) -> dict:
    """The response object (status from finish_reason unless given)."""
    if status is None:
        status = "incomplete" if finish_reason == "length" else "completed"
    return {"id": request_id, "object": "response", "created_at": created or int(time.time()),
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": model, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
            "text": body.get("text", {"format": {"type": "text"}}), "metadata": body.get("metadata") or {},
            "usage": usage(stats) if stats is not None else None}


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def output_items(reasoning: str | None, text: str, calls) -> list[dict]:
    out = []
    if reasoning:
        out.append(reasoning_item(new_id("rs"), reasoning))
    if text or not calls:
        out.append(message_item(new_id("msg"), text))
    out += [call_item(new_id("fc"), c) for c in calls]
    return out


class ItemStream:
    """The streamed output items of one answer: `events(kind, value)` for each piece of the
    answer parser gives the events (type, payload without sequence_number), opening and
    closing items as the kind changes; `close()` ends the open one. `items` holds every
    finished item, for the final response."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: str | None = None
        self._id = ""
        self._text: list[str] = []

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        i, text, kind = len(self.items), "".join(self._text), self.open
        self.open = None
        if kind == "content":
            item = message_item(self._id, text)
            part = item["content"][0]
            events = [("response.output_text.done", {"item_id": self._id, "output_index": i,
                                                      "content_index": 0, "text": text, "logprobs": []}),
                      ("response.content_part.done", {"item_id": self._id, "output_index": i,
                                                       "content_index": 0, "part": part})]
        else:
            item = reasoning_item(self._id, text)
            events = [("response.reasoning_text.done", {"item_id": self._id, "output_index": i,
                                                         "content_index": 0, "text": text})]
        self.items.append(item)
        return events + [("response.output_item.done", {"output_index": i, "item": item})]

    def events(self, kind: str, value) -> list[tuple[str, dict]]:
        i = len(self.items)
        if kind == "call":
            out = self._close()
            i = len(self.items)
            item_id = new_id("fc")
            item = call_item(item_id, value)
            self.items.append(item)
            return out + [
                ("response.output_item.added", {"output_index": i, "item": {**item, "arguments": "",
                                                                            "status": "in_progress"}}),
                ("response.function_call_arguments.delta", {"item_id": item_id, "output_index": i,
                                                            "delta": value.arguments}),
                ("response.function_call_arguments.done", {"item_id": item_id, "output_index": i,
                                                           "name": value.name, "arguments": value.arguments}),
                ("response.output_item.done", {"output_index": i, "item": item})]
        if not value:
            return []
        out = []
        if self.open != kind:
            out = self._close()
            i = len(self.items)
            self.open, self._id, self._text = kind, new_id("msg" if kind == "content" else "rs"), []
            if kind == "content":
                added = message_item(self._id, "", "in_progress")
                added["content"] = []
                out += [("response.output_item.added", {"output_index": i, "item": added}),
                        ("response.content_part.added", {"item_id": self._id, "output_index": i,
                                                          "content_index": 0,
                                                          "part": {"type": "output_text", "text": "",
                                                                   "annotations": [], "logprobs": []}})]
            else:
                out.append(("response.output_item.added", {"output_index": i, "item": {
                    "type": "reasoning", "id": self._id, "summary": [], "content": []}}))
        self._text.append(value)
        name = "response.output_text.delta" if kind == "content" else "response.reasoning_text.delta"
        payload = {"item_id": self._id, "output_index": i, "content_index": 0, "delta": value}
        if kind == "content":
            payload["logprobs"] = []
        return out + [(name, payload)]

    def close(self) -> list[tuple[str, dict]]:
        return self._close()
