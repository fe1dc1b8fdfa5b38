"""Reconciler over the simulated fabric, with status written through a real broker's
session into a real etcd."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dxpool.api.v1 import resources_pb2
from dxpool.fabric.sim import InjectedFault, SimFabric
from dxpool.hostagent.desired import DesiredState
from dxpool.hostagent.driver import StepDriver
from dxpool.hostagent.drivers.sim import make_sim_driver
from dxpool.hostagent.link import BrokerLink
from dxpool.hostagent.reconcile import Outcome, Reconciler
from dxpool.hostagent.status import StatusStore
from dxpool.names import GpuRef
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema
from tests.hostagent.linux_host import LinuxHost, device_for

from .conftest import HOST

GPU = GpuRef("b1", 0)
OTHER_GPU = GpuRef("b1", 1)
Phase = resources_pb2.AttachmentPhase


def want(
    gpu: GpuRef, host_slot: int, generation: int = 1, **fields: Any
) -> resources_pb2.DesiredAttachment:
    return resources_pb2.DesiredAttachment(
        gpu=gpu.name, host_slot=host_slot, node="nodes/n1", generation=generation, **fields
    )


@dataclass
class Harness:
    fabric: SimFabric
    driver: StepDriver
    desired: DesiredState
    status: StatusStore
    reconciler: Reconciler
    client: Any
    keys: KeySchema
    link: BrokerLink

    def set_desired(self, *attachments: resources_pb2.DesiredAttachment) -> int:
        """Write the spec to etcd as the broker would, and adopt it as the watch would;
        returns its revision."""
        allocation = resources_pb2.HostAllocation(host=f"hosts/{HOST}", attachments=attachments)
        response = self.client.put(self.keys.host_allocation(HOST), allocation.SerializeToString())
        revision = int(response.header.revision)
        self.desired.replace(allocation, revision, revision)
        return revision

    def stored(self) -> dict[str, resources_pb2.ObservedAttachment]:
        """The status record as etcd holds it, by GPU name."""
        value, _ = self.client.get(self.keys.host_status(HOST))
        if value is None:
            return {}
        record = resources_pb2.HostStatus.FromString(value)
        assert record.host == f"hosts/{HOST}"
        return {entry.gpu: entry for entry in record.attachments}

    def restart(self) -> Harness:
        """A new agent's view: fresh driver, desired state and status as stored."""
        status = StatusStore(self.link, HOST)
        value, _ = self.client.get(self.keys.host_status(HOST))
        status.adopt(resources_pb2.HostStatus.FromString(value) if value is not None else None)
        driver = make_sim_driver(self.fabric, HOST, device_timeout_s=2.0)
        desired = DesiredState(HOST)
        reconciler = Reconciler(driver=driver, desired=desired, status=status, attach_attempts=3)
        return Harness(
            self.fabric, driver, desired, status, reconciler, self.client, self.keys, self.link
        )


@pytest.fixture
def harness(
    sim_fabric: SimFabric,
    sim_driver: StepDriver,
    etcd_server: EmbeddedEtcd,
    key_prefix: str,
    open_link: Callable[..., BrokerLink],
) -> Iterator[Harness]:
    client = connect(etcd_server.endpoint)
    keys = KeySchema(key_prefix)
    desired = DesiredState(HOST)
    link = open_link()
    status = StatusStore(link, HOST)
    reconciler = Reconciler(driver=sim_driver, desired=desired, status=status, attach_attempts=3)
    yield Harness(sim_fabric, sim_driver, desired, status, reconciler, client, keys, link)
    client.close()


def test_desired_gpu_is_attached_and_reported(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=1, generation=7, model="H100"))

    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    entry = harness.stored()[GPU.name]
    assert entry.phase == Phase.ATTACHMENT_PHASE_ATTACHED
    assert entry.generation == 7
    assert entry.host_slot == 1
    assert entry.bdf == "0000:42:00.0"
    assert entry.uuid == harness.fabric.identity(HOST, entry.bdf).uuid
    assert entry.serial
    assert entry.health == resources_pb2.GPU_HEALTH_HEALTHY
    assert entry.HasField("update_time")
    assert harness.fabric.mappings(HOST) == {1: ("b1", 0)}


def test_attached_as_asked_updates_status_without_touching_hardware(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=1, generation=1))
    harness.reconciler.reconcile(GPU)
    harness.fabric.inject_fault("map", box="b1", slot=0)

    harness.set_desired(want(GPU, host_slot=1, generation=2))
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    entry = harness.stored()[GPU.name]
    assert (entry.phase, entry.generation) == (Phase.ATTACHMENT_PHASE_ATTACHED, 2)
    with pytest.raises(InjectedFault):  # still pending: reconcile did not map again
        harness.fabric.map("b1", 0, HOST, 1)


def test_an_unchanged_status_is_not_rewritten(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=0))
    harness.reconciler.reconcile(GPU)
    _, before = harness.client.get(harness.keys.host_status(HOST))

    harness.reconciler.reconcile(GPU)

    _, after = harness.client.get(harness.keys.host_status(HOST))
    assert after.mod_revision == before.mod_revision


def test_gpu_no_longer_desired_is_detached_then_its_entry_removed(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=0), want(OTHER_GPU, host_slot=1))
    harness.reconciler.reconcile(GPU)
    harness.reconciler.reconcile(OTHER_GPU)

    harness.set_desired(want(OTHER_GPU, host_slot=1))
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    assert set(harness.stored()) == {OTHER_GPU.name}
    assert harness.fabric.mappings(HOST) == {1: ("b1", 1)}


def test_a_failed_detach_keeps_the_entry_and_retries(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=0, generation=3))
    harness.reconciler.reconcile(GPU)
    harness.fabric.inject_fault("unmap", box="b1", slot=0, message="proxy unreachable")
    harness.set_desired()

    assert harness.reconciler.reconcile(GPU) is Outcome.RETRY
    entry = harness.stored()[GPU.name]
    assert entry.phase == Phase.ATTACHMENT_PHASE_DETACHING
    assert entry.generation == 3
    assert "proxy unreachable" in entry.message

    assert harness.reconciler.reconcile(GPU) is Outcome.DONE
    assert harness.stored() == {}
    assert harness.fabric.mapping("b1", 0) is None


def test_attach_errors_retry_then_fail_for_the_generation(harness: Harness) -> None:
    harness.fabric.inject_fault("map", box="b1", slot=0, count=10, message="mapping table full")
    harness.set_desired(want(GPU, host_slot=0, generation=4))

    assert harness.reconciler.reconcile(GPU) is Outcome.RETRY
    entry = harness.stored()[GPU.name]
    assert entry.phase == Phase.ATTACHMENT_PHASE_ATTACHING
    assert "attempt 1/3" in entry.message
    assert harness.reconciler.reconcile(GPU) is Outcome.RETRY
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    entry = harness.stored()[GPU.name]
    assert (entry.phase, entry.generation) == (Phase.ATTACHMENT_PHASE_FAILED, 4)
    assert "after 3 attempt(s)" in entry.message
    assert "mapping table full" in entry.message

    # FAILED is terminal for generation 4, even once the fault is gone ...
    harness.fabric.clear_faults()
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE
    assert harness.stored()[GPU.name].phase == Phase.ATTACHMENT_PHASE_FAILED
    assert harness.fabric.mappings(HOST) == {}

    # ... and a new generation tries again.
    harness.set_desired(want(GPU, host_slot=0, generation=5))
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE
    entry = harness.stored()[GPU.name]
    assert (entry.phase, entry.generation) == (Phase.ATTACHMENT_PHASE_ATTACHED, 5)


def test_failed_generation_stays_failed_across_a_restart(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=0, generation=2, expected_uuid="GPU-other"))
    harness.reconciler.reconcile(GPU)

    restarted = harness.restart()
    restarted.set_desired(want(GPU, host_slot=0, generation=2, expected_uuid="GPU-other"))

    assert restarted.reconciler.reconcile(GPU) is Outcome.DONE
    assert restarted.stored()[GPU.name].phase == Phase.ATTACHMENT_PHASE_FAILED
    assert restarted.fabric.mappings(HOST) == {}


def test_identity_mismatch_fails_at_once_and_leaves_nothing_mapped(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=0, model="A100"))

    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    entry = harness.stored()[GPU.name]
    assert entry.phase == Phase.ATTACHMENT_PHASE_FAILED
    assert "after 1 attempt(s)" in entry.message
    assert "expected 'A100'" in entry.message
    assert entry.identity_mismatch
    assert harness.fabric.mappings(HOST) == {}


def test_slot_still_held_by_an_undesired_gpu_waits_for_its_detach(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=2))
    harness.reconciler.reconcile(GPU)
    harness.set_desired(want(OTHER_GPU, host_slot=2))  # slot 2 goes to another GPU

    assert harness.reconciler.reconcile(OTHER_GPU) is Outcome.RETRY
    entry = harness.stored()[OTHER_GPU.name]
    assert entry.phase == Phase.ATTACHMENT_PHASE_ATTACHING
    assert "freed by boxes/b1/gpus/0" in entry.message

    assert harness.reconciler.reconcile(GPU) is Outcome.DONE  # detaches the old one
    assert harness.reconciler.reconcile(OTHER_GPU) is Outcome.DONE
    assert harness.fabric.mappings(HOST) == {2: ("b1", 1)}
    assert set(harness.stored()) == {OTHER_GPU.name}


def test_a_slot_given_to_two_gpus_fails_the_second(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=0), want(OTHER_GPU, host_slot=0))
    harness.reconciler.reconcile(GPU)

    assert harness.reconciler.reconcile(OTHER_GPU) is Outcome.DONE

    entry = harness.stored()[OTHER_GPU.name]
    assert entry.phase == Phase.ATTACHMENT_PHASE_FAILED
    assert "assigned to both" in entry.message


def test_gpu_at_another_slot_is_detached_and_attached_again(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=0))
    harness.reconciler.reconcile(GPU)

    harness.set_desired(want(GPU, host_slot=3, generation=2))
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    assert harness.fabric.mappings(HOST) == {3: ("b1", 0)}
    entry = harness.stored()[GPU.name]
    assert (entry.host_slot, entry.bdf) == (3, "0000:44:00.0")


def test_binding_change_to_vfio_reattaches_and_keeps_identity(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=0))
    harness.reconciler.reconcile(GPU)
    uuid = harness.stored()[GPU.name].uuid

    harness.set_desired(want(GPU, host_slot=0, generation=2, vfio=True))
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    assert [d.driver for d in harness.fabric.devices(HOST)] == ["vfio-pci"]
    entry = harness.stored()[GPU.name]
    assert (entry.phase, entry.uuid) == (Phase.ATTACHMENT_PHASE_ATTACHED, uuid)


def test_vfio_gpu_after_a_restart_keeps_its_reported_identity(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=0, vfio=True))
    harness.reconciler.reconcile(GPU)
    before = harness.stored()[GPU.name]

    restarted = harness.restart()
    restarted.set_desired(want(GPU, host_slot=0, generation=2, vfio=True))
    assert restarted.reconciler.reconcile(GPU) is Outcome.DONE

    after = restarted.stored()[GPU.name]
    assert after.generation == 2
    assert (after.uuid, after.serial, after.bdf) == (before.uuid, before.serial, before.bdf)
    assert [d.driver for d in restarted.fabric.devices(HOST)] == ["vfio-pci"]


def test_partial_attach_left_by_a_crash_is_completed(harness: Harness) -> None:
    harness.fabric.map("b1", 0, HOST, 1)  # a crash between map and rescan
    harness.set_desired(want(GPU, host_slot=1))

    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    assert harness.stored()[GPU.name].phase == Phase.ATTACHMENT_PHASE_ATTACHED
    assert harness.fabric.mappings(HOST) == {1: ("b1", 0)}


def test_stale_entry_of_a_gpu_neither_desired_nor_attached_is_removed(harness: Harness) -> None:
    harness.status.put(
        resources_pb2.ObservedAttachment(
            gpu=GPU.name, generation=1, phase=Phase.ATTACHMENT_PHASE_ATTACHING
        )
    )

    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    assert harness.stored() == {}


def test_health_changes_reach_the_status(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=0))
    harness.reconciler.reconcile(GPU)
    harness.fabric.set_health("b1", 0, healthy=False)

    harness.reconciler.reconcile(GPU)

    assert harness.stored()[GPU.name].health == resources_pb2.GPU_HEALTH_UNHEALTHY
    assert harness.stored()[GPU.name].health_reason == "marked unhealthy in the simulated fabric"


def test_a_busy_gpu_is_drained_then_detached_after_the_drain_timeout(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    key_prefix: str,
    open_link: Callable[..., BrokerLink],
) -> None:
    host = LinuxHost(tmp_path / "host", host=HOST)
    client = connect(etcd_server.endpoint)
    keys = KeySchema(key_prefix)
    status = StatusStore(open_link(), HOST)
    desired = DesiredState(HOST)
    now = [0.0]
    reconciler = Reconciler(
        driver=host.driver(),
        desired=desired,
        status=status,
        attach_attempts=1,
        detach_attempts=2,
        drain_timeout_s=60,
        clock=lambda: now[0],
    )

    def set_desired(*attachments: resources_pb2.DesiredAttachment) -> None:
        allocation = resources_pb2.HostAllocation(host=f"hosts/{HOST}", attachments=attachments)
        response = client.put(keys.host_allocation(HOST), allocation.SerializeToString())
        revision = int(response.header.revision)
        desired.replace(allocation, revision, revision)

    def stored() -> dict[str, resources_pb2.ObservedAttachment]:
        value, _ = client.get(keys.host_status(HOST))
        record = resources_pb2.HostStatus.FromString(value or b"")
        return {entry.gpu: entry for entry in record.attachments}

    try:
        set_desired(want(GPU, host_slot=0))
        assert reconciler.reconcile(GPU) is Outcome.DONE
        gpu = host.nvml.nvmlDeviceGetHandleByPciBusId(device_for(0))
        gpu.processes = [SimpleNamespace(pid=4242)]
        set_desired()

        for _ in range(3):  # more refusals than detach_attempts: draining is not failing
            assert reconciler.reconcile(GPU) is Outcome.RETRY
        entry = stored()[GPU.name]
        assert entry.phase == Phase.ATTACHMENT_PHASE_DETACHING
        assert "pids 4242" in entry.message and "detaching anyway in 60s" in entry.message
        assert host.mapped() == {0: GPU}

        now[0] = 61.0
        assert reconciler.reconcile(GPU) is Outcome.DONE
        assert stored() == {}
        assert host.mapped() == {}
        assert not host.kernel.present(device_for(0))
    finally:
        client.close()
        host.close()


def test_a_released_gpu_is_scrubbed_detached_and_reported_released(harness: Harness) -> None:
    harness.set_desired(want(GPU, host_slot=0))
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE
    harness.set_desired(want(GPU, host_slot=0, release=True))

    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    entry = harness.stored()[GPU.name]
    assert (entry.phase, entry.scrubbed, entry.generation) == (
        Phase.ATTACHMENT_PHASE_RELEASED,
        True,
        1,
    )
    assert harness.fabric.mappings(HOST) == {}
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE  # reported: nothing more
    harness.set_desired()  # the broker recorded it
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE
    assert harness.stored() == {}


def test_an_agent_restarted_after_the_scrub_does_not_scrub_again(harness: Harness) -> None:
    """The scrub is recorded in the entry before the detach: a crash between them is
    resumed with the detach, and the GPU still counts as scrubbed."""
    harness.set_desired(want(GPU, host_slot=0))
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE
    harness.set_desired(want(GPU, host_slot=0, release=True))
    harness.fabric.inject_fault("unmap", box="b1", slot=0, message="proxy busy")
    assert harness.reconciler.reconcile(GPU) is Outcome.RETRY  # scrubbed, detach failed
    assert harness.stored()[GPU.name].scrubbed

    restarted = harness.restart()
    restarted.set_desired(want(GPU, host_slot=0, release=True))
    harness.fabric.inject_fault("reset", box="b1", slot=0, message="a second reset")
    assert restarted.reconciler.reconcile(GPU) is Outcome.DONE

    entry = restarted.stored()[GPU.name]
    assert entry.phase == Phase.ATTACHMENT_PHASE_RELEASED and entry.scrubbed


def test_a_gpu_that_was_attached_and_vanished_unscrubbed_fails_its_release(
    harness: Harness,
) -> None:
    harness.set_desired(want(GPU, host_slot=0))
    assert harness.reconciler.reconcile(GPU) is Outcome.DONE
    harness.fabric.unmap("b1", 0, HOST)  # gone from under the agent, never scrubbed
    harness.set_desired(want(GPU, host_slot=0, release=True))

    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    entry = harness.stored()[GPU.name]
    assert entry.phase == Phase.ATTACHMENT_PHASE_SCRUB_FAILED
    assert "before it could be scrubbed" in entry.message


def test_a_gpu_released_before_it_reached_the_host_is_released_without_a_scrub(
    harness: Harness,
) -> None:
    harness.set_desired(want(GPU, host_slot=0, release=True))

    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    entry = harness.stored()[GPU.name]
    assert (entry.phase, entry.scrubbed) == (Phase.ATTACHMENT_PHASE_RELEASED, False)
    assert entry.message == "never attached here"


def test_a_busy_released_gpu_is_drained_then_reset_through_sysfs_and_detached(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    key_prefix: str,
    open_link: Callable[..., BrokerLink],
) -> None:
    host = LinuxHost(tmp_path / "host", host=HOST)
    client = connect(etcd_server.endpoint)
    keys = KeySchema(key_prefix)
    status = StatusStore(open_link(), HOST)
    desired = DesiredState(HOST)
    now = [0.0]
    reconciler = Reconciler(
        driver=host.driver(),
        desired=desired,
        status=status,
        attach_attempts=1,
        detach_attempts=2,
        drain_timeout_s=60,
        clock=lambda: now[0],
    )

    def set_desired(*attachments: resources_pb2.DesiredAttachment) -> None:
        allocation = resources_pb2.HostAllocation(host=f"hosts/{HOST}", attachments=attachments)
        response = client.put(keys.host_allocation(HOST), allocation.SerializeToString())
        revision = int(response.header.revision)
        desired.replace(allocation, revision, revision)

    def stored() -> dict[str, resources_pb2.ObservedAttachment]:
        value, _ = client.get(keys.host_status(HOST))
        record = resources_pb2.HostStatus.FromString(value or b"")
        return {entry.gpu: entry for entry in record.attachments}

    try:
        set_desired(want(GPU, host_slot=0))
        assert reconciler.reconcile(GPU) is Outcome.DONE
        gpu = host.nvml.nvmlDeviceGetHandleByPciBusId(device_for(0))
        gpu.processes = [SimpleNamespace(pid=4242)]
        set_desired(want(GPU, host_slot=0, release=True))

        for _ in range(3):  # more refusals than detach_attempts: draining is not failing
            assert reconciler.reconcile(GPU) is Outcome.RETRY
        entry = stored()[GPU.name]
        assert entry.phase == Phase.ATTACHMENT_PHASE_DETACHING
        assert "pids 4242" in entry.message and "scrubbing anyway in 60s" in entry.message
        assert host.kernel.resets == []

        now[0] = 61.0
        assert reconciler.reconcile(GPU) is Outcome.DONE
        assert host.kernel.resets == [device_for(0)]
        entry = stored()[GPU.name]
        assert (entry.phase, entry.scrubbed) == (Phase.ATTACHMENT_PHASE_RELEASED, True)
        assert host.mapped() == {}
    finally:
        client.close()
        host.close()


def test_a_gpu_mapped_but_never_up_is_unmapped_and_released_without_a_scrub(
    harness: Harness,
) -> None:
    harness.fabric.map("b1", 0, HOST, 0, generation=1)  # a partial attach: no rescan yet
    harness.set_desired(want(GPU, host_slot=0, release=True))

    assert harness.reconciler.reconcile(GPU) is Outcome.DONE

    entry = harness.stored()[GPU.name]
    assert (entry.phase, entry.scrubbed) == (Phase.ATTACHMENT_PHASE_RELEASED, False)
    assert harness.fabric.mappings(HOST) == {}
