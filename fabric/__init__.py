"""dxpool.fabric: the fabric between hosts and GPU boxes.

- :mod:`dxpool.fabric.topology`: where hosts and boxes sit (site / pod / rack) and what
  each switch costs, read from YAML.
- :mod:`dxpool.fabric.latency`: host-to-box round-trip estimates for placement (the tree
  model), and the contracts every latency model keeps.
- :mod:`dxpool.fabric.matrix`: an operator's round trips per rack, pod or site pair.
- :mod:`dxpool.fabric.measured`: round trips agents measure, smoothed, with staleness.
- :mod:`dxpool.fabric.models`: which of those a deployment uses.
- :mod:`dxpool.fabric.overhead`: a DxPU-style model of a workload's slowdown for a round
  trip.
- :mod:`dxpool.fabric.sim`: a simulated fabric (proxies, PCIe hotplug, drivers, NVML
  identity) shared between processes through a state directory.
"""

from __future__ import annotations

from dxpool.fabric.latency import (
    LatencyEstimate,
    LatencyModel,
    LatencySource,
    Place,
    StaticLatency,
    TieredLatencyModel,
    TopologyLatencyModel,
)
from dxpool.fabric.matrix import LatencyMatrix, MatrixError, MatrixLatencyModel
from dxpool.fabric.measured import (
    MeasuredLatency,
    MeasuredLatencyModel,
    Measurement,
    RoundTripSmoother,
)
from dxpool.fabric.models import LatencySettings, build_latency_source
from dxpool.fabric.overhead import PROFILES, WorkloadProfile, parse_workload
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
    "PROFILES",
    "InjectedFault",
    "LatencyEstimate",
    "LatencyMatrix",
    "LatencyModel",
    "LatencySettings",
    "LatencySource",
    "LinkLatencies",
    "Location",
    "MappingConflict",
    "MatrixError",
    "MatrixLatencyModel",
    "MeasuredLatency",
    "MeasuredLatencyModel",
    "Measurement",
    "Place",
    "PodSpec",
    "RackSpec",
    "RoundTripSmoother",
    "SimDelays",
    "SimDevice",
    "SimFabric",
    "SimFabricError",
    "SimGpuSpec",
    "SimIdentity",
    "SiteSpec",
    "StaticLatency",
    "SwitchLatencies",
    "TieredLatencyModel",
    "Topology",
    "TopologyError",
    "TopologyLatencyModel",
    "UnknownTarget",
    "WorkloadProfile",
    "build_latency_source",
    "parse_workload",
]
