"""What the commands that ask a running daemon share: where it answers (its socket or its
URL), the request body, the text streamed to stdout, and one-line errors (exit 1) when the
daemon fails them."""
from __future__ import annotations

import argparse
import os
import sys

from daemon.commands.args import UsageError


def target(args: argparse.Namespace):
    """The daemon's `Target` from --socket / --url / --api-key and the environment
    (client.target_from); a usage error for a bad URL or both MOED_URL and MOED_SOCKET."""
    from daemon.commands.client import target_from

    try:
        return target_from(socket=args.socket, url=args.url, api_key=args.api_key,
                           environ=os.environ)
    except ValueError as e:
        raise UsageError(str(e)) from None

class TextOut:
    """Pieces of an answer written to stdout as they arrive; remembers whether a line is open."""

    def __init__(self):
        self.open = False

    def __call__(self, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()
        self.open = True

    def end_line(self) -> None:
        if self.open:
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.open = False

def ask(where, call):
    """Run `call(client)` (a coroutine) against the daemon at `where` (a `Target`, see
    `target`); its result.

    DaemonError (including "nothing answers there") propagates with a one-line message;
    `client_command` turns it into exit status 1.
    """
    import asyncio

    from daemon.commands.client import Client

    async def run():
        async with Client(where) as client:
            return await call(client)
    return asyncio.run(run())

def client_command(fn):
    """Wrap a command that talks to the daemon: its errors print one line and exit 1."""
    def command(args: argparse.Namespace) -> int:
        from daemon.commands.client import DaemonError

        try:
            return fn(args)
        except DaemonError as e:
            print(f"moed {args.command}: error: {e}", file=sys.stderr)
            return 1
    return command

def request_body(args: argparse.Namespace, *, prompt: str | None = None,
                  messages: list[dict] | None = None) -> dict:
    from daemon.commands.client import completion_request

    return completion_request(prompt=prompt, messages=messages, max_tokens=args.max_tokens,
                              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              seed=args.seed)
