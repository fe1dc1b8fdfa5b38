"""The Linux driver as a whole: StepDriver over SysfsPciBus (fake kernel), the command-hook
mapper (a real hook) and NvmlInspector (fake pynvml)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from dxpool.api.v1 import resources_pb2
from dxpool.errors import FailedPrecondition, InvalidArgument
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.driver import AttachRequest
from dxpool.hostagent.drivers import build_driver
from dxpool.hostagent.drivers.command_hook import CommandHookMapper
from dxpool.hostagent.drivers.linux import make_linux_driver
from dxpool.hostagent.errors import GpuBusyError, IdentityMismatchError
from dxpool.names import GpuRef
from tests.hostagent.fake_sysfs import FakeCard
from tests.hostagent.linux_host import LinuxHost, device_for, uuid_for

GPU = GpuRef("b1", 3)


@pytest.fixture
def linux_host(tmp_path: Path) -> Iterator[LinuxHost]:
    host = LinuxHost(tmp_path)
    yield host
    host.close()


def test_attach_maps_brings_up_identifies_and_detach_undoes_it(linux_host: LinuxHost) -> None:
    driver = linux_host.driver()

    attached = driver.attach(AttachRequest(GPU, host_slot=2, model="H100", pci_id="10de:2330"))

    assert linux_host.mapped() == {2: GPU}
    assert (attached.bdf, attached.driver) == (device_for(2), "nvidia")
    assert attached.identity is not None and attached.identity.uuid == uuid_for(GPU)
    assert attached.identity.pci_bus_id == device_for(2)
    assert attached.health == resources_pb2.GPU_HEALTH_HEALTHY
    assert driver.observe() == {GPU: attached}

    driver.detach(GPU)

    assert linux_host.mapped() == {}
    assert not linux_host.kernel.present(device_for(2))
    assert driver.observe() == {}


def test_a_vfio_gpu_keeps_its_identity_while_config_space_says_it_is_the_same(
    linux_host: LinuxHost,
) -> None:
    driver = linux_host.driver()

    attached = driver.attach(AttachRequest(GPU, host_slot=0, vfio=True))
    observed = driver.observe()[GPU]

    assert (attached.driver, observed.driver) == ("vfio-pci", "vfio-pci")
    assert observed.identity == attached.identity  # NVML cannot see it; config space can
    assert observed.health == resources_pb2.GPU_HEALTH_UNSPECIFIED
    # Another card now answers at that address (same place, other serial number):
    linux_host.kernel.path(f"bus/pci/devices/{device_for(0)}/config").write_bytes(
        bytes(0x100) + (0x10003).to_bytes(4, "little") + (7).to_bytes(8, "little")
    )
    assert driver.observe()[GPU].identity is None


def test_a_device_with_the_wrong_pci_id_is_rolled_back(linux_host: LinuxHost) -> None:
    linux_host.card_overrides[GPU] = FakeCard(device=0x20B0)
    driver = linux_host.driver()

    with pytest.raises(IdentityMismatchError, match="is PCI 10de:20b0, expected 10de:2330"):
        driver.attach(AttachRequest(GPU, host_slot=1, pci_id="10de:2330"))

    assert linux_host.mapped() == {}
    assert not linux_host.kernel.present(device_for(1))


def test_an_unhealthy_gpu_reports_why(linux_host: LinuxHost) -> None:
    driver = linux_host.driver()
    driver.attach(AttachRequest(GPU, host_slot=0))
    gpu = linux_host.nvml.nvmlDeviceGetHandleByPciBusId(device_for(0))
    gpu.volatile_uncorrected_ecc = 3

    observed = driver.observe()[GPU]

    assert observed.health == resources_pb2.GPU_HEALTH_UNHEALTHY
    assert observed.health_reason == "3 volatile uncorrected ECC errors"


def test_capabilities_come_from_sysfs(linux_host: LinuxHost) -> None:
    caps = linux_host.driver().capabilities

    assert (caps.hotplug, caps.vfio, caps.identity) == (True, True, True)
    assert (caps.slot_power, caps.surprise_removal, caps.p2p) == (False, False, False)


def test_a_hook_that_is_not_executable_stops_the_driver_at_start(linux_host: LinuxHost) -> None:
    os.chmod(linux_host.hook, 0o644)

    with pytest.raises(FailedPrecondition, match="not an executable file"):
        linux_host.driver()


def test_a_bridge_missing_from_the_host_stops_the_driver_at_start(linux_host: LinuxHost) -> None:
    with pytest.raises(
        FailedPrecondition, match=re.escape("0000:7f:01.0 of host slot 0 is not on")
    ):
        make_linux_driver(
            host_id="h1",
            ports={0: "0000:7f:01.0"},
            proxy_hook=linux_host.hook,
            sysfs=linux_host.kernel,
        )


def test_build_driver_makes_the_linux_driver_from_the_config(linux_host: LinuxHost) -> None:
    config = AgentConfig(
        host_id="h1",
        slot_capacity=4,
        driver="linux",
        linux_ports=linux_host.ports,
        proxy_hook=linux_host.hook,
        sysfs_root=linux_host.kernel.root,
        fabric_p2p=True,
    )

    driver = build_driver(config)

    assert driver.capabilities.p2p is True
    assert driver.observe() == {}


def test_build_driver_says_what_the_linux_driver_needs(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"--linux-port SLOT=BRIDGE"):
        build_driver(AgentConfig(host_id="h1", driver="linux"))
    ports = {0: "0000:40:01.0"}
    with pytest.raises(InvalidArgument, match=r"--proxy-hook PATH.*--redfish-map FILE"):
        build_driver(AgentConfig(host_id="h1", driver="linux", linux_ports=ports))
    with pytest.raises(InvalidArgument, match=r"exactly one way to map GPUs"):
        build_driver(
            AgentConfig(
                host_id="h1",
                driver="linux",
                linux_ports=ports,
                proxy_hook=tmp_path / "hook",
                redfish_map=tmp_path / "map.yaml",
            )
        )


def test_a_sysfs_root_without_a_pci_bus_is_refused(tmp_path: Path, linux_host: LinuxHost) -> None:
    config = AgentConfig(
        host_id="h1",
        driver="linux",
        linux_ports={0: "0000:40:01.0"},
        proxy_hook=linux_host.hook,
        sysfs_root=tmp_path / "empty",
    )

    with pytest.raises(FailedPrecondition, match="no PCI bus under"):
        build_driver(config)


def test_detach_refuses_a_gpu_running_compute_processes_unless_forced(
    linux_host: LinuxHost,
) -> None:
    driver = linux_host.driver()
    driver.attach(AttachRequest(GPU, host_slot=0))
    gpu = linux_host.nvml.nvmlDeviceGetHandleByPciBusId(device_for(0))
    gpu.processes = [SimpleNamespace(pid=4242), SimpleNamespace(pid=17)]

    with pytest.raises(
        GpuBusyError, match=r"runs 2 compute process\(es\) \(pids 17, 4242\)"
    ) as caught:
        driver.detach(GPU)

    assert caught.value.pids == (17, 4242)
    assert linux_host.mapped() == {0: GPU}  # nothing was touched
    assert linux_host.kernel.link_name(f"bus/pci/devices/{device_for(0)}/driver") == "nvidia"
    driver.detach(GPU, force=True)
    assert linux_host.mapped() == {}
    assert not linux_host.kernel.present(device_for(0))


def test_a_vfio_bound_gpu_is_detached_without_asking_nvml(linux_host: LinuxHost) -> None:
    driver = linux_host.driver()
    driver.attach(AttachRequest(GPU, host_slot=0, vfio=True))

    driver.detach(GPU)  # NVML cannot see it: the VM using it is the orchestrator's to stop

    assert linux_host.mapped() == {}


def test_an_attach_cut_off_after_the_map_is_completed_by_a_fresh_driver(
    linux_host: LinuxHost,
) -> None:
    # The agent died right after the hook mapped the GPU: nothing was rescanned.
    CommandHookMapper(linux_host.hook, "h1").map(GPU, 1, generation=4)
    driver = linux_host.driver()
    partial = driver.observe()[GPU]
    assert (partial.host_slot, partial.present) == (1, False)

    attached = driver.attach(AttachRequest(GPU, host_slot=1, generation=4))

    assert (attached.bdf, attached.driver) == (device_for(1), "nvidia")
    assert linux_host.mapped() == {1: GPU}


@pytest.mark.parametrize("cut_after", ["unbind", "remove"])
def test_a_detach_cut_off_midway_is_completed_by_a_fresh_driver(
    linux_host: LinuxHost, cut_after: str
) -> None:
    linux_host.driver().attach(AttachRequest(GPU, host_slot=2))
    bdf = device_for(2)
    linux_host.kernel.write("bus/pci/drivers/nvidia/unbind", bdf)
    if cut_after == "remove":
        linux_host.kernel.write(f"bus/pci/devices/{bdf}/remove", "1")
    driver = linux_host.driver()  # the agent restarted

    driver.detach(GPU)

    assert linux_host.mapped() == {}
    assert not linux_host.kernel.present(bdf)
    assert driver.observe() == {}


def test_concurrent_attaches_on_different_slots_share_the_bus(linux_host: LinuxHost) -> None:
    driver = linux_host.driver()
    gpus = [GpuRef("b1", slot) for slot in range(4)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        attached = list(
            pool.map(lambda i: driver.attach(AttachRequest(gpus[i], host_slot=i)), range(4))
        )

    assert [a.bdf for a in attached] == [device_for(i) for i in range(4)]
    assert [a.identity.uuid for a in attached if a.identity] == [uuid_for(g) for g in gpus]
    assert linux_host.mapped() == dict(enumerate(gpus))


def test_a_surprise_removed_gpu_is_seen_as_partial_and_brought_back(
    linux_host: LinuxHost,
) -> None:
    driver = linux_host.driver()
    request = AttachRequest(GPU, host_slot=0)
    driver.attach(request)
    linux_host.kernel.write(f"bus/pci/devices/{device_for(0)}/remove", "1")  # link flap

    assert driver.observe()[GPU].present is False
    assert driver.attach(request).bdf == device_for(0)
    assert driver.observe()[GPU].satisfies(request)
