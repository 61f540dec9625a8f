"""One chat-template render process (`python -m daemon.workers.template_worker LIMIT`).

Run by daemon/workers/templates.py. It limits its own address space to LIMIT bytes
(RLIMIT_AS) before it reads anything, says ``{"ready": true}`` on stdout once it has
imported what it needs, then answers requests, one JSON object per line:
on stdin ``{"source": str, "variables": {...}, "max_chars": int, "timeout_s": float}``,
on stdout ``{"text": str}`` or ``{"error": str, "limit": bool}`` (limit: the render was
stopped by a bound, not by a fault of the template). Compiled templates are kept by
source (the last few). It imports only ext.chat_template (jinja2) and the standard
library (and daemon/workers/process.py, the loop shared with the grammar
worker), and writes nothing else anywhere.
"""
from __future__ import annotations

import sys

from daemon.workers.process import limit_memory, serve_lines

OUT_OF_MEMORY = {"error": "the chat template needed more memory than its render may use",
                 "limit": True}


def main(argv: list[str]) -> int:
    limit_memory(int(argv[1]))
    from ext.chat_template import ChatTemplateError, ChatTemplateLimitError, compile_template, render

    compiled: dict[str, object] = {}

    def answer(request: dict) -> dict:
        try:
            template = compiled.get(request["source"])
            if template is None:
                if len(compiled) >= 4:
                    compiled.clear()
                template = compiled[request["source"]] = compile_template(request["source"])
            text = render(template, request["variables"], max_chars=request["max_chars"],
                          timeout_s=request["timeout_s"])
            return {"text": text}
        except ChatTemplateLimitError as e:
            return {"error": str(e), "limit": True}
        except ChatTemplateError as e:
            return {"error": str(e), "limit": False}
        except MemoryError:
            return OUT_OF_MEMORY

    return serve_lines(answer, OUT_OF_MEMORY)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
