"""What rendering chat templates in worker processes costs: microseconds per render of a
chat request, in this process (ext.chat_template) against moed serve's bounded workers
(daemon/workers/templates.py), interleaved round by round; JSON on stdout.

    .venv/bin/python bench/template_render.py [--rounds 7] [--renders 200] [--turns 4]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.workers.templates import TemplateWorkers  # noqa: E402
from ext.chat_template import compile_template, render  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--renders", type=int, default=200, help="renders per arm and round")
    ap.add_argument("--turns", type=int, default=4, help="messages per conversation")
    args = ap.parse_args()
    messages = [{"role": "user" if i % 2 == 0 else "assistant",
                 "content": "def fibonacci(n):\n    " * 20} for i in range(args.turns)]
    variables = {"messages": messages, "add_generation_prompt": True, "eos_token": "<|im_end|>"}
    template = compile_template(CHATML)
    pool = TemplateWorkers(max_chars=4 << 20, timeout_s=5.0)
    pool.start()
    arms = {"in_process": lambda: render(template, variables),
            "worker": lambda: pool.render(CHATML, variables)}
    assert arms["in_process"]() == arms["worker"]()
    times: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for _ in range(args.rounds):
            for name, fn in arms.items():
                t0 = time.perf_counter()
                for _ in range(args.renders):
                    fn()
                times[name].append((time.perf_counter() - t0) / args.renders * 1e6)
    finally:
        pool.close()

    def summary(xs):
        return {"median_us": round(statistics.median(xs), 1), "min_us": round(min(xs), 1),
                "max_us": round(max(xs), 1), "runs_us": [round(x, 1) for x in xs]}
    out = {name: summary(xs) for name, xs in times.items()}
    extra = [w - i for w, i in zip(times["worker"], times["in_process"])]
    out["worker_extra_us"] = summary(extra)
    out["prompt_chars"] = len(arms["in_process"]())
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
