"""The driver registry: ``build_driver(config)``."""

from __future__ import annotations

from pathlib import Path

import pytest

from dxpool.errors import FailedPrecondition, InvalidArgument
from dxpool.fabric.sim import SimFabric
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.driver import AttachRequest
from dxpool.hostagent.drivers import build_driver
from dxpool.names import GpuRef


def test_sim_driver_attaches_on_the_configured_fabric(sim_fabric: SimFabric) -> None:
    driver = build_driver(
        AgentConfig(host_id="h1", slot_capacity=4, sim_state_dir=sim_fabric.state_dir)
    )

    driver.attach(AttachRequest(GpuRef("b2", 1), host_slot=3))

    assert sim_fabric.mappings("h1") == {3: ("b2", 1)}


def test_sim_driver_installs_a_host_the_fabric_lacks(sim_fabric: SimFabric) -> None:
    build_driver(AgentConfig(host_id="h9", slot_capacity=2, sim_state_dir=sim_fabric.state_dir))

    assert sim_fabric.hosts()["h9"] == 2


def test_sim_driver_rejects_a_slot_capacity_the_fabric_contradicts(sim_fabric: SimFabric) -> None:
    config = AgentConfig(host_id="h1", slot_capacity=8, sim_state_dir=sim_fabric.state_dir)

    with pytest.raises(InvalidArgument, match="pass --slot-capacity 4"):
        build_driver(config)


def test_sim_driver_needs_a_state_dir() -> None:
    with pytest.raises(InvalidArgument, match="--sim-state-dir"):
        build_driver(AgentConfig(host_id="h1"))


def test_sim_driver_needs_an_existing_fabric(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="no simulated fabric"):
        build_driver(AgentConfig(host_id="h1", sim_state_dir=tmp_path))


def test_unknown_driver_names_the_choices() -> None:
    with pytest.raises(
        InvalidArgument, match="unknown fabric driver 'vendor-x': choose one of linux, sim"
    ):
        build_driver(AgentConfig(host_id="h1", driver="vendor-x"))
