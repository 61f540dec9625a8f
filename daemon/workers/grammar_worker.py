"""One grammar-compile process (`python -m daemon.workers.grammar_worker LIMIT`).

Run by daemon/workers/grammar.py. It limits its own address space to LIMIT bytes
(RLIMIT_AS) before it reads anything and lowers its CPU priority (decoding comes
first), reads one line ``{"tokenizer": str, "vocab_size": int, "eos": [int]}`` (the
model's tokenizer in Hugging Face's JSON, as the daemon gives it to llguidance), says
``{"ready": true}`` once llguidance has it, then answers requests, one JSON object per
line: on stdin ``{"grammar": str}`` (an llguidance grammar, as
`LLMatcher.grammar_from_json_schema` makes it), on stdout ``{"ok": true, "seconds":
float, "bytes": int}`` (the grammar compiles, its first mask allows something and its
first steps fail nothing (`first_steps_error`); the time that took, and the memory its
matcher holds) or ``{"error": str, "limit": bool}``.
It imports only llguidance and the standard library (and daemon/workers/process.py),
and writes nothing anywhere else.

`bytes` is what the daemon's cache charges for the schema (grammar.py). It is the heap
the C allocator has handed out (glibc's mallinfo2: llguidance allocates through it),
measured before the compile and again while the matcher is alive. Not the growth of the
resident size: this process is reused, and a compile that fits in memory an earlier one
freed grows it by nothing (measured: 630 KB enum schemas, ~15 MB of matcher each, grew
it by ~0). This process runs one compile at a time on one thread, so the difference is
the matcher's, and the same compile in the daemon holds the same. Without mallinfo2
(another C library) it falls back to the resident growth, and the daemon's floor.

`build_matcher` is also what the daemon runs in-process once a worker has said a
grammar compiles (daemon/workers/grammar.py).

A compile llguidance's own limits do not bound (an allOf of many regex patterns doubles
its cost with each one) is ended by the daemon: it kills this process at its deadline,
and the address-space limit ends one that grows first (Rust aborts on a failed
allocation: the process dies, the daemon reports the memory limit).
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time

from daemon.workers.process import limit_memory, serve_lines

OUT_OF_MEMORY = {"error": "the grammar needed more memory than its compile may use", "limit": True}
NICE = 10          # below the daemon's engine thread on a busy machine


def build_matcher(tokenizer, grammar: str):
    """(matcher, None) for an llguidance grammar that compiles and whose first mask allows
    some token, else (None, what is wrong). tokenizer: an llguidance.LLTokenizer.

    llguidance accepts some schemas it can never match (`{"$ref": "#"}` refers only to
    itself: no value is finite) and says so only at the first mask, with its parser's
    state dump; the first mask is computed here so that such a schema is refused before
    a request runs, and errors are asked for without the dump (verbose_errors=False).
    """
    import llguidance
    limits = llguidance.LLParserLimits(verbose_errors=False)
    # The constructor reports what LLMatcher.validate_grammar would, without compiling
    # twice (validate_grammar builds the same parser and throws it away).
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        return None, matcher.get_error()
    mask = matcher.compute_bitmask()
    if matcher.is_error() or not any(mask):
        return None, "no JSON value satisfies it (nothing can be generated)"
    return matcher, None


WALK_TOKENS = 32       # tokens consumed past the forced ones by `first_steps_error`


def first_steps_error(matcher) -> str | None:
    """What llguidance says goes wrong within the first tokens of an output, or None.

    matcher: a fresh llguidance.LLMatcher (`build_matcher`'s; not changed: a deep copy is
    walked). Some of llguidance's limits are checked only when a token is consumed, never
    while a mask is computed: the Earley row limit (max_items_in_row, 2000), which an
    anyOf of 4000 objects passes at its first token. So a mask that allows a token does
    not mean the token can be consumed, and a grammar whose first mask is fine may still
    fail at its first token. This consumes, on the copy, the tokens the grammar forces
    (compute_ff_tokens: every output begins with them), then up to WALK_TOKENS tokens of
    one path (the lowest id each mask allows), and returns the first error met. It checks
    the forced prefix and that one path, not every path a model may take.
    """
    walker = matcher.deep_copy()
    forced = walker.compute_ff_tokens()
    if walker.is_error() or (forced and not walker.consume_tokens(forced)):
        return walker.get_error()
    for _ in range(WALK_TOKENS):
        if walker.is_stopped():
            return None
        bits = int.from_bytes(walker.compute_bitmask(), "little")
        if walker.is_error():
            return walker.get_error()
        if bits == 0:
            return None                 # nothing allowed and no error: the caller's check
        if not walker.consume_token((bits & -bits).bit_length() - 1):
            return walker.get_error()
    return None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2():
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype, function.argtypes = _MallInfo2, []
    return function


_MALLINFO2 = _mallinfo2()


def heap_bytes() -> int:
    """The bytes the C allocator has handed out and not had back (allocated chunks and
    mmapped blocks, every arena), or the resident size without glibc's mallinfo2."""
    if _MALLINFO2 is None:
        return _rss_bytes()
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def main(argv: list[str]) -> int:
    limit_memory(int(argv[1]))
    try:
        os.nice(NICE)
    except OSError:
        pass
    init = json.loads(sys.stdin.readline() or "null")
    import llguidance
    tokenizer = llguidance.LLTokenizer(init["tokenizer"], n_vocab=init["vocab_size"],
                                       eos_token=init["eos"] or None)
    del init

    def answer(request: dict) -> dict:
        before, started = heap_bytes(), time.monotonic()
        matcher, error = build_matcher(tokenizer, request["grammar"])
        seconds, held = time.monotonic() - started, heap_bytes() - before
        if error is None:
            walked = first_steps_error(matcher)
            if walked is not None:
                walked = walked.replace("<non-verbose/>", "").strip()
                error = f"it fails within its first {WALK_TOKENS} tokens: {walked}"
        del matcher                    # measured while alive: its size, not what is left
        if error is not None:
            return {"error": error, "limit": False}
        return {"ok": True, "seconds": seconds, "bytes": max(0, held)}

    return serve_lines(answer, OUT_OF_MEMORY)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
