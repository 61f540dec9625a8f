"""`moed chat`: a conversation on the terminal with the model the daemon serves."""
from __future__ import annotations

import argparse
import json
import sys

from daemon.commands.args import ExamplesFormatter, Parents, add_sampling_arguments, sampling_params
from daemon.commands.ask import TextOut, client_command, request_body, target

CHAT_COMMANDS = "/exit (or Ctrl-D) ends the chat, /reset forgets the conversation"

def register(sub, parents: Parents) -> None:
    """`moed chat` and its options."""
    c = sub.add_parser(
        "chat", parents=[parents.common, parents.client],
        description="A chat on the terminal with the model the daemon serves: each line you type "
                    "is a user message, the answer streams back, and the conversation so far is "
                    "sent with every message (through the model's chat template). "
                    f"{CHAT_COMMANDS}. Reads standard input, so a file or a pipe of "
                    "messages (one per line) works too. Each answer ends with a newline on "
                    "stdout, but may hold newlines of its own: for a program, --json writes "
                    "one JSON object per answer instead. Decoding is greedy unless "
                    "--temperature is given.",
        epilog="examples:\n"
               "  moed chat\n"
               "  moed chat --socket /tmp/moed.sock --system 'Answer in one sentence.'\n"
               "  MOED_API_KEY=... moed chat --url http://10.0.0.5:8000\n"
               "  printf 'Hello!\\nAnd what can you do?\\n' | moed chat --max-tokens 64\n"
               "  printf 'Hello!\\n' | moed chat --json",
        formatter_class=ExamplesFormatter)
    c.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message put before the conversation")
    c.add_argument("--json", action="store_true",
                   help='one JSON object per answer on stdout, {"message", "answer", '
                        '"finish_reason"}, instead of streamed text')
    add_sampling_arguments(c, max_tokens=512, per="answer")
    c.set_defaults(func=run)

@client_command
def run(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from daemon.commands.client import Client, DaemonError, DaemonUnavailableError

    sampling_params(args)
    where = target(args)
    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)

    async def connect() -> Client:
        return Client(where)

    with asyncio.Runner() as runner:
        client = runner.run(connect())
        try:
            models = runner.run(client.get("/v1/models"))
            if interactive:
                name = (models.get("data") or [{}])[0].get("id", "?")
                print(f"moed chat with {name} at {where}; {CHAT_COMMANDS}.", file=sys.stderr)
            while (line := _read_turn(interactive)) is not None:
                line = line.strip()
                if not line:
                    continue
                if line in ("/exit", "/quit"):
                    break
                if line == "/reset":
                    history = list(system)
                    if interactive:
                        print("(conversation forgotten)", file=sys.stderr)
                    continue
                history.append({"role": "user", "content": line})
                text = _Quiet() if args.json else TextOut()
                try:
                    result = runner.run(client.stream("/v1/chat/completions",
                                                      request_body(args, messages=history), text))
                except KeyboardInterrupt:
                    if not interactive:
                        raise
                    text.end_line()
                    print("(interrupted)", file=sys.stderr)
                    history.pop()
                    continue
                except DaemonUnavailableError:
                    raise
                except DaemonError as e:
                    text.end_line()
                    if not interactive:
                        raise
                    print(f"moed chat: error: {e}", file=sys.stderr)
                    history.pop()
                    continue
                if args.json:
                    sys.stdout.write(json.dumps({"message": line, "answer": result.text,
                                                 "finish_reason": result.finish_reason},
                                                ensure_ascii=False) + "\n")
                else:
                    sys.stdout.write("\n")
                sys.stdout.flush()
                history.append({"role": "assistant", "content": result.text})
                if result.finish_reason == "length" and interactive:
                    print(f"(answer cut at --max-tokens {args.max_tokens})", file=sys.stderr)
        finally:
            runner.run(client.close())
    return 0

class _Quiet(TextOut):
    """--json: the pieces are kept by the client, not written as they arrive."""

    def __call__(self, piece: str) -> None:
        pass


def _read_turn(interactive: bool) -> str | None:
    """The user's next line, or None at end of input."""
    if not interactive:
        line = sys.stdin.readline()
        return line or None
    try:
        if sys.stdout.isatty():
            return input("> ")
        sys.stderr.write("> ")
        sys.stderr.flush()
        return input()
    except EOFError:
        sys.stderr.write("\n")
        return None
    except KeyboardInterrupt:       # Ctrl-C at the prompt ends the chat (exit status 130)
        sys.stderr.write("\n")
        raise
