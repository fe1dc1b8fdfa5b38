"""Fuzzing every RPC of a real broker: hypothesis profiles and a seeded pool.

Profiles (``tests/fuzz`` loads one at import):

* ``ci`` (the default): :data:`CI_EXAMPLES` examples per RPC, no per-example deadline
  (a call's own deadline bounds it), derandomized under ``CI`` so a run is repeatable.
* ``long``: chosen by ``DXPOOL_FUZZ_EXAMPLES=N``; N examples per RPC, random, for the
  ``slow`` long-run tests (``DXPOOL_FUZZ_EXAMPLES=10000 pytest -m slow tests/fuzz``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from hypothesis import HealthCheck, settings

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.store.keys import KeySchema
from tests.conftest import Stubs, add_box, pool_records

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer

CI_EXAMPLES = 25
EXAMPLES_ENV = "DXPOOL_FUZZ_EXAMPLES"
LONG_EXAMPLES = int(os.environ.get(EXAMPLES_ENV, "0") or 0)

settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long",
    parent=settings.get_profile("ci"),
    max_examples=max(LONG_EXAMPLES, CI_EXAMPLES),
    derandomize=False,
)
settings.load_profile("long" if LONG_EXAMPLES else "ci")

Snapshot = dict[bytes, bytes]


def snapshot(etcd_client: Any, prefix: str) -> dict[bytes, bytes]:
    return pool_records(etcd_client, prefix)


@dataclass
class FuzzPool:
    """A broker over real etcd with two boxes, one host, a PENDING node (``nodes/n1``), a
    READY vfio node (``nodes/vm1``) and one QUARANTINED GPU (``boxes/box1/gpus/7``)."""

    broker: BrokerServer
    channel: grpc.Channel
    etcd_client: Any
    prefix: str

    def snapshot(self) -> Snapshot:
        return snapshot(self.etcd_client, self.prefix)

    def settle(self, timeout_s: float = 10.0) -> Snapshot:
        """Wait until the controller has stopped writing (the store holds still for a
        few of its sweeps), and return the store as it then is."""
        deadline = time.monotonic() + timeout_s
        before = self.snapshot()
        while True:
            time.sleep(0.25)
            after = self.snapshot()
            if after == before:
                return after
            if time.monotonic() > deadline:
                pytest.fail("the broker kept writing to etcd; the store never settled")
            before = after


@pytest.fixture
def fuzz_pool(
    broker_factory: Callable[..., BrokerServer], etcd_client: Any, key_prefix: str
) -> Iterator[FuzzPool]:
    keys = KeySchema(key_prefix)
    # A registered, live host without an agent: composes commit and stay PENDING (the
    # attach timeout is an hour, so the controller leaves them alone).
    host = pb.Host(
        name="hosts/h1",
        location=pb.Location(site="s1", pod="p1", rack="r1"),
        slot_capacity=8,
        driver="sim",
    )
    etcd_client.put(keys.host("h1"), host.SerializeToString())
    etcd_client.put(keys.host_lease("h1"), b"")
    broker = broker_factory(attach_timeout_s=3600.0)
    channel = grpc.insecure_channel(broker.endpoint)
    stubs = Stubs(channel)
    add_box(stubs, "box1")
    add_box(stubs, "box2", gpus=4, model="A100")
    # A GPU an earlier detach left QUARANTINED on h1, for ReclaimGpu.
    stuck = pb.Gpu.FromString(etcd_client.get(keys.gpu("box1", 7))[0])
    stuck.state, stuck.host, stuck.host_slot = pb.GPU_STATE_QUARANTINED, "hosts/h1", 7
    etcd_client.put(keys.gpu("box1", 7), stuck.SerializeToString())
    stubs.nodes.ComposeNode(
        nodes_pb2.ComposeNodeRequest(
            spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1)), node_id="n1"
        )
    )
    # A gang of one member, for GetGang and ReleaseGang.
    stubs.nodes.ComposeGang(
        nodes_pb2.ComposeGangRequest(
            members=[pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1))], gang_id="g1"
        )
    )
    # A READY node handed to a VM (vfio), for GetNodeHostdev: as the controller leaves it
    # once its agent reported the GPU bound at 0000:41:00.0.
    ready = pb.VirtualNode(
        name="nodes/vm1",
        host="hosts/h1",
        state=pb.NODE_STATE_READY,
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="A100", count=1), vfio=True),
    )
    ready.gpus.add(
        gpu="boxes/box2/gpus/3",
        model="A100",
        host_slot=6,
        bdf="0000:41:00.0",
        phase=pb.ATTACHMENT_PHASE_ATTACHED,
    )
    etcd_client.put(keys.node("vm1"), ready.SerializeToString())
    # A tenant with a quota and no nodes, for DeleteTenant.
    stubs.nodes.SetTenantQuota(
        nodes_pb2.SetTenantQuotaRequest(name="tenants/idle", quota=pb.TenantQuota(gpus=1))
    )
    pool = FuzzPool(broker, channel, etcd_client, key_prefix)
    pool.settle()
    yield pool
    channel.close()
