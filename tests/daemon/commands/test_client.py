"""The daemon's clients end to end: `moed generate` / `chat` / `stats` / `pins` over the Unix
socket and the TCP address (--url, with its API key) of a real `moed serve`, and `moed demo`
(which starts its own).

The reference for every answer is the daemon's own non-streamed HTTP answer, and for
`generate` also the in-process `moed generate --model` (greedy, same prompt and budget).
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_proc import MOED, Daemon, free_port, short_dir

from daemon.commands.cli import main
from daemon.commands.client import (Client, DaemonError, DaemonUnavailableError, Target,
                                    completion_request, default_socket, target_from)
from daemon.commands.demo import DemoError, ServeProcess, default_cache_dir, default_model_dir
from ext.formats.checkpoint import Checkpoint
from ext.makemodel import make_model

PROMPT = "def fibonacci(n):"
TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("client") / "model", arch="qwen3_moe", layers=4,
                      experts=16, top_k=4, hidden=128, intermediate=64)


@pytest.fixture(scope="module")
def daemon(model_dir):
    d = Daemon(model_dir, short_dir(), "--expert-cache-bytes", "2M",
               "--tcp-address", "127.0.0.1:0", env={"MOED_API_KEY": "k"})
    yield d
    assert d.stop() == 0
    d.cleanup()


def completion(daemon: Daemon, **body) -> dict:
    """The daemon's non-streamed answer (the reference)."""
    status, answer = daemon.json("POST", "/v1/chat/completions" if "messages" in body
                                 else "/v1/completions", {"stream": False, **body})
    assert status == 200, answer
    return answer


def completion_text(daemon: Daemon, **body) -> str:
    choice = completion(daemon, **body)["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def moed(*args: str, input: str | None = None,
         env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed `moed` console script, as a user runs it."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    environ.update(env or {})
    return subprocess.run([MOED, *args], input=input, capture_output=True, text=True,
                          env=environ, timeout=300)


# ---------------------------------------------------------------------- generate


def test_generate_over_the_socket_streams_what_the_daemon_and_in_process_generate(
        daemon, model_dir, capsys):
    expected = completion(daemon, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    text = expected["choices"][0]["text"]
    assert expected["usage"]["completion_tokens"] == TOKENS and text
    proc = moed("generate", "--socket", daemon.socket, "--max-tokens", str(TOKENS), PROMPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == text + "\n"
    [finished] = [e for e in map(json.loads, proc.stderr.splitlines())
                  if e["event"] == "generation_finished"]
    assert finished["completion_tokens"] == TOKENS and finished["socket"] == daemon.socket
    # the in-process mode (greedy by default) gives the same text
    assert main(["generate", "--model", str(model_dir), "--max-tokens", str(TOKENS), PROMPT]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_generate_chat_over_the_socket_matches_in_process(daemon, model_dir, capsys, monkeypatch):
    text = completion_text(daemon, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                           temperature=0)
    monkeypatch.setenv("MOED_SOCKET", daemon.socket)         # the default socket
    assert main(["generate", "--chat", "--max-tokens", "12", "hi"]) == 0
    assert capsys.readouterr().out == text + "\n"
    assert main(["generate", "--model", str(model_dir), "--chat", "--max-tokens", "12", "hi"]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_generate_passes_the_sampling_flags(daemon, capsys):
    def generate(*flags: str) -> str:
        assert main(["generate", "--socket", daemon.socket, "--max-tokens", "16", *flags, "x"]) == 0
        return capsys.readouterr().out.removesuffix("\n")

    greedy = completion_text(daemon, prompt="x", max_tokens=16, temperature=0)
    sampled = completion_text(daemon, prompt="x", max_tokens=16, temperature=1.5, seed=3)
    assert sampled != greedy
    assert generate("--temperature", "1.5", "--seed", "3") == sampled
    assert generate("--temperature", "1.5", "--seed", "4") != sampled
    # top_k 1 leaves only the most likely token: greedy again
    assert generate("--temperature", "1.5", "--seed", "3", "--top-k", "1") == greedy
    nucleus = completion_text(daemon, prompt="x", max_tokens=16, temperature=1.5, seed=3,
                              top_p=0.3)
    assert nucleus != sampled
    assert generate("--temperature", "1.5", "--seed", "3", "--top-p", "0.3") == nucleus
    assert generate("--max-tokens", "5") == completion_text(daemon, prompt="x", max_tokens=5,
                                                             temperature=0)


def test_the_client_streams_pieces_as_they_arrive(daemon):
    reference = completion(daemon, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    pieces: list[str] = []

    async def ask():
        async with Client(Target.unix(daemon.socket)) as client:
            return await client.stream("/v1/completions", completion_request(
                prompt=PROMPT, max_tokens=TOKENS, temperature=0), pieces.append)
    result = asyncio.run(ask())
    assert len(pieces) > 1                       # more than one event, in order
    assert "".join(pieces) == result.text == reference["choices"][0]["text"]
    assert result.finish_reason == "length"
    assert result.completion_tokens == TOKENS
    assert 0 < result.time_to_first_text_s <= result.duration_s


def test_a_daemon_error_is_one_line_and_exit_1(daemon, capsys):
    assert main(["generate", "--socket", daemon.socket, "--temperature", "3", "hi"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "moed generate: error: 'temperature' must be in [0.0, 2.0], got 3.0 (HTTP 400)\n"


def test_in_process_options_without_model_are_usage_errors(daemon, model_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--socket", daemon.socket, "--threads", "2", "--no-prefetch", "hi"])
    assert e.value.code == 2
    assert "--threads, --no-prefetch only apply with --model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--socket", daemon.socket, "--model", str(model_dir), "hi"])
    assert e.value.code == 2
    assert "give one" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--url", "http://127.0.0.1:1", "--api-key", "k", "--model",
              str(model_dir), "hi"])
    assert e.value.code == 2
    assert ("--url, --api-key (asking the daemon) and --model (generating in this process) do "
            "not go together: give one") in capsys.readouterr().err


def test_a_refused_socket_names_the_path(tmp_path):
    dead = str(tmp_path / "dead.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(dead)                 # bound, never listening: connections are refused
    s.close()
    proc = moed("generate", "--socket", dead, "hello")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == (f"moed generate: error: cannot connect to the moed daemon at {dead}: "
                           "nothing is listening on it; is moed serve running? (choose another "
                           "socket with --socket PATH or $MOED_SOCKET)\n")
    missing = str(tmp_path / "missing.sock")
    proc = moed("stats", env={"MOED_SOCKET": missing})
    assert proc.returncode == 1
    assert f"at {missing}: the socket does not exist; is moed serve running?" in proc.stderr


def test_the_default_socket():
    assert default_socket({}) == "/run/moed/moed.sock"
    assert default_socket({"MOED_SOCKET": "/x/y.sock"}) == "/x/y.sock"
    assert default_socket({"MOED_SOCKET": ""}) == "/run/moed/moed.sock"


def test_the_client_error_for_a_missing_socket_is_typed(tmp_path):
    async def ask():
        async with Client(Target.unix(str(tmp_path / "none.sock"))) as client:
            await client.get("/health")
    with pytest.raises(DaemonUnavailableError, match="none.sock: the socket does not exist"):
        asyncio.run(ask())


# ---------------------------------------------------------------------- chat


def test_chat_from_a_pipe_keeps_the_conversation(daemon):
    system = {"role": "system", "content": "Be brief."}
    first = [system, {"role": "user", "content": "hello"}]
    a1 = completion_text(daemon, messages=first, max_tokens=10, temperature=0)
    second = first + [{"role": "assistant", "content": a1},
                      {"role": "user", "content": "and then?"}]
    a2 = completion_text(daemon, messages=second, max_tokens=10, temperature=0)
    alone = completion_text(daemon, messages=[system, {"role": "user", "content": "and then?"}],
                            max_tokens=10, temperature=0)
    assert a2 != alone           # the history changes the answer, so the test can tell
    proc = moed("chat", "--socket", daemon.socket, "--system", "Be brief.", "--max-tokens", "10",
                input="hello\n\nand then?\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == a1 + "\n" + a2 + "\n"
    assert proc.stderr == ""     # no banner or prompts when stdin is not a terminal


def test_chat_json_writes_one_object_per_answer_even_when_answers_hold_newlines(daemon):
    first = [{"role": "user", "content": "hello"}]
    a1 = completion_text(daemon, messages=first, max_tokens=24, temperature=0)
    second = first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "more"}]
    a2 = completion_text(daemon, messages=second, max_tokens=24, temperature=0)
    proc = moed("chat", "--socket", daemon.socket, "--max-tokens", "24", "--json",
                input="hello\nmore\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    answers = [json.loads(x) for x in lines]
    assert [(a["message"], a["answer"]) for a in answers] == [("hello", a1), ("more", a2)]
    assert all(a["finish_reason"] in ("length", "stop") for a in answers)


def test_chat_reset_and_exit(daemon, capsys, monkeypatch):
    a1 = completion_text(daemon, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                         temperature=0)
    again = completion_text(daemon, messages=[{"role": "user", "content": "hello"},
                                              {"role": "assistant", "content": a1},
                                              {"role": "user", "content": "hello"}],
                            max_tokens=8, temperature=0)
    assert again != a1
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/reset\nhello\n/exit\nhello\n"))
    assert main(["chat", "--socket", daemon.socket, "--max-tokens", "8"]) == 0
    # after /reset the same question gets the first answer; nothing after /exit
    assert capsys.readouterr().out == a1 + "\n" + a1 + "\n"


def test_chat_stops_at_the_first_daemon_error_when_piped(daemon, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n"))
    assert main(["chat", "--socket", daemon.socket, "--temperature", "2.5"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "moed chat: error: 'temperature' must be in [0.0, 2.0], got 2.5 (HTTP 400)\n"


# ---------------------------------------------------------------------- stats, pins


def test_stats_and_pins_print_the_daemons_json(daemon, model_dir, capsys):
    completion(daemon, prompt="abc", max_tokens=4, temperature=0)
    _, direct = daemon.json("GET", "/v1/moed/stats")
    assert main(["stats", "--socket", daemon.socket]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["requests"]["total"] == direct["requests"]["total"] > 0
    assert stats["experts"] == direct["experts"] and stats["experts"]["misses"] > 0
    assert stats["memory"]["budget_bytes"] == 2 * 2**20

    # Whether the pin learner has pinned anything yet depends on its time budget (a share
    # of the decode time): the command prints what the daemon holds, whatever that is.
    _, held = daemon.json("GET", "/v1/moed/pins")
    assert main(["pins", "--socket", daemon.socket]) == 0
    pins = json.loads(capsys.readouterr().out)
    with Checkpoint(model_dir) as checkpoint:
        assert pins == held and pins["model_fingerprint"] == checkpoint.fingerprint()
    assert isinstance(pins["pins"], list)
    assert main(["pins", "--socket", daemon.socket, "--reset"]) == 0
    assert json.loads(capsys.readouterr().out) == {"reset": True, "pins_dropped": len(held["pins"])}
    _, after = daemon.json("GET", "/v1/moed/pins")
    assert after["pins"] == []


# ---------------------------------------------------------------------- over TCP: --url


def tcp_url(daemon: Daemon) -> str:
    return "http://" + daemon.wait_event("tcp_listening")["address"]


def test_generate_chat_stats_and_pins_over_the_url_with_the_key(daemon):
    url = tcp_url(daemon)
    text = completion_text(daemon, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    proc = moed("generate", "--url", url, "--api-key", "k", "--max-tokens", str(TOKENS), PROMPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == text + "\n"
    [finished] = [e for e in map(json.loads, proc.stderr.splitlines())
                  if e["event"] == "generation_finished"]
    assert finished["url"] == url and "socket" not in finished

    # $MOED_URL and $MOED_API_KEY instead of the flags; a trailing slash is fine
    answer = completion_text(daemon, messages=[{"role": "user", "content": "hello"}],
                             max_tokens=10, temperature=0)
    env = {"MOED_URL": url + "/", "MOED_API_KEY": "k"}
    proc = moed("chat", "--max-tokens", "10", input="hello\n", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == answer + "\n"
    proc = moed("stats", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["requests"]["total"] >= 2
    # the flag wins over $MOED_SOCKET, and the key is not needed on the socket
    proc = moed("pins", "--url", url, env={"MOED_SOCKET": "/nonexistent.sock",
                                           "MOED_API_KEY": "k"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == daemon.json("GET", "/v1/moed/pins")[1]

    # the admin call: the daemon refuses it over TCP, and the client says so
    proc = moed("pins", "--reset", env=env)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (f"moed pins: error: the moed daemon at {url} takes --reset (an admin "
                           "call) only over its Unix socket, from its own user or root, never "
                           "over TCP: run moed pins --reset --socket PATH on its machine "
                           "(HTTP 403)\n")


def test_over_the_url_a_missing_or_wrong_key_says_how_to_give_it(daemon):
    url = tcp_url(daemon)
    proc = moed("generate", "--url", url, "hello")
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (f"moed generate: error: the moed daemon at {url} asks for an API "
                           "key: give it with --api-key KEY or $MOED_API_KEY (HTTP 401)\n")
    proc = moed("stats", "--url", url, env={"MOED_API_KEY": "wrong"})
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (f"moed stats: error: the moed daemon at {url} refused the API key "
                           "(--api-key or $MOED_API_KEY): give the key it serves with (HTTP "
                           "401)\n")


def test_over_the_url_nothing_listening_plain_http_and_bad_urls_are_one_line(daemon):
    url = f"http://127.0.0.1:{free_port()}"
    proc = moed("chat", "--url", url, input="hello\n")
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (f"moed chat: error: cannot connect to the moed daemon at {url}: "
                           "nothing is listening on it; is moed serve running with "
                           "--tcp-address there? (choose another address with --url URL or "
                           "$MOED_URL)\n")
    # https to the daemon's own port, which speaks plain HTTP
    https = tcp_url(daemon).replace("http://", "https://")
    proc = moed("stats", "--url", https, "--api-key", "k")
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"moed stats: error: cannot connect to the moed daemon at "
                                  f"{https}: TLS failed (")
    assert "moed serve itself speaks plain HTTP: use http://, or a TLS proxy" in proc.stderr
    for bad in ("127.0.0.1:8000", "ftp://h:1", "http://:80", "http://h:99999", "http://u:p@h:1",
                "http://h:1/?q=1"):
        with pytest.raises(ValueError, match="^--url: "):
            target_from(url=bad, environ={})


def test_socket_and_url_together_are_a_usage_error(daemon):
    proc = moed("stats", "--socket", daemon.socket, "--url", tcp_url(daemon))
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.endswith("moed stats: error: argument --url: not allowed with argument "
                                "--socket\n")
    proc = moed("stats", env={"MOED_SOCKET": daemon.socket, "MOED_URL": tcp_url(daemon)})
    assert proc.returncode == 2
    assert proc.stderr.endswith("moed stats: error: $MOED_URL and $MOED_SOCKET are both set: "
                                "unset one, or choose with --url or --socket\n")


def test_the_target_from_flags_and_environment():
    assert target_from(environ={}) == Target.unix("/run/moed/moed.sock")
    assert target_from(environ={"MOED_URL": "", "MOED_SOCKET": "/s"}) == Target.unix("/s")
    url = target_from(environ={"MOED_URL": "https://moed.example/v/", "MOED_API_KEY": "sekrit"})
    assert (url.url, url.api_key, url.base_url) == ("https://moed.example/v", "sekrit",
                                                     "https://moed.example/v")
    assert url.headers() == {"Authorization": "Bearer sekrit"}
    assert "sekrit" not in repr(url)
    flag = target_from(url="http://[::1]:8000", api_key="f", environ={"MOED_API_KEY": "k"})
    assert (flag.url, flag.headers()) == ("http://[::1]:8000", {"Authorization": "Bearer f"})
    # the key never goes over the socket
    socket_target = target_from(socket="/s", environ={"MOED_URL": "http://h:1",
                                                       "MOED_API_KEY": "k"})
    assert socket_target.socket == "/s" and socket_target.headers() == {}
    with pytest.raises(ValueError, match="^\\$MOED_URL: expected http://HOST:PORT"):
        target_from(environ={"MOED_URL": "localhost:8000"})


def test_a_connection_closed_by_the_server_names_the_url():
    async def ask():
        async def hang_up(reader, writer):
            await reader.readline()
            writer.close()
        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, Client(Target.http(f"http://127.0.0.1:{port}")) as client:
            await client.get("/v1/moed/stats")
    with pytest.raises(DaemonError) as e:
        asyncio.run(ask())
    assert not isinstance(e.value, DaemonUnavailableError)
    assert str(e.value).startswith("the moed daemon at http://127.0.0.1:")
    assert " closed the connection: " in str(e.value)


# ---------------------------------------------------------------------- demo


# A counted figure shows one value when every start of the mode had it, else its median
# and range (prefetches that end in another order on a loaded machine move it).
_SPREAD = r"(?: \([^)]*\))?"
ROW = re.compile(r"^(naive LRU, cold|moed, restarted) +(\d+\.\d) \((\d+\.\d)-(\d+\.\d)\) +"
                 rf"(\d+) KiB{_SPREAD} +"
                 rf"(\d+\.\d) %{_SPREAD} +(\d+\.\d) %{_SPREAD} +(\d+) KiB{_SPREAD}$", re.M)
SOCKET = re.compile(r"starts of moed serve on (\S+),")


def demo_rows(stdout: str) -> dict[str, tuple[float, float, float, int, float, float, int]]:
    """name -> (tokens/s median, min, max, KiB read per token, answer hit rate %, prompt hit
    rate %, KiB read before the request); the counted figures' columns show one value, as
    they do when they were the same in every start."""
    return {m[0]: (float(m[1]), float(m[2]), float(m[3]), int(m[4]), float(m[5]), float(m[6]),
                   int(m[7]))
            for m in ROW.findall(stdout)}


def demo_answer(stdout: str) -> str:
    return stdout.split("\n\n(the default model is tiny, ")[0].split("\n", 1)[1]


def test_demo_compares_moed_restarted_with_its_learned_state_against_the_naive_cache(tmp_path):
    """A learning start, then the naive cache and moed restarted with what it learned,
    alternately, experts read from disk. Which is faster is not asserted (the demo must say
    whichever it measured); what is asserted is that the words say what the figures say."""
    (tmp_path / "demo-state").mkdir()
    (tmp_path / "demo-state" / "usage-stale.json").write_text("{}")   # emptied by the demo
    (tmp_path / "other.txt").write_text("kept")                       # the rest of --dir is not
    proc = moed("demo", "--dir", str(tmp_path), "--max-tokens", "32", "--repeats", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert (tmp_path / "other.txt").read_text() == "kept"
    assert out.startswith("the model: moed's embedded default model, a small Mixture-of-Experts "
                          "(qwen3_moe, 8 MoE layers of 32 experts, 4 per token) trained on the "
                          "Python standard library; it completes Python code\n")
    answer = demo_answer(out)
    assert answer.startswith('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    assert answer.strip() != 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""'
    assert ("\n\n(the default model is tiny, 15 MB: its completions are plausible-looking "
            "Python, not correct code, and chat with it is meaningless)\n\n") in out
    assert re.search(r"^expert cache budget: 3\.2 MiB for 13\.0 MiB of routed experts \(25 %\); "
                     r"the shards' page cache was dropped \(POSIX_FADV_DONTNEED\)", out, re.M)
    learning = re.search(r"^learning run \(another prompt and 128 tokens, not comparable with the "
                         r"rows below\): (\d+\.\d) tokens/s, (\d+) KiB read/token, answer hit "
                         r"rate (\d+\.\d) %, prompt hit rate (\d+\.\d) %$", out, re.M)
    assert learning, out
    assert "the same prompt and seed, 32 tokens, 2 starts of each, alternately:" in out
    rows = demo_rows(out)
    assert list(rows) == ["naive LRU, cold", "moed, restarted"], out
    naive, warm = rows.values()
    for median, low, high, read_kib, hit, prompt_hit, _ in rows.values():
        assert 0 < low <= median <= high and read_kib > 0 and 0 < hit < 100
        assert 0 <= prompt_hit <= 100
    assert naive[5] == 0.0                    # a cold cache: the prompt's lookups all miss
    assert naive[6] == 0                      # nothing learned: nothing read early
    assert warm[6] > 0                        # the learned state was read back and used
    # the verdict lines agree with the table (rounding of the shown figures aside)
    counted = re.search(r"^moed restarted with what it learned, against the naive cache: bytes "
                        r"read per token (.*); answer hit rate ([+-]\d+\.\d) points; prompt hit "
                        r"rate ([+-]\d+\.\d) points \(the same in every start of each mode", out,
                        re.M)
    assert counted, out
    if warm[3] != naive[3]:
        assert counted.group(1).endswith("(MORE read on this machine)" if warm[3] > naive[3]
                                         else "(less read)"), counted.group(1)
    assert abs(float(counted.group(2)) - (warm[4] - naive[4])) <= 0.11
    assert abs(float(counted.group(3)) - (warm[5] - naive[5])) <= 0.11
    speed = re.search(r"^speed, which this machine's load moves: tokens/s (.*)$", out, re.M)
    assert speed, out
    if warm[1] > naive[2]:
        assert "(faster: " in speed.group(1)
    elif warm[2] < naive[1]:
        assert "(SLOWER on this machine: " in speed.group(1)
    else:
        assert speed.group(1).startswith("within the noise ("), speed.group(1)
    warm_line = re.search(r"^warm start: each restart found the state the learning run saved, by "
                          r"the model's fingerprint: the experts its cache held when it stopped "
                          r"and their usage counts, from which it read those experts \((\d+) KiB\) "
                          r"before the request, so the prompt's "
                          r"lookups hit (\d+\.\d) %, against (\d+\.\d) % for the naive cache; "
                          r"(.*)$", out, re.M)
    assert warm_line, out
    assert int(warm_line.group(1)) == warm[6]
    assert (float(warm_line.group(2)), float(warm_line.group(3))) == (warm[5], naive[5])
    assert re.search(r"^not compared: the page-cache \(mmap\) mode", out, re.M)
    assert proc.stderr.count(": daemon ready in ") == 5                 # 1 + 2 * 2 starts
    assert not os.path.exists(SOCKET.search(proc.stderr).group(1))    # the daemons are gone
    assert '"event"' not in proc.stderr                                 # their logs stayed quiet
    # the naive cache and moed answer the same: placement changes speed, never output
    assert "answers to the same prompt and seed differed" not in proc.stderr
    # the state the restarts read back is the learning run's, by fingerprint
    with Checkpoint(default_model_dir()) as checkpoint:
        fingerprint = checkpoint.fingerprint()
    saved = [p.name for p in (tmp_path / "demo-state").glob("usage-*.json")]
    assert saved == [f"usage-{fingerprint[:16]}.json"], saved


def test_demo_refuses_a_directory_that_is_not_a_model(tmp_path):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "tokenizer.json").write_text("{}")
    proc = moed("demo", "--dir", str(tmp_path / "state"), "--model", str(not_a_model))
    assert proc.returncode == 1
    assert f"moed demo: error: the model in {not_a_model} cannot be served" in proc.stderr
    assert "neither model.safetensors.index.json nor model.safetensors found" in proc.stderr
    missing = moed("demo", "--dir", str(tmp_path / "state"), "--model", str(tmp_path / "nope"))
    assert missing.returncode == 2                  # a --model that does not exist: usage
    assert f"moed demo: error: --model: {tmp_path / 'nope'} does not exist" in missing.stderr


def test_demo_keep_serves_until_interrupted(tmp_path):
    proc = subprocess.Popen([MOED, "demo", "--dir", str(tmp_path), "--keep", "--max-tokens", "8",
                             "--repeats", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "press Ctrl-C to stop it" in line:
                break
        socket_path = SOCKET.search("".join(lines)).group(1)
        assert f"moed chat --socket {socket_path}" in "".join(lines)
        stats = moed("stats", "--socket", socket_path)
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["requests"]["total"] == 1     # the shown question
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "moed, restarted 2/2: stopping the daemon (SIGTERM)" in err
    assert list(demo_rows(out)) == ["naive LRU, cold", "moed, restarted"]
    assert not os.path.exists(socket_path)


def test_a_failing_daemon_shows_its_last_log_lines():
    script = "import sys; print('loading'); print('boom: no model', file=sys.stderr); sys.exit(3)"

    async def start():
        serve = ServeProcess([sys.executable, "-c", script], os.environ)
        await serve.start()
        await serve.wait_event("ready", timeout=60)
    with pytest.raises(DemoError) as e:
        asyncio.run(start())
    assert str(e.value) == ("moed serve exited with code 3 before it was ready; its last log "
                            "lines:\n  boom: no model")


def test_the_default_cache_dir():
    assert default_cache_dir({"XDG_CACHE_HOME": "/c", "HOME": "/h"}) == Path("/c/moed")
    assert default_cache_dir({"XDG_CACHE_HOME": "relative", "HOME": "/h"}) == Path("/h/.cache/moed")
    assert default_cache_dir({"HOME": "/h"}) == Path("/h/.cache/moed")


def _figures(name, tokens_per_s, bytes_per_token, answer_hits, start_bytes=0, prompt_hits=0,
             pins_at_start=0, pins_at_end=0):
    from daemon.commands.demo import RunFigures
    return RunFigures(name=name, text="", tokens=100, duration_s=100 / tokens_per_s,
                      bytes_read=100 * bytes_per_token, start_bytes_read=start_bytes,
                      prompt_hits=prompt_hits, prompt_misses=10 - prompt_hits,
                      answer_hits=answer_hits, answer_misses=100 - answer_hits,
                      pins_at_start=pins_at_start, pins_at_end=pins_at_end)


def _summary(naive_speeds, warm_speeds, warm_bytes=5000, naive_bytes=10000, warm_hits=47,
             learned_pins=0):
    """The demo's summary for made-up starts: the learning run, then naive and restarted moed
    alternately, as `demo_runs` orders them."""
    from daemon.commands.demo import CacheBudget, summary_lines
    runs = [_figures("moed learning", 90.0, 8000, 45, pins_at_end=learned_pins)]
    for naive_speed, warm_speed in zip(naive_speeds, warm_speeds, strict=True):
        runs.append(_figures("naive LRU, cold", naive_speed, naive_bytes, 40))
        runs.append(_figures("moed, restarted", warm_speed, warm_bytes, warm_hits,
                             start_bytes=4096, prompt_hits=3, pins_at_start=learned_pins))
    budget = CacheBudget(cache_bytes=2**20, expert_bytes=2**22, minimum_bytes=2**19, slots=4,
                         experts=16)
    return summary_lines(runs, budget, "direct")


def _line(lines, start):
    return next(line for line in lines if line.startswith(start))


@pytest.mark.parametrize("naive_speeds, warm_speeds, said", [
    # every moed start faster than every naive one: faster
    ((100.0, 110.0, 105.0), (120.0, 150.0, 130.0),
     "tokens/s 1.24x (faster: every moed start was faster than every naive one)"),
    # every moed start slower: slower
    ((100.0, 110.0, 105.0), (80.0, 90.0, 99.9),
     "tokens/s 0.86x (SLOWER on this machine: every moed start was slower than every naive one)"),
    # medians 1.33x apart, but one slow moed start overlaps the naive range: noise
    ((100.0, 110.0, 105.0), (140.0, 147.0, 104.0),
     "tokens/s within the noise (1.33x of the medians 140.0 and 105.0, but the ranges "
     "104.0-147.0 and 100.0-110.0 overlap)"),
    # medians 0.89x apart (one run each would have said SLOWER): noise
    ((100.0, 130.0, 120.0), (107.0, 125.0, 101.0),
     "tokens/s within the noise (0.89x of the medians 107.0 and 120.0, but the ranges "
     "101.0-125.0 and 100.0-130.0 overlap)"),
])
def test_the_demo_calls_a_speed_difference_only_when_the_ranges_do_not_overlap(
        naive_speeds, warm_speeds, said):
    lines = _summary(naive_speeds, warm_speeds)
    assert _line(lines, "speed, ") == f"speed, which this machine's load moves: {said}"


@pytest.mark.parametrize("warm_bytes, warm_hits, said", [
    (5000, 47, "bytes read per token 0.50x (less read); answer hit rate +7.0 points"),
    (20000, 30, "bytes read per token 2.00x (MORE read on this machine); answer hit rate "
                "-10.0 points"),
    # counted figures are exact: 1 % less is less, not "about the same"
    (9900, 40, "bytes read per token 0.99x (less read); answer hit rate +0.0 points"),
    (10000, 40, "bytes read per token the same; answer hit rate +0.0 points"),
])
def test_the_demo_heads_with_the_counted_figures_whichever_way(warm_bytes, warm_hits, said):
    lines = _summary((100.0, 101.0), (100.5, 99.0), warm_bytes=warm_bytes, warm_hits=warm_hits)
    assert _line(lines, "moed restarted") == (
        f"moed restarted with what it learned, against the naive cache: {said}; prompt hit "
        "rate +30.0 points (the same in every start of each mode: they follow from the prompt, "
        "the seed and the cache, not from the machine's speed)")
    # the counted figures come before the speed, which here is noise
    assert lines.index(_line(lines, "moed restarted")) < lines.index(_line(lines, "speed, "))
    assert "within the noise" in _line(lines, "speed, ")


def test_the_demo_says_when_counted_figures_varied_between_starts():
    from daemon.commands.demo import CacheBudget, summary_lines
    runs = [_figures("moed learning", 90.0, 8000, 45),
            _figures("naive LRU, cold", 100.0, 10000, 40),
            _figures("moed, restarted", 100.0, 5000, 47),
            _figures("naive LRU, cold", 100.0, 10000, 40),
            _figures("moed, restarted", 100.0, 9000, 47)]
    budget = CacheBudget(cache_bytes=2**20, expert_bytes=2**22, minimum_bytes=2**19, slots=4,
                         experts=16)
    lines = summary_lines(runs, budget, "direct")
    counted = _line(lines, "moed restarted")
    assert counted.startswith("moed restarted with what it learned, against the naive cache: "
                              "bytes read per token 0.70x (less read);"), counted
    assert counted.endswith("(they varied between starts of a mode (prefetches ending in another "
                            "order), so these are medians)")
    assert re.search(r"^moed, restarted +100\.0 +7 KiB \(5 KiB-9 KiB\) ", "\n".join(lines), re.M)


def test_the_demo_table_shows_medians_ranges_and_the_learning_run_apart():
    lines = _summary((100.0, 200.0, 150.0), (120.0, 180.0, 130.0))
    assert "expert cache budget: 1.0 MiB for 4.0 MiB of routed experts (25 %)" in lines[0]
    assert "experts with O_DIRECT, so every miss is read from disk" in lines[0]
    assert lines[1] == ("learning run (another prompt and 100 tokens, not comparable with the "
                        "rows below): 90.0 tokens/s, 8 KiB read/token, answer hit rate 45.0 %, "
                        "prompt hit rate 0.0 %")
    assert lines[2] == "the same prompt and seed, 100 tokens, 3 starts of each, alternately:"
    assert lines[3:6] == [
        "                 tokens/s median (min-max)  read/token  answer hit rate  prompt hit rate"
        "  read before request",
        "naive LRU, cold        150.0 (100.0-200.0)      10 KiB           40.0 %            0.0 %"
        "                0 KiB",
        "moed, restarted        130.0 (120.0-180.0)       5 KiB           47.0 %           30.0 %"
        "                4 KiB"]


@pytest.mark.parametrize("pins, said", [
    (0, "no experts were pinned: pins come only when the tuner finds that they pay, and in "
        "the learning run it found they did not"),
    (6, "6 experts were pinned at start (the learning run ended with 6 pins, which its tuner "
        "found pay)"),
])
def test_the_demo_says_what_the_restart_took_from_the_learning_run(pins, said):
    lines = _summary((100.0, 101.0), (100.5, 99.0), learned_pins=pins)
    assert _line(lines, "warm start: ") == (
        "warm start: each restart found the state the learning run saved, by the model's "
        "fingerprint: the experts its cache held when it stopped and their usage counts, from "
        "which it read those experts (4 KiB) before the request, so the prompt's lookups hit "
        f"30.0 %, against 0.0 % for the naive cache; {said}")


def test_demo_repeats_must_be_at_least_two():
    from daemon.commands.demo import at_least_two, demo_runs
    with pytest.raises(argparse.ArgumentTypeError):
        at_least_two("1")
    assert at_least_two("3") == 3
    runs = demo_runs(16, 3)
    assert [(r.mode, r.learned, r.shown) for r in runs] == (
        [("moed", False, False)] + [("naive", False, False), ("moed", True, False)] * 2
        + [("naive", False, False), ("moed", True, True)])
    assert runs[0].max_tokens == 64 and {r.max_tokens for r in runs[1:]} == {16}
