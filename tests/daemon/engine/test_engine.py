"""The engine thread: batching never changes a request's tokens; cancel, timeout, stops, limits."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from repacked_models import REPACKED, make_in_format

from daemon.engine.engine import Engine, EngineClosedError, EngineRequest, QueueFullError
from daemon.store.session import open_model
from daemon.store.streaming import minimum_cache_bytes
from ext.makemodel import make_model
from ext.models.model import Model
from ext.sampling import SamplingParams
from ext.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("engine") / "m", arch="qwen3_moe", layers=3, experts=8,
                      top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=5, initializer_range=0.2)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_model_dir(model_dir)


def _requests(n: int) -> list[EngineRequest]:
    out = []
    for i in range(n):
        prompt = tuple(1 + (i * 7 + j * 13) % 500 for j in range(3 + i % 5))
        sampling = SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9, top_k=0 if i % 2 else 20,
                                  seed=100 + i)
        out.append(EngineRequest(f"r{i}", prompt, max_tokens=6 + i % 4, sampling=sampling))
    return out


async def _drain(handle) -> tuple[str, list[int], str, object]:
    text, ids = [], []
    while True:
        ev = await handle.events.get()
        text.append(ev.text)
        ids.extend(ev.token_ids)
        if ev.finish_reason is not None:
            return "".join(text), ids, ev.finish_reason, ev.stats


def _run(engine: Engine, requests: list[EngineRequest]) -> list[tuple]:
    async def main():
        loop = asyncio.get_running_loop()
        handles = [engine.submit(r, loop) for r in requests]
        return await asyncio.gather(*(_drain(h) for h in handles))
    return asyncio.run(main())


def _engine(model, tokenizer, **kw) -> Engine:
    engine = Engine(model, tokenizer, **kw)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def model_dirs(model_dir, tmp_path_factory):
    """The fixture model in each stored format (same values before rounding)."""
    dirs = {"bf16": model_dir}
    for dtype in ("fp8", "mxfp4", *REPACKED):
        dirs[dtype] = make_in_format(tmp_path_factory.mktemp(f"engine-{dtype}") / "m", dtype,
                                     arch="qwen3_moe", layers=3, experts=8, top_k=2, hidden=64,
                                     intermediate=32, seed=5, initializer_range=0.2)
    return dirs


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "mxfp4", *REPACKED])
@pytest.mark.parametrize("streaming", [False, True])
def test_tokens_are_the_same_alone_and_in_company(model_dirs, tokenizer, streaming, dtype):
    """12 requests with mixed sampling: one at a time vs eight sharing each step, for
    every stored format of the experts."""
    model_dir = model_dirs[dtype]

    def load():
        if streaming:  # the smallest cache moed accepts: batch unions overflow it
            from daemon.store.plans import plans_for  # noqa: F401  (the budget helper reads plans)
            from ext.formats.checkpoint import Checkpoint
            from ext.models.config import load_config
            from ext.models.experts import ExpertLayout
            config = load_config(model_dir)
            minimum = minimum_cache_bytes(ExpertLayout(Checkpoint(model_dir), config), config)
            return open_model(model_dir, threads=2, cache_bytes=minimum, state_dir=None,
                              environ={"HOME": str(model_dir)}, numerics="exact")[0]
        return Model.load(model_dir, n_threads=2, numerics="exact")

    reqs = _requests(12)
    alone_engine = _engine(load(), tokenizer, max_concurrent_sequences=1)
    alone = [_run(alone_engine, [r])[0] for r in reqs]
    alone_engine.stop()
    together_engine = _engine(load(), tokenizer, max_concurrent_sequences=8)
    together = _run(together_engine, reqs)
    assert together_engine.decode_steps < sum(len(a[1]) for a in alone)   # steps were shared
    together_engine.stop()
    for a, t in zip(alone, together):
        assert t[1] == a[1] and t[0] == a[0] and t[2] == a[2] == "length"


def test_cancel_stops_a_request_before_its_next_step(model_dir, tokenizer):
    engine = _engine(Model.load(model_dir, n_threads=1), tokenizer)

    async def main():
        loop = asyncio.get_running_loop()
        req = EngineRequest("long", (1, 2, 3), max_tokens=100_000)
        handle = engine.submit(req, loop)
        for _ in range(3):
            await handle.events.get()
        handle.cancel()
        while (ev := await handle.events.get()).finish_reason is None:
            pass
        return ev
    ev = asyncio.run(main())
    assert ev.finish_reason == "cancelled"
    assert ev.stats.steps_after_cancel <= 1
    assert engine.wait_idle(10)
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (0, 0)
    engine.stop()


def test_deadline_ends_with_timeout(model_dir, tokenizer):
    now = [0.0]
    engine = _engine(Model.load(model_dir, n_threads=1), tokenizer, clock=lambda: now[0])

    async def main():
        handle = engine.submit(EngineRequest("t", (1, 2), max_tokens=100_000, deadline=5.0),
                               asyncio.get_running_loop())
        await handle.events.get()
        now[0] = 6.0
        while (ev := await handle.events.get()).finish_reason is None:
            pass
        return ev
    assert asyncio.run(main()).finish_reason == "timeout"
    engine.stop()


def test_stop_ids_and_stop_strings(model_dir, tokenizer):
    engine = _engine(Model.load(model_dir, n_threads=1), tokenizer)
    base = EngineRequest("s", (5, 6, 7), max_tokens=12)
    text, ids, reason, _ = _run(engine, [base])[0]
    assert reason == "length" and len(ids) == 12
    # A stop token: the first generated id ends the answer at once, emitting nothing.
    _, ids_stop, reason_stop, stats = _run(engine, [EngineRequest("s", (5, 6, 7), max_tokens=12,
                                                                  stop_ids=frozenset({ids[0]}))])[0]
    assert reason_stop == "stop" and ids_stop == [] and stats.completion_tokens == 0
    # A stop string taken from the middle of the text: output ends right before it.
    cut = next(c for c in range(len(text) // 2, len(text) - 1) if text.find(text[c:c + 2]) == c)
    got, _, reason_s, _ = _run(engine, [EngineRequest("s", (5, 6, 7), max_tokens=12,
                                                      stop_strings=("\x00never", text[cut:cut + 2]))])[0]
    assert reason_s == "stop" and got == text[:cut]
    engine.stop()


def test_queue_limits_and_closing(model_dir, tokenizer):
    engine = Engine(Model.load(model_dir, n_threads=1), tokenizer, max_concurrent_sequences=1,
                    max_queue=1)           # not started: nothing leaves the queue

    async def main():
        loop = asyncio.get_running_loop()
        engine.submit(EngineRequest("a", (1,), max_tokens=2), loop)   # takes the free place
        engine.submit(EngineRequest("b", (1,), max_tokens=2), loop)   # waits
        with pytest.raises(QueueFullError):
            engine.submit(EngineRequest("c", (1,), max_tokens=2), loop)
        engine.stop_accepting()
        with pytest.raises(EngineClosedError):
            engine.submit(EngineRequest("d", (1,), max_tokens=2), loop)
    asyncio.run(main())
    assert engine.stats().waiting == 2


@pytest.mark.parametrize("prompt,max_tokens,message", [
    ((), 4, "empty"), ((1,), 0, "max_tokens"), ((10**9,), 4, "token ids")])
def test_bad_requests_are_refused_at_submit(model_dir, tokenizer, prompt, max_tokens, message):
    engine = Engine(Model.load(model_dir, n_threads=1), tokenizer)

    async def main():
        with pytest.raises(ValueError, match=message):
            engine.submit(EngineRequest("x", prompt, max_tokens=max_tokens), asyncio.get_running_loop())
    asyncio.run(main())


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(model_dir, tokenizer):
    model = Model.load(model_dir, n_threads=1)
    real = model.forward_step
    calls = {"n": 0}

    def flaky(seqs, chunks):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(5, "Input/output error (injected)")
        return real(seqs, chunks)
    model.forward_step = flaky
    engine = _engine(model, tokenizer)
    first = _run(engine, [EngineRequest("f", (1, 2), max_tokens=5)])[0]
    assert first[2] == "error"
    second = _run(engine, [EngineRequest("g", (1, 2), max_tokens=5)])[0]
    assert second[2] == "length" and len(second[1]) == 5
    engine.stop()


def test_call_runs_between_steps_on_the_engine_thread(model_dir, tokenizer):
    import threading

    engine = _engine(Model.load(model_dir, n_threads=1), tokenizer)
    name = engine.call(lambda: threading.current_thread().name).result(10)
    assert name == "moed-engine"
    engine.stop()
    assert np.isfinite(engine.stats().tokens_per_second)


def test_a_read_error_in_a_batch_fails_only_the_row_that_needs_it(model_dir, tokenizer):
    """The failing step is retried row by row: step mates finish with their solo tokens."""
    reqs = _requests(3)
    alone_engine = _engine(Model.load(model_dir, n_threads=1), tokenizer)
    alone = [_run(alone_engine, [r])[0] for r in reqs]
    alone_engine.stop()

    model = Model.load(model_dir, n_threads=1)
    real = model.forward_step
    poisoned = []                                   # the sequence of request r1, once known

    def forward_step(seqs, chunks):
        if poisoned and poisoned[0] in seqs:
            raise OSError(5, "Input/output error (injected: expert of r1)")
        for seq, chunk in zip(seqs, chunks):        # learn which sequence is r1's (prompt)
            if list(np.asarray(chunk)) == list(reqs[1].prompt_ids):
                poisoned.append(seq)
        return real(seqs, chunks)
    model.forward_step = forward_step
    engine = _engine(model, tokenizer, max_concurrent_sequences=3)
    got = _run(engine, reqs)
    engine.stop()
    assert got[1][2] == "error"
    for i in (0, 2):
        assert got[i][:3] == alone[i][:3]


def test_nan_logits_fail_only_their_request(model_dir, tokenizer):
    model = Model.load(model_dir, n_threads=1)
    real = model.forward_step

    def forward_step(seqs, chunks):
        out = real(seqs, chunks)
        if all(len(c) == 1 for c in chunks):        # decode steps: the weights are corrupt
            out[0, :] = np.nan
        return out
    model.forward_step = forward_step
    engine = _engine(model, tokenizer, max_concurrent_sequences=1)
    first = _run(engine, [EngineRequest("nan", (1, 2), max_tokens=5)])[0]
    assert first[2] == "error" and len(first[1]) == 1     # the prefill's token, then NaN
    model.forward_step = real
    second = _run(engine, [EngineRequest("ok", (1, 2), max_tokens=5)])[0]
    assert second[2] == "length" and len(second[1]) == 5  # the engine thread lives on
    engine.stop()


def test_requests_cancelled_while_waiting_or_during_prefill_cost_no_more_prefill(model_dir, tokenizer):
    model = Model.load(model_dir, n_threads=1)
    real = model.forward_step
    chunks = []
    engine = Engine(model, tokenizer, max_concurrent_sequences=1)

    async def main():
        loop = asyncio.get_running_loop()
        waiting = engine.submit(EngineRequest("w", (1, 2, 3), max_tokens=4), loop)
        waiting.cancel()                            # gone before the engine saw it
        long = engine.submit(EngineRequest("p", tuple(range(1, 200)), max_tokens=4), loop)

        def forward_step(seqs, token_ids):
            chunks.append(sum(len(t) for t in token_ids))
            long.cancel()                           # the client leaves during the first chunk
            return real(seqs, token_ids)
        model.forward_step = forward_step
        engine.start()
        return await _drain(waiting), await _drain(long)
    (w, p) = asyncio.run(main())
    engine.stop()
    assert w[2] == "cancelled" and w[3].completion_tokens == 0
    assert p[2] == "cancelled" and p[3].completion_tokens == 0
    assert chunks == [64]                           # one chunk of 199 tokens, not all four


def test_a_failing_step_observer_changes_nothing(model_dir, tokenizer, log_records):
    def results(observer):
        model = Model.load(model_dir, n_threads=1)
        engine = _engine(model, tokenizer)
        if observer is not None:
            engine.step_observers.append(observer)
        try:
            return [(r[0], r[1], r[2]) for r in _run(engine, _requests(4))]
        finally:
            engine.stop()
            model.close()

    baseline = results(None)
    calls = []

    def observer(seconds, batch_size):
        calls.append(batch_size)
        if len(calls) in (2, 5):
            raise OSError("the tuner's check prompt hit a read error")
    records = log_records("moed.engine")
    assert results(observer) == baseline          # no retry, no failure, the same text
    assert max(calls) > 1                         # it saw batched steps
    assert sum(r["event"] == "step_observer_failed" for r in records) == 2


def test_the_context_allowed_bounds_prompts_answers_and_the_kv_cache(model_dir, tokenizer):
    """context_tokens (the memory plan's context): a prompt that leaves no room is refused,
    an answer stops with "length" at it, and the sequence's KV cache never grows past it."""
    model = Model.load(model_dir, n_threads=1)
    with pytest.raises(ValueError, match="context_tokens must be in"):
        Engine(model, tokenizer, context_tokens=model.config.max_position_embeddings + 1)
    engine = _engine(model, tokenizer, context_tokens=24)
    assert engine.context_tokens == 24
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="context of 24 tokens"):
            engine.submit(EngineRequest("long", tuple(range(1, 25)), max_tokens=4), loop)
    finally:
        loop.close()
    capacities = []
    new_sequence = model.new_sequence

    def spy(*args, **kw):
        seq = new_sequence(*args, **kw)
        capacities.append(seq.kv.max_capacity)
        return seq
    model.new_sequence = spy
    [(_, ids, reason, _)] = _run(engine, [EngineRequest("r", tuple(range(1, 11)), max_tokens=100)])
    assert reason == "length" and len(ids) == 24 - 10
    assert capacities == [24]
    engine.stop()
