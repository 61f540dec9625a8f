"""The expert store: routed experts from the shards into RAM slots, and what it learns.

Owns: read plans (plans.py), the io worker pool (reads.py), slot memory (slots.py), the
streaming expert provider (streaming.py), a model opened with its provider and state
(session.py), the usage state file (state.py) and the storage probe (probe.py). Imports
no other room of daemon/ (only ext/, scheduler/, telemetry/): what it decides comes from
scheduler/, who drives it is above.
"""
