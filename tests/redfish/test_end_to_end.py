"""A pool on DMTF's own Redfish fabric: a lost host's GPUs are fenced and scrubbed at the
fabric manager before another host gets them.

Real processes: etcd, a broker (``python -m dxpool.broker --fabric redfish:MAP``) and two
host agents with the Redfish mapper (:mod:`tests.redfish.host_agent`: the agent's own
code, with only sysfs and NVML faked), launched by :mod:`tests.redfish.pool`. The fabric
manager is DMTF's Mockup Server serving ``public-cxl`` - its own ids, the switch's
endpoint in every zone, one zone per host port - behind the suite's proxy enforcing what
a conforming service does and the Mockup Server does not: ETags and If-Match (DSP0266
"ETags"), read-only ``Links.Endpoints`` (DSP0266 "PATCH (update)", Zone schema), the
``#Zone.AddEndpoint``/``#Zone.RemoveEndpoint`` actions (Zone v1.5+), and 202 with
empty-body task monitors for every action (DSP0266 "Asynchronous operations"). The GPUs'
reset is the CXL logical devices' secure erase, named in the fabric map.

compose on h1 -> READY -> h1's agent killed -> LOST, FENCING -> fence -> scrub -> FREE ->
composed on h2 -> READY, then the proxy's request log is checked for the order: each
GPU left h1's zone, was erased, and the erase ended before the GPU joined h2's zone, and
no GPU was ever in two zones. It takes about 20 s on a loaded two-core machine, so it
runs with the fast suite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from dxpool.api.v1 import inventory_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.store.embedded import EmbeddedEtcd
from tests.conftest import Stubs, wait_hosts_alive, wait_until
from tests.integration.test_node_lifecycle import compose, wait_state
from tests.redfish.mockup import MockupServer
from tests.redfish.pool import RedfishPool
from tests.redfish.proxy import Exchange, RecordingProxy, Rules

FABRIC = "/redfish/v1/Fabrics/CXL"
GPUS = {"boxes/b1/gpus/0": "T1", "boxes/b1/gpus/1": "T2"}
ERASE = "CXLLogicalDevice.PassphraseSecureErase"
LEASE_TTL_S = 2.0
DEADLINE_S = 90.0  # a loaded two-core machine starts four Python processes


def write_map(root: Path, url: str) -> Path:
    (root / "password").write_text("unused\n")
    path = root / "fabric-map.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "service": {
                    "url": url,
                    "fabric": "CXL",
                    "username": "Administrator",
                    "password_file": "password",
                    "timeout_s": 10,
                    "attempts": 3,
                    "task_timeout_s": 60,
                },
                "hosts": {
                    "h1": {"endpoint": "I1", "zone": 1, "slots": 2},
                    "h2": {"endpoint": "I2", "zone": 2, "slots": 2},
                },
                "boxes": {"b1": ["T1", "T2"]},
                "scrub": {
                    "actions": [
                        {
                            "name": f"#{ERASE}",
                            "parameters": {"PassphraseType": "Master", "Passphrase": "dxpool"},
                        }
                    ]
                },
            }
        )
    )
    return path


def zone_members(server: MockupServer, zone: str) -> list[str]:
    links: Any = server.get(f"{FABRIC}/Zones/{zone}")["Links"]["Endpoints"]
    return [link["@odata.id"].rpartition("/")[2] for link in links]


def gpus_in(server: MockupServer, zone: str) -> list[str]:
    return sorted(m for m in zone_members(server, zone) if m in GPUS.values())


def gpu_state(stubs: Stubs, name: str) -> int:
    return stubs.inventory.GetGpu(inventory_pb2.GetGpuRequest(name=name)).state


@pytest.fixture
def pool(
    tmp_path: Path, etcd_server: EmbeddedEtcd, key_prefix: str
) -> Iterator[Callable[[Path], RedfishPool]]:
    started: list[RedfishPool] = []

    def start(fabric_map: Path) -> RedfishPool:
        launched = RedfishPool(tmp_path, etcd_server.endpoint, key_prefix, fabric_map)
        started.append(launched)
        return launched

    yield start
    for launched in started:
        launched.stop()


def test_a_lost_hosts_gpus_are_fenced_and_scrubbed_before_another_host_gets_them(
    mockup: Callable[[str], MockupServer],
    proxied: Callable[[MockupServer, Rules], RecordingProxy],
    pool: Callable[[Path], RedfishPool],
    tmp_path: Path,
) -> None:
    server = mockup("public-cxl")
    proxy = proxied(
        server,
        Rules(etags="header", read_only_links=True, zone_actions=True, async_actions=True),
    )
    processes = pool(write_map(tmp_path, proxy.url))
    stubs = Stubs(grpc.insecure_channel(processes.start_broker()))
    try:
        stubs.inventory.CreateBox(
            inventory_pb2.CreateBoxRequest(
                box_id="b1",
                box=pb.Box(location=pb.Location(site="s1", pod="p1", rack="r1")),
                gpus=[
                    inventory_pb2.GpuSlotSpec(slot=s, model="H100", memory_mib=81920)
                    for s in range(2)
                ],
            )
        )
        h1 = processes.start_agent("h1", slots=2, store=server.url, lease_ttl_s=LEASE_TTL_S)
        processes.start_agent("h2", slots=2, store=server.url, lease_ttl_s=LEASE_TTL_S)
        wait_hosts_alive(stubs, 2, timeout_s=DEADLINE_S)
        # The mockup starts with T1 in zone 1 and T2 in zone 2, which nobody asked for:
        # each agent takes its orphan out of its zone.
        wait_until(
            lambda: gpus_in(server, "1") == gpus_in(server, "2") == [],
            DEADLINE_S,
            message="the agents to drop the mockup's mappings",
        )

        first = compose(stubs, "H100:2", host="hosts/h1")
        wait_state(stubs, first.name, pb.NODE_STATE_READY, timeout_s=DEADLINE_S)
        assert gpus_in(server, "1") == ["T1", "T2"]
        assert "1" in zone_members(server, "1")  # the switch's endpoint stays in the zone

        h1.kill()  # the host is lost: its lease expires, the leader fences its GPUs
        wait_state(stubs, first.name, pb.NODE_STATE_LOST, timeout_s=DEADLINE_S)
        seen: dict[str, set[int]] = {name: set() for name in GPUS}

        def all_free() -> bool:
            for name, endpoint in GPUS.items():
                state = gpu_state(stubs, name)
                seen[name].add(state)
                if state == pb.GPU_STATE_FREE:
                    assert endpoint not in gpus_in(server, "1"), f"{name} FREE while mapped"
                assert state != pb.GPU_STATE_QUARANTINED
            return all(pb.GPU_STATE_FREE in states for states in seen.values())

        wait_until(all_free, DEADLINE_S, message="the lost host's GPUs to be freed")
        assert all(pb.GPU_STATE_FENCING in states for states in seen.values()), seen

        second = compose(stubs, "H100:2", host="hosts/h2")
        wait_state(stubs, second.name, pb.NODE_STATE_READY, timeout_s=DEADLINE_S)
        assert gpus_in(server, "2") == ["T1", "T2"]
        assert gpus_in(server, "1") == []
        assert zone_members(server, "1") == ["I1", "1"]
    except BaseException:
        print(processes.logs())
        raise
    finally:
        stubs.channel.close()

    check_order(proxy.log)


def membership(exchange: Exchange) -> tuple[str, str, str] | None:
    """(add or remove, GPU endpoint, zone) of a zone action the proxy carried out."""
    if exchange.method != "POST" or exchange.status >= 400:
        return None
    if not exchange.path.endswith(("/Zone.AddEndpoint", "/Zone.RemoveEndpoint")):
        return None
    gpu = exchange.body["Endpoint"]["@odata.id"].rpartition("/")[2]
    zone = exchange.path.removeprefix(f"{FABRIC}/Zones/").split("/")[0]
    return ("add" if exchange.path.endswith("AddEndpoint") else "remove"), gpu, zone


def check_order(log: list[Exchange]) -> None:
    """From the proxy's record: no GPU was ever in two zones, and each left h1's zone,
    was erased, and its erase ended, before it joined h2's zone."""
    holders = {"T1": {"1"}, "T2": {"2"}}  # the mockup's starting state
    for exchange in log:
        change = membership(exchange)
        if change is None or change[1] not in holders:
            continue
        what, gpu, zone = change
        (holders[gpu].add if what == "add" else holders[gpu].discard)(zone)
        assert len(holders[gpu]) <= 1, f"{gpu} was in zones {sorted(holders[gpu])} at once"
    for gpu in ("T1", "T2"):
        joined = next(i for i, e in enumerate(log) if membership(e) == ("add", gpu, "2"))
        left = max(i for i, e in enumerate(log[:joined]) if membership(e) == ("remove", gpu, "1"))
        erase = next(
            i
            for i in range(left, joined)
            if log[i].method == "POST" and log[i].path.endswith(ERASE) and log[i].status == 202
        )
        monitor = log[erase].location
        ended = next(
            (
                i
                for i in range(erase, len(log))
                if log[i].path == monitor and log[i].method == "GET" and log[i].status != 202
            ),
            None,
        )
        assert ended is not None and ended < joined, (
            f"{gpu} joined h2's zone (request {joined}) before its erase ended ({ended})"
        )
