"""`moed serve`: the long-running service on a Unix socket.

Owns: the lifecycle (daemon.py: startup -> main loop -> shutdown), the HTTP routes
(app.py) and the API's request/response shapes (api.py), the background loops
(background.py), what is loaded before READY (loading.py), the engine thread
(engine.py), listeners (listen.py) and the connection cap and sites that serve them
(connections.py), the chat template's bounded render processes (templates.py,
template_worker.py), response_format's bounded compiles (grammar.py, grammar_worker.py)
and the worker-process handling both share (workers.py), sd_notify (sdnotify.py), the serve configuration (config.py) and the
statistics reading (stats.py). May import tuning/, store/ and
machine/ (and ext/, scheduler/, telemetry/); never commands/.
"""
