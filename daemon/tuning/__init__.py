"""The self-tuner at work on a loaded model: `scheduler.tuner` decides, this room measures
and applies.

Owns: the knobs and how they are applied live (knobs.py), the built-in workload
(workload.py), the A/B search with its output check and the cache split by replay
(search.py), the live tuner fed by the engine (live.py), the saved winners per model and
hardware (saved.py). May import store/ and machine/ (and ext/, scheduler/, telemetry/);
never service/ or commands/.
"""
