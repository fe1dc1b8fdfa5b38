"""Prometheus metrics of the host agent (``dxpool_agent_`` prefix, base units).

==============================================  ==========================================
``dxpool_agent_attach_duration_seconds``        successful attaches: map, rescan, bind,
                                                identify
``dxpool_agent_detach_duration_seconds``        successful releases (scrub and detach) and
                                                detaches of GPUs no longer wanted
``dxpool_agent_attach_failures_total{reason}``  failed attach attempts
``dxpool_agent_detach_failures_total{reason}``  failed or refused scrub/detach attempts
``dxpool_agent_gpus{phase, health}``            the GPUs in the agent's status, computed
                                                when Prometheus scrapes
==============================================  ==========================================

Reasons are :func:`failure_reason`'s: ``identity_mismatch``, ``conflict``,
``device_timeout``, ``busy``, ``unhealthy_after_reset``, ``transient`` (other retryable
errors) and ``refused`` (other errors that are not retried).

:data:`COLLECTOR` is registered with the default registry on import; an agent attaches
its status store on start and detaches it on stop (with several agents in one process,
the one attached last is reported).
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import Counter, Histogram
from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.hostagent.errors import (
    AttachConflictError,
    DeviceTimeoutError,
    DriverError,
    GpuBusyError,
    IdentityMismatchError,
    ScrubError,
)

_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

ATTACH_SECONDS = Histogram(
    "dxpool_agent_attach_duration_seconds",
    "Time a successful attach took: map, rescan, bind, identify",
    buckets=_BUCKETS,
)
DETACH_SECONDS = Histogram(
    "dxpool_agent_detach_duration_seconds",
    "Time a successful release (scrub and detach) or detach took",
    buckets=_BUCKETS,
)
ATTACH_FAILURES = Counter(
    "dxpool_agent_attach_failures_total", "Failed attach attempts by reason", ["reason"]
)
DETACH_FAILURES = Counter(
    "dxpool_agent_detach_failures_total",
    "Failed or refused scrub and detach attempts by reason",
    ["reason"],
)


def failure_reason(error: DriverError) -> str:
    """The ``reason`` label of a driver error; see the module docstring."""
    if isinstance(error, IdentityMismatchError):
        return "identity_mismatch"
    if isinstance(error, AttachConflictError):
        return "conflict"
    if isinstance(error, DeviceTimeoutError):
        return "device_timeout"
    if isinstance(error, GpuBusyError):
        return "busy"
    if isinstance(error, ScrubError):
        return "unhealthy_after_reset"
    return "transient" if error.retryable else "refused"


class StatusSource(Protocol):
    """What the collector reads: the agent's status entries."""

    def entries(self) -> list[pb.ObservedAttachment]: ...


class AgentCollector(Collector):
    """``dxpool_agent_gpus{phase, health}`` over the attached status; see the module
    docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: list[StatusSource] = []

    def attach(self, source: StatusSource) -> Callable[[], None]:
        """Report ``source`` from now on; returns the function that stops that (idempotent)."""
        with self._lock:
            self._sources.append(source)

        def detach() -> None:
            with self._lock:
                if source in self._sources:
                    self._sources.remove(source)

        return detach

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            source = self._sources[-1] if self._sources else None
        family = self._family()
        if source is not None:
            tally = Tally(
                (
                    pb.AttachmentPhase.Name(entry.phase).removeprefix("ATTACHMENT_PHASE_"),
                    pb.GpuHealth.Name(entry.health).removeprefix("GPU_HEALTH_"),
                )
                for entry in source.entries()
            )
            for (phase, health), count in sorted(tally.items()):
                family.add_metric([phase, health], count)
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "dxpool_agent_gpus",
            "GPUs in the agent's status by attachment phase and health",
            labels=["phase", "health"],
        )


COLLECTOR = AgentCollector()
REGISTRY.register(COLLECTOR)

__all__ = [
    "ATTACH_FAILURES",
    "ATTACH_SECONDS",
    "COLLECTOR",
    "DETACH_FAILURES",
    "DETACH_SECONDS",
    "AgentCollector",
    "StatusSource",
    "failure_reason",
]
