"""Gauges of what the pool holds, computed from a broker's cache when Prometheus scrapes.

======================================  ==============================================
``dxpool_gpus{model, state}``           GPU records by model and state
``dxpool_nodes{state}``                 node records by state
``dxpool_hosts{liveness}``              registered hosts, ``alive`` (agent lease held)
                                        or ``dead``
``dxpool_cache_revision``               the etcd revision the cache has caught up to
======================================  ==============================================

State labels are the enum value names without their prefix (``FREE``, ``READY``), the
form every dxpool metric uses (``dxpool_node_transitions_total{state}`` too). The counts
come from the broker's :class:`~dxpool.broker.state.pool_tally.PoolTally`, kept current from
cache events, so a scrape costs O(models x states), not a pass over the records.

:data:`COLLECTOR` is registered with the default registry on import. A broker attaches
its cache and tally on start and detaches them on stop; with several brokers in one
process (tests), the one attached last is reported.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.pool_tally import PoolTally


def state_label(enum_name: str, prefix: str) -> str:
    """``NODE_STATE_READY`` -> ``READY``: the form state labels take."""
    return enum_name.removeprefix(prefix)


class PoolCollector(Collector):
    """A Prometheus collector over the attached cache; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attached: list[tuple[Cache, PoolTally]] = []

    def attach(self, cache: Cache, tally: PoolTally) -> Callable[[], None]:
        """Report ``tally`` (and ``cache``'s revision) from now on; returns the function
        that stops that (idempotent)."""
        pair = (cache, tally)
        with self._lock:
            self._attached.append(pair)

        def detach() -> None:
            with self._lock:
                if pair in self._attached:
                    self._attached.remove(pair)

        return detach

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            attached = self._attached[-1] if self._attached else None
        gpus, nodes, hosts, revision = self._families()
        if attached is not None:
            cache, tally = attached
            by_gpu = sorted(
                (model, pb.GpuState.Name(state), count)  # type: ignore[arg-type]
                for (model, state), count in tally.gpu_states().items()
            )
            for model, state_name, count in by_gpu:
                gpus.add_metric([model, state_label(state_name, "GPU_STATE_")], count)
            by_node = sorted(
                (pb.NodeState.Name(state), count)  # type: ignore[arg-type]
                for state, count in tally.node_states().items()
            )
            for state_name, count in by_node:
                nodes.add_metric([state_label(state_name, "NODE_STATE_")], count)
            alive, dead = tally.host_liveness()
            hosts.add_metric(["alive"], alive)
            hosts.add_metric(["dead"], dead)
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
