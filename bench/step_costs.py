"""What a step costs beside decodes: the arithmetic behind chunked prefill's trade-off.

Loads a `moed make-model` checkpoint in-process (no daemon, no HTTP) and times
`Model.forward_step` (median of --repeats) for:

  decode: --streams decode rows at --decode-context tokens of context each;
  alone:  a prompt chunk of c tokens continuing a prompt already p tokens long;
  mixed:  the same chunk in one step with the decode rows.

Printed as JSON, with per (p, c): the chunk's cost per token, and what the decode rows
add to the step they share with the chunk (mixed - alone) as a fraction of the decode
step alone. When that fraction is about 1 the rows share nothing worth having with the
chunk (their experts' weights are cached and their cost is arithmetic), so a step that
must stay within R decode steps leaves the prompt at most (R - 1) / R of the machine,
and the prompt's time to first token beside the streams is at least R / (R - 1) times
its time alone, before the extra cost of small chunks (cost per token of c tokens over
that of PREFILL_CHUNK). With R = 3 that bound is 1.5 already.

"bound": the same made concrete for a --prompt-tokens prompt. The step times are fitted
(least squares) as t(c, p) = m0 + m1 p + c (k0 + k1 (p + c / 2)) — a part per chunk
that grows with the prompt's KV cache, and per token the rows' weights and their
attention over the context — mixed steps and full chunks alone separately; then for
each R the best any chunk-sizing rule could do with exact knowledge of those costs and
no noise: every step takes the largest chunk that keeps it within R decode steps (one
token when none does), and the prompt's time to first token is compared with its
full-chunk prefill alone. The streams' own growth in context is left out, so the bound
is optimistic.

    python bench/step_costs.py [--model DIR] [--threads 1] [--prefill-chunk 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from ext.models.model import PREFILL_CHUNK, Model
from interleave import MAKE_MODEL
from served import ensure_model


def _clock(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _interleaved(fns, repeats: int) -> list[list[float]]:
    """Each fn timed `repeats` times, in turn (A B C A B C ...), so a machine whose load
    drifts slows them alike: per fn, its times in round order."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for t, fn in zip(times, fns):
            t.append(_clock(fn))
    return times


def _fit(samples: list[tuple[int, int, float]]) -> list[float]:
    """Least squares of t(c, p) = m0 + m1 p + c (k0 + k1 (p + c / 2)) over (c, p, t):
    [m0, m1, k0, k1]."""
    a = np.array([[1.0, p, c, c * (p + c / 2)] for c, p, _ in samples])
    t = np.array([t for _, _, t in samples])
    return np.linalg.lstsq(a, t, rcond=None)[0].tolist()


def _cost(coef: list[float], c: int, p: int) -> float:
    m0, m1, k0, k1 = coef
    return m0 + m1 * p + c * (k0 + k1 * (p + c / 2))


def _bound(ratio: float, decode_s: float, mixed: list[float], alone: list[float],
           tokens: int, full: int) -> dict:
    """The best chunk sizes under `ratio` with exactly known, noise-free step costs; the
    prompt alone is prefilled in chunks of `full` tokens."""
    p, total, steps, worst = 0, 0.0, 0, 0.0
    while p < tokens:
        c = 1
        while c < min(full - 3, tokens - p) and _cost(mixed, c + 1, p) <= ratio * decode_s:
            c += 1
        step = _cost(mixed, c, p)
        total, steps, worst, p = total + step, steps + 1, max(worst, step), p + c
    alone_s = sum(_cost(alone, min(full, tokens - q), q) for q in range(0, tokens, full))
    return {"ratio": ratio, "steps": steps, "ttft_mixed_over_alone": total / alone_s,
            "worst_step_over_decode_step": worst / decode_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-interleave-model",
                   help="model directory (written by make-model when missing)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help="the full chunk, as serve's prefill_chunk (it takes 512 when the experts "
                        "are in memory); also the most a step holds")
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--decode-context", type=int, default=600)
    p.add_argument("--positions", type=int, nargs="+", default=[0, 1000, 2000, 3400])
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--prompt-tokens", type=int, default=3500, help="the prompt of the bound")
    args = p.parse_args()
    full_chunk = args.prefill_chunk
    model = Model.load(ensure_model(args.model, MAKE_MODEL), n_threads=args.threads,
                       prefill_chunk=full_chunk)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    def prefilled(n: int):
        seq = model.new_sequence(capacity=n + full_chunk + 1)
        if n:
            model.forward(seq, rng.integers(1, vocab, n))
        return seq

    streams = [prefilled(args.decode_context) for _ in range(args.streams)]
    one = [np.array([7], np.int64)] * args.streams

    def rewind(seqs, lengths):           # undo a step: the caches hold what they held
        for seq, n in zip(seqs, lengths):
            seq.kv.length = n

    def decode():
        model.forward_step(streams, one)
        rewind(streams, [args.decode_context] * args.streams)

    decode_times: list[float] = []
    rows = []
    for pos in args.positions:
        prompt = prefilled(pos)
        whole = rng.integers(1, vocab, full_chunk)

        def full():
            model.forward_step([prompt], [whole])
            rewind([prompt], [pos])

        for c in args.chunks:
            chunk = rng.integers(1, vocab, c)

            def alone():
                model.forward_step([prompt], [chunk])
                rewind([prompt], [pos])

            def mixed():
                model.forward_step(streams + [prompt], one + [chunk])
                rewind(streams + [prompt], [args.decode_context] * args.streams + [pos])

            a, m, d, f = _interleaved([alone, mixed, decode, full], args.repeats)
            decode_times += d
            # ratios per round, so that load drifting over the run cancels
            rows.append({"position": pos, "chunk": c, "alone_s": statistics.median(a),
                         "mixed_s": statistics.median(m),
                         "alone_s_per_token": statistics.median(a) / c,
                         "cost_per_token_over_full_chunk": statistics.median(
                             (ai / c) / (fi / full_chunk) for ai, fi in zip(a, f)),
                         "decode_rows_added_over_decode_step": statistics.median(
                             (mi - ai) / di for ai, mi, di in zip(a, m, d))})
    decode_s = statistics.median(decode_times)
    mixed_cost = _fit([(r["chunk"], r["position"], r["mixed_s"]) for r in rows])
    alone_cost = _fit([(r["chunk"], r["position"], r["alone_s"]) for r in rows] +
                      [(full_chunk, r["position"], r["alone_s"] / r["chunk"] * full_chunk /
                        r["cost_per_token_over_full_chunk"]) for r in rows])
    print(json.dumps({
        "model": args.model, "threads": args.threads, "streams": args.streams,
        "decode_context": args.decode_context, "decode_step_s": decode_s,
        "full_chunk": full_chunk,
        "steps": rows,
        "decode_rows_added_over_decode_step_median": statistics.median(
            r["decode_rows_added_over_decode_step"] for r in rows),
        "bound": {"prompt_tokens": args.prompt_tokens,
                  "fit_mixed_s": mixed_cost, "fit_alone_s": alone_cost,
                  "by_ratio": [_bound(r, decode_s, mixed_cost, alone_cost, args.prompt_tokens, full_chunk)
                               for r in (2.0, 2.5, 3.0, 3.5, 4.0, 5.0)]}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
