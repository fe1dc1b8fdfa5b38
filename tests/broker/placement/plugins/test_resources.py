"""HostResourceBalance prefers the host whose CPU and memory left stay in proportion to
its free proxy slots."""

from __future__ import annotations

import dataclasses

import pytest

from dxpool.broker.placement import WeightedScore, default_pipeline, place
from dxpool.broker.placement.framework import BoxSupply, Proposal, Take
from dxpool.broker.placement.model import BoxInfo, GpuInfo, HostInfo, Place, PlacementRequest
from dxpool.broker.placement.plugins.resources import BALANCED, HostResourceBalance
from tests.broker.placement.pools import Pool, TableLatency


def proposal(count: int, host: HostInfo) -> Proposal:
    gpus = tuple(GpuInfo(f"boxes/b1/gpus/{s}", "b1", s, "H100", 1, True, True) for s in range(8))
    supply = BoxSupply(BoxInfo("b1", Place("boxes/b1"), True), gpus)
    return Proposal(host, host.free_slot_count(), (Take(supply, count, 1_000),), "test")


def host(cpus: int, memory: int, used_cpus: int = 0, used_memory: int = 0) -> HostInfo:
    return HostInfo(
        "h1", Place("hosts/h1"), 8, frozenset(), True, frozenset(), cpus, memory, used_cpus,
        used_memory,
    )  # fmt: skip


def test_leftovers_in_proportion_score_best() -> None:
    plugin = HostResourceBalance()
    request = PlacementRequest("", 4, cpu_cores=32, host_memory_mib=256)
    # half the slots, half the CPU and half the memory left: balanced
    assert plugin.score(request, proposal(4, host(64, 512))) == pytest.approx(BALANCED)
    # half the slots left, but 3/4 of the CPU and 1/4 of the memory left: off by 1/4 twice
    skewed = plugin.score(request, proposal(4, host(128, 341, 0, 0)))
    assert skewed == pytest.approx(BALANCED - 0.25 - abs((341 - 256) / 341 - 0.5))


def test_a_request_or_host_without_cpu_and_memory_is_balanced() -> None:
    plugin = HostResourceBalance()
    assert plugin.score(PlacementRequest("", 2), proposal(2, host(64, 512))) == BALANCED
    asking = PlacementRequest("", 2, cpu_cores=8)
    assert plugin.score(asking, proposal(2, host(0, 0))) == BALANCED
    assert plugin.normalize([BALANCED, 1.0]) == [100.0, 50.0]


def test_a_cpu_heavy_node_goes_where_cpu_is_plentiful_per_free_slot() -> None:
    pool = Pool().box("b1", 8)
    pool.hosts["lean"] = HostInfo("lean", Place("hosts/lean"), 8, frozenset(), True,
                                  frozenset(), 16, 65536)  # fmt: skip
    pool.hosts["rich"] = HostInfo("rich", Place("hosts/rich"), 8, frozenset(), True,
                                  frozenset(), 128, 65536)  # fmt: skip
    snapshot = pool.snapshot()
    base = default_pipeline()
    balanced = dataclasses.replace(
        base, scores=(*base.scores, WeightedScore(HostResourceBalance(), 2.0))
    )
    request = PlacementRequest("H100", 1, cpu_cores=16)
    default = place(request, snapshot, TableLatency())
    assert default.placement is not None and default.placement.host == "lean"  # ties by id
    chosen = place(request, snapshot, TableLatency(), balanced)
    # lean would keep 7 slots and no CPU; rich keeps 7/8 of both
    assert chosen.placement is not None and chosen.placement.host == "rich"
