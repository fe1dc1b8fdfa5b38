"""The Redfish fence benchmark counts what it says: a scan reads every zone, an
``$expand``-ed scan one listing, ``Links.Zones`` none but the GPU's own."""

from __future__ import annotations

from bench.redfish_fence import MODES, fence_requests


def test_a_fence_reading_links_zones_costs_the_same_at_any_size() -> None:
    counts = {
        (zones, name): fence_requests(zones, *MODES[name])[0] for zones in (4, 16) for name in MODES
    }
    assert counts[(4, "scan")] == 2 * 4 + 5  # each zone read twice
    assert counts[(16, "scan")] == 2 * 16 + 5
    assert counts[(4, "scan+expand")] == counts[(16, "scan+expand")] == 5
    assert counts[(4, "endpoint")] == counts[(16, "endpoint")] == 5
