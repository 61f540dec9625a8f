"""The usage state file's save from the event loop: moed's way (the whole atomic write —
lock, read-merge, temp file, fsync, rename, fsync of the directory — as one call on
another thread) against the same write step by step through aiofiles (each step its own
hop to aiofiles' executor). Interleaved rounds; per save: wall time, and the longest
the event loop went without running a ticker (its stall). JSON on stdout.

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python bench/state_io.py [--rounds 7] [--saves 50] [--dir DIR]

The daemon does not even run the save on the loop: its flusher hands `session.flush` to
the engine thread, which owns the usage counts (they change with every decode step).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiofiles  # noqa: E402
import aiofiles.os  # noqa: E402

from daemon.store.state import StateStore  # noqa: E402

PAYLOAD = {"counts": [[float(i * j % 97) for j in range(128)] for i in range(48)],
           "tokens_observed": 123456}       # a 48-layer, 128-expert model's usage


async def moed_save(store: StateStore) -> None:
    await asyncio.to_thread(store.save, lambda _current: PAYLOAD, tokens=10)


async def aiofiles_save(store: StateStore) -> None:
    """The same atomic write, one aiofiles (or executor) call per step, under the lock."""
    loop = asyncio.get_running_loop()
    lock = await loop.run_in_executor(None, os.open, store.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        import fcntl
        await loop.run_in_executor(None, fcntl.flock, lock, fcntl.LOCK_EX)
        try:
            async with aiofiles.open(store.path, "rb") as f:
                current = json.loads(await f.read())
        except FileNotFoundError:
            current = None
        doc = {"version": 1, "fingerprint": store.fingerprint, "written_unix": time.time(),
               "tokens": (current or {}).get("tokens", 0) + 10, "payload": PAYLOAD}
        tmp = store.state_dir / f".{store.path.name}.tmp-aio"
        async with aiofiles.open(tmp, "wb") as f:
            await f.write(json.dumps(doc, separators=(",", ":")).encode())
            await f.flush()
            await loop.run_in_executor(None, os.fsync, f.fileno())   # aiofiles has no fsync
        await aiofiles.os.replace(tmp, store.path)
        d = await loop.run_in_executor(None, os.open, store.state_dir, os.O_RDONLY | os.O_DIRECTORY)
        await loop.run_in_executor(None, os.fsync, d)
        os.close(d)
    finally:
        os.close(lock)


async def measure(save, store: StateStore, saves: int) -> tuple[float, float]:
    """(median seconds per save, longest loop stall in seconds) over `saves` saves."""
    stall = 0.0
    stop = asyncio.Event()

    async def ticker():
        nonlocal stall
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            stall = max(stall, now - last)
            last = now
    tick = asyncio.create_task(ticker())
    times = []
    for _ in range(saves):
        t0 = time.perf_counter()
        await save(store)
        times.append(time.perf_counter() - t0)
    stop.set()
    await tick
    return statistics.median(times), stall


async def main_async(args) -> dict:
    root = Path(args.dir or tempfile.mkdtemp(prefix="moed-stateio-"))
    store = StateStore(root, "f" * 64)
    arms = {"to_thread_one_call": moed_save, "aiofiles_per_step": aiofiles_save}
    seconds: dict[str, list[float]] = {k: [] for k in arms}
    stalls: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(args.rounds):
        for name, save in arms.items():
            s, stall = await measure(save, store, args.saves)
            seconds[name].append(s * 1e3)
            stalls[name].append(stall * 1e3)
    assert store.load() == PAYLOAD

    def summary(xs):
        return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
                "max": round(max(xs), 3)}
    return {"state_file_bytes": store.path.stat().st_size, "rounds": args.rounds,
            "saves_per_round": args.saves, "directory": str(root),
            "ms_per_save": {k: summary(v) for k, v in seconds.items()},
            "longest_loop_stall_ms": {k: summary(v) for k, v in stalls.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--saves", type=int, default=50)
    ap.add_argument("--dir", default=None, help="state directory to write in (default: a temp dir)")
    print(json.dumps(asyncio.run(main_async(ap.parse_args())), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
