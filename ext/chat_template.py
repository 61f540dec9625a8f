"""Chat templates: compiled and rendered as transformers does, within an output and time
bound.

A chat template is Jinja code shipped in the model directory. It renders in
`jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`
with the `loopcontrols` extension, a `{% generation %}` block that renders its body, a
`tojson` filter that does not escape HTML (`json.dumps(..., ensure_ascii=False)`), and
the globals `raise_exception` and `strftime_now` — as in
`transformers.utils.chat_template_utils`.

The sandbox bounds what a template may reach (attributes, ranges of at most 100 000),
not how much it renders or for how long. `render` streams the output
(`Template.generate`) and stops with `ChatTemplateLimitError` as soon as it holds more
than `max_chars` characters or has taken longer than `timeout_s`; both are checked
between the pieces Jinja yields, so one expression that builds a huge string in a single
step (``{{ "x" * 10**9 }}``) is bounded only by the memory of the process it runs in.
The daemon therefore renders in worker processes with an address-space limit
(daemon/workers/templates.py), where that ends as a MemoryError, reported here as a
`ChatTemplateLimitError` too. This module imports only jinja2 and the standard library,
so such a worker stays small.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_MAX_CHARS = 4 << 20       # characters one render may produce
DEFAULT_TIMEOUT_S = 5.0           # seconds one render may take


class ChatTemplateError(ValueError):
    """A chat template is missing, does not compile, or raised while rendering."""


class ChatTemplateLimitError(ChatTemplateError):
    """A chat template rendered more text, took longer or needed more memory than allowed."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged.

    transformers uses this tag to mark assistant tokens for training masks; for
    inference only the text matters.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template. Raises ChatTemplateError when it does not compile."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render(template: jinja2.Template, variables: dict[str, Any], *,
           max_chars: int = DEFAULT_MAX_CHARS, timeout_s: float = DEFAULT_TIMEOUT_S,
           clock: Callable[[], float] = time.monotonic) -> str:
    """Render `template` with `variables`; the text.

    max_chars: the most characters the result may hold. timeout_s: the most seconds the
    render may take (by `clock`, monotonic seconds). Raises ChatTemplateLimitError when
    either is exceeded (or memory runs out), ChatTemplateError when the template calls
    raise_exception or fails while rendering (a template is code from the model
    directory: any failure inside it is the template's fault, never a crash).
    """
    deadline = clock() + timeout_s
    parts: list[str] = []
    size = 0
    try:
        for part in template.generate(**variables):
            size += len(part)
            if size > max_chars:
                raise ChatTemplateLimitError(
                    f"the chat template rendered more than {max_chars} characters "
                    "(chat_template_max_chars)")
            if clock() > deadline:
                raise ChatTemplateLimitError(
                    f"the chat template took longer than {timeout_s:g} s to render "
                    "(chat_template_timeout_s)")
            parts.append(part)
    except ChatTemplateError:
        raise
    except MemoryError:
        parts.clear()
        raise ChatTemplateLimitError("the chat template needed more memory than its render "
                                     "may use") from None
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError,
            AttributeError) as exc:
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    return "".join(parts)
