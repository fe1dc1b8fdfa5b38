"""``python -m tests.redfish.host_agent``: a host agent process on a fake Linux host whose
box side is a Redfish fabric manager.

It runs what ``python -m dxpool.hostagent --driver linux --redfish-map MAP`` runs - the
agent's own selection of the Redfish mapper from its config (``build_proxy_mapper``: load
the map, log in, check it against the service), the Linux driver, the agent's reconcile
loop over etcd - with only the hardware faked: the kernel's sysfs tree and NVML
(:class:`~tests.hostagent.linux_host.LinuxHost`). The fake kernel shows a card behind a
host slot's bridge while the host's zone at the fabric manager holds that GPU's endpoint
(read straight from the Mockup Server's store with ``--store``, so the fake's reads do not
appear in the proxy's request log) at the slot the agent recorded for it.

SIGTERM stops the agent cleanly (its lease revoked); SIGKILL is a host lost.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import requests

from dxpool.hostagent.agent import Agent
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.drivers import build_proxy_mapper
from dxpool.hostagent.drivers.linux import make_linux_driver
from dxpool.hostagent.drivers.redfish_slots import LEDGER_FILE
from dxpool.hostagent.nvml import NvmlInspector
from dxpool.names import GpuRef, parse_gpu
from dxpool.redfish.fabric_map import load_fabric_map
from dxpool.store.client import connect
from tests.hostagent.linux_host import LinuxHost


@dataclass
class RedfishPortHost(LinuxHost):
    """A fake Linux host whose slots show the GPUs its port zone holds at the store."""

    store: str = ""
    zone_path: str = ""
    endpoints: dict[str, GpuRef] = field(default_factory=dict)
    ledger: Path = field(default_factory=Path)

    def mapped(self) -> dict[int, GpuRef]:
        try:
            zone = requests.get(f"{self.store}{self.zone_path}", timeout=10).json()
            recorded = json.loads(self.ledger.read_text())["slots"]
        except (OSError, ValueError, KeyError, requests.RequestException):
            return {}
        held = {
            self.endpoints[link["@odata.id"].rpartition("/")[2]]
            for link in zone.get("Links", {}).get("Endpoints", [])
            if link["@odata.id"].rpartition("/")[2] in self.endpoints
        }
        slots = {int(slot): parse_gpu(name) for slot, name in recorded.items()}
        return {slot: gpu for slot, gpu in slots.items() if gpu in held}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.redfish.host_agent")
    parser.add_argument("--host", required=True)
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--redfish-map", type=Path, required=True)
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True, help="the fake host's files")
    parser.add_argument("--store", required=True, help="the Mockup Server, read straight")
    parser.add_argument("--lease-ttl", type=float, default=2.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    fabric_map = load_fabric_map(args.redfish_map)
    entry = fabric_map.hosts[args.host]
    fabric_path = f"/redfish/v1/Fabrics/{fabric_map.service.fabric}"
    state_dir = args.root / "state"
    host = RedfishPortHost(
        args.root,
        host=args.host,
        slots=args.slots,
        store=args.store,
        zone_path=f"{fabric_path}/Zones/{entry.zones[0]}",
        endpoints={
            endpoint: GpuRef(box, slot)
            for box, ids in fabric_map.boxes.items()
            for slot, endpoint in enumerate(ids)
        },
        ledger=state_dir / LEDGER_FILE,
    )
    config = AgentConfig(
        host_id=args.host,
        etcd_endpoints=args.etcd,
        key_prefix=args.prefix,
        site="s1",
        pod="p1",
        rack="r1",
        slot_capacity=args.slots,
        driver="linux",
        linux_ports=host.ports,
        redfish_map=args.redfish_map,
        sysfs_root=host.kernel.root,
        state_dir=state_dir,
        lease_ttl_s=args.lease_ttl,
        resync_interval_s=1,
        backoff_base_s=0.1,
        backoff_max_s=1.0,
        workers=2,
    )
    mapper = build_proxy_mapper(config)
    assert mapper is not None
    driver = make_linux_driver(
        host_id=args.host,
        ports=host.ports,
        mapper=mapper,
        sysfs=host.kernel,
        inspector=NvmlInspector(host.nvml, xid_wait_ms=50),
        device_timeout_s=10,
    )
    client = connect(config.etcd_endpoints)
    agent = Agent(config, driver, client)

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        agent.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.start()
        while not agent.wait(0.5):
            pass
        return 0
    finally:
        agent.stop()
        client.close()
        mapper.close()
        host.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
