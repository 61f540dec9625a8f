"""Reasoning and the answer: a chat answer's text split into `reasoning_content` (the
model's thinking), `content` and tool calls, as it streams.

Models that think (Qwen3, QwQ, DeepSeek-R1, GLM-4.5) write their reasoning between
`<think>` and `</think>` before the answer; their chat templates name those tags. When a
model's template does (`thinks`), the text of an answer that opens with `<think>` (after
whitespace) up to `</think>` is reasoning, and so is the start of an answer whose prompt
already ended inside an open `<think>` (templates that open it in the generation prompt,
DeepSeek-R1's). What follows `</think>` is the answer (newlines after the tag dropped),
parsed for tool calls when the request offered tools (daemon/api/tools.py). A request
turns thinking off where the template allows it through chat_template_kwargs
({"enable_thinking": false} for Qwen3's: the prompt then holds an empty think block;
{"thinking": true} for DeepSeek-V3.1's, which is off by default and closes the block in
the prompt, `</think>`, when off), or through reasoning_effort ("none": off; the
variables `effort_variables` sets; the request's own chat_template_kwargs win).
An answer that never closes its `<think>` is all reasoning, as vLLM's and llama-server's
parsers have it. GPT-OSS writes no <think> blocks: its reasoning is harmony's analysis
channel, read by daemon/api/harmony.py.
"""
from __future__ import annotations

from typing import Any

from daemon.api.tools import THINK_CLOSE, CallParser, _prefix_overlap

THINK_OPEN = "<think>"
# OpenAI's reasoning efforts (chat completions' reasoning_effort, the Responses API's
# reasoning.effort), least first
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# harmony's own levels (GPT-OSS's system message "Reasoning: low|medium|high"): it cannot
# stop reasoning, so "none" and "minimal" are its least, "xhigh" its most
HARMONY_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium",
                   "high": "high", "xhigh": "high"}


def effort_variables(effort: str, harmony: bool) -> dict[str, Any]:
    """The chat template variables of a reasoning effort (one of REASONING_EFFORTS):
    `reasoning_effort` (GPT-OSS's template and others that read it; harmony's nearest
    level on a harmony template), and thinking on unless "none", in the variables the
    templates that switch it read: `enable_thinking` (Qwen3's, GLM-4.5's) and `thinking`
    (DeepSeek-V3.1's). A template reading none of them ignores them."""
    return {"reasoning_effort": HARMONY_EFFORTS[effort] if harmony else effort,
            "enable_thinking": effort != "none", "thinking": effort != "none"}


def thinks(chat_template: str | None) -> bool:
    """Does the template write reasoning between <think> and </think>?"""
    return bool(chat_template) and THINK_CLOSE in chat_template


def opens_thinking(prompt_text: str) -> bool:
    """Does the rendered prompt end inside an open <think> block?"""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


class AnswerParser:
    """One choice's text, fed as it streams, as pieces ("reasoning", str), ("content",
    str) and ("call", ToolCall) in order. reasoning: the template thinks; started: the
    prompt left a <think> open; tools: the request offered tools (calls are parsed; a
    CallParser: with it, in its format)."""

    def __init__(self, *, reasoning: bool, started: bool = False, tools: bool | CallParser = False):
        self._state = ("think" if started else "start") if reasoning else "answer"
        self._buf = ""
        self._calls = tools if isinstance(tools, CallParser) else CallParser() if tools else None
        self._after_think = False        # the answer follows a think block: newlines dropped

    @property
    def calls(self) -> int:
        return self._calls.calls if self._calls is not None else 0

    def _answer(self, text: str, final: bool = False) -> list[tuple[str, Any]]:
        if self._after_think:
            text = text.lstrip("\n")
            self._after_think = not text
        if self._calls is None:
            return [("content", text)] if text else []
        return self._calls.feed(text) + (self._calls.finish() if final else [])

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self._state == "start":              # is it a <think> block?
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buf = stripped[len(THINK_OPEN):]
                    self._state = "think"
                elif THINK_OPEN.startswith(stripped):   # not known yet (maybe empty)
                    return out
                else:
                    self._state = "answer"
            elif self._state == "think":
                end = self._buf.find(THINK_CLOSE)
                if end < 0:
                    keep = _prefix_overlap(self._buf, THINK_CLOSE)
                    cut = len(self._buf) - keep
                    if cut:
                        out.append(("reasoning", self._buf[:cut]))
                    self._buf = self._buf[cut:]
                    return out
                if end:
                    out.append(("reasoning", self._buf[:end]))
                self._buf = self._buf[end + len(THINK_CLOSE):]
                self._state = "answer"
                self._after_think = True
            else:
                buf, self._buf = self._buf, ""
                return out + self._answer(buf)

    def finish(self) -> list[tuple[str, Any]]:
        """The rest of the text once the choice has ended."""
        buf, self._buf = self._buf, ""
        if self._state == "think":
            return [("reasoning", buf)] if buf else []
        return self._answer(buf, final=True)


def split_answer(text: str, *, reasoning: bool, started: bool = False,
                 tools: bool | CallParser = False) -> tuple[str | None, str, list]:
    """A whole answer's (reasoning_content or None, content, tool calls)."""
    return split_with(AnswerParser(reasoning=reasoning, started=started, tools=tools), text)


def split_with(parser, text: str) -> tuple[str | None, str, list]:
    """A whole answer's (reasoning_content or None, content, tool calls) read by `parser`
    (a new AnswerParser, or one with its interface: daemon/api/harmony.py's)."""
    pieces = parser.feed(text) + parser.finish()
    thought = [v for k, v in pieces if k == "reasoning"]
    content = "".join(v for k, v in pieces if k == "content")
    calls = [v for k, v in pieces if k == "call"]
    return ("".join(thought).strip("\n") if thought else None,
            content.strip() if calls else content, calls)
