"""The names of the eviction policies (scheduler/eviction.py's `POLICIES`, in its order)
without their code, for what must not load numpy and the policies: the choices of `moed
replay-trace --policy`, which `moed replay-trace --help` shows. A policy added to
`POLICIES` is named here too (tests/scheduler/test_eviction_policies.py checks)."""

POLICY_NAMES = ("lru", "lfu", "slru", "arc", "s3fifo", "lrfu", "predictive")
