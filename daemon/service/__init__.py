"""`moed serve`: the long-running service, assembled from the rooms below it.

Owns: the lifecycle (daemon.py: startup -> main loop -> shutdown), the HTTP routes
(app.py: every endpoint, the SSE streams, errors in each API's shape), the background loops
(background.py), what is loaded before READY (loading.py), the serving state read by
/health and /metrics (serving.py, stats.py), listeners (listen.py) and the connection cap
and sites that serve them (connections.py), sd_notify (sdnotify.py) and the serve
configuration (config.py). May import api/, engine/, workers/, tuning/, store/ and
machine/ (and ext/, scheduler/, telemetry/); never commands/. With commands/, the only
room that may import aiohttp.
"""
