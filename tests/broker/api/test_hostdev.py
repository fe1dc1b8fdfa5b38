"""GetNodeHostdev: libvirt <hostdev> XML for a READY vfio node, over a real broker, etcd
and a host agent on the simulated fabric; and the XML itself."""

from __future__ import annotations

from xml.etree import ElementTree

import grpc
import pytest

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.hostdev import hostdev_element, node_hostdev
from dxpool.broker.api.server import BrokerServer
from dxpool.errors import FailedPrecondition
from dxpool.hostagent.driver import VFIO_DRIVER
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until
from tests.streaming import write_nodes

# -- the XML -------------------------------------------------------------------------------


def test_hostdev_element_is_libvirts_unmanaged_pci_hostdev() -> None:
    element = ElementTree.fromstring(hostdev_element("0000:4A:1f.3"))

    assert element.tag == "hostdev"
    assert element.attrib == {"mode": "subsystem", "type": "pci", "managed": "no"}
    address = element.find("source/address")
    assert address is not None
    assert address.attrib == {"domain": "0x0000", "bus": "0x4a", "slot": "0x1f", "function": "0x3"}


@pytest.mark.parametrize("bdf", ["", "41:00.0", "0000:41:00.8", "0000:41:20.0", "0000:4g:00.0"])
def test_hostdev_element_refuses_what_is_not_a_pci_address(bdf: str) -> None:
    with pytest.raises(ValueError, match="is not a PCI address"):
        hostdev_element(bdf)


def ready_node(*, vfio: bool = True, bdfs: tuple[str, ...] = ("0000:41:00.0",)) -> pb.VirtualNode:
    node = pb.VirtualNode(
        name="nodes/n1",
        host="hosts/h1",
        state=pb.NODE_STATE_READY,
        spec=pb.NodeSpec(gpus=pb.GpuRequest(count=len(bdfs)), vfio=vfio),
    )
    for slot, bdf in enumerate(bdfs):
        node.gpus.add(gpu=f"boxes/box1/gpus/{slot}", host_slot=slot, bdf=bdf)
    return node


def test_node_hostdev_lists_every_gpu_in_binding_order() -> None:
    result = node_hostdev(ready_node(bdfs=("0000:42:00.0", "0000:41:00.0")))

    assert [(d.gpu, d.bdf) for d in result.devices] == [
        ("boxes/box1/gpus/0", "0000:42:00.0"),
        ("boxes/box1/gpus/1", "0000:41:00.0"),
    ]
    assert result.host == "hosts/h1"
    assert result.xml == "".join(d.xml + "\n" for d in result.devices)


def test_node_hostdev_refuses_a_binding_without_an_address() -> None:
    with pytest.raises(FailedPrecondition, match="boxes/box1/gpus/0 has no usable PCI address"):
        node_hostdev(ready_node(bdfs=("",)))


# -- over the broker ---------------------------------------------------------------------


@pytest.fixture
def pool(broker: BrokerServer, stubs: Stubs, sim_pool: SimPool) -> SimPool:
    register_sim_box(sim_pool, stubs, "box1", gpus=4)
    sim_pool.start_agent("h1")
    wait_hosts_alive(stubs)
    return sim_pool


def compose_ready(stubs: Stubs, name: str, *, vfio: bool) -> pb.VirtualNode:
    spec = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=2), vfio=vfio)
    stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec, node_id=name))
    request = nodes_pb2.GetNodeRequest(name=f"nodes/{name}")
    wait_until(lambda: stubs.nodes.GetNode(request).state == pb.NODE_STATE_READY, message="READY")
    node: pb.VirtualNode = stubs.nodes.GetNode(request)
    return node


def hostdev(stubs: Stubs, name: str) -> nodes_pb2.NodeHostdev:
    request = nodes_pb2.GetNodeHostdevRequest(name=f"nodes/{name}")
    return stubs.nodes.GetNodeHostdev(request)  # type: ignore[no-any-return]


def test_hostdev_of_a_ready_vfio_node_names_the_devices_bound_on_its_host(
    stubs: Stubs, pool: SimPool
) -> None:
    node = compose_ready(stubs, "vm1", vfio=True)

    result = hostdev(stubs, "vm1")

    bound = {d.bdf for d in pool.fabric.devices("h1") if d.driver == VFIO_DRIVER}
    assert {d.bdf for d in result.devices} == bound
    assert len(bound) == 2
    assert [d.gpu for d in result.devices] == [b.gpu for b in node.gpus]
    assert result.host == "hosts/h1"
    for device in result.devices:
        address = ElementTree.fromstring(device.xml).find("source/address")
        assert address is not None
        domain, bus, _ = device.bdf.split(":")
        assert (address.get("domain"), address.get("bus")) == (f"0x{domain}", f"0x{bus}")


def test_hostdev_of_an_unknown_node_is_not_found(stubs: Stubs) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        hostdev(stubs, "ghost")
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert "node nodes/ghost does not exist" in str(raised.value.details())


def test_hostdev_of_a_node_without_vfio_is_a_failed_precondition(
    stubs: Stubs, pool: SimPool
) -> None:
    compose_ready(stubs, "plain", vfio=False)
    with pytest.raises(grpc.RpcError) as raised:
        hostdev(stubs, "plain")
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "compose it again with --vfio" in str(raised.value.details())


def test_hostdev_of_a_node_still_attaching_says_to_retry(
    stubs: Stubs, broker: BrokerServer, sim_pool: SimPool
) -> None:
    register_sim_box(sim_pool, stubs, "box1", gpus=2)
    sim_pool.start_agent("h1", map_delay_s=3.0)  # each map takes 3 s: READY comes late
    wait_hosts_alive(stubs)
    spec = pb.NodeSpec(gpus=pb.GpuRequest(count=2), vfio=True)
    stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec, node_id="slow"))

    with pytest.raises(grpc.RpcError) as raised:
        hostdev(stubs, "slow")

    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = str(raised.value.details())
    assert "node nodes/slow is " in details
    assert "not READY: its GPUs are not bound on its host yet; retry once it is READY" in details


@pytest.mark.parametrize(
    "state", [pb.NODE_STATE_FAILED, pb.NODE_STATE_LOST, pb.NODE_STATE_RELEASED]
)
def test_hostdev_of_a_node_past_ready_says_to_compose_anew(  # type: ignore[no-untyped-def]
    stubs: Stubs, etcd_client, key_prefix: str, state: int
) -> None:
    node = ready_node()
    node.state = state  # type: ignore[assignment]
    node.gpus[0].phase = pb.ATTACHMENT_PHASE_FAILED  # nothing left for the controller to do
    write_nodes(etcd_client, key_prefix, [node])

    with pytest.raises(grpc.RpcError) as raised:
        hostdev(stubs, "n1")

    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = str(raised.value.details())
    # The controller may move a hand-written node on (FAILED -> RELEASED) meanwhile;
    # either way it is past READY.
    assert "not READY, and will not be again" in details
    assert "compose a new node with --vfio" in details
