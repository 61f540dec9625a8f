"""One chat-template render process (`python -m daemon.service.template_worker LIMIT`).

Run by daemon/service/templates.py. It limits its own address space to LIMIT bytes
(RLIMIT_AS) before it reads anything, says ``{"ready": true}`` on stdout once it has
imported what it needs, then answers requests, one JSON object per line:
on stdin ``{"source": str, "variables": {...}, "max_chars": int, "timeout_s": float}``,
on stdout ``{"text": str}`` or ``{"error": str, "limit": bool}`` (limit: the render was
stopped by a bound, not by a fault of the template). Compiled templates are kept by
source (the last few). It imports only ext.chat_template (jinja2) and the standard
library, and writes nothing else anywhere.
"""
from __future__ import annotations

import json
import resource
import sys


def main(argv: list[str]) -> int:
    limit = int(argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from ext.chat_template import ChatTemplateError, ChatTemplateLimitError, compile_template, render

    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    compiled: dict[str, object] = {}
    for line in sys.stdin:
        try:
            request = json.loads(line)
            template = compiled.get(request["source"])
            if template is None:
                if len(compiled) >= 4:
                    compiled.clear()
                template = compiled[request["source"]] = compile_template(request["source"])
            text = render(template, request["variables"], max_chars=request["max_chars"],
                          timeout_s=request["timeout_s"])
            answer = {"text": text}
        except ChatTemplateLimitError as e:
            answer = {"error": str(e), "limit": True}
        except ChatTemplateError as e:
            answer = {"error": str(e), "limit": False}
        except MemoryError:
            answer = {"error": "the chat template needed more memory than its render may use",
                      "limit": True}
        except (ValueError, KeyError, TypeError, RecursionError) as e:   # a malformed request
            answer = {"error": f"bad render request: {type(e).__name__}: {e}", "limit": False}
        try:
            out = json.dumps(answer)
        except MemoryError:
            out = json.dumps({"error": "the chat template needed more memory than its render "
                                       "may use", "limit": True})
        sys.stdout.write(out + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
