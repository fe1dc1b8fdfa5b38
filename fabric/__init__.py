"""dxpool.fabric: the fabric between hosts and GPU boxes.

- :mod:`dxpool.fabric.topology`: where hosts and boxes sit (site / pod / rack) and what
  each switch costs, read from YAML.
- :mod:`dxpool.fabric.latency`: host-to-box round-trip estimates for placement.
- :mod:`dxpool.fabric.sim`: a simulated fabric (proxies, PCIe hotplug, drivers, NVML
  identity) shared between processes through a state directory.
"""

from __future__ import annotations

from dxpool.fabric.latency import LatencyEstimate, LatencyModel, Place, TopologyLatencyModel
from dxpool.fabric.sim import (
    InjectedFault,
    MappingConflict,
    SimDelays,
    SimDevice,
    SimFabric,
    SimFabricError,
    SimGpuSpec,
    SimIdentity,
    UnknownTarget,
)
from dxpool.fabric.topology import (
    LinkLatencies,
    Location,
    PodSpec,
    RackSpec,
    SiteSpec,
    SwitchLatencies,
    Topology,
    TopologyError,
)

__all__ = [
    "InjectedFault",
    "LatencyEstimate",
    "LatencyModel",
    "LinkLatencies",
    "Location",
    "MappingConflict",
    "Place",
    "PodSpec",
    "RackSpec",
    "SimDelays",
    "SimDevice",
    "SimFabric",
    "SimFabricError",
    "SimGpuSpec",
    "SimIdentity",
    "SiteSpec",
    "SwitchLatencies",
    "Topology",
    "TopologyError",
    "TopologyLatencyModel",
    "UnknownTarget",
]
