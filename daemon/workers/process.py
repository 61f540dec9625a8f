"""Bounded worker processes: work the daemon cannot bound in-process runs in a child that
caps its own address space (RLIMIT_AS) and that the daemon kills when it has not answered
in time. Used by the chat templates (templates.py, template_worker.py) and the grammar
compiles of response_format (grammar.py, grammar_worker.py).

Daemon side: `WorkerProcess` starts `python -m <module> LIMIT`, waits for its
``{"ready": true}`` line, asks one JSON line and reads one back, and kills it.
Worker side: `limit_memory` first (before anything is read or imported), then
`serve_lines`, which answers each JSON request line with one JSON line.

RLIMIT_AS bounds a worker, not the machine: in a memory cgroup smaller than the limit
(or on a machine short of memory) the kernel's OOM killer acts first, and with every
process at the same oom_score_adj it picks the largest, the daemon with its model. So
`limit_memory` also sets the worker's oom_score_adj to 1000 (killed first): a worker
killed that way ends with SIGKILL, which the daemon reports as such (grammar.py).
"""
from __future__ import annotations

import json
import os
import resource
import select
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerProcess:
    """One worker process and its pipes.

    argv: the command (its last argument, by convention, the address-space limit the
    worker sets itself). memory_bytes: that limit, kept to tell workers of an old limit
    apart. init: a line written to the worker's stdin before it says ready (what it needs
    to start: a tokenizer, say), or None.
    """

    def __init__(self, argv: Sequence[str], memory_bytes: int, init: dict | None = None):
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            close_fds=True, text=True, encoding="ascii", cwd=REPO_ROOT)
        self.memory_bytes = memory_bytes
        if init is not None:
            try:
                self.proc.stdin.write(json.dumps(init) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass                      # it died: wait_ready says so

    def wait_ready(self, wait_s: float) -> bool:
        """Wait for the worker's `{"ready": true}` line (its interpreter started and its
        imports done), so that a request's time limit never counts the start of a process;
        False when it did not come within `wait_s` or the worker died."""
        ready, _, _ = select.select([self.proc.stdout], [], [], wait_s)
        if not ready:
            return False
        try:
            return json.loads(self.proc.stdout.readline() or "null") == {"ready": True}
        except ValueError:
            return False

    def ask(self, request: dict, wait_s: float) -> dict | None:
        """Send one request; the answer, or None when none came within `wait_s` or the
        worker died (it must then be killed and not reused)."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):     # ValueError: closed by kill()
            return None
        try:
            ready, _, _ = select.select([self.proc.stdout], [], [], wait_s)
            if not ready:
                return None
            line = self.proc.stdout.readline()
        except (OSError, ValueError):
            return None
        if not line:
            return None
        try:
            return json.loads(line)
        except ValueError:
            return None

    def kill(self) -> str:
        """Kill the process; how it ended ("signal 9", "exit code 1")."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        code = self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        return f"signal {-code}" if code < 0 else f"exit code {code}"


OOM_SCORE_ADJ = 1000           # the most: the OOM killer takes a worker before the daemon


def limit_memory(limit: int) -> None:
    """Worker side, first thing: cap this process's address space at `limit` bytes, and
    make it the OOM killer's first choice (best effort: without /proc, or where the
    value may not be written, the worker runs as it is)."""
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(f"{OOM_SCORE_ADJ}\n")
    except OSError:
        pass


def serve_lines(answer: Callable[[dict], dict], out_of_memory: dict) -> int:
    """Worker side: say ready, then answer each JSON line on stdin with `answer(request)`
    as one JSON line on stdout (`out_of_memory` when either ran out of memory)."""
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            out = json.dumps(answer(json.loads(line)))
        except MemoryError:
            out = json.dumps(out_of_memory)
        except (ValueError, KeyError, TypeError, RecursionError) as e:   # a malformed request
            out = json.dumps({"error": f"bad request: {type(e).__name__}: {e}", "limit": False})
        sys.stdout.write(out + "\n")
        sys.stdout.flush()
    return 0
