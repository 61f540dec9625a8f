"""The daemon's Prometheus registry (issue: telemetry fills in the moed_* families).

One registry per daemon, owned by it; `/metrics` on the Unix socket and on
`metrics_address` render the same registry. `_created` series are disabled
(Prometheus 2.42 would store each as a series).
"""
from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Info, ProcessCollector

prometheus_client.disable_created_metrics()


def build_registry(*, version: str, model_type: str) -> CollectorRegistry:
    """A registry with the process collector and `moed_build_info{version, model_type}`."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    Info("moed_build", "moed version and the served model's architecture",
         registry=registry).info({"version": version, "model_type": model_type})
    return registry
