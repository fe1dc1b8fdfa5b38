"""Stand-in host agents for a whole benchmark pool, in one process.

``bench/scale.py`` registers thousands of hosts through the store layer; running an agent
process per host is beyond one machine. This process stands in for all of them, and for
the brokers' agent service that would write their status, so that composed nodes attach
and released GPUs are freed, as in a pool with agents. Per host it runs the agent's own
parts, unchanged: :class:`~dxpool.hostagent.desired.DesiredState` (the spec as adopted),
:class:`~dxpool.hostagent.status.StatusStore` (the status record) and
:class:`~dxpool.hostagent.reconcile.Reconciler`, fed from one keyed
:class:`~dxpool.hostagent.workqueue.WorkQueue` by ``--workers`` threads running the agent's own
:func:`~dxpool.hostagent.agent.reconcile_worker`; the status is written by the broker's
own :func:`~dxpool.broker.control.agent_sessions.commit_status`, with the session and
spec-revision guards. So etcd and the brokers see the same status writes per attach and
release as from real agents (attach: ATTACHING, ATTACHED; release: DETACHING, scrubbed,
RELEASED), but no broker spends CPU on agent sessions: ``bench/agent_fleet.py``
measures that.

What differs from a real agent: the hardware is :class:`MemoryDriver` (a mapping table in
memory: attach, scrub and detach succeed at once; the fake is for hardware this machine
does not have, behind the agent's own driver interface); one watch on the whole
``hostalloc/`` prefix replaces one session per host; every host's liveness record is on
one lease that the caller holds (``--lease``), so there is no session or heartbeat here;
and there is no periodic resync. The pool starts with no status records.

Usage: python bench/pool_agents.py --etcd HOST:PORT --prefix /p/ [--workers 16]
Prints ``ready`` once the spec is listed and the workers run; stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

import etcd3.events

from dxpool.api.v1 import resources_pb2
from dxpool.broker.control.agent_sessions import SessionNotLiveError, commit_status
from dxpool.broker.control.agent_sessions import StaleSpecError as BrokerStaleSpecError
from dxpool.hostagent.agent import reconcile_worker
from dxpool.hostagent.desired import DesiredState
from dxpool.hostagent.driver import AttachedGpu, AttachRequest, DriverCapabilities
from dxpool.hostagent.drivers.sim import SIM_CAPABILITIES
from dxpool.hostagent.errors import AttachConflictError
from dxpool.hostagent.nvml import HEALTHY, GpuIdentity
from dxpool.hostagent.reconcile import Reconciler
from dxpool.hostagent.status import NotRegisteredError, StaleSpecError, StatusStore
from dxpool.hostagent.workqueue import ExponentialBackoff, WorkQueue
from dxpool.names import GpuRef
from dxpool.store.client import addresses_of, connect
from dxpool.store.keys import HOST_ALLOCATIONS, KeySchema
from dxpool.store.typed import Store
from dxpool.store.watch import PrefixWatch

ATTACH_ATTEMPTS = 3


class MemoryDriver:
    """A :class:`~dxpool.hostagent.driver.FabricDriver` whose hardware is a dict: one
    host's mappings, each GPU with a stable identity derived from its name."""

    def __init__(self) -> None:
        self._attached: dict[GpuRef, AttachedGpu] = {}
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> DriverCapabilities:
        return SIM_CAPABILITIES  # what the simulated fabric supports too

    def attach(self, request: AttachRequest) -> AttachedGpu:
        with self._lock:
            held = self._attached.get(request.gpu)
            if held is not None and held.host_slot != request.host_slot:
                raise AttachConflictError(f"{request.gpu.name} is mapped at slot {held.host_slot}")
            gpu = AttachedGpu(
                gpu=request.gpu,
                host_slot=request.host_slot,
                bdf=f"0000:{0x40 + request.host_slot:02x}:00.0",
                driver=request.kernel_driver,
                identity=GpuIdentity(
                    uuid=f"GPU-{request.gpu.box}-{request.gpu.slot}",
                    serial=f"SN-{request.gpu.box}-{request.gpu.slot}",
                    model=request.model or "H100",
                    memory_mib=81920,
                ),
                health=HEALTHY,
            )
            self._attached[request.gpu] = gpu
            return gpu

    def detach(self, gpu: GpuRef, *, force: bool = False) -> None:
        with self._lock:
            self._attached.pop(gpu, None)

    def scrub(self, gpu: GpuRef, *, force: bool = False) -> None:
        """Nothing runs on a GPU here, so a scrub always leaves it clean."""

    def observe(self) -> dict[GpuRef, AttachedGpu]:
        with self._lock:
            return dict(self._attached)


class _StatusWriter:
    """Writes one host's status as the broker holding its session would (a
    :class:`~dxpool.hostagent.status.StatusWriter`): the session is the host's liveness
    record as it was when this stand-in first wrote."""

    def __init__(self, store: Store, host_id: str) -> None:
        self._store = store
        self._host_id = host_id
        self._liveness_revision = 0

    def write_status(self, record: resources_pb2.HostStatus, spec_revision: int) -> None:
        if not self._liveness_revision:
            found = self._store.get(self._store.keys.host_lease(self._host_id))
            if found is None:
                raise NotRegisteredError(f"hosts/{self._host_id} has no liveness record")
            self._liveness_revision = found.mod_revision
        try:
            commit_status(
                self._store, self._host_id, self._liveness_revision, record, spec_revision
            )
        except SessionNotLiveError as error:
            raise NotRegisteredError(error.message) from None
        except BrokerStaleSpecError as error:
            raise StaleSpecError(error.message) from None


class _Host:
    """One host's agent parts."""

    def __init__(self, store: Store, host_id: str) -> None:
        self.desired = DesiredState(host_id)
        self.reconciler = Reconciler(
            driver=MemoryDriver(),
            desired=self.desired,
            status=StatusStore(_StatusWriter(store, host_id), host_id),
            attach_attempts=ATTACH_ATTEMPTS,
        )


class PoolAgents:
    """Every host's agent behind one watch and one work queue; see the module docstring."""

    def __init__(self, client: Any, keys: KeySchema, workers: int) -> None:
        self._client = client
        self._keys = keys
        self._store = Store(client, keys, name="pool-agents")
        self._workers = workers
        self._spec_prefix = keys.collection(HOST_ALLOCATIONS)
        self._hosts: dict[str, _Host] = {}
        self._hosts_lock = threading.Lock()
        self._queue: WorkQueue[tuple[str, GpuRef]] = WorkQueue(ExponentialBackoff(0.05, 1.0))
        self._watch: PrefixWatch | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """List every host's spec, start the workers, then keep watching."""
        self._watch = PrefixWatch(
            addresses_of(self._client),
            self._spec_prefix,
            on_list=self._on_list,
            on_events=self._on_events,
            name="pool-agents-spec-watch",
        )
        for index in range(self._workers):
            thread = threading.Thread(target=self._work, name=f"pool-agent-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._watch.start(timeout_s=60)

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        self._queue.shutdown()
        for thread in self._threads:
            thread.join()

    def _host(self, host_id: str) -> _Host:
        with self._hosts_lock:
            host = self._hosts.get(host_id)
            if host is None:
                host = self._hosts[host_id] = _Host(self._store, host_id)
            return host

    def _on_list(self, kvs: Any, revision: int) -> None:
        for kv in kvs:
            allocation = resources_pb2.HostAllocation.FromString(kv.value)
            self._adopt(kv.key.decode(), allocation, revision, int(kv.mod_revision))

    def _on_events(self, response: Any) -> None:
        for event in response.events:
            allocation = (
                None
                if isinstance(event, etcd3.events.DeleteEvent)
                else resources_pb2.HostAllocation.FromString(event.value)
            )
            revision = int(event.mod_revision)
            self._adopt(event.key.decode(), allocation, revision, revision)

    def _adopt(
        self,
        key: str,
        allocation: resources_pb2.HostAllocation | None,
        revision: int,
        spec_revision: int,
    ) -> None:
        host_id = key[len(self._spec_prefix) :]
        for gpu in self._host(host_id).desired.replace(allocation, revision, spec_revision):
            self._queue.add((host_id, gpu))

    def _work(self) -> None:
        """As the agent's reconcile worker does, for (host, GPU) keys."""
        reconcile_worker(
            self._queue,
            lambda key: self._host(key[0]).reconciler.reconcile(key[1]),
            lambda key: f"hosts/{key[0]} {key[1].name}",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--etcd", required=True, help="etcd endpoint, HOST:PORT")
    parser.add_argument("--prefix", required=True, help="the pool's etcd key prefix")
    parser.add_argument("--workers", type=int, default=16, help="reconcile threads")
    args = parser.parse_args()
    client = connect(args.etcd, timeout_s=30)
    agents = PoolAgents(client, KeySchema(args.prefix), args.workers)
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    agents.start()
    print("ready", flush=True)
    stopping.wait()
    agents.stop()
    client.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
