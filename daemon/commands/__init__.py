"""The `moed` command line: `cli.main` builds one parser from every command module.

Owns: argument parsing and exit codes (cli.py, args.py), one module per command or
group (demo, generate, chat, stats/pins, make-model, bench, tune, iobench, replay-trace,
serve, install-service), progress bars (args.py), figures with their spread and the
noise verdict of bench and tune (figures.py), what bench and tune run (bench_runs.py,
tune_runs.py), the client of a running daemon (client.py, ask.py). Every command module is
cheap to import (see cli.py). May import every other room
of daemon/ and ext/, scheduler/, telemetry/; nothing imports it but bench/ scripts.
"""
