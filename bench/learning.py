"""Learning across sessions: what a second session gains, and what a session on another
kind of text loses, against the right baselines.

    python bench/learning.py [--model default] [--cache-fraction 0.25] [--tokens 256]
        [--prompt-tokens 32] [--defaults]

For each pair (X, Y) — X a held-out Python module, Y a text of another kind (Perl, C, the
GPL's English) — four sessions, each a fresh process-level provider over the same state
directory, each decoding --tokens tokens from the first --prompt-tokens tokens of its text
(temperature 0.7, seed 0):
    A  fresh state, text X           (a first session)
    B  A's state, text X             (the same workload again)
    C  A's state, text Y             (another kind of text)
    D  fresh state, text Y           (the baseline C must not fall below)
and reports decode hit rates: B - A (goal >= +2 points), C - D (goal >= -0.5 points), the
decode step at which A first held pins, and the pins each session started with. By
default prefetch and the referee are off, so hit rates are deterministic (learning alone);
--defaults runs moed's defaults. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import sysconfig
import tempfile
from pathlib import Path

PYTHON = Path(sysconfig.get_paths()["stdlib"])
SAME = ["statistics.py", "csv.py", "argparse.py", "difflib.py", "textwrap.py", "heapq.py"]
OTHER = ["/usr/share/perl/5.36.0/Text/Wrap.pm", "/usr/include/stdlib.h",
         "/usr/share/common-licenses/GPL-3", "/usr/share/perl/5.36.0/File/Find.pm",
         "/usr/include/stdio.h", "/usr/share/common-licenses/Apache-2.0"]


def session(model_dir: str, cache_bytes: int, state: Path, text: str, args) -> dict:
    from daemon.store.session import open_model
    from ext.sampling import Sampler, SamplingParams
    from ext.tokenizer import Tokenizer

    options = {} if args.defaults else {"prefetch": False, "referee": False}
    model, s = open_model(model_dir, threads=args.threads, cache_bytes=cache_bytes,
                          state_dir=state, **options)
    p = s.provider
    started_pinned = len(p.cache.pins)
    ids = Tokenizer.from_model_dir(model_dir).encode(text)[: args.prompt_tokens]
    seq = model.new_sequence(capacity=len(ids) + args.tokens + 1)
    sampler = Sampler(SamplingParams(temperature=0.7, seed=0))
    p.phase = "prefill"
    logits = model.forward(seq, ids)
    p.phase = "decode"
    first_pins = None if not p.cache.pins else 0
    for step in range(args.tokens):
        logits = model.forward(seq, [sampler.sample(logits[-1])])
        if first_pins is None and p.cache.pins:
            first_pins = step + 1
    snap = p.cache.snapshot()
    hits = sum(snap.hits_by_phase["decode"])
    lookups = hits + sum(snap.prefetch_hits_by_phase["decode"]) + sum(snap.misses_by_phase["decode"])
    out = {"hit_rate": hits / lookups, "started_with_pins": started_pinned,
           "pins_at_end": len(p.cache.pins), "first_pins_at_decode_step": first_pins,
           "warm_loads": p.warm_loads,
           "pin_share": p.adaptation.learner.share if p.adaptation and p.adaptation.learner else None}
    s.flush()
    model.close()
    return out


def main(argv=None) -> int:
    doc = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(description=doc[0], epilog=doc[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help='model directory ("default": the embedded one)')
    parser.add_argument("--cache-fraction", type=float, default=0.25,
                        help="expert cache as a share of the routed experts (default 0.25)")
    parser.add_argument("--tokens", type=int, default=256, help="decode tokens per session")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt tokens per session")
    parser.add_argument("--pairs", type=int, default=len(SAME), help="(X, Y) pairs (default all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--defaults", action="store_true", help="moed's defaults (prefetch, referee on)")
    args = parser.parse_args(argv)
    from daemon.commands.demo import cache_budget
    from daemon.service.config import resolve_model_alias

    model_dir = resolve_model_alias(args.model)
    budget = cache_budget(Path(model_dir), args.cache_fraction).cache_bytes
    rows = []
    with tempfile.TemporaryDirectory(prefix="moed-learning-") as tmp:
        state = Path(tmp) / "state"
        for x, y in list(zip(SAME, OTHER))[: args.pairs]:
            tx = (PYTHON / x).read_text(encoding="utf-8", errors="replace")
            ty = Path(y).read_text(encoding="utf-8", errors="replace")
            shutil.rmtree(state, ignore_errors=True)
            a = session(model_dir, budget, state, tx, args)
            b = session(model_dir, budget, state, tx, args)
            shutil.rmtree(state, ignore_errors=True)
            a2 = session(model_dir, budget, state, tx, args)          # A again, for C
            c = session(model_dir, budget, state, ty, args)
            shutil.rmtree(state, ignore_errors=True)
            d = session(model_dir, budget, state, ty, args)
            rows.append({"same": x, "other": y, "A": a, "B": b, "A_again": a2, "C": c, "D": d,
                         "second_minus_first_points": round(100 * (b["hit_rate"] - a["hit_rate"]), 2),
                         "other_minus_fresh_points": round(100 * (c["hit_rate"] - d["hit_rate"]), 2)})
            print(f"{x} / {Path(y).name}: B-A {rows[-1]['second_minus_first_points']:+.2f}, "
                  f"C-D {rows[-1]['other_minus_fresh_points']:+.2f}", file=sys.stderr)
    gain = [r["second_minus_first_points"] for r in rows]
    loss = [r["other_minus_fresh_points"] for r in rows]
    report = {"model": model_dir, "cache_bytes": budget, "tokens": args.tokens,
              "prompt_tokens": args.prompt_tokens, "mode": "defaults" if args.defaults
              else "prefetch and referee off (deterministic)",
              "second_minus_first_points": {"median": statistics.median(gain), "min": min(gain),
                                            "max": max(gain), "by_pair": gain},
              "other_minus_fresh_points": {"median": statistics.median(loss), "min": min(loss),
                                           "max": max(loss), "by_pair": loss},
              "first_pins_at_decode_step": [r["A"]["first_pins_at_decode_step"] for r in rows],
              "pairs": rows}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
