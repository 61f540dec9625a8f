"""The usage-statistics file (daemon/store/state.py): round trip, crash safety, bad files set
aside, two writers merging, where the state directory is."""
from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.store.state import FAULT_STEPS, VERSION, StateStore, default_state_dir

ROOT = Path(__file__).resolve().parents[3]
FP = "0123456789abcdef" + "f" * 48  # a sha256-sized model fingerprint
OTHER_FP = "0123456789abcdef" + "e" * 48  # same file name, another model
WAIT = 60  # seconds: a bound on subprocesses, not a sleep


def _set_aside(state_dir: Path, kind: str) -> list[Path]:
    return sorted(state_dir.glob(f"usage-{FP[:16]}.json.{kind}-*"))


def test_round_trip_and_file_format(tmp_path):
    state_dir = tmp_path / "new" / "state"
    store = StateStore(state_dir, FP, clock=lambda: 1_700_000_000.5)
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    assert store.load() is None
    seen = []

    def first(current):
        seen.append(current)
        return {"counts": [[1.5, 0.0], [2.0, 3.25]], "half_life_tokens": 512}

    written = store.save(first, tokens=7)
    assert store.path == state_dir / f"usage-{FP[:16]}.json"
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    doc = json.loads(store.path.read_text())
    assert doc == {"version": VERSION, "fingerprint": FP, "written_unix": 1_700_000_000.5,
                   "tokens": 7, "payload": {"counts": [[1.5, 0.0], [2.0, 3.25]],
                                            "half_life_tokens": 512}}
    assert store.load() == doc["payload"]
    assert store.load_record() == written
    # A second save sees the first payload and adds its tokens to the running total.
    store.save(lambda current: seen.append(current) or {"n": 2}, tokens=5)
    assert seen == [None, doc["payload"]]
    assert store.load_record().tokens == 12
    assert sorted(p.name for p in state_dir.iterdir()) == [f"usage-{FP[:16]}.json",
                                                            f"usage-{FP[:16]}.lock"]


def test_save_calls_the_fault_hook_at_each_step_in_order(tmp_path):
    steps = []
    StateStore(tmp_path, FP, _fault=steps.append).save(lambda _: {})
    assert steps == list(FAULT_STEPS) == ["tmp_written", "fsynced", "renamed"]


def test_a_payload_json_cannot_hold_is_refused_and_the_old_file_kept(tmp_path):
    store = StateStore(tmp_path, FP)
    store.save(lambda _: {"x": 1})
    with pytest.raises(ValueError):
        store.save(lambda _: {"x": float("nan")})
    with pytest.raises(TypeError, match="not a dict"):
        store.save(lambda _: [1, 2])
    with pytest.raises(ValueError, match="tokens"):
        store.save(lambda _: {}, tokens=-1)
    assert store.load() == {"x": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"usage-{FP[:16]}.json",
                                                           f"usage-{FP[:16]}.lock"]


KILL_SCRIPT = r"""
import os, signal, sys
from pathlib import Path
from daemon.store.state import StateStore
state_dir, fingerprint, step = sys.argv[1:4]
def fault(name):
    if name == step:
        os.kill(os.getpid(), signal.SIGKILL)
StateStore(Path(state_dir), fingerprint, _fault=fault).save(
    lambda current: {"generation": "new", "seen": current}, tokens=3)
"""


@pytest.mark.parametrize("had_old_file", [True, False], ids=["over-old", "first-write"])
@pytest.mark.parametrize("step", FAULT_STEPS)
def test_kill_9_during_save_leaves_the_old_or_the_new_file(tmp_path, step, had_old_file, log_records):
    store = StateStore(tmp_path, FP)
    old = {"generation": "old"}
    if had_old_file:
        store.save(lambda _: old, tokens=10)
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path), FP, step],
                          cwd=ROOT, capture_output=True, text=True, timeout=WAIT)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    new = {"generation": "new", "seen": old if had_old_file else None}
    records = log_records("moed.state")
    record = store.load_record()
    assert [r for r in records if r["level"] != "debug"] == []  # nothing torn, nothing set aside
    if step == "renamed":
        assert (record.payload, record.tokens) == (new, 3 + 10 * had_old_file)
    elif had_old_file:
        assert (record.payload, record.tokens) == (old, 10)
    else:
        assert record is None
    # The dead writer's lock is gone and its temp file is cleaned up by the next save.
    store.save(lambda current: {"after": current})
    assert store.load() == {"after": None if record is None else record.payload}
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"usage-{FP[:16]}.json",
                                                           f"usage-{FP[:16]}.lock"]


def _good_file(tmp_path: Path) -> bytes:
    StateStore(tmp_path, FP).save(lambda _: {"counts": list(range(50))}, tokens=4)
    return (tmp_path / f"usage-{FP[:16]}.json").read_bytes()


CORRUPT = {
    "not-json": lambda good: b"{not json",
    "truncated": lambda good: good[: len(good) // 2],
    "empty": lambda good: b"",
    "not-utf8": lambda good: b"\xff\xfe\x00",
    "not-an-object": lambda good: b"[1, 2]",
    "payload-not-object": lambda good: good.replace(b'"payload":{', b'"payload":[{')
                                           .replace(b"]}}", b"]}]}"),
    "negative-tokens": lambda good: good.replace(b'"tokens":4', b'"tokens":-4'),
    "no-written-unix": lambda good: good.replace(b'"written_unix"', b'"written"'),
    "nested-too-deep": lambda good: b'{"version": 1, "x": ' + b"[" * 100000 + b"]" * 100000 + b"}",
}


@pytest.mark.parametrize("kind", CORRUPT)
def test_a_corrupt_file_is_set_aside_with_a_warning(tmp_path, kind, log_records):
    bad = CORRUPT[kind](_good_file(tmp_path))
    store = StateStore(tmp_path, FP, clock=lambda: 0.0)
    store.path.write_bytes(bad)
    records = log_records("moed.state")
    assert store.load() is None
    assert not store.path.exists()
    [aside] = _set_aside(tmp_path, "corrupt")
    assert aside.name == f"usage-{FP[:16]}.json.corrupt-19700101T000000.000000Z"
    assert aside.read_bytes() == bad  # kept for a human to look at
    [warning] = records
    assert warning["level"] == "warning" and warning["event"] == "state_file_set_aside"
    assert warning["path"] == str(store.path) and warning["moved_to"] == str(aside)
    # Learning starts fresh; a second bad file at the same instant gets its own name.
    store.path.write_bytes(bad)
    seen = []
    store.save(lambda current: seen.append(current) or {"fresh": True})
    assert seen == [None] and store.load() == {"fresh": True}
    assert [p.name for p in _set_aside(tmp_path, "corrupt")] == [aside.name, aside.name + "-1"]


@pytest.mark.parametrize("change", ["fingerprint", "version"])
def test_a_foreign_file_is_set_aside_not_trusted(tmp_path, change, log_records):
    good = json.loads(_good_file(tmp_path))
    if change == "fingerprint":
        good["fingerprint"] = OTHER_FP
    else:
        good["version"] = VERSION + 1
    store = StateStore(tmp_path, FP)
    store.path.write_text(json.dumps(good))
    records = log_records("moed.state")
    assert store.load() is None
    [aside] = _set_aside(tmp_path, "foreign")
    assert json.loads(aside.read_text()) == good
    assert _set_aside(tmp_path, "corrupt") == []
    assert any(r["kind"] == "foreign" and change in r["reason"] for r in records)
    assert store.load() is None and not store.path.exists()


WRITER_SCRIPT = r"""
import sys
from pathlib import Path
from daemon.store.state import StateStore
state_dir, fingerprint, name, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
store = StateStore(Path(state_dir), fingerprint)
print("ready", flush=True)
assert sys.stdin.readline() == "go\n"
def add_one(current):
    payload = dict(current or {})
    payload["total"] = payload.get("total", 0) + 1
    payload[name] = payload.get(name, 0) + 1
    return payload
for _ in range(rounds):
    store.save(add_one, tokens=2)
"""


def test_two_writers_merge_without_losing_an_update(tmp_path):
    rounds = 80
    writers = [subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(tmp_path), FP,
                                 name, str(rounds)], cwd=ROOT, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name in ("a", "b")]
    try:
        for w in writers:  # both are up before either starts writing
            assert w.stdout.readline() == "ready\n"
        for w in writers:
            w.stdin.write("go\n")
            w.stdin.flush()
        for w in writers:
            _, err = w.communicate(timeout=WAIT)
            assert w.returncode == 0, err
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
                w.communicate()
    record = StateStore(tmp_path, FP).load_record()
    assert record.payload == {"total": 2 * rounds, "a": rounds, "b": rounds}
    assert record.tokens == 2 * 2 * rounds


def test_default_state_dir_follows_systemd_then_xdg_then_home():
    assert default_state_dir({"STATE_DIRECTORY": "/var/lib/moed:/var/lib/moed-extra",
                              "XDG_STATE_HOME": "/x", "HOME": "/h"}) == Path("/var/lib/moed")
    assert default_state_dir({"XDG_STATE_HOME": "/x", "HOME": "/h"}) == Path("/x/moed")
    assert default_state_dir({"XDG_STATE_HOME": "rel", "HOME": "/h"}) == Path(
        "/h/.local/state/moed")  # a relative XDG path is invalid and ignored
    assert default_state_dir({"STATE_DIRECTORY": "", "HOME": "/h"}) == Path(
        "/h/.local/state/moed")
    assert default_state_dir({}) == Path(pwd.getpwuid(os.getuid()).pw_dir) / ".local/state/moed"


def test_fingerprint_must_name_a_model(tmp_path):
    with pytest.raises(ValueError, match="16"):
        StateStore(tmp_path, "abc")
