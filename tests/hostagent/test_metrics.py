"""The agent's Prometheus metrics, scraped from a real agent process on --metrics-port
while a real broker composes and releases a node through it."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.hostagent import metrics
from dxpool.hostagent.errors import (
    AttachConflictError,
    DeviceTimeoutError,
    DriverError,
    GpuBusyError,
    IdentityMismatchError,
    ScrubError,
)
from tests.conftest import SimPool, Stubs, register_sim_box, wait_hosts_alive, wait_until
from tests.integration.test_node_lifecycle import compose, wait_state


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (IdentityMismatchError("x"), "identity_mismatch"),
        (AttachConflictError("x"), "conflict"),
        (DeviceTimeoutError("x"), "device_timeout"),
        (GpuBusyError("x", (1,)), "busy"),
        (ScrubError("x"), "unhealthy_after_reset"),
        (DriverError("x"), "transient"),
        (DriverError("x", retryable=False), "refused"),
    ],
)
def test_failure_reasons(error: DriverError, reason: str) -> None:
    assert metrics.failure_reason(error) == reason


def test_an_agent_serves_attach_and_detach_durations_failures_and_health(
    stubs: Stubs, sim_pool: SimPool
) -> None:
    port = free_port()
    register_sim_box(sim_pool, stubs, "box1", gpus=2)
    sim_pool.start_agent("h1", extra=("--metrics-port", str(port)))
    wait_hosts_alive(stubs)
    node = wait_state(stubs, compose(stubs, "H100:2").name, pb.NODE_STATE_READY)

    sim_pool.fabric.set_health("box1", 1, healthy=False)
    wait_state(stubs, node.name, pb.NODE_STATE_DEGRADED)
    attached = scrape(port)
    assert attached[("dxpool_agent_attach_duration_seconds_count", ())] == 2
    assert attached[("dxpool_agent_gpus", (("health", "HEALTHY"), ("phase", "ATTACHED")))] == 1
    assert attached[("dxpool_agent_gpus", (("health", "UNHEALTHY"), ("phase", "ATTACHED")))] == 1

    sim_pool.fabric.set_health("box1", 1, healthy=True)
    wait_state(stubs, node.name, pb.NODE_STATE_READY)
    sim_pool.fabric.inject_fault("reset", box="box1", slot=0, message="FLR timed out")
    stubs.nodes.ReleaseNode(nodes_pb2.ReleaseNodeRequest(name=node.name))
    wait_state(stubs, node.name, pb.NODE_STATE_RELEASED)

    def released() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        samples = scrape(port)
        done = samples.get(("dxpool_agent_detach_duration_seconds_count", ()), 0) == 2
        return samples if done else None

    samples = wait_until(released, message="both releases to be counted")
    assert isinstance(samples, dict)
    assert samples[("dxpool_agent_detach_failures_total", (("reason", "transient"),))] == 1
    wait_until(
        lambda: not any(name == "dxpool_agent_gpus" for name, _ in scrape(port)),
        message="the agent's status to empty once the broker recorded both releases",
    )
