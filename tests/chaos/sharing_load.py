"""Load that makes the pool share itself during chaos runs: loaning, reclaim, shrink,
preemption and the queue, under the same faults as the rest of the load.

Two tenants: ``owner`` is guaranteed :data:`OWNER_GUARANTEE` GPUs and composes with
``queue`` (so a request within its guarantee that finds nothing free takes lent GPUs
back); ``borrower`` is guaranteed none, so every node it holds is borrowed: elastic
(``min_gpus`` 1, shrunk first) when it has several GPUs, with a grace period of one
second. Both run the ordinary worker's loop (compose, wait, hold, release) through
:class:`~tests.chaos.workload.Worker`, so every acknowledged compose is checked, every
result code judged, and a node taken by a preemption is simply found RELEASING.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from dxpool.client import Client
from dxpool.errors import DxpoolError
from tests.chaos.invariants import EtcdSnapshot
from tests.chaos.workload import OpLog, Worker

OWNER = "owner"
BORROWER = "borrower"
OWNER_GUARANTEE = 6


class SharingWorker(Worker):
    """A worker charged to ``tenant``: the owner queues its composes, the borrower's are
    elastic with a short grace."""

    def __init__(
        self,
        index: int,
        endpoints: list[str],
        log: OpLog,
        stop: threading.Event,
        seed: int,
        *,
        tenant: str,
    ) -> None:
        super().__init__(
            index,
            endpoints,
            log,
            stop,
            seed,
            wait_bound_s=20.0,
            max_gpus=6 if tenant == BORROWER else 4,
        )
        self.name = f"chaos-{tenant}-{index}"
        self.tenant = tenant

    def hold_s(self) -> tuple[float, float]:
        # a borrower holds its nodes long enough for owners to need them back
        return (3.0, 8.0) if self.tenant == BORROWER else (0.5, 2.0)

    def compose_kwargs(self, gpus: str) -> dict[str, Any]:
        count = int(gpus.rpartition(":")[2])
        if self.tenant == OWNER:
            return {"tenant": OWNER, "queue": True, "queue_timeout_s": 20}
        elastic = count > 1 and self.rng.random() < 0.6
        return {
            "tenant": BORROWER,
            "min_gpus": 1 if elastic else 0,
            # an elastic node shrinks at once (its job rescales); a whole one gets a second
            "preemption_grace_s": 0 if elastic else 1,
        }


def set_quotas(endpoints: list[str], deadline_s: float = 30.0) -> None:
    """Give the owner its guarantee and make the borrower take part with none, trying
    each broker until one answers."""
    end = time.monotonic() + deadline_s
    last: DxpoolError | None = None
    while time.monotonic() < end:
        for endpoint in endpoints:
            try:
                with Client(endpoint, timeout_s=5.0) as client:
                    client.set_tenant_quota(OWNER, guaranteed_gpus=OWNER_GUARANTEE)
                    client.set_tenant_quota(BORROWER, guaranteed_gpus=0)
                return
            except DxpoolError as error:
                last = error
        time.sleep(0.5)
    raise RuntimeError(f"could not set the tenants' quotas: {last}")


def sharing_workers(
    first_index: int,
    endpoints: list[str],
    log: OpLog,
    stop: threading.Event,
    seed: int,
    count: int,
) -> list[Worker]:
    """``count`` workers: borrower, owner, borrower, borrower, owner, ..."""
    return [
        SharingWorker(
            first_index + i,
            endpoints,
            log,
            stop,
            seed * 100 + first_index + i,
            tenant=OWNER if i % 3 == 1 else BORROWER,
        )
        for i in range(count)
    ]


def sharing_summary(snap: EtcdSnapshot) -> dict[str, int]:
    """What sharing happened in a run, from the nodes' own events (they stay until
    collected): requests queued, notices given and withdrawn, nodes shrunk or preempted
    whole, borrowed nodes composed."""
    counts = dict.fromkeys(("queued", "notices", "withdrawn", "shrunk", "preempted", "borrowed"), 0)
    for _, node in snap.node_items():
        reasons = [event.reason for event in node.events]
        counts["queued"] += "Queued" in reasons
        counts["notices"] += reasons.count("PreemptionNotice")
        counts["withdrawn"] += reasons.count("PreemptionCancelled")
        counts["borrowed"] += node.preemptible
        for event in node.events:
            if event.reason == "Preempted":
                shrunk = event.message.startswith("shrinking")
                counts["shrunk" if shrunk else "preempted"] += 1
    counts["gangs"] = len(snap.gangs)
    return counts


__all__ = [
    "BORROWER",
    "OWNER",
    "OWNER_GUARANTEE",
    "SharingWorker",
    "set_quotas",
    "sharing_summary",
    "sharing_workers",
]
