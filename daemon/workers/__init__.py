"""Work that runs in bounded child processes, beside the engine.

Owns: the child-process protocol both kinds share (process.py: a line per request, memory
limit, kill on timeout), chat template renders (templates.py, template_worker.py),
grammar compiles for response_format and tool calls (grammar.py, grammar_worker.py), and
the per-client compile slots that keep one client from taking every worker
(compile_slots.py). Imports no other room of daemon/.
"""
