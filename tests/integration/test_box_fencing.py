"""A lost host's GPUs are revoked at the box side before anyone gets them again, with
the broker fencing through a Redfish fabric manager and through an operator's hook.

Real etcd, a real broker over gRPC, host agents running the Linux driver on fake kernel
trees (the same set-up as ``test_linux_agent.py``). With Redfish, the agents map by
zone membership at the local Redfish fabric service and the broker fences there
(``--fabric redfish:MAP``); with the hook, the agents' proxy hook and the broker's box
fabric hook are the same program over one mapping table (``--fabric hook:PATH``). Each
test blocks or fails the broker's first fences and shows the GPUs stay unavailable -
not FREE, not composable - until the fence has taken effect at the box side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from dxpool.api.v1 import inventory_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerServer
from dxpool.hostagent.agent import Agent
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.driver import StepDriver
from dxpool.hostagent.drivers.linux import make_linux_driver
from dxpool.hostagent.drivers.redfish import RedfishProxyMapper
from dxpool.hostagent.nvml import NvmlInspector
from dxpool.names import GpuRef, parse_gpu
from dxpool.redfish.fabric_map import load_fabric_map
from dxpool.redfish.session import RedfishSession
from tests.conftest import Stubs, wait_hosts_alive, wait_until
from tests.hostagent.linux_host import LinuxHost
from tests.hostagent.proxy_hook import box_log, fail_box_side, read_table
from tests.hostagent.redfish_service import (
    FABRIC,
    PASSWORD,
    USERNAME,
    RedfishFabricService,
    install,
    running_service,
    self_signed_cert,
)
from tests.integration.test_node_lifecycle import compose, wait_state

LEASE_TTL_S = 2.0
HELD_S = 2.5  # how long the broker's fences are kept from taking effect
ZONES = {"h1": ("h1-s0", "h1-s1"), "h2": ("h2-s0",)}


def endpoint_of(gpu: str) -> str:
    ref = parse_gpu(gpu)
    return f"GPU-{ref.box}-{ref.slot}"


@dataclass
class RedfishLinuxHost(LinuxHost):
    """A Linux host whose proxy slots are zones at a Redfish fabric service: a card sits
    behind a slot's bridge while the slot's zone holds the GPU's endpoint."""

    service: RedfishFabricService | None = None
    map_path: Path | None = None

    def mapped(self) -> dict[int, GpuRef]:
        assert self.service is not None
        found: dict[int, GpuRef] = {}
        for slot, zone in enumerate(ZONES[self.host]):
            for endpoint in self.service.zone(zone):
                if endpoint.startswith("GPU-"):
                    _, box, gpu_slot = endpoint.split("-")
                    found[slot] = GpuRef(box, int(gpu_slot))
        return found

    def driver(self, *, device_timeout_s: float = 2.0) -> StepDriver:
        assert self.map_path is not None
        fabric_map = load_fabric_map(self.map_path)
        mapper = RedfishProxyMapper(
            fabric_map, self.host, RedfishSession(fabric_map.service), retry_wait_s=0
        )
        inspector = NvmlInspector(self.nvml, xid_wait_ms=50)
        self._inspectors.append(inspector)
        return make_linux_driver(
            host_id=self.host,
            ports=self.ports,
            mapper=mapper,
            sysfs=self.kernel,
            inspector=inspector,
            device_timeout_s=device_timeout_s,
        )


@pytest.fixture
def start_agent(started_brokers: list[BrokerServer]) -> Iterator[Callable[[LinuxHost], Agent]]:
    """Start an agent for a fake Linux host, connected to the test's brokers; every one
    is stopped at teardown."""
    started: list[tuple[Agent, LinuxHost]] = []

    def start(host: LinuxHost) -> Agent:
        config = AgentConfig(
            host_id=host.host,
            brokers=",".join(b.agent_endpoint for b in started_brokers),
            site="s1",
            pod="p1",
            rack="r1",
            slot_capacity=host.slots,
            driver="linux",
            linux_ports=host.ports,
            proxy_hook=host.hook,
            sysfs_root=host.kernel.root,
            lease_ttl_s=LEASE_TTL_S,
            resync_interval_s=1,
            backoff_base_s=0.05,
            backoff_max_s=0.5,
            workers=2,
        )
        agent = Agent(config, host.driver(device_timeout_s=5))
        agent.start()
        started.append((agent, host))
        return agent

    yield start
    for agent, host in started:
        agent.stop()
        host.close()


def fencing_broker(broker_factory: Callable[..., BrokerServer], fabric: str) -> Stubs:
    broker = broker_factory(fabric=fabric, leader_ttl_s=2.0)
    return Stubs(grpc.insecure_channel(broker.endpoint))


def add_box(stubs: Stubs, gpus: int) -> None:
    stubs.inventory.CreateBox(
        inventory_pb2.CreateBoxRequest(
            box_id="b1",
            box=pb.Box(location=pb.Location(site="s1", pod="p1", rack="r1")),
            gpus=[
                inventory_pb2.GpuSlotSpec(
                    slot=s, model="H100", memory_mib=81920, pci_id="10de:2330"
                )
                for s in range(gpus)
            ],
        )
    )


def gpu(stubs: Stubs, name: str) -> pb.Gpu:
    return stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name=name))


def lose_host(stubs: Stubs, agent: Agent, node: str, gpus: list[str]) -> None:
    """Stop the agent without releasing its host (as if it died): its liveness TTL
    passes, the node goes LOST and its GPUs FENCING."""
    agent.stop(release=False)
    wait_state(stubs, node, pb.NODE_STATE_LOST, timeout_s=LEASE_TTL_S + 10)
    wait_until(
        lambda: all(gpu(stubs, g).state != pb.GPU_STATE_ATTACHED for g in gpus),
        message="the lost host's GPUs to be let go",
    )
    states = {g: pb.GpuState.Name(gpu(stubs, g).state) for g in gpus}
    assert set(states.values()) == {"GPU_STATE_FENCING"}, f"not held for fencing: {states}"


def assert_unavailable_for(
    stubs: Stubs, gpus: list[str], seconds: float, still_mapped: Callable[[], bool]
) -> None:
    """For ``seconds``: none of ``gpus`` is FREE, the box side still maps them, and a
    compose that could only be served by them is refused."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        states = {g: gpu(stubs, g).state for g in gpus}
        assert set(states.values()) == {pb.GPU_STATE_FENCING}, states
        assert still_mapped()
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as refused:
        compose(stubs, "H100:1", host="hosts/h2")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()


def wait_free_after(stubs: Stubs, gpus: list[str], revoked: Callable[[str], bool]) -> None:
    """Wait until every one of ``gpus`` is FREE, checking at the moment each is first
    seen FREE that the box side had already revoked it."""
    pending = set(gpus)
    deadline = time.monotonic() + 15
    while pending:
        for name in sorted(pending):
            state = gpu(stubs, name).state
            assert state != pb.GPU_STATE_QUARANTINED, gpu(stubs, name).message
            if state == pb.GPU_STATE_FREE:
                assert revoked(name), f"{name} was FREE while the box side still mapped it"
                pending.discard(name)
        assert time.monotonic() < deadline, f"{sorted(pending)} never became FREE"
        time.sleep(0.02)


# -- Redfish ----------------------------------------------------------------------------------


@pytest.fixture
def redfish_service(tmp_path: Path) -> Iterator[tuple[RedfishFabricService, Path]]:
    """The fabric service over HTTPS, and the fabric map naming it (as both the agents
    and the broker read it)."""
    cert, _ = tls = self_signed_cert(tmp_path)
    service = RedfishFabricService()
    install(service)
    with running_service(service, tls=tls) as running:
        (tmp_path / "password").write_text(PASSWORD + "\n")
        map_path = tmp_path / "fabric-map.yaml"
        map_path.write_text(
            yaml.safe_dump(
                {
                    "service": {
                        "url": running.url,
                        "fabric": FABRIC,
                        "username": USERNAME,
                        "password_file": "password",
                        "ca_bundle": cert.name,
                        "timeout_s": 0.5,
                        "attempts": 2,
                    },
                    "hosts": {
                        host: {"endpoint": f"HostPort-{host}", "zones": list(zones)}
                        for host, zones in ZONES.items()
                    },
                    "boxes": {"b1": [f"GPU-b1-{slot}" for slot in range(4)]},
                }
            )
        )
        yield running, map_path


def test_a_lost_hosts_gpus_leave_its_zones_before_they_are_free_again(
    broker_factory: Callable[..., BrokerServer],
    start_agent: Callable[[LinuxHost], Agent],
    redfish_service: tuple[RedfishFabricService, Path],
    tmp_path: Path,
) -> None:
    service, map_path = redfish_service
    stubs = fencing_broker(broker_factory, f"redfish:{map_path}")
    add_box(stubs, gpus=2)  # both GPUs go to h1's node: nothing else to hand out
    lost = start_agent(
        RedfishLinuxHost(tmp_path / "h1", host="h1", slots=2, service=service, map_path=map_path)
    )
    start_agent(
        RedfishLinuxHost(tmp_path / "h2", host="h2", slots=1, service=service, map_path=map_path)
    )
    wait_hosts_alive(stubs, 2)
    node = wait_state(stubs, compose(stubs, "H100:2", host="hosts/h1").name, pb.NODE_STATE_READY)
    gpus = sorted(b.gpu for b in node.gpus)
    assert sorted(m for z in ZONES["h1"] for m in service.zone(z) if m.startswith("GPU-")) == [
        endpoint_of(g) for g in gpus
    ]

    def in_h1_zones(name: str) -> bool:
        return any(endpoint_of(name) in service.zone(zone) for zone in ZONES["h1"])

    # the broker's zone changes wait, and time out
    gate = service.hold("POST", "/Actions/Zone.RemoveEndpoint")
    try:
        lose_host(stubs, lost, node.name, gpus)
        assert_unavailable_for(
            stubs, gpus, HELD_S, still_mapped=lambda: all(in_h1_zones(g) for g in gpus)
        )
        assert service.resets == []  # not scrubbed either: it is still mapped
    finally:
        gate.set()

    wait_free_after(
        stubs,
        gpus,
        revoked=lambda name: (
            not in_h1_zones(name)
            and endpoint_of(name) in [endpoint for endpoint, _ in service.resets_done]
        ),
    )
    assert all(service.zone(zone) == ["HostPort-h1"] for zone in ZONES["h1"])

    # The fenced GPU serves the next compose, on another host.
    reused = wait_state(stubs, compose(stubs, "H100:1", host="hosts/h2").name, pb.NODE_STATE_READY)
    (binding,) = reused.gpus
    assert service.zone("h2-s0") == ["HostPort-h2", endpoint_of(binding.gpu)]


# -- hook -------------------------------------------------------------------------------------


def test_a_lost_hosts_gpus_are_fenced_by_the_hook_before_they_are_free_again(
    broker_factory: Callable[..., BrokerServer],
    start_agent: Callable[[LinuxHost], Agent],
    tmp_path: Path,
) -> None:
    first = LinuxHost(tmp_path / "h1", host="h1", slots=2)
    second = LinuxHost(tmp_path / "h2", host="h2", slots=1)
    second.hook = first.hook  # one proxy table for the whole fabric
    hook = first.hook
    stubs = fencing_broker(broker_factory, f"hook:{hook}")
    add_box(stubs, gpus=2)
    lost = start_agent(first)
    start_agent(second)
    wait_hosts_alive(stubs, 2)
    node = wait_state(stubs, compose(stubs, "H100:2", host="hosts/h1").name, pb.NODE_STATE_READY)
    gpus = sorted(b.gpu for b in node.gpus)
    generations = {g: gpu(stubs, g).generation for g in gpus}

    def mapped_on_h1(name: str) -> bool:
        return parse_gpu(name) in read_table(hook).get("h1", {}).values()

    fail_box_side(hook, "fence-gpu", True)
    try:
        lose_host(stubs, lost, node.name, gpus)
        assert_unavailable_for(
            stubs, gpus, HELD_S, still_mapped=lambda: all(mapped_on_h1(g) for g in gpus)
        )
        assert box_log(hook) == []
    finally:
        fail_box_side(hook, "fence-gpu", False)

    def fenced_and_scrubbed(name: str) -> bool:
        done = [
            (entry["op"], entry["generation"])
            for entry in box_log(hook)
            if entry["gpu"] == f"{parse_gpu(name).box}/{parse_gpu(name).slot}"
        ]
        return not mapped_on_h1(name) and done == [
            ("fence-gpu", generations[name]),
            ("scrub-gpu", generations[name]),
        ]

    wait_free_after(stubs, gpus, revoked=fenced_and_scrubbed)
    assert read_table(hook)["h1"] == {}

    reused = wait_state(stubs, compose(stubs, "H100:1", host="hosts/h2").name, pb.NODE_STATE_READY)
    (binding,) = reused.gpus
    assert read_table(hook)["h2"] == {0: parse_gpu(binding.gpu)}
    assert gpu(stubs, binding.gpu).generation > generations[binding.gpu]


def test_a_broker_the_fabric_manager_refuses_never_frees_and_quarantines(
    broker_factory: Callable[..., BrokerServer],
    start_agent: Callable[[LinuxHost], Agent],
    redfish_service: tuple[RedfishFabricService, Path],
    tmp_path: Path,
) -> None:
    service, map_path = redfish_service
    wrong = yaml.safe_load(map_path.read_text())
    wrong["service"]["password_file"] = "wrong-password"
    (tmp_path / "wrong-password").write_text("not-the-password\n")
    broker_map = tmp_path / "broker-map.yaml"
    broker_map.write_text(yaml.safe_dump(wrong))
    stubs = fencing_broker(broker_factory, f"redfish:{broker_map}")
    add_box(stubs, gpus=1)
    lost = start_agent(
        RedfishLinuxHost(tmp_path / "h1", host="h1", slots=2, service=service, map_path=map_path)
    )
    wait_hosts_alive(stubs)
    node = wait_state(stubs, compose(stubs, "H100:1", host="hosts/h1").name, pb.NODE_STATE_READY)
    (name,) = [b.gpu for b in node.gpus]

    lose_host(stubs, lost, node.name, [name])
    seen: set[int] = set()

    def quarantined() -> bool:
        state = gpu(stubs, name).state
        seen.add(state)
        return state == pb.GPU_STATE_QUARANTINED

    wait_until(quarantined, timeout_s=30, message="the unfenceable GPU to be quarantined")
    assert pb.GPU_STATE_FREE not in seen
    assert "refused the credentials of Redfish user 'dxpool'" in gpu(stubs, name).message
    assert any(endpoint_of(name) in service.zone(zone) for zone in ZONES["h1"])  # untouched
    assert len(service.writes()) == 1  # the agent's map; the broker never got to write
