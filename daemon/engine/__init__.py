"""The engine: one thread that runs the model's steps for every request.

Owns: the engine thread, its queue and the handles requests read events from
(engine.py), what goes into a step (steps.py: decode rows, prompt chunks, the budget), the
prefix cache of KV blocks (prefix_cache.py) and its file in the state directory that
outlives a restart (prefix_store.py). May import store/ (atomic writes of state files);
never service/, api/ or workers/.
"""
