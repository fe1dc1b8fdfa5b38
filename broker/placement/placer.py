"""The entry point the broker calls on every compose and plan."""

from __future__ import annotations

from dxpool.broker.placement.model import LatencyModel, PlacementRequest, PlacementResult, Snapshot
from dxpool.broker.placement.pipeline import Pipeline
from dxpool.broker.placement.registry import default_pipeline
from dxpool.errors import NotFound

_DEFAULT = default_pipeline()


def place(
    request: PlacementRequest,
    snapshot: Snapshot,
    latency: LatencyModel,
    pipeline: Pipeline | None = None,
) -> PlacementResult:
    """Choose a host and GPUs for ``request`` from ``snapshot``, and explain the choice.

    Returns a result whose ``placement`` is None when nothing fits; ``unsatisfied`` then
    names each failing constraint and the closest thing available, and ``candidates``
    says why each host was kept or dropped. Pure: the snapshot is read, never changed,
    and the same inputs give the same result. Raises :class:`~dxpool.errors.NotFound`
    when the request pins a host the snapshot does not hold.
    """
    if request.host is not None and request.host not in snapshot.hosts:
        raise NotFound(
            f"host hosts/{request.host} is not registered: pin a registered host "
            "(dxpool get hosts) or leave the host empty",
            reason="HOST_NOT_FOUND",
        )
    return (pipeline or _DEFAULT).run(request, snapshot, latency)
