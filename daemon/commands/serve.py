"""`moed serve`: the configuration read at the edge, then the daemon (daemon/service/)."""
from __future__ import annotations

import argparse
import json
import os

from daemon.commands.args import (ExamplesFormatter, Parents, check_model_dir, configure_logging,
                                  version)
from daemon.service.config import add_arguments


def register(sub, parents: Parents) -> None:
    """`moed serve` and its options (every configuration key is a flag)."""
    s = sub.add_parser(
        "serve", parents=[parents.common],
        description="Serve a model over HTTP/1.1 on a Unix socket, and on TCP with "
                    "--tcp-address (with --api-key, TCP clients must send that key): OpenAI's "
                    "/v1/completions, /v1/chat/completions (tool calls, reasoning, "
                    "response_format) and /v1/responses, Anthropic's /v1/messages, all "
                    "streaming with SSE; also /v1/models, /health, /metrics, /tokenize, "
                    "/detokenize, /apply-template and /v1/moed/stats (docs/api.md lists "
                    "them). Experts stream from disk into the expert cache, with learned pins "
                    "and prefetch. Runs until SIGTERM or Ctrl-C; SIGHUP re-reads the "
                    "configuration. Logs go to stderr.",
        epilog="example: moed serve --model default --socket /tmp/moed.sock "
               "--expert-cache-bytes 64M\n"
               "then:    curl --unix-socket /tmp/moed.sock http://localhost/v1/models",
        formatter_class=ExamplesFormatter)
    add_arguments(s, exclude={"log_level"})
    s.set_defaults(func=run)

def run(args: argparse.Namespace) -> int:

    from daemon.service.config import load_config
    from daemon.service.daemon import serve
    from telemetry.logs import get_logger

    log = get_logger("cli")
    config, warnings = load_config(args, os.environ)
    configure_logging(config.log_level)
    for w in warnings:
        log.warning("config_warning", warning=w)
    if config.sources.get("model", "").startswith("flag"):
        check_model_dir(config.model)    # a --model that does not exist: a usage error (2)
    config.require_model()
    fields = config.to_dict()
    if fields["state_dir"] is None:     # the default the daemon will save to, not null
        from daemon.store.state import default_state_dir
        fields["state_dir"] = str(default_state_dir(os.environ))
    log.info("config", **fields)
    return serve(config, reload=lambda: load_config(args, os.environ)[0], environ=os.environ,
                 version=version())
