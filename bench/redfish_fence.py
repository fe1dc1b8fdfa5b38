"""HTTP requests of one broker fence at a Redfish fabric manager, by fabric size and by how
the zones holding the GPU are found.

A fabric of ZONES host zones (one host port each; the test Redfish service of
``tests/hostagent/redfish_service.py``, which behaves as DMTF's standard allows) holds one
GPU in one zone. The broker's box fabric (``RedfishBoxFabric``) fences it, and the
requests the service received for that fence are counted, under each way of finding the
zones that hold the GPU:

* ``scan``: every zone read, one GET each after the listing - what the fence always did
  before it could read ``Links.Zones`` (the baseline);
* ``scan+expand``: every zone read in one ``$expand``-ed listing, on a service whose root
  advertises ``ExpandQuery``;
* ``endpoint``: the GPU endpoint's own ``Links.Zones`` (pinned with ``zone_lookup:
  endpoint``, or learned by ``auto`` after dxpool saw one of its changes show up there).

Each fence is preceded by a fence of a GPU in no zone on the same box fabric, so the
login and the one-off reads (the service root) are not counted. Requests are counted,
not timed: the figure does not depend on the machine. The wall time of the fence is
printed for the record.

Usage: python -m bench.redfish_fence [--zones 8,64,256]
"""

from __future__ import annotations

import argparse
import logging
import time

from dxpool.broker.control.box_fabric_redfish import RedfishBoxFabric
from dxpool.names import GpuRef
from dxpool.redfish.fabric_map import (
    RedfishFabricMap,
    RedfishHost,
    RedfishService,
    ZoneLookup,
)
from tests.hostagent.redfish_service import (
    FABRIC,
    PASSWORD,
    SESSIONS,
    USERNAME,
    RedfishFabricService,
    running_service,
)

MODES = {
    "scan": (ZoneLookup.SCAN, False),
    "scan+expand": (ZoneLookup.SCAN, True),
    "endpoint": (ZoneLookup.ENDPOINT, False),
}
FENCED = GpuRef("b1", 0)
IDLE = GpuRef("b1", 1)


def fence_requests(
    zones: int, lookup: ZoneLookup, expand: bool
) -> tuple[int, dict[str, int], float]:
    """(requests, requests by method, seconds) of one fence in a fabric of ``zones``."""
    service = RedfishFabricService(expand=expand, async_actions=False)
    for index in range(zones):
        service.add_endpoint(f"HostPort-h{index}", "Initiator")
    service.add_endpoint("GPU-b1-0", "Target")
    service.add_endpoint("GPU-b1-1", "Target")
    for index in range(zones):
        held = ["HostPort-h0", "GPU-b1-0"] if index == 0 else [f"HostPort-h{index}"]
        service.add_zone(f"z{index}", held)
    with running_service(service) as running:
        fabric_map = RedfishFabricMap(
            service=RedfishService(
                url=running.url,
                fabric=FABRIC,
                username=USERNAME,
                password=PASSWORD,
                timeout_s=30,
                zone_lookup=lookup,
            ),
            hosts={
                f"h{index}": RedfishHost(endpoint=f"HostPort-h{index}", zones=(f"z{index}",))
                for index in range(zones)
            },
            boxes={"b1": ("GPU-b1-0", "GPU-b1-1")},
        )
        box = RedfishBoxFabric(fabric_map, retry_wait_s=0)
        try:
            box.fence(IDLE, generation=1)  # logs in; reads the root once
            before = len(service.requests)
            began = time.perf_counter()
            box.fence(FENCED, generation=1)
            took = time.perf_counter() - began
        finally:
            box.close()
        assert service.zones_of("GPU-b1-0") == [], "the fence left the GPU in a zone"
        counted = [r for r in service.requests[before:] if not r.path.startswith(SESSIONS)]
    by_method: dict[str, int] = {}
    for request in counted:
        by_method[request.method] = by_method.get(request.method, 0) + 1
    return len(counted), by_method, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zones", default="8,64,256", help="fabric sizes, comma-separated")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # each fence logs a warning; not wanted here
    sizes = [int(size) for size in args.zones.split(",")]
    print(f"{'zones':>6}  {'lookup':<12} {'requests':>8}  {'GET':>5} {'POST':>4}  "
          f"{'vs scan':>8}  {'fence ms':>8}")  # fmt: skip
    for zones in sizes:
        baseline = 0
        for name, (lookup, expand) in MODES.items():
            count, by_method, took = fence_requests(zones, lookup, expand)
            baseline = baseline or count
            print(
                f"{zones:>6}  {name:<12} {count:>8}  {by_method.get('GET', 0):>5} "
                f"{by_method.get('POST', 0):>4}  {count / baseline:>7.3f}x  {took * 1000:>8.1f}"
            )


if __name__ == "__main__":
    main()
