"""The host agent inside a QEMU guest, end to end: a real broker and etcd on this
machine, the agent with the Linux driver on the guest's kernel, and the emulated fabric
(``QemuFabric``) as both the agents' proxy hook and the broker's ``hook:`` box fabric.

Compose -> READY (the card visible in the guest, bound to vfio-pci, its address in
``node hostdev``) -> release -> the card gone -> FREE; and host loss (the guest killed)
-> the broker fences at the box side -> FREE -> composed on the other guest (opt-in:
``DXPOOL_KERNEL_HOST_LOSS=1``). The host-loss test kills the pciehp guest, so it runs
last.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from dxpool.api.v1 import inventory_pb2, nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.store.embedded import EmbeddedEtcd
from tests.conftest import Stubs, wait_until
from tests.kernel.box import E1000E_PCI_ID
from tests.kernel.conftest import PORTS, TIMINGS
from tests.kernel.qemu_fabric import QemuFabric
from tests.kernel.qemu_guest import GUEST_HOST, Guest
from tests.kernel.rig import device_of, driver_of

BOX = "kbox"
# The guest's agent must keep its lease alive from a TCG guest on a loaded machine,
# where a starved guest goes silent for tens of seconds: a TTL no real host needs.
LEASE_TTL_S = 60.0
READY_S = 900.0  # a generous deadline: TCG on a loaded machine
AGENT_PORTS = (PORTS[0], PORTS[1])  # host slots 0 and 1: ports with power controllers


def agent_command_line(
    *, host: str, etcd_port: int, key_prefix: str, hook: Path, state_dir: str
) -> list[str]:
    """How the agent is started inside a guest: the one place its options are listed."""
    return [
        sys.executable, "-m", "tests.kernel.guest_agent",
        "--host", host,
        "--etcd", f"{GUEST_HOST}:{etcd_port}",
        "--key-prefix", key_prefix,
        "--driver", "linux",
        "--slots", str(len(AGENT_PORTS)),
        *(f"--linux-port={slot}={port.bridge}" for slot, port in enumerate(AGENT_PORTS)),
        "--proxy-hook", str(hook),
        "--proxy-hook-timeout", "300",
        "--lease-ttl", str(LEASE_TTL_S),
        "--device-timeout", "180",
        "--resync-interval", "5",
        "--backoff-base", "0.5",
        "--state-dir", state_dir,
        "--site", "s1", "--pod", "p1", "--rack", "r1",
    ]  # fmt: skip


class GuestAgent:
    """The agent process of one guest's host."""

    def __init__(self, guest: Guest, host: str, argv: list[str]) -> None:
        self.guest, self.host = guest, host
        self.log = guest.share / f"agent-{host}.log"
        self.pid = int(guest.call("spawn", argv=argv, log_path=str(self.log)))

    def stop(self) -> None:
        if self.guest.alive and self.guest.call("poll", pid=self.pid) is None:
            self.guest.call("stop", pid=self.pid)

    def log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
        except FileNotFoundError:
            return "(no agent log)"


@pytest.fixture
def e2e(
    broker_factory: Callable[..., object],
    fabric: QemuFabric,
    etcd_server: EmbeddedEtcd,
    key_prefix: str,
    pciehp_guest: Guest,
    acpi_guest: Guest,
    tmp_path: Path,
) -> Iterator[tuple[Stubs, Callable[[Guest, str], GuestAgent]]]:
    hook = fabric.write_hook(tmp_path / "box-hook", f"127.0.0.1:{fabric.port}")
    broker = broker_factory(
        fabric=f"hook:{hook}", leader_ttl_s=2.0, fabric_hook_timeout_s=300.0, retention_s=1.0
    )
    channel = grpc.insecure_channel(broker.endpoint)  # type: ignore[attr-defined]
    stubs = Stubs(channel)
    stubs.inventory.CreateBox(
        inventory_pb2.CreateBoxRequest(
            box_id=BOX,
            box=pb.Box(location=pb.Location(site="s1", pod="p1", rack="r1")),
            gpus=[
                inventory_pb2.GpuSlotSpec(
                    slot=0, model="H100", memory_mib=81920, pci_id=E1000E_PCI_ID
                )
            ],
        )
    )
    agents: list[GuestAgent] = []

    def start_agent(guest: Guest, host: str) -> GuestAgent:
        fabric.add_host(host, guest, {s: p.qemu_id for s, p in enumerate(AGENT_PORTS)})
        guest_hook = fabric.write_hook(guest.share / "proxy-hook", f"{GUEST_HOST}:{fabric.port}")
        state_dir = guest.share / f"state-{host}"
        state_dir.mkdir(exist_ok=True)
        argv = agent_command_line(
            host=host,
            etcd_port=int(etcd_server.endpoint.rsplit(":", 1)[1]),
            key_prefix=key_prefix,
            hook=guest_hook,
            state_dir=str(state_dir),
        )
        agents.append(GuestAgent(guest, host, argv))
        return agents[-1]

    try:
        yield stubs, start_agent
    finally:
        for agent in agents:
            if agent.guest.alive:
                print(f"agent {agent.host} log:\n{agent.log_tail()}")
            agent.stop()
        channel.close()


def node(stubs: Stubs, name: str) -> pb.VirtualNode:
    return stubs.nodes.GetNode(nodes_pb2.GetNodeRequest(name=name))


def gpu_state(stubs: Stubs) -> int:
    return stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name=f"boxes/{BOX}/gpus/0")).state


def wait_node(stubs: Stubs, name: str, state: int, agent: GuestAgent) -> pb.VirtualNode:
    try:
        wait_until(
            lambda: node(stubs, name).state == state,
            READY_S,
            interval_s=0.2,
            message=f"{name} to be {pb.NodeState.Name(state)}",
        )
    except AssertionError:
        print(f"agent {agent.host} log:\n{agent.log_tail()}")
        raise
    return node(stubs, name)


def wait_alive(stubs: Stubs, host: str) -> None:
    """Wait until ``host``'s agent holds its lease (a starved guest may have let it
    lapse and registered again)."""
    wait_until(
        lambda: any(
            h.name == host and h.alive
            for h in stubs.inventory.ListHosts(inventory_pb2.ListHostsRequest()).hosts
        ),
        READY_S,
        interval_s=0.5,
        message=f"{host} alive",
    )


def compose(stubs: Stubs, host: str, *, vfio: bool) -> str:
    wait_alive(stubs, host)
    spec = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1), host=host, vfio=vfio)
    return stubs.nodes.ComposeNode(nodes_pb2.ComposeNodeRequest(spec=spec)).name


def test_compose_ready_release_free_with_the_agent_in_a_guest(
    e2e: tuple[Stubs, Callable[[Guest, str], GuestAgent]],
    pciehp_guest: Guest,
    acpi_guest: Guest,
    fabric: QemuFabric,
) -> None:
    stubs, start_agent = e2e
    card = QemuFabric.card(BOX, 0)
    agent = start_agent(pciehp_guest, "g1")
    with TIMINGS.phase("e2e: agent g1 started and registered"):
        wait_alive(stubs, "hosts/g1")

    # compose -> READY, bound to vfio-pci, its address in node hostdev
    started = time.monotonic()
    name = compose(stubs, "hosts/g1", vfio=True)
    ready = wait_node(stubs, name, pb.NODE_STATE_READY, agent)
    TIMINGS.phases.append(
        ("e2e: compose -> READY (vfio, pciehp guest)", time.monotonic() - started)
    )
    bdf = ready.gpus[0].bdf
    assert bdf == device_of(pciehp_guest, PORTS[0])
    assert driver_of(pciehp_guest, bdf) == "vfio-pci"
    assert ready.gpus[0].uuid == f"GPU-{card.dsn}"
    hostdev = stubs.nodes.GetNodeHostdev(nodes_pb2.GetNodeHostdevRequest(name=name))
    [device] = hostdev.devices
    assert device.bdf == bdf
    assert f'bus="0x{bdf[5:7]}" slot="0x00" function="0x0"' in device.xml

    # release -> the card gone -> FREE
    started = time.monotonic()
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=name))
    wait_until(lambda: gpu_state(stubs) == pb.GPU_STATE_FREE, READY_S, interval_s=0.2,
               message="the GPU FREE after release")  # fmt: skip
    TIMINGS.phases.append(("e2e: release -> GPU FREE (pciehp guest)", time.monotonic() - started))
    assert not pciehp_guest.call("exists", path=f"bus/pci/devices/{bdf}")
    assert fabric.mapped("g1") == {}


@pytest.mark.skipif(
    os.environ.get("DXPOOL_KERNEL_HOST_LOSS") != "1",
    reason="opt in with DXPOOL_KERNEL_HOST_LOSS=1: on a machine loaded enough to starve a "
    "TCG guest, the guest's agent loses its lease before the host is killed on purpose",
)
def test_host_loss_is_fenced_at_the_box_side_and_the_gpu_composed_on_another_guest(
    e2e: tuple[Stubs, Callable[[Guest, str], GuestAgent]],
    pciehp_guest: Guest,
    acpi_guest: Guest,
    fabric: QemuFabric,
) -> None:
    stubs, start_agent = e2e
    card = QemuFabric.card(BOX, 0)
    agent = start_agent(pciehp_guest, "g1")
    bdf = device_of(pciehp_guest, PORTS[0])
    # compose again, then lose the host: the guest is killed
    name = compose(stubs, "hosts/g1", vfio=False)
    wait_node(stubs, name, pb.NODE_STATE_READY, agent)
    assert driver_of(pciehp_guest, bdf) == "e1000e"
    pciehp_guest.kill()
    killed = time.monotonic()
    wait_until(lambda: node(stubs, name).state == pb.NODE_STATE_LOST, READY_S, interval_s=0.2,
               message="the node LOST")  # fmt: skip
    wait_until(lambda: gpu_state(stubs) == pb.GPU_STATE_FREE, READY_S, interval_s=0.2,
               message="the lost host's GPU fenced and FREE")  # fmt: skip
    TIMINGS.phases.append(("e2e: host loss (guest killed) -> GPU FREE", time.monotonic() - killed))
    assert fabric.mapped("g1") == {}
    assert any(e["argv"][0] == "fence-gpu" and e["rc"] == 0 for e in fabric.log)

    # composed on the other guest (ACPI hot-plug)
    other = start_agent(acpi_guest, "g2")
    with TIMINGS.phase("e2e: agent g2 started and registered"):
        wait_alive(stubs, "hosts/g2")
    started = time.monotonic()
    moved = wait_node(stubs, compose(stubs, "hosts/g2", vfio=True), pb.NODE_STATE_READY, other)
    TIMINGS.phases.append(("e2e: compose -> READY (vfio, ACPI guest)", time.monotonic() - started))
    assert driver_of(acpi_guest, moved.gpus[0].bdf) == "vfio-pci"
    assert moved.gpus[0].uuid == f"GPU-{card.dsn}"
