"""StepDriver over the simulated fabric's seams: attach, detach, observe."""

from __future__ import annotations

import pytest

from dxpool.api.v1 import resources_pb2
from dxpool.fabric.sim import InjectedFault, SimFabric
from dxpool.hostagent.driver import (
    AttachedGpu,
    AttachRequest,
    DriverCapabilities,
    StepDriver,
    model_matches,
)
from dxpool.hostagent.drivers.sim import SimNvml, SimPciBus, SimProxyMapper, make_sim_driver
from dxpool.hostagent.errors import (
    AttachConflictError,
    DeviceTimeoutError,
    DriverError,
    IdentityMismatchError,
    ScrubError,
)
from dxpool.names import GpuRef

from .conftest import HOST

GPU = GpuRef("b1", 0)
OTHER_GPU = GpuRef("b1", 1)


def test_attach_maps_rescans_identifies_and_reports(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    attached = sim_driver.attach(AttachRequest(GPU, host_slot=1, model="H100"))

    assert sim_fabric.mappings(HOST) == {1: ("b1", 0)}
    [device] = sim_fabric.devices(HOST)
    assert attached.bdf == device.bdf == "0000:42:00.0"
    assert attached.driver == device.driver == "nvidia"
    assert attached.identity is not None
    assert attached.identity.uuid == sim_fabric.identity(HOST, device.bdf).uuid
    assert attached.identity.model == "H100"
    assert attached.identity.memory_mib == 81920
    assert attached.health == resources_pb2.GPU_HEALTH_HEALTHY
    assert sim_driver.observe() == {GPU: attached}


def test_attach_when_attached_as_asked_touches_no_hardware(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    request = AttachRequest(GPU, host_slot=0)
    first = sim_driver.attach(request)
    sim_fabric.inject_fault("map", box="b1", slot=0)

    assert sim_driver.attach(request) == first
    # The fault is still pending: the second attach did not program the proxy.
    with pytest.raises(InjectedFault):
        sim_fabric.map("b1", 0, HOST, 0)


def test_attach_completes_a_partial_attach(sim_fabric: SimFabric, sim_driver: StepDriver) -> None:
    sim_fabric.map("b1", 0, HOST, 2)  # mapped, but the bus was never rescanned
    partial = sim_driver.observe()[GPU]
    assert partial.host_slot == 2
    assert not partial.present

    attached = sim_driver.attach(AttachRequest(GPU, host_slot=2))

    assert attached.present
    assert sim_fabric.mappings(HOST) == {2: ("b1", 0)}


def test_attach_at_another_slot_is_a_conflict(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    sim_driver.attach(AttachRequest(GPU, host_slot=1))

    with pytest.raises(AttachConflictError, match="host slot 1, not 3"):
        sim_driver.attach(AttachRequest(GPU, host_slot=3))
    assert sim_fabric.mappings(HOST) == {1: ("b1", 0)}


def test_attach_into_a_slot_holding_another_gpu_is_a_retryable_conflict(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    sim_driver.attach(AttachRequest(GPU, host_slot=1))

    with pytest.raises(AttachConflictError) as caught:
        sim_driver.attach(AttachRequest(OTHER_GPU, host_slot=1))
    assert caught.value.retryable
    assert sim_fabric.mappings(HOST) == {1: ("b1", 0)}


def test_uuid_mismatch_rolls_the_attach_back(sim_fabric: SimFabric, sim_driver: StepDriver) -> None:
    with pytest.raises(IdentityMismatchError, match="expected GPU-not-this-one") as caught:
        sim_driver.attach(AttachRequest(GPU, host_slot=0, expected_uuid="GPU-not-this-one"))

    assert not caught.value.retryable
    assert sim_fabric.mappings(HOST) == {}
    assert sim_fabric.devices(HOST) == []


def test_model_mismatch_rolls_the_attach_back(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    with pytest.raises(IdentityMismatchError, match="reports model 'H100', expected 'A100'"):
        sim_driver.attach(AttachRequest(GPU, host_slot=0, model="A100"))

    assert sim_fabric.mappings(HOST) == {}


def test_expected_uuid_that_matches_is_accepted(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    first = sim_driver.attach(AttachRequest(GPU, host_slot=0))
    sim_driver.detach(GPU)
    assert first.identity is not None

    again = sim_driver.attach(AttachRequest(GPU, host_slot=0, expected_uuid=first.identity.uuid))

    assert again.identity == first.identity


@pytest.mark.parametrize(
    ("wanted", "reported", "matches"),
    [
        ("H100", "H100", True),
        ("h100", "NVIDIA H100 80GB HBM3", True),
        ("A100", "NVIDIA A100-SXM4-40GB", False),
        ("H100", "NVIDIA H1000", False),
    ],
)
def test_model_matches_nvml_device_names(wanted: str, reported: str, matches: bool) -> None:
    assert model_matches(wanted, reported) is matches


def test_vfio_attach_identifies_before_binding(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    attached = sim_driver.attach(AttachRequest(GPU, host_slot=0, vfio=True, model="H100"))

    [device] = sim_fabric.devices(HOST)
    assert device.driver == "vfio-pci"
    assert attached.driver == "vfio-pci"
    assert attached.identity is not None
    # NVML cannot see the device any more; the driver remembers what it read before binding.
    observed = sim_driver.observe()[GPU]
    assert observed.identity == attached.identity
    assert observed.health == resources_pb2.GPU_HEALTH_UNSPECIFIED


def test_vfio_gpu_seen_by_a_fresh_driver_is_attached_as_asked_without_identity(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    request = AttachRequest(GPU, host_slot=0, vfio=True)
    sim_driver.attach(request)
    restarted = make_sim_driver(sim_fabric, HOST)

    observed = restarted.observe()[GPU]

    assert observed.identity is None
    assert observed.satisfies(request)
    assert restarted.attach(request) == observed
    assert sim_fabric.devices(HOST)[0].driver == "vfio-pci"


def test_attach_rebinds_a_vfio_device_to_the_native_driver(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    sim_driver.attach(AttachRequest(GPU, host_slot=0, vfio=True))

    attached = sim_driver.attach(AttachRequest(GPU, host_slot=0))

    assert attached.driver == "nvidia"
    assert sim_fabric.devices(HOST)[0].driver == "nvidia"


def test_detach_unbinds_removes_and_unmaps(sim_fabric: SimFabric, sim_driver: StepDriver) -> None:
    sim_driver.attach(AttachRequest(GPU, host_slot=0, vfio=True))
    sim_driver.attach(AttachRequest(OTHER_GPU, host_slot=1))

    sim_driver.detach(GPU)

    assert sim_fabric.mappings(HOST) == {1: ("b1", 1)}
    assert [d.host_slot for d in sim_fabric.devices(HOST)] == [1]
    assert set(sim_driver.observe()) == {OTHER_GPU}


def test_detach_is_idempotent(sim_fabric: SimFabric, sim_driver: StepDriver) -> None:
    sim_driver.detach(GPU)  # never attached: a no-op
    sim_driver.attach(AttachRequest(GPU, host_slot=0))
    sim_driver.detach(GPU)
    sim_driver.detach(GPU)

    assert sim_fabric.mappings(HOST) == {}
    assert sim_fabric.devices(HOST) == []


def test_detach_completes_a_partial_attach(sim_fabric: SimFabric, sim_driver: StepDriver) -> None:
    sim_fabric.map("b1", 0, HOST, 3)

    sim_driver.detach(GPU)

    assert sim_fabric.mapping("b1", 0) is None


def test_detach_never_touches_another_hosts_mapping(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    sim_fabric.add_host("h2", 2)
    sim_fabric.map("b1", 0, "h2", 0)

    sim_driver.detach(GPU)

    assert sim_fabric.mapping("b1", 0) == ("h2", 0)


def test_proxy_fence_revokes_every_mapping_of_the_named_host_only(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    sim_fabric.add_host("h2", 2)
    sim_driver.attach(AttachRequest(gpu=GpuRef("b1", 0), host_slot=0, generation=1))
    sim_driver.attach(AttachRequest(gpu=GpuRef("b2", 1), host_slot=3, generation=1))
    sim_fabric.map("b1", 2, "h2", 0, generation=1)
    fencer = SimProxyMapper(sim_fabric, "h2")  # any host's mapper can fence another host

    assert sorted(fencer.fence(HOST)) == [GpuRef("b1", 0), GpuRef("b2", 1)]

    assert sim_driver.observe() == {}
    assert SimProxyMapper(sim_fabric, HOST).mappings() == {}
    assert fencer.mappings() == {0: GpuRef("b1", 2)}
    assert fencer.fence(HOST) == []
    with pytest.raises(DriverError) as raised:  # the fenced host's agent cannot map again
        sim_driver.attach(AttachRequest(gpu=GpuRef("b1", 0), host_slot=0, generation=1))
    assert not raised.value.retryable


def test_observe_reads_the_hardware_not_memory(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    sim_driver.attach(AttachRequest(GPU, host_slot=0))
    sim_fabric.set_health("b1", 0, healthy=False)
    assert sim_driver.observe()[GPU].health == resources_pb2.GPU_HEALTH_UNHEALTHY

    sim_fabric.revoke("b1", 0)  # fenced from the box side, behind the driver's back

    assert sim_driver.observe() == {}


def test_fabric_faults_are_retryable_and_unknown_targets_are_not(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    sim_fabric.inject_fault("map", box="b1", slot=0, message="proxy table busy")
    with pytest.raises(DriverError, match="proxy table busy") as fault:
        sim_driver.attach(AttachRequest(GPU, host_slot=0))
    assert fault.value.retryable

    with pytest.raises(DriverError, match="unknown box 'b9'") as unknown:
        sim_driver.attach(AttachRequest(GpuRef("b9", 0), host_slot=0))
    assert not unknown.value.retryable


class _DeadBus(SimPciBus):
    """A bus whose rescans never find anything (a link that does not train)."""

    def rescan(self) -> None:
        return None


def test_a_device_that_never_appears_times_out(sim_fabric: SimFabric) -> None:
    driver = StepDriver(
        proxy=SimProxyMapper(sim_fabric, HOST),
        bus=_DeadBus(sim_fabric, HOST),
        inspector=SimNvml(sim_fabric, HOST),
        capabilities=make_sim_driver(sim_fabric, HOST).capabilities,
        device_timeout_s=0.1,
    )

    with pytest.raises(DeviceTimeoutError, match="host slot 2") as caught:
        driver.attach(AttachRequest(GPU, host_slot=2))
    assert caught.value.retryable


def test_vfio_request_on_a_driver_without_vfio_fails_at_once(sim_fabric: SimFabric) -> None:
    driver = StepDriver(
        proxy=SimProxyMapper(sim_fabric, HOST),
        bus=SimPciBus(sim_fabric, HOST),
        inspector=SimNvml(sim_fabric, HOST),
        capabilities=DriverCapabilities(
            hotplug=True, surprise_removal=False, vfio=False, p2p=False, identity=True
        ),
    )

    with pytest.raises(DriverError, match="vfio-pci") as caught:
        driver.attach(AttachRequest(GPU, host_slot=0, vfio=True))
    assert not caught.value.retryable
    assert sim_fabric.mappings(HOST) == {}


def test_sim_driver_declares_its_capabilities(sim_driver: StepDriver) -> None:
    capabilities = sim_driver.capabilities
    assert capabilities.hotplug
    assert capabilities.vfio
    assert capabilities.identity


def test_attach_request_rejects_a_negative_host_slot() -> None:
    with pytest.raises(ValueError, match="host_slot"):
        AttachRequest(GPU, host_slot=-1)


def test_scrub_resets_the_unbound_device_and_leaves_it_bound_to_nvidia(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    sim_driver.attach(AttachRequest(GPU, host_slot=0, vfio=False))
    sim_fabric.inject_fault("reset", box="b1", slot=0, message="first reset fails")

    with pytest.raises(DriverError, match="first reset fails"):
        sim_driver.scrub(GPU)
    sim_driver.scrub(GPU)  # safe to call again

    [device] = sim_fabric.devices(HOST)
    assert device.driver == "nvidia"
    assert sim_fabric.mappings(HOST) == {0: ("b1", 0)}


def test_scrub_of_a_gpu_unhealthy_after_its_reset_is_a_scrub_error(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    sim_driver.attach(AttachRequest(GPU, host_slot=0))
    sim_fabric.set_health("b1", 0, healthy=False)

    with pytest.raises(ScrubError, match="unhealthy after a reset") as caught:
        sim_driver.scrub(GPU)
    assert not caught.value.retryable


def test_scrub_of_a_gpu_not_mapped_here_is_a_driver_error(sim_driver: StepDriver) -> None:
    with pytest.raises(DriverError, match="not mapped to this host"):
        sim_driver.scrub(GPU)


def test_attach_of_a_gpu_with_another_serial_is_refused_and_rolled_back(
    sim_fabric: SimFabric, sim_driver: StepDriver
) -> None:
    request = AttachRequest(GPU, host_slot=0, expected_serial="1650000000001")

    with pytest.raises(IdentityMismatchError, match="expected 1650000000001") as caught:
        sim_driver.attach(request)

    assert not caught.value.retryable
    assert sim_fabric.mappings(HOST) == {}


def test_the_recorded_serial_is_accepted(sim_driver: StepDriver) -> None:
    from dxpool.fabric._sim_types import gpu_serial

    request = AttachRequest(GPU, host_slot=0, expected_serial=gpu_serial("b1", 0))
    assert request.expected_device.dsn == ""  # a board serial is NVML's to check

    attached = sim_driver.attach(request)

    assert attached.identity is not None and attached.identity.serial == gpu_serial("b1", 0)


def test_a_serial_in_device_serial_number_form_goes_to_the_bus() -> None:
    request = AttachRequest(GPU, host_slot=0, expected_serial="01-23-45-67-89-ab-cd-ef")

    assert request.expected_device.dsn == "01-23-45-67-89-ab-cd-ef"


def test_an_attachment_on_another_native_driver_satisfies_its_requests() -> None:
    """A host whose GPUs run on another kernel driver than nvidia (the stand-in cards of
    the real-kernel tests) is attached as asked once bound to that driver, or vfio-pci."""
    native = AttachedGpu(GPU, 0, bdf="0000:01:00.0", driver="e1000e", native_driver="e1000e")
    passed = AttachedGpu(GPU, 0, bdf="0000:01:00.0", driver="vfio-pci", native_driver="e1000e")

    assert native.satisfies(AttachRequest(GPU, host_slot=0))
    assert not native.satisfies(AttachRequest(GPU, host_slot=0, vfio=True))
    assert passed.satisfies(AttachRequest(GPU, host_slot=0, vfio=True))
    assert not AttachedGpu(GPU, 0, bdf="0000:01:00.0", driver="e1000e").satisfies(
        AttachRequest(GPU, host_slot=0)
    )
