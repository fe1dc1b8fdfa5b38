"""Gauges of what the pool holds, computed from a broker's cache when Prometheus scrapes.

======================================  ==============================================
``dxpool_gpus{model, state}``           GPU records by model and state
``dxpool_nodes{state}``                 node records by state
``dxpool_hosts{liveness}``              registered hosts, ``alive`` (agent lease held)
                                        or ``dead``
``dxpool_cache_revision``               the etcd revision the cache has caught up to
======================================  ==============================================

State labels are the enum value names without their prefix (``FREE``, ``READY``), the
form every dxpool metric uses (``dxpool_node_transitions_total{state}`` too). Counting is
one pass over the cached records per scrape (a page at a time, so the cache's watch is
never held up for long), nothing on the request path.

:data:`COLLECTOR` is registered with the default registry on import. A broker attaches
its cache on start and detaches it on stop; with several brokers in one process (tests),
the one attached last is reported.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.cache import Cache
from dxpool.store import keys as k


def state_label(enum_name: str, prefix: str) -> str:
    """``NODE_STATE_READY`` -> ``READY``: the form state labels take."""
    return enum_name.removeprefix(prefix)


class PoolCollector(Collector):
    """A Prometheus collector over the attached cache; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: list[Cache] = []

    def attach(self, cache: Cache) -> Callable[[], None]:
        """Report ``cache`` from now on; returns the function that stops that (idempotent)."""
        with self._lock:
            self._caches.append(cache)

        def detach() -> None:
            with self._lock:
                if cache in self._caches:
                    self._caches.remove(cache)

        return detach

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cache = self._caches[-1] if self._caches else None
        gpus, nodes, hosts, revision = self._families()
        if cache is not None:
            by_gpu = Counter(
                (r.value.model, pb.GpuState.Name(r.value.state)) for _, r in cache.walk(k.GPUS)
            )
            for (model, state), count in sorted(by_gpu.items()):
                gpus.add_metric([model, state_label(state, "GPU_STATE_")], count)
            by_node = Counter(pb.NodeState.Name(r.value.state) for _, r in cache.walk(k.NODES))
            for state, count in sorted(by_node.items()):
                nodes.add_metric([state_label(state, "NODE_STATE_")], count)
            alive = sum(
                1 for host, _ in cache.walk(k.HOSTS) if cache.get(k.HOST_LEASES, host) is not None
            )
            hosts.add_metric(["alive"], alive)
            hosts.add_metric(["dead"], cache.count(k.HOSTS) - alive)
            revision.add_metric([], cache.revision)
        yield from (gpus, nodes, hosts, revision)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily("dxpool_gpus", "GPUs by model and state", labels=["model", "state"]),
            GaugeMetricFamily("dxpool_nodes", "Virtual nodes by state", labels=["state"]),
            GaugeMetricFamily(
                "dxpool_hosts", "Registered hosts by agent liveness", labels=["liveness"]
            ),
            GaugeMetricFamily(
                "dxpool_cache_revision", "etcd revision the broker's cache has caught up to"
            ),
        )


COLLECTOR = PoolCollector()
REGISTRY.register(COLLECTOR)

__all__ = ["COLLECTOR", "PoolCollector", "state_label"]
