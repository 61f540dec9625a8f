"""The prefix cache keeps one client's prompts from another (daemon/engine/prefix_cache.py).

The attack it closes: client A sends a secret prompt; client B sends guesses that start
the same way, and the guess whose `cached_tokens` (or time to first token) is larger is
the one that matches A's prompt further. Requests share cached blocks only with requests
of the same `cache_salt`; under `prefix_cache_scope = "client"` only with requests of the
same client (here two TCP peers, 127.0.0.2 and 127.0.0.3, with one api_key). The answers
are the same with and without reuse.
"""
from __future__ import annotations

import http.client
import json
import signal
from pathlib import Path

import pytest
from daemon_proc import Daemon, short_dir

from ext.makemodel import make_model

PROMPT = [(7 * i) % 200 + 3 for i in range(49)]    # three whole blocks before the last token
CACHED = (len(PROMPT) - 1) // 16 * 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("isolation") / "model", arch="qwen3_moe", layers=2,
                      experts=8, top_k=2, hidden=64, intermediate=32, dtype="bf16", seed=5)


def _start(model_dir, *args, env: dict | None = None) -> Daemon:
    return Daemon(model_dir, short_dir(), "--threads", "1", "--prefix-cache-bytes", "16M",
                  *args, env=env)


@pytest.fixture(scope="module")
def daemon(model_dir):
    d = _start(model_dir)
    try:
        yield d
        assert d.stop() == 0
    finally:
        d.cleanup()


def _complete(daemon: Daemon, prompt, **extra) -> dict:
    status, body = daemon.json("POST", "/v1/completions",
                               {"prompt": prompt, "max_tokens": 4, "temperature": 0, **extra},
                               timeout=120)
    assert status == 200, body
    return body


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_different_cache_salt_reuses_nothing_and_the_same_salt_reuses_its_blocks(daemon):
    prompt = [t + 1 for t in PROMPT]                        # not another test's tokens
    alice = _complete(daemon, prompt, cache_salt="alice-secret")
    bob = _complete(daemon, prompt, cache_salt="bob")
    unsalted = _complete(daemon, prompt)
    alice_again = _complete(daemon, prompt, cache_salt="alice-secret")
    assert [_cached(b) for b in (alice, bob, unsalted, alice_again)] == [0, 0, 0, CACHED]
    assert len({b["choices"][0]["text"] for b in (alice, bob, unsalted, alice_again)}) == 1
    # and unsalted requests still share with each other (prefix_cache_scope "shared")
    assert _cached(_complete(daemon, prompt)) == CACHED


def test_chat_completions_take_the_cache_salt_too(daemon):
    messages = [{"role": "user", "content": "internal notes for user alice, api token " * 6}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    answers = []
    for salt in ("a", "b", "a"):
        status, answer = daemon.json("POST", "/v1/chat/completions", {**body, "cache_salt": salt},
                                     timeout=120)
        assert status == 200, answer
        answers.append(answer)
    n = answers[0]["usage"]["prompt_tokens"]
    assert [_cached(a) for a in answers] == [0, 0, (n - 1) // 16 * 16]
    assert (n - 1) // 16 > 0
    assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1


@pytest.mark.parametrize("salt", [7, "", "x" * 257, ["a"], {"a": 1}, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_cache_salt_is_a_400_naming_it(daemon, path, salt):
    body = {"max_tokens": 2, "cache_salt": salt}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    status, answer = daemon.json("POST", path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == "cache_salt"
    assert "cache_salt" in answer["error"]["message"]


def test_the_longest_cache_salt_is_accepted(daemon):
    assert _cached(_complete(daemon, "hi", cache_salt="x" * 256)) == 0


def test_under_client_scope_tcp_peers_do_not_share_but_a_peer_shares_with_itself(model_dir):
    """Over TCP with one api_key for both peers: 127.0.0.3's request with the very tokens
    127.0.0.2 sent (and the same cache_salt) reuses nothing; 127.0.0.2's second one reuses
    its own blocks, as 127.0.0.3's does; the Unix socket's peer (a uid) is a client of its
    own. SIGHUP with the scope back to "shared" lets the peers share again."""
    workdir = short_dir()
    config = Path(workdir) / "moed.toml"
    config.write_text('prefix_cache_scope = "client"\n')
    d = Daemon(model_dir, workdir, "--threads", "1", "--prefix-cache-bytes", "16M",
               "--tcp-address", "127.0.0.1:0",
               env={"MOED_API_KEY": "k", "MOED_CONFIG": str(config)})
    try:
        host, port = d.wait_event("tcp_listening")["address"].rsplit(":", 1)

        def complete(source: str, **extra) -> dict:
            conn = http.client.HTTPConnection(host, int(port), timeout=120,
                                              source_address=(source, 0))
            body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Authorization": "Bearer k",
                                  "Content-Type": "application/json"})
            resp = conn.getresponse()
            status, answer = resp.status, json.loads(resp.read())
            conn.close()
            assert status == 200, answer
            return answer

        first = complete("127.0.0.2")
        other = complete("127.0.0.3")
        again = complete("127.0.0.2")
        other_again = complete("127.0.0.3")
        assert [_cached(a) for a in (first, other, again, other_again)] == [0, 0, CACHED, CACHED]
        salted = [complete(source, cache_salt="team") for source in ("127.0.0.2", "127.0.0.3")]
        assert [_cached(a) for a in salted] == [0, 0]       # the salt is combined, not instead
        assert _cached(complete("127.0.0.3", cache_salt="team")) == CACHED
        unix = [_complete(d, PROMPT) for _ in range(2)]
        assert [_cached(a) for a in unix] == [0, CACHED]
        texts = {a["choices"][0]["text"] for a in (first, other, again, other_again, *salted, *unix)}
        assert len(texts) == 1

        mark = d.mark()
        config.write_text('prefix_cache_scope = "shared"\n')
        d.signal(signal.SIGHUP)
        d.wait_event("reloaded", from_index=mark)
        shared = [complete(source) for source in ("127.0.0.2", "127.0.0.3")]
        assert [_cached(a) for a in shared] == [0, CACHED]   # the client-scoped blocks stay theirs
    finally:
        assert d.stop() == 0
        d.cleanup()
