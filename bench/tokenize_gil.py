"""Does tokenizing a long prompt stall the daemon's other threads (the engine's Python
between kernels)? `Tokenizer.encode` (tokenizers' `encode`, which holds the GIL) against
`Tokenizer.encode_long` (its `encode_batch`, which releases it), on a ~1 MB text.

A second thread wakes every millisecond; the worst gap between its wake-ups while the
text is tokenized is what an engine step would have waited. Interleaved repeats; JSON.

    python bench/tokenize_gil.py [--model DIR] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from served import spread

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _probe(fn, text: str) -> tuple[float, float]:
    stop, gaps = threading.Event(), []

    def spin():
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            time.sleep(0.001)
    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    fn(text)
    took = time.perf_counter() - t0
    stop.set()
    t.join()
    return took, max(gaps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="model directory (default: the embedded one)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from daemon.service.config import resolve_model_alias
    from ext.tokenizer import Tokenizer
    tok = Tokenizer.from_model_dir(resolve_model_alias(args.model))
    text = " ".join(f"word{i % 977} x" for i in range(100_000))
    out = {"encode": {"seconds": [], "worst_gap_s": []}, "encode_long": {"seconds": [], "worst_gap_s": []}}
    for _ in range(args.repeats):
        for name in out:
            took, gap = _probe(getattr(tok, name), text)
            out[name]["seconds"].append(took)
            out[name]["worst_gap_s"].append(gap)
    print(json.dumps({"text_bytes": len(text.encode()), **{
        name: {k: spread(v) for k, v in figures.items()} for name, figures in out.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
