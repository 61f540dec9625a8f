"""response_format compiles are bounded (daemon/workers/grammar.py): a schema whose compile
never ends is a 400 naming the limit within the timeout, in a worker whose memory is capped;
a schema no value satisfies is a 400 at validation; compiled schemas are reused; compiles
fill no pool other requests need, and shutdown does not wait for them.

Every daemon here also runs under an address-space limit of its own (prlimit), so that
even a daemon that compiled in-process (as moed did before) could not take the machine."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

import pytest
import tools
from daemon_proc import Daemon, short_dir

from ext.makemodel import make_model

TIMEOUT_S = 2.0                 # grammar_compile_timeout_s of these daemons
MARGIN_S = 3.0                  # answer, kill, a loaded machine
WORKER_MEMORY = "512M"          # grammar_compile_memory_bytes
DAEMON_AS = 3 << 30             # the whole daemon's address space (the safety net)
PROMPT = [5, 6, 7]


def bomb(n: int, salt: str = "") -> dict:
    """An allOf of `n` `.*x.*` patterns: llguidance's compile doubles with each one."""
    letters = [chr(97 + i % 26) + str(i // 26 or "") for i in range(n)]
    return {"type": "json_schema", "json_schema": {"name": "bomb", "schema": {
        "allOf": [{"type": "string", "pattern": f".*{salt}{x}.*"} for x in letters]}}}


def _complete(daemon: Daemon, response_format: dict | None = None, **extra) -> tuple[int, dict]:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    if response_format is not None:
        body["response_format"] = response_format
    return daemon.json("POST", "/v1/completions", body, timeout=120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("grammar") / "model", arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=4)


def _start(model_dir, *args, env: dict | None = None) -> Daemon:
    return Daemon(model_dir, short_dir(), "--threads", "1", "--log-level", "debug",
                  "--grammar-compile-memory-bytes", WORKER_MEMORY, *args,
                  launcher=(tools.path("prlimit"), f"--as={DAEMON_AS}"), env=env)


@pytest.fixture(scope="module")
def daemon(model_dir):
    d = _start(model_dir, "--grammar-compile-timeout-s", str(TIMEOUT_S))
    try:
        yield d
        assert d.stop() == 0
    finally:
        d.cleanup()


pytestmark = pytest.mark.tools("prlimit")


def test_the_bomb_is_a_400_naming_the_limit_within_the_timeout(daemon):
    mark = daemon.mark()
    started = time.monotonic()
    status, body = _complete(daemon, bomb(30))
    took = time.monotonic() - started
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "response_format" and error["code"] == "grammar_compile_limit"
    assert "grammar_compile_timeout_s" in error["message"]
    assert took < TIMEOUT_S + MARGIN_S
    killed = daemon.wait_event("grammar_compile_killed", from_index=mark)
    capped = daemon.wait_event("grammar_compile_memory")         # logged at the start
    assert capped["configured_memory_bytes"] == 512 << 20 and capped["workers"] == 2
    assert 0 < capped["memory_bytes"] <= 512 << 20 and capped["room_bytes"] is not None
    assert killed["memory_bytes"] == capped["memory_bytes"] and killed["ended"] == "signal 9"
    assert _complete(daemon)[0] == 200                     # the daemon goes on


def test_a_normal_schema_works_and_its_second_use_hits_the_cache(daemon):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}}
    mark = daemon.mark()
    texts = []
    for _ in range(2):
        status, body = _complete(daemon, fmt, max_tokens=40)
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "stop"
        texts.append(json.loads(body["choices"][0]["text"]))
    assert texts[0] == texts[1] and set(texts[0]) == {"n"} and 0 <= texts[0]["n"] <= 9
    compiled = [e for e in daemon.events[mark:] if e["event"] == "grammar_compiled"]
    assert len(compiled) == 1, compiled                    # the second request: the cache


def test_a_schema_no_value_satisfies_is_a_400_at_validation(daemon):
    status, body = _complete(daemon, {"type": "json_schema",
                                      "json_schema": {"name": "r", "schema": {"$ref": "#"}}})
    assert status == 400, body
    error = body["error"]
    assert error["param"] == "response_format"
    assert "no JSON value satisfies it" in error["message"]
    assert "<state>" not in error["message"] and "Parser" not in error["message"]


def test_a_plain_completion_is_not_held_up_by_bomb_compiles(daemon):
    """Eight different bombs at once (more than asyncio's default pool has threads here),
    from one client: one compiles (a client holds one slot at a time), a few wait on the
    event loop, the rest are refused at once; a plain completion sent while a compile runs
    is answered before any bomb that waited is."""
    mark = daemon.mark()
    answers: list[tuple[str, int, dict]] = []
    lock = threading.Lock()

    def send(name, fmt):
        status, body = _complete(daemon, fmt)
        with lock:
            answers.append((name, status, body))

    bombs = [threading.Thread(target=send, args=(f"bomb{i}", bomb(30, salt=str(i))))
             for i in range(8)]
    for t in bombs:
        t.start()
    with daemon._cond:
        assert daemon._cond.wait_for(lambda: sum(e["event"] == "grammar_compile_started"
                                                 for e in daemon.events[mark:]) >= 1, 30)
    plain = threading.Thread(target=send, args=("plain", None))
    plain.start()
    plain.join(60)
    for t in bombs:
        t.join(60)
    assert len(answers) == 9
    names = [name for name, _, _ in answers]
    at = names.index("plain")
    assert answers[at][1] == 200, answers
    waited = 0
    for i, (name, status, body) in enumerate(answers):
        if name == "plain":
            continue
        assert status in (400, 429), (name, body)         # the timeout, or no slot in time
        message = body["error"]["message"]
        if "compiles of this client wait" in message:     # refused at once: not waiting
            continue
        # The bomb ends at whichever bound it meets first: the deadline, or on a loaded
        # machine (where the deadline buys less CPU) the address-space cap.
        assert "grammar_compile_timeout_s" in message or "grammar_compile_memory_bytes" in message, \
            message
        if "grammar_compile_timeout_s" in message:
            assert i > at, answers                          # plain before each that waited
        waited += 1
    assert waited >= 2

def test_sigterm_during_a_long_compile_exits_promptly(model_dir):
    """Three bombs whose compiles would run 60 s, from one client: one compiles, two wait
    for a slot (a client holds one at a time).
    SIGTERM ends the daemon at once, the workers with it, and every client is answered
    503 (or sees its connection close)."""
    d = _start(model_dir, "--grammar-compile-timeout-s", "60")
    try:
        mark = d.mark()
        results: list = []

        def send(i):
            try:
                results.append(_complete(d, bomb(30, salt=str(i))))
            except OSError as e:          # the connection closed as the daemon stopped
                results.append(e)
        clients = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for c in clients:
            c.start()
        with d._cond:
            assert d._cond.wait_for(lambda: sum(e["event"] == "grammar_compile_started"
                                                for e in d.events[mark:]) >= 1, 30)
        pids = [e["pid"] for e in d.events[mark:] if e["event"] == "grammar_compile_started"]
        started = time.monotonic()
        assert d.stop(timeout=30) == 0
        assert time.monotonic() - started < 10.0
        for c in clients:
            c.join(30)
        assert len(results) == 3
        assert all(isinstance(r, OSError) or r[0] == 503 for r in results), results
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)             # the workers are gone too
    finally:
        d.cleanup()


def test_the_workers_memory_limit_is_a_400_naming_it(model_dir):
    """In-process (no daemon): a worker of 260 MB address space meets the bomb's growth
    before its 30 s deadline; the error names grammar_compile_memory_bytes."""
    from daemon.workers.grammar import GrammarLimitError, Grammars
    from ext.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_model_dir(model_dir)
    grammars = Grammars(tokenizer, tokenizer.vocab_size, frozenset(), timeout_s=30.0,
                        memory_bytes=260 << 20)

    async def run():
        return await grammars.compile(grammars.spec(bomb(30)))
    try:
        with pytest.raises(GrammarLimitError, match="grammar_compile_memory_bytes"):
            asyncio.run(run())
        assert grammars.killed == 1
    finally:
        grammars.close()


def test_the_cache_is_bounded_and_identical_compiles_run_once(model_dir, monkeypatch):
    """In-process: CACHE_ENTRIES compiled schemas are kept, the least recently used goes
    first; concurrent requests for one schema share its compile."""
    from daemon.workers import grammar
    from ext.tokenizer import Tokenizer
    monkeypatch.setattr(grammar, "CACHE_ENTRIES", 2)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    grammars = grammar.Grammars(tokenizer, tokenizer.vocab_size, frozenset(), timeout_s=10.0)

    def fmt(i):
        return {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": [i]}}}

    async def run():
        specs = [grammars.spec(fmt(i)) for i in range(3)]
        await asyncio.gather(*(grammars.compile(specs[0]) for _ in range(4)))
        assert (grammars.misses, grammars.hits) == (1, 0)        # one compile for four
        await grammars.compile(specs[1])
        await grammars.compile(specs[0])                          # a hit: now the newest
        await grammars.compile(specs[2])                          # evicts specs[1]
        assert (grammars.misses, grammars.hits) == (3, 1)
        await grammars.compile(specs[0])
        await grammars.compile(specs[1])
        assert (grammars.misses, grammars.hits) == (4, 2)
        constraint = (await grammars.compile(specs[2]))()
        assert constraint.mask().any() and not constraint.done()
    try:
        asyncio.run(run())
    finally:
        grammars.close()


def _grammars(model_dir, **kwargs):
    from daemon.workers.grammar import Grammars
    from ext.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_model_dir(model_dir)
    return Grammars(tokenizer, tokenizer.vocab_size, frozenset(), **kwargs)


def test_workers_are_the_oom_killers_first_choice(model_dir):
    """Every worker (grammar compiles, chat templates) sets its oom_score_adj to 1000, so
    that in a small memory cgroup the kernel kills a worker, not the daemon."""
    from daemon.workers.process import WorkerProcess
    grammars = _grammars(model_dir)
    template = WorkerProcess([sys.executable, "-m", "daemon.workers.template_worker",
                              str(256 << 20)], 256 << 20)
    try:
        grammars.start()
        assert template.wait_ready(60)
        pids = [w.proc.pid for w in grammars._idle] + [template.proc.pid]
        assert len(pids) == 2
        for pid in pids:
            with open(f"/proc/{pid}/oom_score_adj") as f:
                assert f.read().strip() == "1000", pid
        with open("/proc/self/oom_score_adj") as f:
            assert f.read().strip() != "1000"                # the daemon's is its own
    finally:
        template.kill()
        grammars.close()


def test_a_worker_killed_mid_compile_is_a_400_saying_so(model_dir):
    """A compile process killed by SIGKILL before its deadline (what the OOM killer does)
    is reported as killed, not as grammar_compile_memory_bytes, and not cached."""
    import signal
    from daemon.workers.grammar import GrammarKilledError
    grammars = _grammars(model_dir, timeout_s=30.0, memory_bytes=512 << 20)
    grammars.start()
    [worker] = grammars._idle

    async def run():
        spec = grammars.spec(bomb(30))
        task = asyncio.ensure_future(grammars.compile(spec))
        await asyncio.sleep(1.0)                             # the bomb runs for 30 s
        assert not task.done() and worker.proc.poll() is None
        os.kill(worker.proc.pid, signal.SIGKILL)
        with pytest.raises(GrammarKilledError) as caught:
            await task
        return spec, str(caught.value)
    try:
        started = time.monotonic()
        spec, message = asyncio.run(run())
        assert time.monotonic() - started < 10.0
        assert "killed (signal 9)" in message and "memory limit of the machine" in message
        assert "grammar_compile_memory_bytes" not in message
        assert spec.key not in grammars._cache
    finally:
        grammars.close()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _enum(j: int, n: int) -> dict:
    """A distinct schema of `n` strings: ~10 bytes of JSON and ~300 bytes of matcher each."""
    return {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "enum": [f"w{j}_{i:06d}" for i in range(n)]}}}


def test_the_cache_is_charged_what_its_matchers_hold(model_dir, monkeypatch):
    """In-process (the process holding the cache is this one): distinct large enum schemas
    are charged what their matchers hold (~1.5 MB each, not the 4096 a reused worker's
    resident growth gave), the charged bytes stay within CACHE_BYTES by evicting the
    least recently used, and this process's resident size stops growing near that budget
    (before: every schema stayed, ~2 MB of resident memory each)."""
    from daemon.workers import grammar
    budget, n = 16 << 20, 48
    monkeypatch.setattr(grammar, "CACHE_BYTES", budget)
    grammars = _grammars(model_dir, timeout_s=30.0)

    async def run():
        for j in range(n):
            await grammars.compile(grammars.spec(_enum(j, 5000)))
            assert grammars._cache_bytes <= budget
    try:
        grammars.start()
        asyncio.run(grammars.compile(grammars.spec(_enum(-1, 5000))))   # allocator warm
        before = _rss_bytes()
        asyncio.run(run())
        grown = _rss_bytes() - before
        costs = [e.cost for e in grammars._cache.values()]
        assert all(c >= 1 << 20 for c in costs), costs
        assert sum(costs) == grammars._cache_bytes <= budget
        assert 4 <= len(costs) <= budget // (1 << 20) < n
        assert grown < 3 * budget, grown                     # 48 schemas cached: ~100 MB
    finally:
        grammars.close()


def test_a_large_matcher_is_used_but_not_cached_and_a_larger_one_refused(model_dir,
                                                                          monkeypatch):
    """A matcher above CACHE_BYTES / CACHE_ENTRY_FRACTION serves its request and is not
    kept; one above memory_bytes / COMPILED_FRACTION is a 400 naming
    grammar_compile_memory_bytes, before the daemon compiles it."""
    from daemon.workers import grammar
    monkeypatch.setattr(grammar, "CACHE_BYTES", 8 << 20)       # entries up to 1 MiB
    grammars = _grammars(model_dir, timeout_s=30.0, memory_bytes=512 << 20)

    async def run():
        spec = grammars.spec(_enum(0, 5000))                    # ~1.5 MB
        constraint = (await grammars.compile(spec))()
        assert constraint.mask().any()
        assert spec.key not in grammars._cache and grammars._cache_bytes == 0
        monkeypatch.setattr(grammar, "COMPILED_FRACTION", 256)      # up to 2 MiB
        mark = grammars.misses
        with pytest.raises(grammar.GrammarLimitError, match="grammar_compile_memory_bytes"):
            await grammars.compile(grammars.spec(_enum(1, 10000)))     # ~3 MB
        with pytest.raises(grammar.GrammarLimitError, match="grammar_compile_memory_bytes"):
            await grammars.compile(grammars.spec(_enum(1, 10000)))     # the refusal is cached
        assert grammars.misses == mark + 1
    try:
        asyncio.run(run())
    finally:
        grammars.close()



def test_an_anyof_past_llguidances_row_limit_is_a_400_at_validation(model_dir):
    """In-process, the default limits: an anyOf of 4000 objects (a ~37 MB matcher, within
    1/16 of the default 1 GiB). Its first mask is fine, and llguidance's row limit (2000
    items) fails only when a token is consumed; the worker consumes the first tokens, so
    the compile is refused with llguidance's message (a 400), not a 500 at the first
    token. The refusal is a verdict on the schema: cached."""
    from daemon.workers.grammar import GrammarError, GrammarLimitError
    grammars = _grammars(model_dir)
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": {"anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(4000)]}}}

    async def run():
        spec = grammars.spec(fmt)
        for _ in range(2):
            with pytest.raises(GrammarError) as caught:
                await grammars.compile(spec)
            assert not isinstance(caught.value, GrammarLimitError)
            message = str(caught.value)
            assert "Current row has 4000 items; max is 2000" in message, message
            assert "<non-verbose/>" not in message
        assert (grammars.misses, grammars.hits) == (1, 1)
    try:
        asyncio.run(run())
    finally:
        grammars.close()


def test_a_clients_bombs_hold_one_slot_and_another_clients_schema_compiles_promptly(
        model_dir):
    """In-process, two slots: client A sends three bombs at once, then client B a small
    schema. A holds one slot (its other bombs wait), so B's compile takes the other at once
    and is done long before A's first bomb times out (before: A's bombs held both slots
    and B's compile waited out timeout_s, a 429)."""
    from daemon.workers.grammar import GrammarError
    timeout_s = 6.0
    grammars = _grammars(model_dir, timeout_s=timeout_s, workers=2)
    small = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": [1, 2]}}}

    async def run():
        await asyncio.get_running_loop().run_in_executor(None, grammars.start)
        await asyncio.get_running_loop().run_in_executor(None, grammars.start)   # 2 idle
        bombs = [asyncio.ensure_future(grammars.compile(grammars.spec(bomb(30, salt=str(i))),
                                                        ("ip", "192.0.2.1")))
                 for i in range(3)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert grammars._slots.held(("ip", "192.0.2.1")) == 1
        assert grammars._slots.waiting(("ip", "192.0.2.1")) == 2
        started = time.monotonic()
        factory = await grammars.compile(grammars.spec(small), ("ip", "192.0.2.2"))
        took = time.monotonic() - started
        assert factory().mask().any()
        assert not any(b.done() for b in bombs)             # A's first bomb still runs
        grammars.close()
        outcomes = await asyncio.gather(*bombs, return_exceptions=True)
        assert all(isinstance(o, GrammarError) for o in outcomes), outcomes
        return took
    try:
        took = asyncio.run(run())
        assert took < timeout_s / 2, took
    finally:
        grammars.close()


def test_a_schema_that_timed_out_is_refused_at_once_for_a_while(model_dir, monkeypatch):
    """In-process, with a clock of its own: a bomb that ran out of time is refused again at
    once (no second compile) until TIMED_OUT_S have passed, then compiled again; the record
    keeps TIMED_OUT_ENTRIES schemas."""
    from daemon.workers import grammar
    monkeypatch.setattr(grammar, "TIMED_OUT_ENTRIES", 1)
    now = [1000.0]
    grammars = _grammars(model_dir, timeout_s=1.0, clock=lambda: now[0])

    async def run():
        spec = grammars.spec(bomb(30))
        with pytest.raises(grammar.GrammarTimeoutError, match="grammar_compile_timeout_s"):
            await grammars.compile(spec)
        assert grammars.misses == 1
        now[0] += grammar.TIMED_OUT_S - 1
        started = time.monotonic()
        with pytest.raises(grammar.GrammarTimeoutError, match="not tried again"):
            await grammars.compile(spec)
        assert time.monotonic() - started < 0.5 and grammars.misses == 1
        now[0] += 1
        with pytest.raises(grammar.GrammarTimeoutError, match="grammar_compile_timeout_s"):
            await grammars.compile(spec)                    # compiled (and timed out) again
        assert grammars.misses == 2
        other = grammars.spec(bomb(30, salt="o"))
        with pytest.raises(grammar.GrammarTimeoutError):
            await grammars.compile(other)
        assert list(grammars._timed_out) == [other.key]     # the oldest went
    try:
        asyncio.run(run())
    finally:
        grammars.close()


def test_the_workers_memory_cap_is_what_the_memory_plan_reserves(model_dir, monkeypatch):
    """In-process load, with a reading of a 400 MiB memory cgroup (faked through the
    function the planner reads the machine with): the plan reserves each of the two
    compile workers its start and headroom (grammar.compile_reserve_bytes) besides its 5%
    margin (20 MiB), and each worker's cap is half of both, not grammar_compile_memory_bytes
    (1 GiB: two of them would take more than the cgroup has) nor half the margin alone
    (10 MiB: before, no worker started and every response_format was a 400)."""
    from daemon.machine.memory import MemoryReading
    from daemon.service import loading
    from daemon.workers import grammar
    from daemon.service.config import ServeConfig
    from scheduler.planner import CgroupLimit
    limit = 400 << 20
    reading = MemoryReading(64 << 30, (CgroupLimit("/fake", 2, limit, 0, 0),))
    monkeypatch.setattr(loading, "read_memory", lambda: reading)
    config = ServeConfig(model=str(model_dir), tuner="off", threads=1,
                         prefix_cache_bytes=16 << 20)
    loaded = loading.load_for_serving(config, {})
    try:
        grammars = loaded.grammars
        margin = int(loading.MARGIN_FRACTION * limit)
        reserve = grammar.compile_reserve_bytes(1 << 30, grammars.vocab_size,
                                                (model_dir / "tokenizer.json").stat().st_size)
        assert grammars.configured_memory_bytes == 1 << 30
        assert grammars.memory_room_bytes == margin + reserve
        assert grammars.memory_bytes == (margin + reserve) // 2
        assert grammars.memory_bytes >= grammars.floor_bytes + grammar.COMPILE_HEADROOM_BYTES
        make = asyncio.run(grammars.compile(grammars.spec({"type": "json_object"})))
        assert make().mask().any()
    finally:
        loaded.close()


def test_with_an_expert_cache_set_the_workers_still_get_the_plans_share(model_dir, monkeypatch):
    """expert_cache_bytes set and within what the plan leaves it (8 of the 16 experts), in
    a 560 MiB cgroup (faked): the workers' room is the plan's margin and reserve, not what
    the reading leaves after the caches' budgets (560 MiB less the 512 MiB prefix cache:
    24 MiB a worker, too little to start one), so json_object compiles."""
    from daemon.machine.memory import MemoryReading
    from daemon.service import loading
    from daemon.workers import grammar
    from daemon.service.config import ServeConfig
    from scheduler.planner import CgroupLimit
    limit = 560 << 20
    reading = MemoryReading(64 << 30, (CgroupLimit("/fake", 2, limit, 0, 0),))
    monkeypatch.setattr(loading, "read_memory", lambda: reading)
    slot = loading.plan_serving_memory(model_dir, max_concurrent_sequences=4, pin_fraction=0,
                                       reading=reading).plan.slot_bytes
    config = ServeConfig(model=str(model_dir), tuner="off", threads=1, expert_cache_bytes=8 * slot)
    loaded = loading.load_for_serving(config, {})
    try:
        grammars = loaded.grammars
        assert loaded.session.options.cache_bytes == 8 * slot        # not clamped
        reserve = grammar.compile_reserve_bytes(1 << 30, grammars.vocab_size,
                                                (model_dir / "tokenizer.json").stat().st_size)
        assert grammars.memory_room_bytes == int(loading.MARGIN_FRACTION * limit) + reserve
        assert grammars.memory_bytes >= grammars.floor_bytes
        make = asyncio.run(grammars.compile(grammars.spec({"type": "json_object"})))
        assert make().mask().any()
    finally:
        loaded.close()


def test_a_worker_that_dies_at_start_says_how_and_under_what_cap(model_dir, monkeypatch):
    """A cap below a worker's start: a warning when it is set (structured output is
    unavailable, and why), and a compile's 400 says the worker ended as it started (its
    exit, the cap in force, what it needs), not that it "did not start within 60 s"."""
    from daemon.workers import grammar
    warnings = []
    monkeypatch.setattr(grammar.log, "warning", lambda event, **f: warnings.append((event, f)))
    grammars = _grammars(model_dir, memory_bytes=8 << 20)
    try:
        [(event, fields)] = warnings
        assert event == "grammar_unavailable" and fields["memory_bytes"] == 8 << 20
        assert fields["worker_floor_bytes"] == grammars.floor_bytes > 8 << 20
        assert "response_format other than text is refused" in fields["reason"]
        with pytest.raises(grammar.GrammarLimitError) as caught:
            asyncio.run(grammars.compile(grammars.spec({"type": "json_object"})))
        message = str(caught.value)
        assert "ended as it started (exit code 1, after" in message, message
        assert f"under an address-space cap of {8 << 20} bytes" in message
        assert f"needs about {grammars.floor_bytes} bytes to start" in message
        assert "within 60 s" not in message
    finally:
        grammars.close()


def test_a_memory_error_names_the_lowered_cap(model_dir):
    """A bomb in a worker capped at half of a 400 MiB room (not the configured 1 GiB): the
    400 names the 200 MiB it ran into, and the configured value it replaced."""
    from daemon.workers.grammar import GrammarLimitError
    grammars = _grammars(model_dir, timeout_s=30.0, memory_room_bytes=400 << 20)
    assert grammars.memory_bytes == 200 << 20
    try:
        with pytest.raises(GrammarLimitError) as caught:
            asyncio.run(grammars.compile(grammars.spec(bomb(30))))
        message = str(caught.value)
        assert f"needed more than {200 << 20} bytes" in message, message
        assert f"grammar_compile_memory_bytes {1 << 30}, lowered to {200 << 20}" in message
    finally:
        grammars.close()


def test_the_room_without_a_plan_is_what_the_reading_leaves_less_the_caches():
    """expert_cache_bytes set (no plan): the room is the tightest bound of the reading less
    the caches' budgets (they fill later), never below 0; None when nothing is known; with
    a plan, its margin."""
    from daemon.machine.memory import MemoryReading
    from daemon.service.loading import grammar_room_bytes
    from scheduler.planner import CgroupLimit
    cgroup = MemoryReading(64 << 30, (CgroupLimit("/fake", 2, 1 << 30, 300 << 20, 0),))
    assert grammar_room_bytes(None, 200 << 20, cgroup) == (1 << 30) - (500 << 20)
    assert grammar_room_bytes(None, 2 << 30, cgroup) == 0
    assert grammar_room_bytes(None, 0, MemoryReading(None, ())) is None
    assert grammar_room_bytes(20 << 20, 2 << 30, cgroup) == 20 << 20


def test_over_tcp_one_peers_bombs_leave_a_slot_for_another_peer(model_dir):
    """End to end, over TCP with one api_key for both: the peer at 127.0.0.2 sends three
    bombs, then the peer at 127.0.0.3 a small schema. The first peer's bombs hold one
    compile slot (the others wait), so the second's compile starts at once and its answer
    (200) comes long before the first bomb's timeout (before: the bombs held both slots
    and the small schema was a 429 after grammar_compile_timeout_s)."""
    import http.client
    timeout_s = 8.0
    d = _start(model_dir, "--grammar-compile-timeout-s", str(timeout_s),
               "--tcp-address", "127.0.0.1:0", env={"MOED_API_KEY": "k"})
    try:
        host, port = d.wait_event("tcp_listening")["address"].rsplit(":", 1)

        def complete(source: str, fmt: dict) -> tuple[int, dict]:
            conn = http.client.HTTPConnection(host, int(port), timeout=120,
                                              source_address=(source, 0))
            body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "response_format": fmt}
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Authorization": "Bearer k",
                                  "Content-Type": "application/json"})
            resp = conn.getresponse()
            out = resp.status, json.loads(resp.read())
            conn.close()
            return out

        mark = d.mark()
        bombs: list = []
        threads = [threading.Thread(target=lambda i=i: bombs.append(
            complete("127.0.0.2", bomb(30, salt=f"t{i}")))) for i in range(3)]
        for t in threads:
            t.start()
        with d._cond:
            assert d._cond.wait_for(lambda: sum(e["event"] == "grammar_compile_started"
                                                for e in d.events[mark:]) >= 1, 30)
        started = time.monotonic()
        small = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
        status, body = complete("127.0.0.3", small)
        took = time.monotonic() - started
        assert status == 200, body
        assert took < timeout_s / 2, took
        assert bombs == []                                   # none answered yet
        compiles = [e for e in d.events[mark:] if e["event"] == "grammar_compile_started"]
        assert len(compiles) == 2, compiles                  # one bomb, the small schema
        for t in threads:
            t.join(120)
        assert len(bombs) == 3
        assert all(s in (400, 429) for s, _ in bombs), bombs
    finally:
        assert d.stop() == 0
        d.cleanup()


def test_a_response_formats_objects_are_closed_unless_they_say_otherwise(model_dir):
    """json_schema: an object schema that lists properties takes no other key (as
    llama.cpp's and vLLM's grammars read it); json_object stays any object."""
    import llguidance

    from ext.tokenizer import Tokenizer
    grammars = _grammars(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    text = (model_dir / "tokenizer.json").read_text()
    ll = llguidance.LLTokenizer(text, n_vocab=tokenizer.vocab_size)
    listed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    try:
        for schema, answer, ok in ((listed, '{"a":1,"b":2}', False), (listed, '{"a":1}', True),
                                   ({**listed, "additionalProperties": True}, '{"a":1,"b":2}', True)):
            spec = grammars.spec({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
            m = llguidance.LLMatcher(ll, spec.grammar, log_level=0)
            took = all(m.consume_token(i) for i in tokenizer.encode(answer, add_special_tokens=False))
            assert (took and m.is_accepting()) is ok, (schema, answer)
        spec = grammars.spec({"type": "json_object"})
        m = llguidance.LLMatcher(ll, spec.grammar, log_level=0)
        assert all(m.consume_token(i) for i in tokenizer.encode('{"z":1}', add_special_tokens=False))
    finally:
        grammars.close()
