"""The public surface of dxpool.fabric is deliberate: adding or removing a name is a choice."""

from __future__ import annotations

import dxpool.fabric
from dxpool.fabric import sim


def test_exported_names_are_pinned() -> None:
    assert sorted(dxpool.fabric.__all__) == [
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
        "PROFILES",
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
    for name in dxpool.fabric.__all__:
        assert getattr(dxpool.fabric, name) is not None


def test_sim_errors_form_one_tree() -> None:
    for error in (sim.MappingConflict, sim.UnknownTarget, sim.InjectedFault, sim.Fenced):
        assert issubclass(error, sim.SimFabricError)
    assert sorted(sim.FAULT_OPS) == [
        "bind",
        "fence",
        "identity",
        "map",
        "rescan",
        "reset",
        "scrub",
        "unmap",
    ]
