"""What a request must pass before placement, beside its quota: its priority, and lending.

* **Priority.** A node charged to a tenant whose quota sets ``max_priority`` may not ask
  for more (FAILED_PRECONDITION ``PRIORITY_NOT_ALLOWED``: retrying will not help, an
  operator must raise it).
* **Lending paused.** While a waiting request within its tenant's guarantee is taking
  lent capacity back (``QueueStatus.reclaiming``), no tenant borrows GPUs that request
  could want: a node that would be borrowed is refused (RESOURCE_EXHAUSTED
  ``LENDING_PAUSED``; with ``queue`` it waits instead). Otherwise the GPUs the owner is
  reclaiming would be lent again the moment they are freed, and reclaimed again.

Both are judged on this broker's cache: a pre-check, not a guarantee. The commit
compares the tenant's record for the quota; for lending, a borrower that slips through
on a lagging cache is preemptible, and the owner's reclaim takes it back too.
"""

from __future__ import annotations

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes import loaning
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.queue_index import QueueIndex
from dxpool.errors import FailedPrecondition, ResourceExhausted


class ComposeGate:
    """Pre-checks for composes, gangs, admissions and grows; ``queue`` None: lending is
    never paused (no queue is served)."""

    def __init__(self, cache: Cache, queue: QueueIndex | None = None) -> None:
        self._cache = cache
        self._queue = queue

    def tenant(self, tenant_id: str) -> pb.Tenant | None:
        record = self._cache.tenants.get(tenant_id) if tenant_id else None
        return record.value if record is not None else None

    def check(self, spec: pb.NodeSpec, gpus: int, *, requester: str = "") -> None:
        """Raise when a request for ``gpus`` GPUs (a gang: all its members') under
        ``spec`` (its tenant, priority and model) may not go on; ``requester`` names the
        request itself when it waits in the queue (it does not pause itself)."""
        record = self.tenant(spec.tenant)
        self.check_priority(spec, record)
        if self._queue is None or not spec.tenant:
            return
        if not loaning.terms(record, gpus).borrowed:
            return
        reclaiming = [n for n in self._queue.reclaiming(spec.gpus.model) if n != requester]
        if reclaiming:
            shown = ", ".join(reclaiming[:3]) + (", ..." if len(reclaiming) > 3 else "")
            raise ResourceExhausted(
                f"tenant {spec.tenant} is beyond its guarantee, so the node would borrow "
                f"lent capacity, and lending is paused while its owners take it back "
                f"(for {shown}); compose with queue to wait, or within the guarantee",
                reason="LENDING_PAUSED",
                metadata={"tenant": spec.tenant, "reclaiming": str(len(reclaiming))},
            )

    @staticmethod
    def check_priority(spec: pb.NodeSpec, record: pb.Tenant | None) -> None:
        if (
            spec.tenant
            and record is not None
            and not loaning.priority_allowed(record, spec.priority)
        ):
            raise FailedPrecondition(
                f"tenant {spec.tenant} may not ask for priority {spec.priority}: its quota "
                f"allows at most {record.quota.max_priority}; ask for less, or have an "
                "operator raise quota.max_priority (`dxpool tenant set-quota`)",
                reason="PRIORITY_NOT_ALLOWED",
                metadata={"tenant": spec.tenant, "max_priority": str(record.quota.max_priority)},
            )


__all__ = ["ComposeGate"]
