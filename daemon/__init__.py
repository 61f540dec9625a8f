"""moed's daemon and everything that runs it, in rooms that import downward only.

    commands/   the `moed` command line: one module per command (its arguments beside
                its code), the demo, bench, tune, the clients of a running daemon
    service/    `moed serve`: lifecycle, the aiohttp app and its handlers, API shapes,
                the engine thread, listeners, sd_notify, the serve configuration
    tuning/     the self-tuner at work on a loaded model: knobs, built-in workload, the
                A/B search (foreground and live), the saved winners
    store/      the expert store: read plans, io workers, slot memory, the streaming
                provider, the usage state file, the storage probe
    machine/    readings of the machine (memory, cgroups, pressure) and the squeezer

commands may import every other room; service imports tuning, store and machine;
tuning imports store and machine; store and machine import no other room. Every room
may import ext/, scheduler/ and telemetry/. tests/test_layout.py enforces these rules.
"""
