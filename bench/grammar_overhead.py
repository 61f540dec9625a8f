"""What constraining output to a JSON schema costs per token, for the two CPU grammar
libraries moed could use (llguidance, which moed uses, and xgrammar), and in moed itself.

1. Library: for each schema of a held-out set (not the tests' schemas) and each of two
   vocabularies — the `moed make-model` tokenizer and a 32k byte-level BPE trained here
   on the Python standard library's sources — a seeded random "model" (Gaussian logits)
   picks the best allowed token until the grammar completes; we time the mask
   computation plus the token's acceptance, per token. Both libraries see the same
   tokens' vocabulary; xgrammar's mask is a torch bitmask (it needs torch at run time),
   llguidance's a byte string.
2. moed: decode steps of the engine on a make-model checkpoint with and without
   response_format (the same requests otherwise, interleaved A B A B), seconds per
   generated token.

Prints JSON (medians in microseconds, with min and max over repeats). xgrammar is
measured only when it is installed (`pip install xgrammar`; it is not a dependency).

    python bench/grammar_overhead.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from served import spread

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["title", "year", "genres"],
     "properties": {"title": {"type": "string", "maxLength": 24},
                    "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                    "genres": {"type": "array", "maxItems": 3,
                               "items": {"enum": ["drama", "comedy", "horror", "sci-fi"]}}}},
    {"type": "object", "additionalProperties": False, "required": ["order_id", "lines", "paid"],
     "properties": {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                    "paid": {"type": "boolean"},
                    "lines": {"type": "array", "maxItems": 4, "items": {
                        "type": "object", "additionalProperties": False,
                        "required": ["sku", "qty"],
                        "properties": {"sku": {"type": "string", "maxLength": 8},
                                       "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}}}},
    {"type": "object", "additionalProperties": False, "required": ["lat", "lon", "label"],
     "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                    "label": {"type": ["string", "null"], "maxLength": 16}}},
    {"type": "object", "additionalProperties": False, "required": ["level", "message", "ts"],
     "properties": {"level": {"enum": ["debug", "info", "warning", "error"]},
                    "message": {"type": "string", "maxLength": 40},
                    "ts": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}$"}}},
    {"type": "array", "minItems": 1, "maxItems": 6,
     "items": {"type": "object", "additionalProperties": False, "required": ["k", "v"],
               "properties": {"k": {"type": "string", "maxLength": 6},
                              "v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                              {"type": "boolean"}, {"type": "null"}]}}}},
]
MAX_TOKENS = 400


def _vocabularies(workdir: str) -> dict[str, HFTokenizer]:
    from ext.makemodel import make_model
    small = make_model(os.path.join(workdir, "m"), arch="qwen3_moe", layers=2, experts=4,
                       top_k=2, hidden=64, intermediate=32)
    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "..", "*.py")))[:300]
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train(files, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                         show_progress=False))
    return {"make_model_512": HFTokenizer.from_file(os.path.join(small, "tokenizer.json")),
            "bpe_32k": bpe}


def _drive(matcher_step, vocab: int, seed: int) -> list[float]:
    """Run one constrained generation; per-token seconds of mask + accept."""
    rng = np.random.default_rng(seed)
    times = []
    for _ in range(MAX_TOKENS):
        logits = rng.standard_normal(vocab)
        t0 = time.perf_counter()
        done = matcher_step(logits)
        times.append(time.perf_counter() - t0)
        if done:
            break
    return times


def _llguidance(tokenizer: HFTokenizer, eos: int):
    import llguidance
    lltok = llguidance.LLTokenizer(tokenizer.to_str(), eos_token=eos)
    V = tokenizer.get_vocab_size()

    def run(schema: dict, seed: int) -> list[float]:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(lltok, grammar)

        def step(logits):
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[:V]
            z = np.where(bits.astype(bool), logits, -np.inf)
            token = int(np.argmax(z))
            m.consume_token(token)
            return m.is_stopped()
        return _drive(step, V, seed)
    return run


def _xgrammar(tokenizer: HFTokenizer, eos: int):
    import xgrammar as xgr
    V = tokenizer.get_vocab_size()
    vocab = [None] * V
    for piece, i in tokenizer.get_vocab(with_added_tokens=True).items():
        vocab[i] = piece
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=V, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)

    def run(schema: dict, seed: int) -> list[float]:
        m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        bitmask = xgr.allocate_token_bitmask(1, V)

        def step(logits):
            m.fill_next_token_bitmask(bitmask)
            words = bitmask.numpy().view(np.uint8).reshape(-1)
            bits = np.unpackbits(words, bitorder="little")[:V]
            z = np.where(bits.astype(bool), logits, -np.inf)
            token = int(np.argmax(z))
            m.accept_token(token)
            return m.is_terminated()
        return _drive(step, V, seed)
    return run


def _library(repeats: int, workdir: str) -> dict:
    out = {}
    for name, tokenizer in _vocabularies(workdir).items():
        eos = tokenizer.token_to_id("<|endoftext|>")
        runners = {"llguidance": _llguidance(tokenizer, eos)}
        try:
            runners["xgrammar"] = _xgrammar(tokenizer, eos)
        except ImportError:
            pass
        results = {lib: [] for lib in runners}
        tokens = {lib: 0 for lib in runners}
        for r in range(repeats):
            for lib, run in runners.items():                      # interleaved
                per_token = [t for i, s in enumerate(SCHEMAS) for t in run(s, 100 * r + i)]
                tokens[lib] += len(per_token)
                results[lib].append(statistics.median(per_token) * 1e6)
        out[name] = {lib: {"median_us_per_token": spread(v), "tokens": tokens[lib]}
                     for lib, v in results.items()}
    return out


def _moed(repeats: int, workdir: str) -> dict:
    from daemon.engine.engine import Engine, EngineRequest
    from daemon.workers.grammar import Grammars
    from ext.makemodel import make_model
    from ext.models.model import Model
    from ext.sampling import SamplingParams
    from ext.tokenizer import Tokenizer, stop_token_ids
    model_dir = make_model(os.path.join(workdir, "engine"), arch="qwen3_moe", layers=4,
                           experts=16, top_k=2, hidden=128, intermediate=64)
    model, tokenizer = Model.load(model_dir), Tokenizer.from_model_dir(model_dir)
    stops = frozenset(stop_token_ids(model_dir))
    grammars = Grammars(tokenizer, model.config.vocab_size, stops)
    engine = Engine(model, tokenizer)
    engine.start()

    async def one(req: EngineRequest):
        handle = engine.submit(req, asyncio.get_running_loop())
        while not (ev := await handle.events.get()).last:
            pass
        s = ev.stats
        return s.duration_s - (s.time_to_first_token_s or 0), max(s.completion_tokens - 1, 0)

    def per_token(seed: int) -> tuple[float, float]:
        """(constrained, plain) seconds per token after the first; each plain request
        generates as many tokens as its constrained twin did."""
        async def run():
            totals = {"constrained": [0.0, 0], "plain": [0.0, 0]}
            for i, schema in enumerate(SCHEMAS):
                sampling = SamplingParams(temperature=0.8, seed=seed + i)
                fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
                sec, n = await one(EngineRequest(f"c{i}", (1, 2, 3), max_tokens=MAX_TOKENS,
                                                 stop_ids=stops, sampling=sampling,
                                                 constraint=await grammars.compile(
                                                     grammars.spec(fmt))))
                totals["constrained"][0] += sec
                totals["constrained"][1] += n
                sec, n = await one(EngineRequest(f"p{i}", (1, 2, 3), max_tokens=n + 1,
                                                 sampling=sampling))
                totals["plain"][0] += sec
                totals["plain"][1] += n
            return tuple(t / n for t, n in totals.values())
        return asyncio.run(run())
    plain, constrained = [], []
    for r in range(repeats):
        c, p = per_token(10 * r)
        constrained.append(c * 1e6)
        plain.append(p * 1e6)
    engine.stop()
    grammars.close()
    overhead = [c - p for c, p in zip(constrained, plain)]
    return {"us_per_token_plain": spread(plain), "us_per_token_constrained": spread(constrained),
            "overhead_us_per_token": spread(overhead),
            "note": "each plain request generates as many tokens as its constrained twin "
                    "(same seed, no grammar)"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="moedgrammar") as workdir:
        report = {"schemas": len(SCHEMAS), "library": _library(args.repeats, workdir),
                  "moed_engine": _moed(args.repeats, workdir)}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
