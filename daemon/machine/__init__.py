"""The machine moed runs on: what memory it may use, and giving memory back.

Owns: readings of /proc/meminfo, the cgroup tree and PSI (memory.py), and the squeezer
that shrinks and grows the expert cache with them (squeeze.py). Imports no other room of
daemon/ (only scheduler/ for the policy, and the standard library).
"""
