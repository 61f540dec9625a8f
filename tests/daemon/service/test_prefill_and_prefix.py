"""Chunked prefill beside decodes, prefix reuse and n choices never change a token.

The references are the engine or the model without the feature: a prompt prefilled
alone, a request without reused blocks, one choice per request.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from daemon.engine.engine import Engine, EngineRequest
from daemon.engine.prefix_cache import PrefixCache, block_bytes
from daemon.engine.steps import INITIAL_PREFILL_ROWS, MIN_PREFILL_ROWS, StepTimes
from ext.makemodel import make_model
from ext.models.model import PREFILL_CHUNK, Model
from ext.sampling import SamplingParams
from ext.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("prefill") / "m", arch="qwen3_moe", layers=3,
                      experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=11,
                      initializer_range=0.2)


@pytest.fixture(scope="module")
def model(model_dir):
    return Model.load(model_dir, n_threads=2)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_model_dir(model_dir)


def _per_token(model) -> int:
    return model.attention.kv_bytes_per_token(model.config)


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(1, 500, n))


async def _drain(handle) -> dict:
    out = {}
    while True:
        ev = await handle.events.get()
        choice = out.setdefault(ev.index, {"ids": [], "text": "", "logprobs": []})
        choice["ids"].extend(ev.token_ids)
        choice["text"] += ev.text
        choice["logprobs"].extend(ev.logprobs)
        if ev.finish_reason is not None:
            choice["finish_reason"] = ev.finish_reason
        if ev.last:
            return {"choices": [out[i] for i in sorted(out)], "stats": ev.stats}


def _run(engine: Engine, requests: list[EngineRequest], delays: list[int] | None = None) -> list[dict]:
    """Submit requests (request i after the earlier ones produced delays[i] events in all)
    and collect every answer."""
    async def main():
        loop = asyncio.get_running_loop()
        handles, results = [], []
        for i, r in enumerate(requests):
            if delays and delays[i]:
                await asyncio.sleep(0)
                while sum(h.events.qsize() for h in handles) < delays[i]:
                    await asyncio.sleep(0.001)
            handles.append(engine.submit(r, loop))
        for h in handles:
            results.append(await _drain(h))
        return results
    return asyncio.run(main())


def _engine(model, tokenizer, **kw) -> Engine:
    engine = Engine(model, tokenizer, **kw)
    engine.start()
    return engine


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_decodes(model, tokenizer):
    """Three streams decode while a 300-token prompt arrives: it is prefilled a few
    tokens per step beside their rows, and every request's tokens are those alone."""
    streams = [EngineRequest(f"s{i}", _prompt(i, 5), max_tokens=400,
                             sampling=SamplingParams(temperature=0.9, seed=i)) for i in range(3)]
    long = EngineRequest("long", _prompt(99, 300), max_tokens=8,
                         sampling=SamplingParams(temperature=0.7, top_k=30, seed=7))
    alone_engine = _engine(model, tokenizer, max_concurrent_sequences=1)
    alone = [_run(alone_engine, [r])[0] for r in streams + [long]]
    alone_engine.stop()

    steps = []                                   # (long-prompt tokens, other rows) per step
    real = model.forward_step

    def forward_step(seqs, chunks):
        ours = [len(c) for seq, c in zip(seqs, chunks) if seq.length < 300 and list(c) ==
                list(long.prompt_ids[seq.length:seq.length + len(c)])]
        steps.append((sum(ours), sum(len(c) for c in chunks) - sum(ours)))
        return real(seqs, chunks)
    model.forward_step = forward_step
    try:
        engine = _engine(model, tokenizer, max_concurrent_sequences=4, prefill_step_ratio=1.05)
        mixed = _run(engine, streams + [long], delays=[0, 0, 0, 9])
        engine.stop()
    finally:
        model.forward_step = real
    for a, m in zip(alone, mixed):
        assert m["choices"][0]["ids"] == a["choices"][0]["ids"]
        assert m["choices"][0]["text"] == a["choices"][0]["text"]
    beside = [p for p, d in steps if p and d]
    assert sum(beside) > 200                     # most of the prompt ran beside decode rows
    assert max(beside) < PREFILL_CHUNK - 3       # in chunks smaller than a step alone takes
    assert len(beside) > 300 / (PREFILL_CHUNK - 3)
    assert mixed[3]["stats"].prefill_tokens == 300


def test_prefix_reuse_gives_the_same_logits_for_a_prefix_that_ends_mid_chunk(model):
    """Blocks of 16 tokens: a 100-token prompt leaves 6 blocks; a prompt sharing its first
    57 tokens reuses 48 (3 blocks, not a prefill-chunk boundary) and computes the rest;
    the logits of every computed position equal those of a prefill from scratch."""
    cache = PrefixCache(_per_token(model), capacity_bytes=64 * block_bytes(_per_token(model)))
    first = _prompt(1, 100)
    seq = model.new_sequence()
    model.forward(seq, first)
    assert cache.store(first, seq.kv) == 6
    second = first[:57] + _prompt(2, 40)
    reused = model.new_sequence()
    assert cache.load(second, reused.kv) == 48
    assert reused.length == 48
    got = model.forward(reused, second[48:], all_logits=True)
    scratch = model.new_sequence()
    want = model.forward(scratch, second, all_logits=True)[48:]
    assert np.array_equal(got, want)
    for a, b in zip(reused.kv.read(0, len(second)), scratch.kv.read(0, len(second))):
        assert np.array_equal(a, b)                   # and the same KV everywhere
    s = cache.stats()
    assert (s.queries, s.hits, s.tokens_reused, s.blocks) == (1, 1, 48, 6)


def test_the_last_token_is_always_computed(model):
    cache = PrefixCache(_per_token(model), capacity_bytes=64 * block_bytes(_per_token(model)))
    prompt = _prompt(3, 32)                       # exactly two blocks
    seq = model.new_sequence()
    model.forward(seq, prompt)
    cache.store(prompt, seq.kv)
    again = model.new_sequence()
    assert cache.load(prompt, again.kv) == 16     # the second block holds the last token
    assert cache.load(prompt[:10], model.new_sequence().kv) == 0


def test_engine_answers_are_the_same_with_reuse_on_and_off(model, tokenizer):
    """A 10-turn chat where each turn appends to the last: with the prefix cache the
    tokens are those without it, and the tokens prefilled per turn stay flat."""
    def chat(prefix_cache_bytes):
        engine = _engine(model, tokenizer, prefix_cache_bytes=prefix_cache_bytes)
        history, out = list(_prompt(5, 40)), []
        for turn in range(10):
            r = _run(engine, [EngineRequest(f"t{turn}", tuple(history), max_tokens=12,
                                            sampling=SamplingParams(temperature=0.8, seed=turn))])[0]
            out.append(r)
            history += r["choices"][0]["ids"] + list(_prompt(100 + turn, 20))
        engine.stop()
        return out
    on, off = chat(1 << 24), chat(0)
    assert [r["choices"] for r in on] == [r["choices"] for r in off]
    prefilled_on = [r["stats"].prefill_tokens for r in on]
    prefilled_off = [r["stats"].prefill_tokens for r in off]
    assert prefilled_off == [r["stats"].prompt_tokens for r in off]        # growing
    assert prefilled_off[-1] > 5 * max(prefilled_on[1:])
    assert max(prefilled_on[1:]) <= 12 + 20 + 16   # this turn's new tokens + part of a block
    assert all(r["stats"].cached_tokens + r["stats"].prefill_tokens == r["stats"].prompt_tokens
               for r in on)


def test_only_requests_of_the_same_cache_salt_share_blocks(model, tokenizer):
    """The attacker's probe: a secret prompt under one salt, then the same tokens under
    another salt, unsalted, and under a tuple salt (a client's identity) reuse nothing;
    under its own salt it reuses every whole block before its last token. The answers are
    the same with and without the reuse."""
    engine = _engine(model, tokenizer, prefix_cache_bytes=1 << 24)
    secret = _prompt(21, 49)                     # three whole blocks before the last token

    def ask(name, salt):
        return _run(engine, [EngineRequest(name, secret, max_tokens=6, cache_salt=salt)])[0]
    try:
        first = ask("a", "alice")
        probes = [ask("b", "bob"), ask("c", None), ask("d", (("ip", "127.0.0.2"), "alice"))]
        again = ask("e", "alice")
    finally:
        engine.stop()
    assert first["stats"].cached_tokens == 0
    # each probe stored its own chain under its own salt; none found alice's
    assert [p["stats"].cached_tokens for p in probes] == [0, 0, 0]
    assert again["stats"].cached_tokens == 48
    assert all(p["choices"] == first["choices"] for p in [*probes, again])


def test_a_salted_chain_is_a_subtree_of_its_own(model):
    """Blocks stored under a salt are found only under it, and evicting them leaves the
    unsalted chain of the same tokens whole."""
    nbytes = block_bytes(_per_token(model))
    cache = PrefixCache(_per_token(model), capacity_bytes=4 * nbytes)
    p = _prompt(9, 33)                            # two whole blocks
    seq = model.new_sequence()
    model.forward(seq, p)
    assert cache.store(p, seq.kv) == 2
    assert cache.load(p, model.new_sequence().kv, salt="s") == 0
    assert cache.store(p, seq.kv, salt="s") == 2   # a chain of its own, not shared blocks
    assert cache.stats().blocks == 4
    assert cache.load(p, model.new_sequence().kv, salt="s") == 32
    assert cache.load(p, model.new_sequence().kv, salt="t") == 0
    cache.resize(2 * nbytes)                      # the unsalted chain is older: it goes
    assert cache.load(p, model.new_sequence().kv) == 0
    assert cache.load(p, model.new_sequence().kv, salt="s") == 32


def test_the_cache_stays_within_its_bytes_and_evicts_least_recently_used(model):
    nbytes = block_bytes(_per_token(model))
    cache = PrefixCache(_per_token(model), capacity_bytes=5 * nbytes)
    a, b = _prompt(7, 48), _prompt(8, 48)         # three blocks each
    for p in (a, b):
        seq = model.new_sequence()
        model.forward(seq, p)
        cache.store(p, seq.kv)
    s = cache.stats()
    assert s.blocks == 5 and s.bytes == 5 * nbytes and s.blocks_evicted == 1
    # a was stored first: its leaf went; b is whole (its last block holds the last token)
    assert cache.load(a, model.new_sequence().kv) == 32
    assert cache.load(b, model.new_sequence().kv) == 32
    cache.resize(nbytes)
    assert cache.stats().blocks == 1
    # b was touched last: its first block is the one kept (a parent is always more
    # recent than its children, so leaves go first)
    assert cache.load(b, model.new_sequence().kv) == 16
    assert cache.load(a, model.new_sequence().kv) == 0
    cache.clear()
    assert cache.stats().blocks == 0
    empty = PrefixCache(_per_token(model), capacity_bytes=0)
    seq = model.new_sequence()
    model.forward(seq, a)
    assert empty.store(a, seq.kv) == 0 and empty.load(a, model.new_sequence().kv) == 0


def test_n_choices_are_the_requests_of_seed_plus_i(model, tokenizer):
    prompt = _prompt(9, 30)
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=40)
    engine = _engine(model, tokenizer, max_concurrent_sequences=4)
    together = _run(engine, [EngineRequest("n", prompt, max_tokens=10, sampling=sampling, n=3)])[0]
    singles = [_run(engine, [EngineRequest(f"s{i}", prompt, max_tokens=10,
                                           sampling=sampling.with_seed(40 + i))])[0]
               for i in range(3)]
    engine.stop()
    assert [c["ids"] for c in together["choices"]] == [s["choices"][0]["ids"] for s in singles]
    assert len({tuple(c["ids"]) for c in together["choices"]}) > 1
    assert together["stats"].completion_tokens == sum(len(c["ids"]) for c in together["choices"])
    assert together["stats"].prefill_tokens == 30            # one prefill for three choices


def test_logprobs_are_the_models_log_softmax(model, tokenizer):
    prompt = _prompt(10, 12)
    engine = _engine(model, tokenizer)
    got = _run(engine, [EngineRequest("lp", prompt, max_tokens=5, logprobs=3)])[0]["choices"][0]
    engine.stop()
    ids = got["ids"]
    logits = model.forward(model.new_sequence(), list(prompt) + ids[:-1], all_logits=True)[-5:]
    for row, token, entry in zip(logits, ids, got["logprobs"]):
        z = row.astype(np.float64)
        want = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
        assert entry.token == token == int(np.argmax(row))         # greedy: the top one
        assert entry.logprob == pytest.approx(want[token], abs=1e-9)
        assert [t for t, _ in entry.top] == list(np.argsort(-z, kind="stable")[:3])
        assert [lp for _, lp in entry.top] == pytest.approx(sorted(want, reverse=True)[:3], abs=1e-9)


def test_penalties_and_logit_bias_follow_openais_formula(model, tokenizer):
    """Greedy with penalties: the reference applies z[j] -= c[j]*frequency + (c[j] > 0)*
    presence and the biases to the model's logits, token by token."""
    prompt, bias = _prompt(11, 8), ((5, 3.0), (17, -100.0))
    sampling = SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=1.3,
                              logit_bias=bias)
    engine = _engine(model, tokenizer)
    got = _run(engine, [EngineRequest("pen", prompt, max_tokens=20, sampling=sampling)])[0]
    plain = _run(engine, [EngineRequest("plain", prompt, max_tokens=20)])[0]
    engine.stop()
    seq, counts, want = model.new_sequence(), {}, []
    logits = model.forward(seq, prompt)[-1]
    for _ in range(20):
        z = logits.astype(np.float64)
        for t, b in bias:
            z[t] += b
        for t, c in counts.items():
            z[t] -= c * 1.3 + 0.7
        token = int(np.argmax(z))
        want.append(token)
        counts[token] = counts.get(token, 0) + 1
        logits = model.forward(seq, [token])[-1]
    assert got["choices"][0]["ids"] == want
    assert got["choices"][0]["ids"] != plain["choices"][0]["ids"]
    assert 17 not in want


def test_the_chunk_beside_decodes_follows_measured_step_times():
    """(ratio - 1) x decode step / cost of a prompt row; a step slowed by the machine
    halves the chunk at most, and it never drops below MIN_PREFILL_ROWS."""
    t = StepTimes()
    assert t.prefill_rows(0, 2.0) == PREFILL_CHUNK                   # nothing decodes
    assert t.prefill_rows(3, 2.0) == INITIAL_PREFILL_ROWS            # nothing timed yet
    for _ in range(9):
        t.observe(0.010, 0, 3)                                       # decode steps: 10 ms
    t.observe(0.064, 64, 0)                                          # a prompt row: 1 ms
    assert [t.prefill_rows(3, 2.0) for _ in range(3)] == [10, 10, 10]
    assert t.prefill_rows(3, 3.0) == 20
    t.observe(1.0, 10, 3)                                            # a stalled step
    sizes = [t.prefill_rows(3, 2.0) for _ in range(4)]
    assert sizes == [10, 5, MIN_PREFILL_ROWS, MIN_PREFILL_ROWS]
    assert t.prefill_rows(PREFILL_CHUNK - 2, 2.0) == 2               # the rows left in a step


def test_a_larger_model_chunk_is_the_step_of_a_prompt_alone_and_bounds_mixed_steps():
    """The model's prefill_chunk (1024 when experts stream) sizes the steps of a prompt
    alone; beside decodes the measured rule still decides, within it."""
    t = StepTimes(1024)
    assert t.prefill_rows(0, 2.0) == 1024
    for _ in range(9):
        t.observe(0.010, 0, 3)
    t.observe(1.024, 1024, 0)                                        # a prompt row: 1 ms
    assert t.prefill_rows(3, 2.0) == 10
    assert t.prefill_rows(1020, 200.0) == 4                          # the rows left in a step


def test_a_request_of_more_choices_than_places_left_fails_instead_of_blocking(model, tokenizer):
    engine = Engine(model, tokenizer, max_concurrent_sequences=4)      # not started yet

    async def main():
        loop = asyncio.get_running_loop()
        wide = engine.submit(EngineRequest("wide", (1, 2), max_tokens=2, n=4), loop)
        after = engine.submit(EngineRequest("after", (1, 2), max_tokens=2), loop)
        engine.set_limits(2, 8)                   # SIGHUP lowered the limit meanwhile
        engine.start()
        return await _drain(wide), await _drain(after)
    wide, after = asyncio.run(main())
    engine.stop()
    assert [c["finish_reason"] for c in wide["choices"]] == ["error"] * 4
    assert after["choices"][0]["finish_reason"] == "length"
