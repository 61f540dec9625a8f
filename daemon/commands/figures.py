"""How `moed bench` and `moed tune` report a measured figure and a comparison: each figure
with its spread over the runs, and a plain verdict on whether a difference between two
settings stands out of the noise.

Runs of the two settings are interleaved (a b a b ...), so run i of one and run i of the
other saw the same machine: they make a pair. A difference is called real only when
every pair agrees on its direction AND the two sets of runs do not overlap (the slowest
run of the faster setting beats the fastest run of the slower one) with at least
MIN_PAIRS pairs; anything less is "within the noise", said as such with the range the
pairs span. Timings on a shared machine swing by tens of percent from run to run: one
number without its spread is not a result.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

MIN_PAIRS = 3


def spread(runs: Sequence[float], digits: int = 3) -> dict:
    """{"median", "min", "max", "relative_spread" ((max - min) / median), "runs"}."""
    if not runs:
        raise ValueError("no runs")
    med = statistics.median(runs)
    return {"median": round(med, digits), "min": round(min(runs), digits),
            "max": round(max(runs), digits),
            "relative_spread": round((max(runs) - min(runs)) / med, 3) if med else None,
            "runs": [round(x, digits) for x in runs]}


def compare(a: Sequence[float], b: Sequence[float], name_a: str, name_b: str,
            unit: str = "tokens/s") -> dict:
    """The ratio a / b of interleaved runs (higher is better), pair by pair.

    Returns {"ratio" (of the medians), "pair_ratios", "significant" (bool), "verdict" (a
    sentence)}. Raises ValueError when the run counts differ or are zero."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same number of runs of each, got {len(a)} and {len(b)}")
    ratio = statistics.median(a) / statistics.median(b)
    pairs = [x / y for x, y in zip(a, b)]
    lo, hi = min(pairs), max(pairs)
    agree = all(p > 1 for p in pairs) or all(p < 1 for p in pairs)
    apart = min(a) > max(b) or max(a) < min(b)
    significant = len(pairs) >= MIN_PAIRS and agree and apart
    if significant:
        faster, slower = (name_a, name_b) if ratio > 1 else (name_b, name_a)
        factor = ratio if ratio > 1 else 1 / ratio
        verdict = (f"{faster} is {factor:.2f}x {slower} ({unit}): every one of {len(pairs)} "
                   f"interleaved pairs agrees ({lo:.2f} to {hi:.2f}) and the runs do not overlap")
    elif len(pairs) < MIN_PAIRS:
        verdict = (f"within the noise: {len(pairs)} pair(s) of runs cannot tell a difference "
                   f"from noise (ratio {ratio:.2f}); use at least {MIN_PAIRS} repeats")
    else:
        why = "the pairs disagree" if not agree else "the runs overlap"
        verdict = (f"within the noise: {name_a} / {name_b} = {ratio:.2f} by the medians, but "
                   f"{why} (pairs {lo:.2f} to {hi:.2f}); more repeats or a quieter machine "
                   "may tell")
    return {"ratio": round(ratio, 3), "pair_ratios": [round(p, 3) for p in pairs],
            "significant": significant, "verdict": verdict}
