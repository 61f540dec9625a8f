"""The machine moed runs on: what memory it may use, and giving memory back.

Owns: readings of the memory available (psutil), the cgroup tree and PSI (memory.py),
of the process and the system — CPUs usable, resident memory, RAM (psutil; system.py) —
and the squeezer that shrinks and grows the expert cache with them
(squeeze.py). Imports no other room of daemon/ (only scheduler/ for the policy, psutil
and the standard library).
"""
